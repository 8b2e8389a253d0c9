"""Which GEMM computes a linear layer on CPU, chosen per weight shape and row count by measurement.

On CPU, ``F.linear`` (MKL sgemm with a transposed weight) is far from the machine's limit for the
row counts that serving lives in: one decode row per sequence, a 16-64 token warm suffix, a handful
of speculative rows. oneDNN's linear over a weight reordered once into its blocked layout (the
private ops ``torch.compile`` uses on CPU) is 1.5-4x faster there, and about even or slower for
prefill-sized row counts. Which kernel wins, and where the crossover lies, depends on the CPU, the
thread count, the dtype and the weight's shape, so it is measured rather than assumed:

- ``plan_for`` times both kernels on a random weight of the layer's shape at a ladder of row counts
  and keeps the verdict in ``<cache dir>/linear-kernels.json`` under a key naming the CPU, its
  flags, the torch version, the thread count, the dtype and the shape (measured once per machine;
  a qwen2.5-0.5b model takes a few seconds the first time).
- ``LinearKernel`` holds a layer's weights and runs the packed copy for row counts up to the plan's
  ``packed_max_rows`` and plain ``F.linear`` above it. The plain weight is released when the packed
  one wins at every measured row count, so memory only doubles where it buys speed.

Both kernels compute the same product in float arithmetic with different summation orders; outputs
agree within float tolerance (tests/test_linear_kernels.py). ``KVREUSE_LINEAR_KERNEL=plain`` or
``packed`` overrides the measurement (for comparisons and for bisecting a numerical question).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

KERNEL_ENV = "KVREUSE_LINEAR_KERNEL"  # "auto" (default), "plain" or "packed"
PLAN_VERSION = 2  # bump when the measurement or the decision rule changes
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048)
ALWAYS = sys.maxsize  # packed_max_rows of a layer that runs packed at every row count
# The packed kernel may be this much slower at the largest row counts (prefill chunks) and still
# replace the plain weight everywhere: one copy of the weights is worth a few percent of prefill.
DROP_PLAIN_TOLERANCE = 1.05
# Weights bigger than this are probed at fewer rows (an output projection over a 150k vocabulary
# only ever sees one row per sampled token).
LARGE_WEIGHT_ELEMENTS = 50_000_000
LARGE_WEIGHT_MAX_ROWS = 64


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder and run a ``dtype`` weight on this CPU (probed once with a tiny one).

    The ops exist in every oneDNN build; the bfloat16 reorder needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT and raises on plain AVX2 CPUs; float32 works everywhere oneDNN does.
    """
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        packed = pack_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.equal(out, torch.full((2, 16), 16.0, dtype=dtype)))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    # 64: the batch-size hint oneDNN uses to pick the blocking; any row count can use the result.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def run_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass(frozen=True)
class LinearPlan:
    """Row counts up to ``packed_max_rows`` run on the packed weight (0: never, ALWAYS: always)."""

    packed_max_rows: int
    keep_plain: bool  # False: the packed kernel serves every row count and the plain weight is released
    # The measurement behind the verdict, microseconds per call by row count, for the record.
    plain_us: dict[int, float] | None = None
    packed_us: dict[int, float] | None = None

    @property
    def uses_packed(self) -> bool:
        return self.packed_max_rows > 0


PLAIN = LinearPlan(packed_max_rows=0, keep_plain=True)
PACKED = LinearPlan(packed_max_rows=ALWAYS, keep_plain=False)


def decide(plain_us: dict[int, float], packed_us: dict[int, float]) -> LinearPlan:
    """The plan for measured times (microseconds per call by row count).

    The crossover is the row count T that minimises the summed time ratios over the probed sizes
    when sizes up to T run packed and the rest plain, so one noisy probe cannot flip the verdict for
    its neighbours. The plain weight is released when the packed kernel is used for every size and
    is within DROP_PLAIN_TOLERANCE at the largest ones, where prefill lives.
    """
    rows = sorted(plain_us)
    ratios = [packed_us[count] / plain_us[count] for count in rows]
    best_cost, packed_max_rows = float(len(rows)), 0  # T = 0: everything plain, ratio 1 each
    for index, count in enumerate(rows):
        cost = sum(ratios[: index + 1]) + (len(rows) - index - 1)
        if cost < best_cost - 1e-9:
            best_cost, packed_max_rows = cost, count
    # Packed everywhere costs at most the tolerance at the two largest sizes over the best split.
    slack = 2 * (DROP_PLAIN_TOLERANCE - 1)
    if all(ratio <= DROP_PLAIN_TOLERANCE for ratio in ratios[-2:]) and sum(ratios) <= best_cost + slack:
        return LinearPlan(ALWAYS, False, plain_us, packed_us)
    return LinearPlan(packed_max_rows, True, plain_us, packed_us)


def _best_us(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls: other processes on the cores only ever add time, and on a busy
    CPU a median still catches thread wake-up stalls of ~16 ms that have nothing to do with the kernel."""
    fn()  # warm-up: first-call allocation and oneDNN primitive creation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def measure(out_features: int, in_features: int, dtype: torch.dtype, repeats: int = 5) -> LinearPlan:
    """Time F.linear against the packed kernel on a random weight of this shape and decide."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    packed = pack_weight(weight)
    large = out_features * in_features > LARGE_WEIGHT_ELEMENTS
    rows = [r for r in PROBE_ROWS if not large or r <= LARGE_WEIGHT_MAX_ROWS]
    plain_us: dict[int, float] = {}
    packed_us: dict[int, float] = {}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, in_features, generator=generator).to(dtype)
            reps = 3 if large else repeats
            # Interleaved, so a burst of noise does not land on one kernel only.
            plain_us[count] = _best_us(lambda: F.linear(x, weight), reps)
            packed_us[count] = _best_us(lambda: run_packed(x, packed, None), reps)
    return decide(plain_us, packed_us)


def _machine_key() -> str:
    cpu = platform.machine()
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name") and cpu == platform.machine():
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert", "asimd", "sve", "bf16")
                present = set(line.split(":", 1)[1].split())
                flags = ",".join(flag for flag in wanted if flag in present)
    except OSError:
        pass
    return f"{cpu} [{flags}] torch {torch.__version__} threads {torch.get_num_threads()}"


def _plans_path() -> Path:
    from kvreuse.models.make import cache_dir  # lazy: make.py pulls in the tokenizer trainer

    return cache_dir() / "linear-kernels.json"


class PlanBook:
    """Measured plans by (machine, dtype, shape), read from and written back to one JSON file."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or _plans_path()
        self.machine = _machine_key()
        self._plans: dict[str, dict] = {}
        try:
            stored = json.loads(self.path.read_text())
            if stored.get("version") == PLAN_VERSION:
                self._plans = stored.get("plans", {})
        except (OSError, ValueError, AttributeError):
            pass
        self.measured = 0  # shapes measured by this book (not found in the file)

    def _key(self, dtype: torch.dtype, shape: tuple[int, int]) -> str:
        return f"{self.machine} | {str(dtype).removeprefix('torch.')} | {shape[0]}x{shape[1]}"

    def plan_for(self, dtype: torch.dtype, shape: tuple[int, int]) -> LinearPlan:
        forced = os.environ.get(KERNEL_ENV, "auto").strip().lower()
        if forced not in ("auto", "plain", "packed"):
            raise ValueError(f"{KERNEL_ENV} must be auto, plain or packed, got {forced!r}")
        if forced == "plain" or not packing_available(dtype):
            return PLAIN
        if forced == "packed":
            return PACKED
        key = self._key(dtype, shape)
        stored = self._plans.get(key)
        if stored is not None:
            return LinearPlan(int(stored["packed_max_rows"]), bool(stored["keep_plain"]))
        plan = measure(shape[0], shape[1], dtype)
        self.measured += 1
        self._plans[key] = asdict(plan)
        logger.info("linear kernel for %s: packed up to %s rows, plain weight %s", key,
                    "all" if plan.packed_max_rows == ALWAYS else plan.packed_max_rows,
                    "kept" if plan.keep_plain else "released")
        return plan

    def save(self) -> None:
        if not self.measured:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": PLAN_VERSION, "plans": self._plans}, indent=1, default=str))
            tmp.replace(self.path)
        except OSError as exc:  # a read-only cache dir costs a re-measurement next time, nothing else
            logger.warning("could not save linear kernel plans to %s: %s", self.path, exc)


class LinearKernel:
    """y = x W^T (+ b) on the kernel the plan picks for x's row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearPlan) -> None:
        self.plan = plan
        self.bias = bias
        self.packed = pack_weight(weight) if plan.uses_packed else None
        self.weight = weight if plan.keep_plain else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        if self.packed is not None and rows <= self.plan.packed_max_rows:
            return run_packed(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def extra_bytes(self) -> int:
        """Memory beyond one copy of the weight (the packed copy when the plain one is kept)."""
        if self.packed is None or self.weight is None:
            return 0
        return self.packed.numel() * self.packed.element_size()
