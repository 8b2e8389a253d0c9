"""CUDA graphs for pure decode steps: one captured forward per padded batch size, replayed each step.

On a GPU a decode step of a small model is bound by launches, not by the GPU: ~740 kernels a step, each paying
PyTorch's and the driver's per-launch cost, while the GPU works ~2 ms of a ~10 ms step (docs/benchmarks.md).
A CUDA graph records the step's launches once and replays them with one call, as vLLM and SGLang do.

What a graph needs is a step whose shapes and pointers never change, so:
- Batch sizes are padded to 1, 2, 4, 8, 16, 32, ... up to ``max_num_seqs`` (and ``max_num_seqs`` itself): one
  graph each. A step of 5 sequences replays the graph of 8; rows 5..7 store nothing (slot -1, which the Triton
  store kernel skips) and attend over nothing (context length 0).
- The inputs live in static buffers: token ids, positions, slots, block tables (``max_model_len /
  block_size`` blocks wide), context lengths. A step copies its values in (device to device for the ids,
  positions and slots the input builder already moved; one pinned host copy for the tables) and replays.
- Attention must not read a device value on the host or size a launch from one: the Triton backend's decode
  kernel sizes its split-K work inside the kernel from each row's context length (attention/triton_paged.py).
- The graphs share one memory pool, captured largest first so that smaller ones reuse its blocks.

What runs eagerly, as before: prefill and chunks over cached context (their shapes vary with every prompt and
they are GEMM-bound), mixed steps, LoRA rows, speculative steps (their verify rows are several per
sequence) and steps asking for hidden states of inner layers; mixture-of-experts models entirely (their
routing groups rows by expert on the host). ``enforce_eager`` (vLLM's name) turns the graphs off.

The graphs run the same kernels as the eager step on the same inputs, so greedy output equals eager's
(tests/test_cuda.py, on a GPU). The K/V they write are the eager step's bytes: block keys do not change.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.triton_paged import TritonAttentionMetadata, TritonPagedAttention

if TYPE_CHECKING:
    from kvreuse.cache.kv import KVCache
    from kvreuse.models.llama import LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below ``max_num_seqs``, then ``max_num_seqs``: the padded batch sizes that get a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = [1 << power for power in range(max(1, max_num_seqs).bit_length()) if 1 << power < max_num_seqs]
    return sizes + [max_num_seqs]


def why_no_graphs(model: LlamaFamilyForCausalLM, device: torch.device, backend: object, enforce_eager: bool) -> str | None:
    """Why decode steps run eagerly on this engine, or None when they are captured."""
    if enforce_eager:
        return "enforce_eager"
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, this engine runs on {device}"
    if not isinstance(backend, TritonPagedAttention):
        return "CUDA graphs need the triton attention backend (the torch backend sizes its gathers on the host)"
    if model.config.moe is not None:
        return "a mixture-of-experts model groups its rows by expert on the host"
    if model.config.is_hybrid:
        return "a hybrid model's conv layers read their taps through indices built on the host each step"
    return None


class CudaGraphDecode:
    """Pure decode steps of ``model`` replayed from captured graphs (``capture`` once, then call per step)."""

    def __init__(self, model: LlamaFamilyForCausalLM, kv_cache: KVCache, device: torch.device, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size = kv_cache.block_size
        self.max_blocks = math.ceil(max_model_len / kv_cache.block_size)
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((largest, self.max_blocks), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.memory_bytes = 0  # what the graphs' pool holds after capture
        self.replays = 0  # decode steps replayed (tests and the benchmark read it)

    def _metadata(self, size: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                       context_lens=self.context_lens[:size], query_start_loc=None, max_query_len=1,
                                       decode_only=True)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self._metadata(size))
        return hidden, self.model.compute_logits(hidden)

    def capture(self) -> float:
        """Capture every size's graph (largest first, one shared pool); returns the seconds it took. Rows hold
        slot -1 and context 0 meanwhile, so neither the warm-up runs nor the capture touch the KV pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                # Warm up on a side stream (Triton compiles its kernels, cuBLAS picks algorithms), as
                # torch.cuda.graphs' own helpers do, so that the capture records launches only.
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._forward(size)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden, logits = self._forward(size)
                self.graphs[size] = (graph, hidden, logits)
        torch.cuda.synchronize(self.device)
        self.memory_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        return time.perf_counter() - start

    def applies(self, batch: ForwardBatch, aux_layers: tuple[int, ...]) -> bool:
        """Whether a captured graph can run this step."""
        return (bool(self.graphs) and batch.lora is None and not aux_layers and batch.num_seqs <= self.sizes[-1]
                and batch.num_tokens == batch.num_seqs and all(length == 1 for length in batch.query_lens)
                and max(batch.context_lens) <= self.max_blocks * self.block_size)

    def __call__(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [B, hidden], float32 logits of ``batch.logits_indices``) of a pure decode step,
        from the graph of the smallest captured size that holds it."""
        count = batch.num_seqs
        size = next(size for size in self.sizes if size >= count)
        graph, hidden, logits = self.graphs[size]
        width = max(-(-length // self.block_size) for length in batch.context_lens)
        # The tables of the step (only the blocks its contexts use: the kernel reads no further) and the context
        # lengths, padded to the graph's size with zeros: one pinned host tensor, two copies.
        host = torch.zeros(count * width + size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host[: count * width].view(count, width).copy_(torch.tensor(
            [table[:width] + [0] * (width - len(table[:width])) for table in batch.block_tables], dtype=torch.int32))
        host[count * width: count * width + count] = torch.tensor(batch.context_lens, dtype=torch.int32)
        self.block_tables[:count, :width].copy_(host[: count * width].view(count, width), non_blocking=True)
        self.context_lens[:size].copy_(host[count * width:], non_blocking=True)
        self.input_ids[:count].copy_(batch.input_ids, non_blocking=True)
        self.positions[:count].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:count].copy_(batch.slot_mapping, non_blocking=True)
        if size > count:
            self.slot_mapping[count:size].fill_(-1)  # padding rows store nothing
        graph.replay()
        self.replays += 1
        # Copies: the graph's own outputs are overwritten by the next replay.
        return hidden[:count].clone(), logits.index_select(0, batch.logits_indices)


def estimate_graph_memory(model: LlamaFamilyForCausalLM, kv_cache: KVCache, device: torch.device,
                          max_num_seqs: int) -> int:
    """Bytes the graphs' pool will hold, measured before the KV pool is sized: the peak of one eager decode step
    of the largest padded batch (``kv_cache``: a one-block scratch pool of the real layout; every row stores
    nothing and attends over nothing). The graphs share one pool captured largest first, so the largest step's
    activations are what it keeps."""
    size = graph_batch_sizes(max_num_seqs)[-1]
    metadata = TritonAttentionMetadata(
        slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((size, 1), dtype=torch.int32, device=device),
        context_lens=torch.zeros(size, dtype=torch.int32, device=device), query_start_loc=None, max_query_len=1,
        decode_only=True)
    ids = torch.zeros(size, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        hidden = model(ids, ids, kv_cache, metadata)
        model.compute_logits(hidden)
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)
