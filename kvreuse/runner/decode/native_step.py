"""A decode step's decoder layers in one native call (csrc/decoder_layer.cpp), ``torch.classes.kvreuse_step``.

Run op by op, a one-token step of a small model spends as long in Python (module calls, argument
handling, torch's bindings: about ten operators per layer) as in arithmetic. ``DecodeLayers`` makes
the same calls from C++ through torch's dispatcher, with the same kernels in the same order (the
products each part's plan picks: ``qdot`` / ``qdot8`` over quantized parts, F.linear or the row-dot
kernels over float ones; the fused norm, rotary and SiLU kernels; the paged attention kernel with its
fused K/V store), so its outputs are the op-by-op path's bit for bit (tests/test_native_step.py).
``DecodeLayers`` holds every layer's arguments for one row count, made once, so a step is one call from
Python for all the layers (a call per layer cost SmolLM2-135M's 30 layers about 8% of a one-stream step in
argument conversion); a step that captures the residual stream for EAGLE runs the layers in stretches.

It runs a step when every token is the paged kernel's (decode rows and short chunks over cached
context: ``NativeAttentionMetadata.paged_covers_whole_batch``), the KV pool holds floats (the model's dtype or bfloat16),
no LoRA adapter is in the batch, and each projection's plan for the step's row count is one of those
kernels. Anything else runs op by op for that step: prefills, quantized KV pools, LoRA rows, products
on dequantized tiles or packed layouts, CUDA (``for_model`` says which, once, at start).
Each layer's attention is what its ``self_attn.layer_attention`` (a ``LayerAttention``) says: a sliding window,
a softmax scale of its own, learned sinks, handed to the paged kernel as the op-by-op path hands them
(``DecodeLayers.set_attention``), with the output projection's bias (gpt-oss). A model with Gemma's norms runs op
by op. A mixture-of-experts layer's MLP is its experts, held as layers/experts.py's native layer
holds them (``DecodeLayers.set_experts``, csrc/moe.h), for the row counts their GEMV kernels are planned for.
A hybrid's conv layer (LFM2's gated short convolution, models/lfm2.py) is held with its planes in the pool
(``DecodeLayers.add_conv_layer``): the same norms and MLP around in_proj, the fused convolution and out_proj, each row's
convolution inputs found from the block tables as ``ConvTaps`` finds them. Qwen3.5's layers are held too
(``set_offset_norms``: its (1 + weight) norms as float32 scales; ``set_gated_attention``: the output gate and the
partial rotary; ``add_delta_layer``: a Gated DeltaNet layer's mixer, the one native call the op-by-op layer makes, over
the state slots each step hands ``run``). So are Nemotron-H's blocks, a norm, one mixer and the residual each
(``add_block``: attention without rotary, the squared-ReLU MLP; ``add_mamba_block``: Mamba-2 through the same native
mixer call as op by op), its norms held as float32 scales too.
``KVREUSE_NATIVE_STEP=0`` turns it off (benchmarks compare the two in one run).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from kvreuse.attention.backend import PLAIN_ATTENTION, LayerAttention
from kvreuse.attention.cpu_paged import NativeAttentionMetadata, NativePagedAttention
from kvreuse.cache.kv import KVCache
from kvreuse.kernels import fused_ops, qpacked, quant_ops
from kvreuse.kernels import gated_delta as gated_delta_kernel
from kvreuse.kernels.decoder_layer import library
from kvreuse.kernels.quant import QuantizedTensor
from kvreuse.layers.experts import SparseMoE
from kvreuse.layers.gated_delta import GatedDeltaNet
from kvreuse.layers.linear import Linear
from kvreuse.layers.mlp import GatedMLP
from kvreuse.layers.norm import GemmaRMSNorm, RMSNorm
from kvreuse.layers.plan_book import LAYOUT, ROWDOT_GROUP, LinearKernel
from kvreuse.layers.recurrent import StateInputs
from kvreuse.layers.short_conv import ShortConv
from kvreuse.models.nemotron_h import AttentionBlock, Float32ScaleRMSNorm, MambaBlock, MLPBlock
from kvreuse.models.qwen3_5 import GatedAttention

logger = logging.getLogger("kvreuse")

ENV = "KVREUSE_NATIVE_STEP"
# decoder_layer.cpp's Kernel codes.
KERNEL_CODES = {"qdot": 0, "qdot8": 1, "plain": 2, "rowdot": 3, "rowdot8": 4, "qpacked8": 6}
FLOAT_PART = 5  # a float part of a quantized weight: F.linear, then the bias
# Distinct row counts whose layer arguments are held at once (batch-invariant mode runs prefills here too).
MAX_ROW_COUNTS_HELD = 64


@dataclass
class LayerArgs:
    """One decoder layer's weights as ``DecodeLayers.add_layer`` takes them, for one row count."""

    weights: list[torch.Tensor]  # the parts of qkv, o, gate_up, down, in order
    kernels: list[int]
    formats: list[int]
    parts: list[int]  # how many of ``weights`` each projection has
    qkv_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    experts: tuple[Any, ...] | None = None  # a mixture-of-experts layer's native arguments (layers/experts.py)
    attention: LayerAttention = PLAIN_ATTENTION  # the layer's window, scale and sinks
    o_bias: torch.Tensor | None = None  # the output projection's bias (gpt-oss)
    kv_layer: int = 0  # where an attention layer's K/V sit in the pool
    conv: ConvArgs | None = None  # a conv layer's convolution (the projections are then in_proj and out_proj)
    delta: DeltaArgs | None = None  # a Gated DeltaNet layer's mixer (the projections are then in_proj and out_proj)
    gated_rotary_dim: int = 0  # Qwen3.5's gated attention: the rotary's width per head (0: not gated)
    block: int = 0  # a Nemotron-H block's kind (BLOCK_KINDS: its projections are then [first, second, 0, 0])
    mamba: MambaArgs | None = None  # a Mamba-2 block's mixer


# decoder_layer.cpp's LayerKind of Nemotron-H's blocks.
BLOCK_KINDS = {"attention": 3, "mlp": 4, "mamba": 5}


@dataclass
class MambaArgs:
    """A Mamba-2 block's mixer as ``DecodeLayers.add_mamba_block`` takes it: its float32 parameters as layers/mamba2.py
    hands them to the native mixer, its place in a state slot, its heads, groups, widths and dt's limits."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    d: torch.Tensor
    norm_weight: torch.Tensor
    state_layer: int
    heads: int
    groups: int
    inner: int
    conv_dim: int
    dt_limit: tuple[float, float]


@dataclass
class DeltaArgs:
    """A Gated DeltaNet layer's mixer as ``DecodeLayers.add_delta_layer`` takes it: its float32 parameters as
    layers/gated_delta.py hands them to ``delta_mixer``, its place in a state slot, its heads and in_proj's split."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    state_layer: int
    key_heads: int
    tiled: bool
    conv_dim: int
    value_size: int
    value_heads: int


@dataclass
class ConvArgs:
    """A conv layer's convolution as ``DecodeLayers.add_conv_layer`` takes it: its float32 kernel [K, H] and bias, and
    its index among the pool's planes."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    plane: int


def projection(linear: Linear, rows: int) -> tuple[list[torch.Tensor], list[int], list[int]] | str:
    """The parts, kernel codes and format codes ``linear`` runs for a step of ``rows`` rows, or why the
    native layer does not run them."""
    kernel = linear.kernel
    if linear.quantized is not None:
        weights, codes, formats = [], [], []
        for part, plan in zip(kernel.parts, kernel.plans):
            if isinstance(part, qpacked.PackedWeight):  # batch-invariant mode's packed int8 product
                if part.out_features % qpacked.TILE:
                    return "a packed weight padded to whole blocks"  # the C++ call knows its outputs from its shape
                weights.append(part.data), codes.append(KERNEL_CODES["qpacked8"]), formats.append(
                    qpacked.FORMAT_CODES[part.format])
                continue
            if not isinstance(part, QuantizedTensor):
                if plan.kernel_for(rows) in ROWDOT_GROUP:
                    return "a float part on the row-dot kernel (batch-invariant)"  # project() runs F.linear
                weights.append(part), codes.append(FLOAT_PART), formats.append(-1)
                continue
            name = plan.kernel_for(rows)
            if name == "qdot8" and part.format.name not in quant_ops.int8_formats():
                name = "qdot"  # as quantized_linear.run_quantized falls back
            if name not in ("qdot", "qdot8"):
                return f"{name} products at {rows} rows"
            weights.append(part.data), codes.append(KERNEL_CODES[name]), formats.append(part.format.code)
        return weights, codes, formats
    if kernel is None:
        return [linear.weight.detach()], [KERNEL_CODES["plain"]], [-1]
    if not isinstance(kernel, LinearKernel):
        return f"a {type(kernel).__name__} weight"
    name = kernel.plan.kernel_for(rows)
    if name not in ("plain", "rowdot", "rowdot8"):
        return f"{name} products at {rows} rows"
    return [kernel.layouts[LAYOUT[name]]], [KERNEL_CODES[name]], [-1]


def layer_args(layer: Any, rows: int) -> LayerArgs | str:
    if isinstance(layer, (AttentionBlock, MLPBlock, MambaBlock)):
        return block_args(layer, rows)
    if isinstance(getattr(layer, "conv", None), ShortConv):
        return conv_layer_args(layer, rows)
    if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet):
        return delta_layer_args(layer, rows)
    attention, mlp = layer.self_attn, layer.mlp
    experts = isinstance(mlp, SparseMoE)
    if experts and (mlp.native is None or rows > mlp.native_max_rows):
        return "an MoE layer without its native layer" if mlp.native is None else f"MoE experts at {rows} rows"
    if experts and mlp.shared_expert is not None:
        return "a shared expert (the native decode step runs the routed experts only)"
    gated = isinstance(attention, GatedAttention)
    if isinstance(layer.input_layernorm, GemmaRMSNorm) and not gated:
        return "Gemma's norms around a Llama-shaped attention"
    linears = (attention.qkv_proj, attention.o_proj) + (() if experts else (mlp.gate_up_proj, mlp.down_proj))
    for linear in linears[2:]:
        if linear.bias is not None or (linear.kernel is not None and linear.kernel.bias is not None):
            return "a bias on an MLP projection"
    found = _projections(linears, rows)
    if isinstance(found, str):
        return found
    weights, kernels, formats, parts = found
    if experts:
        parts += [0, 0]  # the layer's MLP is its experts (DecodeLayers.set_experts)
    bias, o_bias = (_bias(linear) for linear in (attention.qkv_proj, attention.o_proj))
    return LayerArgs(weights, kernels, formats, parts, bias,
                     _norm_weight(layer.input_layernorm), _norm_weight(layer.post_attention_layernorm),
                     layer.input_layernorm.eps, None if attention.q_norm is None else _norm_weight(attention.q_norm),
                     None if attention.k_norm is None else _norm_weight(attention.k_norm),
                     mlp.native_args if experts else None, attention.layer_attention, o_bias, attention.kv_layer,
                     gated_rotary_dim=attention.rotary_dim if gated else 0)


def _norm_weight(norm: RMSNorm | GemmaRMSNorm) -> torch.Tensor:
    """What the native layer scales a norm by: Llama's weight, or a float32 scale (Gemma's and Qwen3.5's 1 + weight,
    Nemotron-H's weight)."""
    return norm.scale() if isinstance(norm, (GemmaRMSNorm, Float32ScaleRMSNorm)) else norm.weight.detach()


def _projections(linears: tuple[Linear, ...], rows: int) -> tuple[list, list, list, list] | str:
    """The weights, kernel codes, formats and part counts of ``linears`` for ``rows`` rows, or why not native."""
    weights, kernels, formats, parts = [], [], [], []
    for linear in linears:
        found = projection(linear, rows)
        if isinstance(found, str):
            return found
        weights += found[0]
        kernels += found[1]
        formats += found[2]
        parts.append(len(found[0]))
    return weights, kernels, formats, parts


def block_args(layer: AttentionBlock | MLPBlock | MambaBlock, rows: int) -> LayerArgs | str:
    """A Nemotron-H block's arguments: its norm's float32 scale and its two projections (q|k|v and o, up and down, or
    in_proj and out_proj), with the attention's pools or the Mamba-2 mixer's parameters."""
    norm = _norm_weight(layer.input_layernorm)
    if isinstance(layer, MLPBlock):
        found = _projections((layer.ffn.up_proj, layer.ffn.down_proj), rows)
        if isinstance(found, str):
            return found
        first, second = layer.ffn.up_proj, layer.ffn.down_proj
        kind, mamba, attention = "mlp", None, PLAIN_ATTENTION
    elif isinstance(layer, AttentionBlock):
        attention_module = layer.self_attn
        found = _projections((attention_module.qkv_proj, attention_module.o_proj), rows)
        if isinstance(found, str):
            return found
        first, second = attention_module.qkv_proj, attention_module.o_proj
        kind, mamba, attention = "attention", None, attention_module.layer_attention
    else:
        mixer = layer.mixer  # the scan's kernel built: the model refuses the native step otherwise
        found = _projections((mixer.in_proj, mixer.out_proj), rows)
        if isinstance(found, str):
            return found
        first, second = mixer.in_proj, mixer.out_proj
        conv_weight, conv_bias, a_log, dt_bias, d, norm_weight = mixer._native_parameters.get(
            mixer.conv1d.weight, mixer.conv1d.bias, mixer.A_log, mixer.dt_bias, mixer.D, mixer.norm.weight)
        mamba = MambaArgs(conv_weight.squeeze(1).contiguous(), conv_bias, a_log, dt_bias, d, norm_weight,
                          mixer.state_layer, mixer.heads, mixer.groups, mixer.inner_size, mixer.conv_dim,
                          (float(mixer.dt_limit[0]), float(mixer.dt_limit[1])))
        kind, attention = "mamba", PLAIN_ATTENTION
    weights, kernels, formats, parts = found
    return LayerArgs(weights, kernels, formats, parts + [0, 0], _bias(first), norm, norm, layer.input_layernorm.eps,
                     None, None, attention=attention, o_bias=_bias(second),
                     kv_layer=layer.self_attn.kv_layer if kind == "attention" else 0, block=BLOCK_KINDS[kind],
                     mamba=mamba)


def delta_layer_args(layer: Any, rows: int) -> LayerArgs | str:
    """A Qwen3.5 Gated DeltaNet layer's arguments: in_proj and out_proj in the attention's projections' places."""
    mixer, mlp = layer.linear_attn, layer.mlp
    if not isinstance(mlp, GatedMLP) or mlp.activation != "silu":
        return "a Gated DeltaNet layer without a dense SwiGLU MLP"
    if mixer.in_proj.dtype not in (torch.float32, torch.bfloat16) or not gated_delta_kernel.available():
        return "a Gated DeltaNet layer without its native mixer (float32 or bfloat16, the kernel built)"
    if any(linear.bias is not None for linear in (mixer.in_proj, mixer.out_proj)):
        return "a bias on a Gated DeltaNet projection"
    found = _projections((mixer.in_proj, mixer.out_proj, mlp.gate_up_proj, mlp.down_proj), rows)
    if isinstance(found, str):
        return found
    conv_weight, a_log, dt_bias, norm_weight = mixer._native_parameters.get(
        mixer.conv1d.weight, mixer.A_log, mixer.dt_bias, mixer.norm.weight)
    delta = DeltaArgs(conv_weight.squeeze(1).contiguous(), a_log, dt_bias, norm_weight, mixer.state_layer,
                      mixer.key_heads, mixer.tiled_values, mixer.conv_dim, mixer.value_size, mixer.value_heads)
    return LayerArgs(*found, None, _norm_weight(layer.input_layernorm), _norm_weight(layer.post_attention_layernorm),
                     layer.input_layernorm.eps, None, None, delta=delta)


def conv_layer_args(layer: Any, rows: int) -> LayerArgs | str:
    """An LFM2 conv layer's arguments: in_proj and out_proj in the attention's projections' places, its SwiGLU."""
    conv, mlp = layer.conv, layer.mlp
    if not isinstance(mlp, GatedMLP) or mlp.activation != "silu":
        return "a conv layer without a SwiGLU MLP"
    found = _projections((conv.in_proj, conv.out_proj, mlp.gate_up_proj, mlp.down_proj), rows)
    if isinstance(found, str):
        return found
    weights, kernels, formats, parts = found
    weight, bias = conv.conv.taps()
    return LayerArgs(weights, kernels, formats, parts, _bias(conv.in_proj), layer.input_layernorm.weight.detach(),
                     layer.post_attention_layernorm.weight.detach(), layer.input_layernorm.eps, None, None,
                     o_bias=_bias(conv.out_proj), conv=ConvArgs(weight, bias, conv.plane))


def _bias(linear: Linear) -> torch.Tensor | None:
    """A projection's bias as its product adds it (a float kernel holds its own copy)."""
    bias = linear.kernel.bias if linear.kernel is not None else linear.bias
    return None if bias is None else bias.detach()


class NativeDecodeStep:
    """Runs a model's decoder layers through ``DecodeLayers`` for the steps it covers (``layers_for``); the
    layers' arguments are made once per row count and KV cache."""

    def __init__(self, model: Any) -> None:  # a LlamaFamilyForCausalLM (models/llama.py imports this module)
        self.model = model
        self._args: dict[int, list[LayerArgs] | str] = {}
        self._held: dict[int, Any] = {}  # row count -> its DecodeLayers, over the pools of _kv_cache
        self._kv_cache: KVCache | None = None
        self._said: set[str] = set()

    def layers_for(self, rows: int, dtype: torch.dtype, kv_cache: KVCache, metadata: object,
                   lora: object) -> HeldLayers | None:
        """The layers held for a step of ``rows`` tokens in ``dtype``, or None where it runs op by op."""
        if (lora is not None or not isinstance(metadata, NativeAttentionMetadata)
                or not metadata.paged_covers_whole_batch or kv_cache.scheme is not None
                or kv_cache.dtype != dtype or dtype not in fused_ops.DTYPES or not fused_ops.available()):
            return None
        args = self._args.get(rows)
        if args is None and len(self._args) >= MAX_ROW_COUNTS_HELD:
            # Batch-invariant mode sends prefills here too: a new row count each; what is held is a few
            # tensor handles per layer, but not without bound.
            self._args.clear()
            self._held.clear()
        if args is None:
            args = self._args[rows] = self._make(rows)
        if isinstance(args, str):
            if args not in self._said:
                self._said.add(args)
                logger.info("decode step: %d-row steps run op by op (%s)", rows, args)
            return None
        if kv_cache is not self._kv_cache:  # the layers hold the pools they write
            self._held.clear()
            self._kv_cache = kv_cache
        held = self._held.get(rows)
        if held is None:
            held = self._held[rows] = HeldLayers(self._hold(args, kv_cache))
        return held

    def _hold(self, args: list[LayerArgs], kv_cache: KVCache) -> Any:
        config = self.model.config
        held = torch.classes.kvreuse_step.DecodeLayers(args[0].eps, 1.0 / math.sqrt(config.head_dim),
                                                       config.num_attention_heads, config.num_key_value_heads,
                                                       config.head_dim, kv_cache.block_size)
        partition_size = getattr(self.model.attention_backend, "partition_size", 0)
        if partition_size:  # batch-invariant: the attention's partitions as the op-by-op path cuts them
            held.set_partition_size(partition_size)
        if config.norm_style == "offset" or any(layer.block for layer in args):
            held.set_offset_norms(True)  # Qwen3.5's (1 + weight) and Nemotron-H's norms: held as float32 scales
        convs = [layer.conv for layer in args if layer.conv is not None]
        if convs:
            assert kv_cache.planes is not None, "a conv layer's pool has its planes"
            held.set_planes(convs[0].weight.shape[0], kv_cache.zero_plane_slot)
        for index, layer in enumerate(args):
            if layer.conv is not None:
                held.add_conv_layer(layer.weights, layer.kernels, layer.formats, layer.parts, layer.qkv_bias,
                                    layer.o_bias, layer.input_norm, layer.post_norm, layer.conv.weight,
                                    layer.conv.bias, kv_cache.planes[layer.conv.plane])
                continue
            if layer.mamba is not None:
                mamba, states = layer.mamba, kv_cache.states
                assert states is not None, "a Mamba-2 block's pool has its states"
                held.add_mamba_block(layer.weights, layer.kernels, layer.formats, layer.parts, layer.qkv_bias,
                                     layer.o_bias, layer.input_norm, mamba.conv_weight, mamba.conv_bias, mamba.a_log,
                                     mamba.dt_bias, mamba.d, mamba.norm_weight, states.conv, states.ssm,
                                     mamba.state_layer, mamba.heads, mamba.groups, mamba.inner, mamba.conv_dim,
                                     *mamba.dt_limit)
                continue
            if layer.block:
                pools = kv_cache.layer_pools(layer.kv_layer)[:2] if layer.block == BLOCK_KINDS["attention"] else (
                    torch.empty(0), torch.empty(0))
                held.add_block(layer.block, layer.weights, layer.kernels, layer.formats, layer.parts, layer.qkv_bias,
                               layer.o_bias, layer.input_norm, *pools)
                if not layer.attention.is_plain:
                    held.set_attention(index, layer.attention.sliding_window or 0, layer.attention.scale or 0.0,
                                       layer.attention.sinks, layer.o_bias)
                continue
            if layer.delta is not None:
                delta, states = layer.delta, kv_cache.states
                assert states is not None, "a Gated DeltaNet layer's pool has its states"
                held.add_delta_layer(layer.weights, layer.kernels, layer.formats, layer.parts, layer.input_norm,
                                     layer.post_norm, delta.conv_weight, delta.a_log, delta.dt_bias, delta.norm_weight,
                                     states.conv, states.ssm, delta.state_layer, delta.key_heads, delta.tiled,
                                     delta.conv_dim, delta.value_size, delta.value_heads)
                continue
            k_pool, v_pool, _, _ = kv_cache.layer_pools(layer.kv_layer)
            held.add_layer(layer.weights, layer.kernels, layer.formats, layer.parts, layer.qkv_bias, layer.input_norm,
                           layer.post_norm, layer.q_norm, layer.k_norm, k_pool, v_pool)
            if layer.experts is not None:
                held.set_experts(index, *layer.experts)
            if layer.gated_rotary_dim:
                held.set_gated_attention(index, layer.gated_rotary_dim)
            attention = layer.attention
            if not attention.is_plain or layer.o_bias is not None:
                held.set_attention(index, attention.sliding_window or 0, attention.scale or 0.0, attention.sinks,
                                   layer.o_bias)
        return held

    def _make(self, rows: int) -> list[LayerArgs] | str:
        made = []
        for layer in self.model.model.layers:
            args = layer_args(layer, rows)
            if isinstance(args, str):
                return args
            made.append(args)
        return made


@dataclass
class HeldLayers:
    """A step's decoder layers held in C++ for one row count (``DecodeLayers``): what the model runs in place of
    its Python layers (models/llama.py's ``NativeLayers``)."""

    layers: Any  # torch.classes.kvreuse_step.DecodeLayers

    def run(self, hidden: torch.Tensor, rope: Any, metadata: NativeAttentionMetadata, first: int, last: int,
            recurrent: Any = None) -> None:
        """Decoder layers [first, last) on ``hidden`` [T, hidden] (updated in place), their K/V stored; ``recurrent``:
        where a Gated DeltaNet model's sequences keep their state (layers/recurrent.py ``StateInputs``), else None."""
        rows, table = metadata.paged, rope.rotary
        states = (recurrent.slots, recurrent.starts, recurrent.lens) if isinstance(recurrent, StateInputs) else ([],) * 3
        self.layers.run(hidden, table.cos_cache, table.sin_cache, rope.positions, rows.block_tables,
                        rows.query_start, rows.query_lens, rows.context_lens, metadata.slot_mapping, first, last,
                        *states)


def for_model(model: Any, device: torch.device) -> NativeDecodeStep | None:
    """The native step for ``model`` where it can run (logged once either way), else None."""
    if os.environ.get(ENV, "1").strip() == "0":
        reason = f"{ENV}=0"
    elif device.type != "cpu":
        reason = f"not on {device.type}"
    elif getattr(model, "native_step_refusal", None) is not None:
        reason = model.native_step_refusal
    elif not isinstance(model.attention_backend, NativePagedAttention):
        reason = "the attention backend is not cpu_paged"
    elif library() is None:
        reason = "the native decoder layer could not be built (see the log)"
    else:
        logger.info("decode step: one native call for the decoder layers (decode rows over a float KV pool, "
                    "no LoRA rows; other steps op by op)")
        return NativeDecodeStep(model)
    logger.info("decode step: op by op (%s)", reason)
    return None
