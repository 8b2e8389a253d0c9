"""The packed int8 kernel (kernels/qpacked.py, csrc/qpacked.cpp): batch-invariant mode's q8_0, q4_0 and q4_1 products.

Packing keeps the file's values; a product equals a float64 reference over the same rounded inputs; and a row's
output has the same bits whatever the number of rows in its call and whichever instruction set summed it (VNNI
for a few rows, AMX's tiles above where the CPU grants them, VNNI for all where it does not).
"""

from __future__ import annotations

import pytest
import torch

from kvreuse.kernels import qpacked, quant
from kvreuse.kernels.quant import random_quantized

pytestmark = pytest.mark.skipif(not qpacked.available(), reason="the packed int8 kernel needs AVX512-VNNI")

FORMATS = list(qpacked.FORMAT_CODES)


def rounded_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] rounded as the kernel rounds it: per 32 values, d = amax / 127 and codes round(x * 127 / amax)
    (to nearest even), both in float32. Returns (codes [rows, chunks, 32], d [rows, chunks, 1])."""
    chunks = x.float().reshape(x.shape[0], -1, qpacked.CHUNK)
    amax = chunks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    return torch.round(chunks * inverse), amax / 127


def reference(x: torch.Tensor, weight: quant.QuantizedTensor) -> torch.Tensor:
    """float64 products of the rounded inputs with the file's values."""
    codes, d = rounded_inputs(x)
    values = (codes.double() * d.double()).reshape(x.shape[0], -1)
    return values @ quant.dequantize(weight).double().T


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_keeps_the_files_values(fmt):
    weight = random_quantized(fmt, 100, 576, torch.Generator().manual_seed(2))  # 100: a block of 16 padded
    packed = qpacked.pack(weight)
    assert packed.data.shape == (7, 18, {"q8_0": 544, "q4_0": 288, "q4_1": 320}[fmt])
    assert torch.equal(packed.dequantize(), quant.dequantize(weight))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_a_product_equals_the_reference_over_rounded_inputs(fmt, rows):
    weight = random_quantized(fmt, 100, 576, torch.Generator().manual_seed(3))
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(4)) * 3
    x[0, :32] = 0  # an all-zero chunk: scale 0, codes 0
    got = qpacked.qlinear_packed(x, qpacked.pack(weight))
    assert got.shape == (rows, 100) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(x, weight), rtol=2e-6, atol=2e-6 * reference(x, weight).abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_at_any_row_count_on_either_instruction_set(fmt, dtype):
    """Rows 1-4 sum on VNNI, more on AMX where granted (qpacked.tiles(); elsewhere both calls below run VNNI);
    use_tiles=False puts every count on VNNI. Each row of every call equals that row alone, and the two
    instruction sets agree bit for bit."""
    weight = qpacked.pack(random_quantized(fmt, 80, 320, torch.Generator().manual_seed(5)))
    x = torch.randn(300, 320, generator=torch.Generator().manual_seed(6)).to(dtype)
    alone = torch.cat([qpacked.qlinear_packed(x[i:i + 1], weight) for i in range(len(x))])
    for rows in (2, 4, 5, 15, 16, 17, 37, 300):
        for use_tiles in (True, False):
            assert torch.equal(qpacked.qlinear_packed(x[:rows], weight, use_tiles), alone[:rows]), (rows, use_tiles)
    # Rows at another offset of a call (a suffix after other sequences' rows) too.
    assert torch.equal(qpacked.qlinear_packed(x[7:60], weight), alone[7:60])


def test_bfloat16_outputs_are_the_float32_outputs_rounded():
    weight = qpacked.pack(random_quantized("q4_1", 64, 256, torch.Generator().manual_seed(7)))
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert torch.equal(qpacked.qlinear_packed(x, weight), qpacked.qlinear_packed(x.float(), weight).bfloat16())


def test_what_it_does_not_run_is_refused_by_name():
    with pytest.raises(ValueError, match="q5_0"):
        qpacked.pack(random_quantized("q5_0", 16, 256))
    assert not qpacked.runs(random_quantized("q4_k", 16, 256)) and qpacked.runs(random_quantized("q4_0", 16, 256))
    weight = qpacked.pack(random_quantized("q8_0", 32, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        qpacked.qlinear_packed(torch.randn(2, 40), weight)
    with pytest.raises(RuntimeError, match="packed weight must be contiguous uint8"):
        torch.ops.kvreuse_qpacked.qlinear_packed(torch.randn(2, 64), weight.data[:1], 0, 32, True)

