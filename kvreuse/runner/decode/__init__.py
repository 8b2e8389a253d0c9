"""The decode paths beside the Python layers (the reference, which every path equals): the native CPU step
(``native_step.py``: a decode step's layers in one C++ call) and CUDA graphs (``cuda_graphs.py``), with the
one function that picks a path for a step (``paths.py``).
"""
