"""Linear layers on quantized weights (kernels/quant.py, layers/quantized_linear.py, kernels/csrc/quant.cpp): GGUF's
blocks repacked losslessly, each kernel equal to dequantize-then-F.linear, bad input refused, traced by
torch.compile, the float path where no compiler builds the kernels, and a model on its quantized
weights generating what the same model dequantized generates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvreuse import LLM, SamplingParams
from kvreuse.kernels import quant, quant_ops
from kvreuse.kernels.quant import FORMATS, GGUF_TYPES, QuantizedTensor, repack_gguf
from kvreuse.layers import plan_book, quantized_linear
from kvreuse.layers.embedding import QuantizedEmbedding
from kvreuse.layers.linear import Linear

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                    reason="no C++ compiler to build the quantized kernels")
# GGML types gguf.quants can quantize (the K-quants it only dequantizes: their tests use random blocks).
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
# Offsets of the fp16 fields in each GGUF block (random bytes there could be NaN or infinity).
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": ()}
# Offsets of the E8M0 exponent bytes: 2^(e - 128) scales near 1e-3 (large ones overflow a product), and the
# two subnormal ones (e 0 and 1) too.
E8M0_FIELDS = {"MXFP4": (0,)}


@pytest.fixture(scope="module")
def built() -> None:
    assert quant_ops.available(), "the quantized kernels did not build (see the log)"


def gguf_blocks(ggml_type: str, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """A GGUF tensor's raw blocks [out, row bytes]: every code and value random, scales sane fp16."""
    fmt = FORMATS[GGUF_TYPES[ggml_type]]
    rng = np.random.default_rng(seed)
    count = in_features // fmt.block
    blocks = rng.integers(0, 256, (out_features, count, fmt.gguf_block_bytes), dtype=np.uint8)
    for offset in HALF_FIELDS[ggml_type]:
        halves = (rng.uniform(1e-4, 1e-2, (out_features, count)) * rng.choice([-1, 1], (out_features, count)))
        blocks[..., offset:offset + 2] = halves.astype(np.float16).view(np.uint8).reshape(out_features, count, 2)
    for offset in E8M0_FIELDS.get(ggml_type, ()):
        blocks[..., offset] = rng.choice([0, 1, *range(112, 124)], (out_features, count))
    return blocks.reshape(out_features, -1)


def reference(ggml_type: str, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[ggml_type]).reshape(shape).astype(np.float32))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


# Shapes with a short last span (rows not a multiple of 256 values: 96, 288, 1120) where the format allows.
SHAPES = {"block32": [(3, 32), (9, 96), (21, 288), (4, 1120), (37, 256)], "block256": [(3, 256), (21, 512), (5, 1280)]}


def shapes_of(ggml_type: str) -> list[tuple[int, int]]:
    return SHAPES["block256" if FORMATS[GGUF_TYPES[ggml_type]].block == 256 else "block32"]


@pytest.mark.parametrize("ggml_type", list(GGUF_TYPES))
def test_repacking_is_exact_and_as_small_as_the_file(ggml_type):
    """Random blocks (every code and value pattern) and, where gguf can quantize, real quantized data:
    the repacked layout dequantizes to gguf's values bit for bit, in plain torch and in the C++ kernel,
    and takes at most 3% more bytes than the file's blocks (K-quants' 6-bit scales unpacked to bytes)."""
    for out_features, in_features in shapes_of(ggml_type):
        raws = [gguf_blocks(ggml_type, out_features, in_features)]
        if ggml_type in QUANTIZABLE:
            values = np.random.default_rng(1).standard_normal((out_features, in_features)).astype(np.float32)
            raws.append(gguf_quantize(values, GGMLQuantizationType[ggml_type]))
        for raw in raws:
            qt = repack_gguf(raw, ggml_type, (out_features, in_features))
            expected = reference(ggml_type, raw, (out_features, in_features))
            assert bits_equal(qt.dequantize(), expected), (ggml_type, out_features, in_features)
            assert qt.nbytes <= 1.03 * raw.nbytes
            if quant_ops.available():
                assert bits_equal(quant_ops.dequantize(qt), expected)


def test_layout_sizes_and_int8_quantization():
    assert {name: fmt.bits_per_value() for name, fmt in FORMATS.items()} == {
        "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "q4_k": 4.625, "q5_k": 5.625, "q6_k": 6.5625,
        "mxfp4": 4.25}
    torch.manual_seed(0)
    weight = torch.randn(40, 96)
    weight[3, :32] = 0  # an all-zero group: scale 0, values 0
    qt = quant.quantize_int8(weight)
    assert qt.format.name == "q8_0" and qt.nbytes == 40 * (96 + 6)
    # Round to nearest with a scale of (largest magnitude / 127): off by at most half a step.
    step = weight.reshape(40, 3, 32).abs().amax(-1, keepdim=True) / 127
    error = (qt.dequantize() - weight).reshape(40, 3, 32).abs()
    assert bool((error <= step * 0.51 + 1e-6).all()) and bool((qt.dequantize()[3, :32] == 0).all())
    with pytest.raises(ValueError, match="q8_0 needs in_features a positive multiple of 32, got 40"):
        quant.quantize_int8(torch.randn(8, 40))


def _tolerance(x: torch.Tensor, weight: torch.Tensor, bf16_output: bool | None = None) -> torch.Tensor:
    """Per-output bound on the kernels' error against the exact product: every product is exact (bf16
    codes times bf16 inputs, a float32 input split exactly into three bf16 parts; or float32 FMAs) and
    only the float32 sums round (a few 2**-24 of the magnitudes per term); bf16 outputs are the float32
    result rounded once (2**-9 relative). A dropped tail, a wrong scale or a wrong row would be off by a
    group's whole contribution, far above it."""
    magnitude = F.linear(x.double().abs(), weight.double().abs())
    bound = magnitude * 2.0**-17
    if x.dtype == torch.bfloat16 if bf16_output is None else bf16_output:
        bound = bound + F.linear(x.double(), weight.double()).abs() * 2.0**-8
    return bound + 1e-30


def _rounded_to_int8(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x as qdot8 multiplies it: per ``group`` values (32, or a K-quant's super-block of 256 on
    AVX512-VNNI), the nearest (ties to even) of the codes -127..127 times amax / 127."""
    assert group in (32, 256)
    groups = x.float().reshape(x.shape[0], x.shape[1] // group, group)  # float32 arithmetic, as the kernel's
    amax = groups.abs().amax(-1, keepdim=True)
    scale = amax / 127
    # torch.full_like(...) / amax, not 127 / amax: torch computes the latter as 127 * (1 / amax), rounded twice.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse)
    return (codes.double() * scale.double()).reshape(x.shape)


@needs_compiler
@pytest.mark.parametrize("dtype", quant_ops.DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", list(GGUF_TYPES))
def test_kernels_match_dequantize_then_f_linear(built, ggml_type, dtype):
    """qdot (the quantized groups read directly) and qtile (dequantized tiles, F.linear) against the
    float64 product with the dequantized weight: 0-17 rows (one pass of 8, two, a partial third), output
    rows that do not fill a thread's share evenly, short last spans, a non-contiguous input. qdot8 (where
    this CPU runs the format on int8 inputs) against the product of the inputs it rounds, as exactly;
    qtile_bf16 (bfloat16 activations only) against the product with the weight rounded to bf16."""
    for out_features, in_features in shapes_of(ggml_type):
        qt = repack_gguf(gguf_blocks(ggml_type, out_features, in_features, seed=2), ggml_type,
                         (out_features, in_features))
        weight = qt.dequantize()
        generator = torch.Generator().manual_seed(3)
        inputs = [torch.randn(rows, in_features, generator=generator).to(dtype) for rows in (0, 1, 2, 3, 5, 8, 9, 16, 17)]
        inputs.append(torch.randn(in_features, 3, generator=generator).to(dtype).t())  # non-contiguous
        inputs[2][0, :32] = 0  # a group of zeros (no scale to divide by)
        for x in inputs:
            for name in quantized_linear.kernels_for(qt.format.name, dtype):
                rounded = _rounded_to_int8(x, quant_ops.int8_group(qt.format.name)) if name == "qdot8" else x
                # qtile_bf16 multiplies the weights rounded to bf16 (bf16 inputs, bf16 GEMM output).
                used = weight.bfloat16().float() if name == "qtile_bf16" else weight
                expected = F.linear(rounded.double(), used.double())
                got = quantized_linear.run_quantized(name, x, qt)
                assert got.dtype == dtype and got.shape == (x.shape[0], out_features)
                error = (got.double() - expected).abs()
                bound = _tolerance(rounded, used, bf16_output=dtype == torch.bfloat16)
                assert bool((error <= bound).all()), (name, ggml_type, x.shape, error.max())


@needs_compiler
def test_int8_input_kernel_is_offered_where_it_runs_and_refuses_the_rest(built, monkeypatch):
    """qdot8 rounds the inputs as llama.cpp does: offered under float32 and bfloat16 activations, for the
    formats this CPU runs on int8 inputs (every format on AVX2, all but q5_0 / q5_1 on AVX512-VNNI:
    every x86-64 machine this suite runs on has one of them), never for float16; asked for
    another format it names it, and a fused weight's later part in such a format falls back to qdot."""
    offered = quant_ops.int8_formats()
    vnni = {"q8_0", "q4_0", "q4_1", "mxfp4", "q4_k", "q5_k", "q6_k"}
    assert offered in (vnni, set(quant.FORMATS)), offered
    for fmt in quant.FORMATS:  # the K-quants' inputs per super-block on VNNI (as llama.cpp's q8_K), else per 32
        expected_group = 0 if fmt not in offered else 256 if offered == vnni and fmt.endswith("_k") else 32
        assert quant_ops.int8_group(fmt) == expected_group, fmt
    for dtype in (torch.float32, torch.bfloat16):
        assert ("qdot8" in quantized_linear.kernels_for("q8_0", dtype)) == ("q8_0" in offered)
    assert "qdot8" not in quantized_linear.kernels_for("q8_0", torch.float16)
    q6 = quant.random_quantized("q6_k", 16, 256)
    x = torch.randn(2, 256).bfloat16()
    for missing in sorted(set(quant.FORMATS) - offered):  # VNNI builds: q5_0 and q5_1
        with pytest.raises(RuntimeError, match=f"{missing} is not run on int8 inputs"):
            quant_ops.qlinear_int8(x, quant.random_quantized(missing, 16, 256))
    # Where q6_k is not offered, a plan asking for qdot8 runs qdot on it.
    monkeypatch.setattr(quant_ops, "int8_formats", lambda: offered - {"q6_k"})
    assert "qdot8" not in quantized_linear.kernels_for("q6_k", torch.float32)
    assert torch.equal(quantized_linear.run_quantized("qdot8", x, q6), quant_ops.qlinear(x, q6))
    with pytest.raises(RuntimeError, match="x has 128 features, weight expects 256"):
        quant_ops.qlinear_int8(torch.randn(1, 128), quant.random_quantized("q8_0", 16, 256))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        quant_ops.qlinear_int8(torch.ones(1, 256, dtype=torch.float16), quant.random_quantized("q8_0", 16, 256))
    book = plan_book.PlanBook(Path(os.devnull))
    q8 = quant.random_quantized("q8_0", 16, 256)
    monkeypatch.setenv(plan_book.KERNEL_ENV, "qdot8")
    expected = "qdot8" if "q8_0" in quant_ops.int8_formats() else "qdot"
    assert quantized_linear.plan_for(book, q8, torch.float32) == plan_book.LinearPlan.single(expected)
    assert quantized_linear.plan_for(book, q8, torch.bfloat16) == plan_book.LinearPlan.single(expected)
    assert quantized_linear.plan_for(book, q6, torch.float32) == plan_book.LinearPlan.single("qdot")


@needs_compiler
def test_bf16_tiles_are_offered_under_bfloat16_activations_only(built, monkeypatch):
    """qtile_bf16 rounds each dequantized tile to bf16: offered to bfloat16 engines (and measured like the
    rest), never to float32 ones, whose products stay exact; forced under float32 it runs qtile."""
    for fmt in quant.FORMATS:
        assert "qtile_bf16" in quantized_linear.kernels_for(fmt, torch.bfloat16)
        assert "qtile_bf16" not in quantized_linear.kernels_for(fmt, torch.float32)
    book = plan_book.PlanBook(Path(os.devnull))
    qt = quant.random_quantized("q4_k", 64, 256)
    monkeypatch.setenv(plan_book.KERNEL_ENV, "qtile_bf16")
    assert quantized_linear.plan_for(book, qt, torch.bfloat16) == plan_book.LinearPlan.single("qtile_bf16")
    assert quantized_linear.plan_for(book, qt, torch.float32) == plan_book.LinearPlan.single("qtile")
    x = torch.randn(40, 256).bfloat16()
    assert torch.equal(quantized_linear.run_quantized("qtile_bf16", x, qt),
                       F.linear(x, quant_ops.dequantize(qt).bfloat16()))


@needs_compiler
def test_quantized_linear_kernel_parts_bias_and_tiles(built, monkeypatch):
    """A fused weight whose parts have different formats (a Q4_K_M file's q/k beside a Q6_K v), plus a
    float part and a bias, through every kernel choice, with tiles smaller than the weight."""
    monkeypatch.setattr(quant_ops, "TILE_VALUES", 512 * 20)
    parts = [repack_gguf(gguf_blocks("Q4_K", 40, 512), "Q4_K", (40, 512)),
             repack_gguf(gguf_blocks("Q4_K", 24, 512, seed=1), "Q4_K", (24, 512)),
             repack_gguf(gguf_blocks("Q6_K", 24, 512, seed=2), "Q6_K", (24, 512)),
             torch.randn(8, 512) * 0.01]
    weight = torch.cat([quantized_linear.dequantize_any(part) for part in parts])
    bias = torch.randn(96)
    for plans in (None, [plan_book.LinearPlan.single("qtile")] * 3, [plan_book.LinearPlan(((2, "qdot"), (plan_book.ALWAYS, "qtile")))] * 3):
        kernel = quantized_linear.QuantizedLinearKernel(parts, bias, plans)
        assert [p.shape[0] for p in kernel.parts] == [64, 24, 8]  # the two Q4_K parts are one weight
        for rows in (1, 3, 11):
            x = torch.randn(2, rows, 512)
            expected = F.linear(x.double(), weight.double(), bias.double())
            error = (kernel(x).double() - expected).abs().reshape(2 * rows, 96)
            assert bool((error <= _tolerance(x.reshape(2 * rows, 512), weight)).all())
    with pytest.raises(ValueError, match="3 weight parts, 1 plans"):
        quantized_linear.QuantizedLinearKernel(parts, None, [quantized_linear.DEFAULT_PLAN])


@needs_compiler
def test_bad_input_is_refused_naming_the_problem(built):
    qt = repack_gguf(gguf_blocks("Q4_K", 8, 512), "Q4_K", (8, 512))
    code = qt.format.code
    op = torch.ops.kvreuse_cpu.qlinear
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got Half"):
        op(torch.randn(1, 512).half(), qt.data, code, 512)
    with pytest.raises(RuntimeError, match="x has 511 features, weight expects 512"):
        op(torch.randn(1, 511), qt.data, code, 512)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, in\]"):
        op(torch.randn(512), qt.data, code, 512)
    with pytest.raises(RuntimeError, match="unknown format 9"):
        op(torch.randn(1, 512), qt.data, 9, 512)
    with pytest.raises(RuntimeError, match="q4_k needs in_features a positive multiple of 256, got 288"):
        op(torch.randn(1, 288), qt.data, code, 288)
    with pytest.raises(RuntimeError, match="a q4_k row of 512 features has 296 bytes, weight rows have 295"):
        op(torch.randn(1, 512), qt.data[:, :295], code, 512)
    with pytest.raises(RuntimeError, match="weight must be uint8"):
        torch.ops.kvreuse_cpu.qdequant(qt.data.to(torch.int16), code, 512)
    with pytest.raises(ValueError, match="GGML type F16 is not held quantized"):
        repack_gguf(np.zeros((2, 64), np.uint8), "F16", (2, 32))
    with pytest.raises(ValueError, match="a Q4_0 tensor of shape 2x64 has 72 bytes, got 70"):
        repack_gguf(np.zeros(70, np.uint8), "Q4_0", (2, 64))
    with pytest.raises(ValueError, match="rows must be a multiple of 256 values, got 288"):
        repack_gguf(np.zeros(2 * 288 // 256 * 144, np.uint8), "Q4_K", (2, 288))
    with pytest.raises(ValueError, match=r"q8_0 data for 64 features must be uint8 \[out, 68\]"):
        QuantizedTensor("q8_0", torch.zeros(2, 64, dtype=torch.uint8), 64)
    linear = Linear(512, [8, 8], False, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="quantized parts 8x512 do not make a 16x512 weight"):
        linear.set_quantized([qt])


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K", "Q8_0", "MXFP4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True], ids=["qdot", "qdot8"])
def test_grouped_products_equal_one_call_per_group(built, ggml_type, dtype, int8):
    """A MoE layer's experts in one call (qlinear_grouped, qlinear_int8_grouped): each group's rows against its
    own weight give what qlinear / qlinear_int8 gives per group, bit for bit, for groups of 0, 1, 3 and more
    than the kernel's 8 rows per pass; one row repeated (a decode row's k experts) included."""
    fmt = FORMATS[GGUF_TYPES[ggml_type]]
    if int8 and fmt.name not in quant_ops.int8_formats():
        pytest.skip(f"{fmt.name} does not run on int8 inputs on this CPU")
    in_features = 512
    weights = [repack_gguf(gguf_blocks(ggml_type, 40, in_features, seed=s), ggml_type, (40, in_features))
               for s in range(5)]
    rows = [1, 0, 3, 11, 2]
    x = torch.randn(sum(rows), in_features).to(dtype)
    x[4:7] = x[0]  # the same row in several groups rounds the same in each
    out = quant_ops.qlinear_grouped(x, rows, weights, int8=int8)
    assert out.shape == (sum(rows), 40) and out.dtype == dtype
    at = 0
    for count, weight in zip(rows, weights):
        expected = (quant_ops.qlinear_int8 if int8 else quant_ops.qlinear)(x[at:at + count], weight)
        assert torch.equal(out[at:at + count].float().view(torch.int32), expected.float().view(torch.int32))
        at += count
    op = torch.ops.kvreuse_cpu.qlinear_int8_grouped if int8 else torch.ops.kvreuse_cpu.qlinear_grouped
    data = [w.data for w in weights]
    with pytest.raises(RuntimeError, match="the groups' row counts add up to 16, x has 17 rows"):
        op(x, [1, 0, 3, 11, 1], data, fmt.code, in_features)
    with pytest.raises(RuntimeError, match="one row count per weight, got 2 row counts and 5 weights"):
        op(x, [1, 16], data, fmt.code, in_features)
    with pytest.raises(RuntimeError, match="every weight must have the same output rows, got 20 and 40"):
        op(x, rows, [*data[:4], data[4][:20]], fmt.code, in_features)
    with pytest.raises(ValueError, match="the weights must share one format"):
        other = repack_gguf(gguf_blocks("Q4_0", 40, in_features), "Q4_0", (40, in_features))
        quant_ops.qlinear_grouped(x[:2], [1, 1], [weights[0], other], int8=int8)


@pytest.mark.parametrize("int8", [False, True], ids=["qdot", "qdot8"])
def test_products_in_many_tasks_give_every_row_once_on_any_thread_count(built, int8):
    """The threads take a product's rows in tasks of ~32 KiB of weight, their own share first, then from the
    back of another's (split_groups): over 3 groups of 3,001 rows (tasks straddling the groups), repeated so
    that threads finish at different times and take each other's tasks, every output row equals the one-thread
    result bit for bit and the dequantized reference."""
    if int8 and "q8_0" not in quant_ops.int8_formats():
        pytest.skip("q8_0 does not run on int8 inputs on this CPU")
    in_features, out_features, rows = 512, 3001, [1, 2, 1]
    weights = [repack_gguf(gguf_blocks("Q8_0", out_features, in_features, seed=s), "Q8_0", (out_features, in_features))
               for s in range(3)]
    x = torch.randn(sum(rows), in_features)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = quant_ops.qlinear_grouped(x, rows, weights, int8=int8)
        torch.set_num_threads(2)
        for _ in range(20):
            assert torch.equal(quant_ops.qlinear_grouped(x, rows, weights, int8=int8).view(torch.int32),
                               single.view(torch.int32))
    finally:
        torch.set_num_threads(threads)
    at = 0
    for count, weight in zip(rows, weights):
        reference = F.linear(x[at:at + count], quant_ops.dequantize(weight))
        # qdot8 rounds the inputs to int8 (per 32 values): within 2% of the outputs' scale, as every row must be.
        scale = reference.abs().max().item()
        torch.testing.assert_close(single[at:at + count], reference, rtol=0, atol=(0.02 if int8 else 1e-5) * scale)
        at += count


def test_bfloat16_int8_products_are_the_float32_products_rounded(built):
    """qdot8 widens a bfloat16 input and rounds its float32 sums to bfloat16 in its own loops for a few rows,
    through ATen's .to() beyond 32k values: either way the bits of the float32 product of the same values
    rounded to nearest even (1 row of 1,280 outputs, and 64). (qdot multiplies bf16 inputs otherwise than
    float32 ones: no such identity there.)"""
    if "q8_0" not in quant_ops.int8_formats():
        pytest.skip("this CPU runs no int8 products")
    qt = repack_gguf(gguf_blocks("Q8_0", 1280, 1024, seed=4), "Q8_0", (1280, 1024))
    generator = torch.Generator().manual_seed(5)
    for rows in (1, 64):
        x = torch.randn(rows, 1024, generator=generator).bfloat16()
        got, want = quant_ops.qlinear_int8(x, qt), quant_ops.qlinear_int8(x.float(), qt).bfloat16()
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "MXFP4"])
def test_int8_products_give_a_row_the_same_bits_in_any_block_of_rows(built, ggml_type):
    """On AVX512-VNNI, q8_0, q4_0 and MXFP4 multiply 4 weight rows at a time against one input row (2 against
    two), the rest one at a time, with q4_0's and MXFP4's zero in the integer sums: each output equals its
    weight row's product alone, bit for bit, whichever block it fell in (13 weight rows, or 12 from the
    second, so the blocks start elsewhere; 1, 2 and 3 input rows; rows of 384 values, a short last span,
    MXFP4's subnormal exponents among the scales), and the product of the rounded inputs within tolerance."""
    fmt = FORMATS[GGUF_TYPES[ggml_type]]
    if fmt.name not in quant_ops.int8_formats():
        pytest.skip(f"{fmt.name} does not run on int8 inputs on this CPU")
    out_features, in_features = 13, 384
    raw = gguf_blocks(ggml_type, out_features, in_features, seed=5)
    weight = repack_gguf(raw, ggml_type, (out_features, in_features))
    shifted = repack_gguf(raw[1:], ggml_type, (out_features - 1, in_features))
    alone = [repack_gguf(raw[j:j + 1], ggml_type, (1, in_features)) for j in range(out_features)]
    generator = torch.Generator().manual_seed(6)
    for rows in (1, 2, 3):
        x = torch.randn(rows, in_features, generator=generator)
        full = quant_ops.qlinear_int8(x, weight)
        for j in range(out_features):
            assert torch.equal(quant_ops.qlinear_int8(x, alone[j]).view(torch.int32), full[:, j:j + 1].view(torch.int32))
        assert torch.equal(quant_ops.qlinear_int8(x, shifted).view(torch.int32), full[:, 1:].view(torch.int32))
        rounded = _rounded_to_int8(x, quant_ops.int8_group(fmt.name))
        expected = F.linear(rounded.double(), weight.dequantize().double())
        assert bool(((full.double() - expected).abs() <= _tolerance(rounded, weight.dequantize())).all())


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_int8_products_give_a_row_the_same_bits_in_any_pass_of_rows(built, ggml_type):
    """Batch-invariant mode runs K-quants on qdot8 at every row count: a row's output is its product alone, bit
    for bit, whichever pass over the weights it fell in (Q4_K and Q5_K take 8 rows a pass up to 2,048 inputs and
    4 above, so both widths), and the product of the rounded inputs within tolerance."""
    fmt = FORMATS[GGUF_TYPES[ggml_type]]
    if fmt.name not in quant_ops.int8_formats():
        pytest.skip(f"{fmt.name} does not run on int8 inputs on this CPU")
    generator = torch.Generator().manual_seed(7)
    for out_features, in_features in ((5, 512), (6, 2304)):
        weight = repack_gguf(gguf_blocks(ggml_type, out_features, in_features, seed=8), ggml_type,
                             (out_features, in_features))
        x = torch.randn(17, in_features, generator=generator)
        full = quant_ops.qlinear_int8(x, weight)
        for i in range(len(x)):
            assert torch.equal(quant_ops.qlinear_int8(x[i:i + 1], weight).view(torch.int32), full[i:i + 1].view(torch.int32))
        assert torch.equal(quant_ops.qlinear_int8(x[3:12], weight).view(torch.int32), full[3:12].view(torch.int32))
        rounded = _rounded_to_int8(x, quant_ops.int8_group(fmt.name))
        expected = F.linear(rounded.double(), weight.dequantize().double())
        assert bool(((full.double() - expected).abs() <= _tolerance(rounded, weight.dequantize())).all())


@needs_compiler
@pytest.mark.parametrize("march", ["haswell", "x86-64"], ids=["avx2", "scalar"])
def test_the_kernels_compile_for_cpus_without_avx512(march):
    """quant.cpp holds a VNNI, an AVX2 and a scalar build of its kernels, chosen by -march=native at run time;
    a machine with AVX-512 compiles only the first, so the others are compiled here (syntax and types)."""
    import sysconfig

    from torch.utils import cpp_extension
    source = quant_ops.SOURCE
    command = [os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", f"-march={march}", "-fopenmp", "-w",
               *(f"-I{path}" for path in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
               str(source)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@needs_compiler
def test_ops_under_torch_compile(built):
    """Fake implementations let a fullgraph compile with inductor's C++ wrapper (the compiled decode's
    setting) trace the decode kernel, the tiled path and an embedding lookup, with work fused around."""
    qt = repack_gguf(gguf_blocks("Q5_0", 48, 96), "Q5_0", (48, 96))
    table = repack_gguf(gguf_blocks("Q8_0", 30, 96, seed=1), "Q8_0", (30, 96))
    ids = torch.tensor([3, 0, 29, 3])

    def step(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        embedded = quant_ops.dequantize_rows(table, ids)
        return torch.relu(quant_ops.qlinear(x * 2 + embedded, qt)) + quant_ops.tiled_linear(x, qt)

    x = torch.randn(4, 96)
    compiled = torch.compile(step, fullgraph=True, options={"cpp_wrapper": True})
    torch.testing.assert_close(compiled(x, ids), step(x, ids))
    weight, rows = qt.dequantize(), table.dequantize()[ids]
    expected = torch.relu(F.linear(x * 2 + rows, weight)) + F.linear(x, weight)
    torch.testing.assert_close(compiled(x, ids), expected, rtol=1e-4, atol=1e-4)


def test_without_a_compiler_the_dequantized_float_path_remains(tmp_path):
    """A fresh process whose compiler fails: one warning, and a layer or embedding given quantized
    weights holds them dequantized in its dtype (gguf's values), running plain F.linear."""
    raw = gguf_blocks("Q4_1", 16, 64)
    np.save(tmp_path / "raw.npy", raw)
    script = (
        "import numpy as np, torch\n"
        "from kvreuse.kernels import quant, quant_ops\n"
        "from kvreuse.layers.linear import Linear\n"
        "assert not quant_ops.available()\n"
        f"qt = quant.repack_gguf(np.load({str(tmp_path / 'raw.npy')!r}), 'Q4_1', (16, 64))\n"
        "linear = Linear(64, [16], False, torch.float32, torch.device('cpu'))\n"
        "linear.set_quantized([qt])\n"
        "assert linear.quantized is None and linear.kernel is None\n"
        "assert torch.equal(linear.weight, qt.dequantize())\n"
        "x = torch.randn(3, 64)\n"
        "torch.testing.assert_close(linear(x), x @ qt.dequantize().t())\n"
        "print('float path ok')\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "KVREUSE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "float path ok" in result.stdout
    assert "the quantized linear kernels could not be built" in result.stderr


@needs_compiler
@pytest.mark.alone  # it asserts what a measurement picks: the other xdist worker waits
def test_plans_are_measured_per_format_and_read_back(built, tmp_path, monkeypatch):
    monkeypatch.setenv(plan_book.KERNEL_ENV, "auto")
    monkeypatch.setattr(plan_book, "PROBE_ROWS", (1, 16, 256))
    monkeypatch.setattr(plan_book, "MAX_COPIES", 2)
    path = tmp_path / "linear-kernels.json"
    book = plan_book.PlanBook(path)
    small = repack_gguf(gguf_blocks("Q4_0", 16, 64), "Q4_0", (16, 64))
    assert quantized_linear.plan_for(book, small, torch.float32) == quantized_linear.DEFAULT_PLAN and book.measured == 0
    qt = quant.random_quantized("q4_0", 1024, 512)
    plan = quantized_linear.plan_for(book, qt, torch.bfloat16)
    assert book.measured == 1 and set(plan.times_us) == set(quantized_linear.kernels_for("q4_0", torch.bfloat16))
    assert set(plan.times_us) >= {"qdot", "qtile"}
    assert plan.times_us["qdot"][256] == float("inf")  # a GEMV: probed up to QDOT_MAX_ROWS only
    # Each probed row count runs the kernel measured fastest there (all of them read the one quantized layout).
    # Which one that is depends on the machine and its load (the documented commands run in background
    # threads while other tests run, the alone marker notwithstanding), so it is not asserted here.
    for rows in (1, 16, 256):
        fastest = min(plan.times_us, key=lambda name: plan.times_us[name][rows])
        assert plan.times_us[plan.kernel_for(rows)][rows] == plan.times_us[fastest][rows], (rows, plan)
    assert plan.times_us["qtile_bf16"][1] == float("inf") and plan.times_us["qtile_bf16"][256] < float("inf")
    book.save()
    (key,) = json.loads(path.read_text())["plans"]
    # Keyed by the kernels' build too: timings of an older build are measured again, not reused.
    build = quant_ops.build_name().rsplit("_", 1)[-1][:12]
    assert key.endswith(f"| q4_0/bfloat16/{build} | 1024x512")
    monkeypatch.setattr(quantized_linear, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert quantized_linear.plan_for(plan_book.PlanBook(path), qt, torch.bfloat16).segments == plan.segments
    monkeypatch.setenv(plan_book.KERNEL_ENV, "qtile")
    assert quantized_linear.plan_for(book, qt, torch.bfloat16) == plan_book.LinearPlan.single("qtile")
    monkeypatch.setenv(plan_book.KERNEL_ENV, "transposed")  # a float kernel forced: quantized weights unmeasured
    assert quantized_linear.plan_for(book, qt, torch.bfloat16) == quantized_linear.DEFAULT_PLAN


@needs_compiler
def test_stored_timings_without_a_kernel_now_offered_are_measured_again(built, tmp_path, monkeypatch):
    """A plan book written before qdot8 ran here (timings of qdot and qtile only) is not read as if qdot8
    had lost: the entry is measured again with every kernel offered, in one run."""
    monkeypatch.setenv(plan_book.KERNEL_ENV, "auto")
    monkeypatch.setattr(plan_book, "PROBE_ROWS", (1, 16))
    monkeypatch.setattr(plan_book, "MAX_COPIES", 1)
    path = tmp_path / "linear-kernels.json"
    qt = quant.random_quantized("q4_0", 1024, 512)
    book = plan_book.PlanBook(path)
    quantized_linear.plan_for(book, qt, torch.float32)
    book.save()
    stored = json.loads(path.read_text())
    (entry,) = stored["plans"].values()
    assert set(entry["times_us"]) == set(quantized_linear.kernels_for("q4_0", torch.float32)) >= {"qdot", "qdot8", "qtile"}
    del entry["times_us"]["qdot8"]  # as an older build's measurement left it
    path.write_text(json.dumps(stored))
    older = plan_book.PlanBook(path)
    plan = quantized_linear.plan_for(older, qt, torch.float32)
    assert older.measured == 1 and "qdot8" in plan.times_us


def _quantized_weights(folder, ggml_type: str) -> tuple[list, list]:
    """The tiny model's weights as a GGUF file of ``ggml_type`` would hold them (every matrix quantized
    by gguf, the embedding too; norms and biases float): (name, QuantizedTensor or tensor) and the same
    weights dequantized by gguf."""
    from kvreuse.loading.loader import iterate_safetensors, safetensors_files

    held, dense = [], []
    for name, tensor in iterate_safetensors(safetensors_files(folder)):
        if tensor.dim() == 2:
            raw = gguf_quantize(tensor.float().numpy(), GGMLQuantizationType[ggml_type])
            held.append((name, repack_gguf(raw, ggml_type, tuple(tensor.shape))))
            dense.append((name, reference(ggml_type, raw, tuple(tensor.shape))))
        else:
            held.append((name, tensor))
            dense.append((name, tensor))
    return held, dense


def _greedy(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 21, 40)]
    return llm.generate(prompts, params, use_tqdm=False)


@needs_compiler
@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1", "Q5_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_on_quantized_weights_generates_as_dequantized(built, tiny_models, tmp_path, arch, ggml_type):
    """The tiny model's matrices (embedding included) quantized by gguf: held quantized (every linear on
    the quantized kernels, the embedding a QuantizedEmbedding, a tied head reading it) it generates the
    tokens the same weights dequantized into float32 generate, with log-probabilities within 1e-3.
    qwen2 is made tied here, so its output projection reads the quantized table."""
    folder = tiny_models[arch]
    if arch == "qwen2":
        folder = tmp_path / "qwen2-tied"
        shutil.copytree(tiny_models[arch], folder)
        config = json.loads((folder / "config.json").read_text())
        config["tie_word_embeddings"] = True
        (folder / "config.json").write_text(json.dumps(config))
    held, dense = _quantized_weights(folder, ggml_type)
    quantized_llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    model = quantized_llm.engine.model
    model.load_weights(held)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and isinstance(m.kernel, quantized_linear.QuantizedLinearKernel) for m in linears)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert (model._tied_head_kernel is not None) == (arch == "qwen2")
    dense_llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    dense_llm.engine.model.load_weights(dense)
    for a, b in zip(_greedy(quantized_llm), _greedy(dense_llm)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in b.outputs[0].logprobs], abs=1e-3)


@needs_compiler
def test_int8_quantization_keeps_greedy_output(built, tiny_models):
    """quantize_int8 (quantization="int8"): every linear layer in the q8_0 layout (a quarter of float32's
    bytes plus scales), the embedding float; the tiny model's greedy tokens equal float32's here (random
    weights have few near-ties) and log-probabilities stay within 0.05."""
    folder = tiny_models["llama"]
    float_llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    int8_llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    model = int8_llm.engine.model
    assert model.quantize_int8() == len([m for m in model.modules() if isinstance(m, Linear)])
    for module in model.modules():
        if isinstance(module, Linear):
            assert module.weight is None and module.weight_bytes == sum(module.output_sizes) * module.input_size * 17 // 16
    for a, b in zip(_greedy(int8_llm), _greedy(float_llm)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in b.outputs[0].logprobs], abs=5e-2)


def _storage(part) -> int:
    """Where a weight part's bytes live (a QuantizedTensor's codes, or a float tensor's)."""
    return (part.data if isinstance(part, QuantizedTensor) else part).untyped_storage().data_ptr()


def _weight_bytes(model) -> int:
    """Bytes of the model's matrices as held (linear layers and the embedding)."""
    linears = sum(m.weight_bytes for m in model.modules() if isinstance(m, Linear))
    embedding = model.model.embed_tokens
    table = embedding.quantized.nbytes if isinstance(embedding, QuantizedEmbedding) else (
        embedding.weight.numel() * embedding.weight.element_size())
    return linears + table


@needs_compiler
@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
def test_a_gguf_file_is_served_from_its_quantized_weights(built, tiny_models, tmp_path, tensor_type):
    """LLM("model.gguf") holds the file's quantized matrices quantized by default (quantization="gguf":
    no float weight left, the matrices' bytes within 3% of the file's tensor bytes), and generates what
    the same file dequantized (quantization="none") generates. K-quant files are of a folder widened to
    multiples of 256 (their random blocks, as llama.cpp would store them)."""
    from gguf_files import wide_model_folder, write_gguf

    folder = tiny_models["qwen2"]
    if tensor_type in ("Q4_K", "Q6_K"):
        folder = wide_model_folder(folder, tmp_path / "wide")
    path = write_gguf(folder, tmp_path / f"model-{tensor_type}.gguf", tensor_type)
    held = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    model = held.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight is None and m.quantized is not None for m in linears)
    # The per-part weights are views of the kernel's (stacked) ones, not a second copy of them.
    for m in linears:
        stacked = {_storage(part) for part in m.kernel.parts}
        assert {_storage(part) for part in m.quantized} <= stacked, m
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    from gguf import GGUFReader

    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if len(t.shape) == 2)
    assert file_bytes <= _weight_bytes(model) <= 1.03 * file_bytes
    dense = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB", quantization="none")
    assert all(m.quantized is None for m in dense.engine.model.modules() if isinstance(m, Linear))
    for a, b in zip(_greedy(held), _greedy(dense)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in b.outputs[0].logprobs], abs=1e-3)


@needs_compiler
def test_quantization_option_int8_and_refusals(built, tiny_models, tmp_path):
    """LLM(folder, quantization="int8") quantizes the linear layers at load; asking for a method that
    does not fit the model or device is refused naming it."""
    folder = tiny_models["qwen3"]
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory="8MiB", quantization="int8")
    assert all(m.quantized is not None and m.quantized[0].format.name == "q8_0"
               for m in llm.engine.model.modules() if isinstance(m, Linear))
    assert _greedy(llm)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="quantization must be one of none, gguf, int8"):
        LLM(str(folder), device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model file"):
        LLM(str(folder), device="cpu", kv_cache_memory="8MiB", quantization="gguf")
    from gguf_files import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", "Q8_0")
    with pytest.raises(ValueError, match="a GGUF file is quantized already"):
        LLM(str(path), device="cpu", kv_cache_memory="8MiB", quantization="int8")
    from kvreuse.loading.loader import resolve_quantization

    with pytest.raises(ValueError, match="runs on CPU only"):
        resolve_quantization("int8", folder, torch.device("cuda"))
    assert resolve_quantization(None, path, torch.device("cuda")) == "none"


@needs_compiler
@pytest.mark.parametrize("forced", ["qdot", "qtile"])
def test_quantized_layers_get_the_plan_measured_for_their_format_and_shape(built, tiny_models, tmp_path, monkeypatch,
                                                                           forced):
    """Choosing the CPU kernels gives every quantized part of every layer the plan book's verdict for its
    format and shape (here forced through KVREUSE_LINEAR_KERNEL), not the unmeasured default: left on the
    default, 16 decoding sequences ran every layer on dequantized tiles (2-3x slower)."""
    from gguf_files import write_gguf

    path = write_gguf(tiny_models["qwen2"], tmp_path / "model.gguf", "Q8_0")
    monkeypatch.setenv(plan_book.KERNEL_ENV, forced)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.quantized is not None for m in layers)
    for module in layers:
        assert {plan.kernel_for(rows) for plan in module.kernel.plans for rows in (1, 16, 4096)} == {forced}
    monkeypatch.setenv(plan_book.KERNEL_ENV, "plain")  # a float kernel forced: the quantized default stays
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    assert all(m.kernel.plans == [quantized_linear.DEFAULT_PLAN] * len(m.kernel.parts)
               for m in llm.engine.model.modules() if isinstance(m, Linear))
