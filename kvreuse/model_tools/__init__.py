"""The commands that make or train model folders, apart from the engine: ``kvreuse make-model``
(``make_model.py``: real-shaped random-weight folders with a real tokenizer, and GGUF files of them),
``make_draft.py`` (a random EAGLE draft head) and ``kvreuse distill-eagle`` (``distill.py``: a trained one).
"""
