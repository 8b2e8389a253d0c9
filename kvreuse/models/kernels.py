"""Which GEMM computes a linear layer on CPU, chosen per weight shape and row count by measurement.

On CPU, ``F.linear`` (MKL sgemm over the [out, in] weight) is far from the machine's limit for the
row counts that serving lives in: one decode row per sequence, a 16-64 token warm suffix, a handful
of speculative rows. Two other layouts of the same weight do better there: oneDNN's linear over a
weight reordered once into its blocked layout (the private ops ``torch.compile`` uses on CPU), and
a plain matmul against a contiguous transposed copy [in, out]. Which wins, and where, depends on the
CPU, the thread count, the dtype and the weight's shape (on a 2-core AVX2 EPYC one decode row runs
the 9728x896 gate/up projection at 22 GB/s from the transposed copy and 14 GB/s packed, and the
896x4864 down projection the other way round), so it is measured rather than assumed:

- ``PlanBook.plan_for`` times the three kernels on random weights of the layer's shape at a ladder of
  row counts. Small row counts are memory-bound, so they are timed over enough copies of the weight
  to fall out of the CPU caches, as the layers of a real model do. The verdict is kept in
  ``<cache dir>/linear-kernels.json`` under a key naming the CPU, its flags, the torch version, the
  thread count, the dtype and the shape (measured once per machine; a qwen2.5-0.5b model takes
  about half a minute the first time).
- A plan is one kernel for every row count, or two with a crossover when that is clearly faster
  (``SPLIT_MARGIN``); ``LinearKernel`` keeps only the weight layouts its plan uses, so memory grows
  only where a second layout buys speed.

All kernels compute the same product with different summation orders; outputs agree within float
tolerance (tests/test_linear_kernels.py). ``KVREUSE_LINEAR_KERNEL=plain``, ``packed`` or
``transposed`` overrides the measurement (for comparisons and for bisecting a numerical question).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

KERNEL_ENV = "KVREUSE_LINEAR_KERNEL"  # "auto" (default), or one kernel name for every layer
KERNELS = ("plain", "packed", "transposed")  # in order of preference when times tie
PLAN_VERSION = 3  # bump when the measurement or the decision rule changes
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048)
ALWAYS = sys.maxsize  # the crossover of a plan that runs one kernel at every row count
# A two-kernel plan keeps two layouts of the weight; it is taken only when it beats the best single
# kernel by this much summed time ratio over the probed sizes (0.3: a third of one size's time).
SPLIT_MARGIN = 0.3
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


@dataclass(frozen=True)
class LinearPlan:
    """``small`` runs row counts up to ``crossover``, ``large`` the rest (the same kernel: one layout)."""

    small: str
    crossover: int
    large: str
    # The measurement behind the verdict, microseconds per call by kernel and row count, for the record.
    times_us: dict[str, dict[int, float]] | None = None

    @staticmethod
    def single(kernel: str) -> LinearPlan:
        return LinearPlan(kernel, ALWAYS, kernel)

    @property
    def kernels(self) -> frozenset[str]:
        return frozenset((self.small, self.large))

    @property
    def is_plain(self) -> bool:
        return self.kernels == {"plain"}

    def kernel_for(self, rows: int) -> str:
        return self.small if rows <= self.crossover else self.large

    def describe(self) -> str:
        if self.small == self.large:
            return self.small
        return f"{self.small}<={self.crossover}, {self.large} above"


PLAIN = LinearPlan.single("plain")


def decide(times_us: dict[str, dict[int, float]]) -> LinearPlan:
    """The plan for measured times (microseconds per call, by kernel and row count).

    Each kernel's time at a size is divided by the fastest kernel's there; a plan's cost is the sum of
    its ratios over the probed sizes, so one noisy probe shifts a verdict by one size at most. The best
    single kernel is taken unless a two-kernel split (one kernel up to a crossover, another above)
    costs SPLIT_MARGIN less. Ties go to the earlier kernel in KERNELS (plain first).
    """
    names = [name for name in KERNELS if name in times_us]
    rows = sorted(times_us[names[0]])
    best = {count: min(times_us[name][count] for name in names) for count in rows}
    ratio = {name: [times_us[name][count] / best[count] for count in rows] for name in names}
    single_cost, single = min((sum(ratio[name]), index, name) for index, name in enumerate(names))[::2]
    plan, plan_cost = LinearPlan(single, ALWAYS, single, times_us), single_cost - SPLIT_MARGIN
    for small in names:
        for large in names:
            if small == large:
                continue
            for split in range(1, len(rows)):
                cost = sum(ratio[small][:split]) + sum(ratio[large][split:])
                if cost < plan_cost - 1e-9:
                    plan, plan_cost = LinearPlan(small, rows[split - 1], large, times_us), cost
    return plan


def _call_us(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(out_features: int, in_features: int, dtype: torch.dtype, kernels: tuple[str, ...] = KERNELS,
            rows: tuple[int, ...] = PROBE_ROWS) -> LinearPlan:
    """Time each kernel on random weights of this shape at each row count and decide."""
    generator = torch.Generator().manual_seed(0)
    weight_bytes = out_features * in_features * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / weight_bytes)))
    weights = [torch.randn(out_features, in_features, generator=generator).to(dtype) for _ in range(copies)]
    layouts = {
        "plain": weights,
        "packed": [pack_weight(weight) for weight in weights] if "packed" in kernels else [],
        "transposed": [transpose_weight(weight) for weight in weights] if "transposed" in kernels else [],
    }
    run = {
        "plain": lambda x, w: F.linear(x, w),
        "packed": lambda x, w: run_packed(x, w, None),
        "transposed": lambda x, w: torch.matmul(x, w),
    }
    if out_features * in_features > LARGE_WEIGHT_ELEMENTS:
        rows = tuple(count for count in rows if count <= COLD_ROWS)
    times_us: dict[str, dict[int, float]] = {name: {} for name in kernels}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, in_features, generator=generator).to(dtype)
            # Compute-bound sizes need no cache flushing: one copy, and fewer repeats of long calls.
            used = copies if count <= COLD_ROWS else 1
            repeats = 5 if count <= COLD_ROWS else 2
            calls = {name: (lambda fn=run[name], layout=layouts[name][:used]: [fn(x, w) for w in layout])
                     for name in kernels}
            for call in calls.values():
                call()  # warm-up: first-call allocation and oneDNN primitive creation
            # Kernels take turns, repeat by repeat, so a drift in the machine's memory bandwidth (other
            # tenants of the host) does not land on one kernel; the fastest repeat counts, because other
            # processes only ever add time (on a busy CPU even a median catches ~16 ms thread stalls).
            best = {name: math.inf for name in kernels}
            for _ in range(repeats):
                for name, call in calls.items():
                    best[name] = min(best[name], _call_us(call) / used)
            for name in kernels:
                times_us[name][count] = best[name]
    return decide(times_us)


# The CPU flags that decide GEMM speed (bf16 runs emulated without avx512_bf16 / amx_bf16 / bf16).
GEMM_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert", "asimd", "sve", "bf16")


def gemm_cpu_flags() -> str:
    """Which of GEMM_CPU_FLAGS this CPU has, comma-separated ("" where /proc/cpuinfo cannot be read)."""
    from kvreuse.models.loader import cpu_flags  # lazy: the loader imports the model, which imports this

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
        if forced not in ("auto", *KERNELS):
            raise ValueError(f"{KERNEL_ENV} must be auto, {', '.join(KERNELS)}, got {forced!r}")
        packing = packing_available(dtype)
        if forced != "auto":
            return LinearPlan.single(forced if packing or forced != "packed" else "plain")
        if shape[0] * shape[1] < MIN_MEASURED_ELEMENTS:
            return PLAIN
        key = self._key(dtype, shape)
        stored = self._plans.get(key)
        if stored is not None:
            return LinearPlan(str(stored["small"]), int(stored["crossover"]), str(stored["large"]))
        kernels = KERNELS if packing else tuple(name for name in KERNELS if name != "packed")
        plan = measure(shape[0], shape[1], dtype, kernels, PROBE_ROWS)
        self.measured += 1
        self._plans[key] = asdict(plan)
        logger.info("linear kernel for %s: %s", key, plan.describe())
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
    """y = x W^T (+ b) on the kernel the plan picks for x's row count; holds only the layouts it uses."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearPlan) -> None:
        self.plan = plan
        self.bias = bias
        self.weight_bytes = weight.numel() * weight.element_size()  # one copy, in any layout
        kernels = plan.kernels
        self.weight = weight if "plain" in kernels else None
        self.packed = pack_weight(weight) if "packed" in kernels else None
        self.transposed = transpose_weight(weight) if "transposed" in kernels else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kernel = self.plan.kernel_for(rows)
        if kernel == "packed":
            return run_packed(x, self.packed, self.bias)
        if kernel == "transposed":
            out = torch.matmul(x, self.transposed)
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def layout_bytes(self) -> int:
        """Memory of the weight layouts held (one of them replaces the plain weight)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.packed, self.transposed) if t is not None)
