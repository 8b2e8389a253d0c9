"""A decode step's decoder layers, one native call each (csrc/decoder_layer.cpp), as ``torch.ops.kvreuse_step``.

Run op by op, a one-token step of a small model spends as long in Python (module calls, argument
handling, torch's bindings: about ten operators per layer) as in arithmetic. ``decoder_layer`` makes
the same calls from C++ through torch's dispatcher, with the same kernels in the same order (the
products each part's plan picks: ``qdot`` / ``qdot8`` over quantized parts, F.linear or the row-dot
kernels over float ones; the fused norm, rotary and SiLU kernels; the paged attention kernel with its
fused K/V store), so its outputs are the op-by-op path's bit for bit (tests/test_native_step.py).

It runs a step when every token is the paged kernel's (decode rows and short chunks over cached
context: ``NativeAttentionMetadata.paged_covers_whole_batch``), the KV pool holds floats (the model's dtype or bfloat16),
no LoRA adapter is in the batch, and each projection's plan for the step's row count is one of those
kernels. Anything else runs op by op for that step: prefills, quantized KV pools, LoRA rows, products
on dequantized tiles or packed layouts, CUDA, torch.compile (``decode_step`` says which, once, at start).
``KVREUSE_NATIVE_STEP=0`` turns it off (benchmarks compare the two in one run).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvreuse.cache.kv import KVCache
from kvreuse.models import fused_ops, paged_attention, qlinear, rowdot
from kvreuse.models.kernels import LAYOUT, LinearKernel
from kvreuse.models.layers import Linear
from kvreuse.models.paged_attention import NativeAttentionMetadata, NativePagedAttention
from kvreuse.models.quant import QuantizedTensor

logger = logging.getLogger("kvreuse")

SOURCE = Path(__file__).with_name("csrc") / "decoder_layer.cpp"
ENV = "KVREUSE_NATIVE_STEP"
# decoder_layer.cpp's Kernel codes.
KERNEL_CODES = {"qdot": 0, "qdot8": 1, "plain": 2, "rowdot": 3, "rowdot8": 4}
FLOAT_PART = 5  # a float part of a quantized weight: F.linear, then the bias


@functools.cache
def library() -> Path | None:
    """The op, built and loaded with the kernels it calls (None where any of them cannot be)."""
    if not all(module.library() is not None for module in (qlinear, rowdot, fused_ops, paged_attention)):
        return None
    return rowdot.load_extension(SOURCE, rowdot.build_name(SOURCE, "kvreuse_decoder_layer"),
                                 "the native decoder layer", "decode steps run the layers op by op")


@dataclass
class LayerArgs:
    """One decoder layer's weights as ``decoder_layer`` takes them, for one row count."""

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


def projection(linear: Linear, rows: int) -> tuple[list[torch.Tensor], list[int], list[int]] | str:
    """The parts, kernel codes and format codes ``linear`` runs for a step of ``rows`` rows, or why the
    native layer does not run them."""
    kernel = linear.kernel
    if linear.quantized is not None:
        weights, codes, formats = [], [], []
        for part, plan in zip(kernel.parts, kernel.plans):
            if not isinstance(part, QuantizedTensor):
                weights.append(part), codes.append(FLOAT_PART), formats.append(-1)
                continue
            name = plan.kernel_for(rows)
            if name == "qdot8" and part.format.name not in qlinear.int8_formats():
                name = "qdot"  # as qlinear.run_quantized falls back
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
    attention, mlp = layer.self_attn, layer.mlp
    for linear in (attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if linear.bias is not None or (linear.kernel is not None and linear.kernel.bias is not None):
            return "a bias outside q/k/v"
    weights, kernels, formats, parts = [], [], [], []
    for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
        found = projection(linear, rows)
        if isinstance(found, str):
            return found
        weights += found[0]
        kernels += found[1]
        formats += found[2]
        parts.append(len(found[0]))
    qkv = attention.qkv_proj
    bias = qkv.kernel.bias if qkv.kernel is not None else qkv.bias
    return LayerArgs(weights, kernels, formats, parts, None if bias is None else bias.detach(),
                     layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                     layer.input_layernorm.eps, None if attention.q_norm is None else attention.q_norm.weight.detach(),
                     None if attention.k_norm is None else attention.k_norm.weight.detach())


class NativeDecodeStep:
    """Runs a model's decoder layers through ``decoder_layer`` for the steps it covers (``covers``); the
    layers' arguments are made once per row count."""

    def __init__(self, model: Any) -> None:  # a LlamaFamilyForCausalLM (models/llama.py imports this module)
        self.model = model
        self._args: dict[int, list[LayerArgs] | str] = {}
        self._said: set[str] = set()

    def layers_for(self, hidden: torch.Tensor, kv_cache: KVCache, metadata: object, lora: object) -> list[LayerArgs] | None:
        """The layers' arguments for this step, or None where it runs op by op."""
        if (lora is not None or not isinstance(metadata, NativeAttentionMetadata)
                or not metadata.paged_covers_whole_batch or kv_cache.scheme is not None
                or kv_cache.dtype != hidden.dtype or not fused_ops.applies(hidden)):
            return None
        rows = hidden.shape[0]
        args = self._args.get(rows)
        if args is None:
            args = self._args[rows] = self._make(rows)
        if isinstance(args, str):
            if args not in self._said:
                self._said.add(args)
                logger.info("decode step: %d-row steps run op by op (%s)", rows, args)
            return None
        return args

    def _make(self, rows: int) -> list[LayerArgs] | str:
        made = []
        for layer in self.model.model.layers:
            args = layer_args(layer, rows)
            if isinstance(args, str):
                return args
            made.append(args)
        return made

    def run(self, args: LayerArgs, hidden: torch.Tensor, rope: Any, kv_cache: KVCache, layer: int,
            metadata: NativeAttentionMetadata) -> None:
        """One decoder layer on ``hidden`` [T, hidden] (updated in place), its K/V stored."""
        config = self.model.config
        rows = metadata.paged
        k_pool, v_pool, _, _ = kv_cache.layer_pools(layer)
        table = rope.rotary
        torch.ops.kvreuse_step.decoder_layer(
            hidden, args.input_norm, args.post_norm, args.eps, args.weights, args.kernels, args.formats, args.parts,
            args.qkv_bias, table.cos_cache, table.sin_cache, rope.positions, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, args.q_norm, args.k_norm, k_pool, v_pool, rows.block_tables,
            rows.query_start, rows.query_lens, rows.context_lens, metadata.slot_mapping, kv_cache.block_size,
            1.0 / math.sqrt(config.head_dim))


def for_model(model: Any, device: torch.device, compiling: bool) -> NativeDecodeStep | None:
    """The native step for ``model`` where it can run (logged once either way), else None."""
    if os.environ.get(ENV, "1").strip() == "0":
        reason = f"{ENV}=0"
    elif device.type != "cpu":
        reason = f"not on {device.type}"
    elif compiling:
        reason = "enable_torch_compile runs compiled graphs"
    elif not isinstance(model.attention_backend, NativePagedAttention):
        reason = "the attention backend is not cpu_paged"
    elif library() is None:
        reason = "the native decoder layer could not be built (see the log)"
    else:
        logger.info("decode step: one native call per decoder layer (decode rows over a float KV pool, "
                    "no LoRA rows; other steps op by op)")
        return NativeDecodeStep(model)
    logger.info("decode step: op by op (%s)", reason)
    return None
