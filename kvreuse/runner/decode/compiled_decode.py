"""The decode step under ``torch.compile`` (``enable_torch_compile``, SGLang's switch of that name).

A decode step of one stream on CPU spends ~10% of its time between the GEMVs: ~330 small ops per
step (norms, rotary, KV writes, the gather, residual adds), each paying PyTorch eager's per-op cost.
Compiling the step fuses the pointwise work and, with inductor's ``cpp_wrapper``, calls what is left
(the GEMMs, the gather, SDPA) from generated C++ instead of Python. That is where the compiled step
gains (docs/benchmarks.md has the figures); the GEMMs themselves are the same calls as eager's
(library kernels, or the row-dot GEMV, which is a C++ operator inductor calls directly).

What is compiled, and why only that:
- Only pure decode steps (every token is one sequence's next token, no LoRA, no speculative
  features): their shapes are regular, so a handful of graphs serve every step. Prefill steps are
  GEMM-bound, their shapes vary with every prompt, and they stay eager.
- Shapes: the number of sequences and the context length are dynamic (``maybe_mark_dynamic``), so
  few graphs cover decoding: one for one sequence, and one for each range of batch sizes over which
  every layer keeps its kernel (the plans of layers/plan_book.py switch kernel at some row counts);
  several sequences always attend with a padding mask, all true when their contexts are equal. ``warm_up``
  compiles them all when the engine starts, on slots of a free block, so no request waits for the
  compiler. Inductor caches the generated code on disk; a later start on the same machine and torch
  takes seconds instead of minutes.
- ``fullgraph=True``: a construct dynamo cannot trace fails the warm-up loudly rather than silently
  splitting the step into many small graphs.

The compiled step computes the same products as the eager one with fused pointwise work, so logits
agree within float tolerance and greedy tokens are equal (tests/test_compiled_decode.py). The KV it
writes belongs to the same model and weights as eager KV, so cache keys do not change.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.torch_paged import TorchAttentionMetadata

if TYPE_CHECKING:
    from kvreuse.cache.kv import KVCache
    from kvreuse.models.llama import LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)


class CompiledDecode:
    """Runs pure decode steps of ``model`` through one ``torch.compile``d forward-and-logits function."""

    def __init__(self, model: LlamaFamilyForCausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # On CPU the Python wrapper around the generated kernels costs what the compile saves; the C++
        # wrapper is the point. (On CUDA inductor's defaults apply, measured once: docs/benchmarks.md.)
        # cpp.dynamic_threads: the generated loops take the caller's thread count at run time (not the one
        # at compile time), so a server's small steps leave its event loop a core (runner/step_threads.py).
        options = {"cpp_wrapper": True, "cpp.dynamic_threads": True} if device.type == "cpu" else {}
        if device.type != "cpu":
            logger.info("enable_torch_compile on %s: inductor's defaults, no CUDA graphs (measured once, on an H200: "
                        "greedy equal to eager, one-stream decode 2.1x eager; docs/benchmarks.md)", device)
        self._compiled = torch.compile(self._forward_and_logits, fullgraph=True, dynamic=None, options=options)
        self.steps = 0  # decode steps run compiled (tests and the benchmark read it)

    def applies(self, batch: ForwardBatch, metadata: Any, aux_layers: tuple[int, ...]) -> bool:
        """Whether this step is one the compiled graphs cover."""
        return (isinstance(metadata, TorchAttentionMetadata) and metadata.decodes_cover_whole_batch
                and batch.lora is None and not aux_layers)

    def __call__(self, batch: ForwardBatch, metadata: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [B, hidden], float32 logits [B, vocab]) of a pure decode step."""
        group = metadata.decodes
        assert group is not None
        num_seqs, max_context = group.context_slots.shape
        if group.mask is None and num_seqs > 1:
            # Equal context lengths need no mask, but an all-true one lets them share the unequal
            # lengths' graph: one graph fewer to compile (a minute on 2 cores), for a mask of B x context
            # booleans per step.
            group = dataclasses.replace(group, mask=torch.ones(
                (num_seqs, 1, 1, max_context), dtype=torch.bool, device=group.context_slots.device))
            metadata = dataclasses.replace(metadata, decodes=group)
        # Declared dynamic up front, so the first step of each kind compiles the general graph rather
        # than one for its exact sizes followed by a recompile (a size of 1 stays specialised).
        for tensor in (batch.input_ids, batch.positions, batch.logits_indices, metadata.slot_mapping):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(group.context_slots, 0)
        torch._dynamo.maybe_mark_dynamic(group.context_slots, 1)
        if group.mask is not None:
            torch._dynamo.maybe_mark_dynamic(group.mask, 0)
            torch._dynamo.maybe_mark_dynamic(group.mask, 3)
        self.steps += 1
        return self._compiled(batch.input_ids, batch.positions, metadata, batch.logits_indices)

    def _forward_and_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: TorchAttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(input_ids, positions, self.kv_cache, metadata)
        return hidden, self.model.compute_logits(hidden.index_select(0, logits_indices))

    def batch_sizes(self, max_batch: int) -> list[int]:
        """The decode batch sizes that each need their own graphs: 1, and the first size of every range
        of row counts on which some layer's plan switches kernel (kernels.LinearPlan), up to
        ``max_batch``. Within a range the graph is shape-generic."""
        kernels = [module.kernel for module in self.model.modules() if getattr(module, "kernel", None) is not None]
        if self.model._tied_head_kernel is not None:
            kernels.append(self.model._tied_head_kernel)
        starts = {1, 2} | {limit + 1 for kernel in kernels for limit, _ in kernel.plan.segments}
        return sorted(size for size in starts if size <= max_batch)

    def warm_up(self, block_size: int, max_batch: int) -> float:
        """Compile the decode graphs for up to ``max_batch`` sequences now, one for each of
        ``batch_sizes`` (several sequences always run with a padding mask). The steps
        write the first few slots of the pool only, zeroed again after: at engine start every block is free.
        Returns the seconds it took."""
        start = time.perf_counter()
        device = self.kv_cache.device
        sizes = self.batch_sizes(max_batch)
        # Context lengths unlike any batch size: dynamo gives equal sizes one symbol ("duck sizing"), and
        # a graph traced with batch == context would only serve steps where they are equal.
        short = next(length for length in itertools.count(2) if length not in sizes and length + 1 not in sizes)
        long = short + 1
        table = list(range(-(-long // block_size)))  # blocks 0.. in order, so slot == position
        if len(table) > self.kv_cache.num_blocks:
            raise ValueError(f"the compile warm-up needs {len(table)} KV blocks, the pool has {self.kv_cache.num_blocks}")
        shapes = [[short]] + [[short, long] * (size // 2) + [long] * (size % 2) for size in sizes if size > 1]
        # Every shape is its own graph, and dynamo keeps the graphs of every engine in the process under
        # the one code object of _forward_and_logits: past its recompile limit (8 graphs) it would run
        # later steps eager. So each engine raises the limit by what it adds.
        torch._dynamo.config.recompile_limit += len(shapes)
        for context_lens in shapes:
            count = len(context_lens)
            last = torch.tensor([length - 1 for length in context_lens], dtype=torch.int64, device=device)
            batch = ForwardBatch(
                input_ids=torch.zeros(count, dtype=torch.int64, device=device),
                positions=last, slot_mapping=last.clone(),
                query_lens=[1] * count, context_lens=list(context_lens), block_tables=[table] * count,
                logits_indices=torch.arange(count, dtype=torch.int64, device=device),
            )
            metadata = self.model.attention_backend.prepare(batch, block_size)
            with torch.inference_mode():
                self(batch, metadata)
            self.kv_cache.kv[:, :, :long].zero_()  # back to the pool's initial zeros
        self.steps = 0
        seconds = time.perf_counter() - start
        logger.info("torch.compile: %d decode graphs (batch sizes %s up to %d) compiled in %.1f s; inductor "
                    "caches them on disk for later starts", len(shapes), sizes, max_batch, seconds)
        return seconds
