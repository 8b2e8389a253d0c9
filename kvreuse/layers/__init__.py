"""The blocks every architecture composes, each choosing its kernel: linear layers over float weights
(``linear.py``) and quantized ones (``quantized_linear.py``), with the plan book that measures which kernel
runs each row count on this CPU (``plan_book.py``); norms, rotary embeddings and their scalings, the gated
MLP, the quantized embedding, and the mixture-of-experts layer (``experts.py``).
"""
