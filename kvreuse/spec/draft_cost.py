"""Whether a drafted token is worth its verification row: a cost model measured on the machine, per step.

Verifying a draft adds rows to the next forward. On a CPU one decode stream is bounded by streaming the weights,
so a few more rows cost little; with 16 busy streams the step is compute-bound and every row costs about what a
token is worth. ``DraftCost`` fits the forward's time as ``fixed + per_row * rows`` from the steps the engine
ran (seconds per row count, a running mean each), and a token drafted for a sequence is kept while

    expected tokens it adds * (step time / sequences decoding)  >  per_row

(what an accepted token saves against what its row costs). The expected tokens of the i-th drafted token are
the product, over the tokens up to it, of the drafter's confidence and the request's acceptance rate so far
(``AcceptanceRate``). Before two row counts have been measured the row is taken as free, so the first drafts
are what measures it; a decision never depends on anything but the request's own draft and the machine's times.
"""

from __future__ import annotations

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
        self._counts: dict[int, int] = {}
        self.overhead = 0.0  # running mean of a step's seconds outside the forward
        self._steps = 0
        self._per_row: float | None = None
        self._fixed = 0.0

    def record(self, rows: int, forward_seconds: float, step_seconds: float) -> None:
        if rows <= 0 or rows > MAX_ROWS or forward_seconds <= 0:
            return
        previous = self._forward.get(rows)
        self._forward[rows] = forward_seconds if previous is None else (1 - EMA) * previous + EMA * forward_seconds
        self._counts[rows] = self._counts.get(rows, 0) + 1
        outside = max(0.0, step_seconds - forward_seconds)
        self.overhead = outside if self._steps == 0 else (1 - EMA) * self.overhead + EMA * outside
        self._steps += 1
        self._per_row = None  # refit on next use

    def _fit(self) -> tuple[float, float]:
        """(fixed, per_row) by least squares over the row counts measured at least twice; per_row 0 (free)
        until two of them are."""
        if self._per_row is not None:
            return self._fixed, self._per_row
        points = [(rows, seconds) for rows, seconds in self._forward.items() if self._counts[rows] >= 2]
        if len(points) < 2:
            self._fixed, self._per_row = (points[0][1] if points else 0.0), 0.0
            return self._fixed, self._per_row
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        var = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
        self._per_row = max(0.0, slope)
        self._fixed = max(0.0, mean_y - self._per_row * mean_x)
        return self._fixed, self._per_row

    def threshold(self, num_sequences: int) -> float:
        """The expected accepted tokens a drafted token must add to pay for its row, with ``num_sequences``
        sequences decoding: per_row over the time one token of the step is worth."""
        fixed, per_row = self._fit()
        if per_row <= 0:
            return 0.0
        sequences = max(1, num_sequences)
        token_seconds = (fixed + per_row * sequences + self.overhead) / sequences
        return per_row / token_seconds if token_seconds > 0 else 0.0

    def keep(self, confidence: list[float], acceptance: float, num_sequences: int) -> int:
        """How many of a draft's tokens to verify: while each adds more expected tokens than the threshold."""
        threshold = self.threshold(num_sequences)
        expected = 1.0
        for count, share in enumerate(confidence):
            expected *= share * acceptance
            if expected <= threshold:
                return count
        return len(confidence)
