"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3, gpt-oss) as one pure-PyTorch model
over a paged KV cache.

These architectures differ only in switches that ``ModelConfig`` carries (q/k/v bias, q/k RMSNorm,
rope scaling, tied embeddings; mixture-of-experts layers (layers/experts.py); layers that attend over a window
with their own rope base; Gemma's (1 + weight) norms around both blocks, its embedding and query scales and
tanh-GELU; gpt-oss's learned sinks, output-projection bias and biased, clamped experts), so one class serves them all and the engine never branches on the architecture. The model works on a flat batch of tokens from many sequences (``input_ids [T]``,
``positions [T]``) and leaves everything about sequences to the attention backend's metadata; it
returns hidden states and only turns the rows that are sampled into logits, because the vocabulary
projection (up to 152k columns) dominates the cost of a short step. ``load_weights`` maps Hugging
Face parameter names onto the fused q/k/v and gate/up projections, one tensor at a time.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from kvreuse.attention.backend import AttentionBackend, LayerAttention
from kvreuse.attention.blend import Narrowing
from kvreuse.attention.forward_batch import ProjectionDeltas
from kvreuse.attention.torch_paged import TorchPagedAttention
from kvreuse.cache.kv import KVCache
from kvreuse.kernels import fused_ops, qpacked, quant_ops
from kvreuse.kernels.qpacked import PackedWeight
from kvreuse.kernels.quant import QuantizedTensor, quantize_int8, repack_gguf
from kvreuse.layers import quantized_linear
from kvreuse.layers.embedding import QuantizedEmbedding
from kvreuse.layers.experts import SparseMoE
from kvreuse.layers.linear import Linear
from kvreuse.layers.mlp import GatedMLP
from kvreuse.layers.norm import GemmaRMSNorm, RMSNorm
from kvreuse.layers.plan_book import (
    LinearKernel,
    PlanBook,
    invariant_plan,
    layouts_allowed,
)
from kvreuse.layers.quantized_linear import QuantizedLinearKernel
from kvreuse.layers.rotary import RotaryEmbedding, apply_rotary
from kvreuse.models.config import ModelConfig

logger = logging.getLogger(__name__)

class NativeLayers(Protocol):
    """All of a step's decoder layers in one native call: what the runner hands ``forward`` where its decode
    paths chose the native CPU step for the step (runner/decode/paths.py; native_step.py's ``HeldLayers``)."""

    def run(self, hidden: torch.Tensor, rope: Any, metadata: Any, first: int, last: int, recurrent: Any = None
            ) -> None: ...


class RopeInputs:
    """What every layer's rotary needs, made once per forward: the positions, and either the fused kernel's
    float32 tables (``fused``: kernels/fused_ops.py rotates in place) or cos / sin in the activation dtype,
    gathered on first use and shared by every layer."""

    def __init__(self, positions: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype, fused: bool) -> None:
        self.positions = positions
        self.rotary = rotary
        self.dtype = dtype
        self.fused: RotaryEmbedding | None = rotary if fused else None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None:
            self._cos_sin = self.rotary.cos_sin(self.positions, self.dtype)
        return self._cos_sin


class LlamaFamilyAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Where its K/V sit in the pool: a hybrid's recurrent layers keep none, so the attention layers are numbered
        # apart (config.kv_layer_of); the layer's own index for every other model.
        self.kv_layer = config.kv_layer_of(layer_idx)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.attention_backend = attention_backend
        self.qkv_proj = Linear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], config.attention_bias, dtype, device
        )
        self.o_proj = Linear(self.q_size, [config.hidden_size], config.o_proj_bias, dtype, device)
        self.qkv_proj.lora_layer, self.qkv_proj.lora_modules = layer_idx, ("q_proj", "k_proj", "v_proj")
        self.o_proj.lora_layer, self.o_proj.lora_modules = layer_idx, ("o_proj",)
        norm = _norm_class(config)
        if config.qk_norm:
            self.q_norm: RMSNorm | GemmaRMSNorm | None = norm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm: RMSNorm | GemmaRMSNorm | None = norm(self.head_dim, config.rms_norm_eps, dtype, device)
        else:
            self.q_norm = None
            self.k_norm = None
        # The fused rotary kernel applies Llama-style q/k norms only.
        self.fuses_rotary = config.norm_style == "llama"
        # This layer's window and softmax scale, handed to the backend on every call. A window every layer
        # shares (Mistral) caps max_model_len at it instead (engine/builder.py), where it equals full attention.
        window = config.layer_window(layer_idx) if config.layer_types else None
        # gpt-oss: a learned logit per head in the softmax's denominator (HF ``self_attn.sinks``), held in float32
        # whatever the model's dtype (the backends take it so; a bf16 checkpoint's values convert exactly).
        self.sinks: nn.Parameter | None = None
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32, device=device),
                                      requires_grad=False)
        # The backend reads the sinks parameter itself, so the loader's in-place copy reaches it.
        self.layer_attention = LayerAttention(sliding_window=window, scale=config.attention_scale, sinks=self.sinks)
        self.uses_local_rope = config.rope_local_theta is not None and window is not None

    def forward(
        self, hidden: torch.Tensor, rope: RopeInputs, kv_cache: KVCache, attn_metadata: Any,
        lora: ProjectionDeltas | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden, lora)
        if rope.fused is not None and qkv.stride(-1) == 1 and self.fuses_rotary:
            # q/k norms and rotary in one pass over the fused rows, in place (kernels/fused_ops.py).
            table = rope.fused
            fused_ops.rotary_(qkv, table.cos_cache, table.sin_cache, rope.positions, self.num_heads,
                              self.num_kv_heads, self.head_dim,
                              self.q_norm.weight if self.q_norm is not None else None,
                              self.k_norm.weight if self.k_norm is not None else None,
                              self.q_norm.eps if self.q_norm is not None else 0.0)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            out = self._attend(q.view(num_tokens, self.num_heads, self.head_dim),
                               k.view(num_tokens, self.num_kv_heads, self.head_dim),
                               v.view(num_tokens, self.num_kv_heads, self.head_dim), kv_cache, attn_metadata)
            return self.o_proj(out.reshape(num_tokens, self.q_size), lora)
        cos, sin = rope.cos_sin()
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = self._attend(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size), lora)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                attn_metadata: Any) -> torch.Tensor:
        if self.layer_attention.is_plain:
            return self.attention_backend.forward(self.kv_layer, q, k, v, kv_cache, attn_metadata)
        return self.attention_backend.forward(self.kv_layer, q, k, v, kv_cache, attn_metadata,
                                              layer=self.layer_attention)


def _norm_class(config: ModelConfig) -> type[RMSNorm] | type[GemmaRMSNorm]:
    return GemmaRMSNorm if config.norm_style in ("gemma", "offset") else RMSNorm


def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> GatedMLP | SparseMoE:
    """Layer ``layer_idx``'s MLP: its experts where the config makes it sparse, else the dense SwiGLU."""
    if config.is_sparse_layer(layer_idx):
        assert config.moe is not None
        return SparseMoE(config.hidden_size, config.moe, config.hidden_act, dtype, device)
    return GatedMLP(config.hidden_size, config.intermediate_size, dtype, device, config.hidden_act)


class LlamaFamilyDecoderLayer(nn.Module):
    # An attention layer: its past is K/V in the pool, and the forward hands it the rope, the pool and the backend's
    # metadata. A layer that attends to nothing (a hybrid's recurrent layers, Nemotron-H's MLP blocks) gets what the
    # model's ``recurrent_inputs`` made for the step instead.
    attends = True

    def __init__(
        self, config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        norm = _norm_class(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = norm(size, eps, dtype, device)
        self.self_attn = LlamaFamilyAttention(config, layer_idx, attention_backend, dtype, device)
        self.post_attention_layernorm = norm(size, eps, dtype, device)
        self.uses_local_rope = self.self_attn.uses_local_rope
        # Gemma normalises each block's output too (post_attention_layernorm is then the attention's own norm).
        self.sandwich_norms = config.norm_style == "gemma"
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm(size, eps, dtype, device)
            self.post_feedforward_layernorm = norm(size, eps, dtype, device)
        self.mlp = make_mlp(config, layer_idx, dtype, device)
        if isinstance(self.mlp, GatedMLP):
            self.mlp.gate_up_proj.lora_layer, self.mlp.gate_up_proj.lora_modules = layer_idx, ("gate_proj", "up_proj")
            self.mlp.down_proj.lora_layer, self.mlp.down_proj.lora_modules = layer_idx, ("down_proj",)

    def forward(
        self, hidden: torch.Tensor, rope: RopeInputs, kv_cache: KVCache, attn_metadata: Any,
        lora: ProjectionDeltas | None = None,
    ) -> torch.Tensor:
        # The residual stream is owned by the model forward, so it is updated in place: the attention's output
        # is added by the post-attention norm (one pass), the MLP's here.
        attention = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, attn_metadata, lora)
        if self.sandwich_norms:
            hidden.add_(self.post_attention_layernorm(attention))
            mlp = self.mlp(self.pre_feedforward_layernorm(hidden), lora)
            return hidden.add_(self.post_feedforward_layernorm(mlp))
        return hidden.add_(self.mlp(self.post_attention_layernorm(hidden, residual=attention), lora))


class RecurrentDecoderLayer(nn.Module):
    """A hybrid's layer without attention (LFM2's short convolution, Qwen3.5's Gated DeltaNet): norm, a recurrent
    mixer in the attention's place, residual; norm, SwiGLU, residual. The family's forward calls it with what the
    model's ``recurrent_inputs`` made for the step; ``mixer_name`` is the mixer's name in the checkpoint."""

    attends = False
    uses_local_rope = False

    def __init__(self, config: ModelConfig, layer_idx: int, norm: type[RMSNorm] | type[GemmaRMSNorm],
                 mixer_name: str, mixer: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.mixer_name = mixer_name
        self.input_layernorm = norm(size, eps, dtype, device)
        self.add_module(mixer_name, mixer)
        self.post_attention_layernorm = norm(size, eps, dtype, device)
        self.mlp = make_mlp(config, layer_idx, dtype, device)  # Qwen3.5-MoE's: its experts

    def forward(self, hidden: torch.Tensor, recurrent: Any, lora: ProjectionDeltas | None = None) -> torch.Tensor:
        mixed = getattr(self, self.mixer_name)(self.input_layernorm(hidden), recurrent)
        return hidden.add_(self.mlp(self.post_attention_layernorm(hidden, residual=mixed), lora))


class DecoderLayerFactory(Protocol):
    """Builds decoder layer ``layer_idx``: a family whose layers differ (a hybrid's recurrent ones) passes its own."""

    def __call__(self, config: ModelConfig, layer_idx: int, attention_backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> nn.Module: ...


class LlamaFamilyModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(
        self, config: ModelConfig, attention_backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
        make_layer: DecoderLayerFactory = LlamaFamilyDecoderLayer,
    ) -> None:
        super().__init__()
        # Allocated, not initialised (as every layer's weights): the loader fills it, or replaces it with a
        # quantized table, so nothing touches its pages before then (nn.Embedding's own init would: a
        # transient ~110 MB for a 49k x 576 float32 table that a GGUF load then drops).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), _freeze=True)
        self.layers = nn.ModuleList(
            make_layer(config, index, attention_backend, dtype, device) for index in range(config.num_hidden_layers)
        )
        self.norm = _norm_class(config)(config.hidden_size, config.rms_norm_eps, dtype, device)


# HF checkpoint name -> (our parameter name, part index within a fused parameter or None).
_FUSED_PARTS: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),  # Qwen3.5-MoE's shared expert
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
    # Qwen3.5's Gated DeltaNet (layers/gated_delta.py)
    "linear_attn.in_proj_qkv": ("linear_attn.in_proj", 0),
    "linear_attn.in_proj_z": ("linear_attn.in_proj", 1),
    "linear_attn.in_proj_b": ("linear_attn.in_proj", 2),
    "linear_attn.in_proj_a": ("linear_attn.in_proj", 3),
}
def _fused_part(module: str) -> tuple[str, int] | None:
    """(our fused module, part index) for an HF module name that is part of a fused projection."""
    if module in _FUSED_PARTS:
        return _FUSED_PARTS[module]
    match = _EXPERT_PART.match(module)
    if match is not None:
        return f"mlp.experts.{match.group(1)}.gate_up_proj", 0 if match.group(2) == "gate" else 1
    return None


_EXPERT_PART = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up)_proj$")
# transformers 5 holds a layer's experts stacked: gate|up [E, 2I, H] and down [E, H, I] (split per expert here).
_STACKED_EXPERTS = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# Buffers some older checkpoints saved; recomputed here, so skipped rather than rejected.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaFamilyForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        attention_backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.attention_backend = attention_backend or TorchPagedAttention()
        self.model = LlamaFamilyModel(config, self.attention_backend, dtype, device, self.make_layer)
        # Over the first rotary_dim of each head where that is less (Qwen3.5's partial rotary).
        self.rotary = RotaryEmbedding(
            config.rotary_dim or config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling, device
        )
        # Gemma 3's sliding layers rotate with their own base (10,000 against the global layers' 1,000,000).
        self.local_rotary: RotaryEmbedding | None = None
        if config.rope_local_theta is not None:
            self.local_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                                config.rope_local_theta, None, device)
        # transformers multiplies by the scale rounded to the weights' dtype (Gemma: sqrt(hidden_size)).
        self.embedding_scale = (None if config.embedding_scale is None
                                else torch.tensor(config.embedding_scale, dtype=dtype, device=device))
        # Tied models reuse the embedding matrix as the output projection (no lm_head parameter).
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, [config.vocab_size], False, dtype, device)
        self._tied_head_kernel: LinearKernel | QuantizedLinearKernel | None = None  # see choose_cpu_kernels
        self.cpu_kernel_extra_bytes = 0  # memory the chosen kernels' weight layouts add (choose_cpu_kernels)

    make_layer: DecoderLayerFactory = LlamaFamilyDecoderLayer

    def set_attention_backend(self, attention_backend: AttentionBackend) -> None:
        """Route every layer's attention through ``attention_backend`` from the next forward on."""
        self.attention_backend = attention_backend
        for layer in self.model.layers:
            if layer.attends:
                layer.self_attn.attention_backend = attention_backend

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection's float weight (dequantized where it is held quantized)."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        if self.lm_head.quantized is not None:
            return torch.cat([quantized_linear.dequantize_any(part) for part in self.lm_head.quantized]).to(self.dtype)
        return self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache, attn_metadata: Any,
        lora: ProjectionDeltas | None = None, aux_layers: tuple[int, ...] = (), aux_out: list[torch.Tensor] | None = None,
        narrowing: Narrowing | None = None, native: NativeLayers | None = None, recurrent: Any = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (K/V of the tokens stored);
        ``lora`` adds each adapter's deltas to its own token rows. For each layer index in ``aux_layers``
        a copy of the residual stream entering that layer is appended to ``aux_out`` (EAGLE-3's features).
        ``narrowing`` (a blended prefill, attention/blend.py): from layer ``narrowing.at_layer`` on only the rows
        it keeps run, and the hidden states returned are theirs. ``native``: the step's decoder layers held in C++
        (the decode paths' choice, runner/decode/paths.py), run in place of the Python layers. ``recurrent``: what
        a hybrid's recurrent layers read (``recurrent_inputs``: where each sequence's state is), else None.

        Positions must be below ``max_position_embeddings`` (the runner checks, without a device sync).
        """
        hidden = self.model.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        fused = fused_ops.applies(hidden)
        rope = RopeInputs(positions, self.rotary, hidden.dtype, fused)  # shared by every layer
        local_rope = rope if self.local_rotary is None else RopeInputs(positions, self.local_rotary, hidden.dtype, fused)
        captured: dict[int, torch.Tensor] = {}
        if native is not None:  # every layer in one native call, in stretches between the captured layers
            first = 0
            for index in sorted(aux_layers):
                native.run(hidden, rope, attn_metadata, first, index, recurrent)
                captured[index] = hidden.clone()  # the layers update the residual stream in place
                first = index
            native.run(hidden, rope, attn_metadata, first, len(self.model.layers), recurrent)
        else:
            for index, layer in enumerate(self.model.layers):
                if narrowing is not None and index == narrowing.at_layer:
                    keep, narrowed, attn_metadata = narrowing.apply()
                    hidden, lora = hidden.index_select(0, keep), narrowed.lora
                    rope = RopeInputs(narrowed.positions, self.rotary, hidden.dtype, fused)
                    local_rope = rope if self.local_rotary is None else RopeInputs(narrowed.positions, self.local_rotary,
                                                                                   hidden.dtype, fused)
                if index in aux_layers:
                    captured[index] = hidden.clone()
                if not layer.attends:
                    hidden = layer(hidden, recurrent, lora)
                    continue
                layer_rope = local_rope if layer.uses_local_rope else rope
                hidden = layer(hidden, layer_rope, kv_caches, attn_metadata, lora)
        if aux_out is not None:
            aux_out.extend(captured[index] for index in aux_layers)
        return self.model.norm(hidden)

    def recurrent_inputs(self, batch: Any, kv_cache: KVCache) -> None:
        """What a hybrid's recurrent layers read in ``batch``'s step (models/lfm2.py); None here."""
        return None

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """hidden_rows [N, hidden] -> logits [N, vocab] in float32."""
        if self.lm_head is not None:
            return self.lm_head(hidden_rows).float()
        if self._tied_head_kernel is not None:
            return self._tied_head_kernel(hidden_rows).float()
        return torch.nn.functional.linear(hidden_rows, self.lm_head_weight).float()

    def choose_cpu_kernels(self, book: PlanBook | None = None, batch_invariant: bool = False) -> int:
        """Give every linear layer (and a tied output projection) the CPU kernel(s) measured fastest for
        its shape (layers/plan_book.py). Call after loading; returns how many matrices left plain F.linear.
        A tied output projection keeps the embedding (the lookup needs it) next to its other layout.
        ``batch_invariant``: every product, the output projection's included, on the one kernel of its weight
        format that gives a row the same bits at any row count (kernels.invariant_plan, quantized_linear.invariant_plan),
        nothing measured."""
        book = book or PlanBook()
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        embed_tokens = self.model.embed_tokens
        embedding = None if isinstance(embed_tokens, QuantizedEmbedding) else embed_tokens.weight
        tied = [embedding] if self.lm_head is None and embedding is not None else []
        max_layouts = 1 if batch_invariant else layouts_allowed(book, [m.weight for m in linears], kept=tied)
        changed = sum(module.choose_cpu_kernel(book, max_layouts, batch_invariant) for module in linears)
        # Memory beyond one copy of each weight: a layer's second layout, or the tied head's own layouts
        # (the embedding stays for the lookup).
        extra = sum(m.kernel.layout_bytes - m.kernel.weight_bytes for m in linears if m.kernel is not None)
        if self.lm_head is None and embedding is None:  # a quantized table: the head (made at load) reads it in place
            head = self._tied_head_kernel
            if batch_invariant:  # the head's own packed copy (the lookup keeps reading the table)
                head.parts = quantized_linear.invariant_parts(head.parts)
                extra += sum(part.nbytes for part in head.parts if part is not embed_tokens.quantized)
            head.plans = [quantized_linear.invariant_plan(head.parts[0], self.dtype) if batch_invariant else
                          quantized_linear.plan_for(book, embed_tokens.quantized, self.dtype)]
            changed += 1
        elif self.lm_head is None and embedding.device.type == "cpu":
            plan = (invariant_plan(embedding.dtype) if batch_invariant
                    else book.plan_for(embedding.dtype, tuple(embedding.shape), max_layouts))
            if not plan.is_plain:
                self._tied_head_kernel = LinearKernel(embedding.detach(), None, plan)
                changed += 1
                extra += self._tied_head_kernel.layout_bytes - (
                    self._tied_head_kernel.weight_bytes if "plain" in plan.layouts else 0)
        book.save()
        self.cpu_kernel_extra_bytes = extra
        moe_layers = [module for module in self.modules() if isinstance(module, SparseMoE)]
        if moe_layers:
            refusals = {module.prepare_native() for module in moe_layers}
            rows = min(module.native_max_rows for module in moe_layers)
            logger.info("mixture-of-experts layers: %s", "one native call per layer for steps of up to %d rows"
                        % rows if refusals == {None} else
                        "from Python (%s)" % ", ".join(sorted(str(reason) for reason in refusals if reason)))
        logger.info("CPU linear kernels: %d matrices off plain F.linear, %.0f MiB in second weight layouts",
                    changed, extra / 2**20)
        return changed

    def _quantized_plans_pick(self, name: str) -> bool:
        """Whether some quantized product's plan picks kernel ``name`` for some row count."""
        kernels = [module.kernel for module in self.modules() if isinstance(module, Linear)]
        return any(isinstance(kernel, QuantizedLinearKernel) and any(name in plan.kernels for plan in kernel.plans)
                   for kernel in kernels)

    def runs_int8_activations(self) -> bool:
        """Whether a quantized product's plan picks qdot8 (inputs rounded to int8) for some row count: the
        K/V it computes then differ from the exact products' (the engine's fingerprint says so)."""
        return self._quantized_plans_pick("qdot8")

    def products_run_packed(self) -> bool:
        """Whether every product (the output projection's included) can run on the packed int8 kernel
        (kernels/qpacked.py): each linear layer held quantized in a format it runs, and a tied head's table too."""
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        parts = [part for module in linears for part in (module.quantized or [None])]
        if self.lm_head is None:
            embed_tokens = self.model.embed_tokens
            parts.append(embed_tokens.quantized if isinstance(embed_tokens, QuantizedEmbedding) else None)
        return all(part is not None and qpacked.runs(part) for part in parts)

    def runs_packed_products(self) -> bool:
        """Whether a quantized product runs on the packed int8 kernel (batch-invariant mode, kernels/qpacked.py): its own
        arithmetic, so other K/V than qdot8's (the fingerprint says so)."""
        return self._quantized_plans_pick("qpacked8") or (
            self._tied_head_kernel is not None and "qpacked8" in self._tied_head_kernel.plan.kernels)

    def float_product_kernels(self) -> tuple[str, ...]:
        """The kernels float weights' plans pick at some row count (layers/plan_book.py; "plain" where a layer
        has no plan): each sums its products in its own order, so the K/V it computes differ from another's by
        rounding, and the choice is measured per machine (the engine's fingerprint names them)."""
        kernels = {name for module in self.modules() if isinstance(module, Linear)
                   if isinstance(module.kernel, LinearKernel) for name in module.kernel.plan.kernels}
        if any(isinstance(module, Linear) and module.kernel is None and module.quantized is None
               for module in self.modules()):
            kernels.add("plain")
        if isinstance(self._tied_head_kernel, LinearKernel):
            kernels.update(self._tied_head_kernel.plan.kernels)
        return tuple(sorted(kernels))

    def runs_bf16_tiles(self) -> bool:
        """Whether a quantized product's plan picks qtile_bf16 (dequantized tiles rounded to bfloat16) for
        some row count: the K/V its prefills compute then differ from qtile's (the fingerprint says so)."""
        return self._quantized_plans_pick("qtile_bf16")

    def weight_memory_bytes(self) -> int:
        """Bytes the weights take as held: each linear layer in its kernel layouts (quantized blocks or
        float), the embedding table (quantized or float), norms and biases, and a tied head's own layouts."""
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        in_layouts = {id(module.weight) for module in linears if module.weight is not None}  # in weight_bytes
        total = sum(module.weight_bytes for module in linears)
        # Every other parameter: a float embedding table, norms, biases.
        total += sum(p.numel() * p.element_size() for p in self.parameters() if id(p) not in in_layouts)
        if isinstance(self.model.embed_tokens, QuantizedEmbedding):  # held outside the parameters
            total += self.model.embed_tokens.quantized.nbytes
        if isinstance(self._tied_head_kernel, LinearKernel):  # its layouts beside the embedding kept for lookups
            total += self._tied_head_kernel.layout_bytes - (
                self._tied_head_kernel.weight_bytes if "plain" in self._tied_head_kernel.plan.layouts else 0)
        elif isinstance(self._tied_head_kernel, QuantizedLinearKernel):  # a packed copy of the table (qpacked)
            total += sum(part.nbytes for part in self._tied_head_kernel.parts if isinstance(part, PackedWeight))
        return total

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the weights are held in, as `weight_memory_bytes` counts them: the linear layers'
        kernel layouts or quantized blocks, the parameters, a quantized embedding table and a tied head's own
        layouts (views of one storage may appear more than once)."""
        kernels: list[Any] = [module.kernel for module in self.modules() if isinstance(module, Linear)]
        kernels.append(self._tied_head_kernel)
        tensors = [p.detach() for p in self.parameters()]
        if isinstance(self.model.embed_tokens, QuantizedEmbedding):
            tensors.append(self.model.embed_tokens.quantized.data)
        for kernel in kernels:
            if isinstance(kernel, QuantizedLinearKernel):
                tensors += [part if isinstance(part, torch.Tensor) else part.data for part in kernel.parts]
            elif isinstance(kernel, LinearKernel):
                tensors += list(kernel.layouts.values())
        return tensors

    # ---- weights -------------------------------------------------------------------------------

    def expected_weight_names(self) -> list[str]:
        """The HF checkpoint names this model needs, in a stable order."""
        config = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        per_layer = [
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
        ]
        if config.norm_style == "gemma":
            per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
        if config.attention_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if config.o_proj_bias:
            per_layer.append("self_attn.o_proj.bias")
        if config.attention_sinks:
            per_layer.append("self_attn.sinks")
        if config.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        dense_mlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        experts: list[str] = []
        if config.moe is not None:
            router = "mlp.router" if config.moe.router_bias else "mlp.gate"
            kinds = ("weight", "bias") if config.moe.expert_bias else ("weight",)
            experts = [f"{router}.weight"] + ([f"{router}.bias"] if config.moe.router_bias else []) + [
                f"mlp.experts.{expert}.{part}_proj.{kind}"
                for expert in range(config.moe.num_experts) for part in ("gate", "up", "down") for kind in kinds]
            if config.moe.shared_expert_intermediate_size:
                experts += [f"mlp.shared_expert.{part}_proj.weight" for part in ("gate", "up", "down")]
                experts.append("mlp.shared_expert_gate.weight")
        for index in range(config.num_hidden_layers):
            mlp = experts if config.is_sparse_layer(index) else dense_mlp
            names.extend(f"model.layers.{index}.{suffix}" for suffix in per_layer + mlp)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every expected name exactly once.

        A ``QuantizedTensor`` (a GGUF tensor repacked, kernels/quant.py) is held quantized: a linear
        layer's weight or part of one (``Linear.set_quantized`` once all its parts are in; a part given
        as a float tensor stays float beside the quantized ones), or the embedding table
        (``QuantizedEmbedding``, which a tied output projection reads too).
        Raises ValueError naming the first unexpected weight, a shape mismatch, or the missing ones.
        """
        parameters = dict(self.named_parameters())
        expected = set(self.expected_weight_names())
        loaded: set[str] = set()
        quantized: dict[Linear, dict[int, QuantizedTensor]] = {}
        # An MXFP4 folder's experts stay MXFP4 (quantized kernels on CPU), else they are dequantized.
        keep_mxfp4 = self.model.embed_tokens.weight.device.type == "cpu" and quant_ops.available()
        for name, tensor in _per_expert(weights, self.config, keep_mxfp4):
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            if name not in expected:
                raise ValueError(f"unexpected weight {name!r} in checkpoint for {self.config.architecture}")
            if isinstance(tensor, QuantizedTensor):
                self._load_quantized(name, tensor, quantized)
                loaded.add(name)
                continue
            target, rows = self._target_of(name, parameters)
            destination = target.data if rows is None else target.data[rows]
            if tuple(tensor.shape) != tuple(destination.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.add(name)
        missing = [name for name in self.expected_weight_names() if name not in loaded]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"missing weight(s) in checkpoint: {shown}")
        for linear, parts in quantized.items():
            # A part that came as a float tensor was copied into the float weight: it stays float.
            linear.set_quantized([parts[index] if index in parts else linear.weight.data[linear.part_rows(index)].clone()
                                  for index in range(len(linear.output_sizes))])

    def _load_quantized(self, name: str, tensor: QuantizedTensor, pending: dict[Linear, dict[int, QuantizedTensor]]) -> None:
        if name == "model.embed_tokens.weight":
            embedding = self.model.embed_tokens
            if tensor.shape != tuple(embedding.weight.shape):
                raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected {tuple(embedding.weight.shape)}")
            if embedding.weight.device.type == "cpu" and quant_ops.available():
                self.model.embed_tokens = QuantizedEmbedding(tensor, self.dtype)
                if self.lm_head is None:  # tied: the output projection reads the same table
                    self._tied_head_kernel = QuantizedLinearKernel([tensor], None)
            else:  # the quantized kernels cannot run here: the table dequantized, as a float checkpoint's
                embedding.weight.data.copy_(quantized_linear.dequantize_any(tensor))
            return
        linear, part = self._linear_of(name)
        if linear is None:
            raise ValueError(f"weight {name!r} is quantized ({tensor.format.name}); only linear layers' weights "
                             "and the embedding can be held quantized")
        expected = (linear.output_sizes[part], linear.input_size)
        if tensor.shape != expected:
            raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected {expected}")
        pending.setdefault(linear, {})[part] = tensor

    def _linear_of(self, name: str) -> tuple[Linear | None, int]:
        """The linear layer whose weight (or fused part of it) ``name`` is, and the part's index."""
        if name == "lm_head.weight":
            return self.lm_head, 0
        match = _LAYER_NAME.match(name)
        if match is None or match.group(3) != "weight":
            return None, 0
        layer, module, _ = match.groups()
        fused_module, part = _fused_part(module) or (module, 0)
        linear = self.model.layers[int(layer)].get_submodule(fused_module)
        return (linear, part) if isinstance(linear, Linear) else (None, 0)

    def rotary_for_layer(self, layer: int) -> RotaryEmbedding:
        """The table layer ``layer`` rotates its K with: Gemma 3's sliding layers have their own base."""
        if self.local_rotary is not None and self.model.layers[layer].uses_local_rope:
            return self.local_rotary
        return self.rotary

    def rotary_tables(self) -> list[RotaryEmbedding]:
        """Each layer's rotary table, in layer order (what attention/rope_shift.py's ``move_kv`` turns K with)."""
        return [self.rotary_for_layer(layer) for layer in range(len(self.model.layers))]

    @property
    def native_step_refusal(self) -> str | None:
        """Why the native decode step (runner/decode/native_step.py: Llama-shaped layers only) cannot run this model's
        layers, or None where it can."""
        if any(isinstance(layer.mlp, SparseMoE) and layer.mlp.native is None for layer in self.model.layers):
            return "mixture-of-experts layers without their native layer run op by op"
        if self.config.norm_style != "llama":
            return "Gemma's norms run op by op"
        return None  # windows, scales, sinks and o_proj's bias go to DecodeLayers.set_attention

    def quantize_int8(self) -> int:
        """Quantize every linear layer's float weight to int8 (kernels/quant.py's q8_0 layout: a fp16 scale
        per 32 values), in place: ``quantization="int8"``. The embedding, and a tied output projection
        with it, stay in the model's dtype (the lookup reads the table). Returns the matrices quantized;
        a layer whose width is not a multiple of 32 stays float."""
        count = 0
        for module in self.modules():
            if (isinstance(module, Linear) and module.weight is not None and module.input_size % 32 == 0
                    and not module.keep_float):
                module.set_quantized([quantize_int8(module.weight.data)])
                count += 1
        return count

    def _target_of(self, name: str, parameters: dict[str, nn.Parameter]) -> tuple[nn.Parameter, slice | None]:
        match = _LAYER_NAME.match(name)
        if match is not None:
            layer, module, kind = match.groups()
            fused = _fused_part(module)
            if fused is not None:
                fused_module, part = fused
                parameter = parameters[f"model.layers.{layer}.{fused_module}.{kind}"]
                linear = self.model.layers[int(layer)].get_submodule(fused_module)
                return parameter, linear.part_rows(part)
        return parameters[name], None

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for benchmarks and tests: normal(0, 0.02) matrices and biases, norms = 1."""
        generator = torch.Generator(device=self.model.embed_tokens.weight.device)
        generator.manual_seed(seed)
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):
                # A unit scale: Gemma's and Qwen3.5's norms store it as 0 (they multiply by 1 + weight); a gated
                # DeltaNet's output norm multiplies by its weight.
                offset = self.config.norm_style in ("gemma", "offset") and not name.endswith("linear_attn.norm.weight")
                parameter.data.fill_(0.0 if offset else 1.0)
            else:
                parameter.data.normal_(0.0, 0.02, generator=generator)


def _per_expert(weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], config: ModelConfig,
                keep_mxfp4: bool = False) -> Iterable[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's tensors, with a layer's stacked experts split into per-expert names
    (``mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}``), the names Qwen3-MoE checkpoints are saved with:

    - transformers 5's Qwen3-MoE: ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows), ``down_proj`` [E, H, I];
    - gpt-oss: ``gate_up_proj`` [E, H, 2I] with gate and up interleaved along the last dim (gate the even
      columns, up the odd), ``gate_up_proj_bias`` [E, 2I] likewise, ``down_proj`` [E, I, H], ``down_proj_bias``
      [E, H] (transformers computes x @ W + b, so each matrix is transposed into a Linear's [out, in]);
    - gpt-oss's MXFP4 folders: ``gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` / ``_scales``,
      once both halves of a pair have been read: held as MXFP4 (``mxfp4_experts``: kernels/quant.py's layout,
      4.25 bits a weight) where ``keep_mxfp4`` (CPU, the quantized kernels built), else dequantized
      (``dequantize_mxfp4``): already [E, out, in]."""
    gpt_oss = config.architecture == "GptOssForCausalLM"
    pending: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 pair waiting for its other half
    for name, tensor in weights:
        match = _STACKED_EXPERTS.match(name)
        if match is None or config.moe is None or isinstance(tensor, QuantizedTensor):
            yield name, tensor
            continue
        layer, kind, suffix = match.groups()
        if suffix in ("_blocks", "_scales"):
            if not gpt_oss:
                raise ValueError(f"weight {name!r} is MXFP4 blocks / scales, which only gpt-oss checkpoints hold")
            halves = pending.setdefault(f"{layer}.{kind}", {})
            halves[suffix] = tensor
            if len(halves) < 2:
                continue
            del pending[f"{layer}.{kind}"]
            if keep_mxfp4:
                yield from mxfp4_experts(layer, kind, halves["_blocks"], halves["_scales"], config)
                continue
            stacked = dequantize_mxfp4(halves["_blocks"], halves["_scales"], name.removesuffix(suffix))
            yield from _split_stacked(layer, kind, "", stacked, config, transposed=False)
            continue
        yield from _split_stacked(layer, kind, suffix, tensor, config, transposed=gpt_oss)
    if pending:
        key, halves = next(iter(pending.items()))
        layer, kind = key.split(".")
        missing = "_scales" if "_blocks" in halves else "_blocks"
        raise ValueError(f"missing weight(s) in checkpoint: model.layers.{layer}.mlp.experts.{kind}{missing} "
                         f"(MXFP4 blocks and scales come in pairs)")


def _split_stacked(layer: str, kind: str, suffix: str, tensor: torch.Tensor, config: ModelConfig,
                   transposed: bool) -> Iterable[tuple[str, torch.Tensor]]:
    """One stacked experts tensor as per-expert tensors. ``transposed``: gpt-oss's [E, in, out] matrices
    (and its interleaved gate / up); otherwise [E, out, in] with gate rows before up rows, except that an
    MXFP4 pair (gpt-oss, dequantized to [E, out, in]) is interleaved too."""
    name = f"model.layers.{layer}.mlp.experts.{kind}{suffix}"
    assert config.moe is not None
    is_bias = suffix == "_bias"
    if tensor.dim() != (2 if is_bias else 3) or tensor.shape[0] != config.moe.num_experts:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                         f"[{config.moe.num_experts}, ...] (one {'vector' if is_bias else 'matrix'} per expert)")
    gpt_oss = config.architecture == "GptOssForCausalLM"
    kind_name = "bias" if is_bias else "weight"
    for expert in range(tensor.shape[0]):
        prefix = f"model.layers.{layer}.mlp.experts.{expert}"
        value = tensor[expert]
        if transposed and not is_bias:
            value = value.T  # [in, out] -> a Linear's [out, in]
        if kind == "down_proj":
            yield f"{prefix}.down_proj.{kind_name}", value
        elif gpt_oss:  # gate and up interleaved along the output dimension
            yield f"{prefix}.gate_proj.{kind_name}", value[0::2]
            yield f"{prefix}.up_proj.{kind_name}", value[1::2]
        else:
            gate, up = value.chunk(2, dim=0)
            yield f"{prefix}.gate_proj.{kind_name}", gate
            yield f"{prefix}.up_proj.{kind_name}", up


def mxfp4_experts(layer: str, kind: str, blocks: torch.Tensor, scales: torch.Tensor, config: ModelConfig
                  ) -> Iterable[tuple[str, QuantizedTensor]]:
    """An MXFP4 folder's stacked experts (``blocks`` [E, out, G, 16], ``scales`` [E, out, G]) as per-expert
    ``QuantizedTensor``s in kernels/quant.py's mxfp4 layout, losslessly: OpenAI's blocks hold two codes a
    byte, value 2j in the low nibble and 2j + 1 in the high one; GGUF's (and the layout's) hold value i low
    and value i + 16 high. The E8M0 byte is the same (OpenAI's 2^(e - 127) times an E2M1 value is the
    layout's 2^(e - 128) times twice it). gate_up's rows interleave gate and up, as its float form does."""
    name = f"model.layers.{layer}.mlp.experts.{kind}"
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "(blocks [E, out, G, 16] uint8, scales [E, out, G] uint8)")
    experts, out_features, groups = scales.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(experts, out_features, groups, 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # byte i: value i low, value i + 16 high
    gguf_blocks = torch.cat((scales.unsqueeze(-1), packed), dim=-1).reshape(experts, out_features, groups * 17)
    for expert in range(experts):
        prefix = f"model.layers.{layer}.mlp.experts.{expert}"
        matrix = gguf_blocks[expert]
        if kind == "down_proj":
            yield f"{prefix}.down_proj.weight", repack_gguf(matrix.contiguous(), "MXFP4", (out_features, groups * 32))
        else:  # gate and up interleaved along the output rows
            for part, rows in (("gate_proj", matrix[0::2]), ("up_proj", matrix[1::2])):
                yield f"{prefix}.{part}.weight", repack_gguf(rows.contiguous(), "MXFP4", (rows.shape[0], groups * 32))


# The 16 values of an E2M1 (FP4) code, by its 4 bits: sign, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "mxfp4 tensor") -> torch.Tensor:
    """An MXFP4 tensor as float32: ``blocks`` [..., G, 16] uint8 (two E2M1 codes a byte, the lower nibble first:
    32 values per block), ``scales`` [..., G] uint8 (an E8M0 exponent e per block: a factor 2**(e - 127)).
    Returns [..., G * 32], the last dimension the matrix's input (OpenAI's layout, which transformers'
    mxfp4.convert_moe_packed_tensors reads the same way before transposing it). Exact: every value is a
    small binary fraction times a power of two. Kept in one function: a native MXFP4 format will replace it."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "(blocks [..., G, 16], scales [..., G])")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], 32, dtype=torch.float32)
    values[..., 0::2] = table[(blocks & 0x0F).long()]
    values[..., 1::2] = table[(blocks >> 4).long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
