"""LFM2 (Liquid AI): gated short convolutions with a few grouped-query attention layers (issue 66's first hybrid).

An attention layer is the Llama family's, with q/k norms (``LlamaFamilyDecoderLayer``); a conv layer puts
layers/short_conv.py's ``ShortConv`` where the attention was, with the same norms and SwiGLU around it. The
attention layers keep K/V in the paged pool (``ModelConfig.kv_layer_of`` numbers them); a conv layer keeps each
token's convolution input there, a plane row per slot (cache/kv.py ``planes``), from which a sequence's state at any
position is read: the cache treats the model as it treats any other, token for token.

The checkpoint's names are translated to the family's on load: ``operator_norm`` / ``ffn_norm`` are the input and
post-attention norms, ``feed_forward.w1 / w3 / w2`` the gate / up / down projections, ``self_attn.out_proj`` and
``q_layernorm`` / ``k_layernorm`` the attention's ``o_proj`` and q/k norms, ``model.embedding_norm`` the final norm.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache
from kvreuse.kernels.quant import QuantizedTensor
from kvreuse.layers.norm import RMSNorm
from kvreuse.layers.short_conv import ConvInputs, ConvTaps, ShortConv
from kvreuse.models.config import ModelConfig
from kvreuse.models.llama import (
    LlamaFamilyDecoderLayer,
    LlamaFamilyForCausalLM,
    RecurrentDecoderLayer,
)

# LFM2's module names -> the family's (applied to the part after "model.layers.N.").
_RENAMES = (
    ("operator_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("feed_forward.w1.", "mlp.gate_proj."),
    ("feed_forward.w3.", "mlp.up_proj."),
    ("feed_forward.w2.", "mlp.down_proj."),
    ("self_attn.out_proj.", "self_attn.o_proj."),
    ("self_attn.q_layernorm.", "self_attn.q_norm."),
    ("self_attn.k_layernorm.", "self_attn.k_norm."),
)
_LAYER_PREFIX = re.compile(r"^(model\.layers\.\d+\.)(.+)$")


def family_name(name: str) -> str:
    """An LFM2 checkpoint name in the Llama family's spelling (unchanged where they agree)."""
    if name == "model.embedding_norm.weight":
        return "model.norm.weight"
    match = _LAYER_PREFIX.match(name)
    if match is None:
        return name
    prefix, rest = match.groups()
    for old, new in _RENAMES:
        if rest.startswith(old):
            return prefix + new + rest[len(old):]
    return name


def _checkpoint_tensor(name: str, tensor: torch.Tensor | QuantizedTensor) -> tuple[str, torch.Tensor | QuantizedTensor]:
    """A checkpoint's tensor under the family's name; a GGUF file's depthwise kernel ([H, K]: llama.cpp drops the
    channel axis) as HF's [H, 1, K]."""
    name = family_name(name)
    if name.endswith(".conv.conv.weight") and isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
        tensor = tensor.unsqueeze(1)
    return name, tensor


class ShortConvDecoderLayer(RecurrentDecoderLayer):
    """A conv layer: norms around the gated short convolution and the SwiGLU (HF ``Lfm2DecoderLayer``); the conv reads
    its inputs from its planes in the pool (its index among the conv layers)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        mixer = ShortConv(config.hidden_size, config.conv_kernel, config.conv_bias,
                          config.plane_layers.index(layer_idx), dtype, device)
        super().__init__(config, layer_idx, RMSNorm, "conv", mixer, dtype, device)


def _make_layer(config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend, dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    if config.is_recurrent_layer(layer_idx):
        return ShortConvDecoderLayer(config, layer_idx, dtype, device)
    return LlamaFamilyDecoderLayer(config, layer_idx, attention_backend, dtype, device)


class Lfm2ForCausalLM(LlamaFamilyForCausalLM):
    """LFM2: its attention layers keep K/V in the paged pool, its conv layers a plane row per token there."""

    make_layer = staticmethod(_make_layer)

    def recurrent_inputs(self, batch: ForwardBatch, kv_cache: KVCache) -> ConvInputs:
        if kv_cache.planes is None:
            raise ValueError("a hybrid model's pool needs its conv layers' planes (KVCache plane_layers)")
        starts = [context - length for context, length in zip(batch.context_lens, batch.query_lens)]
        taps = ConvTaps.build(batch.slot_mapping, starts, batch.query_lens, batch.block_tables, kv_cache.block_size,
                              self.config.conv_kernel, kv_cache.zero_plane_slot)
        return ConvInputs(taps, kv_cache.planes)

    def expected_weight_names(self) -> list[str]:
        """The family's names for the attention layers, the conv block's for the conv layers."""
        kinds = ("weight", "bias") if self.config.conv_bias else ("weight",)
        conv = [f"model.layers.{layer}.conv.{part}.{kind}" for layer in self.config.plane_layers
                for part in ("in_proj", "conv", "out_proj") for kind in kinds]
        return [name for name in super().expected_weight_names()
                if not (name.startswith("model.layers.") and ".self_attn." in name
                        and self.config.is_recurrent_layer(int(name.split(".")[2])))] + conv

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(_checkpoint_tensor(name, tensor) for name, tensor in weights)
