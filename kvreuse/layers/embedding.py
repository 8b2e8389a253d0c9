"""The token embedding held quantized (a GGUF file's table): rows dequantized as they are looked up.
"""

from __future__ import annotations

import torch
from torch import nn

from kvreuse.kernels import quant_ops
from kvreuse.kernels.quant import QuantizedTensor


class QuantizedEmbedding(nn.Module):
    """An embedding table held quantized: looked-up rows are dequantized (kernels/quant_ops.py's kernel), in ``dtype``;
    a tied output projection reads the same quantized table (``quantized``)."""

    def __init__(self, table: QuantizedTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.quantized = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = quant_ops.dequantize_rows(self.quantized, ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The table dequantized (float memory: for the rare reader of the whole matrix, not the forward)."""
        return quant_ops.dequantize(self.quantized).to(self.dtype)
