"""The in-place paged attention kernel (kernels/csrc/paged_attention.cpp) against its references.

Each case writes K/V for a few sequences into scattered blocks of a ``KVCache``, then runs the kernel over
the sequences' block tables and compares every output row with a float64 dense causal attention over the
same K/V as the pool holds them (a quantized pool's values dequantized: the kernel applies the scales as
it reads). Covered: block sizes 1, 16 and 32; ragged contexts, contexts ending mid-block and a context of
one token; decode rows and chunks over cached context (many queries, offset causal mask), in one call;
contexts split into partitions (flash-decoding's merge); GQA ratios 1 to 8; head_dim 64 and 128; K/V in
float32, bfloat16 and every quantized scheme; a block copied in part (token-granular reuse); the backend
beside SDPA's fresh prefills; and engine runs that must pick the kernel and keep greedy output equal to
the torch backend's through prefix hits and preemption, with the cache invariants checked every step.
Layers that are not plain (``LayerAttention``): sliding windows of 1 key, a few keys (starting mid-tile),
more than a block (starting mid-block) and longer than every context; chunks whose rows' windows start at
different keys; forced partitions, some wholly before a row's window; learned sinks with and without a
window; a scale of the layer's own; in every KV dtype and both bf16 layouts; a decode row that must not read
before its window (NaN there); and the backend equal to the torch reference on each route.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import (
    dense_causal_attention as dense_reference,  # float64, the last Q positions of a context
)

from kvreuse.attention import cpu_paged
from kvreuse.attention.backend import PLAIN_ATTENTION, LayerAttention
from kvreuse.attention.cpu_paged import NativePagedAttention
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.torch_paged import TorchPagedAttention
from kvreuse.cache.blocks import BlockCopy
from kvreuse.cache.kv import KVCache
from kvreuse.kernels import paged_attention
from kvreuse.kernels.paged_attention import paged_rows

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="the paged attention kernel did not build")


class Pool:
    """A one-layer pool with sequences written into shuffled blocks."""

    def __init__(self, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype, kv_cache_dtype: str,
                 num_blocks: int, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = KVCache(1, num_blocks, block_size, kv_heads, dim, dtype, "cpu", kv_cache_dtype=kv_cache_dtype)
        self.free = torch.randperm(num_blocks, generator=self.generator).tolist()
        self.block_size, self.kv_heads, self.dim, self.dtype = block_size, kv_heads, dim, dtype

    def random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.dtype)

    def new_table(self, length: int) -> list[int]:
        count = -(-length // self.block_size)
        table, self.free = self.free[:count], self.free[count:]
        return table

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        return torch.tensor(table, dtype=torch.int64)[positions // self.block_size] * self.block_size + (
            positions % self.block_size)

    def write(self, table: list[int], start: int, end: int) -> None:
        shape = (end - start, self.kv_heads, self.dim)
        self.cache.write(0, self.slots(table, start, end), self.random(*shape), self.random(*shape))

    def held(self, table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence as the pool holds them, in float32 (dequantized)."""
        return self.cache.gather(0, self.slots(table, 0, length), torch.float32)


@pytest.fixture(autouse=True)
def bf16_dot_back_on():
    """A test that reads bf16 pools as float32 rows (``use_bf16_dot(False)``) leaves the layout on for the next."""
    yield
    if paged_attention.available():
        paged_attention.use_bf16_dot(True)


def run_kernel(pool: Pool, query_lens: list[int], context_lens: list[int], heads: int,
               partition_size: int = 0, attention: LayerAttention = PLAIN_ATTENTION) -> None:
    """Write every sequence's context, run the kernel once over all of them, compare each with the reference."""
    tables = [pool.new_table(length) for length in context_lens]
    for table, length in zip(tables, context_lens):
        pool.write(table, 0, length)
    starts = [sum(query_lens[:index]) for index in range(len(query_lens))]
    q = pool.random(sum(query_lens), heads, pool.dim)
    out = torch.full_like(q, float("nan"))
    rows = paged_rows(query_lens, context_lens, tables, starts, pool.block_size)
    cpu_paged.paged_attention(out, q, pool.cache, 0, rows, partition_size, attention=attention)
    run_kernel.last = out
    tolerance = 1e-5 if pool.dtype == torch.float32 else 2e-2  # bfloat16: the output's own rounding
    for table, start, query_len, length in zip(tables, starts, query_lens, context_lens):
        keys, values = pool.held(table, length)
        expected = dense_reference(q[start:start + query_len].float(), keys, values, attention)
        torch.testing.assert_close(out[start:start + query_len].double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_ragged_decodes_and_chunks_in_one_call(block_size, kv_cache_dtype):
    pool = Pool(block_size, 2, 64, torch.float32, kv_cache_dtype, num_blocks=600 // block_size + 40)
    # Decode rows (one query), chunks over cached context (5 and 23 queries), a context of one token,
    # contexts ending mid-block and on a block boundary.
    run_kernel(pool, query_lens=[1, 5, 1, 23, 1, 1], context_lens=[1, 37, 64, 100, 257, 130], heads=8)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2), (12, 3), (8, 1), (64, 8)])
@pytest.mark.parametrize("dim", [64, 128])
def test_gqa_ratios_and_head_dims(heads, kv_heads, dim):
    pool = Pool(16, kv_heads, dim, torch.float32, "auto", num_blocks=48)
    run_kernel(pool, query_lens=[1, 3, 1], context_lens=[77, 40, 300], heads=heads)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_bfloat16_model(kv_cache_dtype):
    pool = Pool(16, 3, 64, torch.bfloat16, kv_cache_dtype, num_blocks=80)
    run_kernel(pool, query_lens=[1, 1, 7], context_lens=[500, 33, 90], heads=9)


@pytest.mark.parametrize("layout", ["bf16_dot", "float_rows"])
@pytest.mark.parametrize("block_size,heads,kv_heads,dim", [
    (16, 14, 2, 64), (1, 8, 8, 64), (32, 8, 1, 128), (16, 12, 4, 96), (16, 6, 2, 80)])
def test_bfloat16_pool_layouts(layout, block_size, heads, kv_heads, dim, monkeypatch):
    # A bf16 pool with bf16 queries has its own kernel where AVX512_BF16 is built in (scores from bf16 dot
    # products over keys transposed as words; head_dim 80 is not a multiple of 32 and falls back to float
    # rows); the other layout reads the same pool as float32 rows. Each must equal the float64 reference:
    # GQA groups of 7 and 8 rows and chunks of up to 8 queries (up to 32 rows a tile), ragged, mid-block and
    # one-token contexts, and split partitions.
    if layout == "bf16_dot" and not paged_attention.has_bf16_dot():
        pytest.skip("this machine's build has no AVX512_BF16 kernel")
    paged_attention.use_bf16_dot(layout != "float_rows")  # back on after the test (bf16_dot_back_on)
    pool = Pool(block_size, kv_heads, dim, torch.bfloat16, "auto", num_blocks=1500 // block_size + 40)
    run_kernel(pool, query_lens=[1, 8, 1, 3, 1], context_lens=[1, 40, 333, 17, 600], heads=heads)
    run_kernel(pool, query_lens=[1, 4], context_lens=[300, 120], heads=heads, partition_size=48)


def test_the_bf16_layout_switch_changes_the_kernel_that_runs():
    # Both layouts equal the reference within bf16 rounding (above), so the switch is checked apart: the
    # AVX512_BF16 dot products round the scores differently from float32 rows, so the outputs' bits differ.
    if not paged_attention.has_bf16_dot():
        pytest.skip("this machine's build has no AVX512_BF16 kernel")
    outputs = []
    for on in (True, False):
        paged_attention.use_bf16_dot(on)
        torch.manual_seed(3)
        pool = Pool(16, 2, 64, torch.bfloat16, "auto", num_blocks=64)
        run_kernel(pool, query_lens=[1, 4], context_lens=[300, 120], heads=8)
        outputs.append(run_kernel.last.clone())
    assert not torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("partition_size", [16, 48, 512])
def test_partitions_of_a_long_context_merge_exactly(partition_size):
    # Split contexts: each partition keeps its own max and sum, merged at the end; chunk rows whose causal
    # limit ends before a later partition see nothing there.
    pool = Pool(16, 2, 64, torch.float32, "auto", num_blocks=120)
    run_kernel(pool, query_lens=[1, 20, 1], context_lens=[1000, 200, 35], heads=4, partition_size=partition_size)


def _sinks(heads: int, seed: int = 0) -> torch.Tensor:
    # Spread around the scores' own size, so some rows give the sink most of their weight and some almost none.
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 3


# Windows with 16-token blocks and 16-key tiles: 1 key (a row sees itself only), 5 (starting mid-tile), 20
# (more than a block: starting mid-block, and a chunk's rows start in different tiles), 5,000 (longer than
# every context: plain); sinks alone and with a window.
LAYERS = {
    "window_1": LayerAttention(sliding_window=1),
    "window_5_scale": LayerAttention(sliding_window=5, scale=0.2),
    "window_20_sinks": LayerAttention(sliding_window=20, sinks=_sinks(8)),
    "window_past_context": LayerAttention(sliding_window=5000),
    "sinks": LayerAttention(sinks=_sinks(8, 1), scale=0.1),
}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e5m2"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_windows_and_sinks(kv_cache_dtype, name):
    pool = Pool(16, 2, 64, torch.float32, kv_cache_dtype, num_blocks=210)
    # Decode rows and chunks (8 queries: two tiles of 4 queries x 4 heads), contexts of 1 to 1,000 tokens; then
    # forced partitions of 16 and 48 keys (some wholly before a later row's window, merged with the sinks after).
    specs = dict(query_lens=[1, 8, 1, 5, 1], context_lens=[1, 45, 300, 37, 1000], heads=8, attention=LAYERS[name])
    run_kernel(pool, **specs)
    run_kernel(pool, **specs, partition_size=16)
    run_kernel(pool, query_lens=[8, 1], context_lens=[200, 130], heads=8, attention=LAYERS[name], partition_size=48)


@pytest.mark.parametrize("layout,kv_cache_dtype", [("bf16_dot", "auto"), ("float_rows", "auto"),
                                                   ("float_rows", "fp8_e4m3")])
@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (4, 4)])
def test_windows_and_sinks_of_a_bfloat16_model(layout, kv_cache_dtype, heads, kv_heads, monkeypatch):
    # Both bf16 layouts (the AVX512_BF16 one masks its 16 lanes per row) and a quantized pool under bf16 q;
    # GQA groups of 7 and of 1.
    if layout == "bf16_dot" and not paged_attention.has_bf16_dot():
        pytest.skip("this machine's build has no AVX512_BF16 kernel")
    paged_attention.use_bf16_dot(layout != "float_rows")  # back on after the test (bf16_dot_back_on)
    pool = Pool(16, kv_heads, 64, torch.bfloat16, kv_cache_dtype, num_blocks=180)
    for attention in (LayerAttention(sliding_window=21, sinks=_sinks(heads, 2)), LayerAttention(sliding_window=3)):
        run_kernel(pool, query_lens=[1, 8, 1, 4], context_lens=[2, 40, 600, 300], heads=heads, attention=attention)
        run_kernel(pool, query_lens=[1, 4], context_lens=[300, 120], heads=heads, attention=attention,
                   partition_size=16)


@pytest.mark.parametrize("dtype,layout", [(torch.float32, "float_rows"), (torch.bfloat16, "bf16_dot")])
def test_a_windowed_row_reads_nothing_before_its_window(dtype, layout, monkeypatch):
    # Keys before a row's window start are not read at all (NaN there would reach the output through any read,
    # masked or not): the items start at the window, whole blocks before it are skipped. A decode row after
    # 1,000 tokens under a 40-key window, and an 8-query chunk whose first query's window starts mid-block.
    if layout == "bf16_dot" and not paged_attention.has_bf16_dot():
        pytest.skip("this machine's build has no AVX512_BF16 kernel")
    window, heads = 40, 4
    pool = Pool(16, 2, 64, dtype, "auto", num_blocks=90)
    query_lens, context_lens = [1, 8], [1000, 300]
    tables = [pool.new_table(length) for length in context_lens]
    for table, query_len, length in zip(tables, query_lens, context_lens):
        pool.write(table, 0, length)
    held = [pool.held(table, length) for table, length in zip(tables, context_lens)]  # before the poison
    for table, query_len, length in zip(tables, query_lens, context_lens):
        first = length - query_len - window + 1  # the first key any of its rows may see
        nan = torch.full((first, 2, 64), float("nan"), dtype=dtype)
        pool.cache.write(0, pool.slots(table, 0, first), nan, nan)
    attention = LayerAttention(sliding_window=window, sinks=_sinks(heads, 3))
    q = pool.random(9, heads, 64)
    for partition_size in (0, 16):
        out = torch.empty_like(q)
        cpu_paged.paged_attention(out, q, pool.cache, 0, paged_rows(query_lens, context_lens, tables, [0, 1], 16),
                                        partition_size, attention=attention)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for (keys, values), start, query_len in zip(held, (0, 1), query_lens):
            expected = dense_reference(q[start:start + query_len].float(), keys, values, attention)
            torch.testing.assert_close(out[start:start + query_len].double(), expected, atol=tolerance, rtol=tolerance)


def test_a_block_copied_in_part_reads_like_its_source():
    # Token-granular reuse: a second sequence shares the first's full blocks and gets a copy of the first
    # 5 tokens of its last one (BlockCopy), then attends in place over both kinds of block.
    pool = Pool(16, 2, 64, torch.float32, "int8", num_blocks=16)
    table = pool.new_table(40)
    pool.write(table, 0, 40)
    copy = pool.new_table(16)[0]
    pool.cache.copy_blocks([BlockCopy(src_block=table[2], dst_block=copy, num_tokens=5)])
    reuse_table = table[:2] + [copy]
    pool.write(reuse_table, 37, 38)  # the new sequence's own next token after the 37 reused
    q = pool.random(1, 4, 64)
    out = torch.empty_like(q)
    cpu_paged.paged_attention(out, q, pool.cache, 0, paged_rows([1], [38], [reuse_table], [0], 16))
    keys, values = pool.held(reuse_table, 38)
    source_keys, _ = pool.held(table, 37)
    assert torch.equal(keys[:37], source_keys)  # the copy holds the source's bytes
    torch.testing.assert_close(out.double(), dense_reference(q, keys, values), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", [PLAIN_ATTENTION, LayerAttention(sliding_window=3, scale=0.3),
                                   LayerAttention(sliding_window=4, sinks=_sinks(4, 4)), LayerAttention(sinks=_sinks(4))],
                         ids=["plain", "window_scale", "window_sinks", "sinks"])
def test_backend_matches_the_torch_reference_beside_fresh_prefills(layer):
    # One step: a fresh prefill (SDPA), a long chunk over cached context (gathered), a short one and two
    # decodes (the kernel), in rows that are not contiguous per kind; each route with the layer's window,
    # scale and sinks.
    pool = Pool(4, 2, 16, torch.float32, "auto", num_blocks=64)
    specs = [(6, 6), (1, 20), (12, 30), (3, 9), (1, 5)]  # (query_len, context_len)
    tables = [pool.new_table(length) for _, length in specs]
    for table, (query_len, length) in zip(tables, specs):
        pool.write(table, 0, length - query_len)
    positions, slots = [], []
    for table, (query_len, length) in zip(tables, specs):
        positions.append(torch.arange(length - query_len, length))
        slots.append(pool.slots(table, length - query_len, length))
    tokens = sum(query_len for query_len, _ in specs)
    batch = ForwardBatch(torch.zeros(tokens, dtype=torch.int64), torch.cat(positions), torch.cat(slots),
                         [s[0] for s in specs], [s[1] for s in specs], tables, torch.zeros(0, dtype=torch.int64))
    q, k, v = pool.random(tokens, 4, 16), pool.random(tokens, 2, 16), pool.random(tokens, 2, 16)
    native = NativePagedAttention()
    metadata = native.prepare(batch, 4)
    assert [c.token_end - c.token_start for c in metadata.context_chunks] == [12]  # over MAX_PAGED_QUERIES
    assert metadata.paged is not None and metadata.paged.query_lens.tolist() == [1, 3, 1]
    out = native.forward(0, q, k, v, pool.cache, metadata, layer)
    reference = TorchPagedAttention()
    expected = reference.forward(0, q, k, v, pool.cache, reference.prepare(batch, 4), layer)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bad_tables_and_shapes_are_refused():
    pool = Pool(4, 2, 16, torch.float32, "auto", num_blocks=8)
    q = torch.zeros(1, 4, 16)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_paged.paged_attention(out, q, pool.cache, 0, paged_rows([1], [5], [[0, 8]], [0], 4))
    with pytest.raises(RuntimeError, match="needs 2 blocks"):
        cpu_paged.paged_attention(out, q, pool.cache, 0, paged_rows([1], [5], [[0]], [0], 4))
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        cpu_paged.paged_attention(torch.empty(1, 3, 16), torch.zeros(1, 3, 16), pool.cache, 0,
                                        paged_rows([1], [2], [[0]], [0], 4))
    rows = paged_rows([1], [2], [[0]], [0], 4)
    k_pool, v_pool, _, _ = pool.cache.layer_pools(0)

    def call(window: int, sinks: torch.Tensor | None) -> None:
        torch.ops.kvreuse_attn.paged_attention(out, q, k_pool, v_pool, None, None, rows.block_tables, rows.query_start,
                                               rows.query_lens, rows.context_lens, 4, -1, 0.25, window, sinks, 0,
                                               None, None, None)

    with pytest.raises(RuntimeError, match="window must be 0"):
        call(-1, None)
    with pytest.raises(RuntimeError, match=r"sinks: a contiguous float32 CPU tensor \[heads\] \(4 heads\)"):
        call(0, torch.zeros(3))
    with pytest.raises(RuntimeError, match="sinks: a contiguous float32"):
        call(2, torch.zeros(4, dtype=torch.float64))


# ---- in the engine --------------------------------------------------------------------------------------

def _greedy_with_invariants(llm, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    from kvreuse import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{id(prompts)}-{index}", {"prompt_token_ids": prompt}, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
    return [done[f"r{id(prompts)}-{index}"] for index in range(len(prompts))]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_runs_the_kernel_and_equals_the_torch_backend(tiny_models, kv_cache_dtype):
    from kvreuse import LLM

    model_dir = tiny_models["qwen3"]
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 300, (45,), generator=generator).tolist()
    # Cold prompts, then hits ending mid-block, a full hit and a long warm suffix (a chunk over cached context
    # that gathers), all on a pool small enough to preempt.
    rounds = [[shared + [7, 8, 9], shared[:30] + [5] * 3],
              [shared[:43] + [11, 12], shared + [7, 8, 9], shared[:22] + list(range(40, 60))]]
    outputs = {}
    for backend in ("torch", "cpu_paged"):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, kv_cache_memory="256KiB",
                  max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
        expected_type = TorchPagedAttention if backend == "torch" else NativePagedAttention
        assert type(llm.engine.runner.attention_backend) is expected_type
        outputs[backend] = [_greedy_with_invariants(llm, prompts) for prompts in rounds]
        assert llm.engine.stats().cache.hit_tokens > 0
    assert outputs["cpu_paged"] == outputs["torch"]


def test_auto_picks_the_kernel_on_cpu_and_a_bad_name_is_refused(tiny_model):
    from kvreuse import LLM

    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="1MiB")
    assert isinstance(llm.engine.runner.attention_backend, NativePagedAttention)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="1MiB", attention_backend="flash")


@pytest.mark.parametrize("layer", [PLAIN_ATTENTION, LayerAttention(sliding_window=5, sinks=_sinks(4, 5))],
                         ids=["plain", "window_sinks"])
def test_a_decode_step_stores_its_kv_and_reads_q_from_the_fused_rows(layer):
    # The hot path: every row a decode, a pool in the model's dtype. The kernel stores the step's K/V itself
    # and reads q, k and v as views of one q|k|v product (rows wider than the heads); a quantized pool takes
    # the separate write. A windowed layer's rows see the key just stored.
    for kv_cache_dtype in ("auto", "int8"):
        pool = Pool(4, 2, 16, torch.float32, kv_cache_dtype, num_blocks=40)
        lengths = [9, 14, 2]
        tables = [pool.new_table(length) for length in lengths]
        for table, length in zip(tables, lengths):
            pool.write(table, 0, length - 1)
        slots = torch.cat([pool.slots(table, length - 1, length) for table, length in zip(tables, lengths)])
        batch = ForwardBatch(torch.zeros(3, dtype=torch.int64), torch.tensor([n - 1 for n in lengths]), slots,
                             [1, 1, 1], lengths, tables, torch.zeros(3, dtype=torch.int64))
        qkv = pool.random(3, (4 + 2 + 2) * 16)
        q, k, v = (part.view(3, -1, 16) for part in qkv.split([64, 32, 32], dim=-1))
        native = NativePagedAttention()
        out = native.forward(0, q, k, v, pool.cache, native.prepare(batch, 4), layer)
        for index, (table, length) in enumerate(zip(tables, lengths)):
            keys, values = pool.held(table, length)
            if kv_cache_dtype == "auto":
                assert torch.equal(keys[-1], k[index]) and torch.equal(values[-1], v[index])  # stored as given
            torch.testing.assert_close(out[index:index + 1].double(),
                                       dense_reference(q[index:index + 1], keys, values, layer), atol=1e-5, rtol=1e-5)
