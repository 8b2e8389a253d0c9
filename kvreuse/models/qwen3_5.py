"""Qwen3.5 (text): Gated DeltaNet layers with one gated full-attention layer in four (issue 66's second hybrid).

An attention layer is the Llama family's with three changes (transformers' ``Qwen3_5Attention``): ``q_proj`` gives each
head's query and, beside it, a gate whose sigmoid scales the head's output before ``o_proj``; rotary turns only the
first ``rotary_dim`` of each head (a quarter); and every norm, q/k norms included, scales by (1 + weight)
(``norm_style`` "offset"). A linear-attention layer puts layers/gated_delta.py's ``GatedDeltaNet`` where the attention
was. The attention layers keep K/V in the paged pool (``ModelConfig.kv_layer_of`` numbers them); the Gated DeltaNet
layers keep one state per sequence, in a slot of the state pool (cache/recurrent_state.py), which a finished request
leaves behind as a snapshot for the next request on its path (cache/state_slots.py).

Checkpoint names are transformers' (``model.layers.N.linear_attn.in_proj_qkv`` ...); a multimodal checkpoint's
language model (``model.language_model.``) reads as the text model's, its vision tower and MTP head are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.forward_batch import ForwardBatch, ProjectionDeltas
from kvreuse.cache.kv import KVCache
from kvreuse.kernels.quant import QuantizedTensor, cat_rows
from kvreuse.layers.experts import SparseMoE
from kvreuse.layers.gated_delta import GatedDeltaNet
from kvreuse.layers.recurrent import StateInputs, sigmoid
from kvreuse.layers.linear import Linear
from kvreuse.layers.norm import GemmaRMSNorm
from kvreuse.layers.rotary import apply_rotary
from kvreuse.models.config import ModelConfig
from kvreuse.models.llama import (
    LlamaFamilyAttention,
    LlamaFamilyDecoderLayer,
    LlamaFamilyForCausalLM,
    RecurrentDecoderLayer,
    RopeInputs,
)

_SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")


class GatedAttention(LlamaFamilyAttention):
    """Full attention with an output gate per head and partial rotary."""

    def __init__(self, config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, layer_idx, attention_backend, dtype, device)
        # q_proj's rows: per head, its query then its gate (HF views them as [heads, 2 * head_dim]).
        self.qkv_proj = Linear(config.hidden_size, [2 * self.q_size, self.kv_size, self.kv_size],
                               config.attention_bias, dtype, device)
        self.rotary_dim = config.rotary_dim or config.head_dim

    def forward(self, hidden: torch.Tensor, rope: RopeInputs, kv_cache: KVCache, attn_metadata: object,
                lora: ProjectionDeltas | None = None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query_gate, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.reshape(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate[..., :self.head_dim], query_gate[..., self.head_dim:]
        assert self.q_norm is not None and self.k_norm is not None
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope.cos_sin()
        turned = self.rotary_dim
        q = torch.cat((apply_rotary(q[..., :turned], cos, sin), q[..., turned:]), dim=-1)
        k = torch.cat((apply_rotary(k[..., :turned], cos, sin), k[..., turned:]), dim=-1)
        out = self._attend(q, k, v.contiguous(), kv_cache, attn_metadata).reshape(num_tokens, self.q_size)
        out = (out * sigmoid(gate.reshape(num_tokens, self.q_size))).to(hidden.dtype)
        return self.o_proj(out, lora)


class GatedAttentionDecoderLayer(LlamaFamilyDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, layer_idx, attention_backend, dtype, device)
        self.self_attn = GatedAttention(config, layer_idx, attention_backend, dtype, device)


class GatedDeltaNetDecoderLayer(RecurrentDecoderLayer):
    """A linear-attention layer: (1 + weight) norms around the Gated DeltaNet and the SwiGLU."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        mixer = GatedDeltaNet(config.hidden_size, config.delta_key_heads, config.delta_value_heads,
                              config.delta_key_dim, config.delta_value_dim, config.conv_kernel, config.rms_norm_eps,
                              config.state_layers.index(layer_idx), dtype, device,
                              tiled_values=config.delta_tiled_values)
        super().__init__(config, layer_idx, GemmaRMSNorm, "linear_attn", mixer, dtype, device)


def _make_layer(config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend, dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    if config.is_recurrent_layer(layer_idx):
        return GatedDeltaNetDecoderLayer(config, layer_idx, dtype, device)
    return GatedAttentionDecoderLayer(config, layer_idx, attention_backend, dtype, device)


def text_model_weights(weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], config: ModelConfig
                       ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """A checkpoint's tensors under the text model's names: a multimodal file's ``model.language_model.`` read as
    ``model.``; the vision tower and the multi-token-prediction head skipped (kvreuse runs neither); Qwen3-Next's
    fused projections split into Qwen3.5's (``qwen3_next_projections``)."""
    for name, tensor in weights:
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        if name.endswith("linear_attn.conv1d.weight") and isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
            tensor = tensor.unsqueeze(1)  # a GGUF file's depthwise kernel [C, K] (llama.cpp drops the channel axis)
        if name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
            yield from qwen3_next_projections(name, tensor, config)
            continue
        yield name, tensor


def qwen3_next_projections(name: str, tensor: torch.Tensor | QuantizedTensor, config: ModelConfig
                           ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` as Qwen3.5's ``in_proj_qkv`` + ``in_proj_z`` / ``in_proj_b`` +
    ``in_proj_a``. Qwen3-Next groups the rows by key head: per key head its query, key, then the values and the
    output gates of the value heads that share it (transformers' ``fix_query_key_value_ordering``), and per key head
    its b then a rows. Qwen3.5 puts all queries, all keys, all values (value head j after head j - 1, head j sharing
    key head j // (value heads / key heads): the same order), and z, b and a each on their own."""
    key_heads, value_heads = config.delta_key_heads, config.delta_value_heads
    key_dim, value_dim, share = config.delta_key_dim, config.delta_value_dim, value_heads // key_heads
    prefix = name.rsplit(".", 2)[0]
    if isinstance(tensor, QuantizedTensor):
        # A GGUF file's ssm_ba (llama.cpp's converter splits in_proj_qkvz into Qwen3.5's q/k/v and z itself): each
        # row is its own run of blocks, so the rows are taken as they are.
        if not name.endswith("in_proj_ba.weight"):
            raise ValueError(f"weight {name!r}: a quantized fused q/k/v/z projection is not supported")
        groups_of = [(group * 2 * share, group * 2 * share + share) for group in range(key_heads)]
        yield f"{prefix}.in_proj_b.weight", cat_rows([tensor.rows(start, stop) for start, stop in groups_of])
        yield f"{prefix}.in_proj_a.weight", cat_rows([tensor.rows(stop, stop + share) for _, stop in groups_of])
        return
    groups = tensor.reshape(key_heads, -1, tensor.shape[-1])
    if name.endswith("in_proj_qkvz.weight"):
        q, k, v, z = groups.split([key_dim, key_dim, share * value_dim, share * value_dim], dim=1)
        flat = [part.reshape(-1, tensor.shape[-1]) for part in (q, k, v, z)]
        yield f"{prefix}.in_proj_qkv.weight", torch.cat(flat[:3])
        yield f"{prefix}.in_proj_z.weight", flat[3]
        return
    b, a = groups.split([share, share], dim=1)
    yield f"{prefix}.in_proj_b.weight", b.reshape(-1, tensor.shape[-1])
    yield f"{prefix}.in_proj_a.weight", a.reshape(-1, tensor.shape[-1])


class Qwen3_5ForCausalLM(LlamaFamilyForCausalLM):
    """Qwen3.5: K/V for its attention layers in the paged pool, one state per sequence for its Gated DeltaNet layers.
    Qwen3.5-MoE and Qwen3-Next are this class with experts for MLPs (``ModelConfig.moe``)."""

    make_layer = staticmethod(_make_layer)

    def recurrent_inputs(self, batch: ForwardBatch, kv_cache: KVCache) -> StateInputs:
        return StateInputs.for_batch(batch, kv_cache)

    @property
    def native_step_refusal(self) -> str | None:
        """Its gated attention, (1 + weight) norms and Gated DeltaNet layers are the native step's too
        (runner/decode/native_step.py); experts without their native layer are not."""
        if any(isinstance(layer.mlp, SparseMoE) and layer.mlp.native is None for layer in self.model.layers):
            return "mixture-of-experts layers without their native layer run op by op"
        return None

    def expected_weight_names(self) -> list[str]:
        """The family's names for the attention layers (q/k norms included), the Gated DeltaNet's for the others."""
        delta = [f"model.layers.{layer}.linear_attn.{name}" for layer in self.config.state_layers
                 for name in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                              "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")]
        return [name for name in super().expected_weight_names()
                if not (name.startswith("model.layers.") and ".self_attn." in name
                        and self.config.is_recurrent_layer(int(name.split(".")[2])))] + delta

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(text_model_weights(weights, self.config))
