"""How many drafted tokens are worth verifying: a cost model measured on the machine, per step.

Verifying a draft adds rows to the next forward. How much they cost is the machine's and the kernel's business:
on the Xeon VM of docs/benchmarks.md SmolLM2 Q4_1's forward takes 4.4 ms for one row, 5.6 for two, 7.7 for four
and 15 for nine (the packed int8 kernel sums exactly on VNNI up to 4 rows; above, without AMX, it takes the
slower path), so the fitted line of an earlier version undercounted short drafts and overcounted nothing.
``DraftCost`` keeps the forward's time per row count (a running mean each) and the step's time around it, and
a draft of k tokens for a sequence is cut to the k that maximises

    (sequences decoding + expected accepted tokens of the first k) / (forward time at sequences + k + the rest)

the expected tokens per second of the step. The expected tokens of the i-th drafted token are the product, over
the tokens up to it, of the drafter's confidence and the request's acceptance rate so far (``AcceptanceRate``).
A row count never measured is worth trying, so the first drafts are what measures it; with 16 busy streams a
row costs what a token is worth and only near-certain drafts pay. A decision depends on nothing but the
request's own draft and the machine's times.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Row counts measured at most (steps above it are prefills, not verification).
MAX_ROWS = 512
# Weight of a new measurement in a row count's running mean.
EMA = 0.2


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


class DraftCost:
    def __init__(self) -> None:
        self._forward: dict[int, float] = {}  # rows -> running mean of the forward's seconds
        self._measured: list[int] = []  # its row counts, sorted (a draft's sizing looks its neighbours up per step)
        self.overhead = 0.0  # running mean of a step's seconds outside the forward
        self._steps = 0

    def record(self, rows: int, forward_seconds: float, step_seconds: float) -> None:
        if rows <= 0 or rows > MAX_ROWS or forward_seconds <= 0:
            return
        previous = self._forward.get(rows)
        if previous is None:
            bisect.insort(self._measured, rows)
        self._forward[rows] = forward_seconds if previous is None else (1 - EMA) * previous + EMA * forward_seconds
        outside = max(0.0, step_seconds - forward_seconds)
        self.overhead = outside if self._steps == 0 else (1 - EMA) * self.overhead + EMA * outside
        self._steps += 1

    def forward_seconds(self, rows: int) -> float | None:
        """The forward's time for ``rows`` rows: measured, or between the nearest measured counts on both sides
        (a straight line); None above the largest count measured (not known yet)."""
        exact = self._forward.get(rows)
        if exact is not None:
            return exact
        place = bisect.bisect_left(self._measured, rows)
        if place == len(self._measured):
            return None
        above = self._measured[place]
        if place == 0:
            return self._forward[above]
        below = self._measured[place - 1]
        low, high = self._forward[below], self._forward[above]
        return low + (high - low) * (rows - below) / (above - below)

    def keep(self, confidence: list[float], acceptance: float, num_sequences: int) -> int:
        """How many of a draft's tokens to verify: the count that gives the most expected tokens per second of
        step, with ``num_sequences`` sequences decoding (each yields one token without drafts). A row count not
        measured yet is taken as worth trying, so that the drafts measure it."""
        base = max(1, num_sequences)
        plain = self.forward_seconds(base)
        if plain is None:
            return len(confidence)
        best, best_rate = 0, base / (plain + self.overhead)
        expected, running = 0.0, 1.0
        for count, share in enumerate(confidence, start=1):
            running *= share * acceptance
            expected += running
            seconds = self.forward_seconds(base + count)
            if seconds is None:
                return len(confidence)
            rate = (base + expected) / (seconds + self.overhead)
            if rate > best_rate:
                best, best_rate = count, rate
        return best
