"""The RoPE scalings a config may name (Llama 3, linear, YaRN), as the rotary layer takes them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style frequency-dependent rope scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (``rope_type: linear``): every frequency divided by ``factor``."""

    factor: float


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (``rope_type: yarn``), as transformers' ``_compute_yarn_parameters`` reads it: frequencies whose
    wavelength fits ``original_max_position_embeddings`` fewer than ``beta_slow`` times are divided by
    ``factor``, those that fit it more than ``beta_fast`` times kept, a linear ramp between (over dimension
    indices, floored / ceiled where ``truncate``); cos and sin are then multiplied by ``attention_factor``."""

    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int
    truncate: bool
    attention_factor: float  # resolved: the config's, else from mscale / mscale_all_dim, else 0.1 ln(factor) + 1

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"yarn rope_scaling factor must be positive, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"yarn rope_scaling original_max_position_embeddings must be positive, got "
                             f"{self.original_max_position_embeddings}")
        if self.attention_factor <= 0:
            raise ValueError(f"yarn rope_scaling attention_factor must be positive, got {self.attention_factor}")


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling
