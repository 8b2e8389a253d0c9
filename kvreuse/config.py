"""Engine settings as frozen dataclasses. Validation happens here so bad values fail at start-up
with a message naming the field and the limit."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Where kvreuse keeps what it makes once per machine: model folders, kernel timings, built kernels.
CACHE_DIR_ENV = "KVREUSE_CACHE_DIR"


def cache_dir() -> Path:
    """Root of kvreuse's on-disk cache: ``$KVREUSE_CACHE_DIR`` or ``~/.cache/kvreuse``."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "kvreuse"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


# kv_cache_dtype's values (vLLM's, plus int8); kvreuse.cache.kv_quant holds the schemes (bfloat16: an unquantized
# pool in bfloat16 under a float32 model).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


def parse_memory_size(value: int | str, field_name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as "2GiB", "512MiB", "1.5GB" or "1048576"."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name} must be a number of bytes or a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match:
            raise ValueError(
                f"{field_name} must be a number of bytes or a size like '2GiB' or '512MiB', got {value!r}"
            )
        unit = (match.group(2) or "B").lower()
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{field_name} must be an int or a string, got {type(value).__name__}")
    if size <= 0:
        raise ValueError(f"{field_name} must be positive, got {value!r}")
    return size


def reject_unknown_fields(value: dict[str, Any], known: Iterable[str], name: str) -> None:
    """A ValueError naming the fields of a JSON option ``name`` that it does not have, and the ones it does."""
    known = sorted(known)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes for the paged KV pool
    enable_prefix_caching: bool = True
    max_pinned_fraction: float = 0.5  # of the KV pool that pins may hold; over it, LRU pins are demoted
    # KV tiers behind the pool (kvreuse.cache.tiers): host memory bytes (0: none), a disk folder and its
    # byte cap, a Redis URL, and the most bytes of records queued for the disk/Redis writer (beyond it
    # blocks are not written, counted in write_drops; kvreuse.cache.tiers.store.DEFAULT_WRITE_QUEUE_BYTES).
    kv_host_memory: int = 0
    kv_disk_dir: str | None = None
    kv_disk_size: int = 20 * 2**30
    kv_remote_url: str | None = None
    kv_write_queue_size: int = 2**30
    # How the pool stores K and V (vLLM's name and values): "auto" (the model's dtype), "int8", "fp8" /
    # "fp8_e4m3", "fp8_e5m2" (kvreuse.cache.kv_quant: one byte per value, a scale per token and head).
    kv_cache_dtype: str = "auto"
    # Reuse beyond the prefix (issue 39, attention/blend.py): marked chunks at any position and an earlier
    # turn's tokens moved earlier, their K/V moved and partly recomputed: the share of moved tokens recomputed
    # (chosen by deviation after chunk_check_layer), and the first tokens of each moved span always recomputed.
    # The defaults are the measured fidelity setting (docs/chunks.md): 30% chosen after a tenth of the layers
    # (None: attention/blend.default_check_layer) share as many answer tokens with full prefill as float32 vs
    # bfloat16 compute does, at 0.46x its TTFT on SmolLM2; 15% after layer 1 takes 0.30x and shares 0.56x.
    chunk_reuse: bool = False
    chunk_recompute_fraction: float = 0.3
    chunk_check_layer: int | None = None
    chunk_recompute_first: int = 0
    # A hybrid whose recurrent layers keep one state per sequence (Qwen3.5's Gated DeltaNet, issue 66): the share of
    # kv_cache_memory its state snapshots may hold (the running requests' states come out of kv_cache_memory too),
    # and which snapshot goes when they are full: "saved" (the least compute saved per byte) or "lru".
    state_snapshot_fraction: float = 0.25
    state_snapshot_policy: str = "saved"

    @property
    def has_tiers(self) -> bool:
        return bool(self.kv_host_memory or self.kv_disk_dir or self.kv_remote_url)

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be between 0 and 1, got {self.max_pinned_fraction}")
        if not 0.0 < self.state_snapshot_fraction < 1.0:
            raise ValueError(f"state_snapshot_fraction must be between 0 and 1 (exclusive), got {self.state_snapshot_fraction}")
        if self.state_snapshot_policy not in ("saved", "lru"):
            raise ValueError(f"state_snapshot_policy must be 'saved' or 'lru', got {self.state_snapshot_policy!r}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be between 1 and 1024, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.kv_host_memory < 0:
            raise ValueError(f"kv_host_memory must be >= 0 bytes, got {self.kv_host_memory}")
        if self.kv_disk_size <= 0:
            raise ValueError(f"kv_disk_size must be positive, got {self.kv_disk_size}")
        if self.kv_write_queue_size <= 0:
            raise ValueError(f"kv_write_queue_size must be positive, got {self.kv_write_queue_size}")
        if self.kv_remote_url is not None and not self.kv_remote_url.startswith(
                ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
            raise ValueError(f"kv_remote_url must be a redis://, rediss://, unix:// or redis+cluster:// URL, got "
                             f"{self.kv_remote_url!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if (self.kv_disk_dir or self.kv_remote_url or self.kv_host_memory) and not self.enable_prefix_caching:
            raise ValueError("KV tiers need prefix caching (enable_prefix_caching=True)")
        if not 0.0 <= self.chunk_recompute_fraction <= 1.0:
            raise ValueError(f"chunk_recompute_fraction must be between 0 and 1, got {self.chunk_recompute_fraction}")
        if self.chunk_check_layer is not None and self.chunk_check_layer < 0:
            raise ValueError(f"chunk_check_layer must be >= 0, got {self.chunk_check_layer}")
        if self.chunk_recompute_first < 0:
            raise ValueError(f"chunk_recompute_first must be >= 0, got {self.chunk_recompute_first}")
        if self.chunk_reuse and not self.enable_prefix_caching:
            raise ValueError("chunk_reuse needs prefix caching (enable_prefix_caching=True): its sources are cached blocks")


SCHEDULING_POLICIES = ("lpm", "fcfs")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # requests running at once
    scheduling_policy: str = "lpm"
    # lpm: a waiting request passed over this many times is admitted before any cache-favoured one.
    starvation_limit: int = 16
    # lpm: beyond this many waiting requests, matching every one each step costs more than it saves.
    lpm_max_queue: int = 256
    # Distinct LoRA adapters among the running requests (the engine sets it from LoRAConfig.max_loras).
    max_loras: int | None = None
    # Speculative decoding: slots reserved past a sampling sequence's tokens for the drafted ones (the
    # engine sets it from SpeculativeConfig.num_speculative_tokens).
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        for name in ("max_num_batched_tokens", "max_num_seqs", "starvation_limit", "lpm_max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 4  # adapters resident (and in one batch) at once; the least recently used idle one goes
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


# --- speculative decoding: vLLM's ``speculative_config`` dict, validated once at start-up ------------------
# ``{"method": "eagle" | "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": k}`` with vLLM's names (an EAGLE
# draft model); ``{"method": "cache", ...}``: the cache drafter (spec/cache_drafter.py), drafts copied from the
# request's own tokens and its namespace's earlier sequences, with its knobs below; ``{"method": "ngram", ...}``:
# vLLM's prompt lookup, the same drafter reading the request's own tokens only; ``{"method": "none"}``: no drafting.
# Left unset (None) the cache drafter runs where verification is exact (batch-invariant mode on: builder.py).
# A bad value fails with the field named, before any weight is read.

EAGLE_METHODS = ("eagle", "eagle3")
CACHE_METHODS = ("cache", "ngram")
SPECULATIVE_METHODS = (*EAGLE_METHODS, *CACHE_METHODS, "none")
# Verification computes 1 + k target tokens per step; beyond this a draft that is ever wrong costs
# more in rejected rows than it can save.
MAX_SPECULATIVE_TOKENS = 16
# The cache drafter's defaults: drafts of up to 8 tokens from a match of 2 to 16 tokens; the namespaces' stores keep
# the last 128Ki tokens of finished sequences to draft from, all together (about 30 MB at most with their index).
CACHE_DRAFT_TOKENS = 8
CACHE_DRAFT_FIELDS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "namespace_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    model: str | None = None  # the EAGLE draft's folder
    num_speculative_tokens: int = CACHE_DRAFT_TOKENS  # most tokens drafted per step
    # The cache drafter: the shortest and longest run of last tokens matched against earlier text (vLLM's names).
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 16
    # Tokens of finished sequences the namespaces' stores keep to draft from, all together ("ngram": 0, the
    # request's own tokens only).
    namespace_tokens: int = 1 << 17

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if self.method in EAGLE_METHODS and (not isinstance(self.model, str) or not self.model):
            raise ValueError("speculative_config.model must name the draft's folder")
        if self.method not in EAGLE_METHODS and self.model is not None:
            raise ValueError(f"speculative_config.model is for an EAGLE draft; method {self.method!r} has none")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        for name, low, high in (("prompt_lookup_min", 1, 64), ("prompt_lookup_max", 1, 64),
                                ("namespace_tokens", 0, 1 << 26)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"speculative_config.{name} must be an int in [{low}, {high}], got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "ngram" and self.namespace_tokens:
            object.__setattr__(self, "namespace_tokens", 0)  # vLLM's ngram: the request's own tokens only

    @property
    def uses_draft_model(self) -> bool:
        """An EAGLE draft: its K/V and features live in the blocks (part of the namespace)."""
        return self.method in EAGLE_METHODS

    @property
    def uses_cache_drafter(self) -> bool:
        return self.method in CACHE_METHODS

    def as_dict(self) -> dict[str, Any]:
        """The fields that mean something for this method, as ``--speculative-config`` takes them."""
        if self.method == "none":
            return {"method": "none"}
        if self.uses_draft_model:
            return {"method": self.method, "model": self.model, "num_speculative_tokens": self.num_speculative_tokens}
        return {"method": self.method, **{name: getattr(self, name) for name in CACHE_DRAFT_FIELDS}}

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict, or the JSON text of ``--speculative-config``; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"--speculative-config is not valid JSON: {error}") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
        method = value.get("method")
        if method is None:
            raise ValueError("speculative_config lacks method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
        if method in EAGLE_METHODS:
            known, required = {"method", "model", "num_speculative_tokens"}, {"method", "model", "num_speculative_tokens"}
        elif method in CACHE_METHODS:
            known, required = {"method", *CACHE_DRAFT_FIELDS}, {"method"}
        else:
            known, required = {"method"}, {"method"}
        reject_unknown_fields(value, known, "speculative_config")
        missing = sorted(name for name in required if name not in value)
        if missing:
            raise ValueError(f"speculative_config lacks {', '.join(missing)}")
        fields = dict(value)
        if "model" in fields:
            fields["model"] = str(fields["model"])
        return cls(**fields)


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")  # auto: a .gguf file is gguf
QUANTIZATION_METHODS = ("none", "gguf", "int8")  # as loading/loader.py's
# Which paged attention the model runs (vLLM's option name): auto picks the in-place C++ kernel on CPU
# (attention/cpu_paged.py) where it builds, else torch (gather + SDPA, attention/torch_paged.py: the
# reference); on CUDA auto picks triton (attention/triton_paged.py: Triton kernels
# reading the blocks in place) where triton is installed.
ATTENTION_BACKENDS = ("auto", "torch", "cpu_paged", "triton")
# The torch.compile'd decode was a third decode path beside the native CPU step and CUDA graphs; measured within
# run-to-run noise of the native step on CPU (docs/benchmarks.md, "The compiled decode, retired"), unable to run
# the CPU attention kernel or batch-invariant mode, and refused with the Triton backend on CUDA, it was removed.
TORCH_COMPILE_RETIRED = ("enable_torch_compile is retired: decode steps run the native CPU step on CPU and CUDA "
                         "graphs on CUDA (the compiled decode was no faster beyond noise and could not run the CPU "
                         "attention kernel or batch-invariant mode: docs/benchmarks.md); drop the option")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a model folder, a GGUF file or a hub id
    served_model_name: str | None = None  # the name in the cache namespace and in API responses
    tokenizer: str | None = None  # a folder or a GGUF file; defaults to the model's
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    load_format: str = "auto"
    # How weights are held (vLLM's names): none | gguf | int8; None: gguf for a GGUF file on CPU, else none
    quantization: str | None = None
    seed: int = 0
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    lora: LoRAConfig = LoRAConfig()
    max_model_len: int | None = None  # None: the model's context length, capped by the KV pool
    # Speculative decoding: an EAGLE draft, the cache drafter, or {"method": "none"}; None (auto): the cache drafter
    # where verification is exact (batch-invariant mode on), none elsewhere (the builder says which and why).
    speculative: SpeculativeConfig | None = None
    # SGLang's switch for a torch.compile'd decode: retired (TORCH_COMPILE_RETIRED says why); True is refused.
    enable_torch_compile: bool = False
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    # vLLM's name: no CUDA graphs; on CUDA with the triton backend pure decode steps replay captured graphs
    # (runner/decode/cuda_graphs.py). Nothing else uses graphs, so elsewhere it changes nothing.
    enforce_eager: bool = False
    # vLLM's and SGLang's name: every product and every attention row on one arithmetic whatever the step's size
    # or split, so a cache hit, a batch or a chunked prefill never changes a bit of the output (CPU only for now;
    # docs/library.md says what it covers and costs). None (auto): on where it costs little (a CPU
    # model whose every product runs on the packed int8 kernel: q8_0 / q4_0 / q4_1 GGUF files; the engine
    # builder's auto_batch_invariant says which and why), off elsewhere.
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        if self.enable_torch_compile:
            raise ValueError(TORCH_COMPILE_RETIRED)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None: the "
                             f"model's default), got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
