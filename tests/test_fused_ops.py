"""The fused decoder-layer kernels (kernels/csrc/fused_ops.cpp) against the PyTorch code they replace.

float32 within float rounding; bfloat16 and float16 within one rounding of the dtype (PyTorch rounds after
every op, the kernels once or twice). Covered: the RMSNorm with and without the residual add (which must
update the residual stream in place exactly as ``add_`` does), rotary with and without Qwen3's q/k norms
on fused q|k|v rows (v untouched, positions anywhere in the table), SiLU-and-multiply, a position
outside the rotary table refused, and the sampler's argmax (equal to torch.argmax, ties and NaNs included).
"""

from __future__ import annotations

import pytest
import torch

from kvreuse.kernels import fused_ops
from kvreuse.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="the fused kernels did not build")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(dtype)
    residual = torch.randn(5, 96, generator=generator).to(dtype) if with_residual else None
    x_reference = x.clone()
    expected = fused_ops.reference_rms_norm(x_reference, weight, 1e-6, residual)
    out = fused_ops.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(x, x_reference, atol=0, rtol=0)  # the residual stream, added as add_ does
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_with_a_float32_scale(dtype, with_residual):
    """Gemma's and Qwen3.5's (1 + weight) norm: scaled in float32 and rounded once, as GemmaRMSNorm's reference;
    the layer takes the kernel and gives its bits."""
    from kvreuse.layers.norm import GemmaRMSNorm

    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=generator).to(dtype)
    scale = 1 + 0.1 * torch.randn(96, generator=generator)
    residual = torch.randn(5, 96, generator=generator).to(dtype) if with_residual else None
    x_reference = x.clone()
    expected = fused_ops.reference_rms_norm_float_scale(x_reference, scale, 1e-6, residual)
    x_layer = x.clone()
    out = fused_ops.rms_norm_float_scale(x, scale, 1e-6, residual)
    torch.testing.assert_close(x, x_reference, atol=0, rtol=0)  # the residual stream, added as add_ does
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    norm = GemmaRMSNorm(96, 1e-6, dtype, torch.device("cpu"))
    with torch.no_grad():
        norm.weight.copy_((scale - 1).to(dtype))
    assert torch.equal(norm.scale(), 1.0 + norm.weight.float())
    by_kernel = fused_ops.rms_norm_float_scale(x_layer.clone(), norm.scale(), 1e-6, residual)
    assert torch.equal(norm(x_layer, residual), by_kernel)
    with torch.no_grad():
        norm.weight.add_(1)  # the cached scale follows the weight
    assert torch.equal(norm.scale(), 1.0 + norm.weight.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_on_fused_rows(dtype, qk_norm):
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 6, 2, 32
    rotary = RotaryEmbedding(dim, 4096, 10000.0, None, torch.device("cpu"))
    qkv = torch.randn(7, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    positions = torch.tensor([0, 1, 17, 1000, 4095, 3, 3])
    q_norm = (1 + 0.1 * torch.randn(dim, generator=generator)).to(dtype) if qk_norm else None
    k_norm = (1 + 0.1 * torch.randn(dim, generator=generator)).to(dtype) if qk_norm else None
    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(7, heads, dim), k.reshape(7, kv_heads, dim)
    if qk_norm:
        q = fused_ops.reference_rms_norm(q.contiguous(), q_norm, 1e-6)
        k = fused_ops.reference_rms_norm(k.contiguous(), k_norm, 1e-6)
    cos, sin = rotary.cos_sin(positions, dtype)
    expected_q = fused_ops.reference_rotary(q, cos, sin)
    expected_k = fused_ops.reference_rotary(k, cos, sin)
    fused_ops.rotary_(qkv, rotary.cos_cache, rotary.sin_cache, positions, heads, kv_heads, dim, q_norm, k_norm, 1e-6)
    out_q, out_k, out_v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    tolerance = 2 * TOLERANCE[dtype]  # two roundings apart at most: the norm's and the rotation's
    torch.testing.assert_close(out_q.reshape(7, heads, dim), expected_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(out_k.reshape(7, kv_heads, dim), expected_k, atol=tolerance, rtol=tolerance)
    assert torch.equal(out_v, v)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        fused_ops.rotary_(qkv, rotary.cos_cache, rotary.sin_cache, torch.tensor([0, 1, 2, 3, 4, 5, 4096]), heads,
                          kv_heads, dim, None, None, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gate_up = (3 * torch.randn(33, 2 * 80, generator=torch.Generator().manual_seed(2))).to(dtype)
    expected = fused_ops.reference_silu_mul(gate_up.clone())
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_silu_mul_takes_pytorchs_own_exp():
    """float32 silu_mul is F.silu(gate) * up bit for bit: its exp is PyTorch's (SLEEF's expf8_u10) on every
    vector of 8, here on widths of whole vectors and on rows shared between threads (16 rows of 4,864)."""
    for rows, width in ((1, 4864), (16, 4864), (3, 256)):
        gate_up = 4 * torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(fused_ops.silu_mul(gate_up), fused_ops.reference_silu_mul(gate_up.clone()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clamped_swiglu_is_the_eager_ops_bit_for_bit(dtype):
    """gpt-oss's expert activation in one kernel equals layers.clamped_swiglu's eleven ops bit for bit (each
    op's rounding kept, the clamps' bounds rounded to the dtype, sigmoid's exp PyTorch's own), on values far
    past the limit on both sides, on widths of whole vectors: 1 row (decode), 4 (a decode row's experts),
    64 rows of 384 (threads share them); and within one rounding on a width with a scalar tail."""
    from kvreuse.layers.mlp import clamped_swiglu

    for rows, width in ((1, 384), (4, 384), (64, 384), (3, 2880)):
        gate_up = (6 * torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows))).to(dtype)
        gate_up[0, :4] = torch.tensor([7.0, 7.5, -30.0, 0.0])  # the gate at and past its bound
        gate_up[0, width:width + 3] = torch.tensor([-7.0, -9.0, 12.0])  # up past both bounds
        expected = clamped_swiglu(gate_up[:, :width], gate_up[:, width:], 7.0, 1.702)
        assert torch.equal(fused_ops.clamped_swiglu(gate_up, 7.0, 1.702), expected), (rows, width)
    gate_up = (6 * torch.randn(2, 2 * 77, generator=torch.Generator().manual_seed(7))).to(dtype)
    torch.testing.assert_close(fused_ops.clamped_swiglu(gate_up, 7.0, 1.702),
                               clamped_swiglu(gate_up[:, :77], gate_up[:, 77:], 7.0, 1.702),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    with pytest.raises(RuntimeError, match="limit must be positive"):
        fused_ops.clamped_swiglu(gate_up, 0.0, 1.702)


def test_argmax_rows_is_torch_argmax():
    """Greedy sampling's argmax: the first index of the largest value, the first NaN where a row has one,
    across the spans the threads share (16,384 values each), on rows that are views of a wider tensor."""
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 40_000 + 5, generator=generator)
    logits = wide[:, :40_000]  # rows 40,005 apart: three spans each, the last one short
    logits[1, 30_000] = logits[1, 3] = logits[1, 39_999] = 50.0  # ties in three spans: the first wins
    logits[2, 20_000] = float("nan")  # a NaN after the largest value still wins
    logits[2, 5] = 99.0
    logits[3, :] = float("-inf")  # a fully masked row: index 0, as torch says
    logits[4, 39_998] = float("nan")
    logits[4, 16_390] = float("nan")  # the first of two NaNs in different spans
    logits[5, 16_383] = logits[5, 16_384] = 60.0  # a tie across a span boundary
    got = fused_ops.argmax(logits)
    assert got.dtype == torch.long and torch.equal(got, logits.argmax(dim=-1))
    assert got.tolist()[1:6] == [3, 20_000, 0, 16_390, 16_383]
    for vocab in (1, 7, 8, 9, 49_152):  # widths around a vector and one span
        x = torch.randn(3, vocab, generator=generator)
        assert torch.equal(fused_ops.argmax(x), x.argmax(dim=-1))
    half = torch.randn(2, 100, generator=generator).bfloat16()  # another dtype: torch's own reduction
    assert torch.equal(fused_ops.argmax(half), half.argmax(dim=-1))
