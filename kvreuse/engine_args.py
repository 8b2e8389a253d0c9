"""Engine options shared by every command that loads a model, and the logging set-up.

``kvreuse.cli`` mounts the sub-commands; the sub-commands (demo, serve, run, bench compare) import
their engine options from here, never from ``kvreuse.cli``, so the command layer has no import
circle. Names follow vLLM's engine arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from kvreuse.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    SpeculativeConfig,
    parse_memory_size,
)

if TYPE_CHECKING:
    from kvreuse.llm import LLM

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def configure_logging(debug: bool = False) -> None:
    """kvreuse's loggers at DEBUG with ``--debug``, else at ``KVREUSE_LOG`` (INFO by default)."""
    level_name = "DEBUG" if debug else os.environ.get("KVREUSE_LOG", "INFO").upper()
    level = getattr(logging, level_name, logging.INFO)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("kvreuse").setLevel(level)


def add_engine_arguments(parser: argparse.ArgumentParser, default_model: str | None = None) -> None:
    """Engine options of every command that loads a model (names as vLLM's)."""
    parser.add_argument("--model", default=default_model, required=default_model is None,
                        help="model folder, GGUF file or hub id")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder or GGUF file (default: the model's, a GGUF file's own)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX), "
                             "else float32")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS))
    parser.add_argument("--quantization", default=None, choices=list(QUANTIZATION_METHODS),
                        help="how weights are held on CPU: gguf keeps a GGUF file's quantized blocks (the default "
                             "for a .gguf model), int8 quantizes a folder's linear layers at load (weight-only), "
                             "none holds every weight in --dtype")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV pool size, e.g. 2GiB or 512MiB")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="how the KV pool stores K and V: auto (the model's dtype), bfloat16 (under a float32 "
                             "model too: half the bytes), int8, fp8 (= fp8_e4m3), "
                             "fp8_e5m2: one byte per value and a scale per token and head, ~1.9x the tokens of "
                             "bfloat16 in the same --kv-cache-memory")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--chunk-reuse", action="store_true",
                        help="reuse chunks marked cache_control scope 'chunk' at any position, and an earlier turn's "
                             "tokens moved earlier: their K/V moved and partly recomputed (docs/chunks.md)")
    parser.add_argument("--chunk-recompute-fraction", type=float, default=0.3,
                        help="share of moved tokens recomputed, those whose K/V deviates most after "
                             "--chunk-check-layer (0: a pure shift)")
    parser.add_argument("--chunk-check-layer", type=int, default=None,
                        help="the layer whose K/V deviation picks them (default: a tenth of the model's layers)")
    parser.add_argument("--chunk-recompute-first", type=int, default=0,
                        help="first tokens of each moved span always recomputed (EPIC-style)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--scheduling-policy", default="lpm", choices=list(SCHEDULING_POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-snapshot-fraction", type=float, default=0.25,
                        help="a hybrid with Gated DeltaNet layers (Qwen3.5): the share of --kv-cache-memory its "
                             "recurrent-state snapshots may hold")
    parser.add_argument("--state-snapshot-policy", choices=("saved", "lru"), default="saved",
                        help="which state snapshot goes first when they are full: the least compute saved per byte, "
                             "or the least recently used")
    parser.add_argument("--max-pinned-fraction", type=float, default=0.5,
                        help="share of the KV pool that pins may hold; over it the least recently used pin is demoted")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders or .safetensors)")
    parser.add_argument("--max-loras", type=int, default=4,
                        help="adapters resident (and in one batch) at once; the least recently used idle one is unloaded")
    parser.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted")
    parser.add_argument("--enable-torch-compile", action="store_true",
                        help="retired (SGLang's flag): refused with the reason; decode runs the native CPU step or "
                             "CUDA graphs")
    parser.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                        help="paged attention: auto (the in-place C++ kernel on CPU where it builds, Triton kernels "
                             "on CUDA, else torch), cpu_paged or triton (that kernel, or fail), torch (gather + "
                             "SDPA: the reference)")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                        help="the same output bits for a token however it was computed: cold or after a cache hit, "
                             "alone or in any batch, in any prefill chunk (one product kernel at every row count, "
                             "every attention row in the paged kernel over fixed partitions; CPU). Default: on where "
                             "it costs little (q8_0 / q4_0 / q4_1 GGUF files on a CPU with AVX512-VNNI), "
                             "off elsewhere; --no-batch-invariant turns it off")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (as vLLM's flag): on CUDA, pure decode steps otherwise replay one "
                             "captured graph per padded batch size")
    parser.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                        help='speculative decoding, as vLLM\'s: an EAGLE draft \'{"method": "eagle" | "eagle3", '
                             '"model": DRAFT_DIR, "num_speculative_tokens": K}\' (its digest becomes part of every '
                             'cache key); the cache drafter \'{"method": "cache", "num_speculative_tokens": 8, '
                             '"prompt_lookup_min": 2, "prompt_lookup_max": 16, "namespace_tokens": 131072}\' (any '
                             'field may be left out; "ngram": the request\'s own tokens only); \'{"method": "none"}\': '
                             'no drafting. Default: the cache drafter where batch-invariant mode is on. Greedy '
                             'outputs are unchanged')
    # KV tiers behind the device pool (kvreuse.cache.tiers): host memory, a disk folder, a Redis server.
    parser.add_argument("--kv-host-memory", type=memory_size_arg("kv_host_memory", allow_zero=True), default=0,
                        metavar="SIZE",
                        help="host-memory KV tier for blocks the device pool evicts, e.g. 4GiB (0: none; on a "
                             "CPU device this is the same RAM as the pool)")
    parser.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                        help="disk KV tier: computed blocks are written here in the background and a server "
                             "restarted on the same folder (same model fingerprint) reuses them")
    parser.add_argument("--kv-disk-size", type=memory_size_arg("kv_disk_size"), default="20GiB", metavar="SIZE",
                        help="most bytes the disk tier keeps (least recently used go first)")
    parser.add_argument("--kv-remote-url", type=remote_url_arg, default=None, metavar="URL",
                        help="remote KV tier on a Redis or Valkey server, redis://[:PASSWORD@]HOST:PORT/DB (or "
                             "rediss://, unix://; redis+cluster://HOST:PORT for a Redis Cluster): every server with "
                             "the same URL and model shares its prefixes; "
                             "a Redis that is down or slow turns lookups into misses, never errors")
    parser.add_argument("--kv-write-queue-size", type=memory_size_arg("kv_write_queue_size"), default="1GiB",
                        metavar="SIZE",
                        help="most bytes of computed blocks waiting to be written to the disk and remote tiers; "
                             "beyond it a block is not written (counted in write_drops), the engine never waits")


def speculative_config_arg(value: str) -> dict[str, Any] | None:
    """``--speculative-config JSON``, checked when the command line is parsed: a bad value stops the
    command before any model is made or loaded, with the field named
    (``kvreuse serve: error: argument --speculative-config: speculative_config.method must be ...``)."""
    try:
        config = SpeculativeConfig.from_value(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if config is None:  # the JSON null: no speculation
        return None
    return config.as_dict()


def memory_size_arg(field_name: str, allow_zero: bool = False) -> Callable[[str], int]:
    """An argparse type: bytes from "4GiB", "512MiB" or a plain number, checked at parse time
    (``allow_zero``: "0" means off)."""

    def parse(value: str) -> int:
        if allow_zero and value.strip() in ("0", "0B", "0b"):
            return 0
        try:
            return parse_memory_size(value, field_name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def remote_url_arg(value: str) -> str:
    """``--kv-remote-url``: a redis://, rediss:// or unix:// URL (checked at parse time)."""
    if not value.startswith(("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
        raise argparse.ArgumentTypeError(f"expected a redis://HOST:PORT/DB, rediss://, unix:// or redis+cluster://HOST:PORT URL, "
                                         f"got {redact_url(value)!r}")
    return value


def redact_url(url: str, mask: str = "***") -> str:
    """The URL with its password (``user:PASSWORD@`` or a ``password=`` query field) replaced by
    ``mask``, or dropped when ``mask`` is empty: for logs, errors and the /v1/models card."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        if has_password:
            userinfo = f"{user}:{mask}" if mask else user
        netloc = f"{userinfo}@{host}" if userinfo else host
    query = parts.query
    if query:
        fields = parse_qsl(query, keep_blank_values=True)
        fields = [(name, mask if name == "password" else value) for name, value in fields
                  if name != "password" or mask]
        query = urlencode(fields, safe="*")
    # Spelled out, not urlunsplit: that drops the "//" of an empty host (unix:///path).
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def llm_from_args(args: argparse.Namespace) -> LLM:
    from kvreuse.llm import LLM

    return LLM(
        args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, load_format=args.load_format,
        quantization=args.quantization, enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy, seed=args.seed, max_pinned_fraction=args.max_pinned_fraction,
        served_model_name=getattr(args, "served_model_name", None),
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        speculative_config=getattr(args, "speculative_config", None),
        kv_host_memory=getattr(args, "kv_host_memory", 0), kv_disk_dir=getattr(args, "kv_disk_dir", None),
        kv_disk_size=getattr(args, "kv_disk_size", "20GiB"), kv_remote_url=getattr(args, "kv_remote_url", None),
        kv_write_queue_size=getattr(args, "kv_write_queue_size", "1GiB"),
        enable_torch_compile=getattr(args, "enable_torch_compile", False),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        attention_backend=getattr(args, "attention_backend", "auto"),
        enforce_eager=getattr(args, "enforce_eager", False),
        batch_invariant=getattr(args, "batch_invariant", None),
        chunk_reuse=getattr(args, "chunk_reuse", False),
        chunk_recompute_fraction=getattr(args, "chunk_recompute_fraction", 0.3),
        chunk_check_layer=getattr(args, "chunk_check_layer", None),
        chunk_recompute_first=getattr(args, "chunk_recompute_first", 0),
        state_snapshot_fraction=getattr(args, "state_snapshot_fraction", 0.25),
        state_snapshot_policy=getattr(args, "state_snapshot_policy", "saved"),
    )
