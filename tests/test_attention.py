"""Paged attention tests: ``TorchPagedAttention`` over a ``KVCache`` equals dense causal attention.

A small harness keeps, per sequence and layer, the full history of K/V the test generated and
checks every step's output against a float64 dense reference over that history, while the backend
only sees the slots of scattered, non-contiguous blocks. Covered: full prefill, chunked prefill,
batched decodes with different context lengths, a mixed batch (fresh prefill + continuing chunk +
decodes in non-contiguous rows), grouped-query attention, token-granular reuse through BlockCopy
(the copied block gives the same result as the original), KVCache sizing and block copies, and
the errors for malformed batches. Layers that are not plain (``LayerAttention``: sliding windows shorter and
longer than the contexts, a softmax scale, learned sinks with and without a window, two windows in one step)
through the same three routes: fresh prefills, chunks over cached context, ragged decode groups.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvreuse.attention import torch_paged
from kvreuse.attention.backend import PLAIN_ATTENTION, LayerAttention
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.torch_paged import TorchPagedAttention
from kvreuse.cache.blocks import BlockCopy
from kvreuse.cache.kv import KVCache
from kvreuse.models.config import ModelConfig

HEAD_DIM = 16
BLOCK_SIZE = 4
NUM_BLOCKS = 48
NUM_LAYERS = 2


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           layer: LayerAttention = PLAIN_ATTENTION) -> torch.Tensor:
    """Float64 reference: q [Q, H, D] are the last Q positions of a context k, v [L, KV, D]. ``layer``'s rules
    as transformers has them: keys after p - window (masking_utils' sliding_window_overlay), its scale, and a
    sink column concatenated to each head's scores and dropped after the softmax (gpt-oss)."""
    num_queries, num_heads, head_dim = q.shape
    context_len, num_kv_heads, _ = k.shape
    k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scale = layer.scale if layer.scale is not None else 1 / math.sqrt(head_dim)
    scores = torch.einsum("qhd,lhd->hql", q.double(), k) * scale
    query_positions = torch.arange(context_len - num_queries, context_len)[:, None]
    key_positions = torch.arange(context_len)[None, :]
    visible = key_positions <= query_positions
    if layer.sliding_window is not None:
        visible &= key_positions > query_positions - layer.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if layer.sinks is None:
        return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    sinks = layer.sinks.double().view(num_heads, 1, 1).expand(num_heads, num_queries, 1)
    probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hql,lhd->qhd", probs, v)


class Harness:
    """Drives the backend step by step and checks each step against the dense reference."""

    def __init__(self, num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0,
                 layers: tuple[LayerAttention, ...] = (PLAIN_ATTENTION,) * NUM_LAYERS) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.layers = layers  # each layer's window, scale and sinks
        self.cache = KVCache(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, torch.float32, "cpu")
        self.backend = TorchPagedAttention()
        self.generator = torch.Generator().manual_seed(seed)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        # (sequence, layer) -> (keys, values) of every token computed so far
        self.history: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def add_sequence(self, name: str, block_ids: list[int]) -> None:
        self.block_tables[name] = block_ids
        self.num_computed[name] = 0
        for layer in range(NUM_LAYERS):
            empty = torch.empty(0, self.num_kv_heads, HEAD_DIM)
            self.history[(name, layer)] = (empty, empty)

    def _random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def step(self, items: list[tuple[str, int]], block_copies: list[BlockCopy] | None = None) -> None:
        """Compute ``num_new`` tokens of each named sequence in one batch and check the outputs."""
        positions, slots, query_lens, context_lens, tables = [], [], [], [], []
        for name, num_new in items:
            start = self.num_computed[name]
            end = start + num_new
            table = self.block_tables[name]
            positions += list(range(start, end))
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            query_lens.append(num_new)
            context_lens.append(end)
            tables.append(table[: -(-end // BLOCK_SIZE)])
        num_tokens = len(positions)
        batch = ForwardBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            logits_indices=torch.tensor([], dtype=torch.int64),
            block_copies=block_copies or [],
        )
        self.cache.copy_blocks(batch.block_copies)  # as ModelRunner does, before any layer
        metadata = self.backend.prepare(batch, BLOCK_SIZE)
        for layer in range(NUM_LAYERS):
            q = self._random(num_tokens, self.num_heads, HEAD_DIM)
            k = self._random(num_tokens, self.num_kv_heads, HEAD_DIM)
            v = self._random(num_tokens, self.num_kv_heads, HEAD_DIM)
            out = self.backend.forward(layer, q, k, v, self.cache, metadata, self.layers[layer])
            assert out.shape == q.shape
            row = 0
            for name, num_new in items:
                rows = slice(row, row + num_new)
                keys, values = self.history[(name, layer)]
                keys = torch.cat([keys, k[rows]])
                values = torch.cat([values, v[rows]])
                self.history[(name, layer)] = (keys, values)
                expected = dense_causal_attention(q[rows], keys, values, self.layers[layer])
                torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"sequence {name}, layer {layer}: {m}")
                row += num_new
        for name, num_new in items:
            self.num_computed[name] += num_new


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_full_prefill(num_heads, num_kv_heads):
    harness = Harness(num_heads, num_kv_heads)
    harness.add_sequence("a", [9, 3, 17, 40, 1, 22])
    harness.step([("a", 21)])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_chunked_prefill_over_scattered_blocks(num_heads, num_kv_heads):
    harness = Harness(num_heads, num_kv_heads)
    harness.add_sequence("a", [31, 4, 19, 7, 44, 12, 2])
    harness.step([("a", 7)])  # ends inside a block
    harness.step([("a", 9)])  # continues it: offset causal mask over gathered context
    harness.step([("a", 8)])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 1)])
def test_batched_decode_with_different_context_lengths(num_heads, num_kv_heads):
    harness = Harness(num_heads, num_kv_heads)
    for name, blocks, length in (("a", [5, 30, 11], 3), ("b", [14, 2, 27, 41, 8], 13), ("c", [19, 36, 23], 6)):
        harness.add_sequence(name, blocks)
        harness.step([(name, length)])
    for _ in range(4):  # lengths 4/14/7 ... 7/17/10: padded batch with a mask
        harness.step([("a", 1), ("b", 1), ("c", 1)])


def test_batched_decode_with_equal_context_lengths():
    harness = Harness(4, 2)
    harness.add_sequence("a", [5, 30, 11])
    harness.add_sequence("b", [14, 2, 27])
    harness.step([("a", 6), ("b", 6)])  # two fresh prefills in one batch
    harness.step([("a", 1), ("b", 1)])  # no padding: the mask-free path


def test_mixed_batch_prefill_chunk_and_decodes():
    harness = Harness(6, 3)
    harness.add_sequence("decode1", [3, 8, 13])
    harness.add_sequence("chunked", [21, 1, 34, 9, 17])
    harness.add_sequence("decode2", [40, 6])
    harness.add_sequence("fresh", [25, 11, 29, 46])
    harness.step([("decode1", 9), ("chunked", 5), ("decode2", 5)])
    # Decode rows 0 and 10 are not contiguous: the output is scattered back by index.
    harness.step([("decode1", 1), ("chunked", 6), ("fresh", 13), ("decode2", 1)])
    harness.step([("chunked", 1), ("decode1", 1), ("decode2", 1), ("fresh", 2)])


def test_block_copy_reuses_part_of_a_block():
    harness = Harness(4, 2)
    harness.add_sequence("a", [12, 5, 33, 20])
    harness.step([("a", 10)])  # blocks 12, 5 full; block 33 holds 2 tokens
    # "b" shares a's first 9 tokens: full blocks 12 and 5 by reference, 1 token of block 33 copied
    # into its own block 7, which it then continues writing.
    harness.add_sequence("b", [12, 5, 7, 26])
    for layer in range(NUM_LAYERS):
        keys, values = harness.history[("a", layer)]
        harness.history[("b", layer)] = (keys[:9], values[:9])
    harness.num_computed["b"] = 9
    harness.step([("b", 4)], block_copies=[BlockCopy(src_block=33, dst_block=7, num_tokens=1)])
    # a is unaffected by b writing after the copied token, and both keep decoding together.
    harness.step([("a", 1), ("b", 1)])
    harness.step([("b", 1), ("a", 1)])


def _sinks(heads: int, seed: int) -> torch.Tensor:
    # Spread around the scores' own size, so some rows give the sink most of their weight and some almost none.
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 3


LAYER_PAIRS = {
    # Gemma 3's pattern: a local layer (window 3 with 4-token blocks: starts mid-block) and a global one,
    # each with query_pre_attn_scalar ** -0.5 as its scale.
    "window_and_scale": (LayerAttention(sliding_window=3, scale=0.3), LayerAttention(scale=0.3)),
    # gpt-oss's: alternating windowed and full layers, both with sinks.
    "sinks": (LayerAttention(sliding_window=6, sinks=_sinks(6, 1)), LayerAttention(sinks=_sinks(6, 2))),
    # two windows in one step (each its own masks), one a single key
    "two_windows": (LayerAttention(sliding_window=1), LayerAttention(sliding_window=10)),
}


@pytest.mark.parametrize("pair", list(LAYER_PAIRS))
def test_windows_scales_and_sinks_on_every_route(pair):
    harness = Harness(6, 2, layers=LAYER_PAIRS[pair])
    harness.add_sequence("a", [3, 8, 13, 30])
    harness.add_sequence("b", [21, 1, 34, 9, 17, 44, 42])
    harness.add_sequence("c", [40, 6, 10])
    harness.add_sequence("d", [25, 11, 29, 46, 2])
    # Fresh prefills longer and shorter than the windows.
    harness.step([("a", 9), ("b", 5), ("c", 2)])
    # Chunks over cached context (their rows' windows start at different keys) beside ragged decodes and a
    # fresh prefill, in rows that are not contiguous per kind.
    harness.step([("a", 1), ("b", 7), ("d", 13), ("c", 1)])
    # Decode groups of ragged contexts, some shorter than the window and some longer.
    for _ in range(3):
        harness.step([("a", 1), ("b", 1), ("c", 1), ("d", 1)])
    harness.step([("b", 1), ("d", 1)])  # a pure decode step whose rows are the whole batch


def test_a_fresh_prefill_and_a_decode_step_of_a_windowed_layer_alone():
    # The single-sequence and all-decode shortcuts of forward, for a windowed layer with sinks.
    harness = Harness(4, 2, layers=(LayerAttention(sliding_window=5, sinks=_sinks(4, 3)),) * NUM_LAYERS)
    harness.add_sequence("a", [9, 3, 17, 40, 1, 22])
    harness.step([("a", 14)])
    harness.step([("a", 1)])


@pytest.mark.parametrize("pair", ["plain", *LAYER_PAIRS])
def test_chunks_over_context_in_small_tiles_equal_the_dense_reference(pair, monkeypatch):
    # Tiles of 3 rows: every chunk over cached context spans several, each over only the keys its rows see
    # (windows start mid-tile, the last tile is short).
    monkeypatch.setattr(torch_paged, "CONTIGUOUS_TILE_ROWS", 3)
    harness = Harness(6, 2, layers=LAYER_PAIRS.get(pair, (PLAIN_ATTENTION,) * NUM_LAYERS))
    harness.add_sequence("a", [3, 8, 13, 30, 19])
    harness.add_sequence("b", [21, 1, 34, 9, 17, 44, 42])
    harness.step([("a", 4), ("b", 2)])
    harness.step([("a", 11), ("b", 17)])
    harness.step([("a", 1), ("b", 8)])


@pytest.mark.parametrize("layer", [PLAIN_ATTENTION, LayerAttention(sliding_window=5, scale=0.3),
                                   LayerAttention(sliding_window=4, sinks=_sinks(6, 4)), LayerAttention(sinks=_sinks(6, 5))],
                         ids=["plain", "window", "window_sinks", "sinks"])
def test_listed_query_positions_read_only_the_keys_their_tile_sees(layer, monkeypatch):
    # A blend's kept rows: queries at scattered ascending positions of a 29-token context, in tiles of 2.
    monkeypatch.setattr(torch_paged, "LISTED_TILE_ROWS", 2)
    generator = torch.Generator().manual_seed(7)
    cache = KVCache(1, 16, BLOCK_SIZE, 2, HEAD_DIM, torch.float32, "cpu")
    table, length = [5, 2, 11, 0, 7, 13, 3, 9], 29
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)])
    keys, values = torch.randn(2, length, 2, HEAD_DIM, generator=generator)
    cache.write(0, slots, keys, values)
    positions = [3, 4, 9, 15, 16, 22, 28]
    chunk = torch_paged.context_chunk(0, len(positions), length, table, BLOCK_SIZE, torch.device("cpu"), positions)
    window = layer.sliding_window or 0
    tiles = chunk.tiles(window)
    assert len(tiles) == 4 and tiles[0][3] - tiles[0][2] < 6  # the first tile reads keys 0..4 at most
    q = torch.randn(len(positions), 6, HEAD_DIM, generator=generator)
    out = torch_paged.attend_chunk(q, cache, 0, chunk, layer)
    for row, position in enumerate(positions):  # each row: the dense reference over its own context
        expected = dense_causal_attention(q[row:row + 1], keys[:position + 1], values[:position + 1], layer)
        torch.testing.assert_close(out[row:row + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_a_window_is_built_once_per_step_and_a_decode_row_reads_only_its_window():
    cache = KVCache(2, 16, BLOCK_SIZE, 2, HEAD_DIM, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(0)
    tables, lengths = [[3, 7, 1, 12, 5], [2]], [19, 3]
    for table, length in zip(tables, lengths):
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)])
        for layer in range(2):
            cache.write(layer, slots, torch.randn(length, 2, HEAD_DIM, generator=generator),
                        torch.randn(length, 2, HEAD_DIM, generator=generator))
    # Keys before the 19-token row's window (5 keys: positions 14..18) are never gathered: NaN there would
    # reach the output through any read, masked or not.
    poisoned = torch.tensor([tables[0][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(14)])
    kept = cache.gather(0, poisoned, torch.float32)
    cache.write(0, poisoned, torch.full_like(kept[0], float("nan")), torch.full_like(kept[1], float("nan")))
    batch = ForwardBatch(torch.zeros(2, dtype=torch.int64), torch.tensor([18, 2]),
                         torch.tensor([5 * BLOCK_SIZE + 2, 2 * BLOCK_SIZE + 2]), [1, 1], lengths, tables,
                         torch.zeros(2, dtype=torch.int64))
    backend = TorchPagedAttention()
    metadata = backend.prepare(batch, BLOCK_SIZE)
    layer = LayerAttention(sliding_window=5)
    q = torch.randn(2, 4, HEAD_DIM, generator=generator)
    k, v = torch.randn(2, 2, 2, HEAD_DIM, generator=generator)
    out = backend.forward(0, q, k, v, cache, metadata, layer)
    slots, mask = metadata.decodes.windowed[5]
    # The 3-token row is shorter than the window: its keys are padded and masked.
    assert slots.shape == (2, 5) and mask.squeeze().tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    backend.forward(1, q, k, v, cache, metadata, LayerAttention(sliding_window=5, scale=0.2))
    assert list(metadata.decodes.windowed) == [5] and metadata.decodes.windowed[5][0] is slots  # built once
    for index, (table, length) in enumerate(zip(tables, lengths)):
        all_slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)])
        keys, values = cache.gather(0, all_slots[-5:], torch.float32)  # all of the 3-token row's
        torch.testing.assert_close(out[index:index + 1].double(),
                                   dense_causal_attention(q[index:index + 1], keys, values), atol=1e-5, rtol=1e-5)


def test_kv_cache_block_copy_touches_only_the_copied_slots_of_every_layer():
    cache = KVCache(3, 6, BLOCK_SIZE, 2, HEAD_DIM, torch.float32, "cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape))
    before = cache.kv.clone()
    cache.copy_blocks([BlockCopy(4, 1, 3), BlockCopy(2, 5, BLOCK_SIZE)])
    for layer in range(3):
        for which in (0, 1):  # K, V
            tensor = cache.kv[layer, which]
            original = before[layer, which]
            torch.testing.assert_close(tensor[4:7], original[16:19])  # block 4 -> block 1, 3 slots
            torch.testing.assert_close(tensor[7], original[7])  # 4th slot of block 1 untouched
            torch.testing.assert_close(tensor[20:24], original[8:12])  # block 2 -> block 5, whole
    unchanged = torch.ones(cache.num_slots, dtype=torch.bool)
    unchanged[4:7] = False
    unchanged[20:24] = False
    torch.testing.assert_close(cache.kv[:, :, unchanged], before[:, :, unchanged])
    with pytest.raises(ValueError, match="dst_block 6 is outside 0..5"):
        cache.copy_blocks([BlockCopy(0, 6, 1)])
    with pytest.raises(ValueError, match="num_tokens 5 must be between 0 and block_size 4"):
        cache.copy_blocks([BlockCopy(0, 1, 5)])


def test_num_blocks_for_memory():
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False,
        attention_bias=False, qk_norm=False, sliding_window=None, eos_token_id=None, bos_token_id=None,
        torch_dtype=None,
    )
    per_token = 2 * 2 * 16 * 3 * 2  # K and V, kv heads, head_dim, layers, bf16 bytes
    assert config.kv_bytes_per_token(torch.bfloat16) == per_token
    assert KVCache.num_blocks_for_memory(10 * 16 * per_token + 5, 16, config, torch.bfloat16) == 10
    with pytest.raises(ValueError, match="holds no KV block"):
        KVCache.num_blocks_for_memory(16 * per_token - 1, 16, config, torch.bfloat16)
    cache = KVCache.for_model(config, 10, 16, torch.bfloat16, "cpu")
    assert cache.memory_bytes == 10 * 16 * per_token


def test_malformed_batches_are_rejected():
    backend = TorchPagedAttention()

    def batch(query_lens, context_lens, tables, num_tokens):
        ids = torch.zeros(num_tokens, dtype=torch.int64)
        return ForwardBatch(ids, ids, ids, query_lens, context_lens, tables, torch.zeros(1, dtype=torch.int64))

    with pytest.raises(ValueError, match=r"context_lens\[0\] \(2\) is smaller than query_lens\[0\] \(3\)"):
        backend.prepare(batch([3], [2], [[0]], 3), BLOCK_SIZE)
    with pytest.raises(ValueError, match=r"block_tables\[0\] has 1 blocks of 4 tokens, too few"):
        backend.prepare(batch([3], [6], [[0]], 3), BLOCK_SIZE)
    with pytest.raises(ValueError, match="query_lens sum to 3 but input_ids has 4"):
        backend.prepare(batch([3], [3], [[0]], 4), BLOCK_SIZE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_long_prefill_with_sinks_in_slices_of_queries_equals_the_formula(monkeypatch, dtype):
    """gpt-oss's prefill with sinks materialises its scores, so a long prompt goes in slices of queries
    (SINK_SCORES_PER_SLICE): with slices of 3 queries (and, for comparison, one slice of all 37) over a
    windowed causal mask after 5 cached keys, the output is the eager formula's (the sink a softmax column
    dropped after), computed in float64, and the slices change nothing but the memory."""
    generator = torch.Generator().manual_seed(11)
    queries, cached, heads, kv_heads, head_dim, window = 37, 5, 4, 2, 16, 8
    context = cached + queries
    q = torch.randn(queries, heads, head_dim, generator=generator).to(dtype)
    keys = torch.randn(context, kv_heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(context, kv_heads, head_dim, generator=generator).to(dtype)
    position = torch.arange(cached, context)[:, None]
    key_position = torch.arange(context)[None, :]
    mask = (key_position <= position) & (key_position > position - window)
    layer = LayerAttention(sliding_window=window, scale=0.3, sinks=torch.randn(heads, generator=generator))
    monkeypatch.setattr(torch_paged, "SINK_SCORES_PER_SLICE", 3 * heads * context)
    sliced = torch_paged._prefill_sink_attention(q, keys, values, mask, layer)
    monkeypatch.setattr(torch_paged, "SINK_SCORES_PER_SLICE", queries * heads * context)
    whole = torch_paged._prefill_sink_attention(q, keys, values, mask, layer)
    group = heads // kv_heads
    k64 = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v64 = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k64.transpose(-1, -2) * 0.3
    scores = scores.masked_fill(~mask, float("-inf"))
    sinks = layer.sinks.double().view(heads, 1, 1).expand(heads, queries, 1)
    probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    expected = (probs @ v64).transpose(0, 1)  # [Q, H, D]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got in (sliced, whole):
        assert got.shape == (queries, heads, head_dim)
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
