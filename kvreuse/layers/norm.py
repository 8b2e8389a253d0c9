"""RMSNorm, and Gemma's (1 + weight) variant; the fused C++ kernel (kernels/fused_ops.py) where it applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.kernels import fused_ops
from kvreuse.layers.linear import _empty_parameter


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x normalised and scaled by (1 + weight), both in float32, rounded once to x's dtype
    (Llama's rounds the normalised x first). A zero weight is the identity scale, which is how Gemma
    checkpoints store it."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_parameter((size,), dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            x.add_(residual)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return normed.mul_(1.0 + self.weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_parameter((size,), dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x) * weight; with ``residual``, x += residual first (in place: x is the residual stream)."""
        if (x.is_contiguous() and fused_ops.applies(x)
                and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype))):
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        return fused_ops.reference_rms_norm(x, self.weight, self.eps, residual)
