"""Linear layers on quantized weights (csrc/quant.cpp): built for this CPU on first use, as ``torch.ops.kvreuse_cpu``.

Two operators over kernels/quant.py's layouts, built and cached like the row-dot GEMV (kernels/rowdot.py:
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
Which runs a row count is measured per CPU (layers/quantized_linear.py, layers/plan_book.py), format, activation dtype and shape, as for float weights
(layers/plan_book.py's ``qdot``, ``qdot8``, ``qtile`` and ``qtile_bf16``; ``QuantizedLinearKernel`` follows
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
from pathlib import Path

import torch
import torch.nn.functional as F

from kvreuse.kernels import build
from kvreuse.kernels.quant import FORMATS, QuantizedTensor

SOURCE = Path(__file__).with_name("csrc") / "quant.cpp"


DTYPES = (torch.float32, torch.bfloat16)  # activations; accumulation is float32 either way


# The revision of qdot8's arithmetic, in the KV fingerprint: raised whenever the int8 products' float sums
# round differently for the same inputs, so K/V a tier stored under an earlier revision are another's.
# 2: q8_0, q4_0 and MXFP4 in blocks of rows, their zero in the int32 sums (issue 38, sixth session).
# 3: Q4_K and Q5_K through vpdpbusd in four-chunk registers, their offsets as float products (issue 66, seventh
#    session: csrc/quant_int8_avx512vnni.h dot_rows_kquant_quads).
INT8_ARITHMETIC = 3


# Output rows per tile of tiled_linear: about this many weight values dequantized at once (4 MiB in
# float32, within the L2 / L3 caches while the GEMM reads it).
TILE_VALUES = 2**20


def build_name() -> str:
    return build.build_name(SOURCE, "kvreuse_quant")


def available() -> bool:
    """Whether the quantized kernels run here, building them first if needed (once per process)."""
    return library() is not None


@functools.cache
def library() -> Path | None:
    built = build.load_extension(SOURCE, build_name(), "the quantized linear kernels",
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


def dequantize(weight: QuantizedTensor) -> torch.Tensor:
    """float32 [out, in] through the C++ kernel (``available()`` must have returned True)."""
    return torch.ops.kvreuse_cpu.qdequant(weight.data, weight.format.code, weight.in_features)


def dequantize_rows(weight: QuantizedTensor, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), in]: the weight rows at the indices ``rows`` (an embedding lookup)."""
    return torch.ops.kvreuse_cpu.qdequant(weight.data.index_select(0, rows), weight.format.code, weight.in_features)


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
