"""TorchPagedAttention: the pure-PyTorch paged attention every engine runs by default.

It runs the same code on CPU and CUDA and splits a step three ways, because the cheapest correct
computation differs: a sequence with no cached context attends over its own new K/V with
``is_causal`` (no gather at all); decodes (one query each) are batched into one gather of padded slots
and one masked SDPA call; a prefill chunk that continues cached context gathers its context and uses
a causal mask shifted by ``context_len - query_len`` (on CPU in tiles of queries, each SDPA call over only
the keys its rows can see, so a long chunk costs a causal prefill's half square, not the full one). Index
tensors, masks and tiles are built in ``prepare`` or on first use, so the per-layer work is gathers and SDPA
calls only.

A layer that is not plain (``LayerAttention``: Gemma 3's and gpt-oss's sliding windows, a softmax scale of
its own, gpt-oss's learned sinks) takes the same three routes with Hugging Face's rules: a query at position
p sees keys p - W + 1 .. p under a window W, as a banded mask; a sink is one more logit per head in the
softmax (a column concatenated to the scores, dropped after the softmax), so a layer with sinks computes its
softmax itself instead of SDPA's. A window's masks are built on first use in the step and kept (keyed by the
window) for every later layer with the same window; a windowed decode row gathers only the keys its window
sees, which for a long context is the point of a window. Plain layers never look at any of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvreuse.attention.backend import PLAIN_ATTENTION, AttentionBackend, LayerAttention
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache

# Queries per SDPA call of a chunk over cached context on CPU (ContextChunk.tiles): at least this many, and more
# over long contexts, since each call streams its keys and values once (a tile per 1/16th of the context for
# contiguous queries, per 1/64th for listed ones). Measured on a 2-core AVX-512 EPYC, float32, 9 heads over 3 KV
# heads of 64: 2,056 contiguous queries over 2,082 keys 88.7 ms in one masked call, 45.2 ms in tiles of 64 (a
# causal prefill of the same rows: 45.5 ms); 2,048 over 4,096 keys 157 ms in one call, 121 in tiles of 64, 113
# in tiles of 256; 1,904 over 8,000 keys 283 ms in one call, 279 in tiles of 64, 259 in tiles of 512; 331
# scattered queries over 2,082 keys 11.9 ms in one call, 8.8 ms in tiles of 32, 9.4 in tiles of 64.
CONTIGUOUS_TILE_ROWS = 64
LISTED_TILE_ROWS = 32
CONTIGUOUS_TILES_PER_CONTEXT = 16
LISTED_TILES_PER_CONTEXT = 64


@dataclass
class ContextChunk:
    """A prefill chunk whose sequence already has cached tokens before it."""

    token_start: int  # rows [token_start, token_end) of the step's flattened tokens
    token_end: int
    context_slots: torch.Tensor  # [context_len] slot of every context token, new ones included
    mask: torch.Tensor  # [query_len, context_len] bool, True where a query may attend
    # window -> (slots, mask) of the keys its queries can see under that window, built on first use
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The queries' positions when they are not the last query_len of the context (a blend's kept rows).
    query_positions: torch.Tensor | None = None
    # The queries in tiles, each over only the keys its rows can see: (first row, end row, first key, end key),
    # rows relative to token_start, keys indexing the gathered context (``tiles``, built on first use per window).
    tile_rows: int = 0  # 0: one tile (every query over every gathered key)
    int_positions: tuple[int, ...] = ()  # the queries' positions as ints (tile bounds need no device sync)
    tiled: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)

    def for_window(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots from the first query's window start on, and the banded causal mask over them."""
        found = self.windowed.get(window)
        if found is None:
            query_len, context_len = self.token_end - self.token_start, int(self.context_slots.shape[0])
            device = self.context_slots.device
            query_positions = (self.query_positions if self.query_positions is not None else
                               torch.arange(context_len - query_len, context_len, device=device))[:, None]
            first = self._window_start(window)  # no query sees a key before this
            key_positions = torch.arange(first, context_len, device=device)
            mask = (key_positions[None, :] <= query_positions) & (key_positions[None, :] > query_positions - window)
            found = self.windowed[window] = (self.context_slots[first:], mask)
        return found

    def _window_start(self, window: int) -> int:
        return max(0, self.int_positions[0] - window + 1) if window else 0

    def tiles(self, window: int = 0) -> list[tuple[int, int, int, int]]:
        """Row tiles and the key range each one reads, for the context gathered under ``window`` (0: all of it).

        The queries are ascending, so a tile's last row sees the furthest key and its first row's window starts
        first: keys outside [first key, end key) are masked for every row of the tile, and SDPA need not
        visit them. A chunk continuing a short context then costs what a causal prefill does (half of the
        masked square), and a blend's scattered kept rows read on average half the context."""
        found = self.tiled.get(window)
        if found is None:
            positions, first = self.int_positions, self._window_start(window)
            step = self.tile_rows or len(positions)
            found = self.tiled[window] = [
                (start, min(start + step, len(positions)),
                 max(0, positions[start] - window + 1) - first if window else 0,
                 positions[min(start + step, len(positions)) - 1] + 1 - first)
                for start in range(0, len(positions), step)]
        return found


@dataclass
class DecodeGroup:
    """All single-token sequences of the step, attended in one padded batch."""

    token_rows: torch.Tensor  # [B] rows of the decode tokens in the flattened batch
    rows_slice: slice | None  # the same rows as a slice when they are contiguous (cheaper writes)
    context_slots: torch.Tensor  # [B, max_context] slots, padded with a valid slot of the same sequence
    mask: torch.Tensor | None  # [B, 1, 1, max_context] bool; None when every context has the same length
    # What a windowed layer needs to gather only its window's keys (kept as the batch gave them: no cost
    # to a step whose layers are plain).
    block_tables: list[list[int]] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_size: int = 0
    # window -> (slots [B, width], mask [B, 1, 1, width] or None) of the last ``window`` keys of each row
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    def for_window(self, window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's keys from max(0, context_len - window) on, padded to the longest such run: a decode row
        after 4,000 tokens under a 512-key window gathers 512 keys."""
        found = self.windowed.get(window)
        if found is None:
            device = self.context_slots.device
            seen = [min(window, length) for length in self.context_lens]
            width = max(seen)
            starts = torch.tensor([length - count for length, count in zip(self.context_lens, seen)],
                                  dtype=torch.int64, device=device)[:, None]
            offsets = torch.arange(width, dtype=torch.int64, device=device)[None, :]
            valid = offsets < torch.tensor(seen, dtype=torch.int64, device=device)[:, None]
            # Padding repeats the row's first key (a slot the sequence wrote: finite values); it is masked.
            positions = torch.where(valid, starts + offsets, starts)
            used = [table[: -(-length // self.block_size)] for table, length in zip(self.block_tables, self.context_lens)]
            blocks = max(len(table) for table in used)
            tables = torch.tensor([table + [table[0]] * (blocks - len(table)) for table in used], dtype=torch.int64,
                                  device=device)
            slots = tables.gather(1, positions // self.block_size) * self.block_size + positions % self.block_size
            mask = valid[:, None, None, :] if min(seen) != width else None
            found = self.windowed[window] = (slots, mask)
        return found


class PrefillMasks:
    """Banded causal masks [Q, Q] of fresh prefills under a window (or plain causal ones, for a layer with
    sinks), built on first use and kept for the step: every layer with the same window reuses them."""

    def __init__(self) -> None:
        self._masks: dict[tuple, torch.Tensor] = {}

    def band(self, queries: int, keys: int, offset: int, window: int, device: torch.device) -> torch.Tensor:
        """[queries, keys]: query i (at key position offset + i) sees keys offset + i - window + 1 .. offset + i."""
        key = (queries, keys, offset, window, device)
        mask = self._masks.get(key)
        if mask is None:
            distance = (torch.arange(queries, device=device)[:, None] + offset) - torch.arange(keys, device=device)[None, :]
            mask = self._masks[key] = (distance >= 0) & (distance < window)
        return mask


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is stored
    fresh_prefills: list[tuple[int, int]]  # (token_start, token_end) of sequences with no cached context
    context_chunks: list[ContextChunk]
    decodes: DecodeGroup | None
    covers_whole_batch: bool  # a single fresh prefill spans every token: no output assembly needed
    decodes_cover_whole_batch: bool = False  # every token is one sequence's decode, in row order
    prefill_masks: PrefillMasks = field(default_factory=PrefillMasks)  # windowed layers' fresh prefill masks


def _context_slots(
    block_tables: list[list[int]], context_lens: list[int], block_size: int, device: torch.device
) -> torch.Tensor:
    """Slots [num_seqs, max_context] of every context token; padding repeats the sequence's first slot.

    Built from block ids (one per ``block_size`` tokens) with tensor ops, so long contexts cost no
    per-token Python work.
    """
    max_context = max(context_lens)
    max_blocks = -(-max_context // block_size)
    padded_tables = []
    for table, context_len in zip(block_tables, context_lens):
        used = table[: -(-context_len // block_size)]
        padded_tables.append(used + [used[0]] * (max_blocks - len(used)))
    tables = torch.tensor(padded_tables, dtype=torch.int64, device=device)
    positions = torch.arange(max_context, dtype=torch.int64, device=device)
    slots = tables[:, positions // block_size] * block_size + positions % block_size
    if min(context_lens) != max_context:
        # Padding must still read a slot this sequence wrote (finite values); it is masked anyway.
        lens = torch.tensor(context_lens, dtype=torch.int64, device=device)
        slots = torch.where(positions[None, :] < lens[:, None], slots, slots[:, :1])
    return slots


def context_chunk(token_start: int, query_len: int, context_len: int, table: list[int], block_size: int,
                  device: torch.device, positions: list[int] | None = None) -> ContextChunk:
    """A prefill chunk of ``query_len`` tokens whose sequence holds ``context_len`` tokens after it (the chunk
    included): its context's slots and its offset causal mask. ``positions``: the queries' positions, ascending,
    where they are not the context's last ``query_len`` (a blend's kept rows, attention/blend.py)."""
    slots = _context_slots([table], [context_len], block_size, device)[0]
    # Query i sits at absolute position context_len - query_len + i (or positions[i]) and sees keys 0..that.
    key_positions = torch.arange(context_len, device=device)
    listed = torch.tensor(positions, dtype=torch.int64, device=device) if positions is not None else None
    query_positions = listed if listed is not None else torch.arange(context_len - query_len, context_len,
                                                                     device=device)
    mask = key_positions[None, :] <= query_positions[:, None]
    int_positions = tuple(positions) if positions is not None else tuple(range(context_len - query_len, context_len))
    # Tiles on CPU only (one SDPA call per tile; a GPU would pay a launch for each).
    tile_rows = 0
    if device.type == "cpu":
        tile_rows = (max(LISTED_TILE_ROWS, context_len // LISTED_TILES_PER_CONTEXT) if positions is not None else
                     max(CONTIGUOUS_TILE_ROWS, context_len // CONTIGUOUS_TILES_PER_CONTEXT))
    return ContextChunk(token_start, token_start + query_len, slots, mask, query_positions=listed,
                        tile_rows=tile_rows, int_positions=int_positions)


def attend_chunk(q: torch.Tensor, kv_cache: KVCache, layer_idx: int, chunk: ContextChunk,
                 layer: LayerAttention = PLAIN_ATTENTION) -> torch.Tensor:
    """A context chunk's queries (``q``: the step's) over its gathered context -> [query_len, heads, head_dim]."""
    slots, mask, window = chunk.context_slots, chunk.mask, 0
    if layer.sliding_window is not None and layer.sliding_window < int(slots.shape[0]):
        window = layer.sliding_window
        slots, mask = chunk.for_window(window)  # only the keys some query's window reaches
    keys, values = kv_cache.gather(layer_idx, slots, _compute_dtype(q))
    queries = q[chunk.token_start:chunk.token_end]
    tiles = chunk.tiles(window)
    if len(tiles) == 1 and tiles[0][2] == 0 and tiles[0][3] == keys.shape[0]:
        return _chunk_attention(queries, keys, values, mask, layer)
    out = torch.empty_like(queries)
    for row_start, row_end, key_start, key_end in tiles:
        out[row_start:row_end] = _chunk_attention(queries[row_start:row_end], keys[key_start:key_end],
                                                  values[key_start:key_end],
                                                  mask[row_start:row_end, key_start:key_end], layer)
    return out


def validate_batch(batch: ForwardBatch, block_size: int) -> None:
    """Cheap shape checks (O(num_seqs) Python) so a malformed batch fails with a clear message."""
    num_seqs = batch.num_seqs
    if len(batch.context_lens) != num_seqs or len(batch.block_tables) != num_seqs:
        raise ValueError(
            f"query_lens, context_lens and block_tables must have one entry per sequence, got "
            f"{num_seqs}, {len(batch.context_lens)} and {len(batch.block_tables)}"
        )
    if sum(batch.query_lens) != batch.num_tokens:
        raise ValueError(f"query_lens sum to {sum(batch.query_lens)} but input_ids has {batch.num_tokens} tokens")
    for name in ("positions", "slot_mapping"):
        length = int(getattr(batch, name).shape[0])
        if length != batch.num_tokens:
            raise ValueError(f"{name} has {length} entries but input_ids has {batch.num_tokens}")
    # A prefill chunk that does not finish its prompt samples nothing, so fewer rows are fine.
    # Verifying drafted tokens samples several rows of one sequence, so the bound is the token count.
    if batch.listed_positions is not None:
        if len(batch.listed_positions) != num_seqs:
            raise ValueError(f"listed_positions has {len(batch.listed_positions)} entries for {num_seqs} sequences")
        for index, (listed, query_len, context_len) in enumerate(
                zip(batch.listed_positions, batch.query_lens, batch.context_lens)):
            if listed is not None and (len(listed) != query_len or listed != sorted(set(listed))
                                       or listed[0] < 0 or listed[-1] >= context_len):
                raise ValueError(f"listed_positions[{index}] must be {query_len} ascending positions below "
                                 f"context_lens[{index}] = {context_len}")
    if int(batch.logits_indices.shape[0]) > batch.num_tokens:
        raise ValueError(
            f"logits_indices has {int(batch.logits_indices.shape[0])} entries, more than the {batch.num_tokens} tokens"
        )
    for index, (query_len, context_len, table) in enumerate(
        zip(batch.query_lens, batch.context_lens, batch.block_tables)
    ):
        if query_len < 1:
            raise ValueError(f"query_lens[{index}] must be at least 1, got {query_len}")
        if context_len < query_len:
            raise ValueError(f"context_lens[{index}] ({context_len}) is smaller than query_lens[{index}] ({query_len})")
        if len(table) * block_size < context_len:
            raise ValueError(
                f"block_tables[{index}] has {len(table)} blocks of {block_size} tokens, "
                f"too few for context_lens[{index}] = {context_len}"
            )


class TorchPagedAttention(AttentionBackend):
    """Reference paged attention in plain PyTorch (CPU and CUDA)."""

    def __init__(self, validate: bool = True) -> None:
        self.validate = validate

    def prepare(self, batch: ForwardBatch, block_size: int) -> TorchAttentionMetadata:
        if self.validate:
            validate_batch(batch, block_size)
        device = batch.input_ids.device
        fresh_prefills: list[tuple[int, int]] = []
        context_chunks: list[ContextChunk] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        token_start = 0
        listed = batch.listed_positions or [None] * batch.num_seqs
        for query_len, context_len, table, positions in zip(batch.query_lens, batch.context_lens,
                                                            batch.block_tables, listed):
            token_end = token_start + query_len
            if positions is not None:
                context_chunks.append(context_chunk(token_start, query_len, context_len, table, block_size, device,
                                                    positions))
            elif context_len == query_len:
                fresh_prefills.append((token_start, token_end))
            elif query_len == 1:
                decode_rows.append(token_start)
                decode_tables.append(table)
                decode_lens.append(context_len)
            else:
                context_chunks.append(context_chunk(token_start, query_len, context_len, table, block_size, device))
            token_start = token_end

        decodes = None
        if decode_rows:
            max_context = max(decode_lens)
            mask = None
            if min(decode_lens) != max_context:
                lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
                mask = (torch.arange(max_context, device=device)[None, :] < lens[:, None])[:, None, None, :]
            first, last = decode_rows[0], decode_rows[-1]
            contiguous = last - first + 1 == len(decode_rows)
            decodes = DecodeGroup(
                token_rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
                rows_slice=slice(first, last + 1) if contiguous else None,
                context_slots=_context_slots(decode_tables, decode_lens, block_size, device),
                mask=mask,
                block_tables=decode_tables,
                context_lens=decode_lens,
                block_size=block_size,
            )
        covers_whole_batch = (
            len(fresh_prefills) == 1 and not context_chunks and decodes is None
        )
        decodes_cover_whole_batch = bool(decode_rows) and len(decode_rows) == token_start
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            fresh_prefills=fresh_prefills,
            context_chunks=context_chunks,
            decodes=decodes,
            covers_whole_batch=covers_whole_batch,
            decodes_cover_whole_batch=decodes_cover_whole_batch,
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: TorchAttentionMetadata,
        layer: LayerAttention = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        kv_cache.write(layer_idx, metadata.slot_mapping, k, v)
        if not layer.is_plain:
            return self._forward_layer(layer_idx, q, k, v, kv_cache, metadata, layer)
        if metadata.covers_whole_batch:
            return causal_self_attention(q, k, v)
        if metadata.decodes_cover_whole_batch:  # a pure decode step: no output buffer to fill
            return _decode_attention(q, kv_cache, layer_idx, metadata.decodes)
        out = torch.empty_like(q)
        for start, end in metadata.fresh_prefills:
            out[start:end] = causal_self_attention(q[start:end], k[start:end], v[start:end])
        for chunk in metadata.context_chunks:
            out[chunk.token_start:chunk.token_end] = attend_chunk(q, kv_cache, layer_idx, chunk)
        if metadata.decodes is not None:
            group = metadata.decodes
            batch_q = q[group.rows_slice] if group.rows_slice is not None else q.index_select(0, group.token_rows)
            decode_out = _decode_attention(batch_q, kv_cache, layer_idx, group)
            if group.rows_slice is not None:
                out[group.rows_slice] = decode_out
            else:
                out.index_copy_(0, group.token_rows, decode_out)
        return out

    def _forward_layer(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                       metadata: TorchAttentionMetadata, layer: LayerAttention) -> torch.Tensor:
        """``forward`` for a layer with a window, its own scale or sinks (its K/V already written)."""
        if metadata.covers_whole_batch:
            return self_attention(q, k, v, layer, metadata.prefill_masks)
        if metadata.decodes_cover_whole_batch:
            return _decode_attention(q, kv_cache, layer_idx, metadata.decodes, layer)
        out = torch.empty_like(q)
        for start, end in metadata.fresh_prefills:
            out[start:end] = self_attention(q[start:end], k[start:end], v[start:end], layer, metadata.prefill_masks)
        for chunk in metadata.context_chunks:
            out[chunk.token_start:chunk.token_end] = attend_chunk(q, kv_cache, layer_idx, chunk, layer)
        if metadata.decodes is not None:
            group = metadata.decodes
            batch_q = q[group.rows_slice] if group.rows_slice is not None else q.index_select(0, group.token_rows)
            decode_out = _decode_attention(batch_q, kv_cache, layer_idx, group, layer)
            if group.rows_slice is not None:
                out[group.rows_slice] = decode_out
            else:
                out.index_copy_(0, group.token_rows, decode_out)
        return out


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """CPU prefill attention runs in float32: without AMX, PyTorch's bfloat16/float16 flash kernel
    on CPU is ~25-35% slower than float32 (measured on AVX-512 BF16 Xeons), and float32 is also
    the more precise. The KV cache keeps the model dtype; only the attention arithmetic is wider."""
    return torch.float32 if q.device.type == "cpu" else q.dtype


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A sequence attending over its own new tokens only: [Q, H, D] x [Q, KV, D] -> [Q, H, D]."""
    dtype = _compute_dtype(q)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(dtype),
        k.transpose(0, 1).unsqueeze(0).to(dtype),
        v.transpose(0, 1).unsqueeze(0).to(dtype),
        is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1).to(q.dtype)


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerAttention,
                   masks: PrefillMasks) -> torch.Tensor:
    """``causal_self_attention`` for any layer: a window shorter than the sequence bands the causal mask (from
    ``masks``, shared by the step's layers), a scale goes to SDPA, sinks take ``_sink_attention``."""
    length = q.shape[0]
    window = layer.sliding_window if layer.sliding_window is not None and layer.sliding_window < length else None
    if window is None and layer.sinks is None:
        dtype = _compute_dtype(q)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0).to(dtype), k.transpose(0, 1).unsqueeze(0).to(dtype),
            v.transpose(0, 1).unsqueeze(0).to(dtype), is_causal=True, scale=layer.scale,
            enable_gqa=q.shape[1] != k.shape[1])
        return out.squeeze(0).transpose(0, 1).to(q.dtype)
    if window is not None:
        # In slices of ``window`` queries, each over the keys its window reaches (at most twice the window):
        # O(length x window) work and masks of window x 2 window, not a length x length mask.
        out = torch.empty_like(q)
        for start in range(0, length, window):
            end = min(length, start + window)
            first = max(0, start - window + 1)
            mask = masks.band(end - start, end - first, start - first, window, q.device)
            out[start:end] = _chunk_attention(q[start:end], k[first:end], v[first:end], mask, layer)
        return out
    return _chunk_attention(q, k, v, masks.band(length, length, 0, length, q.device), layer)


def _chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     layer: LayerAttention = PLAIN_ATTENTION) -> torch.Tensor:
    """Queries [Q, H, D] over gathered context [L, KV, D] with an offset causal mask [Q, L]."""
    dtype = _compute_dtype(q)
    if layer.sinks is not None:
        return _prefill_sink_attention(q.to(dtype), keys.to(dtype), values.to(dtype), mask, layer).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(dtype),
        keys.transpose(0, 1).unsqueeze(0).to(dtype),
        values.transpose(0, 1).unsqueeze(0).to(dtype),
        attn_mask=mask,
        scale=layer.scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.squeeze(0).transpose(0, 1).to(q.dtype)


# Scores a layer with sinks materialises at once (its softmax is computed here, not by a fused kernel): a long
# prefill is taken in slices of queries so that heads x queries x keys stays near this many (32 MiB of float32).
# A slice holds about four such tensors at once (the product, its float32 copy, the scores with the sink column,
# their softmax); at 2^26 scores a slice gpt-oss-1b's 2,048-token prefill peaked 1.6 GiB above the loaded
# model, four times llama-server's whole process (docs/benchmarks.md).
SINK_SCORES_PER_SLICE = 1 << 23


def _sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                    layer: LayerAttention) -> torch.Tensor:
    """Softmax attention with a learned sink per head, as transformers' gpt-oss ``eager_attention_forward``: the
    sink is a column concatenated to the scaled scores, the softmax taken over both, the column dropped (its
    weight is what the row gives to no value).

    q [..., KV, G, Q, D] (the G query heads of a KV head adjacent, as the heads are numbered), keys and values
    [..., KV, 1, L, D]; mask broadcasts to the scores [..., KV, G, Q, L] (True: may attend) or is None."""
    kv_heads, group = q.shape[-4], q.shape[-3]
    scale = layer.scale if layer.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale)  # the product is a tensor of its own
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    sinks = layer.sinks.to(scores.device).view(kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def _prefill_sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                            layer: LayerAttention) -> torch.Tensor:
    """Queries [Q, H, D] over keys/values [L, KV, D] under ``mask`` [Q, L], with the layer's sinks."""
    num_queries, num_heads, head_dim = q.shape
    context_len, num_kv_heads = keys.shape[0], keys.shape[1]
    grouped = q.transpose(0, 1).reshape(num_kv_heads, num_heads // num_kv_heads, num_queries, head_dim)
    keys = keys.transpose(0, 1).unsqueeze(1)  # [KV, 1, L, D]
    values = values.transpose(0, 1).unsqueeze(1)
    step = max(1, SINK_SCORES_PER_SLICE // max(1, num_heads * context_len))
    out = torch.cat([_sink_attention(grouped[:, :, start:start + step], keys, values, mask[start:start + step], layer)
                     for start in range(0, num_queries, step)], dim=2)  # [KV, G, Q, D]
    return out.reshape(num_heads, num_queries, head_dim).transpose(0, 1)


def _decode_attention(q: torch.Tensor, kv_cache: KVCache, layer: int, group: DecodeGroup,
                      attention: LayerAttention = PLAIN_ATTENTION) -> torch.Tensor:
    """The decode rows' queries q [B, H, D], one per sequence, over padded contexts -> [B, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.num_kv_heads
    slots, mask = group.context_slots, group.mask
    window = attention.sliding_window
    if window is not None and window < slots.shape[1]:
        slots, mask = group.for_window(window)  # each row's last ``window`` keys only
    # Heads sharing a KV head are consecutive, so with a single query they can be folded into the
    # query-length axis: [B, KV, heads_per_kv, D] against [B, KV, ctx, D], no K/V repetition.
    grouped_q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # index_select over flat slots is several times faster on CPU than advanced indexing [B, ctx].
    flat_slots = slots.view(-1)
    gathered_shape = (num_seqs, slots.shape[1], num_kv_heads, head_dim)
    keys, values = kv_cache.gather(layer, flat_slots, q.dtype)
    keys = keys.view(gathered_shape).transpose(1, 2)  # [B, KV, ctx, D]
    values = values.view(gathered_shape).transpose(1, 2)
    if attention.sinks is not None:
        out = _sink_attention(grouped_q.unsqueeze(-2), keys.unsqueeze(2), values.unsqueeze(2),
                              None if mask is None else mask.unsqueeze(1), attention)
        return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=attention.scale)
    return out.reshape(num_seqs, num_heads, head_dim)
