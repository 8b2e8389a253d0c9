"""ModelConfig: the architecture facts the engine needs, parsed from a Hugging Face ``config.json``.

This module owns the translation from the many spellings found in real checkpoints (``rope_theta``
+ ``rope_scaling`` in older files, ``rope_parameters`` in transformers 5, ``torch_dtype`` vs
``dtype``, Qwen2's ``use_sliding_window`` switch) into one frozen, validated dataclass, so the model
code, the KV cache sizing and the engine all read the same numbers and an unsupported checkpoint
fails at start-up with a message naming what is wrong instead of producing wrong text later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style frequency-dependent rope scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always for Qwen2)
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    sliding_window: int | None  # None when the model attends over its whole context
    eos_token_id: int | tuple[int, ...] | None
    bos_token_id: int | None
    torch_dtype: str | None  # dtype the checkpoint was saved in, e.g. "bfloat16"

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

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id as a tuple (empty when the config names none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_key_value_heads * self.head_dim * self.num_hidden_layers * element_size

    def forward_flops(self, num_cached: int, num_new: int, sampled_rows: int = 1) -> int:
        """Matrix-multiply FLOPs (2 per multiply-add) of running ``num_new`` tokens after ``num_cached``
        cached ones: the linear layers, attention over each query's visible keys (causal, within the
        sliding window if any) and the output projection of ``sampled_rows`` rows. Norms, rotary and
        softmax are left out: they are a rounding error here. The benchmark's floor for warm/cold TTFT is
        ``forward_flops(prefix, suffix) / forward_flops(0, prefix + suffix)``."""
        hidden, layers = self.hidden_size, self.num_hidden_layers
        per_token_linear = hidden * (self.q_size + 2 * self.kv_size) + self.q_size * hidden \
            + 3 * hidden * self.intermediate_size
        # Query at position p sees keys max(0, p + 1 - window) .. p.
        first, end = num_cached + 1, num_cached + num_new + 1  # visible-key counts without a window
        visible = (first + end - 1) * num_new // 2  # sum of first .. end - 1
        if self.sliding_window is not None:
            visible = sum(min(keys, self.sliding_window) for keys in range(first, end))
        # QK^T and PV: head_dim multiply-adds each per (query head, visible key).
        attention = 2 * self.num_attention_heads * self.head_dim * visible
        return 2 * (layers * (per_token_linear * num_new + attention) + sampled_rows * hidden * self.vocab_size)

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
        try:
            hidden_size = int(hf_config["hidden_size"])
            num_attention_heads = int(hf_config["num_attention_heads"])
            num_hidden_layers = int(hf_config["num_hidden_layers"])
            intermediate_size = int(hf_config["intermediate_size"])
            vocab_size = int(hf_config["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"config.json lacks the required field {exc.args[0]!r}") from exc
        head_dim = hf_config.get("head_dim") or hidden_size // num_attention_heads
        rope_theta, rope_scaling = _rope(hf_config)
        is_qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
        # Qwen2 checkpoints always carry q/k/v biases; the config does not say so.
        attention_bias = architecture == "Qwen2ForCausalLM" or bool(hf_config.get("attention_bias", False))
        sliding_window = hf_config.get("sliding_window")
        # Qwen configs name a window but only use it when use_sliding_window is set.
        if is_qwen and not hf_config.get("use_sliding_window", False):
            sliding_window = None
        eos_token_id = hf_config.get("eos_token_id")
        if isinstance(eos_token_id, list):
            eos_token_id = tuple(int(token) for token in eos_token_id)
        torch_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
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
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            eos_token_id=eos_token_id,
            bos_token_id=hf_config.get("bos_token_id"),
            torch_dtype=str(torch_dtype) if torch_dtype is not None else None,
        )


def _architecture(hf_config: dict[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(
            "config.json has no 'architectures' entry; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"architecture {architectures[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(hf_config: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either the old (rope_theta/rope_scaling) or new (rope_parameters) keys."""
    parameters = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        raise ValueError(f"rope_scaling must be an object or null, got {parameters!r}")
    rope_theta = hf_config.get("rope_theta") or parameters.get("rope_theta") or 10000.0
    rope_type = parameters.get("rope_type") or parameters.get("type") or "default"
    if rope_type == "default":
        return float(rope_theta), None
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
