"""Scheduler: continuous batching under a token budget, cache-aware admission, preemption.

Each step it decides how many tokens of which requests run. Running requests go first (a decode
costs one token, an unfinished prefill a chunk of what is left); then waiting requests are admitted
while the budget, ``max_num_seqs`` and the KV pool allow. Under the ``lpm`` policy the waiting queue
is ordered by cached-prefix length (longest first), with aging: a request passed over
``starvation_limit`` times goes before any cache-favoured one. When a running request cannot grow,
the most recently admitted request is preempted (its computed blocks stay cached, so re-admission
hits them). A waiting request whose next block is being computed by a running prefill is held back
one step, so two requests with the same new prefix compute it once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvreuse.cache.manager import KVCacheManager
from kvreuse.cache.prefix import PrefixMatch
from kvreuse.config import SchedulerConfig
from kvreuse.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[tuple[Request, PrefixMatch]] = field(default_factory=list)  # for logging
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._arrivals = 0

    # --- queue management -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival_order = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Take a request out (finished or aborted) and release its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            return
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.finished_time = time.monotonic()

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, self._limit(request))
            if request.spec_token_ids:  # verify as many drafted tokens as the budget leaves room for
                del request.spec_token_ids[budget - num_new:]
                num_new += len(request.spec_token_ids)
            while not self.kv.grow(request, num_new + self._lookahead(request, num_new)):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: nothing more fits

        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _limit(self, request: Request) -> int:
        limit = self.kv.step_limit(request)
        return request.num_tokens if limit is None else limit

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots to reserve past this step's tokens: a sequence that samples this step drafts up to
        ``num_lookahead_tokens`` tokens, whose draft K/V need slots before the target has verified them."""
        lookahead = self.config.num_lookahead_tokens
        if lookahead and request.num_computed_tokens + num_new - len(request.spec_token_ids) >= request.num_tokens:
            return lookahead
        return 0

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return
        config = self.config
        use_lpm = config.scheduling_policy == "lpm" and len(self.waiting) <= config.lpm_max_queue
        matches: dict[int, PrefixMatch] = {}
        if use_lpm and self.kv.enable_prefix_caching:
            for request in self.waiting:
                matches[id(request)] = self.kv.match(request)
            order = sorted(
                self.waiting,
                key=lambda r: (
                    r.num_times_passed_over < config.starvation_limit,  # starving first
                    -matches[id(r)].num_tokens,
                    r.arrival_order,
                ),
            )
        else:
            order = list(self.waiting)

        admitted: list[Request] = []
        adapters = {r.adapter for r in self.running if r.adapter is not None}
        for request in order:
            if budget <= 0 or len(self.running) >= config.max_num_seqs:
                break
            if request.waiting_for_grammar:
                continue  # its constraint is compiling off the engine thread; the others go on
            if (config.max_loras is not None and request.adapter is not None
                    and request.adapter not in adapters and len(adapters) >= config.max_loras):
                continue  # max_loras other adapters are running; this one waits for a slot
            match = matches.get(id(request))
            # Taken fresh where the order's match may be stale: a hybrid's snapshot lookup always, and a match whose
            # blocks an admission before this one evicted to make room (idle blocks, as this request's were).
            if match is None or self.kv.states is not None or not self.kv.is_current(match):
                match = self.kv.match(request)
            if self.kv.is_next_block_pending(request, match):
                continue  # another prefill is computing this prefix; it will be a hit next step
            # Reuse beyond the prefix (issue 39): the blended blocks an earlier blend cached after the exact hit,
            # then tokens whose K/V the pool holds at other positions. A blend computes the rest of the prompt in
            # one step, so it needs the budget for all of it; else the prompt runs with its exact hit only.
            match, blended = self.kv.match_blended(request, match)  # both no-ops without chunk reuse
            num_new = min(request.num_tokens - match.num_tokens, budget)
            # A hybrid's first chunk stops where the request leaves the cached path, or at a prefix it pins: its state
            # is kept there.
            for stop in (self.kv.branch_point(request, match), self.kv.next_state_mark(request, match.num_tokens)):
                if stop is not None:
                    num_new = min(num_new, stop - match.num_tokens)
            moved = self.kv.match_moved(request, match)
            if moved and num_new < request.num_tokens - match.num_tokens:
                request.chunk_misses = sorted(request.chunk_misses + [(span.start, span.end, "step_budget")
                                                                      for span in moved if span.kind == "chunk"])
                moved = []
            lookahead = self.config.num_lookahead_tokens if match.num_tokens + num_new >= request.num_tokens else 0
            if not self.kv.admit(request, match, num_new + lookahead, moved):
                break  # the pool is full of running requests; wait for some to finish
            request.moved_spans = moved
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = match.num_tokens + sum(span.num_tokens for span in moved)
                request.num_moved_tokens += blended  # reused, and not exact: reported with the moved tokens
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            if request.adapter is not None:
                adapters.add(request.adapter)
            admitted.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            out.admitted.append((request, match))
            budget -= num_new

        if not admitted:
            return
        admitted_ids = {id(r) for r in admitted}
        self.waiting = deque(r for r in self.waiting if id(r) not in admitted_ids)
        latest = max(r.arrival_order for r in admitted)
        for request in self.waiting:
            if request.arrival_order < latest:
                request.num_times_passed_over += 1

    # --- after the forward ------------------------------------------------------------------------
    def advance(self, scheduled: list[ScheduledRequest], num_computed: list[int] | None = None) -> None:
        """Account for computed tokens and cache every block that became full.

        ``num_computed[i]``: tokens of ``scheduled[i]`` whose K/V are now final (default: all it ran);
        fewer when drafted tokens were rejected: their slots are overwritten by later steps.
        """
        for index, item in enumerate(scheduled):
            request = item.request
            request.num_computed_tokens += item.num_tokens if num_computed is None else num_computed[index]
            if request.status is RequestStatus.RUNNING:
                self.kv.cache_computed_blocks(request)
        self.kv.end_step()
