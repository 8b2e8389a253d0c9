"""The live dashboard's time series: a ring buffer of per-owner hit counters and block states, and its
sampler.

The engine counts, per cache owner (a tenant, or ``"shared"`` for requests without one), the prompt
tokens it looked up and the ones it served from the cache; those counters only grow. The server
samples them once a second into `DashboardHistory` (ten minutes by default), with the pool's block
states (free, idle, in use, pinned), and every dashboard reply turns the samples into series the
caller may see: hit rate over a short trailing window, tokens saved (cached prompt tokens) since the
start, and the block states.

Torch-free on purpose: the sampler reaches the engine only through the awaitable it is given (the
server passes ``AsyncEngine.call``), so the aggregation is tested without a model.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("kvreuse.observatory")

SHARED_OWNER = "shared"  # the engine's name for counters of requests without an owner


@dataclass(frozen=True)
class HitCounter:
    """Cumulative prompt tokens looked up in the cache, and of those, served from it."""

    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.query_tokens if self.query_tokens else None

    def minus(self, earlier: HitCounter) -> HitCounter:
        # Clamped: a counter never goes back, but a reading torn across a reset must not show a negative rate.
        return HitCounter(max(0, self.query_tokens - earlier.query_tokens),
                          max(0, self.hit_tokens - earlier.hit_tokens))

    def plus(self, other: HitCounter) -> HitCounter:
        return HitCounter(self.query_tokens + other.query_tokens, self.hit_tokens + other.hit_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {"query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens, "hit_rate": self.hit_rate}


def counters_from(raw: Mapping[str, Mapping[str, Any]]) -> dict[str, HitCounter]:
    """The engine's ``hit_counters`` reply (owner -> {"query_tokens", "hit_tokens"}) as HitCounters."""
    return {str(owner): HitCounter(int(values.get("query_tokens", 0)), int(values.get("hit_tokens", 0)))
            for owner, values in raw.items()}


BLOCK_STATES = ("free", "idle", "in_use", "pinned")


@dataclass(frozen=True)
class EngineReading:
    """What one trip to the engine thread brings back for a sample."""

    counters: Mapping[str, HitCounter]  # owner -> cumulative counters
    pinned_blocks: int  # distinct blocks held by pins, every tenant's


@dataclass(frozen=True)
class Sample:
    time: float  # Unix seconds (the page shows wall-clock times)
    counters: Mapping[str, HitCounter]  # owner -> cumulative counters at that time
    blocks: Mapping[str, int] = field(default_factory=dict)  # BLOCK_STATES -> blocks in that state


class DashboardHistory:
    """The last ``capacity`` samples; the oldest drops out when a new one comes."""

    def __init__(self, capacity: int = 600, window_s: float = 10.0) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2 samples, got {capacity}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s  # the trailing window a hit-rate point is computed over
        self._samples: deque[Sample] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)

    def latest(self) -> Sample | None:
        return self._samples[-1] if self._samples else None

    def series(self, visible: Callable[[str], bool], include_total: bool) -> dict[str, Any]:
        """Per visible owner (and the sum over every owner when ``include_total``): the hit rate over
        the trailing window at each sample (None where no prompt token was looked up in it) and the
        cumulative tokens saved; a tenant's page never sums another tenant's traffic. Block states are
        the pool's, the same for every caller (as on /metrics), except pinned blocks, which count every
        tenant's pins: only with ``include_total``."""
        samples = list(self._samples)
        times = [sample.time for sample in samples]
        owners = sorted({owner for sample in samples for owner in sample.counters if visible(owner)})
        starts = [bisect.bisect_left(times, t - self.window_s) for t in times]

        def one(read: Callable[[Sample], HitCounter]) -> dict[str, list[Any]]:
            values = [read(sample) for sample in samples]
            return {"hit_rate": [_rounded(values[i].minus(values[start]).hit_rate) for i, start in enumerate(starts)],
                    "tokens_saved": [value.hit_tokens for value in values],
                    "query_tokens": [value.query_tokens for value in values]}

        states = BLOCK_STATES if include_total else tuple(state for state in BLOCK_STATES if state != "pinned")
        return {
            "window_s": self.window_s,
            "time": [round(t, 3) for t in times],
            "total": one(_total) if include_total else None,
            "owners": {owner: one(lambda sample, owner=owner: sample.counters.get(owner, HitCounter()))
                       for owner in owners},
            "blocks": {state: [sample.blocks.get(state) for sample in samples] for state in states},
        }

    def recent(self, counters: Mapping[str, HitCounter], visible: Callable[[str], bool], include_total: bool,
               now: float) -> dict[str, Any]:
        """Cumulative figures now (``counters``: a fresh reading) and the hit rate over the trailing
        window, per visible owner and in total."""
        base = self._at_or_before(now - self.window_s)
        earlier = base.counters if base is not None else {}

        def figures(current: HitCounter, before: HitCounter) -> dict[str, Any]:
            recent = current.minus(before)
            return current.as_dict() | {"hit_rate": _rounded(current.hit_rate),
                                        "recent_hit_rate": _rounded(recent.hit_rate)}

        result: dict[str, Any] = {"window_s": self.window_s, "owners": {
            owner: figures(counter, earlier.get(owner, HitCounter()))
            for owner, counter in sorted(counters.items()) if visible(owner)}}
        result["total"] = figures(_sum(counters.values()), _sum(earlier.values())) if include_total else None
        return result

    def _at_or_before(self, t: float) -> Sample | None:
        found = None
        for sample in self._samples:
            if sample.time > t:
                break
            found = sample
        return found if found is not None else (self._samples[0] if self._samples else None)


def _total(sample: Sample) -> HitCounter:
    return _sum(sample.counters.values())


def _sum(counters: Any) -> HitCounter:
    total = HitCounter()
    for counter in counters:
        total = total.plus(counter)
    return total


def _rounded(rate: float | None) -> float | None:
    return None if rate is None else round(rate, 4)


@dataclass
class HitSampler:
    """Takes one sample per ``interval_s`` on the event loop. ``read`` fetches the engine's counters
    and pinned blocks (the server runs it on the engine thread through AsyncEngine.call); ``pool`` reads
    the free / idle / in-use counts from a snapshot the loop may read; ``marker`` is a cheap value read
    on the loop that changes whenever the counters may have (the engine's step count and cache counters
    from its stats snapshot): while it stays the same the last reading is reused, so an idle engine
    thread is not woken every second."""

    read: Callable[[], Awaitable[EngineReading]]
    history: DashboardHistory
    pool: Callable[[], Mapping[str, int]] | None = None
    marker: Callable[[], Hashable] | None = None
    interval_s: float = 1.0
    clock: Callable[[], float] = time.time
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _last: EngineReading | None = field(default=None, init=False, repr=False)
    _last_marker: Hashable = field(default=None, init=False, repr=False)
    _failures: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")

    def ensure_started(self) -> None:
        """Start sampling on the running event loop (idempotent; restarts a task that ended)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvreuse-dashboard-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def sample_once(self) -> Sample:
        marker = self.marker() if self.marker is not None else None
        if self._last is None or self.marker is None or marker != self._last_marker:
            # The marker is read before the counters: a change that lands in between is seen next time.
            self._last = await self.read()
            self._last_marker = marker
        blocks = dict(self.pool()) if self.pool is not None else {}
        blocks["pinned"] = self._last.pinned_blocks
        sample = Sample(self.clock(), self._last.counters, blocks)
        self.history.add(sample)
        return sample

    async def _run(self) -> None:
        while True:
            try:
                await self.sample_once()
                self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the engine stopping (shutdown) or failing must not end the sampler
                self._failures += 1
                if self._failures == 1:
                    logger.warning("dashboard sampler: reading the hit counters failed: %s", error)
            await asyncio.sleep(self.interval_s)
