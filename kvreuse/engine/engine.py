"""LLMEngine: add_request / step / abort. One step is schedule -> run -> sample -> update.

The engine validates input (a bad request raises before it touches any state, so nothing else in
flight is disturbed), turns the scheduler's decision into a ForwardBatch, samples, checks the stop
conditions it can see in token ids (eos, stop tokens, length) and returns RequestOutputs of token ids.
Text, stop strings and stream deltas are the caller's side (kvreuse.output_processor), which calls
`finish_sequence` when a stop string ends a sample. With ``n > 1`` a request becomes n sequences that
share the prompt (the scheduler's in-batch sharing makes them compute it once).

Its parts are built from the ``EngineConfig`` by ``kvreuse.engine.builder`` and handed in; this module
is the step loop and the request lifecycle only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

import torch

from kvreuse.attention.blend import BlendSettings, resolved_check_layer
from kvreuse.cache.hashing import namespace_key
from kvreuse.cache.pins import Pin, PinSpec
from kvreuse.config import EngineConfig
from kvreuse.engine.builder import EngineParts, build_engine_parts
from kvreuse.engine.groups import RequestGroup, Sample
from kvreuse.engine.stats import EngineStats, StepTiming
from kvreuse.errors import InvalidRequestError
from kvreuse.grammar.manager import MaskRows
from kvreuse.inputs import InputProcessor, PromptInput
from kvreuse.lora.request import LoRARequest
from kvreuse.observatory.admissions import AdmissionRecorder
from kvreuse.observatory.scope import ALL, Scope
from kvreuse.outputs import CompletionOutput, RequestOutput
from kvreuse.request import Request
from kvreuse.runner.input_batch import StepItem, build_forward_batch
from kvreuse.runner.step_threads import StepThreads
from kvreuse.sampling import SamplingParams, SamplingState
from kvreuse.scheduler import ScheduledRequest
from kvreuse.spec.verify import VerifyItem, VerifyResult, verify

logger = logging.getLogger("kvreuse")


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        parts = parts or build_engine_parts(config)
        self.config = parts.config  # as built: what "auto" resolved to (batch_invariant) included
        self.device, self.dtype, self.dtype_reason = parts.device, parts.dtype, parts.dtype_reason
        self.model_name, self.model, self.model_config = parts.model_name, parts.model, parts.model_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.kv_cache, self.runner, self.kv, self.kv_events = parts.kv_cache, parts.runner, parts.kv, parts.kv_events
        self.tier_store, self.tier_glue = parts.tier_store, parts.tier_glue
        self.lora, self.draft, self.spec = parts.lora, parts.draft, parts.spec
        self.proposer = parts.spec.proposer if parts.spec is not None else None
        self.sampler, self.scheduler, self.pins = parts.sampler, parts.scheduler, parts.pins
        self.structured = parts.structured  # grammars of structured outputs (kvreuse.grammar)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        # The engine thread's own way in (string prompts, validation); callers on other threads own theirs.
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, self.model_config.vocab_size)
        self._groups: dict[str, RequestGroup] = {}
        self._sequences: dict[int, tuple[RequestGroup, Sample]] = {}  # id(Request) -> its group and sample
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0
        # The observatory: per-owner hit counters, prefix reuse, recent misses (kvreuse.observatory).
        self.observatory = AdmissionRecorder(self.kv, self.tokenizer.decode)
        # The latest steps' time split (forward vs the rest), for benchmarks and the overhead figure.
        self.step_timings: deque[StepTiming] = deque(maxlen=4096)
        cache = config.cache
        self.blend = (BlendSettings(resolved_check_layer(cache.chunk_check_layer, self.model_config.num_hidden_layers),
                                    cache.chunk_recompute_fraction, cache.chunk_recompute_first)
                      if cache.chunk_reuse else None)

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
        A prompt dict's ``chunk_spans`` (checked against its ids: in order, non-empty, inside the prompt)
        go on each sample's `Request`.
        """
        params = sampling_params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        tokenized = self.inputs.from_prompt(prompt)
        prompt_text, token_ids = tokenized.text, tokenized.token_ids
        # The chunks' spans ride on the request: with chunk_reuse on, the cache records each chunk and a later prompt
        # reuses its K/V at any position (moved, a share recomputed: the blend); without it they change nothing.
        chunk_spans = tokenized.chunk_spans
        vocab = self.model_config.vocab_size
        for position, token_id in enumerate(params.stop_token_ids):
            if token_id >= vocab:
                raise InvalidRequestError(
                    f"stop_token_ids[{position}] = {token_id} is outside the vocabulary [0, {vocab})", "stop_token_ids")
        for spec in pins:
            self.check_pin(spec, len(token_ids))
        constraint = params.structured_outputs
        if constraint is not None:
            compiling = self.structured.compiler.submit(constraint)
            if compiling.done():
                compiling.result()  # a constraint already known to be refused raises here, before any change
        adapter = self.adapter_digest(lora_request)
        namespace = namespace_key(cache_salt, adapter, self.model_name, self.draft_digest)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, prompt_text, token_ids, [], arrival, pin_specs=list(pins), owner=owner)
        self.observatory.note_owner(namespace, owner, lambda: {
            sample.request.namespace for group in self._groups.values() for sample in group.sequences})
        for index in range(params.n):
            request = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=list(token_ids), sampling_params=params, namespace=namespace,
                arrival_time=arrival, eos_token_ids=self.eos_token_ids, prompt=prompt_text, parent_id=request_id,
                index=index, adapter=adapter, chunk_spans=chunk_spans,
            )
            if index == 0 and pins and self.kv.states is not None:
                # A hybrid keeps its state where each pinned prefix's blocks end (the pin covers whole blocks).
                size = self.kv.block_size
                request.state_marks = sorted({spec.num_tokens // size * size for spec in pins})
            request.sampling_state = SamplingState.create(
                params, self.device, eos_token_ids=sorted(self.eos_token_ids),
                prompt_token_ids=token_ids, sequence_index=index,
            )
            logprobs = [] if params.logprobs is not None else None
            group.sequences.append(Sample(request, CompletionOutput(index=index, logprobs=logprobs)))
        self._groups[request_id] = group
        for sample in group.sequences:
            self._sequences[id(sample.request)] = (group, sample)
            if constraint is not None:
                sample.request.waiting_for_grammar = not self.structured.add(id(sample.request), constraint)
            self.scheduler.add(sample.request)

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
        spec.check(num_prompt_tokens, self.kv.block_size, self.kv.enable_prefix_caching)

    def finish_sequence(self, request_id: str, index: int, stop_reason: str) -> RequestOutput | None:
        """End one sample that a stop string ended on the caller's side (the engine sees no text).
        Returns the request's final output when this was its last unfinished sample, else None (also
        for a request or sample that has already finished)."""
        group = self._groups.get(request_id)
        if group is None or not 0 <= index < len(group.sequences):
            return None
        sample = group.sequences[index]
        if sample.output.finished:
            return None
        sample.output.finish_reason, sample.output.stop_reason = "stop", stop_reason
        self._end(sample.request, "stop", stop_reason)
        return self._make_output(group) if group.finished else None

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for sample in group.sequences:
            self._sequences.pop(id(sample.request), None)
            self._end(sample.request, "abort")

    def _end(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if self.spec is not None:
            self.spec.forget(request)
        self.structured.remove(id(request))
        self.scheduler.finish(request, reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # --- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step_start = time.perf_counter()
        failed = self._resolve_grammars() if self.structured.has_pending() else []
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return failed
        self._steps += 1
        wall_now = time.time()
        self.pins.expire(wall_now)
        for request, match in scheduled.admitted:
            group, _ = self._sequences[id(request)]
            if self.pins.pins and match.nodes:
                used = self.pins.record_use(match.nodes, wall_now)
                if used and request.num_preemptions == 0:
                    group.pins_hit.extend(pin.pin_id for pin in used)
            if request.num_preemptions == 0:
                self._prompt_tokens += request.num_prompt_tokens
                if request.index == 0:
                    group.metrics.first_scheduled_time = request.first_scheduled_time
                    group.metrics.num_computed_prompt_tokens = request.num_prompt_tokens - match.num_tokens
            self.observatory.admitted(request, match, group.owner, wall_now)

        batch, items = build_forward_batch(scheduled.scheduled, self.kv.block_size, self.device, self.kv.take_copies(),
                                           self.lora, copy_tables=self.proposer is not None, blend=self.blend,
                                           state_copies=self.kv.take_state_copies())
        logits = self.spec.forward(self.runner, batch) if self.spec is not None else self.runner.execute(batch)
        if batch.blend is not None:  # how many moved tokens each blended sequence recomputed
            for item in items:
                if item.blend_segment is not None:
                    item.request.num_recomputed_tokens += batch.blend.recomputed[item.blend_segment]
        sampling = [item for item in items if item.first_row is not None]
        results = self._take_tokens(logits, sampling)
        now = time.monotonic()
        for item, result in zip(sampling, results):  # before advance: the block keys need the accepted tokens
            group, sample = self._sequences[id(item.request)]
            sample.append(result.token_ids, result.logprobs, now, group.metrics)
            self._generation_tokens += len(result.token_ids)
        accepted = {id(item.request): result.num_accepted for item, result in zip(sampling, results)}
        # In the batch's order (sorted by adapter with LoRA), each count with its own request.
        self.scheduler.advance([ScheduledRequest(item.request, item.num_tokens) for item in items], [
            item.num_tokens - len(item.draft_token_ids) + accepted.get(id(item.request), 0) for item in items])
        self._create_due_pins(scheduled.scheduled, wall_now)
        touched: dict[str, RequestGroup] = {}
        for item, result in zip(sampling, results):
            group, sample = self._sequences[id(item.request)]
            if result.finish is not None:
                self.structured.remove(id(item.request))
                if self.spec is not None:
                    self.spec.forget(item.request)
                self.scheduler.finish(item.request, *result.finish)
                sample.output.finish_reason, sample.output.stop_reason = result.finish
            touched[group.request_id] = group
        if self.spec is not None:
            self.spec.draft(items, self.max_model_len, len(self.scheduler.running))
        if self.tier_glue is not None:  # after the draft's K/V: a stored block is complete
            self.tier_glue.store_computed(self.kv.take_new_blocks())
        outputs = failed + [self._make_output(group) for group in touched.values()]
        timing = StepTiming(batch.num_tokens, batch.num_seqs, time.perf_counter() - step_start,
                            self.runner.last_forward_seconds)
        self.step_timings.append(timing)
        if self.spec is not None and all(item.num_tokens == len(item.draft_token_ids) + 1 for item in items):
            # Decode and verification steps only: a prefill chunk's rows run GEMM-shaped, cheaper a row than the
            # few rows a draft adds, and would price drafts low between the counts measured.
            self.spec.record_step(timing.num_tokens, timing.step_s)
        return outputs

    def _take_tokens(self, logits: torch.Tensor, sampling: list[StepItem]) -> list[VerifyResult]:
        """Sample (and verify drafted tokens) for every sequence that samples this step."""
        verify_items = []
        for item in sampling:
            request = item.request
            assert request.sampling_state is not None
            probs = self.spec.take_draft_probs(request, len(item.draft_token_ids)) if self.spec is not None else None
            verify_items.append(VerifyItem(request.sampling_state, item.first_row or 0, item.draft_token_ids, probs))
        self.structured.apply(logits, [MaskRows(id(item.request), item.first_row or 0, item.draft_token_ids)
                                       for item in sampling if self.structured.is_constrained(id(item.request))])

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
        for item, result in zip(sampling, results):
            # A grammar that can go no further ends its sequence (EOS is all it would allow next), after the token
            # that ended it: accepted drafts past it are dropped, as a step without drafts never made them.
            taken = self.structured.accept(id(item.request), result.token_ids)
            if taken is not None and taken < len(result.token_ids):
                del result.token_ids[taken:], result.logprobs[taken:]
                result.num_accepted = min(result.num_accepted, taken - 1)
                result.finish = ("stop", None)
            elif taken is not None and result.finish is None:
                result.finish = ("stop", None)
        if self.spec is not None:
            for item, result in zip(sampling, results):
                self.spec.record(item.request, len(item.draft_token_ids), result.num_accepted)
        return results

    def _resolve_grammars(self) -> list[RequestOutput]:
        """Sequences whose grammar finished compiling go on; one whose constraint was refused ends (the
        servers and LLM check constraints before queueing, so this is the rare late refusal). When nothing
        else can run, wait briefly for the compiler rather than spin."""
        idle = not self.scheduler.running and all(request.waiting_for_grammar for request in self.scheduler.waiting)
        outputs = []
        for key, error in self.structured.resolve(block_s=0.05 if idle else 0.0).items():
            group, sample = self._sequences[key]
            sample.request.waiting_for_grammar = False
            if error is not None:
                logger.warning("request %s: %s", group.request_id, error)
                sample.output.finish_reason, sample.output.stop_reason = "abort", str(error)
                self._end(sample.request, "abort", str(error))
                if group.finished:
                    outputs.append(self._make_output(group))
        return outputs

    def _create_due_pins(self, scheduled: list[ScheduledRequest], now: float) -> None:
        """Pin the prefixes requested with add_request(pins=...) once their blocks are cached."""
        for item in scheduled:
            request = item.request
            owner = self._sequences.get(id(request))
            if owner is None or not owner[0].pin_specs or request.index != 0:
                continue
            group = owner[0]
            for spec in [s for s in group.pin_specs if s.num_tokens <= request.num_computed_tokens]:
                group.pin_specs.remove(spec)
                nodes = request.cached_nodes[: spec.num_tokens // self.kv.block_size]
                try:
                    pin = self.pins.pin(spec.key, nodes, kind=spec.kind, now=now, ttl=spec.ttl, adapter=spec.adapter,
                                        owner=spec.owner)
                except ValueError as error:
                    logger.warning("request %s: could not pin %d tokens: %s", group.request_id, spec.num_tokens, error)
                    continue
                group.pins_saved.append(pin.pin_id)
                logger.debug("request %s: pinned %d tokens as %s (%s, ttl %s)", group.request_id,
                             pin.num_tokens, pin.pin_id, pin.kind, pin.ttl)

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        if group.finished:
            group.metrics.finished_time = time.monotonic()
            self._groups.pop(group.request_id, None)
            for sample in group.sequences:
                self._sequences.pop(id(sample.request), None)
        return group.to_output(self._cached_by_tier)

    def _cached_by_tier(self, request: Request) -> dict[str, int] | None:
        """The request's cached tokens split by the tier they were loaded from (the rest: device)."""
        if self.tier_glue is None:
            return None
        return self.tier_glue.cached_by_tier(max(request.num_cached_tokens, 0), request.tier_tokens)

    def share_cpu_with_event_loop(self) -> StepThreads | None:
        """For a server whose event loop shares this process: on CPU, steps of a few tokens run on every
        intra-op thread or on one fewer, whichever their measured time favours (runner/step_threads.py);
        larger steps use every thread. Returns the policy set, or None (a GPU, or a single thread)."""
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or threads < 2:
            return None
        self.runner.step_threads = StepThreads(threads)
        return self.runner.step_threads

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
            running_adapters=self._adapter_names(self.scheduler.running),
            waiting_adapters=self._adapter_names(self.scheduler.waiting),
            max_loras=self.config.lora.max_loras if self.lora is not None else 0,
            spec_decode=self.spec.stats_snapshot() if self.spec is not None else None,
            tiers=self.tier_store.snapshot() if self.tier_store is not None else None,
        )

    def _adapter_names(self, requests: Iterable[Request]) -> tuple[str, ...]:
        """The names of the LoRA adapters these requests run with, sorted, each once (an adapter's
        requests carry its digest; a digest under several names is listed by each)."""
        if self.lora is None:
            return ()
        digests = {request.adapter for request in requests if request.adapter is not None}
        return tuple(sorted(name for name, digest in self.lora.names().items() if digest in digests))

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

    def check_integrity(self) -> None:
        """Cache-core invariants; tests call this after every step."""
        self.kv.check_integrity(self.scheduler.running)
        for request in self.scheduler.waiting:
            if request.block_ids:
                raise RuntimeError(f"waiting request {request.request_id} holds blocks")
            if request.state_slot is not None:
                raise RuntimeError(f"waiting request {request.request_id} holds a state slot")

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

    # --- the observatory (kvreuse.observatory.admissions) -------------------------------------------
    def drift_report(self, scope: Scope = ALL, top: int = 10) -> dict:
        """Recent misses that ``scope`` may see, grouped by (namespace, template start, divergence
        position), most tokens lost first: sentences, volatile spans, advice (kvreuse.observatory.drift)."""
        return self.observatory.drift_report(scope, top)

    def cache_tree(self, scope: Scope = ALL, top: int = 8) -> list[dict]:
        """The prefix index's ``top`` largest cached subtrees ``scope`` may see: {"text" (a preview of the
        prefix, <= 200 chars), "tokens", "blocks", "branches", "pinned", "hits", "namespace",
        "namespace_owner"} (kvreuse.observatory.tree)."""
        return self.observatory.cache_tree(scope, top)

    def hit_counters(self, scope: Scope = ALL) -> dict[str, dict[str, int]]:
        """Per owner ("shared" for requests without one) that ``scope`` may see: prompt tokens looked up
        in the cache at first admission ("query_tokens") and of those served from it ("hit_tokens")."""
        return self.observatory.hit_counters(scope)
