"""Building an engine's parts from its ``EngineConfig``, apart from the step that uses them.

In order: the device and dtype (and why), the model and its tokenizer, the EAGLE draft (its K/V and
input feature live in the target's blocks, so it sizes the pool too), the KV pool (blocks that fit
``kv_cache_memory``; ``max_model_len`` checked against the model's context and the pool), the model
runner, the cache manager with its KV event log, the tiers keyed to the model fingerprint, LoRA,
the speculative step, the scheduler and the pin registry. Every refusal is a ``ValueError`` naming the
setting and the limit, raised before the engine exists.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.attention import cpu_paged
from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.blend import resolved_check_layer
from kvreuse.attention.torch_paged import TorchPagedAttention
from kvreuse.cache.events import KVEventLog
from kvreuse.cache.kv import KVCache
from kvreuse.cache.kv_quant import (
    kv_bytes_per_token,
    kv_float_dtype,
    resolve_kv_cache_dtype,
)
from kvreuse.cache.manager import KVCacheManager
from kvreuse.cache.pins import PinRegistry
from kvreuse.cache.recurrent_state import RecurrentStatePool
from kvreuse.cache.state_slots import StateSlots
from kvreuse.cache.tiers.backends import DiskTier, HostTier, RedisTier
from kvreuse.cache.tiers.fingerprint import files_digest, model_fingerprint
from kvreuse.cache.tiers.glue import TierGlue
from kvreuse.cache.tiers.record import BlockLayout
from kvreuse.cache.tiers.store import TieredStore
from kvreuse.config import EngineConfig, SpeculativeConfig, cache_dir
from kvreuse.grammar.compiler import GrammarCompiler
from kvreuse.grammar.manager import StructuredOutputManager
from kvreuse.kernels import fused_ops, paged_attention, qpacked, quant_ops
from kvreuse.layers import experts, plan_book
from kvreuse.loading.gguf import gguf_digest, is_gguf_path, read_gguf
from kvreuse.loading.loader import (
    load_model,
    resolve_dtype_with_reason,
    resolve_model_path,
    resolve_quantization,
    resolve_tokenizer_path,
    safetensors_files,
)
from kvreuse.lora.manager import LoRAManager
from kvreuse.models.config import ModelConfig
from kvreuse.models.llama import LlamaFamilyForCausalLM
from kvreuse.runner.decode.cuda_graphs import estimate_graph_memory, why_no_graphs
from kvreuse.runner.host_allocator import return_free_heap
from kvreuse.runner.model_runner import ModelRunner
from kvreuse.sampling import Sampler
from kvreuse.scheduler import Scheduler
from kvreuse.spec.cache_drafter import CacheDrafter
from kvreuse.spec.decoding import SpeculativeDecoding
from kvreuse.spec.eagle import EagleDraft, load_eagle_draft
from kvreuse.spec.proposer import EagleProposer
from kvreuse.tokenizer import Tokenizer

logger = logging.getLogger("kvreuse")


@dataclass
class EngineParts:
    """Everything an ``LLMEngine`` steps with, built and checked."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str  # why this dtype ("as asked", or the hardware fact behind "auto")
    model_name: str  # the served name: part of every cache namespace
    model: LlamaFamilyForCausalLM
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    kv_cache: KVCache
    runner: ModelRunner
    kv_events: KVEventLog
    kv: KVCacheManager
    tier_store: TieredStore | None
    tier_glue: TierGlue | None
    lora: LoRAManager | None
    draft: EagleDraft | None
    spec: SpeculativeDecoding | None
    sampler: Sampler
    scheduler: Scheduler
    pins: PinRegistry
    structured: StructuredOutputManager


def build_engine_parts(config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    dtype, dtype_reason = resolve_dtype_with_reason(config.dtype, device)
    logger.info("dtype %s (%s)", str(dtype).removeprefix("torch."), dtype_reason)
    model_path = resolve_model_path(config.model)
    model, model_config = load_model(model_path, dtype=dtype, device=device, load_format=config.load_format,
                                     seed=config.seed, quantization=config.quantization)
    if model_config.is_hybrid:
        config = hybrid_settings(config, model_config)
    cache_drafts_asked = config.speculative is not None and config.speculative.uses_cache_drafter
    if cache_drafts_asked and config.batch_invariant is False:
        raise ValueError(f"speculative_config method {config.speculative.method!r} verifies drafts exactly only in "
                         f"batch-invariant mode (a verified row must be the bits a one-token step gives), and "
                         f"batch_invariant=False turns it off: drop one of the two")
    if config.batch_invariant is None:
        on, reason = auto_batch_invariant(config, model, model_config, device)
        if cache_drafts_asked and not on:
            on, reason = True, f"cache drafts asked for (speculative_config), where auto says off: {reason}"
        config = dataclasses.replace(config, batch_invariant=on)
        logger.info("batch-invariant mode %s (auto: %s)", "on" if on else "off", reason)
    if config.batch_invariant:
        try:
            refuse_batch_invariant(config, model_config)
            if cache_drafts_asked and device.type != "cpu":
                raise ValueError(f"batch_invariant is built for CPU only so far (device {device})")
        except ValueError as error:
            if not cache_drafts_asked:
                raise
            raise ValueError(f"speculative_config method {config.speculative.method!r} verifies drafts exactly only "
                             f"in batch-invariant mode: {error}") from None
    gguf_file = is_gguf_path(model_path)
    tokenizer_path = resolve_tokenizer_path(config.tokenizer or model_path)
    tokenizer = Tokenizer(tokenizer_path)

    # Speculative decoding: the draft's K/V (one more layer) and its per-slot input feature live in the
    # target's KV blocks, so every block costs a little more and holds both.
    draft: EagleDraft | None = None
    extra_bytes_per_token = 0
    if config.speculative is not None and config.speculative.uses_draft_model:
        assert config.speculative.model is not None
        draft = load_eagle_draft(config.speculative.model, config.speculative.method, model,
                                 model_config.num_kv_layers, dtype, device)
        if device.type == "cpu":
            draft.choose_cpu_kernels(batch_invariant=config.batch_invariant)
        element = torch.empty((), dtype=dtype).element_size()
        # The draft's one layer of K/V (stored like the target's) and its feature (in the model's dtype).
        extra_bytes_per_token = (kv_bytes_per_token(1, model_config.num_key_value_heads, model_config.head_dim,
                                                    kv_float_dtype(config.cache.kv_cache_dtype, dtype),
                                                    resolve_kv_cache_dtype(config.cache.kv_cache_dtype))
                                 + model_config.hidden_size * element)
        logger.info("speculative decoding: %s draft %s (digest %s), %d tokens per step", config.speculative.method,
                    config.speculative.model, draft.digest[:12], config.speculative.num_speculative_tokens)

    if device.type == "cpu":
        gc.collect()
        return_free_heap()  # what loading freed (a GGUF header, repacking's intermediates) back to the system
    attention_backend = choose_attention_backend(config, device, dtype)
    sizing = config  # what the pool is sized from: kv_cache_memory less what the decode graphs take
    if why_no_graphs(model, device, attention_backend or model.attention_backend, config.enforce_eager) is None:
        # The decode graphs' memory comes out of kv_cache_memory: measured now, on a one-block scratch pool.
        model.set_attention_backend(attention_backend)
        scratch = KVCache(model_config.num_kv_layers, 1, config.cache.block_size, model_config.num_key_value_heads,
                          model_config.head_dim, dtype, device, kv_cache_dtype=config.cache.kv_cache_dtype)
        graph_bytes = estimate_graph_memory(model, scratch, device, config.scheduler.max_num_seqs)
        del scratch
        logger.info("CUDA graphs: about %.1f MiB of activations for %d rows, taken from kv_cache_memory",
                    graph_bytes / 2**20, config.scheduler.max_num_seqs)
        sizing = dataclasses.replace(config, cache=dataclasses.replace(
            config.cache, kv_cache_memory=max(1, config.cache.kv_cache_memory - graph_bytes)))
    num_state_slots = 0
    if model_config.state_layers:  # a per-sequence recurrent state: its slots come out of kv_cache_memory
        num_state_slots, state_bytes = state_pool_slots(sizing, model_config)
        sizing = dataclasses.replace(sizing, cache=dataclasses.replace(
            sizing.cache, kv_cache_memory=sizing.cache.kv_cache_memory - state_bytes))
    num_blocks, max_model_len = size_kv_pool(sizing, model_config, dtype, extra_bytes_per_token)
    kv_cache = KVCache(
        num_layers=model_config.num_kv_layers + (1 if draft is not None else 0),
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=dtype,
        device=device,
        feature_size=model_config.hidden_size if draft is not None else 0,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        plane_layers=model_config.num_plane_layers,
        plane_size=model_config.plane_size,
    )
    # Blocks stored / removed (and a hybrid's states kept / dropped), for routers (GET /v1/cache/events); a bounded
    # ring, cheap to keep.
    kv_events = KVEventLog()
    state_slots: StateSlots | None = None
    if num_state_slots:
        kv_cache.states = RecurrentStatePool(num_state_slots, len(model_config.state_layers),
                                             *model_config.state_matrix_shape, model_config.state_conv_dim,
                                             model_config.conv_kernel, device)
        state_slots = StateSlots(config.cache.block_size, num_state_slots, config.scheduler.max_num_seqs,
                                 kv_cache.states.slot_bytes, config.cache.state_snapshot_policy, kv_events)
        logger.info("recurrent states: %d slots of %.1f MiB (%d for running requests, lent to the snapshots while "
                    "idle; %d for snapshots)",
                    num_state_slots, model_config.state_bytes / 2**20, config.scheduler.max_num_seqs,
                    num_state_slots - config.scheduler.max_num_seqs)
    runner = ModelRunner(model, model_config, kv_cache, device,
                         max_num_seqs=config.scheduler.max_num_seqs, attention_backend=attention_backend,
                         enforce_eager=config.enforce_eager, max_model_len=max_model_len,
                         batch_invariant=config.batch_invariant)
    held = model.weight_memory_bytes()
    on_disk = f" (the file: {model_path.stat().st_size / 2**20:.1f} MiB)" if gguf_file else ""
    logger.info("weights: %.1f MiB as held%s", held / 2**20, on_disk)
    if config.cache.chunk_reuse:
        refuse_chunk_reuse(config, model_config, runner)
    kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, kv_events,
                        chunk_reuse=config.cache.chunk_reuse, states=state_slots)
    tier_store = tier_glue = None
    if config.cache.has_tiers:
        fingerprint = engine_fingerprint(config, model_path, model_config, kv_cache, dtype, draft, tokenizer_path,
                                         int8_activations=model.runs_int8_activations(),
                                         bf16_tiles=model.runs_bf16_tiles(), packed_products=model.runs_packed_products(),
                                         float_products=model.float_product_kernels(),
                                         attention=type(model.attention_backend).__name__)
        tier_store = make_tiers(config, kv_cache, fingerprint)
        tier_glue = kv.tiers = TierGlue(tier_store, kv_cache, kv_cache.states)

    scheduler_config = config.scheduler
    lora = None
    if config.lora.enable_lora:
        lora = LoRAManager(model_config, dtype, device, config.lora.max_loras, config.lora.max_lora_rank)
        scheduler_config = dataclasses.replace(scheduler_config, max_loras=config.lora.max_loras)
    sampler = Sampler()
    spec = None
    cache_settings, why = cache_drafter_settings(config, device)
    logger.info("cache drafts: %s", why)
    cache_drafter = (CacheDrafter(cache_settings.prompt_lookup_min, cache_settings.prompt_lookup_max,
                                  cache_settings.namespace_tokens) if cache_settings is not None else None)
    if draft is not None and config.speculative is not None:
        k = config.speculative.num_speculative_tokens
        spec = SpeculativeDecoding(max(k, cache_settings.num_speculative_tokens if cache_settings else 0),
                                   config.cache.block_size, eagle=EagleProposer(draft, kv_cache, device, sampler),
                                   cache=cache_drafter)
        scheduler_config = dataclasses.replace(scheduler_config, num_lookahead_tokens=k)
    elif cache_drafter is not None and cache_settings is not None:
        spec = SpeculativeDecoding(cache_settings.num_speculative_tokens, config.cache.block_size, cache=cache_drafter)
    pins = PinRegistry(kv.index, int(config.cache.max_pinned_fraction * num_blocks))
    disk = tier_store.tier("disk") if tier_store is not None else None
    if isinstance(disk, DiskTier):
        pins.listener = disk  # a pinned prefix stays on disk while pinned (and so survives restarts)
    structured = StructuredOutputManager(
        GrammarCompiler(tokenizer_path, model_config.vocab_size, sorted(tokenizer.eos_token_ids)),
        model_config.vocab_size, sorted(tokenizer.eos_token_ids))
    if spec is not None and spec.eagle is not None:
        spec.eagle.draft_mask = lambda requests, drafted, logits: structured.mask_drafts(
            [id(request) for request in requests], drafted, logits)
    if spec is not None:
        spec.constrain = structured.allowed_draft
    if device.type == "cpu":
        return_free_heap()  # what building the rest freed
    return EngineParts(
        config=config, device=device, dtype=dtype, dtype_reason=dtype_reason,
        model_name=config.served_model_name or config.model, model=model, model_config=model_config,
        tokenizer=tokenizer, max_model_len=max_model_len, kv_cache=kv_cache, runner=runner, kv_events=kv_events,
        kv=kv, tier_store=tier_store, tier_glue=tier_glue, lora=lora, draft=draft, spec=spec, sampler=sampler,
        scheduler=Scheduler(scheduler_config, kv), pins=pins,
        structured=structured,
    )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    return resolved


def choose_attention_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> AttentionBackend | None:
    """The attention backend ``config.attention_backend`` asks for; None keeps the model's TorchPagedAttention.
    auto: the in-place C++ kernel on CPU where it builds and the Triton kernels on CUDA where triton is installed.
    Logged once, with the reason where it is not the kernel."""
    choice = config.attention_backend
    if config.batch_invariant and choice not in ("auto", "cpu_paged"):
        raise ValueError(f"batch_invariant runs every attention row in the CPU paged kernel (attention_backend auto "
                         f"or cpu_paged), not {choice!r}")
    if choice == "torch":
        logger.info("attention: torch (gather + SDPA), as asked")
        return None
    if config.batch_invariant and device.type != "cpu":
        raise ValueError(f"batch_invariant is built for CPU only so far (device {device}): the Triton kernels' "
                         f"split sizes and cuBLAS's tiles follow the batch")
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        return _triton_backend(config, device, asked=choice == "triton")
    backend = cpu_paged.paged_attention_backend(device, dtype, config.batch_invariant)
    if config.batch_invariant:
        if backend is None:  # choice is auto or cpu_paged (checked above)
            raise ValueError(f"batch_invariant runs every attention row in the CPU paged kernel (the kernel "
                             f"built): device {device}, dtype {dtype}")
        logger.info("attention: cpu_paged, batch-invariant (every row in the kernel, partitions of %d keys)",
                    cpu_paged.INVARIANT_PARTITION)
        return backend
    if choice == "cpu_paged":
        if backend is None:
            raise ValueError(f"attention_backend 'cpu_paged' needs a CPU device, a float32 / bfloat16 / float16 "
                             f"model and the kernel built (device {device}, dtype {dtype}; see the log)")
    elif backend is None:
        logger.info("attention: torch (gather + SDPA): the in-place kernel does not run on %s / %s here", device, dtype)
        return None
    logger.info("attention: cpu_paged (the in-place C++ kernel; chunks over cached context of more than %d "
                "tokens gather and run SDPA)", cpu_paged.MAX_PAGED_QUERIES)
    return backend


def _triton_backend(config: EngineConfig, device: torch.device, asked: bool) -> AttentionBackend | None:
    """The Triton backend, or (under auto, when it cannot run) None with the reason logged. On CPU it runs only
    where ``TRITON_INTERPRET=1`` makes Triton interpret its kernels with NumPy: how the tests run it."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    problem = None
    if importlib.util.find_spec("triton") is None:
        problem = "triton is not installed (pip install triton; torch's CUDA wheels bring it)"
    elif device.type != "cuda" and not interpreted:
        problem = f"its kernels run on CUDA (on {device} only under TRITON_INTERPRET=1, for tests)"
    if problem is not None:
        if asked:
            raise ValueError(f"attention_backend 'triton' cannot run here: {problem}")
        logger.info("attention: torch (gather + SDPA): %s", problem)
        return None
    from kvreuse.attention.triton_paged import TritonPagedAttention

    logger.info("attention: triton (paged kernels reading the blocks in place%s)",
                ", interpreted on CPU" if device.type != "cuda" else "")
    return TritonPagedAttention()


def size_kv_pool(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                 extra_bytes_per_token: int = 0) -> tuple[int, int]:
    """(blocks in ``kv_cache_memory``, max_model_len): the configured length checked against the model's
    context and the pool, or the longest both allow."""
    cache_config = config.cache
    block_size = cache_config.block_size
    bytes_per_token = KVCache.bytes_per_token(model_config, dtype, cache_config.kv_cache_dtype) + extra_bytes_per_token
    num_blocks = KVCache.num_blocks_for_memory(cache_config.kv_cache_memory, block_size, model_config, dtype,
                                               extra_bytes_per_token, cache_config.kv_cache_dtype)
    capacity = num_blocks * block_size
    context_limit = model_config.max_position_embeddings
    if model_config.sliding_window and not model_config.layer_types:
        # A window every layer shares (Mistral) is not applied by the model: attention over it equals full
        # attention only while the context fits in it. Per-layer windows (Gemma 3) are applied by the attention
        # backends, over a cache that keeps every token.
        context_limit = min(context_limit, model_config.sliding_window)
    if config.max_model_len is not None:
        if config.max_model_len > context_limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length {context_limit}")
        if config.max_model_len > capacity:
            need = math.ceil(config.max_model_len / block_size) * block_size * bytes_per_token
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}, "
                f"kv_cache_memory={cache_config.kv_cache_memory} bytes) but one request of "
                f"max_model_len={config.max_model_len} tokens needs more: raise kv_cache_memory to at "
                f"least {need} bytes ({need / 2**20:.1f} MiB) or lower max_model_len"
            )
        max_model_len = config.max_model_len
    else:
        max_model_len = min(context_limit, capacity)
        if max_model_len < 2:
            raise ValueError(f"kv_cache_memory={cache_config.kv_cache_memory} bytes holds {capacity} tokens: "
                             f"raise it (each token needs {bytes_per_token} bytes)")
    scheme = resolve_kv_cache_dtype(cache_config.kv_cache_dtype)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %d bytes per token (%.1f MiB; %d tokens per GiB; K/V stored "
        "as %s); max_model_len %d; prefix caching %s",
        num_blocks, block_size, capacity, bytes_per_token, num_blocks * block_size * bytes_per_token / 2**20,
        2**30 // bytes_per_token, scheme.describe() if scheme is not None
        else str(kv_float_dtype(cache_config.kv_cache_dtype, dtype)).removeprefix("torch."),
        max_model_len, "on" if cache_config.enable_prefix_caching else "off",
    )
    return num_blocks, max_model_len


def engine_fingerprint(config: EngineConfig, model_path: Path, model_config: ModelConfig, kv_cache: KVCache,
                       dtype: torch.dtype, draft: EagleDraft | None, tokenizer_path: Path | None = None,
                       int8_activations: bool = False, bf16_tiles: bool = False, packed_products: bool = False,
                       float_products: tuple[str, ...] = ("plain",), attention: str = "NativePagedAttention") -> str:
    """Digest of everything that decides KV bytes (see kvreuse.cache.tiers.fingerprint).

    A GGUF model adds its weight format (each tensor type and its count, e.g. "gguf:F32x61+Q4_1x210+Q8_0x1")
    beside the file's digest, so KV computed from a Q4 file is never served to a Q8 file of the same
    architecture, and a record says which format made it; a folder's fingerprint has no such field and
    stays what it was (stored records keep hitting). A quantized method ("gguf", "int8") adds itself: the
    quantized kernels round differently from the float path over the same file (and int8's weights are
    not the files'), so the KV they compute is another's. So does a model whose quantized products may
    round their inputs to int8 (``int8_activations``: a plan that picks qdot8, layers/quantized_linear.py): its K/V
    differ from the exact products' by that rounding, and the choice is measured per machine. So does one
    whose many-row products may multiply tiles of dequantized weights rounded to bfloat16 (``bf16_tiles``:
    a plan that picks qtile_bf16). So does one whose quantized products run on the packed int8 kernel
    (``packed_products``: batch-invariant mode, kernels/qpacked.py), whose float sums run otherwise than qdot8's.
    So do float weights' product kernels other than plain F.linear (``float_products``: the measured plans'
    rowdot, split or oneDNN products sum in other orders) and an attention backend other than the CPU default
    (``attention``: the torch reference's SDPA and the Triton kernels reduce otherwise than the in-place
    kernel, and a layer's K/V follow from the earlier layers' attention). The native decode step is not in
    it: it computes each layer's ops in the same order as the Python layers, bit for bit
    (tests/test_native_step.py holds every architecture and kernel to that), so it cannot change a block.
    """
    gguf_file = is_gguf_path(model_path)
    if config.load_format == "dummy":
        weights = f"dummy-seed-{config.seed}"
    elif gguf_file:
        weights = gguf_digest(model_path)
    else:
        weights = files_digest(safetensors_files(model_path), memo=cache_dir() / "weights-digests.json")
    tokenizer_dir = tokenizer_path or resolve_tokenizer_path(config.tokenizer or model_path)
    tokenizer_files = [tokenizer_dir / name for name in ("tokenizer.json", "tokenizer_config.json")
                       if (tokenizer_dir / name).is_file()]
    fields = {}
    method = resolve_quantization(config.quantization, None if config.load_format == "dummy" else model_path,
                                  kv_cache.device)
    if method != "none":  # other arithmetic (int8: other weights) than the float path: other KV
        fields["quantization"] = method
    if gguf_file:
        info = read_gguf(model_path)
        model_json = info.hf_config
        fields["weight_format"] = "dummy" if config.load_format == "dummy" else info.weight_format
    else:
        config_file = model_path / "config.json"
        model_json = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() \
            else repr(model_config)
    return model_fingerprint({
        "config": model_json, **fields,
        "weights": weights, "tokenizer": files_digest(tokenizer_files) if tokenizer_files else None,
        **({"kv_cache_dtype": kv_cache.scheme.describe()} if kv_cache.scheme is not None else {}),
        **({"activations": f"int8 (qdot8, arithmetic {quant_ops.INT8_ARITHMETIC})"} if int8_activations else {}),
        **({"weight_tiles": "bfloat16 (qtile_bf16)"} if bf16_tiles else {}),
        **({"packed_products": qpacked.ARITHMETIC} if packed_products else {}),
        **({"float_products": "+".join(float_products)} if float_products != ("plain",) else {}),
        **({"attention": attention} if attention != "NativePagedAttention" else {}),
        # Batch-invariant mode's arithmetic: one product kernel at every row count, attention in the paged kernel
        # over fixed partitions; K/V of the default (measured, per row count) arithmetic are another's.
        **({"arithmetic": f"batch-invariant (attention partitions of {cpu_paged.INVARIANT_PARTITION} keys)"}
           if config.batch_invariant else {}),
        # gpt-oss's experts' activation in one kernel (fused_ops.clamped_swiglu): SLEEF's exp on every value,
        # where eager sigmoid takes std::exp on the scalar tails of its thread's chunk, so a prefill split
        # otherwise between threads rounded a few values otherwise before it.
        **({"expert_activation": "clamped_swiglu (kvreuse_fused)"} if clamped_swiglu_kernel(model_config, kv_cache)
           else {}),
        # Gemma's and Qwen3.5's (1 + weight) norms in one kernel (fused_ops.rms_norm_float_scale): the row's sum in its
        # own order, where PyTorch's rms_norm vectorises it, so K/V from before differ in their last bits.
        **({"offset_norm": "rms_norm_float_scale (kvreuse_fused)"} if offset_norm_kernel(model_config, kv_cache)
           else {}),
        # A shared expert's sigmoid gate on rows of 64 copies (layers/experts.py shared_expert_scale), where eager
        # sigmoid on [rows, 1] took std::exp on its tail: K/V from before differ in their last bits.
        **({"shared_expert_gate": f"sigmoid rows of {experts.SIGMOID_ROW}"}
           if model_config.moe is not None and model_config.moe.shared_expert_intermediate_size else {}),
        # LFM2's short convolution sums its taps in tap order (fused_ops.short_conv and its reference alike), where it
        # took PyTorch's sum over the tap axis before: K/V and planes from before may differ in their last bits.
        **({"short_conv": "taps summed in order"} if model_config.num_plane_layers else {}),
        # A float pool in another dtype than the model's (kv_cache_dtype bfloat16): other bytes.
        **({"kv_storage": str(kv_cache.storage_dtype)} if kv_cache.scheme is None
           and kv_cache.storage_dtype != kv_cache.dtype else {}),
        "dtype": str(dtype), "kv_dtype": str(kv_cache.dtype), "block_size": kv_cache.block_size,
        "kv_layers": kv_cache.num_layers, "kv_heads": kv_cache.num_kv_heads, "head_dim": kv_cache.head_dim,
        "feature_size": kv_cache.feature_size, "draft": draft.digest if draft is not None else None,
    })


def clamped_swiglu_kernel(model_config: ModelConfig, kv_cache: KVCache) -> bool:
    """Whether the model's experts take their clamped SwiGLU (gpt-oss) from fused_ops' kernel."""
    moe = model_config.moe
    return (moe is not None and moe.swiglu_limit is not None and kv_cache.device.type == "cpu"
            and fused_ops.available())


def offset_norm_kernel(model_config: ModelConfig, kv_cache: KVCache) -> bool:
    """Whether the model's float32-scaled norms (Gemma's and Qwen3.5's (1 + weight), Nemotron-H's weight outside
    float32) run in fused_ops' kernel."""
    float_scaled = (model_config.norm_style in ("gemma", "offset")
                    or (model_config.architecture == "NemotronHForCausalLM" and kv_cache.dtype != torch.float32))
    return float_scaled and kv_cache.device.type == "cpu" and fused_ops.available()


def make_tiers(config: EngineConfig, kv_cache: KVCache, fingerprint: str) -> TieredStore:
    """The host / disk / remote tiers, all keyed to the engine's model fingerprint."""
    cache_config = config.cache
    layout = BlockLayout(shape=(*kv_cache.block_shape, kv_cache.feature_size),
                         dtype=kv_cache.scheme.name if kv_cache.scheme is not None
                         else str(kv_cache.dtype).removeprefix("torch."), num_bytes=kv_cache.block_bytes)
    tiers: list = []
    if cache_config.kv_host_memory:
        tiers.append(HostTier(cache_config.kv_host_memory))
    if cache_config.kv_disk_dir:
        tiers.append(DiskTier(cache_config.kv_disk_dir, cache_config.kv_disk_size, fingerprint))
    if cache_config.kv_remote_url:
        tiers.append(RedisTier(cache_config.kv_remote_url, fingerprint))
    logger.info("KV tiers: %s; model fingerprint %s", ", ".join(tier.name for tier in tiers), fingerprint)
    states = kv_cache.states  # a hybrid's recurrent states go with their blocks (issue 66)
    state = None if states is None else BlockLayout(
        shape=(states.slot_bytes // 4,), dtype="state:float32", num_bytes=states.slot_bytes)
    return TieredStore(fingerprint, layout, tiers, max_queue_bytes=cache_config.kv_write_queue_size, state=state)


def snapshot_slots(config: EngineConfig, model_config: ModelConfig) -> int:
    """How many state snapshots ``state_snapshot_fraction`` of kv_cache_memory holds (at least one)."""
    return max(1, int(config.cache.kv_cache_memory * config.cache.state_snapshot_fraction) // model_config.state_bytes)


def state_pool_slots(config: EngineConfig, model_config: ModelConfig) -> tuple[int, int]:
    """(slots, bytes) of a hybrid's recurrent-state pool: one per running request (max_num_seqs) and as many snapshots
    as ``state_snapshot_fraction`` of kv_cache_memory holds (at least one), all out of kv_cache_memory."""
    per_slot = model_config.state_bytes
    snapshots = snapshot_slots(config, model_config)
    slots = config.scheduler.max_num_seqs + snapshots
    if slots * per_slot >= config.cache.kv_cache_memory:
        raise ValueError(f"kv_cache_memory={config.cache.kv_cache_memory} bytes cannot hold {model_config.architecture}'s "
                         f"recurrent states ({slots} of {per_slot / 2**20:.1f} MiB: max_num_seqs="
                         f"{config.scheduler.max_num_seqs} running and {snapshots} snapshots) and K/V beside them: "
                         f"raise kv_cache_memory or lower max_num_seqs")
    return slots, slots * per_slot


def hybrid_settings(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """``config`` as a hybrid model (short convolutions among the attention layers: issue 66) runs it, or a
    ValueError naming what it cannot do yet. Its conv layers keep each token's input in the pool (cache/kv.py
    planes), so prefix caching, tiers and cache drafts work as for any model; an EAGLE draft, chunk reuse and
    LoRA are not built for its layers."""
    kinds = {"linear_attention": "Gated DeltaNet layers", "mamba2": "Mamba-2 layers", "conv": "short convolutions"}
    kind = " and ".join(sorted({kinds[model_config.layer_types[layer]] for layer in model_config.recurrent_layers}))
    name = f"a hybrid model ({model_config.architecture}: {len(model_config.recurrent_layers)} of its " \
           f"{model_config.num_hidden_layers} layers are {kind})"
    if config.speculative is not None and config.speculative.uses_draft_model:
        raise ValueError(f"speculative_config method {config.speculative.method!r} on {name} is not implemented; "
                         "the cache drafter (method cache) runs on it")
    if config.cache.chunk_reuse:
        raise ValueError(f"chunk_reuse on {name} is not implemented (prefix reuse is)")
    if config.lora.enable_lora:
        raise ValueError(f"enable_lora on {name} is not implemented")
    if model_config.state_layers:
        # Each running request holds a slot of recurrent state (18.7 MiB at nemotron-h-0.5b's shapes). Where
        # max_num_seqs of them and the snapshots' share would not fit in kv_cache_memory (the default 64 at 1 GiB),
        # fewer run at once, their states and the snapshots within half of it, instead of a refusal at start.
        memory, per_slot = config.cache.kv_cache_memory, model_config.state_bytes
        snapshots = snapshot_slots(config, model_config)
        fit = memory // 2 // per_slot - snapshots
        if (config.scheduler.max_num_seqs + snapshots) * per_slot >= memory and fit >= 1:
            logger.warning("max_num_seqs lowered from %d to %d: %s's recurrent state takes %.1f MiB a running request, "
                           "and %d of them beside %d snapshots do not fit in kv_cache_memory (%.0f MiB); raise "
                           "kv_cache_memory to run more at once", config.scheduler.max_num_seqs, fit,
                           model_config.architecture, per_slot / 2**20, config.scheduler.max_num_seqs, snapshots,
                           memory / 2**20)
            config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_seqs=fit))
        # A verification step runs drafted tokens through the state, and a rejected one cannot be taken back out.
        if config.speculative is not None and config.speculative.uses_cache_drafter:
            raise ValueError(f"speculative_config method {config.speculative.method!r} on {name} is not implemented: "
                             f"its {kind}' state would take in the rejected drafts")
        config = dataclasses.replace(config, speculative=SpeculativeConfig(method="none"))
    return config


def cache_drafter_settings(config: EngineConfig, device: torch.device) -> tuple[SpeculativeConfig | None, str]:
    """The cache drafter's settings (None: it does not run), and why. It runs where its drafts are verified exactly:
    batch-invariant mode gives a verification row the bits a one-token step gives (every product and attention
    row on one arithmetic whatever the step's rows). Asked for (method cache or ngram), the builder turned the
    mode on or refused; left unset, it runs where the mode is on; with an EAGLE draft it runs beside it when the
    mode is on; {"method": "none"} turns it off."""
    asked = config.speculative
    if asked is not None and asked.method == "none":
        return None, 'off (speculative_config {"method": "none"})'
    if asked is not None and asked.uses_cache_drafter:
        return asked, f"on ({asked.as_dict()})"
    if not config.batch_invariant or device.type != "cpu":
        return None, ("off (auto: a verified draft is exact only in batch-invariant mode, which is off here; "
                      "speculative_config {\"method\": \"cache\"} turns both on)")
    settings = SpeculativeConfig(method="cache")
    return settings, f"on (auto: batch-invariant mode is on; {settings.as_dict()})"


def auto_batch_invariant(config: EngineConfig, model: LlamaFamilyForCausalLM, model_config: ModelConfig,
                         device: torch.device) -> tuple[bool, str]:
    """Whether batch-invariant mode is on when not asked either way, and why: on where it costs little, which is
    where every product runs on the packed int8 kernel (kernels/qpacked.py: a q8_0, q4_0 or q4_1 GGUF file on a
    CPU with AVX512-VNNI; there decode and warm prefills are faster than the default plan's, a short fresh
    prefill about as fast, a 2,048-token one 1.67x as long: docs/benchmarks.md) and nothing it does not cover is
    asked for. Float weights would run the row-dot GEMV at every row count (a cold prefill 1.5-2.8x as long), so
    a folder stays on the default path."""
    if device.type != "cpu":
        return False, f"device {device.type}"
    try:
        refuse_batch_invariant(config, model_config)
    except ValueError as exc:
        return False, str(exc).removeprefix("batch_invariant is ")
    for refused, reason in (
            (config.speculative is not None and config.speculative.uses_draft_model,
             "an EAGLE draft (its float products would run the row-dot GEMV)"),
            (config.attention_backend not in ("auto", "cpu_paged"), f"attention_backend {config.attention_backend}"),
            (os.environ.get(plan_book.KERNEL_ENV, "auto").strip().lower() != "auto",
             f"{plan_book.KERNEL_ENV} forces a product kernel"),
            # Asked before the kernel's availability, which builds it: a folder never builds it here.
            (not model.products_run_packed(), "not every product is a q8_0, q4_0 or q4_1 weight the packed int8 "
                                              "kernel runs (float weights would run the row-dot GEMV, slower on a "
                                              "cold prefill; the kernel needs AVX512-VNNI)"),
            (not paged_attention.available(), "the CPU paged attention kernel is not built")):
        if refused:
            return False, reason
    return True, "every product on the packed int8 kernel; --no-batch-invariant turns it off"


def refuse_batch_invariant(config: EngineConfig, model_config: ModelConfig) -> None:
    """A ValueError naming what batch-invariant mode does not cover yet, if the configuration asks for it."""
    windowed = model_config.sliding_window is not None or "sliding_attention" in model_config.layer_types
    for reason, refused in (
            ("sliding-window layers (the kernel's tiles start at a window that follows the step's rows)", windowed),
            ("LoRA adapters (their grouped products follow the batch)", config.lora.enable_lora),
            ("chunk_reuse (a blend recomputes rows selected by the step)", config.cache.chunk_reuse)):
        if refused:
            raise ValueError(f"batch_invariant is not built for {reason} yet")


def refuse_chunk_reuse(config: EngineConfig, model_config: ModelConfig, runner: ModelRunner) -> None:
    """A ValueError naming why chunk reuse (issue 39) cannot run with this configuration, if it cannot."""
    if config.speculative is not None and config.speculative.uses_draft_model:
        raise ValueError("chunk_reuse with speculative decoding is not implemented: a blended prefill returns the "
                         "recomputed rows' hidden states only, and the draft reads every row's")
    if not isinstance(runner.attention_backend, (TorchPagedAttention, cpu_paged.NativePagedAttention)):
        raise ValueError(f"chunk_reuse runs on the torch and native CPU attention backends, not on "
                         f"{type(runner.attention_backend).__name__}, which attends contiguous queries only")
    check_layer = resolved_check_layer(config.cache.chunk_check_layer, model_config.num_hidden_layers)
    if config.cache.chunk_recompute_fraction > 0 and check_layer >= model_config.num_hidden_layers - 1:
        raise ValueError(f"chunk_check_layer must be below {model_config.num_hidden_layers - 1} (the model has "
                         f"{model_config.num_hidden_layers} layers; some must run after it), got {check_layer}")
