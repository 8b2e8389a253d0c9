"""Which GEMM computes a linear layer on CPU, chosen per weight shape and row count by measurement.

On CPU, ``F.linear`` (MKL sgemm over the [out, in] weight) is far from the machine's limit for the
row counts that serving lives in: one decode row per sequence, a 16-64 token warm suffix, a handful
of speculative rows. Other layouts of the same weight do better there:

- ``packed``: oneDNN's linear over a weight reordered once into its blocked layout (the private ops
  ``torch.compile`` uses on CPU);
- ``transposed``: a plain matmul against a contiguous transposed copy [in, out];
- ``split_in`` and ``split_out``: one row is a matrix-vector product, which MKL runs on one thread and
  so at one core's share of the memory bandwidth. These two cut the weight into one block per thread
  and run the blocks as one batched matmul, which torch spreads over the threads: ``split_in`` cuts the
  input dimension of the transposed copy (a free view; the partial products are summed), ``split_out``
  cuts the output columns into blocks stored [parts, in, out/parts];
- ``rowdot`` and ``rowdot8``: kernels/rowdot.py's C++ GEMV over the plain layout (no copy), one or
  eight weight rows per pass, for one to a few rows (float32 and bfloat16). On a 2-core AVX-512 EPYC
  one decode row streams the 896x4864 down projection at ~35 GB/s, against 22-25 for the best library
  kernel. Built for the CPU on first use; where no compiler builds it, the planner never offers it.
- ``qdot``, ``qdot8``, ``qtile`` and ``qtile_bf16``, for weights held quantized (kernels/quant.py,
  layers/quantized_linear.py): the C++ kernel that reads the quantized groups directly (decode rows), the same over
  inputs rounded to int8 per 32 values (llama.cpp's arithmetic), and F.linear on tiles dequantized one at a
  time (many rows), in float32 or, under bfloat16 activations, in bfloat16 (the library's bf16 GEMM: 3x
  float32's on an AVX512-BF16 EPYC). Only quantized weights run them; their plans are measured the same
  way, under the format's name (``q4_k/bfloat16``) where a float weight's key has its dtype.

Which wins, and where, depends on the CPU, the thread count, the dtype and the weight's shape (on a
2-core AVX2 EPYC one decode row runs the 9728x896 gate/up projection at 15 GB/s on F.linear, 23 packed
and 29 split_in; from 2 rows on packed is fastest), so it is measured rather than assumed:

- ``PlanBook.plan_for`` times the kernels on random weights of the layer's shape at a ladder of
  row counts. Small row counts are memory-bound, so they are timed over enough copies of the weight
  to fall out of the CPU caches, as the layers of a real model do. The verdict is kept in
  ``<cache dir>/linear-kernels.json`` under a key naming the CPU, its flags, the torch version, the
  thread count, the dtype and the shape (measured once per machine; a qwen2.5-0.5b model takes
  about half a minute the first time).
- A plan names the kernel for each range of row counts. Kernels over one layout (``split_in`` for one
  row, ``transposed`` above) mix for free; a plan over two layouts keeps two copies of the weight and is
  taken only when clearly faster (``SPLIT_MARGIN``), and only while all second copies together fit a
  share of the available memory (``layouts_allowed``). ``LinearKernel`` keeps only the layouts its plan
  uses, so memory grows only where a second layout buys speed.

All kernels compute the same product with different summation orders; outputs agree within float
tolerance (tests/test_linear_kernels.py). ``KVREUSE_LINEAR_KERNEL=plain`` (or another kernel's name)
overrides the measurement (for comparisons and for bisecting a numerical question).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvreuse.config import cache_dir
from kvreuse.kernels import rowdot
from kvreuse.kernels.cpu import cpu_flags

logger = logging.getLogger(__name__)

KERNEL_ENV = "KVREUSE_LINEAR_KERNEL"  # "auto" (default), or one kernel name for every layer
# Preference order when times tie.
KERNELS = ("plain", "packed", "transposed", "split_in", "split_out", "rowdot", "rowdot8", "qdot", "qdot8", "qtile",
           "qtile_bf16")
# The weight layout each kernel reads; kernels sharing one can share a plan without extra memory.
LAYOUT = {"plain": "plain", "packed": "packed", "transposed": "transposed", "split_in": "transposed",
          "split_out": "split_out", "rowdot": "plain", "rowdot8": "plain", "qdot": "quantized", "qdot8": "quantized",
          "qtile": "quantized", "qtile_bf16": "quantized"}
# Over a quantized weight only (layers/quantized_linear.py runs them).
QUANTIZED_KERNELS = ("qdot", "qdot8", "qtile", "qtile_bf16")
ROWDOT_GROUP = {"rowdot": 1, "rowdot8": 8}  # weight rows per pass of kernels/rowdot.py's kernel
# The row-dot kernels re-read each pass of weight rows from cache for every input row: a GEMV, not a
# GEMM. They are probed up to this many rows and never chosen above.
ROWDOT_MAX_ROWS = 64
PLAN_VERSION = 7  # bump when the measurement or the decision rule changes
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048)
ALWAYS = sys.maxsize  # the upper end of a plan's last range of row counts
# A two-kernel plan over two layouts keeps two copies of the weight; it is taken only when it beats the
# best one-layout plan by this much summed time ratio over the probed sizes (0.1: a tenth of one size's
# time; one decode row 12% faster is worth it: one-stream decode runs at that row count only).
SPLIT_MARGIN = 0.1
# Second layouts are kept only while all of them together take at most this share of the memory the
# system reports available when the kernels are chosen; otherwise every layer gets its one-layout plan.
SECOND_LAYOUT_MEMORY_SHARE = 0.25
# Row counts up to this are memory-bound: probed over copies of the weight that overflow the caches.
COLD_ROWS = 64
COLD_BYTES = 96 * 2**20
MAX_COPIES = 16
# Weights smaller than this (1 MiB in float32) stay on F.linear unmeasured: they live in the CPU's
# caches, their GEMMs take microseconds, and probing them would only add start-up time (test models).
MIN_MEASURED_ELEMENTS = 2**18
# Weights bigger than this are probed at fewer rows (an output projection over a 150k vocabulary
# only ever sees one row per sampled token).
LARGE_WEIGHT_ELEMENTS = 50_000_000


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


def transpose_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().t().contiguous()


def split_parts() -> int:
    """Blocks the split kernels cut a weight into: one per intra-op thread."""
    return torch.get_num_threads()


def split_kernels_fit(shape: tuple[int, int], parts: int) -> tuple[str, ...]:
    """The split kernels that apply to an [out, in] weight: more than one thread, and dimensions that
    divide into equal blocks."""
    if parts < 2:
        return ()
    return tuple(name for name, size in (("split_in", shape[1]), ("split_out", shape[0])) if size % parts == 0)


def run_split_in(x: torch.Tensor, transposed: torch.Tensor, parts: int) -> torch.Tensor:
    """x [rows, in] @ transposed [in, out]: each thread multiplies its slice of the input dimension, the
    partial products are summed."""
    rows, size = x.shape
    blocks = x.view(rows, parts, size // parts).transpose(0, 1)  # [parts, rows, in/parts]
    return torch.bmm(blocks, transposed.view(parts, size // parts, -1)).sum(0)


def split_out_weight(weight: torch.Tensor, parts: int) -> torch.Tensor:
    """[out, in] -> [parts, in, out/parts], each block contiguous."""
    out_features, in_features = weight.shape
    return weight.detach().view(parts, out_features // parts, in_features).transpose(1, 2).contiguous()


def run_split_out(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [rows, in] times each block [in, out/parts], side by side -> [rows, out]."""
    parts = blocks.shape[0]
    out = torch.bmm(x.unsqueeze(0).expand(parts, -1, -1), blocks)  # [parts, rows, out/parts]
    return out.transpose(0, 1).reshape(x.shape[0], parts * blocks.shape[2])


def build_layout(name: str, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """The weight in layout ``name`` (a LAYOUT value)."""
    if name == "packed":
        return pack_weight(weight)
    if name == "transposed":
        return transpose_weight(weight)
    if name == "split_out":
        return split_out_weight(weight, parts)
    return weight.detach()


def run_kernel(name: str, x: torch.Tensor, layout: torch.Tensor, parts: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] through kernel ``name`` over its layout, plus ``bias``."""
    if name == "packed":
        return run_packed(x, layout, bias)
    if name == "plain":
        return F.linear(x, layout, bias)
    if name in ROWDOT_GROUP:
        out = rowdot.rowdot(x, layout, ROWDOT_GROUP[name])
    elif name == "transposed":
        out = torch.matmul(x, layout)
    elif name == "split_in":
        out = run_split_in(x, layout, parts)
    else:
        out = run_split_out(x, layout)
    return out if bias is None else out.add_(bias)


def kernel_runs(name: str, dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """Whether kernel ``name`` can run a ``dtype`` weight of this [out, in] shape here. Asked per kernel,
    so an engine forced onto one kernel never builds the row-dot extension."""
    if name in QUANTIZED_KERNELS:
        return False  # float weights; a quantized weight's kernels are layers/quantized_linear.py's to offer
    if name == "packed":
        return packing_available(dtype)
    if name.startswith("split"):
        return name in split_kernels_fit(shape, split_parts())
    if name in ROWDOT_GROUP:
        return rowdot_runs(dtype)
    return True


def runnable_kernels(dtype: torch.dtype, shape: tuple[int, int]) -> tuple[str, ...]:
    """The kernels that can run a ``dtype`` weight of this [out, in] shape here, in KERNELS' order."""
    return tuple(name for name in KERNELS if kernel_runs(name, dtype, shape))


def rowdot_runs(dtype: torch.dtype) -> bool:
    """Whether the row-dot kernels run here: float32 or bfloat16, and kernels/rowdot.py built (on first
    call)."""
    return dtype in rowdot.DTYPES and rowdot.available()


# Batch-invariant mode (--batch-invariant): one kernel for every row count, whose output row depends on that
# row's input and the weight only. kernels/rowdot.py's GEMV keeps one FMA chain per output in a fixed order and
# runs each input row on its own (tests/test_batch_invariance.py holds any row of an M-row call to the 1-row
# call's bits); the library GEMMs tile by the row count and so sum in another order above some M.
INVARIANT_FLOAT_KERNEL = "rowdot8"


def invariant_plan(dtype: torch.dtype) -> LinearPlan:
    """The batch-invariant plan for a float weight of ``dtype``; RuntimeError where its kernel cannot run."""
    if not rowdot_runs(dtype):
        raise RuntimeError(f"batch-invariant products of {str(dtype).removeprefix('torch.')} weights need the row-dot "
                           f"kernel (kernels/rowdot.py), which does not run here (see the log)")
    return LinearPlan.single(INVARIANT_FLOAT_KERNEL)


@dataclass(frozen=True)
class LinearPlan:
    """Which kernel runs which row counts: ``segments`` are (up to this many rows, kernel), ascending, the
    last one up to ALWAYS."""

    segments: tuple[tuple[int, str], ...]
    # The measurement behind the verdict, microseconds per call by kernel and row count, for the record.
    times_us: dict[str, dict[int, float]] | None = None

    @staticmethod
    def single(kernel: str) -> LinearPlan:
        return LinearPlan(((ALWAYS, kernel),))

    @staticmethod
    def from_picks(rows: list[int], picks: list[str], times_us: dict[str, dict[int, float]] | None = None
                   ) -> LinearPlan:
        """The plan running ``picks[i]`` up to ``rows[i]`` rows (the last pick above too)."""
        segments: list[tuple[int, str]] = []
        for count, kernel in zip(rows, picks):
            if segments and segments[-1][1] == kernel:
                segments[-1] = (count, kernel)
            else:
                segments.append((count, kernel))
        segments[-1] = (ALWAYS, segments[-1][1])
        return LinearPlan(tuple(segments), times_us)

    @property
    def kernels(self) -> frozenset[str]:
        return frozenset(kernel for _, kernel in self.segments)

    @property
    def layouts(self) -> frozenset[str]:
        return frozenset(LAYOUT[name] for name in self.kernels)

    @property
    def is_plain(self) -> bool:
        return self.kernels == {"plain"}

    def kernel_for(self, rows: int) -> str:
        for limit, kernel in self.segments:
            if rows <= limit:
                return kernel
        raise AssertionError("the last segment reaches ALWAYS")

    def describe(self) -> str:
        parts = [f"{kernel}<={limit}" for limit, kernel in self.segments[:-1]]
        last = self.segments[-1][1]
        return ", ".join([*parts, f"{last} above"]) if parts else last


PLAIN = LinearPlan.single("plain")


def decide(times_us: dict[str, dict[int, float]], max_layouts: int = 2) -> LinearPlan:
    """The plan for measured times (microseconds per call, by kernel and row count).

    Each kernel's time at a size is divided by the fastest kernel's there. For every set of one weight
    layout (and, with ``max_layouts=2``, of two), each probed size takes the fastest kernel that reads a
    layout of the set; the set's cost is the sum of those ratios, so one noisy probe shifts a verdict by
    one size at most. A set of two layouts keeps two copies of the weight and pays SPLIT_MARGIN on top;
    kernels sharing a layout (split_in and transposed) mix for free. The cheapest set wins; ties go to
    the earlier kernel in KERNELS (plain first), also within a size.
    """
    names = [name for name in KERNELS if name in times_us]
    rows = sorted(times_us[names[0]])
    best = {count: min(times_us[name][count] for name in names) for count in rows}
    ratio = {name: [times_us[name][count] / best[count] for count in rows] for name in names}
    layouts = list(dict.fromkeys(LAYOUT[name] for name in names))  # in KERNELS' preference order
    plan, plan_cost = PLAIN, math.inf
    for size in range(1, min(max_layouts, 2) + 1):
        for chosen in itertools.combinations(layouts, size):
            allowed = [name for name in names if LAYOUT[name] in chosen]
            picks = [min(allowed, key=lambda name, index=index: ratio[name][index]) for index in range(len(rows))]
            if len({LAYOUT[name] for name in picks}) < size:
                continue  # one layout unused: that plan is among the one-layout sets already
            cost = sum(ratio[name][index] for index, name in enumerate(picks)) + (SPLIT_MARGIN if size > 1 else 0)
            if cost < plan_cost - 1e-9:
                plan, plan_cost = LinearPlan.from_picks(rows, picks, times_us), cost
    return plan


def monotone_in_rows(times_us: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Each kernel's time at a row count capped by its time at any larger count: for kernels whose work grows with
    the rows (the quantized ones: every row streams the same weight blocks once more), a count measured slower than
    a larger one met the machine's noise (another process on both cores: a 1-row product measured at 2.1 ms against
    0.13 ms at 2 rows picked the dequantizing kernel for every decode step of a model on this VM, a stored verdict
    until the file was cleared)."""
    capped: dict[str, dict[int, float]] = {}
    for name, by_rows in times_us.items():
        running, kept = math.inf, {}
        for count in sorted(by_rows, reverse=True):
            running = min(running, by_rows[count])
            # A count left unprobed (inf: the kernel does not run there) stays so.
            kept[count] = by_rows[count] if math.isinf(by_rows[count]) else running
        capped[name] = dict(sorted(kept.items()))
    return capped


def _call_us(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(out_features: int, in_features: int, dtype: torch.dtype, kernels: tuple[str, ...] = KERNELS,
            rows: tuple[int, ...] = PROBE_ROWS) -> dict[str, dict[int, float]]:
    """Time each kernel on random weights of this shape at each row count: microseconds per call, by
    kernel and row count (``decide`` turns them into a plan)."""
    generator = torch.Generator().manual_seed(0)
    weight_bytes = out_features * in_features * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / weight_bytes)))
    weights = [torch.randn(out_features, in_features, generator=generator).to(dtype) for _ in range(copies)]
    parts = split_parts()
    layouts = {layout: [build_layout(layout, weight, parts) for weight in weights]
               for layout in {LAYOUT[name] for name in kernels}}
    if out_features * in_features > LARGE_WEIGHT_ELEMENTS:
        rows = tuple(count for count in rows if count <= COLD_ROWS)
    times_us: dict[str, dict[int, float]] = {name: {} for name in kernels}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, in_features, generator=generator).to(dtype)
            # Compute-bound sizes need no cache flushing: one copy, and fewer repeats of long calls.
            used = copies if count <= COLD_ROWS else 1
            repeats = 7 if count <= COLD_ROWS else 2
            calls = {name: (lambda name=name, layout=layouts[LAYOUT[name]][:used]:
                            [run_kernel(name, x, w, parts) for w in layout])
                     for name in kernels if name not in ROWDOT_GROUP or count <= ROWDOT_MAX_ROWS}
            for call in calls.values():
                call()  # warm-up: first-call allocation and oneDNN primitive creation
            # Kernels take turns, repeat by repeat, so a drift in the machine's memory bandwidth (other
            # tenants of the host) does not land on one kernel; the fastest repeat counts, because other
            # processes only ever add time (on a busy CPU even a median catches ~16 ms thread stalls).
            best = {name: math.inf for name in kernels}  # a kernel not probed at this size stays inf
            for _ in range(repeats):
                for name, call in calls.items():
                    best[name] = min(best[name], _call_us(call) / used)
            for name in kernels:
                times_us[name][count] = best[name]
    return times_us


# The CPU flags that decide GEMM speed (bf16 runs emulated without avx512_bf16 / amx_bf16 / bf16).
GEMM_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert", "asimd", "sve", "bf16")


def gemm_cpu_flags() -> str:
    """Which of GEMM_CPU_FLAGS this CPU has, comma-separated ("" where /proc/cpuinfo cannot be read)."""
    flags = cpu_flags() or frozenset()
    return ",".join(flag for flag in GEMM_CPU_FLAGS if flag in flags)


def _machine_key() -> str:
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} [{gemm_cpu_flags()}] torch {torch.__version__} threads {torch.get_num_threads()}"


def _plans_path() -> Path:
    return cache_dir() / "linear-kernels.json"


class PlanBook:
    """Kernel timings by (machine, dtype, shape), read from and written back to one JSON file, and the
    plans decided from them."""

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

    def plan_for(self, dtype: torch.dtype, shape: tuple[int, int], max_layouts: int = 2) -> LinearPlan:
        """The plan for a weight of this dtype and [out, in] shape: from the file's measurement where there
        is one, else measured now. ``max_layouts=1``: the best plan that keeps one copy of the weight."""
        forced = os.environ.get(KERNEL_ENV, "auto").strip().lower()
        if forced not in ("auto", *KERNELS):
            raise ValueError(f"{KERNEL_ENV} must be auto, {', '.join(KERNELS)}, got {forced!r}")
        if forced != "auto":
            # A kernel this CPU or shape cannot run falls back to plain F.linear.
            return LinearPlan.single(forced if kernel_runs(forced, dtype, shape) else "plain")
        if shape[0] * shape[1] < MIN_MEASURED_ELEMENTS:
            return PLAIN
        return self.plan_measured(str(dtype).removeprefix("torch."), shape, max_layouts,
                                  lambda: measure(shape[0], shape[1], dtype, runnable_kernels(dtype, shape), PROBE_ROWS),
                                  lambda name: kernel_runs(name, dtype, shape))

    def plan_measured(self, label: str, shape: tuple[int, int], max_layouts: int,
                      measure_now: Callable[[], dict[str, dict[int, float]]], runs: Callable[[str], bool],
                      expected: Collection[str] = (), rows_monotone: bool = False) -> LinearPlan:
        """The plan decided from the timings stored under (this machine, ``label``, ``shape``), or from
        ``measure_now()``'s, kept for the next start. ``runs(name)``: whether a kernel runs here now;
        ``expected``: kernels the stored timings must include (one offered since they were taken is
        measured: the whole entry again, so the kernels are compared in one run); ``rows_monotone``: the kernels'
        work grows with the rows, so a time is capped by a larger count's (``monotone_in_rows``) before deciding."""
        clean = monotone_in_rows if rows_monotone else (lambda times: times)
        key = f"{self.machine} | {label} | {shape[0]}x{shape[1]}"
        times = self._stored_times(key)
        if times is not None and not set(expected) <= set(times):
            times = None
        if times is not None:
            # The file keeps measurements, not verdicts: the decision rule can change without re-measuring.
            # A kernel measured once but not runnable now (the row-dot build failed here) drops out.
            return decide(clean({name: by_rows for name, by_rows in times.items() if runs(name)}), max_layouts)
        times = measure_now()
        self.measured += 1
        self._plans[key] = {"times_us": times}
        cleaned = clean(times)
        plan = decide(cleaned, max_layouts)
        logger.info("linear kernel for %s: %s (one layout: %s)", key, plan.describe(), decide(cleaned, 1).describe())
        return plan

    def _stored_times(self, key: str) -> dict[str, dict[int, float]] | None:
        """The file's timings for ``key``; None where it has none, or an entry that is not timings of known
        kernels at the same row counts (a hand-edited or damaged file costs a re-measurement, not a start)."""
        stored = self._plans.get(key)
        if stored is None:
            return None
        try:
            times = {str(name): {int(rows): float(us) for rows, us in by_rows.items()}
                     for name, by_rows in stored["times_us"].items()}
        except (AttributeError, KeyError, TypeError, ValueError):
            times = {}
        counts = {tuple(sorted(by_rows)) for by_rows in times.values()}
        if not times or not set(times) <= set(KERNELS) or len(counts) != 1 or not next(iter(counts)):
            logger.warning("linear kernel timings for %s in %s are malformed: measuring again", key, self.path)
            return None
        return times

    def save(self) -> None:
        if not self.measured:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": PLAN_VERSION, "plans": self._plans}, indent=1))
            tmp.replace(self.path)
        except OSError as exc:  # a read-only cache dir costs a re-measurement next time, nothing else
            logger.warning("could not save linear kernel plans to %s: %s", self.path, exc)


def second_layout_budget() -> int:
    """Bytes that second weight layouts may take: SECOND_LAYOUT_MEMORY_SHARE of the memory the system
    reports available now (0 where /proc/meminfo cannot be read: one layout per weight)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(SECOND_LAYOUT_MEMORY_SHARE * int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def layouts_allowed(book: PlanBook, weights: list[torch.Tensor | None], kept: list[torch.Tensor] = ()) -> int:
    """How many layouts per weight a model may use: 2 when the fastest plans of all its CPU ``weights``
    together fit their extra copies in ``second_layout_budget()``, else 1 (every weight on its best
    one-layout plan). ``kept`` are weights whose plain copy stays regardless (a tied embedding, which the
    lookup needs): every layout their plans add counts."""
    extra = 0
    for weight, keeps_plain in [(w, False) for w in weights] + [(w, True) for w in kept]:
        if weight is None or weight.device.type != "cpu":
            continue
        layouts = book.plan_for(weight.dtype, tuple(weight.shape)).layouts
        copies = len(layouts - {"plain"}) if keeps_plain else len(layouts) - 1
        extra += copies * weight.numel() * weight.element_size()
    budget = second_layout_budget()
    if extra <= budget:
        return 2
    logger.info("CPU linear kernels: second weight layouts would take %.0f MiB, over the budget of %.0f MiB "
                "(%.0f%% of available memory): one layout per weight", extra / 2**20, budget / 2**20,
                100 * SECOND_LAYOUT_MEMORY_SHARE)
    return 1


class LinearKernel:
    """y = x W^T (+ b) on the kernel the plan picks for x's row count; holds only the layouts it uses."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearPlan) -> None:
        self.plan = plan
        self.bias = bias
        self.out_features = weight.shape[0]
        self.weight_bytes = weight.numel() * weight.element_size()  # one copy, in any layout
        # The split count is fixed here: a later change of torch's thread count keeps the blocks valid.
        self.parts = split_parts() if any(name.startswith("split") for name in plan.kernels) else 1
        self.layouts = {layout: build_layout(layout, weight, self.parts) for layout in plan.layouts}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kernel = self.plan.kernel_for(rows)
        out = run_kernel(kernel, x.reshape(rows, x.shape[-1]), self.layouts[LAYOUT[kernel]], self.parts, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor | None:
        """The plain [out, in] weight, where the plan still reads it."""
        return self.layouts.get("plain")

    @property
    def layout_bytes(self) -> int:
        """Memory of the weight layouts held (one of them replaces the plain weight)."""
        return sum(t.numel() * t.element_size() for t in self.layouts.values())
