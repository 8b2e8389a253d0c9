"""Rotary position embeddings: the inverse frequencies of every scaling kvreuse reads (Llama 3, linear, YaRN:
layers/rope_scaling.py), the cos/sin tables, and their application (fused on CPU where built).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvreuse.kernels import fused_ops
from kvreuse.layers.rope_scaling import LinearRopeScaling, RopeScaling, YarnRopeScaling


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, optionally with Llama 3, linear or YaRN scaling (YaRN's
    attention factor is applied to cos / sin by RotaryEmbedding, as transformers does)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inverse_frequencies(head_dim, theta, scaling, exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between
    # them interpolated smoothly.
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: YarnRopeScaling,
                              exponents: torch.Tensor) -> torch.Tensor:
    """transformers' _compute_yarn_parameters, op for op (so float32 tables match bit for bit): each dimension
    pair blends the interpolated frequency (divided by factor) and the original one, by a ramp over the pair
    index between the dimensions where beta_fast and beta_slow rotations fit the original context."""
    pos_freqs = theta ** exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = (1 - ramp).to(device=exponents.device)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a cos/sin table precomputed on the device.

    ``cos_sin(positions, dtype)`` is called once per forward and the result shared by every layer.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: RopeScaling | None,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, device)
        positions = torch.arange(max_position, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2], float32
        cos, sin = freqs.cos(), freqs.sin()
        # What the tables' cos and sin are multiplied by (YaRN's attention factor, else 1): a rotation by a
        # position delta (attention/rope_shift.py) divides it out, since the rows it turns carry it already.
        self.attention_factor = scaling.attention_factor if isinstance(scaling, YarnRopeScaling) else 1.0
        if isinstance(scaling, YarnRopeScaling):
            # YaRN scales the attention logits by attention_factor**2 through q and k: transformers multiplies
            # cos and sin in float32 before rounding them to the activations' dtype, and so do these tables
            # (every reader of them, the fused kernels included, gets the factor).
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim // 2] for the given absolute positions, in ``dtype``."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by position (rotate-half layout, as in HF checkpoints)."""
    return fused_ops.reference_rotary(x, cos, sin)
