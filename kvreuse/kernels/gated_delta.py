"""The gated delta rule's token loop (csrc/gated_delta.cpp), and the few activations around it that must give a value
the same bits wherever it sits in its tensor (batch invariance: PyTorch's vectorised exp leaves a tensor's last values
to its scalar exp): built for this CPU on first use, loaded as ``torch.ops.kvreuse_delta``. Built and cached like the other kernels (kernels/build.py); where the build fails,
``available`` says so once in the log and layers/gated_delta.py runs its PyTorch reference instead."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from kvreuse.kernels.build import build_name as _build_name
from kvreuse.kernels.build import load_extension

SOURCE = Path(__file__).with_name("csrc") / "gated_delta.cpp"


def build_name() -> str:
    return _build_name(SOURCE, "kvreuse_gated_delta")


def available() -> bool:
    return library() is not None


@functools.cache
def library() -> Path | None:
    return load_extension(SOURCE, build_name(), "the gated delta rule's loop",
                          "Gated DeltaNet layers run the PyTorch reference loop")


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, layer: int, slots: Sequence[int], starts: Sequence[int],
                     lens: Sequence[int], tiled: bool = False) -> torch.Tensor:
    """q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] float32; ``states`` [slots, layers, Hv, dk, dv] float32,
    layer ``layer`` of each sequence's slot updated in place. Returns o [T, Hv, dv]. Value head h reads key head
    h // (Hv / Hk), or h % Hk when ``tiled``. ``available()`` must be True."""
    return torch.ops.kvreuse_delta.gated_delta_rule(q, k, v, g, beta, states, layer, list(slots), list(starts),
                                                    list(lens), tiled)


SILU, SIGMOID = 0, 1


def pointwise_(x: torch.Tensor, kind: int) -> torch.Tensor:
    """SiLU (``SILU``) or sigmoid (``SIGMOID``) of a contiguous float32 ``x``, in place, the scalar exp for every value."""
    torch.ops.kvreuse_delta.pointwise_(x, kind)
    return x


def pointwise(x: torch.Tensor, kind: int) -> torch.Tensor:
    """``pointwise_`` of a float32 copy of ``x`` (``x`` is left as it is)."""
    return pointwise_(x.to(torch.float32, memory_format=torch.contiguous_format, copy=True), kind)


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, Hv] float32 from a, b [T, Hv]: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    return torch.ops.kvreuse_delta.delta_gates(a.float().contiguous(), b.float().contiguous(), a_log.float(),
                                               dt_bias.float())


def delta_mixer(mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                conv_states: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                states: torch.Tensor, layer: int, slots: Sequence[int], starts: Sequence[int], lens: Sequence[int],
                key_heads: int, tiled: bool, eps: float, round_bf16: bool) -> torch.Tensor:
    """The Gated DeltaNet between its projections for every row of a step (csrc/gated_delta.cpp ``delta_mixer``):
    mixed [T, C] (q|k|v before the convolution), z [T, Hv * dv], a, b [T, Hv]; the convolution's weight [C, 1, K], its
    inputs kept in ``conv_states`` [slots, layers, K - 1, C]; A_log, dt_bias [Hv]; the output norm's weight [dv];
    ``states`` [slots, layers, Hv, dk, dv]. ``round_bf16``: round where a bfloat16 model's op-by-op path does. Returns
    the gated, normed output [T, Hv * dv] float32."""
    def as_float(x: torch.Tensor) -> torch.Tensor:
        return x.float().contiguous()

    return torch.ops.kvreuse_delta.delta_mixer(
        as_float(mixed), as_float(z), as_float(a), as_float(b), as_float(conv_weight.squeeze(1)), conv_states,
        as_float(a_log), as_float(dt_bias), as_float(norm_weight), states, layer, list(slots), list(starts), list(lens),
        key_heads, tiled, float(eps), round_bf16)
