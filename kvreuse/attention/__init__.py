"""Attention below the model code: the step's metadata (``ForwardBatch``), the backend interface the
model calls (``AttentionBackend``) and the pure-PyTorch paged implementation (``TorchPagedAttention``)."""
