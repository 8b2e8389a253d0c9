"""TorchPagedAttention: the pure-PyTorch paged attention every engine runs by default.

It runs the same code on CPU and CUDA and splits a step three ways, because the cheapest correct
computation differs: a sequence with no cached context attends over its own new K/V with
``is_causal`` (no gather at all); decodes (one query each) are batched into one gather of padded slots
and one masked SDPA call; a prefill chunk that continues cached context gathers its context and uses
a causal mask shifted by ``context_len - query_len``. Index tensors and masks are built in ``prepare``
so the per-layer work is gathers and SDPA calls only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache


@dataclass
class ContextChunk:
    """A prefill chunk whose sequence already has cached tokens before it."""

    token_start: int  # rows [token_start, token_end) of the step's flattened tokens
    token_end: int
    context_slots: torch.Tensor  # [context_len] slot of every context token, new ones included
    mask: torch.Tensor  # [query_len, context_len] bool, True where a query may attend


@dataclass
class DecodeGroup:
    """All single-token sequences of the step, attended in one padded batch."""

    token_rows: torch.Tensor  # [B] rows of the decode tokens in the flattened batch
    rows_slice: slice | None  # the same rows as a slice when they are contiguous (cheaper writes)
    context_slots: torch.Tensor  # [B, max_context] slots, padded with a valid slot of the same sequence
    mask: torch.Tensor | None  # [B, 1, 1, max_context] bool; None when every context has the same length


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is stored
    fresh_prefills: list[tuple[int, int]]  # (token_start, token_end) of sequences with no cached context
    context_chunks: list[ContextChunk]
    decodes: DecodeGroup | None
    covers_whole_batch: bool  # a single fresh prefill spans every token: no output assembly needed
    decodes_cover_whole_batch: bool = False  # every token is one sequence's decode, in row order


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
                  device: torch.device) -> ContextChunk:
    """A prefill chunk of ``query_len`` tokens whose sequence holds ``context_len`` tokens after it (the chunk
    included): its context's slots and its offset causal mask."""
    slots = _context_slots([table], [context_len], block_size, device)[0]
    # Query i sits at absolute position context_len - query_len + i and sees keys 0..that.
    key_positions = torch.arange(context_len, device=device)
    query_positions = torch.arange(context_len - query_len, context_len, device=device)
    mask = key_positions[None, :] <= query_positions[:, None]
    return ContextChunk(token_start, token_start + query_len, slots, mask)


def attend_chunk(q: torch.Tensor, kv_cache: KVCache, layer_idx: int, chunk: ContextChunk) -> torch.Tensor:
    """A context chunk's queries (``q``: the step's) over its gathered context -> [query_len, heads, head_dim]."""
    keys, values = kv_cache.gather(layer_idx, chunk.context_slots, _compute_dtype(q))
    return _chunk_attention(q[chunk.token_start:chunk.token_end], keys, values, chunk.mask)


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
        for query_len, context_len, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            token_end = token_start + query_len
            if context_len == query_len:
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
    ) -> torch.Tensor:
        kv_cache.write(layer_idx, metadata.slot_mapping, k, v)
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


def _chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Queries [Q, H, D] over gathered context [L, KV, D] with an offset causal mask [Q, L]."""
    dtype = _compute_dtype(q)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(dtype),
        keys.transpose(0, 1).unsqueeze(0).to(dtype),
        values.transpose(0, 1).unsqueeze(0).to(dtype),
        attn_mask=mask,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.squeeze(0).transpose(0, 1).to(q.dtype)


def _decode_attention(q: torch.Tensor, kv_cache: KVCache, layer: int, group: DecodeGroup) -> torch.Tensor:
    """The decode rows' queries q [B, H, D], one per sequence, over padded contexts -> [B, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.num_kv_heads
    # Heads sharing a KV head are consecutive, so with a single query they can be folded into the
    # query-length axis: [B, KV, heads_per_kv, D] against [B, KV, ctx, D], no K/V repetition.
    grouped_q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # index_select over flat slots is several times faster on CPU than advanced indexing [B, ctx].
    flat_slots = group.context_slots.view(-1)
    gathered_shape = (num_seqs, group.context_slots.shape[1], num_kv_heads, head_dim)
    keys, values = kv_cache.gather(layer, flat_slots, q.dtype)
    keys = keys.view(gathered_shape).transpose(1, 2)  # [B, KV, ctx, D]
    values = values.view(gathered_shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=group.mask)
    return out.reshape(num_seqs, num_heads, head_dim)
