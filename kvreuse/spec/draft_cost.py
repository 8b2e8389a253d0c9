"""How many drafted tokens are worth verifying: a cost model measured on the machine, sized over the whole step.

Verifying a draft adds rows to the next forward. How much they cost is the machine's and the kernel's business:
on the Xeon VM of docs/benchmarks.md SmolLM2 Q4_1's forward takes 4.4 ms for one row, 5.6 for two, 7.7 for four
and 15 for nine (the packed int8 kernel sums exactly on VNNI up to 4 rows; above, without AMX, it takes the
slower path), so a fitted line undercounts short drafts. ``DraftCost`` keeps the time of decode and verification
steps per row count (a running mean each: the forward, the sampling and verification of its rows, the drafting
around it; the engine leaves prefill steps out, whose GEMM-shaped rows cost less each than a draft's), and the
step's drafts are cut together (``allocate``): every drafted token of every sequence is worth its expected
accepted tokens (the product, over the tokens of its draft up to it, of the drafter's confidence and the
request's acceptance rate so far: ``AcceptanceRate``), the tokens are taken best first, and the step keeps the
count N that maximises

    (sequences decoding + expected accepted tokens of the best N) / (step time at sequences + N rows)

the expected tokens per second of the step. Sizing each sequence's draft alone, as if no other sequence added
rows, over-drafts a busy step: sixteen sequences that each find 3 rows worth it add 48 rows together, which
none of them priced (issue 65's run 3 lost 15% at 16 streams on the edit workload that way).

Past the largest row count measured, a step goes at most ``EXPLORE_ROWS`` further, and only while the rate still
rises at that count; a step whose own rows were never measured drafts nothing (it measures them). A count
measured slow once
(a step that met a page fault or another process) would never be chosen again and so never measured again:
every ``EXPLORE_EVERY`` steps the step keeps the drafts up to the nearest count above its choice whose
measurement is older than ``STALE_STEPS`` steps. A decision depends on nothing but the step's drafts and the
machine's times (a cache draft never changes greedy output; seeded requests are never cache-drafted).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Row counts measured at most (steps above it are prefills, not verification).
MAX_ROWS = 512
# Weight of a new measurement in a row count's running mean.
EMA = 0.2
# A row count's time is re-measured when it is this many steps old, at most once every EXPLORE_EVERY steps.
STALE_STEPS = 512
EXPLORE_EVERY = 64
# Rows a step may go past the largest count measured: one more pass of the packed kernel (4 rows). A step far
# past it (16 streams drafting 8 each: 144 rows, three times a 16-row step on a 0.5B Q8_0 file) costs more than
# its drafts ever bring back when it turns out slow.
EXPLORE_ROWS = 4


@dataclass
class AcceptanceRate:
    """A request's chance that its next drafted token is accepted, given the one before was: accepted tokens
    over tokens checked (a rejection ends the check), decayed so that the latest drafts count most, from a
    prior of 0.8 over two tokens."""

    accepted: float = 1.6
    checked: float = 2.0

    @property
    def rate(self) -> float:
        return self.accepted / self.checked

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.accepted = 0.8 * self.accepted + num_accepted
        self.checked = 0.8 * self.checked + min(num_accepted + 1, num_drafted)


def expected_gains(confidence: list[float], acceptance: float) -> list[float]:
    """Each drafted token's expected accepted tokens: it counts only if every token before it was accepted."""
    gains, running = [], 1.0
    for share in confidence:
        running *= share * acceptance
        gains.append(running)
    return gains


class DraftCost:
    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # rows -> running mean of the step's seconds
        self._measured_at: dict[int, int] = {}  # rows -> the step that last measured it
        self._measured: list[int] = []  # the row counts measured, sorted (looked up per step by bisection)
        self._steps = 0
        self._last_explore = -EXPLORE_EVERY

    def record(self, rows: int, step_seconds: float) -> None:
        self._steps += 1
        if rows <= 0 or rows > MAX_ROWS or step_seconds <= 0:
            return
        previous = self._seconds.get(rows)
        if previous is None:
            bisect.insort(self._measured, rows)
        else:  # a step that met something else (a page fault, another process) counts as 2x the mean at most
            step_seconds = (1 - EMA) * previous + EMA * min(step_seconds, 2 * previous)
        self._seconds[rows] = step_seconds
        self._measured_at[rows] = self._steps

    @property
    def measured_rows(self) -> list[int]:
        """The row counts measured so far, in order."""
        return list(self._measured)

    def step_seconds(self, rows: int) -> float | None:
        """A step's time at ``rows`` rows: measured, or between the nearest measured counts on both sides (a
        straight line); None above the largest count measured (not known yet)."""
        exact = self._seconds.get(rows)
        if exact is not None:
            return exact
        place = bisect.bisect_left(self._measured, rows)
        if place == len(self._measured):
            return None
        above = self._measured[place]
        if place == 0:
            return self._seconds[above]
        below = self._measured[place - 1]
        low, high = self._seconds[below], self._seconds[above]
        return low + (high - low) * (rows - below) / (above - below)

    def allocate(self, gains: list[list[float]], num_sequences: int, extra_rows: int = 0,
                 extra_tokens: float = 0.0) -> list[int]:
        """How many of each draft's tokens to verify next step: ``gains[i]`` are draft i's tokens' expected
        accepted tokens (non-increasing: ``expected_gains``), ``num_sequences`` sequences decode (each yields one
        token without drafts), and ``extra_rows`` rows already chosen (another drafter's) add ``extra_tokens``.
        The best tokens of all drafts are kept together, as many as give the step the most expected tokens per
        second."""
        ranked = sorted(((gain, index, position) for index, draft in enumerate(gains)
                         for position, gain in enumerate(draft)), key=lambda t: (-t[0], t[2], t[1]))
        base = max(1, num_sequences) + extra_rows
        tokens = max(1, num_sequences) + extra_tokens
        plain = self.step_seconds(base)
        if plain is None:
            count = 0  # nothing measured at or above this step's rows: this step, undrafted, measures them
        else:
            count, best_rate = 0, tokens / plain
            expected = tokens
            for taken, (gain, _, _) in enumerate(ranked, start=1):
                expected += gain
                seconds = self.step_seconds(base + taken)
                if seconds is None:  # past the largest count measured: a few rows further, if rates still rise
                    if count == taken - 1:
                        count = min(len(ranked), self._measured[-1] + EXPLORE_ROWS - base)
                    break
                if expected / seconds > best_rate:
                    count, best_rate = taken, expected / seconds
            else:
                count = self._explored(base, count, len(ranked))
        keep = [0] * len(gains)
        for _, index, position in ranked[:count]:
            keep[index] = max(keep[index], position + 1)
        return keep

    def may_pay(self, num_sequences: int, most_rows: int, extra_rows: int = 0, extra_tokens: float = 0.0) -> bool:
        """Whether ``allocate`` could keep any of up to ``most_rows`` drafted tokens at this step: False when even
        drafts certain to be accepted (a token's expected tokens are at most one) would not raise the step's
        rate at any measured row count, no count past the largest measured is in reach and no re-measurement is
        due. The engine then skips the drafter's lookups: at 16 streams on a file whose 17th row costs half a
        step, they found drafts every step that were all cut (a millisecond a step)."""
        base = max(1, num_sequences) + extra_rows
        tokens = max(1, num_sequences) + extra_tokens
        plain = self.step_seconds(base)
        if plain is None or most_rows <= 0:
            return False  # allocate keeps nothing: this step measures its rows undrafted
        for taken in range(1, most_rows + 1):
            seconds = self.step_seconds(base + taken)
            if seconds is None:  # allocate goes past the measured counts only from one that raised the rate
                if taken == 1:
                    return True
                break
            if (tokens + taken) / seconds > tokens / plain:
                return True
        return self._steps - self._last_explore >= EXPLORE_EVERY and any(
            self._steps - self._measured_at[rows] >= STALE_STEPS for rows in self._measured[
                bisect.bisect_right(self._measured, base):bisect.bisect_right(self._measured, base + most_rows)])

    def _explored(self, base: int, count: int, most: int) -> int:
        """``count``, or the nearest larger count (up to ``most``) whose step time is stale, when it is time to
        re-measure one."""
        if self._steps - self._last_explore < EXPLORE_EVERY:
            return count
        for larger in range(count + 1, most + 1):
            measured_at = self._measured_at.get(base + larger)
            if measured_at is not None and self._steps - measured_at >= STALE_STEPS:
                self._last_explore = self._steps
                return larger
        return count
