"""LLMEngine: add_request / step / abort. One step is schedule -> run -> sample -> update.

The engine validates input (a bad request raises before it touches any state, so nothing else in
flight is disturbed), turns the scheduler's decision into a ForwardBatch, samples, checks the stop
conditions it can see in token ids (eos, stop tokens, length) and returns RequestOutputs of token ids.
Text, stop strings and stream deltas are the caller's side (kvreuse.output_processor), which calls
`finish_sequence` when a stop string ends a sample. With ``n > 1`` a request becomes n sequences that
share the prompt (the scheduler's in-batch sharing makes them compute it once).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvreuse.cache.events import KVEventLog
from kvreuse.cache.hashing import namespace_key
from kvreuse.cache.kv import KVCache
from kvreuse.cache.manager import CacheStats, KVCacheManager
from kvreuse.cache.pins import Pin, PinRegistry, PinSpec
from kvreuse.cache.tiers.backends import DiskTier, HostTier, RedisTier
from kvreuse.cache.tiers.fingerprint import files_digest, model_fingerprint
from kvreuse.cache.tiers.record import BlockLayout
from kvreuse.cache.tiers.store import BlockRef, TieredStore
from kvreuse.cache.prefix import Divergence, PrefixMatch
from kvreuse.config import EngineConfig
from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import InputProcessor, PromptInput
from kvreuse.lora.batch import LoRABatch, LoRASegment
from kvreuse.lora.manager import LoRAManager
from kvreuse.lora.request import LoRARequest
from kvreuse.models.loader import load_model, resolve_dtype_with_reason, resolve_model_path
from kvreuse.observatory.drift import DriftLog, cached_continuation
from kvreuse.observatory.scope import ALL, NamespaceOwners, Owner, Scope
from kvreuse.observatory.tree import PrefixHits, largest_subtrees
from kvreuse.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvreuse.request import Request, RequestStatus
from kvreuse.runner.forward_batch import ForwardBatch
from kvreuse.runner.model_runner import ModelRunner
from kvreuse.sampling import Sampler, SamplingParams, SamplingState
from kvreuse.scheduler import Scheduler, ScheduledRequest
from kvreuse.spec.eagle import EagleDraft, load_eagle_draft
from kvreuse.spec.proposer import DraftJob, EagleProposer, Proposal
from kvreuse.spec.verify import VerifyItem, VerifyResult, verify
from kvreuse.tokenizer import Tokenizer

logger = logging.getLogger("kvreuse")

SHARED_OWNER = "shared"  # hit_counters' name for requests without an owner
MAX_TRACKED_NAMESPACES = 65536  # namespace owners kept before those nothing is held of are forgotten


@dataclass
class EngineStats:
    cache: CacheStats
    num_running: int
    num_waiting: int
    num_preemptions: int
    prompt_tokens: int  # prompt tokens of admitted requests
    generation_tokens: int
    steps: int
    num_loras_resident: int = 0
    spec_decode: SpecDecodeStats | None = None
    tiers: dict[str, dict[str, Any]] | None = None  # per tier: queries, hits, bytes, times, verify failures

    def as_dict(self) -> dict[str, Any]:
        cache = self.cache
        spec = self.spec_decode.as_dict() if self.spec_decode is not None else {}
        if self.tiers is not None:
            spec = spec | {"kv_tiers": self.tiers}
        return spec | {
            "prefix_cache_queries_tokens": cache.query_tokens,
            "prefix_cache_hits_tokens": cache.hit_tokens,
            "prefix_cache_hit_rate": cache.hit_rate,
            "prefix_cache_evicted_blocks": cache.evicted_blocks,
            "blocks_total": cache.num_blocks,
            "blocks_in_use": cache.blocks_in_use,
            "blocks_idle_cached": cache.blocks_idle,
            "blocks_free": cache.blocks_free,
            "kv_cache_usage": cache.usage,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "steps": self.steps,
            "num_loras_resident": self.num_loras_resident,
        }


@dataclass
class StepTiming:
    """Where one engine step's time went. On CPU the forward is synchronous, so the split is exact."""

    num_tokens: int  # tokens the model ran (prefill chunks, decodes, drafted tokens to verify)
    num_seqs: int
    step_s: float  # the whole engine step: schedule, batch metadata, forward, sampling, cache updates
    forward_s: float  # of which the model's forward and logits
    output_s: float = 0.0  # after the step: detokenizing and stop strings (added by step_and_process)

    @property
    def overhead_s(self) -> float:
        """Time outside the model: everything but the forward, output processing included."""
        return self.step_s - self.forward_s + self.output_s


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters, as vLLM's ``vllm:spec_decode_*`` metrics."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verifications of at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            # Tokens per verification: 1 (the target's own) + accepted drafts, per draft made.
            "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
        }


@dataclass
class _StepItem:
    """What the engine remembers of one scheduled sequence between its forward and its update."""

    request: Request
    start: int  # num_computed_tokens before the step
    num_tokens: int  # tokens the target ran (including drafted ones)
    draft_token_ids: list[int]  # drafted tokens among them, verified this step
    table: list[int]  # its block table as the forward used it
    first_row: int | None  # its first logits row (None: a prefill chunk that samples nothing)


@dataclass
class _Sequence:
    """Per-sequence output state the scheduler does not need."""

    request: Request
    output: CompletionOutput


@dataclass
class _Group:
    """A user-visible request: n sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    arrival_time: float
    pin_specs: list[PinSpec] = field(default_factory=list)  # pinned once computed (by sequence 0)
    pins_saved: list[str] = field(default_factory=list)
    pins_hit: list[str] = field(default_factory=list)
    owner: str | None = None  # the tenant that sent it (None: no keys, or the offline API)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def finished(self) -> bool:
        return all(seq.output.finished for seq in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        self.dtype, self.dtype_reason = resolve_dtype_with_reason(config.dtype, self.device)
        logger.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), self.dtype_reason)
        model_path = resolve_model_path(config.model)
        self.model_name = config.served_model_name or config.model
        self.model, self.model_config = load_model(
            model_path, dtype=self.dtype, device=self.device, load_format=config.load_format, seed=config.seed
        )
        self.tokenizer = Tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer else model_path)

        # Speculative decoding: the draft's K/V (one more layer) and its per-slot input feature live in
        # the target's KV blocks, so every block costs a little more and holds both.
        self.draft: EagleDraft | None = None
        extra_bytes_per_token = 0
        if config.speculative is not None:
            self.draft = load_eagle_draft(config.speculative.model, config.speculative.method, self.model,
                                          self.model_config.num_hidden_layers, self.dtype, self.device)
            if self.device.type == "cpu":
                self.draft.choose_cpu_kernels()
            element = torch.empty((), dtype=self.dtype).element_size()
            extra_bytes_per_token = (2 * self.model_config.kv_size + self.model_config.hidden_size) * element
            logger.info("speculative decoding: %s draft %s (digest %s), %d tokens per step",
                        config.speculative.method, config.speculative.model, self.draft.digest[:12],
                        config.speculative.num_speculative_tokens)
        cache_config = config.cache
        block_size = cache_config.block_size
        bytes_per_token = self.model_config.kv_bytes_per_token(self.dtype) + extra_bytes_per_token
        num_blocks = KVCache.num_blocks_for_memory(
            cache_config.kv_cache_memory, block_size, self.model_config, self.dtype, extra_bytes_per_token
        )
        capacity = num_blocks * block_size
        context_limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            # Attention over a window equals full attention only while the context fits in it.
            context_limit = min(context_limit, self.model_config.sliding_window)
        if config.max_model_len is not None:
            if config.max_model_len > context_limit:
                raise ValueError(
                    f"max_model_len={config.max_model_len} exceeds the model's context length {context_limit}"
                )
            if config.max_model_len > capacity:
                need = math.ceil(config.max_model_len / block_size) * block_size * bytes_per_token
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}, "
                    f"kv_cache_memory={cache_config.kv_cache_memory} bytes) but one request of "
                    f"max_model_len={config.max_model_len} tokens needs more: raise kv_cache_memory to at "
                    f"least {need} bytes ({need / 2**20:.1f} MiB) or lower max_model_len"
                )
            self.max_model_len = config.max_model_len
        else:
            self.max_model_len = min(context_limit, capacity)
            if self.max_model_len < 2:
                raise ValueError(
                    f"kv_cache_memory={cache_config.kv_cache_memory} bytes holds {capacity} tokens: "
                    f"raise it (each token needs {bytes_per_token} bytes)"
                )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %d bytes per token (%.1f MiB); max_model_len %d; "
            "prefix caching %s",
            num_blocks, block_size, capacity, bytes_per_token, num_blocks * block_size * bytes_per_token / 2**20,
            self.max_model_len, "on" if cache_config.enable_prefix_caching else "off",
        )
        self.kv_cache = KVCache(
            num_layers=self.model_config.num_hidden_layers + (1 if self.draft is not None else 0),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
            feature_size=self.model_config.hidden_size if self.draft is not None else 0,
        )
        self.runner = ModelRunner(self.model, self.model_config, self.kv_cache, self.device,
                                  compile_decode=config.enable_torch_compile,
                                  max_num_seqs=config.scheduler.max_num_seqs)
        # Blocks stored / removed, for routers (GET /v1/cache/events); a bounded ring, cheap to keep.
        self.kv_events = KVEventLog()
        self.kv = KVCacheManager(num_blocks, block_size, cache_config.enable_prefix_caching, self.kv_events)
        self.tier_store: TieredStore | None = None
        if cache_config.has_tiers:
            self.tier_store = self._make_tiers(model_path)
            self.kv.tiers = _TierGlue(self.tier_store, self.kv_cache)
        scheduler_config = config.scheduler
        self.lora: LoRAManager | None = None
        if config.lora.enable_lora:
            self.lora = LoRAManager(self.model_config, self.dtype, self.device, config.lora.max_loras,
                                    config.lora.max_lora_rank)
            scheduler_config = dataclasses.replace(scheduler_config, max_loras=config.lora.max_loras)
        self.sampler = Sampler()
        self.proposer: EagleProposer | None = None
        self.spec_stats: SpecDecodeStats | None = None
        if self.draft is not None and config.speculative is not None:
            self.proposer = EagleProposer(self.draft, self.kv_cache, self.device, self.sampler)
            self.spec_stats = SpecDecodeStats(config.speculative.num_speculative_tokens)
            scheduler_config = dataclasses.replace(
                scheduler_config, num_lookahead_tokens=config.speculative.num_speculative_tokens)
        self._draft_probs: dict[int, torch.Tensor] = {}  # id(Request) -> q of its drafted tokens (random sampling)
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.pins = PinRegistry(self.kv.index, int(cache_config.max_pinned_fraction * num_blocks))
        disk = self.tier_store.tier("disk") if self.tier_store is not None else None
        if isinstance(disk, DiskTier):
            self.pins.listener = disk  # a pinned prefix stays on disk while pinned (and so survives restarts)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        # The engine thread's own way in (string prompts, validation); callers on other threads own theirs.
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, self.model_config.vocab_size)
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[int, tuple[_Group, _Sequence]] = {}  # id(Request) -> owner
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0
        # The observatory (kvreuse.observatory): who used each namespace (the tenant rule), recent misses
        # and their divergence, prefix reuse counts, per-owner hit counters. Cheap: dict updates at
        # admission and one divergence lookup per partial miss; the analysis runs when a report is asked for.
        self.namespace_owners = NamespaceOwners()
        self.drift = DriftLog()
        self.prefix_hits = PrefixHits()
        self._hits_by_owner: dict[Owner, list[int]] = {}  # owner -> [prompt tokens looked up, tokens hit]
        self._prune_owners_at = MAX_TRACKED_NAMESPACES
        # The latest steps' time split (forward vs the rest), for benchmarks and the overhead figure.
        self.step_timings: deque[StepTiming] = deque(maxlen=4096)

    def _make_tiers(self, model_path: Path) -> TieredStore:
        """The host / disk / remote tiers, all keyed to this engine's model fingerprint."""
        cache_config = self.config.cache
        fingerprint = self.model_fingerprint(model_path)
        layout = BlockLayout(shape=(*self.kv_cache.block_shape, self.kv_cache.feature_size),
                             dtype=str(self.dtype).removeprefix("torch."), num_bytes=self.kv_cache.block_bytes)
        tiers: list = []
        if cache_config.kv_host_memory:
            tiers.append(HostTier(cache_config.kv_host_memory))
        if cache_config.kv_disk_dir:
            tiers.append(DiskTier(cache_config.kv_disk_dir, cache_config.kv_disk_size, fingerprint))
        if cache_config.kv_remote_url:
            tiers.append(RedisTier(cache_config.kv_remote_url, fingerprint))
        logger.info("KV tiers: %s; model fingerprint %s", ", ".join(tier.name for tier in tiers), fingerprint)
        return TieredStore(fingerprint, layout, tiers)

    def model_fingerprint(self, model_path: Path) -> str:
        """Digest of everything that decides KV bytes (see kvreuse.cache.tiers.fingerprint)."""
        from kvreuse.models.loader import safetensors_files
        from kvreuse.models.make import cache_dir

        if self.config.load_format == "dummy":
            weights = f"dummy-seed-{self.config.seed}"
        else:
            weights = files_digest(safetensors_files(model_path), memo=cache_dir() / "weights-digests.json")
        tokenizer_dir = resolve_model_path(self.config.tokenizer) if self.config.tokenizer else model_path
        tokenizer_files = [tokenizer_dir / name for name in ("tokenizer.json", "tokenizer_config.json")
                           if (tokenizer_dir / name).is_file()]
        config_file = model_path / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else repr(self.model_config)
        kv = self.kv_cache
        return model_fingerprint({
            "config": config,
            "weights": weights, "tokenizer": files_digest(tokenizer_files) if tokenizer_files else None,
            "dtype": str(self.dtype), "kv_dtype": str(kv.dtype), "block_size": kv.block_size,
            "kv_layers": kv.num_layers, "kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim,
            "feature_size": kv.feature_size, "draft": self.draft_digest,
        })

    # --- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
        pins: list[PinSpec] | tuple[PinSpec, ...] = (),
        owner: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError on bad input, before any state changes.

        ``owner``: the tenant sending it (the server passes the caller's tenant id when keys are
        configured); the observatory shows a namespace's entries to a tenant only when every request
        in it was that tenant's (kvreuse.observatory.scope).

        ``pins``: prefixes of this request to pin once their KV is computed (explicit caching).
        ``lora_request``: the adapter to run with; its KV lives in a namespace keyed by the digest
        of its weights (``adapter_digest``), so no other adapter, nor the base model, can hit it.
        """
        params = sampling_params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        tokenized = self.inputs.from_prompt(prompt)
        prompt_text, token_ids = tokenized.text, tokenized.token_ids
        vocab = self.model_config.vocab_size
        for position, token_id in enumerate(params.stop_token_ids):
            if token_id >= vocab:
                raise InvalidRequestError(
                    f"stop_token_ids[{position}] = {token_id} is outside the vocabulary [0, {vocab})", "stop_token_ids")
        for spec in pins:
            self.check_pin(spec, len(token_ids))
        adapter = self.adapter_digest(lora_request)
        namespace = namespace_key(cache_salt, adapter, self.model_name, self.draft_digest)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(request_id, prompt_text, token_ids, [], arrival, pin_specs=list(pins), owner=owner)
        self._note_owner(namespace, owner)
        for index in range(params.n):
            request = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=list(token_ids),
                sampling_params=params,
                namespace=namespace,
                arrival_time=arrival,
                eos_token_ids=self.eos_token_ids,
                prompt=prompt_text,
                parent_id=request_id,
                index=index,
                adapter=adapter,
            )
            request.sampling_state = SamplingState.create(
                params, self.device, eos_token_ids=sorted(self.eos_token_ids),
                prompt_token_ids=token_ids, sequence_index=index,
            )
            sequence = _Sequence(request, CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None))
            group.sequences.append(sequence)
        self._groups[request_id] = group
        for sequence in group.sequences:
            self._sequences[id(sequence.request)] = (group, sequence)
            self.scheduler.add(sequence.request)

    @property
    def draft_digest(self) -> str | None:
        """The speculative draft's cache identity (None without speculation): part of every namespace,
        because the blocks of this engine also hold the draft's K/V."""
        return self.draft.digest if self.draft is not None else None

    def adapter_digest(self, lora_request: LoRARequest | None) -> str | None:
        """The cache identity of a request's adapter (None: the base model). Loads the adapter when it is
        new or its files changed; raises InvalidRequestError when LoRA is off or the adapter is refused."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise InvalidRequestError("this engine was started without LoRA support (enable_lora=True, or "
                                      "kvreuse serve --enable-lora)", "lora_request")
        return self.lora.resolve(lora_request)

    def check_pin(self, spec: PinSpec, num_prompt_tokens: int) -> None:
        if not self.kv.enable_prefix_caching:
            raise ValueError("pinning a prefix needs prefix caching; it is disabled (enable_prefix_caching=False)")
        if not 0 < spec.num_tokens <= num_prompt_tokens:
            raise ValueError(
                f"a pinned prefix must cover 1..{num_prompt_tokens} prompt tokens, got {spec.num_tokens}"
            )
        if spec.num_tokens < self.kv.block_size:
            raise ValueError(
                f"the prefix to pin has {spec.num_tokens} tokens, shorter than one KV block "
                f"({self.kv.block_size} tokens): too short to be worth caching"
            )
        if spec.ttl is not None and spec.ttl <= 0:
            raise ValueError(f"a pin's ttl must be positive seconds, got {spec.ttl}")

    def finish_sequence(self, request_id: str, index: int, stop_reason: str) -> RequestOutput | None:
        """End one sample that a stop string ended on the caller's side (the engine sees no text).
        Returns the request's final output when this was its last unfinished sample, else None (also
        for a request or sample that has already finished)."""
        group = self._groups.get(request_id)
        if group is None or not 0 <= index < len(group.sequences):
            return None
        sequence = group.sequences[index]
        if sequence.output.finished:
            return None
        sequence.output.finish_reason, sequence.output.stop_reason = "stop", stop_reason
        self._draft_probs.pop(id(sequence.request), None)
        self.scheduler.finish(sequence.request, "stop", stop_reason)
        return self._make_output(group) if group.finished else None

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for sequence in group.sequences:
            self._sequences.pop(id(sequence.request), None)
            self._draft_probs.pop(id(sequence.request), None)
            self.scheduler.finish(sequence.request, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # --- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step_start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        self._steps += 1
        wall_now = time.time()
        self.pins.expire(wall_now)
        for request, match in scheduled.admitted:
            if self.pins.pins and match.nodes:
                used = self.pins.record_use(match.nodes, wall_now)
                if used and request.num_preemptions == 0:
                    self._sequences[id(request)][0].pins_hit.extend(pin.pin_id for pin in used)
            if request.num_preemptions == 0:
                self._prompt_tokens += request.num_prompt_tokens
                group, _ = self._sequences[id(request)]
                if request.index == 0:
                    group.metrics.first_scheduled_time = request.first_scheduled_time
                    group.metrics.num_computed_prompt_tokens = request.num_prompt_tokens - match.num_tokens
                self._observe_admission(group, request, match, wall_now)
            elif logger.isEnabledFor(logging.DEBUG):
                self._log_admission(request, match)

        batch, items = self._build_batch(scheduled.scheduled)
        if self.proposer is not None:
            output = self.runner.run(batch, self.proposer.aux_layers)
            self.proposer.store_features(output, batch.slot_mapping)
            logits = output.logits
        else:
            logits = self.runner.execute(batch)
        sampling = [item for item in items if item.first_row is not None]
        results = self._take_tokens(logits, sampling)
        now = time.monotonic()
        accepted = {id(item.request): result.num_accepted for item, result in zip(sampling, results)}
        for item, result in zip(sampling, results):  # before advance: the block keys need the accepted tokens
            self._append_tokens(item.request, result, now)
        # In the batch's order (sorted by adapter with LoRA), each count with its own request.
        self.scheduler.advance([ScheduledRequest(item.request, item.num_tokens) for item in items], [
            item.num_tokens - len(item.draft_token_ids) + accepted.get(id(item.request), 0) for item in items])
        self._create_due_pins(scheduled.scheduled, wall_now)
        touched: dict[str, _Group] = {}
        for item, result in zip(sampling, results):
            group, sequence = self._sequences[id(item.request)]
            if result.finish is not None:
                self.scheduler.finish(item.request, *result.finish)
                sequence.output.finish_reason, sequence.output.stop_reason = result.finish
            touched[group.request_id] = group
        if self.proposer is not None:
            self._draft(items)
        if self.tier_store is not None:  # after the draft's K/V: a stored block is complete
            for node, namespace in self.kv.take_new_blocks():
                if not node.evicted:
                    self.tier_store.store(BlockRef(node.key, namespace, node.tokens), self.kv_cache.read_block(node.block_id))
        outputs = [self._make_output(group) for group in touched.values()]
        self.step_timings.append(StepTiming(batch.num_tokens, batch.num_seqs, time.perf_counter() - step_start,
                                            self.runner.last_forward_seconds))
        return outputs

    def _take_tokens(self, logits: torch.Tensor, sampling: list[_StepItem]) -> list[VerifyResult]:
        """Sample (and verify drafted tokens) for every sequence that samples this step."""
        verify_items = []
        for item in sampling:
            request = item.request
            assert request.sampling_state is not None
            probs = self._draft_probs.pop(id(request), None)
            if probs is not None:
                probs = probs[: len(item.draft_token_ids)]
            verify_items.append(VerifyItem(request.sampling_state, item.first_row or 0, item.draft_token_ids, probs))

        def finish_check(index: int, token_id: int, count: int) -> tuple[str, int | None] | None:
            request = sampling[index].request
            params = request.sampling_params
            # The sampler masks EOS and stop tokens until min_tokens are out, so no min_tokens check here.
            if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
                return ("stop", token_id)
            if request.num_output_tokens + count >= params.max_tokens or request.num_tokens + count >= self.max_model_len:
                return ("length", None)
            return None

        results = verify(self.sampler, logits, verify_items, finish_check)
        if self.spec_stats is not None:
            for item, result in zip(sampling, results):
                if item.draft_token_ids:
                    self.spec_stats.record(len(item.draft_token_ids), result.num_accepted)
        return results

    def _draft(self, items: list[_StepItem]) -> None:
        """Bring the draft's K/V up to date for every sequence that ran and draft the next tokens of
        those that decode next step."""
        assert self.proposer is not None and self.config.speculative is not None
        k = self.config.speculative.num_speculative_tokens
        block_size = self.kv.block_size
        jobs: list[DraftJob] = []
        for item in items:
            request = item.request
            request.spec_token_ids = []
            valid_end = request.num_computed_tokens
            num_propose = 0
            if request.status is not RequestStatus.FINISHED and valid_end == request.num_tokens - 1:
                params = request.sampling_params
                num_propose = max(0, min(
                    k,
                    params.max_tokens - request.num_output_tokens - 1,  # drafts the target can still take
                    self.max_model_len - request.num_tokens - 1,
                    len(item.table) * block_size - valid_end,  # the lookahead slots held
                ))
            jobs.append(DraftJob(request, item.start, valid_end, num_propose, item.table))
        proposals: dict[int, Proposal] = self.proposer.run(jobs)
        for index, proposal in proposals.items():
            request = jobs[index].request
            request.spec_token_ids = proposal.token_ids
            if proposal.probs is not None:
                self._draft_probs[id(request)] = proposal.probs

    def _create_due_pins(self, scheduled: list[ScheduledRequest], now: float) -> None:
        """Pin the prefixes requested with add_request(pins=...) once their blocks are cached."""
        for item in scheduled:
            request = item.request
            owner = self._sequences.get(id(request))
            if owner is None or not owner[0].pin_specs or request.index != 0:
                continue
            group = owner[0]
            block_size = self.kv.block_size
            for spec in [s for s in group.pin_specs if s.num_tokens <= request.num_computed_tokens]:
                group.pin_specs.remove(spec)
                nodes = request.cached_nodes[: spec.num_tokens // block_size]
                try:
                    pin = self.pins.pin(spec.key, nodes, kind=spec.kind, now=now, ttl=spec.ttl, adapter=spec.adapter,
                                       owner=spec.owner)
                except ValueError as error:
                    logger.warning("request %s: could not pin %d tokens: %s", group.request_id, spec.num_tokens, error)
                    continue
                group.pins_saved.append(pin.pin_id)
                logger.debug("request %s: pinned %d tokens as %s (%s, ttl %s)", group.request_id,
                             pin.num_tokens, pin.pin_id, pin.kind, pin.ttl)

    def _build_batch(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, list[_StepItem]]:
        block_size = self.kv.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        logits_indices: list[int] = []
        items: list[_StepItem] = []
        adapter_rows: dict[str, list[int]] = {}
        if self.lora is not None:
            # Sequences of one adapter side by side: each adapter then owns one contiguous run of rows.
            scheduled = sorted(scheduled, key=lambda item: item.request.adapter or "")
        for scheduled_item in scheduled:
            request, count = scheduled_item.request, scheduled_item.num_tokens
            drafts = list(request.spec_token_ids)
            start = request.num_computed_tokens
            end = start + count
            if request.adapter is not None:
                adapter_rows.setdefault(request.adapter, []).extend(range(len(input_ids), len(input_ids) + count))
            input_ids.extend(request.all_token_ids[start : end - len(drafts)])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            table = request.block_ids
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            query_lens.append(count)
            context_lens.append(end)
            block_tables.append(table[: -(-end // block_size)])
            first_row = None
            if end - len(drafts) == request.num_tokens:  # the prompt is complete: this step yields tokens
                first_row = len(logits_indices)
                logits_indices.extend(range(len(input_ids) - len(drafts) - 1, len(input_ids)))
            items.append(_StepItem(request, start, count, drafts, list(table) if self.proposer else table, first_row))
        device = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long).to(device, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long).to(device, non_blocking=True),
            block_copies=self.kv.take_copies(),
            lora=self._lora_batch(adapter_rows, len(input_ids)),
        )
        return batch, items

    def _lora_batch(self, adapter_rows: dict[str, list[int]], num_tokens: int) -> LoRABatch | None:
        """The step's adapters and their token rows (rows of the base model get no segment)."""
        if not adapter_rows or self.lora is None:
            return None
        in_use = set(adapter_rows)
        segments = []
        for digest, rows in adapter_rows.items():
            adapter = self.lora.activate(digest, in_use)
            if len(rows) == num_tokens:
                segments.append(LoRASegment(adapter, None))
            elif rows[-1] - rows[0] + 1 == len(rows):  # contiguous (the batch is sorted by adapter)
                segments.append(LoRASegment(adapter, slice(rows[0], rows[-1] + 1)))
            else:
                segments.append(LoRASegment(adapter, torch.tensor(rows, dtype=torch.long, device=self.device)))
        return LoRABatch(segments)

    def _append_tokens(self, request: Request, result: VerifyResult, now: float) -> None:
        """Record a step's tokens of one sequence (its SamplingState already has them)."""
        group, sequence = self._sequences[id(request)]
        output = sequence.output
        for token_id, token_logprobs in zip(result.token_ids, result.logprobs):
            request.append_token(token_id)
            output.token_ids.append(token_id)
            output.token_ids_delta.append(token_id)
            if output.logprobs is not None:
                output.logprobs.append(token_logprobs)
        self._generation_tokens += len(result.token_ids)
        if request.first_token_time is None:
            request.first_token_time = now
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now

    def _make_output(self, group: _Group) -> RequestOutput:
        finished = group.finished
        if finished:
            group.metrics.finished_time = time.monotonic()
            self._groups.pop(group.request_id, None)
            for sequence in group.sequences:
                self._sequences.pop(id(sequence.request), None)
        outputs = []
        for sequence in group.sequences:
            output = sequence.output
            outputs.append(
                CompletionOutput(
                    index=output.index, token_ids=list(output.token_ids),
                    finish_reason=output.finish_reason, stop_reason=output.stop_reason,
                    logprobs=list(output.logprobs) if output.logprobs is not None else None,
                    token_ids_delta=output.token_ids_delta,
                )
            )
            output.token_ids_delta = []
        first = group.sequences[0].request
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            cached_tokens_by_tier=self._cached_by_tier(first),
            metrics=group.metrics,
            pins_saved=list(group.pins_saved),
            pins_hit=list(group.pins_hit),
        )

    def _cached_by_tier(self, request: Request) -> dict[str, int] | None:
        """The request's cached tokens split by the tier they were loaded from (the rest: device)."""
        if self.tier_store is None:
            return None
        cached = max(request.num_cached_tokens, 0)
        loaded = {tier: min(tokens, cached) for tier, tokens in request.tier_tokens.items()}
        return {"device": max(cached - sum(loaded.values()), 0)} | {
            tier.name: loaded.get(tier.name, 0) for tier in self.tier_store.tiers}

    # --- introspection ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            cache=self.kv.stats(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            steps=self._steps,
            num_loras_resident=len(self.lora.resident) if self.lora is not None else 0,
            # A copy: the server reads stats on another thread while the engine keeps counting.
            spec_decode=dataclasses.replace(self.spec_stats, accepted_per_position=list(
                self.spec_stats.accepted_per_position)) if self.spec_stats is not None else None,
            tiers=self.tier_store.snapshot() if self.tier_store is not None else None,
        )

    def reset_prefix_cache(self, tiers: tuple[str, ...] = ("device",)) -> int:
        """Drop every idle cached block that is not pinned from the device pool, and every entry of the
        other ``tiers`` named (host, disk, remote; pinned disk entries stay); returns how many went."""
        unknown = sorted(set(tiers) - {"device", "host", "disk", "remote"})
        if unknown:
            raise InvalidRequestError(f"unknown tier(s) {', '.join(unknown)}; tiers are device, host, disk, remote",
                                      "tiers")
        freed = self.kv.reset_prefix_cache() if "device" in tiers else 0
        if self.tier_store is not None:
            freed += sum(self.tier_store.clear([name for name in tiers if name != "device"]).values())
        return freed

    def flush_tiers(self) -> None:
        """Wait until every computed block queued for the disk and remote tiers is written (clean exit)."""
        if self.tier_store is not None:
            self.tier_store.flush()

    # --- pins -------------------------------------------------------------------------------------
    def list_pins(self) -> list[Pin]:
        self.pins.expire(time.time())
        return sorted(self.pins.pins.values(), key=lambda pin: pin.created)

    def get_pin(self, pin_id: str) -> Pin | None:
        """The pin with this id, or None. Expired pins are swept by ``step`` and ``list_pins``, not here:
        a pin just made with a short TTL is still returned to its maker."""
        return self.pins.pins.get(pin_id)

    def unpin(self, pin_id: str) -> Pin:
        """Remove a pin (its blocks stay cached as ordinary LRU entries). KeyError if unknown."""
        return self.pins.unpin(pin_id)

    def check_integrity(self) -> None:
        """Cache-core invariants; tests call this after every step."""
        self.kv.check_integrity(self.scheduler.running)
        for request in self.scheduler.waiting:
            if request.block_ids:
                raise RuntimeError(f"waiting request {request.request_id} holds blocks")

    # --- the observatory --------------------------------------------------------------------------
    def _note_owner(self, namespace: bytes, owner: Owner) -> None:
        self.namespace_owners.add(namespace, owner)
        if len(self.namespace_owners) > self._prune_owners_at:
            # Forget namespaces nothing is held of any more (no cached block, no recorded miss, no request
            # in flight): their text is gone, so forgetting their owners cannot show it to anyone.
            held = set(self.kv.index.roots) | self.drift.namespaces() | {
                sequence.request.namespace for group in self._groups.values() for sequence in group.sequences}
            held.add(namespace)
            self.namespace_owners.prune(held.__contains__)
            self._prune_owners_at = max(MAX_TRACKED_NAMESPACES, 2 * len(self.namespace_owners))  # amortised

    def _observe_admission(self, group: _Group, request: Request, match: PrefixMatch, now: float) -> None:
        """A request's first admission: its owner's hit counters, the prefix it reused, and on a partial
        miss the divergence from the cached text (the drift log; also the --debug explanation)."""
        counters = self._hits_by_owner.setdefault(group.owner, [0, 0])
        counters[0] += request.num_prompt_tokens
        counters[1] += match.num_tokens
        divergence = None
        if self.kv.enable_prefix_caching:
            self.prefix_hits.record(match)
            self.prefix_hits.prune(self.kv.index)
        if self.kv.enable_prefix_caching and request.index == 0 and match.num_tokens < request.num_tokens - 1:
            divergence = self.kv.divergence(request, match)  # the partial miss _log_admission explains
            continuation = cached_continuation(self.kv.index, request.namespace, match, divergence)
            self.drift.record(request.namespace, request.prompt_token_ids, divergence.position, continuation,
                              group.owner, now)
        if logger.isEnabledFor(logging.DEBUG):
            self._log_admission(request, match, divergence)

    def drift_report(self, scope: Scope = ALL, top: int = 10) -> dict[str, Any]:
        """Recent misses that ``scope`` may see, grouped by (namespace, template start, divergence
        position), most tokens lost first: sentences, volatile spans, advice (kvreuse.observatory.drift)."""
        return self.drift.report(scope, top, self.tokenizer.decode, self.namespace_owners)

    def cache_tree(self, scope: Scope = ALL, top: int = 8) -> list[dict[str, Any]]:
        """The prefix index's ``top`` largest cached subtrees ``scope`` may see: {"text" (a preview of the
        prefix, <= 200 chars), "tokens", "blocks", "branches", "pinned", "hits", "namespace",
        "namespace_owner"} (kvreuse.observatory.tree)."""
        return largest_subtrees(self.kv.index, scope, self.namespace_owners, self.prefix_hits,
                                self.tokenizer.decode, top)

    def hit_counters(self, scope: Scope = ALL) -> dict[str, dict[str, int]]:
        """Per owner ("shared" for requests without one) that ``scope`` may see: prompt tokens looked up
        in the cache at first admission ("query_tokens") and of those served from it ("hit_tokens")."""
        return {SHARED_OWNER if owner is None else owner: {"query_tokens": query, "hit_tokens": hit}
                for owner, (query, hit) in self._hits_by_owner.items() if scope.may_see_owner(owner)}

    def _log_admission(self, request: Request, match: PrefixMatch, divergence: Divergence | None = None) -> None:
        total = request.num_tokens
        reused = match.num_tokens
        logger.debug(
            "request %s: %d prompt tokens, reused %d from the prefix cache, computing %d%s",
            request.request_id, total, reused, total - reused,
            f" (after {request.num_preemptions} preemption(s))" if request.num_preemptions else "",
        )
        if not self.kv.enable_prefix_caching or reused >= total - 1:
            return
        if divergence is None:
            divergence = self.kv.divergence(request, match)
        tokens = request.all_token_ids
        position = divergence.position
        before = self.tokenizer.decode(tokens[max(0, position - 12) : position])
        after = self.tokenizer.decode(tokens[position : position + 12])
        if divergence.cached_token is None:
            reason = "nothing was cached beyond this point"
        else:
            cached_text = self.tokenizer.decode([divergence.cached_token])
            reason = f"the cache holds {cached_text!r} (token {divergence.cached_token}) there"
        logger.debug(
            "request %s: cache miss at token position %d: ...%r >>> %r...; prompt token %d, %s",
            request.request_id, position, before, after, tokens[position], reason,
        )


class _TierGlue:
    """What the cache manager calls to reach the tiers: lookups go to the store, loaded payloads into
    the KV tensors (the manager itself never touches a tensor)."""

    def __init__(self, store: TieredStore, kv_cache: KVCache) -> None:
        self.store = store
        self.kv_cache = kv_cache

    def lookup(self, blocks):
        return self.store.lookup(blocks)

    def load(self, block_ids: list[int], payloads: list[memoryview]) -> None:
        for block_id, payload in zip(block_ids, payloads):
            self.kv_cache.write_block(block_id, payload)

    def evicted(self, node) -> None:
        """A block the device pool evicts (its KV still in place): the host tier keeps a copy."""
        if self.store.tier("host") is None:
            return
        root = node
        while root.parent is not None:  # the namespace is the key of the chain's root
            root = root.parent
        self.store.evicted(BlockRef(node.key, root.key, node.tokens), self.kv_cache.read_block(node.block_id))


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    return resolved
