"""Linear layers over weights held quantized: each part of a weight on the kernel its plan picks for a step's row
count (kernels/quant_ops.py's ``qdot``, ``qdot8``, ``qtile`` and ``qtile_bf16``; kernels/qpacked.py's ``qpacked8``
in batch-invariant mode), the plans measured per CPU, format, activation dtype and shape by the plan book
(layers/plan_book.py), as for float weights.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from kvreuse.kernels import qpacked, quant_ops, rowdot
from kvreuse.kernels.quant import FORMATS, QuantizedTensor, cat_rows, random_quantized
from kvreuse.layers import plan_book
from kvreuse.layers.plan_book import ALWAYS, LinearPlan, PlanBook

# The qdot kernel re-decodes the weight for every 8 input rows: a GEMV, probed up to this many rows.
QDOT_MAX_ROWS = 64
# qtile_bf16 is probed from this many rows up (qtile, its float32 twin, stays probed at every count).
QTILE_BF16_MIN_ROWS = 16
# The plan where nothing is measured (small weights, an engine forced onto one float kernel): the
# quantized kernel for decode rows, dequantized tiles above.
DEFAULT_PLAN = LinearPlan(((8, "qdot"), (ALWAYS, "qtile")))


def kernels_for(fmt: str, dtype: torch.dtype) -> tuple[str, ...]:
    """The quantized kernels offered for a weight of format ``fmt`` under ``dtype`` activations: qdot8
    where this CPU runs the format on int8 inputs, qtile_bf16 under bfloat16 ones (a float32 engine keeps
    exact weights)."""
    offered = {"qdot", "qtile"}
    if dtype in quant_ops.DTYPES and fmt in quant_ops.int8_formats():
        offered.add("qdot8")
    if dtype == torch.bfloat16:
        offered.add("qtile_bf16")
    return tuple(name for name in plan_book.QUANTIZED_KERNELS if name in offered)


def dequantize_any(weight: QuantizedTensor | qpacked.PackedWeight | torch.Tensor) -> torch.Tensor:
    """float32 values of a quantized weight: the C++ kernel where it is built, plain torch otherwise (a
    float tensor is returned as is)."""
    if isinstance(weight, qpacked.PackedWeight):
        return weight.dequantize()
    if not isinstance(weight, QuantizedTensor):
        return weight
    return quant_ops.dequantize(weight) if quant_ops.available() else weight.dequantize()


def run_quantized(name: str, x: torch.Tensor,
                  weight: QuantizedTensor | qpacked.PackedWeight | torch.Tensor) -> torch.Tensor:
    """x [rows, in] through kernel ``name`` (qdot, qdot8, qtile or qtile_bf16) over a quantized weight; a float part
    of a fused weight (a GGUF file may keep one projection in F16) runs F.linear. A fused weight's plan
    is its first part's: qdot8 falls back to qdot on a part whose format it does not run. A weight repacked
    for the packed int8 kernel (batch-invariant mode, ``invariant_parts``) runs there whatever ``name`` says."""
    if isinstance(weight, qpacked.PackedWeight):
        return qpacked.qlinear_packed(x.contiguous(), weight)
    if not isinstance(weight, QuantizedTensor):
        if name in plan_book.ROWDOT_GROUP:  # batch-invariant mode's float product (invariant_plan)
            return rowdot.rowdot(x.contiguous(), weight.to(x.dtype), plan_book.ROWDOT_GROUP[name])
        return F.linear(x, weight.to(x.dtype))
    if name == "qdot8":
        runs = weight.format.name in quant_ops.int8_formats()  # a fused weight's other parts: qdot
        return quant_ops.qlinear_int8(x, weight) if runs else quant_ops.qlinear(x, weight)
    if name == "qtile_bf16":
        return quant_ops.tiled_linear(x, weight, torch.bfloat16)
    return quant_ops.qlinear(x, weight) if name == "qdot" else quant_ops.tiled_linear(x, weight)


def merge_parts(parts: list[QuantizedTensor | torch.Tensor]) -> list[QuantizedTensor | torch.Tensor]:
    """Consecutive parts of one format stacked into one (a fused projection whose parts share a format
    is one weight, one kernel call)."""
    merged: list[QuantizedTensor | torch.Tensor] = []
    for part in parts:
        previous = merged[-1] if merged else None
        if (isinstance(part, QuantizedTensor) and isinstance(previous, QuantizedTensor)
                and previous.format == part.format):
            merged[-1] = cat_rows([previous, part])
        elif isinstance(part, torch.Tensor) and isinstance(previous, torch.Tensor):
            merged[-1] = torch.cat((previous, part))
        else:
            merged.append(part)
    return merged


class QuantizedLinearKernel:
    """y = x W^T (+ b) over a weight held quantized: its parts (stacked by output rows, one per format
    run) each on the kernel its plan picks for x's row count, the outputs side by side."""

    def __init__(self, parts: list[QuantizedTensor | torch.Tensor], bias: torch.Tensor | None,
                 plans: list[LinearPlan] | None = None) -> None:
        self.parts = merge_parts(parts)
        self.plans = plans or [DEFAULT_PLAN] * len(self.parts)
        if len(self.plans) != len(self.parts):
            raise ValueError(f"{len(self.parts)} weight parts, {len(self.plans)} plans")
        self.bias = bias
        self.out_features = sum(part.shape[0] for part in self.parts)
        self.weight = None  # no plain float weight

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parts as held now (batch-invariant mode may repack them: invariant_parts)."""
        return sum(part.numel() * part.element_size() if isinstance(part, torch.Tensor) else part.nbytes
                   for part in self.parts)

    @property
    def layout_bytes(self) -> int:
        return self.weight_bytes  # the quantized weight is the only layout

    def views_of(self, parts: list[QuantizedTensor | torch.Tensor]) -> list[QuantizedTensor | torch.Tensor]:
        """``parts`` (those this kernel was made from, in order) as row views of its merged parts, so a
        caller keeping them per part holds no second copy."""
        views: list[QuantizedTensor | torch.Tensor] = []
        merged, start = 0, 0
        for part in parts:
            stop = start + part.shape[0]
            whole = self.parts[merged]
            views.append(whole.rows(start, stop) if isinstance(whole, QuantizedTensor) else whole[start:stop])
            start = stop
            if start == whole.shape[0]:
                merged, start = merged + 1, 0
        return views

    @property
    def plan(self) -> LinearPlan:
        """One plan whose ranges of row counts are those of all parts' plans (where any part switches
        kernel); each range names the first part's kernel."""
        if len(self.plans) == 1:
            return self.plans[0]
        limits = sorted({limit for plan in self.plans for limit, _ in plan.segments})
        return LinearPlan(tuple((limit, self.plans[0].kernel_for(limit)) for limit in limits))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        outs = [run_quantized(plan.kernel_for(rows), flat, part) for part, plan in zip(self.parts, self.plans)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def invariant_parts(parts: list[QuantizedTensor | torch.Tensor]
                    ) -> list[QuantizedTensor | qpacked.PackedWeight | torch.Tensor]:
    """Batch-invariant mode's weights: each part the packed int8 kernel runs (kernels/qpacked.py: q8_0, q4_0 and q4_1
    on a CPU with AVX512-VNNI) packed for it, the others as they are."""
    return [qpacked.pack(part) if qpacked.runs(part) else part for part in parts]


def invariant_plan(weight: QuantizedTensor | qpacked.PackedWeight | torch.Tensor, dtype: torch.dtype) -> LinearPlan:
    """Batch-invariant mode's plan for a part of a quantized weight: one kernel at every row count. A part
    packed (``invariant_parts``): qpacked8. Otherwise qdot8 (inputs rounded to int8 per group, as llama.cpp
    does at every batch size) where the format runs it, else qdot; all three give a row the same bits in a
    block of any number of rows (csrc/quant.cpp: per-row chains, one reduction tree; csrc/qpacked.cpp: exact
    integer sums, one float part per row). A float part of a fused weight: the float kernel's
    (plan_book.invariant_plan)."""
    if isinstance(weight, qpacked.PackedWeight):
        return LinearPlan.single("qpacked8")
    if not isinstance(weight, QuantizedTensor):
        return plan_book.invariant_plan(dtype)
    return LinearPlan.single("qdot8" if weight.format.name in quant_ops.int8_formats() else "qdot")


def plan_for(book: PlanBook, weight: QuantizedTensor, dtype: torch.dtype) -> LinearPlan:
    """The measured plan for a quantized weight of this format and shape under ``dtype`` activations
    (stored in the plan book's file as float weights' are). KVREUSE_LINEAR_KERNEL=qdot, qdot8, qtile or
    qtile_bf16 forces one (qdot8 or qtile_bf16 where it is not offered: qdot or qtile); forced onto a float
    kernel, or for weights too small
    to matter, DEFAULT_PLAN, unmeasured."""
    offered = kernels_for(weight.format.name, dtype)
    forced = os.environ.get(plan_book.KERNEL_ENV, "auto").strip().lower()
    if forced in plan_book.QUANTIZED_KERNELS:
        return LinearPlan.single(forced if forced in offered else {"qtile_bf16": "qtile"}.get(forced, "qdot"))
    shape = weight.shape
    if forced != "auto" or shape[0] * shape[1] < plan_book.MIN_MEASURED_ELEMENTS or dtype not in quant_ops.DTYPES:
        return DEFAULT_PLAN
    # The kernels' build (source digest) is in the label: timings taken of an older build are not reused.
    label = f"{weight.format.name}/{str(dtype).removeprefix('torch.')}/{quant_ops.build_name().rsplit('_', 1)[-1][:12]}"
    return book.plan_measured(label, shape, 1, lambda: measure(weight.format.name, shape, dtype),
                              lambda name: name in offered, expected=offered, rows_monotone=True)


def measure(fmt: str, shape: tuple[int, int], dtype: torch.dtype,
            rows: tuple[int, ...] | None = None) -> dict[str, dict[int, float]]:
    """Microseconds per call of the kernels offered (``kernels_for``) on random weights of this format and
    shape, by row count (plan_book.measure's method: copies that overflow the caches for memory-bound
    sizes, the kernels taking turns, the fastest repeat)."""
    rows = rows or plan_book.PROBE_ROWS
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(0)
    copies = max(1, min(plan_book.MAX_COPIES, plan_book.COLD_BYTES // FORMATS[fmt].row_bytes(in_features) // out_features))
    weights = [random_quantized(fmt, out_features, in_features, generator) for _ in range(copies)]
    if out_features * in_features > plan_book.LARGE_WEIGHT_ELEMENTS:
        rows = tuple(count for count in rows if count <= plan_book.COLD_ROWS)
    offered = kernels_for(fmt, dtype)
    times: dict[str, dict[int, float]] = {name: {} for name in offered}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, in_features, generator=generator).to(dtype)
            used = copies if count <= plan_book.COLD_ROWS else 1
            repeats = 7 if count <= plan_book.COLD_ROWS else 2
            # qdot is a GEMV (probed up to QDOT_MAX_ROWS); qtile_bf16's tiles lose to the row kernels below
            # QTILE_BF16_MIN_ROWS (a tile's dequantizing outweighs its GEMM there): left at inf, unprobed.
            calls = {name: (lambda name=name: [run_quantized(name, x, w) for w in weights[:used]])
                     for name in offered if (name != "qdot" or count <= QDOT_MAX_ROWS)
                     and (name != "qtile_bf16" or count >= QTILE_BF16_MIN_ROWS)}
            for call in calls.values():
                call()  # warm-up
            best = {name: math.inf for name in offered}
            for _ in range(repeats):
                for name, call in calls.items():
                    best[name] = min(best[name], plan_book._call_us(call) / used)
            for name in offered:
                times[name][count] = best[name]
    return times
