"""TritonPagedAttention: the CUDA attention backend, Triton kernels that read K/V in place through block tables.

``TorchPagedAttention`` (the reference) gathers every context's K/V into a padded copy and calls SDPA; on a GPU
that costs a gather per layer, a mask per step and a dozen small launches. This backend attends with two
kernels from ``triton_kernels``, each of which reads the pool's blocks where they lie:

- a step whose every token is one sequence's next token (a pure decode step) runs the split-K decode kernel,
  one launch per layer whatever the context lengths (the splits are sized in the kernel from each row's own
  length), which is what lets a CUDA graph replay it (runner/decode/cuda_graphs.py);
- any other step (fresh prefills, chunks continuing cached context, decode rows mixed in) runs the prefill
  kernel once over all of the step's sequences.

New K/V are stored first by ``store_kv_rows``, which skips slot -1: a CUDA graph pads its batch with such rows.
A quantized pool's rows are rounded by ``kv_quant.quantize`` (the same function as on CPU, so the bytes and
therefore the block keys are the same) and stored with their scales; the kernels read the codes and scales.

``prepare`` builds the step's int32 tables on the host and copies them once; ``forward`` never reads a
device value, so a decode step's forward can be captured. Every layer's window, scale and sinks
(``LayerAttention``) go to the kernels as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvreuse.attention.backend import PLAIN_ATTENTION, AttentionBackend, LayerAttention
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.torch_paged import validate_batch
from kvreuse.cache.kv import KVCache
from kvreuse.cache.kv_quant import quantize


@dataclass
class TritonAttentionMetadata:
    """One step's tables, on the model's device. A CUDA graph holds one of these made of its static buffers."""

    slot_mapping: torch.Tensor  # [T] int64: each new token's slot; -1 stores nothing (graph padding)
    block_tables: torch.Tensor  # [N, max_blocks] int32, padded with block 0 (never read past a context)
    context_lens: torch.Tensor  # [N] int32: tokens of each sequence after this step, new ones included
    query_start_loc: torch.Tensor | None  # [N + 1] int32 row offsets of the sequences (None: pure decode)
    max_query_len: int
    decode_only: bool  # every token is one sequence's next token, in sequence order


def kv_code(kv_cache: KVCache) -> str:
    """What the kernels read the pool as: ``float`` or the quantized scheme's name."""
    return "float" if kv_cache.scheme is None else kv_cache.scheme.name


class TritonPagedAttention(AttentionBackend):
    """Paged attention with Triton kernels (CUDA; on CPU only under ``TRITON_INTERPRET=1``, as the tests run it)."""

    def __init__(self, validate: bool = True) -> None:
        from kvreuse.kernels import (
            triton_attention,  # imports triton: only where this backend is chosen
        )

        self.kernels = triton_attention
        self.validate = validate

    def prepare(self, batch: ForwardBatch, block_size: int) -> TritonAttentionMetadata:
        if self.validate:
            validate_batch(batch, block_size)
        if batch.listed_positions is not None:
            raise NotImplementedError("the Triton backend attends contiguous queries only; a blended prefill (chunk "
                                      "reuse, attention/blend.py) runs on the torch and native CPU backends")
        device = batch.input_ids.device
        decode_only = all(length == 1 for length in batch.query_lens)
        widths = [-(-length // block_size) for length in batch.context_lens]
        max_blocks = max(widths)
        tables = [table[:width] + [0] * (max_blocks - width) for table, width in zip(batch.block_tables, widths)]
        # One host tensor, one copy: tables, context lengths and row offsets side by side.
        starts = [0]
        for length in batch.query_lens:
            starts.append(starts[-1] + length)
        host = torch.tensor([value for row in tables for value in row] + list(batch.context_lens) + starts,
                            dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        packed = host.to(device, non_blocking=True)
        num_seqs = batch.num_seqs
        table_end = num_seqs * max_blocks
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            block_tables=packed[:table_end].view(num_seqs, max_blocks),
            context_lens=packed[table_end:table_end + num_seqs],
            query_start_loc=None if decode_only else packed[table_end + num_seqs:],
            max_query_len=max(batch.query_lens),
            decode_only=decode_only,
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: TritonAttentionMetadata,
        layer: LayerAttention = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        k_pool, v_pool, k_scales, v_scales = kv_cache.layer_pools(layer_idx)
        self.store(kv_cache, k_pool, v_pool, k_scales, v_scales, k, v, metadata.slot_mapping)
        scale = layer.scale if layer.scale is not None else q.shape[-1] ** -0.5
        common = dict(block_size=kv_cache.block_size, scale=scale, kv_code=kv_code(kv_cache), k_scales=k_scales,
                      v_scales=v_scales, sliding_window=layer.sliding_window, sinks=layer.sinks)
        if metadata.decode_only:
            return self.kernels.paged_decode_attention(q, k_pool, v_pool, metadata.block_tables,
                                                       metadata.context_lens, **common)
        return self.kernels.paged_prefill_attention(q, k_pool, v_pool, metadata.block_tables, metadata.query_start_loc,
                                                    metadata.context_lens, max_query_len=metadata.max_query_len,
                                                    **common)

    def store(self, kv_cache: KVCache, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scales: torch.Tensor | None,
              v_scales: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """The step's K/V into their slots (rounded to codes and scales first where the pool is quantized)."""
        if kv_cache.scheme is None:
            self.kernels.store_kv_rows(k_pool, k.to(k_pool.dtype), slots)
            self.kernels.store_kv_rows(v_pool, v.to(v_pool.dtype), slots)
            return
        assert k_scales is not None and v_scales is not None
        for pool, scales, values in ((k_pool, k_scales, k), (v_pool, v_scales, v)):
            codes, value_scales = quantize(values, kv_cache.scheme)
            self.kernels.store_kv_rows(pool, codes, slots)
            self.kernels.store_kv_rows(scales, value_scales, slots)
