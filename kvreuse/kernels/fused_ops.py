"""A decoder layer's element-wise work in one call each (csrc/fused_ops.cpp), loaded as ``torch.ops.kvreuse_fused``.

Between its matrix products a decode step runs ~40 small PyTorch ops per layer (RMSNorms in float32 and
back, rotary's slices, products and concatenation, SiLU and the multiply, the residual adds), each paying
eager dispatch for a few hundred values: on a 2-core CPU that was more of SmolLM2-135M's decode step than
its quantized products. Four kernels replace them, and a fifth does the sampler's argmax:

- ``rms_norm(x, weight, eps, residual)``: the residual add (in place) and the RMSNorm after it;
- ``rotary_(qkv, ...)``: Qwen3's q/k norms and the rotary embedding, in place on the fused q|k|v rows,
  reading the model's float32 cos/sin tables at each row's position;
- ``silu_mul(gate_up)``: the gated MLP's activation, its exp PyTorch's own (SLEEF, which libtorch exports);
- ``clamped_swiglu(gate_up, limit, alpha)``: gpt-oss's expert activation, eleven eager ops in one (its
  reference is ``layers.clamped_swiglu``, transformers' order of operations);
- ``argmax_rows(logits)``: greedy sampling's argmax over the vocabulary, vectorised and split between threads;
- ``short_conv(bcx, ...)``: LFM2's gated short convolution between its projections (layers/short_conv.py: its inputs
  written to and read from the pool's planes), bit for bit its element-wise reference.

Each equals the PyTorch code it replaces (the ``reference_*`` functions here, which are what the model
runs where the kernels do not: CUDA, or where no compiler built them): float32
within float rounding (a norm's summation order, a contracted multiply-add), reduced precision with at
most the roundings PyTorch does between ops (tests/test_fused_ops.py). Built and cached like the other
kernels (kernels/rowdot.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kvreuse.kernels.build import build_name, load_extension

SOURCE = Path(__file__).with_name("csrc") / "fused_ops.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def library() -> Path | None:
    built = load_extension(SOURCE, build_name(SOURCE, "kvreuse_fused_ops"), "the fused decoder-layer kernels",
                           "norms, rotary and the MLP activation run as PyTorch ops")
    if built is not None:
        @torch.library.register_fake("kvreuse_fused::rms_norm")
        def _(x, weight, eps, residual):
            return torch.empty_like(x)

        @torch.library.register_fake("kvreuse_fused::rms_norm_float_scale")
        def _(x, scale, eps, residual):
            return torch.empty_like(x)

        @torch.library.register_fake("kvreuse_fused::rotary_")
        def _(qkv, cos, sin, positions, heads, kv_heads, head_dim, q_norm, k_norm, eps) -> None:
            return None

        @torch.library.register_fake("kvreuse_fused::silu_mul")
        def _(gate_up):
            return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

        @torch.library.register_fake("kvreuse_fused::clamped_swiglu")
        def _(gate_up, limit, alpha):
            return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

        @torch.library.register_fake("kvreuse_fused::argmax_rows")
        def _(logits):
            return logits.new_empty((logits.shape[0],), dtype=torch.long)

        @torch.library.register_fake("kvreuse_fused::short_conv")
        def _(bcx, weight, bias, planes, taps, slot_mapping):
            return bcx.new_empty((bcx.shape[0], bcx.shape[1] // 3))
    return built


def available() -> bool:
    return library() is not None


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels run for activations ``x``: on CPU, in a dtype they take, and built."""
    return x.device.type == "cpu" and x.dtype in DTYPES and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x += residual`` (when given, in place), then RMSNorm(x) * weight. x contiguous."""
    return torch.ops.kvreuse_fused.rms_norm(x, weight, eps, residual)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, heads: int,
            kv_heads: int, head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
            eps: float) -> None:
    """In place on qkv [rows, (heads + 2 kv_heads) head_dim]: q and k heads normed (where weights are given)
    and rotated by ``positions`` [rows] through the float32 tables cos / sin [max_position, head_dim / 2]."""
    torch.ops.kvreuse_fused.rotary_(qkv, cos, sin, positions, heads, kv_heads, head_dim, q_norm, k_norm, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 x intermediate] (contiguous)."""
    return torch.ops.kvreuse_fused.silu_mul(gate_up)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation of gate_up [rows, 2 x intermediate] (contiguous), rounded op for op as
    ``layers.clamped_swiglu`` rounds it."""
    return torch.ops.kvreuse_fused.clamped_swiglu(gate_up, limit, alpha)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [rows, vocab] logits: the kernel for CPU float32 rows (torch's own
    reduction is a scalar loop per row there), torch's otherwise. Same answer, NaNs and ties included."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(-1) == 1 and logits.shape[1] > 0
            and applies(logits)):
        return torch.ops.kvreuse_fused.argmax_rows(logits)
    return logits.argmax(dim=-1)


def short_conv(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, planes: torch.Tensor,
               taps: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """LFM2's ``C * conv(B * x)`` for bcx [T, 3H] (in_proj's B | C | x, contiguous): each row's B * x written to
    ``planes`` [slots, H] at ``slot_mapping`` [T], then the rows ``taps`` [T, K] name (oldest first) summed by ``weight``
    [K, H] float32 (plus ``bias`` [H] float32) in tap order, rounded to bcx's dtype and gated by C
    (layers/short_conv.py's ``reference_short_conv``, bit for bit)."""
    return torch.ops.kvreuse_fused.short_conv(bcx, weight, bias, planes, taps, slot_mapping)


# ---- the PyTorch code each kernel replaces (what runs where they do not) ------------------------------------

def rms_norm_float_scale(x: torch.Tensor, scale: torch.Tensor, eps: float,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x += residual`` (when given, in place), then RMSNorm(x) * scale in float32, rounded once to x's dtype (Gemma's
    and Qwen3.5's (1 + weight) norms: ``scale`` is that, in float32). x contiguous."""
    return torch.ops.kvreuse_fused.rms_norm_float_scale(x, scale, eps, residual)


def reference_rms_norm_float_scale(x: torch.Tensor, scale: torch.Tensor, eps: float,
                                   residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        x.add_(residual)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).mul_(scale).to(x.dtype)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        x.add_(residual)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Reduced precision: normalise in float32, round to the activation dtype, then scale by the weight in
    # that dtype, the order transformers uses, so bf16 logits match it closely.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return normed.mul_(weight)


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by position (rotate-half layout, as in HF checkpoints); cos / sin
    [T, 1, head_dim // 2] in x's dtype."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    # In place: the [T, intermediate] activations are the largest tensors of a prefill, and not
    # allocating a second one is measurably faster on CPU.
    return F.silu(gate).mul_(up)
