"""ModelConfig: the architecture facts the engine needs, parsed from a Hugging Face ``config.json``.

This module owns the translation from the many spellings found in real checkpoints (``rope_theta``
+ ``rope_scaling`` in older files, ``rope_parameters`` in transformers 5 (per layer type for Gemma 3),
``torch_dtype`` vs ``dtype``, Qwen2's ``use_sliding_window`` switch, ``num_experts`` vs
``num_local_experts``, gpt-oss's defaults that its config.json may leave out) into one frozen, validated dataclass, so the model code, the KV cache sizing and
the engine all read the same numbers and an unsupported checkpoint fails at start-up with a message
naming what is wrong instead of producing wrong text later.

The architectures differ in switches this dataclass carries, not in code paths the engine chooses:
mixture-of-experts layers (``moe``), layers that attend over a window (``layer_types``) with their own
rope base (``rope_local_theta``), Gemma's (1 + weight) norms around both blocks (``norm_style``), its
embedding and query scales, the MLP's activation, gpt-oss's learned sinks, output-projection bias and experts
(biased, clamped SwiGLU, routed by a softmax over the top k logits), and YaRN rope for any architecture.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvreuse.layers.moe_config import MoEConfig
from kvreuse.layers.rope_scaling import (
    LinearRopeScaling,
    Llama3RopeScaling,
    RopeScaling,
    YarnRopeScaling,
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "Lfm2ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "NemotronHForCausalLM",
)
# Architectures transformers knows that kvreuse does not run yet, and what is missing, so the refusal says why.
# Hybrid models not built yet: IBM's Granite 4 has Nemotron-H's Mamba-2 layers (models/nemotron_h.py) among attention
# layers with experts and Granite's multipliers, which are not (issue 66).
_GRANITE_HYBRID_REFUSAL = ("a hybrid model (IBM's Granite 4): its Mamba-2 layers run as Nemotron-H's do, but its "
                           "experts, shared MLP and Granite's embedding, attention, residual and logit multipliers are "
                           "not built (issue 66)")
PLANNED_ARCHITECTURES: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 checkpoints are not supported; the text-only "
                                      "Gemma3ForCausalLM ones (gemma-3-1b, or a text model saved from them) are",
    "Qwen3_5ForConditionalGeneration": "the multimodal Qwen3.5 checkpoints are not supported; a text model "
                                       "(Qwen3_5ForCausalLM: its text_config with the language model's weights) is",
    "Qwen3_5MoeForConditionalGeneration": "the multimodal Qwen3.5-MoE checkpoints are not supported; a text model "
                                          "(Qwen3_5MoeForCausalLM: its text_config with the language model's "
                                          "weights) is",
    "GraniteMoeHybridForCausalLM": _GRANITE_HYBRID_REFUSAL,
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "linear", "yarn")
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh", "relu2")
NORM_STYLES = ("llama", "gemma", "offset")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# LFM2's gated short convolution: a recurrent layer whose state is its last conv_kernel - 1 inputs (no K/V).
CONV = "conv"
# Qwen3.5's Gated DeltaNet: a recurrent layer whose state is a matrix per value head plus its convolution's last
# conv_kernel - 1 inputs, kept per sequence and snapshotted (cache/state_snapshots.py), not per token.
DELTA = "linear_attention"
# Nemotron-H's Mamba-2 mixer: a recurrent layer whose state is a head_dim x state_size matrix per head plus its
# convolution's last conv_kernel - 1 inputs, kept per sequence and snapshotted like the Gated DeltaNet's. Its
# config.json calls these layers "linear_attention" too; kvreuse names them apart.
MAMBA = "mamba2"
# Nemotron-H's MLP-only block (norm, squared-ReLU MLP, residual): neither K/V nor state.
MLP_BLOCK = "mlp"
RECURRENT_KINDS = (CONV, DELTA, MAMBA)
ATTENTION_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always for Qwen2)
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    sliding_window: int | None  # None when the model attends over its whole context
    eos_token_id: int | tuple[int, ...] | None
    bos_token_id: int | None
    torch_dtype: str | None  # dtype the checkpoint was saved in, e.g. "bfloat16"
    # Per layer, "full_attention" or "sliding_attention" (Gemma 3, gpt-oss); empty: every layer alike, over
    # sliding_window when one is set (Mistral).
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # the sliding layers' rope base where it differs (Gemma 3: 10,000)
    hidden_act: str = "silu"
    # "gemma": (1 + weight) norms, also after the attention and after the MLP; "offset": (1 + weight) norms in the
    # Llama places (Qwen3.5)
    norm_style: str = "llama"
    attention_scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    embedding_scale: float | None = None  # the embeddings multiplied by this (Gemma: sqrt(hidden_size))
    moe: MoEConfig | None = None
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each layer's softmax denominator
    o_proj_bias: bool = False  # a bias on the attention's output projection (gpt-oss; Llama's attention_bias)
    # LFM2: the short convolutions' kernel width (layer_types names their layers "conv"; 0: no such layers) and
    # whether their projections and convolution carry biases.
    conv_kernel: int = 0
    conv_bias: bool = False
    # Qwen3.5: rotary over the first rotary_dim of each head only (None: all of it); a sigmoid gate on the attention's
    # output, computed by q_proj beside each head's query; and the Gated DeltaNet layers' heads (layer_types "linear_attention").
    rotary_dim: int | None = None
    attention_output_gate: bool = False
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    # The value heads in llama.cpp's GGUF order (value head h shares key head h % key heads; its converter reorders
    # them so when there are fewer key heads than value heads), not HF's (h // (value heads / key heads)). Set from
    # a GGUF file only: config.json's "kvreuse_tiled_value_heads", which loading/gguf.py writes.
    delta_tiled_values: bool = False
    # Nemotron-H: its Mamba-2 layers' heads (mamba_heads x mamba_head_dim inner width), B/C groups and state size;
    # the time step's clamp; biases on in_proj / out_proj (use_bias). Its attention turns nothing (no rotary: the
    # Mamba layers carry the order) and its MLP blocks are up, squared ReLU, down (hidden_act "relu2").
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    ssm_state_size: int = 0
    mamba_dt_limit: tuple[float, float] = (0.0, math.inf)
    mamba_bias: bool = False
    attention_rope: bool = True

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or null, got {self.sliding_window}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries, the model "
                                 f"{self.num_hidden_layers} layers")
            kinds = {FULL_ATTENTION, SLIDING_ATTENTION} | ({CONV} if self.conv_kernel else set()) | (
                {DELTA} if self.delta_value_heads else set()) | ({MAMBA, MLP_BLOCK} if self.mamba_heads else set())
            unknown = sorted(set(self.layer_types) - kinds)
            if unknown:
                raise ValueError(f"layer_types holds {unknown[0]!r}; supported: {', '.join(sorted(kinds))}")
            if any(kind in RECURRENT_KINDS for kind in self.layer_types) and self.conv_kernel < 2:
                raise ValueError(f"conv_kernel must be at least 2 for conv layers, got {self.conv_kernel}")
            if DELTA in self.layer_types:
                for name in ("delta_key_heads", "delta_value_heads", "delta_key_dim", "delta_value_dim"):
                    if getattr(self, name) < 1:
                        raise ValueError(f"{name} must be a positive integer for linear_attention layers, "
                                         f"got {getattr(self, name)}")
                if self.delta_value_heads % self.delta_key_heads:
                    raise ValueError(f"delta_value_heads ({self.delta_value_heads}) must be a multiple of "
                                     f"delta_key_heads ({self.delta_key_heads})")
            if MAMBA in self.layer_types:
                for name in ("mamba_heads", "mamba_head_dim", "mamba_groups", "ssm_state_size"):
                    if getattr(self, name) < 1:
                        raise ValueError(f"{name} must be a positive integer for Mamba-2 layers, got {getattr(self, name)}")
                if self.mamba_heads % self.mamba_groups:
                    raise ValueError(f"mamba_heads ({self.mamba_heads}) must be a multiple of mamba_groups "
                                     f"({self.mamba_groups})")
            if not any(kind in ATTENTION_KINDS for kind in self.layer_types):
                raise ValueError("layer_types names no attention layer (kvreuse caches attention K/V)")
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types names sliding_attention layers but sliding_window is null")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        if self.norm_style not in NORM_STYLES:
            raise ValueError(f"norm_style must be one of {', '.join(NORM_STYLES)}, got {self.norm_style!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and within head_dim ({self.head_dim}), got {self.rotary_dim}")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_hidden_layers:
            raise ValueError(f"moe.sparse_layers has {len(self.moe.sparse_layers)} entries, the model "
                             f"{self.num_hidden_layers} layers")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id as a tuple (empty when the config names none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def is_recurrent_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps a recurrent state (LFM2's short convolutions, Qwen3.5's Gated DeltaNet)
        instead of K/V."""
        return bool(self.layer_types) and self.layer_types[layer] in RECURRENT_KINDS

    def keeps_kv(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps K/V in the paged pool: an attention layer (not a recurrent layer, nor
        Nemotron-H's MLP-only blocks)."""
        return not self.layer_types or self.layer_types[layer] in ATTENTION_KINDS

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state (issue 66): a prefix hit then needs that state too."""
        return any(kind in RECURRENT_KINDS for kind in self.layer_types)

    @property
    def state_layers(self) -> list[int]:
        """The layers whose state is kept per sequence, not per token (Gated DeltaNet, Mamba-2): a hit on them resumes
        from a snapshot (cache/state_snapshots.py)."""
        return [layer for layer, kind in enumerate(self.layer_types) if kind in (DELTA, MAMBA)]

    @property
    def state_matrix_shape(self) -> tuple[int, int, int]:
        """One state layer's matrices: (value heads, dk, dv) for the Gated DeltaNet, (heads, head_dim, state_size)
        for Mamba-2."""
        if MAMBA in self.layer_types:
            return self.mamba_heads, self.mamba_head_dim, self.ssm_state_size
        return self.delta_value_heads, self.delta_key_dim, self.delta_value_dim

    @property
    def state_conv_dim(self) -> int:
        """The width a state layer's convolution keeps K - 1 inputs of."""
        return self.mamba_conv_dim if MAMBA in self.layer_types else self.delta_conv_dim

    @property
    def mamba_inner_size(self) -> int:
        """A Mamba-2 layer's inner width: its heads' x (and the gate's width)."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """A Mamba-2 layer's convolved width: x, B and C."""
        return self.mamba_inner_size + 2 * self.mamba_groups * self.ssm_state_size

    @property
    def delta_conv_dim(self) -> int:
        """A Gated DeltaNet layer's convolved width: its queries, keys and values."""
        return 2 * self.delta_key_heads * self.delta_key_dim + self.delta_value_heads * self.delta_value_dim

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (a snapshot): per Gated DeltaNet layer, the float32 matrix of each
        value head and the convolution's last conv_kernel - 1 inputs in float32; 0 without such layers."""
        heads, rows, columns = self.state_matrix_shape
        per_layer = heads * rows * columns + (self.conv_kernel - 1) * self.state_conv_dim
        return 4 * per_layer * len(self.state_layers)

    @property
    def recurrent_layers(self) -> list[int]:
        """The indices of the layers that keep a recurrent state, in order."""
        return [layer for layer in range(self.num_hidden_layers) if self.is_recurrent_layer(layer)]

    @property
    def plane_layers(self) -> list[int]:
        """The layers that keep a plane row per token in the pool (cache/kv.py): LFM2's short convolutions."""
        return [layer for layer, kind in enumerate(self.layer_types) if kind == CONV]

    @property
    def num_plane_layers(self) -> int:
        """Layers that keep a plane row per token in the pool (cache/kv.py): the short convolutions."""
        return len(self.plane_layers)

    @property
    def plane_size(self) -> int:
        """The width of a plane row: a short convolution's input, hidden_size wide (0 without such layers)."""
        return self.hidden_size if self.plane_layers else 0

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the paged pool: the attention layers (a hybrid's recurrent ones keep none)."""
        return sum(self.keeps_kv(layer) for layer in range(self.num_hidden_layers))

    def kv_layer_of(self, layer: int) -> int:
        """Where attention layer ``layer`` keeps its K/V in the pool: its index among the attention layers."""
        return sum(self.keeps_kv(index) for index in range(layer))

    def layer_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends over (None: its whole context)."""
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def is_sparse_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers (and of its plane rows: a hybrid's conv layers)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        planes = self.num_plane_layers * self.plane_size * element_size
        return 2 * self.num_key_value_heads * self.head_dim * self.num_kv_layers * element_size + planes

    def forward_flops(self, num_cached: int, num_new: int, sampled_rows: int = 1) -> int:
        """Matrix-multiply FLOPs (2 per multiply-add) of running ``num_new`` tokens after ``num_cached``
        cached ones: the linear layers, attention over each query's visible keys (causal, within the
        sliding window if any) and the output projection of ``sampled_rows`` rows. Norms, rotary and
        softmax are left out: they are a rounding error here. The benchmark's floor for warm/cold TTFT is
        ``forward_flops(prefix, suffix) / forward_flops(0, prefix + suffix)``."""
        hidden, layers = self.hidden_size, self.num_hidden_layers
        attention_linear = hidden * (self.q_size + 2 * self.kv_size) + self.q_size * hidden
        # Query at position p sees keys max(0, p + 1 - window) .. p.
        first, end = num_cached + 1, num_cached + num_new + 1  # visible-key counts without a window
        total = 0
        for layer in range(layers):
            mlp = 3 * hidden * self.intermediate_size
            if self.is_sparse_layer(layer):  # the router, the experts each token is routed to, a shared expert
                moe = self.moe
                mlp = hidden * moe.num_experts + 3 * hidden * moe.moe_intermediate_size * moe.num_experts_per_tok
                if moe.shared_expert_intermediate_size:
                    mlp += hidden + 3 * hidden * moe.shared_expert_intermediate_size
            kind = self.layer_types[layer] if self.layer_types else FULL_ATTENTION
            if self.mamba_heads:  # Nemotron-H's blocks hold one mixer each: no MLP beside the others
                mlp = 0
            if kind == MLP_BLOCK:  # up and down, no gate
                total += 2 * hidden * self.intermediate_size * num_new
                continue
            if kind == MAMBA:
                # in_proj (z, x, B, C, dt), out_proj, the convolution, and per head the state's update and readout:
                # about 2 head_dim x state_size multiply-adds a token
                inner = self.mamba_inner_size
                linear = hidden * (inner + self.mamba_conv_dim + self.mamba_heads) + inner * hidden
                recurrence = 2 * inner * self.ssm_state_size
                total += (linear + self.conv_kernel * self.mamba_conv_dim + recurrence) * num_new
                continue
            if kind == DELTA:
                # in_proj (q, k, v, z, b, a), out_proj, the convolution, and per value head the state's decay-free
                # update and readout: about 4 dk x dv multiply-adds a token
                value_dim = self.delta_value_heads * self.delta_value_dim
                linear = hidden * (self.delta_conv_dim + value_dim + 2 * self.delta_value_heads) + value_dim * hidden
                recurrence = 4 * self.delta_value_heads * self.delta_key_dim * self.delta_value_dim
                total += (linear + self.conv_kernel * self.delta_conv_dim + recurrence + mlp) * num_new
                continue
            if self.is_recurrent_layer(layer):  # in_proj (3 x hidden), out_proj, and the depthwise convolution
                total += (4 * hidden * hidden + self.conv_kernel * hidden + mlp) * num_new
                continue
            window = self.layer_window(layer)
            if window is None:
                visible = (first + end - 1) * num_new // 2  # sum of first .. end - 1
            else:
                visible = sum(min(keys, window) for keys in range(first, end))
            # QK^T and PV: head_dim multiply-adds each per (query head, visible key).
            total += (attention_linear + mlp) * num_new + 2 * self.num_attention_heads * self.head_dim * visible
        return 2 * (total + sampled_rows * hidden * self.vocab_size)

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> ModelConfig:
        """Parse ``config.json`` in a model folder."""
        config_file = Path(model_path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"no config.json in model folder {str(model_path)!r}")
        with open(config_file, encoding="utf-8") as handle:
            try:
                hf_config = json.load(handle)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
        return cls.from_dict(hf_config)

    @classmethod
    def from_dict(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict (the content of ``config.json``)."""
        architecture = _architecture(hf_config)
        is_lfm2 = architecture == "Lfm2ForCausalLM"
        if is_lfm2:
            hf_config = _lfm2_spellings(hf_config)
        is_nemotron_h = architecture == "NemotronHForCausalLM"
        nemotron_h: dict[str, Any] = {}
        if is_nemotron_h:
            hf_config, nemotron_h = _nemotron_h_spellings(hf_config)
        is_qwen3_5_moe = architecture == "Qwen3_5MoeForCausalLM"
        if is_qwen3_5_moe and "intermediate_size" not in hf_config:
            # Every layer is sparse: no dense MLP width (Qwen3_5MoeTextConfig has none); the experts' stands in.
            hf_config = {**hf_config, "intermediate_size": hf_config.get("moe_intermediate_size", 512)}
        try:
            hidden_size = int(hf_config["hidden_size"])
            num_attention_heads = int(hf_config["num_attention_heads"])
            num_hidden_layers = int(hf_config["num_hidden_layers"])
            intermediate_size = int(hf_config["intermediate_size"])
            vocab_size = int(hf_config["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"config.json lacks the required field {exc.args[0]!r}") from exc
        is_gpt_oss = architecture == "GptOssForCausalLM"
        if is_gpt_oss:
            hf_config = _gpt_oss_defaults(hf_config)
        head_dim = hf_config.get("head_dim") or hidden_size // num_attention_heads
        is_gemma = architecture == "Gemma3ForCausalLM"
        rope_theta, rope_scaling, rope_local_theta = _rope(hf_config, is_gemma)
        is_qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        # Qwen3-Next is Qwen3.5's layers with Qwen3-MoE's experts (and a shared expert); its fused projections are
        # split into Qwen3.5's at load (models/qwen3_5.py)
        is_qwen3_5 = architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
        rotary_dim = None
        if is_qwen3_5:
            parameters = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
            factor = float(parameters.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)))
            rotary_dim = int(int(head_dim) * factor) if factor != 1.0 else None
        # Qwen2 checkpoints always carry q/k/v biases; the config does not say so.
        attention_bias = architecture == "Qwen2ForCausalLM" or bool(hf_config.get("attention_bias", False))
        # Llama and gpt-oss put attention_bias on the output projection too; Qwen2 and Mistral never do.
        o_proj_bias = attention_bias and architecture in ("LlamaForCausalLM", "GptOssForCausalLM")
        sliding_window = hf_config.get("sliding_window")
        # Qwen configs name a window but only use it when use_sliding_window is set.
        if is_qwen and not hf_config.get("use_sliding_window", False):
            sliding_window = None
        layer_types = nemotron_h.pop("layer_types", None) or _layer_types(hf_config, num_hidden_layers, is_gemma)
        if layer_types and all(kind == FULL_ATTENTION for kind in layer_types):
            layer_types = ()  # every layer global: the plain case
        if is_gemma:
            for field in ("attn_logit_softcapping", "final_logit_softcapping"):
                if hf_config.get(field) is not None:
                    raise ValueError(f"{field} is set ({hf_config[field]}); kvreuse runs Gemma 3, which has none")
            if hf_config.get("use_bidirectional_attention"):
                raise ValueError("use_bidirectional_attention is set: that is an encoder (EmbeddingGemma), "
                                 "not a causal LM")
        eos_token_id = hf_config.get("eos_token_id")
        if isinstance(eos_token_id, list):
            eos_token_id = tuple(int(token) for token in eos_token_id)
        torch_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
        query_pre_attn_scalar = hf_config.get("query_pre_attn_scalar")
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=int(hf_config.get("num_key_value_heads") or num_attention_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", is_gemma)),
            attention_bias=attention_bias,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or is_gemma or is_lfm2 or is_qwen3_5,
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            eos_token_id=eos_token_id,
            bos_token_id=hf_config.get("bos_token_id"),
            torch_dtype=str(torch_dtype) if torch_dtype is not None else None,
            layer_types=layer_types,
            rope_local_theta=rope_local_theta,
            hidden_act=str(hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "silu"),
            norm_style="gemma" if is_gemma else "offset" if is_qwen3_5 else "llama",
            attention_scale=(float(query_pre_attn_scalar) ** -0.5
                             if is_gemma and query_pre_attn_scalar is not None else None),
            embedding_scale=float(hidden_size) ** 0.5 if is_gemma else None,
            moe=(_moe(hf_config, num_hidden_layers) if architecture in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
                 else _gpt_oss_moe(hf_config, num_hidden_layers) if is_gpt_oss
                 else _qwen3_5_moe(hf_config, num_hidden_layers) if is_qwen3_5_moe else None),
            attention_sinks=is_gpt_oss,
            o_proj_bias=o_proj_bias,
            conv_kernel=(nemotron_h.pop("conv_kernel") if is_nemotron_h
                         else int(hf_config.get("conv_L_cache", 3)) if is_lfm2
                         else int(hf_config.get("linear_conv_kernel_dim", 4)) if is_qwen3_5 else 0),
            conv_bias=(bool(hf_config.get("conv_bias", False)) if is_lfm2
                       else nemotron_h.pop("conv_bias") if is_nemotron_h else False),
            rotary_dim=rotary_dim,
            attention_output_gate=is_qwen3_5 and bool(hf_config.get("attn_output_gate", True)),
            **(_delta_heads(hf_config) if is_qwen3_5 else {}),
            **nemotron_h,
        )


def _delta_heads(hf_config: dict[str, Any]) -> dict[str, int]:
    """Qwen3.5's Gated DeltaNet heads (transformers' Qwen3_5TextConfig defaults where the file leaves one out)."""
    defaults = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128}
    values = {name: int(hf_config.get(name) or default) for name, default in defaults.items()}
    return {"delta_key_heads": values["linear_num_key_heads"], "delta_value_heads": values["linear_num_value_heads"],
            "delta_key_dim": values["linear_key_head_dim"], "delta_value_dim": values["linear_value_head_dim"],
            "delta_tiled_values": bool(hf_config.get("kvreuse_tiled_value_heads", False))}


_NEMOTRON_H_KINDS = {"M": MAMBA, "*": FULL_ATTENTION, "-": MLP_BLOCK, "E": "moe",
                     "linear_attention": MAMBA, "full_attention": FULL_ATTENTION, "mlp": MLP_BLOCK, "moe": "moe"}


def _nemotron_h_spellings(hf_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Nemotron-H's config.json in the names the other architectures use, and its own fields (ModelConfig's
    ``mamba_*``, ``conv_*``, ``layer_types``), as transformers' NemotronHConfig reads it: the layer kinds from
    ``layers_block_type`` (transformers 5) or ``hybrid_override_pattern`` (the released files: M a Mamba-2 layer, *
    attention, - an MLP, E experts); the older ``mamba_``-prefixed spellings; a time-step limit whose bound may be
    written ``{"__float__": "Infinity"}``."""
    config = dict(hf_config)

    def first(*names: str, default: Any = None) -> Any:
        return next((config[name] for name in names if config.get(name) is not None), default)

    kinds = first("layers_block_type", "layer_types") or list(str(first("hybrid_override_pattern", default="")))
    unknown = sorted({str(kind) for kind in kinds} - set(_NEMOTRON_H_KINDS))
    if not kinds or unknown:
        raise ValueError("config.json's layers_block_type / hybrid_override_pattern must name each layer "
                         f"(M or linear_attention, * or full_attention, - or mlp); got {unknown or kinds!r}")
    layer_types = tuple(_NEMOTRON_H_KINDS[str(kind)] for kind in kinds)
    if "moe" in layer_types:
        raise ValueError(f"Nemotron-H layer {layer_types.index('moe')} is a mixture-of-experts block (Nemotron 3's "
                         "E layers): not implemented; the Mamba-2, attention and MLP blocks are")
    for field, expected in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        if str(config.get(field, expected)) != expected:
            raise ValueError(f"{field} {config[field]!r} is not supported; Nemotron-H's is {expected!r}")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias is set: not implemented (no released Nemotron-H has MLP biases)")
    config["attention_bias"] = False  # transformers' NemotronHAttention has none, whatever the config says
    if config.get("residual_in_fp32"):
        raise ValueError("residual_in_fp32 is set: not implemented (the residual stream is in the model's dtype)")
    limit = first("time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))

    def bound(value: Any) -> float:
        return float(value["__float__"]) if isinstance(value, dict) else float(value)

    config.update(num_hidden_layers=len(layer_types), rms_norm_eps=first("layer_norm_epsilon", "rms_norm_eps",
                                                                          default=1e-5),
                  hidden_act="relu2", rope_theta=config.get("rope_theta", 10000.0))
    config.setdefault("tie_word_embeddings", False)
    if config.get("head_dim") is None and config.get("attention_head_dim") is not None:
        config["head_dim"] = config["attention_head_dim"]
    heads = int(first("mamba_num_heads", default=128))
    own = {"layer_types": layer_types, "mamba_heads": heads,
           "mamba_head_dim": int(first("mamba_head_dim", default=64)),
           "mamba_groups": int(first("n_groups", "mamba_n_groups", default=8)),
           "ssm_state_size": int(first("ssm_state_size", default=128)),
           "conv_kernel": int(first("conv_kernel", "mamba_d_conv", default=4)),
           "conv_bias": bool(first("use_conv_bias", "mamba_conv_bias", default=True)),
           "mamba_dt_limit": (bound(limit[0]), bound(limit[1])),
           "mamba_bias": bool(first("use_bias", "mamba_proj_bias", default=False)),
           "attention_rope": False}
    return config, own


def _lfm2_spellings(hf_config: dict[str, Any]) -> dict[str, Any]:
    """LFM2's config.json in the names the other architectures use, as transformers' Lfm2Config reads it: the
    released files say norm_eps, block_ff_dim, tie_embedding and full_attn_idxs; the feed-forward width is
    adjusted (2/3 of it, times block_ffn_dim_multiplier, rounded up to block_multiple_of) unless
    block_auto_adjust_ff_dim is false."""
    config = dict(hf_config)
    config["rms_norm_eps"] = config.get("norm_eps", config.get("rms_norm_eps", 1e-5))
    if "block_ff_dim" in config:
        config["intermediate_size"] = config["block_ff_dim"]
    if "tie_embedding" in config:
        config["tie_word_embeddings"] = config["tie_embedding"]
    config.setdefault("tie_word_embeddings", True)
    config.setdefault("rope_theta", 1000000.0)
    size = int(config.get("intermediate_size", 12288))
    if config.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(config.get("block_multiple_of", 256))
            size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    config["intermediate_size"] = size
    if not config.get("layer_types"):
        layers = int(config.get("num_hidden_layers", 0))
        attention = config.get("full_attn_idxs")
        attention = set(range(layers)) if attention is None else {int(index) for index in attention}
        config["layer_types"] = [FULL_ATTENTION if layer in attention else CONV for layer in range(layers)]
    return config


def _layer_types(hf_config: dict[str, Any], num_layers: int, is_gemma: bool) -> tuple[str, ...]:
    """Per-layer attention kinds: ``layer_types`` where the config lists them; Gemma 3 configs written before
    transformers 4.53 give ``sliding_window_pattern`` instead (every n-th layer global)."""
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ValueError(f"layer_types must be a list, got {layer_types!r}")
        return tuple(str(kind) for kind in layer_types)
    if is_gemma:
        pattern = int(hf_config.get("sliding_window_pattern") or hf_config.get("_sliding_window_pattern") or 6)
        return tuple(FULL_ATTENTION if (layer + 1) % pattern == 0 else SLIDING_ATTENTION for layer in range(num_layers))
    return ()


def _moe(hf_config: dict[str, Any], num_layers: int) -> MoEConfig:
    """Qwen3-MoE's (and Qwen3-Next's) experts: every ``decoder_sparse_step``-th layer sparse, except
    ``mlp_only_layers``; Qwen3-Next's shared expert beside them."""
    try:
        num_experts = int(hf_config.get("num_experts") or hf_config["num_local_experts"])
        per_token = int(hf_config["num_experts_per_tok"])
        moe_intermediate = int(hf_config["moe_intermediate_size"])
    except KeyError as exc:
        raise ValueError(f"config.json lacks the mixture-of-experts field {exc.args[0]!r}") from exc
    step = int(hf_config.get("decoder_sparse_step") or 1)
    dense = set(int(layer) for layer in hf_config.get("mlp_only_layers") or ())
    sparse = tuple(layer not in dense and (layer + 1) % step == 0 for layer in range(num_layers))
    return MoEConfig(num_experts=num_experts, num_experts_per_tok=per_token, moe_intermediate_size=moe_intermediate,
                     norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)), sparse_layers=sparse,
                     shared_expert_intermediate_size=int(hf_config.get("shared_expert_intermediate_size") or 0))


def _qwen3_5_moe(hf_config: dict[str, Any], num_layers: int) -> MoEConfig:
    """Qwen3.5-MoE's experts (transformers' Qwen3_5MoeTextConfig defaults where the file leaves one out): every
    layer sparse, the chosen experts' probabilities renormalised, and a shared expert beside them."""
    def value(name: str, default: int) -> int:
        found = hf_config.get(name)
        return default if found is None else int(found)

    return MoEConfig(num_experts=value("num_experts", 256), num_experts_per_tok=value("num_experts_per_tok", 8),
                     moe_intermediate_size=value("moe_intermediate_size", 512), norm_topk_prob=True,
                     sparse_layers=(True,) * num_layers,
                     shared_expert_intermediate_size=value("shared_expert_intermediate_size", 512))


def _gpt_oss_defaults(hf_config: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's config.json with the values transformers' GptOssConfig gives the fields it leaves out (its
    released files spell most of them; a saved config may not): so both read the same model."""
    defaults: dict[str, Any] = {
        "head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-5, "attention_bias": True, "rope_theta": 150000.0,
        "tie_word_embeddings": False, "max_position_embeddings": 131072,
    }
    config = {**defaults, **{key: value for key, value in hf_config.items() if value is not None or key == "sliding_window"}}
    if not config.get("layer_types"):  # even layers (from 0) windowed, odd ones global
        config["layer_types"] = [SLIDING_ATTENTION if (layer + 1) % 2 else FULL_ATTENTION
                                 for layer in range(int(config["num_hidden_layers"]))]
    if not (config.get("rope_scaling") or config.get("rope_parameters")):
        config["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096}
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if method != "mxfp4":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported for gpt-oss; supported: "
                             "mxfp4 (its experts' *_blocks / *_scales, dequantized at load)")
    return config


def _gpt_oss_moe(hf_config: dict[str, Any], num_layers: int) -> MoEConfig:
    """gpt-oss's experts, in every layer: intermediate_size wide, a biased router whose top k logits are
    softmaxed, biased projections, the SwiGLU clamped at swiglu_limit. router_aux_loss_coef is training only."""
    try:
        num_experts = int(hf_config.get("num_local_experts") or hf_config["num_experts"])
        per_token = int(hf_config["num_experts_per_tok"])
    except KeyError as exc:
        raise ValueError(f"config.json lacks the mixture-of-experts field {exc.args[0]!r}") from exc
    limit = hf_config.get("swiglu_limit", 7.0)
    alpha = hf_config.get("swiglu_alpha", 1.702)
    for field, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{field} must be a number, got {value!r}")
    return MoEConfig(num_experts=num_experts, num_experts_per_tok=per_token,
                     moe_intermediate_size=int(hf_config["intermediate_size"]), norm_topk_prob=False,
                     sparse_layers=(True,) * num_layers, router_bias=True, softmax_after_topk=True, expert_bias=True,
                     swiglu_limit=float(limit), swiglu_alpha=float(alpha))


def _architecture(hf_config: dict[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(
            "config.json has no 'architectures' entry; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if architectures[0] in PLANNED_ARCHITECTURES:
        raise ValueError(f"architecture {architectures[0]!r} is not supported: {PLANNED_ARCHITECTURES[architectures[0]]}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    raise ValueError(
        f"architecture {architectures[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(hf_config: dict[str, Any], is_gemma: bool = False
          ) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_theta, scaling, the sliding layers' theta or None) from the old keys (rope_theta / rope_scaling,
    Gemma 3's rope_local_base_freq) or the new ones (rope_parameters, per layer type for Gemma 3)."""
    parameters = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        raise ValueError(f"rope_scaling must be an object or null, got {parameters!r}")
    if FULL_ATTENTION in parameters or SLIDING_ATTENTION in parameters:  # per layer type (transformers 5)
        full = parameters.get(FULL_ATTENTION) or {}
        local = parameters.get(SLIDING_ATTENTION) or {}
        # transformers reads yarn's truncate from the outer dict, which per layer type never has it: True.
        theta, scaling = _rope_of(full, hf_config, float(hf_config.get("rope_theta") or 10000.0), truncate=True)
        local_theta, local_scaling = _rope_of(local, hf_config, theta, truncate=True)
        if local_scaling is not None:
            raise ValueError("rope scaling on the sliding layers is not supported (Gemma 3 scales its global layers only)")
        return theta, scaling, (local_theta if local_theta != theta else None)
    theta, scaling = _rope_of(parameters, hf_config, float(hf_config.get("rope_theta") or 10000.0))
    local_theta = hf_config.get("rope_local_base_freq") if is_gemma else None
    return theta, scaling, (float(local_theta) if local_theta is not None and float(local_theta) != theta else None)


def _rope_of(parameters: dict[str, Any], hf_config: dict[str, Any], default_theta: float,
             truncate: bool | None = None) -> tuple[float, RopeScaling | None]:
    rope_theta = hf_config.get("rope_theta") if "rope_theta" not in parameters else parameters["rope_theta"]
    rope_theta = float(rope_theta or default_theta)
    rope_type = parameters.get("rope_type") or parameters.get("type") or "default"
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "linear":
        try:
            return rope_theta, LinearRopeScaling(factor=float(parameters["factor"]))
        except KeyError as exc:
            raise ValueError("linear rope_scaling lacks the field 'factor'") from exc
    if rope_type == "yarn":
        return rope_theta, _yarn(parameters, hf_config, parameters.get("truncate", True) if truncate is None else truncate)
    if rope_type != "llama3":
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(parameters["factor"]),
            low_freq_factor=float(parameters["low_freq_factor"]),
            high_freq_factor=float(parameters["high_freq_factor"]),
            original_max_position_embeddings=int(
                parameters.get("original_max_position_embeddings")
                or hf_config.get("max_position_embeddings")
                or parameters["original_max_position_embeddings"]
            ),
        )
    except KeyError as exc:
        raise ValueError(f"llama3 rope_scaling lacks the field {exc.args[0]!r}") from exc
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError(
            f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
            f"{scaling.high_freq_factor} <= {scaling.low_freq_factor}"
        )
    return float(rope_theta), scaling


def _yarn(parameters: dict[str, Any], hf_config: dict[str, Any], truncate: Any) -> YarnRopeScaling:
    """YaRN's parameters resolved as transformers resolves them (modeling_rope_utils: standardize_rope_params
    and _compute_yarn_parameters): a top-level original_max_position_embeddings wins over the rope dict's,
    which defaults to max_position_embeddings; a null factor is their ratio; beta_fast / beta_slow default to
    32 / 1 (also when 0 or null); the attention factor is the config's, else mscale / mscale_all_dim's ratio
    where both are set, else 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    max_positions = int(hf_config.get("max_position_embeddings", 2048))
    original = hf_config.get("original_max_position_embeddings") or parameters.get(
        "original_max_position_embeddings") or max_positions
    original = int(original)
    factor = parameters.get("factor")
    factor = float(factor) if factor is not None else max_positions / original

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = parameters.get("attention_factor")
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = mscale_of(factor, float(mscale)) / mscale_of(factor, float(mscale_all_dim))
        else:
            attention_factor = mscale_of(factor)
    if not isinstance(truncate, bool):
        raise ValueError(f"yarn rope_scaling truncate must be true or false, got {truncate!r}")
    return YarnRopeScaling(factor=factor, beta_fast=float(parameters.get("beta_fast") or 32),
                           beta_slow=float(parameters.get("beta_slow") or 1),
                           original_max_position_embeddings=original, truncate=truncate,
                           attention_factor=float(attention_factor))
