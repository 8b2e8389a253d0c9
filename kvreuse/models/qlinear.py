"""Linear layers on quantized weights (csrc/quant.cpp): built for this CPU on first use, as ``torch.ops.kvreuse_cpu``.

Two operators over models/quant.py's layouts, built and cached like the row-dot GEMV (models/rowdot.py:
``torch.utils.cpp_extension`` with ``-march=native``, named by a digest of source, flags, torch and CPU
flags, loaded directly once built):

- ``qlinear(x, weight, format, in_features)``: y = x W^T for a few rows of x (decode), reading the
  quantized groups directly: the weight streams at its stored 4.5-8.5 bits per value;
- ``qdequant(weight, format, in_features)``: the float32 values of weight rows (gguf's, bit for bit);
- ``qlinear_int8(x, weight, format, in_features)``: as qlinear over x rounded to int8 per 32 values
  (one float32 scale each, amax / 127), multiplied by integer dot products (AVX512-VNNI's ``vpdpbusd``,
  or AVX2's ``vpmaddubsw``): what llama.cpp and vLLM's GGUF kernels do with quantized files. Formats
  (``int8_formats()``): all eight on AVX2; q8_0, q4_0, q4_1 and the K-quants on AVX512-VNNI (q5_0 and
  q5_1 stay on the bf16 kernel there), the K-quants' inputs rounded per super-block of 256 values as
  llama.cpp's q8_K rounds them, so their products stay integer over a super-block (``int8_group``);
  none on CPUs with neither.

Larger row counts are compute-bound: ``tiled_linear`` dequantizes a tile of output rows at a time and
multiplies it with the library GEMM (``F.linear``), so no dequantized copy of the weight is kept: in
float32 (``qtile``: the weights' values exact), or under bfloat16 activations also in bfloat16
(``qtile_bf16``: each tile rounded to bf16, as transformers holds a dequantized file in a bf16 model; the
library's bf16 GEMM runs at 354 GFLOP/s against float32's 120 on a 2-core AVX512-BF16 EPYC, so a prefill
chunk of a quantized file goes about as fast as the bf16 folder's).
Which runs a row count is measured per CPU, format, activation dtype and shape, as for float weights
(models/kernels.py's ``qdot``, ``qdot8``, ``qtile`` and ``qtile_bf16``; ``QuantizedLinearKernel`` follows
the plan).
``qdot8`` is offered under float32 and bfloat16 activations alike: llama.cpp and vLLM multiply their
quantized files' weights by activations rounded this way, and only the inputs round (7 bits and a sign
against each group's largest value, finer than the 4-8-bit weights they meet); where the plan book
measures it faster it runs. Its outputs then differ from transformers' on the dequantized file by that
rounding; ``KVREUSE_LINEAR_KERNEL=qdot`` keeps the exact products (the tests' greedy comparisons run on
them).
Both operators have fake implementations, so ``torch.compile`` traces them. Where the build fails,
``available()`` says False once in the log and the model holds its weights dequantized in its dtype
(quant.dequantize, plain torch), as without quantization.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from kvreuse.models import kernels, qpacked, rowdot
from kvreuse.models.kernels import ALWAYS, LinearPlan, PlanBook
from kvreuse.models.quant import FORMATS, QuantizedTensor, cat_rows, random_quantized

SOURCE = Path(__file__).with_name("csrc") / "quant.cpp"
DTYPES = (torch.float32, torch.bfloat16)  # activations; accumulation is float32 either way
# The revision of qdot8's arithmetic, in the KV fingerprint: raised whenever the int8 products' float sums
# round differently for the same inputs, so K/V a tier stored under an earlier revision are another's.
# 2: q8_0, q4_0 and MXFP4 in blocks of rows, their zero in the int32 sums (issue 38, sixth session).
INT8_ARITHMETIC = 2
# Output rows per tile of tiled_linear: about this many weight values dequantized at once (4 MiB in
# float32, within the L2 / L3 caches while the GEMM reads it).
TILE_VALUES = 2**20
# The qdot kernel re-decodes the weight for every 8 input rows: a GEMV, probed up to this many rows.
QDOT_MAX_ROWS = 64
# qtile_bf16 is probed from this many rows up (qtile, its float32 twin, stays probed at every count).
QTILE_BF16_MIN_ROWS = 16
# The plan where nothing is measured (small weights, an engine forced onto one float kernel): the
# quantized kernel for decode rows, dequantized tiles above.
DEFAULT_PLAN = LinearPlan(((8, "qdot"), (ALWAYS, "qtile")))


def build_name() -> str:
    return rowdot.build_name(SOURCE, "kvreuse_quant")


def available() -> bool:
    """Whether the quantized kernels run here, building them first if needed (once per process)."""
    return library() is not None


@functools.cache
def library() -> Path | None:
    built = rowdot.load_extension(SOURCE, build_name(), "the quantized linear kernels",
                                  "quantized weights are held dequantized in the model's dtype")
    if built is not None:
        _register_fake()
    return built


def _register_fake() -> None:
    @torch.library.register_fake("kvreuse_cpu::qlinear")
    def _(x: torch.Tensor, weight: torch.Tensor, format: int, in_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("kvreuse_cpu::qlinear_int8")
    def _(x: torch.Tensor, weight: torch.Tensor, format: int, in_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("kvreuse_cpu::qlinear_grouped")
    def _(x: torch.Tensor, group_rows: list[int], weights: list[torch.Tensor], format: int,
          in_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weights[0].shape[0]))

    @torch.library.register_fake("kvreuse_cpu::qlinear_int8_grouped")
    def _(x: torch.Tensor, group_rows: list[int], weights: list[torch.Tensor], format: int,
          in_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weights[0].shape[0]))

    @torch.library.register_fake("kvreuse_cpu::qdequant")
    def _(weight: torch.Tensor, format: int, in_features: int) -> torch.Tensor:
        return weight.new_empty((weight.shape[0], in_features), dtype=torch.float32)


def qlinear(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x [rows, in] (float32 or bfloat16) @ weight^T -> [rows, out] in x's dtype, float32 accumulation.
    ``available()`` must have returned True."""
    return torch.ops.kvreuse_cpu.qlinear(x, weight.data, weight.format.code, weight.in_features)


@functools.cache
def int8_formats() -> frozenset[str]:
    """The formats ``qlinear_int8`` runs on this CPU (none without AVX512-VNNI or the build)."""
    if not available():
        return frozenset()
    codes = set(torch.ops.kvreuse_cpu.int8_formats())
    return frozenset(name for name, fmt in FORMATS.items() if fmt.code in codes)


def int8_group(fmt: str) -> int:
    """The values per input scale ``qlinear_int8`` rounds a ``fmt`` weight's inputs with (32, or 256 for
    K-quants on AVX512-VNNI); 0 where it does not run the format."""
    if fmt not in int8_formats():
        return 0
    return int(torch.ops.kvreuse_cpu.int8_group(FORMATS[fmt].code))


def qlinear_int8(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """As ``qlinear`` over x rounded to int8 per ``int8_group`` values (``weight.format.name in
    int8_formats()``)."""
    return torch.ops.kvreuse_cpu.qlinear_int8(x, weight.data, weight.format.code, weight.in_features)


def qlinear_grouped(x: torch.Tensor, group_rows: list[int], weights: list[QuantizedTensor], *,
                    int8: bool = False) -> torch.Tensor:
    """``qlinear`` (``int8``: ``qlinear_int8``) for groups of x's rows, group g (``group_rows[g]`` rows, in order)
    against ``weights[g]``: one parallel region for all of them (a MoE layer's routed experts). The weights
    share one format and shape."""
    fmt = weights[0].format
    if any(w.format is not fmt for w in weights):
        raise ValueError(f"qlinear_grouped: the weights must share one format, got "
                         f"{sorted({w.format.name for w in weights})}")
    op = torch.ops.kvreuse_cpu.qlinear_int8_grouped if int8 else torch.ops.kvreuse_cpu.qlinear_grouped
    return op(x, group_rows, [w.data for w in weights], fmt.code, weights[0].in_features)


def kernels_for(fmt: str, dtype: torch.dtype) -> tuple[str, ...]:
    """The quantized kernels offered for a weight of format ``fmt`` under ``dtype`` activations: qdot8
    where this CPU runs the format on int8 inputs, qtile_bf16 under bfloat16 ones (a float32 engine keeps
    exact weights)."""
    offered = {"qdot", "qtile"}
    if dtype in DTYPES and fmt in int8_formats():
        offered.add("qdot8")
    if dtype == torch.bfloat16:
        offered.add("qtile_bf16")
    return tuple(name for name in kernels.QUANTIZED_KERNELS if name in offered)


def dequantize(weight: QuantizedTensor) -> torch.Tensor:
    """float32 [out, in] through the C++ kernel (``available()`` must have returned True)."""
    return torch.ops.kvreuse_cpu.qdequant(weight.data, weight.format.code, weight.in_features)


def dequantize_rows(weight: QuantizedTensor, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), in]: the weight rows at the indices ``rows`` (an embedding lookup)."""
    return torch.ops.kvreuse_cpu.qdequant(weight.data.index_select(0, rows), weight.format.code, weight.in_features)


def dequantize_any(weight: QuantizedTensor | qpacked.PackedWeight | torch.Tensor) -> torch.Tensor:
    """float32 values of a quantized weight: the C++ kernel where it is built, plain torch otherwise (a
    float tensor is returned as is)."""
    if isinstance(weight, qpacked.PackedWeight):
        return weight.dequantize()
    if not isinstance(weight, QuantizedTensor):
        return weight
    return dequantize(weight) if available() else weight.dequantize()


def tile_rows(weight: QuantizedTensor) -> int:
    return max(16, TILE_VALUES // weight.in_features // 16 * 16)


def tiled_linear(x: torch.Tensor, weight: QuantizedTensor, compute: torch.dtype = torch.float32) -> torch.Tensor:
    """x [rows, in] @ weight^T by tiles of output rows, each dequantized and multiplied by F.linear in
    ``compute``: float32 (bf16 inputs widened, the output rounded once: the decode kernel's numerics, no bf16
    rounding of the weights), or bfloat16 (each tile rounded to bf16: the faster GEMM where the CPU has
    AVX512-BF16 or AMX)."""
    step = tile_rows(weight)
    out_features = weight.shape[0]
    xc = x.to(compute)

    def tile(part: QuantizedTensor) -> torch.Tensor:
        return dequantize(part).to(compute)

    if out_features <= step:
        out = F.linear(xc, tile(weight))
    else:
        # Each tile's product written into one output as it comes (a list of them and a cat would hold the
        # output twice: 50 MB of a 2,048-token chunk's gate/up product on a small model).
        out = torch.empty(*xc.shape[:-1], out_features, dtype=compute, device=xc.device)
        for start in range(0, out_features, step):
            end = min(start + step, out_features)
            out[..., start:end] = F.linear(xc, tile(weight.rows(start, end)))
    return out.to(x.dtype)


def run_quantized(name: str, x: torch.Tensor,
                  weight: QuantizedTensor | qpacked.PackedWeight | torch.Tensor) -> torch.Tensor:
    """x [rows, in] through kernel ``name`` (qdot, qdot8, qtile or qtile_bf16) over a quantized weight; a float part
    of a fused weight (a GGUF file may keep one projection in F16) runs F.linear. A fused weight's plan
    is its first part's: qdot8 falls back to qdot on a part whose format it does not run. A weight repacked
    for the packed int8 kernel (batch-invariant mode, ``invariant_parts``) runs there whatever ``name`` says."""
    if isinstance(weight, qpacked.PackedWeight):
        return qpacked.qlinear_packed(x.contiguous(), weight)
    if not isinstance(weight, QuantizedTensor):
        if name in kernels.ROWDOT_GROUP:  # batch-invariant mode's float product (invariant_plan)
            return rowdot.rowdot(x.contiguous(), weight.to(x.dtype), kernels.ROWDOT_GROUP[name])
        return F.linear(x, weight.to(x.dtype))
    if name == "qdot8":
        # A part's plan offers qdot8 only where its format runs it (plan_for), which the compiled decode
        # trusts: int8_formats() (a cached build check) is not traced.
        runs = torch.compiler.is_compiling() or weight.format.name in int8_formats()
        return qlinear_int8(x, weight) if runs else qlinear(x, weight)
    if name == "qtile_bf16":
        return tiled_linear(x, weight, torch.bfloat16)
    return qlinear(x, weight) if name == "qdot" else tiled_linear(x, weight)


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
        """One plan whose ranges of row counts are those of all parts' plans (the compiled decode reads
        where kernels switch); each range names the first part's kernel."""
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
    """Batch-invariant mode's weights: each part the packed int8 kernel runs (models/qpacked.py: q8_0, q4_0 and q4_1
    on a CPU with AVX512-VNNI) packed for it, the others as they are."""
    return [qpacked.pack(part) if qpacked.runs(part) else part for part in parts]


def invariant_plan(weight: QuantizedTensor | qpacked.PackedWeight | torch.Tensor, dtype: torch.dtype) -> LinearPlan:
    """Batch-invariant mode's plan for a part of a quantized weight: one kernel at every row count. A part
    packed (``invariant_parts``): qpacked8. Otherwise qdot8 (inputs rounded to int8 per group, as llama.cpp
    does at every batch size) where the format runs it, else qdot; all three give a row the same bits in a
    block of any number of rows (csrc/quant.cpp: per-row chains, one reduction tree; csrc/qpacked.cpp: exact
    integer sums, one float part per row). A float part of a fused weight: the float kernel's
    (kernels.invariant_plan)."""
    if isinstance(weight, qpacked.PackedWeight):
        return LinearPlan.single("qpacked8")
    if not isinstance(weight, QuantizedTensor):
        return kernels.invariant_plan(dtype)
    return LinearPlan.single("qdot8" if weight.format.name in int8_formats() else "qdot")


def plan_for(book: PlanBook, weight: QuantizedTensor, dtype: torch.dtype) -> LinearPlan:
    """The measured plan for a quantized weight of this format and shape under ``dtype`` activations
    (stored in the plan book's file as float weights' are). KVREUSE_LINEAR_KERNEL=qdot, qdot8, qtile or
    qtile_bf16 forces one (qdot8 or qtile_bf16 where it is not offered: qdot or qtile); forced onto a float
    kernel, or for weights too small
    to matter, DEFAULT_PLAN, unmeasured."""
    offered = kernels_for(weight.format.name, dtype)
    forced = os.environ.get(kernels.KERNEL_ENV, "auto").strip().lower()
    if forced in kernels.QUANTIZED_KERNELS:
        return LinearPlan.single(forced if forced in offered else {"qtile_bf16": "qtile"}.get(forced, "qdot"))
    shape = weight.shape
    if forced != "auto" or shape[0] * shape[1] < kernels.MIN_MEASURED_ELEMENTS or dtype not in DTYPES:
        return DEFAULT_PLAN
    # The kernels' build (source digest) is in the label: timings taken of an older build are not reused.
    label = f"{weight.format.name}/{str(dtype).removeprefix('torch.')}/{build_name().rsplit('_', 1)[-1][:12]}"
    return book.plan_measured(label, shape, 1, lambda: measure(weight.format.name, shape, dtype),
                              lambda name: name in offered, expected=offered)


def measure(fmt: str, shape: tuple[int, int], dtype: torch.dtype,
            rows: tuple[int, ...] | None = None) -> dict[str, dict[int, float]]:
    """Microseconds per call of the kernels offered (``kernels_for``) on random weights of this format and
    shape, by row count (kernels.measure's method: copies that overflow the caches for memory-bound
    sizes, the kernels taking turns, the fastest repeat)."""
    rows = rows or kernels.PROBE_ROWS
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(0)
    copies = max(1, min(kernels.MAX_COPIES, kernels.COLD_BYTES // FORMATS[fmt].row_bytes(in_features) // out_features))
    weights = [random_quantized(fmt, out_features, in_features, generator) for _ in range(copies)]
    if out_features * in_features > kernels.LARGE_WEIGHT_ELEMENTS:
        rows = tuple(count for count in rows if count <= kernels.COLD_ROWS)
    offered = kernels_for(fmt, dtype)
    times: dict[str, dict[int, float]] = {name: {} for name in offered}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, in_features, generator=generator).to(dtype)
            used = copies if count <= kernels.COLD_ROWS else 1
            repeats = 7 if count <= kernels.COLD_ROWS else 2
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
                    best[name] = min(best[name], kernels._call_us(call) / used)
            for name in offered:
                times[name][count] = best[name]
    return times
