"""Nemotron-H (NVIDIA): Mamba-2 layers with a few attention layers and MLP blocks, by its pattern (issue 66's third
hybrid).

Each of its layers is one block: a norm, one mixer, the residual (transformers' ``NemotronHBlock``), the mixer a
Mamba-2 layer (layers/mamba2.py; "M" in ``hybrid_override_pattern``), grouped-query attention without rotary (the
Mamba layers carry the order; "*") or an ungated squared-ReLU MLP ("-"). The attention blocks keep K/V in the paged
pool (``ModelConfig.kv_layer_of`` numbers them); the Mamba-2 blocks keep one state per sequence in a slot of the state
pool, snapshotted for the next request on its path exactly as Qwen3.5's Gated DeltaNet layers are; the MLP blocks
keep nothing. The mixture-of-experts blocks of Nemotron 3 ("E") are refused by name (models/config.py).

Checkpoint names are transformers' (``backbone.layers.N.mixer.in_proj``, ``backbone.embeddings``,
``backbone.norm_f``: the released files' ``backbone.`` or transformers' ``model.``), translated on load to the
family's where a block is the family's (``norm`` is the input norm, an attention mixer's projections are
``self_attn``'s, an MLP mixer's ``ffn``'s).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.forward_batch import ForwardBatch, ProjectionDeltas
from kvreuse.cache.kv import KVCache
from kvreuse.kernels import fused_ops
from kvreuse.kernels import mamba2_scan as scan_kernel
from kvreuse.kernels.quant import QuantizedTensor
from kvreuse.layers.mamba2 import Mamba2Mixer
from kvreuse.layers.mlp import SquaredReLUMLP
from kvreuse.layers.norm import RMSNorm
from kvreuse.layers.recurrent import Float32Parameters, StateInputs
from kvreuse.models.config import MAMBA, MLP_BLOCK, ModelConfig
from kvreuse.models.llama import LlamaFamilyAttention, LlamaFamilyForCausalLM, RopeInputs

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class Float32ScaleRMSNorm(RMSNorm):
    """RMSNorm scaled by its weight in float32 and rounded once (transformers' ``NemotronHRMSNorm``; Llama's rounds the
    normalised x first): the fused kernel of Gemma's and Qwen3.5's norms with the weight as its float32 scale (the
    native decode step's too), its PyTorch reference where the kernel does not run. The same bits as RMSNorm in
    float32."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(size, eps, dtype, device)
        self._float32 = Float32Parameters()

    def scale(self) -> torch.Tensor:
        """The weight in float32, made once (remade where loading changes it)."""
        scale, = self._float32.get(self.weight)
        assert scale is not None
        return scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if (x.is_contiguous() and fused_ops.applies(x)
                and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype))):
            return fused_ops.rms_norm_float_scale(x, self.scale(), self.eps, residual)
        return fused_ops.reference_rms_norm_float_scale(x, self.scale(), self.eps, residual)


class UnrotatedAttention(LlamaFamilyAttention):
    """Grouped-query attention with no positional rotation (transformers' ``NemotronHAttention``: no bias, no norms)."""

    def forward(self, hidden: torch.Tensor, rope: RopeInputs, kv_cache: KVCache, attn_metadata: Any,
                lora: ProjectionDeltas | None = None) -> torch.Tensor:
        rows = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self._attend(q.reshape(rows, self.num_heads, self.head_dim).contiguous(),
                           k.reshape(rows, self.num_kv_heads, self.head_dim).contiguous(),
                           v.reshape(rows, self.num_kv_heads, self.head_dim).contiguous(), kv_cache, attn_metadata)
        return self.o_proj(out.reshape(rows, self.q_size), lora)


class AttentionBlock(nn.Module):
    attends = True
    uses_local_rope = False

    def __init__(self, config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = Float32ScaleRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = UnrotatedAttention(config, layer_idx, attention_backend, dtype, device)

    def forward(self, hidden: torch.Tensor, rope: RopeInputs, kv_cache: KVCache, attn_metadata: Any,
                lora: ProjectionDeltas | None = None) -> torch.Tensor:
        return hidden.add_(self.self_attn(self.input_layernorm(hidden), rope, kv_cache, attn_metadata, lora))


class MambaBlock(nn.Module):
    attends = False
    uses_local_rope = False

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = Float32ScaleRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mixer = Mamba2Mixer(config.hidden_size, config.mamba_heads, config.mamba_head_dim, config.mamba_groups,
                                 config.ssm_state_size, config.conv_kernel, config.conv_bias, config.mamba_bias,
                                 config.mamba_dt_limit, config.rms_norm_eps, config.state_layers.index(layer_idx),
                                 dtype, device)

    def forward(self, hidden: torch.Tensor, inputs: StateInputs, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        return hidden.add_(self.mixer(self.input_layernorm(hidden), inputs))


class MLPBlock(nn.Module):
    attends = False
    uses_local_rope = False

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = Float32ScaleRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        # Not "mlp": the family's loader reads mlp.up_proj as part of a fused gate_up_proj.
        self.ffn = SquaredReLUMLP(config.hidden_size, config.intermediate_size, False, dtype, device)

    def forward(self, hidden: torch.Tensor, inputs: StateInputs, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        return hidden.add_(self.ffn(self.input_layernorm(hidden), lora))


def _make_layer(config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend, dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    kind = config.layer_types[layer_idx]
    if kind == MAMBA:
        return MambaBlock(config, layer_idx, dtype, device)
    if kind == MLP_BLOCK:
        return MLPBlock(config, dtype, device)
    return AttentionBlock(config, layer_idx, attention_backend, dtype, device)


def family_names(weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], config: ModelConfig
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """A Nemotron-H checkpoint's tensors under this module's names (the family's where a block is the family's)."""
    for name, tensor in weights:
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        name = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"
                }.get(name, name)
        match = _LAYER.match(name)
        if match is not None:
            layer, rest = int(match.group(1)), match.group(2)
            kind = config.layer_types[layer] if layer < config.num_hidden_layers else None
            if rest == "norm.weight":
                rest = "input_layernorm.weight"
            elif rest.startswith("mixer.") and kind not in (MAMBA, None):
                rest = ("ffn." if kind == MLP_BLOCK else "self_attn.") + rest[len("mixer."):]
            name = f"model.layers.{layer}.{rest}"
        if isinstance(tensor, torch.Tensor) and ".mixer." in name:
            # A GGUF file's shapes (llama.cpp's): the depthwise kernel [C, K] without its channel axis, A_log and D
            # as [heads, 1], the grouped norm as [groups, inner / groups].
            if name.endswith("conv1d.weight") and tensor.dim() == 2:
                tensor = tensor.unsqueeze(1)
            elif name.endswith(("A_log", "D", "norm.weight")) and tensor.dim() == 2:
                tensor = tensor.reshape(-1)
        yield name, tensor


class NemotronHForCausalLM(LlamaFamilyForCausalLM):
    """Nemotron-H: K/V for its attention blocks in the paged pool, one state per sequence for its Mamba-2 blocks."""

    make_layer = staticmethod(_make_layer)

    def recurrent_inputs(self, batch: ForwardBatch, kv_cache: KVCache) -> StateInputs:
        return StateInputs.for_batch(batch, kv_cache)

    @property
    def native_step_refusal(self) -> str | None:
        """Its blocks are the native step's (runner/decode/native_step.py), Mamba-2 where the scan's kernel builds."""
        return None if scan_kernel.available() else "Mamba-2's native mixer could not be built (see the log)"

    def expected_weight_names(self) -> list[str]:
        config = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        mamba = ["in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"]
        mamba += ["conv1d.bias"] if config.conv_bias else []
        mamba += ["in_proj.bias", "out_proj.bias"] if config.mamba_bias else []
        for layer, kind in enumerate(config.layer_types):
            prefix = f"model.layers.{layer}."
            names.append(prefix + "input_layernorm.weight")
            if kind == MAMBA:
                names += [prefix + "mixer." + name for name in mamba]
            elif kind == MLP_BLOCK:
                names += [prefix + "ffn.up_proj.weight", prefix + "ffn.down_proj.weight"]
            else:
                names += [prefix + f"self_attn.{part}_proj.weight" for part in "qkvo"]
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        super().load_weights(family_names(weights, self.config))
