"""The Triton paged-attention kernels (kvreuse/attention/triton_attention.py) against references that never touch them.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before the kernels' module
is imported: ``triton.jit`` picks interpreter or compiler when it decorates) on CPU tensors; with one, on CUDA.

Each case writes a few sequences into shuffled blocks of a one-layer ``KVCache`` (block tables out of order, a
block shared by two sequences), then compares the kernels with a float64 dense attention over the K/V as the pool
holds them (``KVCache.gather``: quantized codes dequantized), and, for float pools, with the engine's own reference
``TorchPagedAttention`` (which also writes the step's K/V). Every slot no query may read (free blocks, the tail
of a last block, keys before a window) is poisoned with NaN (a quantized pool's scales), so a kernel that loads
what it should skip, or masks instead of skipping, fails.

Covered: block sizes 4, 8, 16 and 32; ragged contexts ending mid-block and a context of 1; GQA 1, 2 and 4;
head_dim 16, 32, 48 (not a power of two), 64 and 128; K/V in float32, a bfloat16 pool under float32 queries,
float16 and bfloat16 models, int8, fp8_e4m3 and fp8_e5m2; sliding windows shorter than the context; sinks; a
scale of the layer's own. Decode: one split, several (some empty), the default; rows of context 0 (CUDA graph
padding) give zeros; ``out=``. Prefill: one launch mixing a fresh prompt over several query and key tiles, a chunk
continuing cached context whose hit ends mid-block, and a single-token row. ``store_kv_rows`` skips slot -1 and
writes the rest, for every pool dtype; the kernels' float8 decoding is exact for every non-NaN byte.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest  # noqa: E402

pytest.importorskip("triton")

from kvreuse.attention.backend import LayerAttention  # noqa: E402
from kvreuse.attention.forward_batch import ForwardBatch  # noqa: E402
from kvreuse.attention.torch_paged import TorchPagedAttention  # noqa: E402
from kvreuse.cache.kv import KVCache  # noqa: E402
from kvreuse.cache.kv_quant import resolve_kv_cache_dtype  # noqa: E402
from kvreuse.kernels import triton_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Pool:
    """A one-layer pool on DEVICE whose sequences take blocks in shuffled order."""

    def __init__(self, block_size: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                 kv_cache_dtype: str, num_blocks: int = 40, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, DEVICE,
                             kv_cache_dtype=kv_cache_dtype)
        self.free = torch.randperm(num_blocks, generator=self.generator).tolist()
        self.block_size, self.kv_heads, self.heads, self.head_dim = block_size, kv_heads, kv_heads * group, head_dim
        self.dtype = dtype
        self.kv_code = "float" if self.cache.scheme is None else self.cache.scheme.name

    def random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.dtype).to(DEVICE)

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.int64)[positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).to(DEVICE)

    def sequence(self, length: int, shared: list[int] = ()) -> list[int]:
        """A table for ``length`` tokens whose first blocks are ``shared`` (another sequence's, already written: a
        shared prefix); K/V written for the positions after them."""
        count = -(-length // self.block_size)
        table = list(shared) + self.free[:count - len(shared)]
        self.free = self.free[count - len(shared):]
        start = len(shared) * self.block_size
        if length > start:
            shape = (length - start, self.kv_heads, self.head_dim)
            self.cache.write(0, self.slots(table, start, length), self.random(*shape), self.random(*shape))
        return table

    def extend(self, table: list[int], length: int) -> None:
        """More free blocks at the end of ``table`` until it covers ``length`` tokens."""
        extra = -(-length // self.block_size) - len(table)
        table += self.free[:extra]
        self.free = self.free[extra:]

    def poison(self, keep: set[int]) -> None:
        """NaN in every slot outside ``keep`` (a quantized pool: in its scales)."""
        mask = torch.ones(self.cache.num_slots, dtype=torch.bool, device=DEVICE)
        mask[torch.tensor(sorted(keep), dtype=torch.int64, device=DEVICE)] = False
        target = self.cache.kv if self.cache.scheme is None else self.cache.scales
        target[:, :, mask] = float("nan")

    def pools(self) -> dict:
        k_pool, v_pool, k_scales, v_scales = self.cache.layer_pools(0)
        return dict(k_pool=k_pool, v_pool=v_pool, kv_code=self.kv_code, k_scales=k_scales, v_scales=v_scales,
                    block_size=self.block_size)


def visible_start(context_len: int, query_len: int, window: int | None) -> int:
    """The first key any of a sequence's queries sees."""
    return 0 if window is None else max(0, context_len - query_len - window + 1)


def dense_reference(pool: Pool, q: torch.Tensor, table: list[int], context_len: int, scale: float,
                    window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """float64 attention of q [Q, H, D] (the last Q positions of the context) over the keys it may see."""
    query_len = q.shape[0]
    first = visible_start(context_len, query_len, window)
    keys, values = pool.cache.gather(0, pool.slots(table, first, context_len), torch.float64)
    group = pool.heads // pool.kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [L, H, D]
    scores = torch.einsum("qhd,lhd->hql", q.double(), keys) * scale
    q_positions = torch.arange(context_len - query_len, context_len, device=q.device)[:, None]
    k_positions = torch.arange(first, context_len, device=q.device)[None, :]
    seen = k_positions <= q_positions
    if window is not None:
        seen &= k_positions > q_positions - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        column = sinks.double().view(-1, 1, 1).expand(-1, query_len, 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hql,lhd->qhd", probs, values)


def tables_tensor(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(table) for table in tables)
    return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32, device=DEVICE)


def torch_reference(pool: Pool, seqs: list[tuple[list[int], int, int]], q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """The engine's reference backend over (table, context_len, query_len) sequences: writes the step's k/v."""
    rows, positions, slots = [], [], []
    for table, context_len, query_len in seqs:
        positions.append(torch.arange(context_len - query_len, context_len))
        slots.append(pool.slots(table, context_len - query_len, context_len))
        rows.append(sum(len(p) for p in positions) - 1)
    batch = ForwardBatch(
        input_ids=torch.zeros(q.shape[0], dtype=torch.int64, device=DEVICE),
        positions=torch.cat(positions).to(DEVICE), slot_mapping=torch.cat(slots),
        query_lens=[s[2] for s in seqs], context_lens=[s[1] for s in seqs], block_tables=[s[0] for s in seqs],
        logits_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE))
    backend = TorchPagedAttention()
    metadata = backend.prepare(batch, pool.block_size)
    return backend.forward(0, q, k, v, pool.cache, metadata, layer)


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


# (model dtype, kv_cache_dtype, block_size, kv_heads, group, head_dim, window, sinks, scale, check against torch)
CASES = [
    pytest.param(torch.float32, "auto", 16, 2, 2, 64, 5, True, 0.2, True, id="f32-bs16-gqa2-d64-window-sinks-scale"),
    pytest.param(torch.float32, "bfloat16", 4, 1, 4, 48, None, False, None, False, id="bf16pool-bs4-gqa4-d48"),
    pytest.param(torch.float16, "auto", 32, 2, 1, 128, 7, False, None, False, id="f16-bs32-d128-window"),
    pytest.param(torch.bfloat16, "auto", 16, 2, 2, 64, None, True, None, True, id="bf16-bs16-gqa2-sinks"),
    pytest.param(torch.float16, "int8", 8, 2, 2, 16, 6, True, None, False, id="int8-f16-bs8-gqa2-d16-window-sinks"),
    pytest.param(torch.float32, "fp8_e4m3", 16, 1, 4, 32, None, False, 0.3, False, id="e4m3-bs16-gqa4-d32-scale"),
    pytest.param(torch.bfloat16, "fp8_e5m2", 4, 2, 1, 64, 9, False, None, False, id="e5m2-bf16-bs4-d64-window"),
]
CASE_ARGS = "dtype, kv_cache_dtype, block_size, kv_heads, group, head_dim, window, with_sinks, scale, check_torch"


@pytest.mark.parametrize(CASE_ARGS, CASES)
def test_decode_equals_the_references(dtype, kv_cache_dtype, block_size, kv_heads, group, head_dim, window,
                                      with_sinks, scale, check_torch):
    """Rows: a context ending mid-block, a padding row (context 0), a context of 1, and one sharing the first
    row's two full blocks; each with num_splits 1, 3 (some splits empty) and the default."""
    pool = Pool(block_size, kv_heads, group, head_dim, dtype, kv_cache_dtype)
    layer_scale = scale if scale is not None else head_dim ** -0.5
    sinks = torch.randn(pool.heads, generator=pool.generator).to(DEVICE) if with_sinks else None
    lengths = [2 * block_size + 5, 0, 1, 2 * block_size + 3]
    # Each row's context except its last token first; that token is the step's (written below, or by the torch
    # reference).
    tables = []
    for index, length in enumerate(lengths):
        shared = tables[0][:2] if index == 3 else []
        tables.append(pool.sequence(max(0, length - 1), shared))
        pool.extend(tables[-1], length)
    live = [i for i, length in enumerate(lengths) if length > 0]
    q = pool.random(len(lengths), pool.heads, head_dim)
    k, v = pool.random(len(live), kv_heads, head_dim), pool.random(len(live), kv_heads, head_dim)
    seqs = [(tables[i], lengths[i], 1) for i in live]
    layer = LayerAttention(sliding_window=window, scale=scale, sinks=sinks)
    if check_torch:
        expected_torch = torch_reference(pool, seqs, q[live], k, v, layer)
    else:
        pool.cache.write(0, torch.cat([pool.slots(t, n - 1, n) for t, n, _ in seqs]), k, v)
    expected = torch.zeros(q.shape, dtype=torch.float64, device=DEVICE)
    for i in live:
        expected[i] = dense_reference(pool, q[i:i + 1], tables[i], lengths[i], layer_scale, window, sinks)[0]
    pool.poison({int(s) for i in live for s in pool.slots(tables[i], visible_start(lengths[i], 1, window), lengths[i])})

    block_tables = tables_tensor(tables)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 3, None):
        out = torch.full_like(q, float("nan")) if num_splits == 3 else None
        got = triton_attention.paged_decode_attention(
            q, block_tables=block_tables, context_lens=context_lens, scale=layer_scale, sliding_window=window,
            sinks=sinks, num_splits=num_splits, out=out, **pool.pools())
        assert got.dtype == dtype and got.shape == q.shape
        if out is not None:
            assert got is out
        assert torch.equal(got[1], torch.zeros_like(got[1])), "a padding row must give zeros"
        torch.testing.assert_close(got.double(), expected, **tolerance(dtype), msg=f"num_splits={num_splits}")
        if check_torch:
            torch.testing.assert_close(got[live], expected_torch, **tolerance(dtype))


@pytest.mark.parametrize(CASE_ARGS, CASES)
def test_prefill_mixed_launch_equals_the_references(dtype, kv_cache_dtype, block_size, kv_heads, group, head_dim,
                                                   window, with_sinks, scale, check_torch):
    """One launch: a fresh prompt (70 tokens for a float32 pool: several query and key tiles), a chunk of 7 over a
    cached context ending mid-block (its first two blocks shared with the single-token row's), a single-token row."""
    fresh = 70 if dtype == torch.float32 and kv_cache_dtype == "auto" else 9
    check_prefill(dtype, kv_cache_dtype, block_size, kv_heads, group, head_dim, window, with_sinks, scale,
                  check_torch, fresh)


def test_prefill_head_dim_256_window_narrower_than_a_query_tile():
    """head_dim 256 (Gemma's): key tiles of 32 under query tiles of 64 rows, so with a window of 3 some rows see no
    key of a whole key tile (their running max stays -inf there and must not turn into NaN); with sinks."""
    check_prefill(torch.float32, "auto", 16, 1, 1, 256, 3, True, None, False, 70)


def check_prefill(dtype, kv_cache_dtype, block_size, kv_heads, group, head_dim, window, with_sinks, scale,
                  check_torch, fresh):
    pool = Pool(block_size, kv_heads, group, head_dim, dtype, kv_cache_dtype, seed=1)
    layer_scale = scale if scale is not None else head_dim ** -0.5
    sinks = torch.randn(pool.heads, generator=pool.generator).to(DEVICE) if with_sinks else None
    single_ctx = 2 * block_size + 6
    chunk_cached, chunk_len = 2 * block_size + 3, 7
    # (context_len, query_len, cached prefix written now)
    single_table = pool.sequence(single_ctx - 1)
    chunk_table = pool.sequence(chunk_cached, shared=single_table[:2])
    fresh_table = pool.sequence(0)
    specs = [(fresh, fresh), (chunk_cached + chunk_len, chunk_len), (single_ctx, 1)]
    tables = [fresh_table, chunk_table, single_table]
    for table, (context_len, _) in zip(tables, specs):
        pool.extend(table, context_len)
    num_tokens = sum(query_len for _, query_len in specs)
    q = pool.random(num_tokens, pool.heads, head_dim)
    k, v = pool.random(num_tokens, kv_heads, head_dim), pool.random(num_tokens, kv_heads, head_dim)
    seqs = [(table, context_len, query_len) for table, (context_len, query_len) in zip(tables, specs)]
    layer = LayerAttention(sliding_window=window, scale=scale, sinks=sinks)
    if check_torch:
        expected_torch = torch_reference(pool, seqs, q, k, v, layer)
    else:
        pool.cache.write(0, torch.cat([pool.slots(t, n - m, n) for t, n, m in seqs]), k, v)
    starts = [0]
    for _, _, query_len in seqs:
        starts.append(starts[-1] + query_len)
    expected = torch.cat([dense_reference(pool, q[starts[i]:starts[i + 1]], table, context_len, layer_scale, window,
                                          sinks) for i, (table, context_len, _) in enumerate(seqs)])
    pool.poison({int(s) for table, n, m in seqs for s in pool.slots(table, visible_start(n, m, window), n)})

    out = torch.full_like(q, float("nan"))
    got = triton_attention.paged_prefill_attention(
        q, block_tables=tables_tensor(tables),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([n for _, n, _ in seqs], dtype=torch.int32, device=DEVICE),
        max_query_len=max(m for _, _, m in seqs), scale=layer_scale, sliding_window=window, sinks=sinks, out=out,
        **pool.pools())
    assert got is out and got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))
    if check_torch:
        torch.testing.assert_close(got, expected_torch, **tolerance(dtype))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8", "fp8_e5m2"])
def test_store_kv_rows_skips_negative_slots(kv_cache_dtype: str):
    """Rows land in their slots (codes and, for a quantized pool, their [slots, kv_heads] bfloat16 scales: with one
    KV head a 2-byte row), rows with slot -1 nowhere (in particular not in the last slot), int64 and int32 slots;
    a row view that is not contiguous (k sliced out of a fused projection) too."""
    kv_heads = 1 if kv_cache_dtype == "int8" else 2
    cache = KVCache(1, 4, 4, kv_heads, 24, torch.float32, DEVICE, kv_cache_dtype=kv_cache_dtype)
    k_pool, _, k_scales, _ = cache.layer_pools(0)
    generator = torch.Generator().manual_seed(2)
    for pool in [k_pool] if k_scales is None else [k_pool, k_scales]:
        for slot_list, slot_dtype in (([3, -1, 14, 0, -1, 7], torch.int64), ([-1, 9, 2], torch.int32)):
            slots = torch.tensor(slot_list, dtype=slot_dtype, device=DEVICE)
            shape = (len(slot_list), *pool.shape[1:])
            if pool.dtype in (torch.int8, torch.uint8):
                rows = torch.randint(-128 if pool.dtype == torch.int8 else 0, 128, shape, generator=generator)
            else:
                rows = torch.randn(shape, generator=generator)
            rows = rows.to(pool.dtype).to(DEVICE)
            expected = pool.clone()
            keep = slots >= 0
            expected[slots[keep].long()] = rows[keep]
            triton_attention.store_kv_rows(pool, rows, slots)
            assert torch.equal(pool, expected)
            assert torch.equal(pool[15], torch.zeros_like(pool[15]))
    wide = torch.randn(2, kv_heads, 48, generator=generator).to(k_pool.dtype if k_scales is None else torch.float32)
    if k_scales is None:
        rows = wide.to(DEVICE)[:, :, 24:]
        triton_attention.store_kv_rows(k_pool, rows, torch.tensor([5, 13], device=DEVICE))
        assert torch.equal(k_pool[[5, 13]], rows)


def test_fp8_decoding_is_exact_for_every_byte():
    """The kernels' integer decoding of float8 bytes against torch's float8 dtypes, all 256 bytes but NaNs
    (infinities included, for e5m2), and int8 codes as integers."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    for kv_code, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        expected = codes.view(dtype).float()
        got = triton_attention.codes_to_float(codes, kv_code)
        numbers = ~expected.isnan()
        assert int(numbers.sum()) == (254 if kv_code == "fp8_e4m3" else 250)
        assert torch.equal(got[numbers], expected[numbers]), kv_code
    signed = codes.view(torch.int8)
    assert torch.equal(triton_attention.codes_to_float(signed, "int8"), signed.float())


def test_default_num_splits_comes_from_shapes():
    """More splits for a long table and a small batch, one for short tables or a batch that fills the GPU."""
    device = torch.device(DEVICE)
    many = triton_attention.default_num_splits(1, 2, 256, 16, device)
    assert many > 1 and many & (many - 1) == 0
    assert triton_attention.default_num_splits(1, 2, 4, 16, device) == 1
    assert triton_attention.default_num_splits(4096, 8, 256, 16, device) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_and_store_replay_in_a_cuda_graph():
    """Captured once (the launchers read no device value), a decode step (store with padding slots -1, then split
    decode attention) replays with other context lengths and queries and equals an eager run."""
    pool = Pool(16, 2, 4, 64, torch.bfloat16, "auto", num_blocks=64)
    tables = [pool.sequence(length) for length in (100, 37, 300)]
    for table in tables:
        pool.extend(table, 320)  # room for every replay's length
    block_tables = tables_tensor(tables + [[0]])  # a padding row
    context_lens = torch.tensor([101, 38, 301, 0], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([-1] * 4, dtype=torch.int64, device=DEVICE)
    q = pool.random(4, pool.heads, 64)
    k, v = pool.random(4, 2, 64), pool.random(4, 2, 64)
    k_pool, v_pool, _, _ = pool.cache.layer_pools(0)
    out = torch.empty_like(q)

    def step() -> None:
        triton_attention.store_kv_rows(k_pool, k, slots)
        triton_attention.store_kv_rows(v_pool, v, slots)
        triton_attention.paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, block_size=16,
                                              scale=0.125, out=out)

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lengths in ((101, 38, 301, 0), (120, 1, 310, 0)):
        context_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        slots.copy_(torch.tensor([pool.slots(table, n - 1, n)[0] for table, n in zip(tables, lengths[:3])] + [-1]))
        q.copy_(pool.random(4, pool.heads, 64))
        k.copy_(pool.random(4, 2, 64))
        v.copy_(pool.random(4, 2, 64))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        step()
        assert torch.equal(replayed, out)
        assert torch.equal(out[3], torch.zeros_like(out[3]))
        for row, (table, n) in enumerate(zip(tables, lengths[:3])):
            expected = dense_reference(pool, q[row:row + 1], table, n, 0.125, None, None)[0]
            torch.testing.assert_close(out[row].double(), expected, atol=2e-2, rtol=1e-2)
