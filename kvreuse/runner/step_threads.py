"""How many intra-op CPU threads a server's engine step runs on, chosen by measuring the steps themselves.

A server runs its event loop (HTTP, detokenizing, streaming) on a thread of the engine's process. While
it runs Python, it holds a core, and an engine step whose thread team wants every core then waits at each
parallel region for the team member the loop displaced. A step of a few tokens (one-stream decode) pays
that at every one of its few-microsecond regions; whether the second core's bandwidth repays it depends on
the model. Measured served on 2 cores (bench_gguf.py, one-stream decode tok/s on 2 threads vs 1):
SmolLM2-135M Q4_1 36 vs 56, qwen2.5-0.5b Q4_K_M 28.8 vs 26.3. (Those served steps ran beside a second
OpenMP team, which made the step's team sleep between regions and cost two threads the most;
runner/thread_team.py removed it, and two threads now win on SmolLM2 too: 17.7 against 23.4 ms. The
policy measures, so it follows.) Steps of many tokens (prefill, 8 or more streams) need every core:
SmolLM2's 16-stream decode is 172 on 2 threads, 125 on 1.

So a step of more than ``small_step_tokens`` tokens runs on every thread, and a smaller one on whichever
of ``threads`` and ``threads - 1`` has recently given the shorter step for its token count and context
band (the longest context in the step: under 512 tokens, under 2,048, under 8,192, longer; a step's time
and which count wins change with the context, and one set of medians for all contexts mixed them, so the
choice flipped back and forth as a long conversation grew): the policy
runs small steps on ``threads - 1`` first, tries the other count for ``probe_steps`` steps once each count
has ``probe_steps`` measurements and then every ``reprobe_every`` small steps, and compares the medians
of the latest ``window`` step times per (token count, thread count): medians, because a step that meets
the next request's arrival or a client's burst of work takes half as long again, and a running mean let
those flip the choice back and forth (measured: qwen2.5-0.5b's one-stream decode fell to 26 tok/s, below
either fixed count). The measurement is the step as served, event loop included, so it decides what a
microbenchmark at start-up could not see.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger("kvreuse")


@dataclass
class StepThreads:
    """The thread count for each step (``for_step``) and what each count measured (``record``)."""

    threads: int
    # A one-stream step verifying up to 16 drafted tokens (config.MAX_SPECULATIVE_TOKENS) is small too: measured
    # served under load, 2 threads ran such a step in 452 ms where 1 ran it in 16.
    small_step_tokens: int = 17
    probe_steps: int = 8
    reprobe_every: int = 256
    window: int = 16
    # (token count, context band, thread count) -> the latest step seconds
    step_seconds: dict[tuple[int, int, int], deque[float]] = field(default_factory=dict)
    _small_steps: int = 0
    _probe_left: int = 0
    _probing: int | None = None  # the thread count a probe is measuring, while one runs
    _chosen: dict[tuple[int, int], int] = field(default_factory=dict)  # (tokens, band) -> the count last chosen

    def __post_init__(self) -> None:
        if self.threads < 2:
            raise ValueError(f"threads must be at least 2 to leave a core, got {self.threads}")

    @property
    def small_step_threads(self) -> int:
        return self.threads - 1

    def for_step(self, num_tokens: int, context_len: int = 0) -> int:
        if num_tokens > self.small_step_tokens:
            return self.threads
        self._small_steps += 1
        if self._probe_left > 0:
            self._probe_left -= 1
            return self._probing  # type: ignore[return-value]
        self._probing = None
        kind = (num_tokens, context_band(context_len))
        best = self.best(*kind)
        if self._chosen.get(kind, self.small_step_threads) != best:
            logger.info("CPU steps of %d token(s) over %s now run on %d of %d threads (median step %s)", num_tokens,
                        BAND_NAMES[kind[1]], best, self.threads, self.describe(*kind))
        self._chosen[kind] = best
        other = self.threads if best == self.small_step_threads else self.small_step_threads
        unmeasured = (*kind, other) not in self.step_seconds
        if (unmeasured and self._small_steps > self.probe_steps) or self._small_steps % self.reprobe_every == 0:
            self._probing, self._probe_left = other, self.probe_steps - 1
            return other
        return best

    def best(self, num_tokens: int, band: int = 0) -> int:
        """The count with the shorter median step for this token count and context band (``threads - 1``
        until both are known)."""
        small = self.step_seconds.get((num_tokens, band, self.small_step_threads))
        full = self.step_seconds.get((num_tokens, band, self.threads))
        if not small or not full:
            return self.small_step_threads
        return self.threads if statistics.median(full) < statistics.median(small) else self.small_step_threads

    def describe(self, num_tokens: int, band: int = 0) -> str:
        """The median step per thread count for this token count and band, e.g. "1 thread 18.2 ms, 2 threads 27.9 ms"."""
        parts = [f"{threads} thread{'s' if threads > 1 else ''} {statistics.median(times) * 1e3:.1f} ms"
                 for (tokens, kind, threads), times in sorted(self.step_seconds.items())
                 if (tokens, kind) == (num_tokens, band) and times]
        return ", ".join(parts) or "not measured"

    def record(self, num_tokens: int, threads: int, seconds: float, context_len: int = 0) -> None:
        if num_tokens > self.small_step_tokens:
            return
        key = (num_tokens, context_band(context_len), threads)
        self.step_seconds.setdefault(key, deque(maxlen=self.window)).append(seconds)


# Context bands, by the step's longest context: [0, 512), [512, 2048), [2048, 8192), [8192, ...).
BAND_EDGES = (512, 2048, 8192)
BAND_NAMES = ("contexts under 512 tokens", "contexts of 512-2,047 tokens", "contexts of 2,048-8,191 tokens",
              "contexts of 8,192 tokens or more")


def context_band(context_len: int) -> int:
    return sum(context_len >= edge for edge in BAND_EDGES)
