"""Mamba-2's selective scan, token by token (csrc/mamba2_scan.cpp): built for this CPU on first use, loaded as
``torch.ops.kvreuse_mamba2``, built and cached like the other kernels (kernels/build.py); where the build fails,
``available`` says so once in the log and layers/mamba2.py runs its PyTorch reference instead."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from kvreuse.kernels.build import build_name as _build_name
from kvreuse.kernels.build import load_extension

SOURCE = Path(__file__).with_name("csrc") / "mamba2_scan.cpp"


def build_name() -> str:
    return _build_name(SOURCE, "kvreuse_mamba2_scan")


def available() -> bool:
    return library() is not None


@functools.cache
def library() -> Path | None:
    return load_extension(SOURCE, build_name(), "Mamba-2's selective scan", "Mamba-2 layers run the PyTorch reference")


def selective_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor, d: torch.Tensor, states: torch.Tensor, layer: int, slots: Sequence[int],
                   starts: Sequence[int], lens: Sequence[int], dt_limit: tuple[float, float] = (0.0, math.inf)
                   ) -> torch.Tensor:
    """x [T, H, P], dt [T, H] (before dt_bias and softplus), B, C [T, G, N], all float32; A_log, dt_bias, D [H];
    ``states`` [slots, layers, H, P, N] float32, layer ``layer`` of each sequence's slot updated in place. Returns
    y [T, H, P] (D's skip included). ``available()`` must be True."""
    return torch.ops.kvreuse_mamba2.selective_scan(x, dt, b, c, a_log.float().contiguous(), dt_bias.float().contiguous(),
                                                   d.float().contiguous(), states, layer, list(slots), list(starts),
                                                   list(lens), float(dt_limit[0]), float(dt_limit[1]))


def mixer(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
          conv_bias: torch.Tensor | None, conv_states: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
          d: torch.Tensor, norm_weight: torch.Tensor, states: torch.Tensor, layer: int, slots: Sequence[int],
          starts: Sequence[int], lens: Sequence[int], heads: int, groups: int, eps: float,
          dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """The Mamba-2 mixer between its projections for every row of a step (csrc/mamba2_scan.cpp ``mixer``): xbc
    [T, C], z [T, inner], dt [T, H] float32; the convolution's weight [C, 1, K] (and bias [C]), its inputs kept in
    ``conv_states`` [slots, layers, K - 1, C]; A_log, dt_bias, D [H]; the grouped norm's weight [inner] over ``groups``
    groups; ``states`` [slots, layers, H, P, N]. Returns the normed, gated y [T, inner] float32."""
    def as_float(x: torch.Tensor) -> torch.Tensor:
        return x.float().contiguous()

    return torch.ops.kvreuse_mamba2.mixer(
        as_float(xbc), as_float(z), as_float(dt), as_float(conv_weight.squeeze(1)),
        None if conv_bias is None else as_float(conv_bias), conv_states, as_float(a_log), as_float(dt_bias),
        as_float(d), as_float(norm_weight), states, layer, list(slots), list(starts), list(lens), heads, groups,
        groups, float(eps), float(dt_limit[0]), float(dt_limit[1]))
