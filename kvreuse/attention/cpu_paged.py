"""Paged attention in place on CPU (csrc/paged_attention.cpp), loaded as ``torch.ops.kvreuse_attn``.

``TorchPagedAttention`` (kvreuse/attention/torch_paged.py) gathers every context a step attends over out
of the paged pool and hands the copy to SDPA: for a decode row after a 4,000-token context that is a 4,000
x kv_heads x head_dim copy per layer per token, plus a dequantizing one on a quantized pool. The kernel
here reads each K/V row through the block table where it lies, converts it (bfloat16, float16, or one-byte
codes times their scale) as it is read, and runs an online softmax split over the context
(flash-decoding), with the query heads of a KV head folded into one tile. It serves:

- decode rows (one query per sequence) and prefill chunks that continue cached context (a warm
  request's suffix after a prefix hit): one call per layer for all of them;
- not a sequence with no cached context: it attends over its own new K/V with SDPA's causal kernel,
  as in the reference (no pool read at all, and a GEMM-shaped call this loop does not beat).

Layers that are not plain (``LayerAttention``) run here too. A sliding window W (``window``; 0: none) gives a
row at position p the keys max(0, p - W + 1) .. p: each tile's items start at its first query's window start,
so the blocks before it are never read (a decode row after 4,000 tokens under a 512-key window reads 512
keys), and rows whose windows start later (a chunk's later queries) mask their first keys. The softmax scale
comes from the layer. Learned sinks (gpt-oss: ``sinks`` [heads] float32) join the softmax once per row, after
the partitions are merged, as one more term of its denominator. The native decode step (native_step.py)
still serves plain layers only.

``NativePagedAttention`` is the ``AttentionBackend`` that runs it; it is what a CPU engine runs when the
kernel builds (``paged_attention_backend``), and ``TorchPagedAttention`` stays the reference (and the
CUDA path). Built and cached like the other kernels (kernels/rowdot.py: ``-march=native``, named by a
digest of source, flags, torch and CPU). The kernel equals the reference within float summation error
(tests/test_paged_attention.py: block sizes, ragged and mid-block contexts, copied partial blocks,
preemption, GQA ratios, head_dim 64 and 128, every KV dtype, windows and sinks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvreuse.attention.backend import PLAIN_ATTENTION, AttentionBackend, LayerAttention
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.torch_paged import (
    ContextChunk,
    PrefillMasks,
    attend_chunk,
    causal_self_attention,
    context_chunk,
    self_attention,
    validate_batch,
)
from kvreuse.cache.kv import KVCache
from kvreuse.kernels.paged_attention import (
    Q_DTYPES,
    SCHEME_INDEX,
    PagedRows,
    available,
    paged_rows,
)

# A chunk over cached context of more queries than this gathers its context and runs SDPA: past about 8
# queries SDPA's GEMM-shaped product outruns this kernel's per-row loops, and the copy is shared by all the
# chunk's queries (measured on a 2-core AVX2 EPYC, 9 heads over 3 KV heads of 64, 2,048-token context:
# 2 queries 7-10x faster in place, 4 about 1.3x, 8 even, 16 and more slower). Decode rows and verified
# drafts (a few queries) stay in place.
MAX_PAGED_QUERIES = 8
# Batch-invariant mode: every row, of any step, through the kernel, its keys cut into partitions of this many
# from key 0 (the kernel's own choice depends on the step's total keys and the thread count), so a row's
# reduction order is the same whether it came in a cold prefill, a chunk, a warm suffix or a decode step.
INVARIANT_PARTITION = 256


@dataclass
class NativeAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is stored
    fresh_prefills: list[tuple[int, int]]  # (token_start, token_end) of sequences with no cached context
    paged: PagedRows | None  # decode rows and short chunks over cached context: the kernel's
    context_chunks: list[ContextChunk]  # longer chunks over cached context: gathered, then SDPA
    covers_whole_batch: bool  # a single fresh prefill spans every token
    paged_covers_whole_batch: bool  # every token is the kernel's
    prefill_masks: PrefillMasks = field(default_factory=PrefillMasks)  # windowed layers' fresh prefill masks


def paged_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: KVCache, layer: int, rows: PagedRows,
                    partition_size: int = 0, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    attention: LayerAttention = PLAIN_ATTENTION) -> None:
    """Fill ``out`` [T, heads, head_dim] (contiguous) at the rows of ``rows``' sequences with their queries'
    attention over their paged context in ``kv_cache``'s ``layer``. ``q`` may be a view whose tokens are
    rows of the fused q|k|v product. The step's K/V must be in the pool first: written before the call, or
    handed in as ``new_kv`` = (k, v, slot_mapping) for the kernel to store first (a pool in the model's
    dtype only). ``partition_size`` 0: the kernel splits long contexts to keep every thread busy; a positive
    value forces a split length (tests). ``attention``: the layer's window, scale and sinks."""
    k_pool, v_pool, k_scales, v_scales = kv_cache.layer_pools(layer)
    scheme = SCHEME_INDEX[kv_cache.scheme.name if kv_cache.scheme is not None else None]
    k_new, v_new, slots = new_kv if new_kv is not None else (None, None, None)
    scale = attention.scale if attention.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    torch.ops.kvreuse_attn.paged_attention(
        out, q, k_pool, v_pool, k_scales, v_scales, rows.block_tables, rows.query_start, rows.query_lens,
        rows.context_lens, kv_cache.block_size, scheme, scale, attention.sliding_window or 0, attention.sinks,
        partition_size, k_new, v_new, slots)


class NativePagedAttention(AttentionBackend):
    """Paged attention on the C++ kernel (CPU): decode rows and chunks over cached context read the pool in
    place; sequences with no cached context use SDPA's causal kernel. ``available()`` must be True."""

    def __init__(self, validate: bool = True, max_paged_queries: int = MAX_PAGED_QUERIES,
                 batch_invariant: bool = False) -> None:
        if not available():
            raise RuntimeError("the paged attention kernel could not be built on this machine (see the log); "
                               "use TorchPagedAttention")
        self.validate = validate
        self.max_paged_queries = max_paged_queries  # longer chunks over cached context gather (tests: any)
        # Batch-invariant: fresh prefills and chunks of any length in the kernel too (never SDPA, whose tiles
        # follow the query count), over fixed partitions; a row's bits then depend on its own keys only.
        self.batch_invariant = batch_invariant
        self.partition_size = INVARIANT_PARTITION if batch_invariant else 0

    def prepare(self, batch: ForwardBatch, block_size: int) -> NativeAttentionMetadata:
        if self.validate:
            validate_batch(batch, block_size)
        fresh: list[tuple[int, int]] = []
        chunks: list[ContextChunk] = []
        paged_lens: list[int] = []
        paged_contexts: list[int] = []
        paged_tables: list[list[int]] = []
        paged_starts: list[int] = []
        token_start = 0
        listed = batch.listed_positions or [None] * batch.num_seqs
        for query_len, context_len, table, positions in zip(batch.query_lens, batch.context_lens,
                                                            batch.block_tables, listed):
            if positions is not None:  # a blend's kept rows: the kernel reads contiguous queries only
                chunks.append(context_chunk(token_start, query_len, context_len, table, block_size,
                                            batch.input_ids.device, positions))
            elif self.batch_invariant:
                paged_lens.append(query_len)
                paged_contexts.append(context_len)
                paged_tables.append(table)
                paged_starts.append(token_start)
            elif context_len == query_len:
                fresh.append((token_start, token_start + query_len))
            elif query_len > self.max_paged_queries:
                chunks.append(context_chunk(token_start, query_len, context_len, table, block_size,
                                            batch.input_ids.device))
            else:
                paged_lens.append(query_len)
                paged_contexts.append(context_len)
                paged_tables.append(table)
                paged_starts.append(token_start)
            token_start += query_len
        paged = (paged_rows(paged_lens, paged_contexts, paged_tables, paged_starts, block_size)
                 if paged_lens else None)
        return NativeAttentionMetadata(
            slot_mapping=batch.slot_mapping, fresh_prefills=fresh, paged=paged, context_chunks=chunks,
            covers_whole_batch=len(fresh) == 1 and paged is None and not chunks,
            paged_covers_whole_batch=not fresh and not chunks,
        )

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: NativeAttentionMetadata, layer: LayerAttention = PLAIN_ATTENTION) -> torch.Tensor:
        if (metadata.paged_covers_whole_batch and kv_cache.scheme is None and k.dtype == kv_cache.storage_dtype
                and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]):
            # A step of decode rows and short chunks (the common one): the kernel stores the new K/V and
            # attends in one call, reading q where the q|k|v product left it.
            out = q.new_empty(q.shape)
            paged_attention(out, q, kv_cache, layer_idx, metadata.paged, self.partition_size,
                            new_kv=(k, v, metadata.slot_mapping), attention=layer)
            return out
        kv_cache.write(layer_idx, metadata.slot_mapping, k, v)
        plain = layer.is_plain
        if metadata.covers_whole_batch:
            return causal_self_attention(q, k, v) if plain else self_attention(q, k, v, layer, metadata.prefill_masks)
        out = q.new_empty(q.shape)
        for start, end in metadata.fresh_prefills:
            out[start:end] = (causal_self_attention(q[start:end], k[start:end], v[start:end]) if plain else
                              self_attention(q[start:end], k[start:end], v[start:end], layer, metadata.prefill_masks))
        for chunk in metadata.context_chunks:
            out[chunk.token_start:chunk.token_end] = attend_chunk(q, kv_cache, layer_idx, chunk, layer)
        if metadata.paged is not None:
            paged_attention(out, q if q.stride(1) == q.shape[2] else q.contiguous(), kv_cache, layer_idx,
                            metadata.paged, self.partition_size, attention=layer)
        return out


def paged_attention_backend(device: torch.device, dtype: torch.dtype,
                            batch_invariant: bool = False) -> AttentionBackend | None:
    """The in-place kernel's backend where it runs (CPU, a dtype it reads, the kernel built); None otherwise
    (the model keeps ``TorchPagedAttention``)."""
    if device.type != "cpu" or dtype not in Q_DTYPES or not available():
        return None
    return NativePagedAttention(batch_invariant=batch_invariant)
