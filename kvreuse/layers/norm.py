"""RMSNorm, and Gemma's (1 + weight) variant; the fused C++ kernel (kernels/fused_ops.py) where it applies.
"""

from __future__ import annotations

import torch
from torch import nn

from kvreuse.kernels import fused_ops
from kvreuse.layers.linear import _empty_parameter


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (Qwen3.5's too): x normalised and scaled by (1 + weight), both in float32, rounded once to x's
    dtype (Llama's rounds the normalised x first). A zero weight is the identity scale, which is how Gemma
    checkpoints store it."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_parameter((size,), dtype, device)
        self._scale: torch.Tensor | None = None  # 1 + weight in float32, made once (remade if the weight changes)
        self._scale_of: tuple[int, int] = (0, -1)

    def scale(self) -> torch.Tensor:
        key = (id(self.weight), self.weight._version)
        if self._scale is None or key != self._scale_of:
            self._scale = (1.0 + self.weight.detach().float()).contiguous()
            self._scale_of = key
        return self._scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # The fused kernel where it applies: one call instead of six ops, the same arithmetic (one rounding), its sum
        # in a row's own order. Taken whatever the row count and layout (a view of q or k heads is copied), so a row's
        # bits never depend on the step: a PyTorch sum in some steps and the kernel's in others would differ.
        if fused_ops.applies(x) and (residual is None or (x.is_contiguous() and residual.is_contiguous()
                                                          and residual.dtype == x.dtype)):
            return fused_ops.rms_norm_float_scale(x.contiguous(), self.scale(), self.eps, residual)
        return fused_ops.reference_rms_norm_float_scale(x, self.scale(), self.eps, residual)


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
