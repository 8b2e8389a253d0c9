"""Building blocks shared by the decoder families: RMSNorms (Llama's and Gemma's), rotary embedding, fused
linear layers, the gated MLP (SiLU or tanh-GELU).

The numerics follow transformers' reference implementations on purpose (RMSNorm in float32 then
cast back before the weight; rotary cos/sin computed in float32 and cast to the activation dtype;
Llama 3 frequency scaling with the same formula), so a checkpoint gives the same logits here as in
transformers and greedy outputs can be compared token for token. Parameters are created directly on
the target device and dtype with ``torch.empty``: the loader fills them, so nothing is initialised
twice and peak memory stays near the model size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.attention.forward_batch import ProjectionDeltas
from kvreuse.models import fused_ops, qlinear
from kvreuse.models.config import LinearRopeScaling, RopeScaling, YarnRopeScaling
from kvreuse.models.kernels import LinearKernel, PlanBook, invariant_plan
from kvreuse.models.qlinear import QuantizedLinearKernel
from kvreuse.models.quant import QuantizedTensor

def _empty_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


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
        # position delta (models/rope_shift.py) divides it out, since the rows it turns carry it already.
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


class Linear(nn.Module):
    """y = x W^T (+ b). ``output_sizes`` lists the fused parts (e.g. q, k, v) in row order.

    The weight is a float parameter, or held quantized (``set_quantized``: GGUF blocks repacked, or int8
    quantized at load), in which case ``weight`` is None and ``quantized`` holds the parts."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        output_size = sum(output_sizes)
        self.dtype = dtype
        self.weight = _empty_parameter((output_size, input_size), dtype, device)
        self.bias = _empty_parameter((output_size,), dtype, device) if bias else None
        # The weight's parts (stacked by output rows) where it is held quantized (set_quantized).
        self.quantized: list[QuantizedTensor | torch.Tensor] | None = None

        # The CPU kernel chosen for this weight's shape (see choose_cpu_kernel); None: plain F.linear.
        self.kernel: LinearKernel | QuantizedLinearKernel | None = None
        # Where LoRA adapters attach (set by the model): the decoder layer and PEFT's module name per part.
        self.lora_layer: int | None = None
        self.lora_modules: tuple[str, ...] = ()
        # Kept as a plain float weight: not quantized by quantize_int8, no second layout (a MoE router: rounding
        # would move tokens between experts, and the native MoE layer reads it as it is).
        self.keep_float = False

    def forward(self, x: torch.Tensor, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        out = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self.bias)
        if lora is not None:
            lora.apply(self, x, out)
        return out

    def choose_cpu_kernel(self, book: PlanBook, max_layouts: int = 2, batch_invariant: bool = False) -> bool:
        """Run this layer on the kernel(s) measured fastest for its shape, per row count (kernels.py);
        ``batch_invariant``: on the one kernel whose rows do not depend on the row count, at every count.

        The plain weight is released unless the plan still uses it, so memory grows only where a
        second layout buys speed. Returns False where plain F.linear is the verdict (or not on CPU).
        """
        if self.quantized is not None:
            if batch_invariant:  # the parts qpacked runs packed for it (held once: self.quantized is them)
                self.kernel.parts = self.quantized = qlinear.invariant_parts(self.kernel.parts)
            # Each quantized part on the kernel measured fastest for its format and shape, per row count.
            self.kernel.plans = [qlinear.invariant_plan(part, self.dtype) if batch_invariant else
                                 qlinear.plan_for(book, part, self.dtype) if isinstance(part, QuantizedTensor)
                                 else qlinear.DEFAULT_PLAN for part in self.kernel.parts]
            return True
        if self.weight is None or self.weight.device.type != "cpu" or self.keep_float:
            return False
        plan = (invariant_plan(self.weight.dtype) if batch_invariant
                else book.plan_for(self.weight.dtype, tuple(self.weight.shape), max_layouts))
        if plan.is_plain:
            return False
        self.kernel = LinearKernel(self.weight.detach(), self._bias_tensor(), plan)
        if "plain" not in plan.layouts:  # the row-dot kernels read the plain layout too
            self.weight = None  # type: ignore[assignment]
        return True

    def _bias_tensor(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.detach()

    def set_quantized(self, parts: list[QuantizedTensor | torch.Tensor]) -> None:
        """Hold the weight as ``parts`` stacked by output rows (each a QuantizedTensor, or a float tensor
        for a part a file keeps unquantized), run by the quantized kernels (qlinear.DEFAULT_PLAN until
        ``choose_cpu_kernel`` measures). Where those cannot run (no compiler built them, or not on CPU)
        the parts are dequantized into the float weight instead: the same values, float memory."""
        rows = sum(part.shape[0] for part in parts)
        if rows != sum(self.output_sizes) or any(part.shape[1] != self.input_size for part in parts):
            shapes = ", ".join(f"{part.shape[0]}x{part.shape[1]}" for part in parts)
            raise ValueError(f"quantized parts {shapes} do not make a {sum(self.output_sizes)}x{self.input_size} weight")
        device = self.bias.device if self.bias is not None else (
            self.weight.device if self.weight is not None else torch.device("cpu"))
        if device.type == "cpu" and qlinear.available():
            self.weight = None  # type: ignore[assignment]
            self.kernel = QuantizedLinearKernel(parts, self._bias_tensor())
            # The parts as views of the kernel's weights: a fused projection whose parts share a format is
            # stacked into one copy (merge_parts), and keeping the file's parts as well held every such
            # weight twice (qwen2.5-0.5b Q4_K_M: 150 MB more than the log's "weights held").
            self.quantized = self.kernel.views_of(parts)
            return
        dense = torch.cat([qlinear.dequantize_any(part) for part in parts]).to(self.dtype)
        self.weight = nn.Parameter(dense.to(device), requires_grad=False)
        self.quantized = None
        self.kernel = None

    @property
    def weight_bytes(self) -> int:
        """Memory of the weight as held (quantized, or float in any kernel layout)."""
        if self.kernel is not None:
            return self.kernel.layout_bytes
        return self.weight.numel() * self.weight.element_size()

    def part_rows(self, part: int) -> slice:
        """Rows of the fused weight that belong to part ``part`` (e.g. 1 = k of a qkv projection)."""
        start = sum(self.output_sizes[:part])
        return slice(start, start + self.output_sizes[part])


CLAMPED_SWIGLU = "clamped_swiglu"
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", CLAMPED_SWIGLU)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation, in transformers' GptOssExperts._apply_gate's order of operations: the gate
    clamped from above, the up projection on both sides, (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU (the Llama family,
    Qwen's experts), tanh-approximated GELU (Gemma: transformers' ``gelu_pytorch_tanh``) or gpt-oss's clamped
    SwiGLU (``clamped_swiglu``, with ``swiglu_limit`` and ``swiglu_alpha``; its experts also have biases).
    The gate and up rows are held [gate; up] whatever the checkpoint's order (gpt-oss interleaves them: the
    loader splits them apart)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device,
                 activation: str = "silu", bias: bool = False, swiglu_limit: float | None = None,
                 swiglu_alpha: float = 1.702) -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
        if activation == CLAMPED_SWIGLU and swiglu_limit is None:
            raise ValueError("the clamped_swiglu activation needs swiglu_limit")
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        self.gate_up_proj = Linear(hidden_size, [intermediate_size, intermediate_size], bias, dtype, device)
        self.down_proj = Linear(intermediate_size, [hidden_size], bias, dtype, device)

    def forward(self, x: torch.Tensor, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.activation == CLAMPED_SWIGLU:
            if gate_up.dim() == 2 and gate_up.is_contiguous() and fused_ops.applies(gate_up):
                return self.down_proj(fused_ops.clamped_swiglu(gate_up, self.swiglu_limit, self.swiglu_alpha), lora)
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha), lora)
        if self.activation == "gelu_pytorch_tanh":
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up), lora)
        if gate_up.is_contiguous() and fused_ops.applies(gate_up):
            return self.down_proj(fused_ops.silu_mul(gate_up), lora)
        return self.down_proj(fused_ops.reference_silu_mul(gate_up), lora)


class QuantizedEmbedding(nn.Module):
    """An embedding table held quantized: looked-up rows are dequantized (qlinear's kernel), in ``dtype``;
    a tied output projection reads the same quantized table (``quantized``)."""

    def __init__(self, table: QuantizedTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.quantized = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = qlinear.dequantize_rows(self.quantized, ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The table dequantized (float memory: for the rare reader of the whole matrix, not the forward)."""
        return qlinear.dequantize(self.quantized).to(self.dtype)
