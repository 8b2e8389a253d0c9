"""ModelRunner: executes one engine step (a ``ForwardBatch``) on the model and returns logits.

The engine decides what runs; the runner owns how: it moves the batch to the model's device,
performs the step's block copies (token-granular prefix reuse) before any layer reads the cache,
builds the attention metadata once for all layers, runs the model without autograd, and projects
only the sampled rows to the vocabulary. Keeping these steps here means the model stays a pure
function of (tokens, positions, cache, metadata) and the engine never touches a tensor it does not own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import NamedTuple

import torch

from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.blend import Narrowing, narrow_batch, select_rows
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.rope_shift import move_kv
from kvreuse.cache.kv import KVCache
from kvreuse.models.config import ModelConfig
from kvreuse.models.llama import LlamaFamilyForCausalLM
from kvreuse.runner.decode.paths import CUDA_GRAPHS, DecodePaths
from kvreuse.runner.host_allocator import keep_activations_in_heap
from kvreuse.runner.huge_pages import (
    HugePageReport,
    back_weights_with_huge_pages,
    log_weight_pages,
)
from kvreuse.runner.step_threads import StepThreads

logger = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    logits: torch.Tensor  # float32 [len(logits_indices), vocab]
    hidden: torch.Tensor  # final hidden states of every token of the step [num_tokens, hidden]
    aux_hidden: list[torch.Tensor]  # residual streams entering the requested layers, [num_tokens, hidden] each


class ModelRunner:
    def __init__(
        self,
        model: LlamaFamilyForCausalLM,
        model_config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device | str,
        attention_backend: AttentionBackend | None = None,
        max_num_seqs: int = 64,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        batch_invariant: bool = False,
    ) -> None:
        # More KV layers than the model's: a draft model keeps its K/V in the extra ones.
        if kv_cache.num_layers < model_config.num_kv_layers:
            raise ValueError(
                f"kv_cache has {kv_cache.num_layers} layers, the model has {model_config.num_kv_layers} attention layers"
            )
        if (kv_cache.num_kv_heads, kv_cache.head_dim) != (model_config.num_key_value_heads, model_config.head_dim):
            raise ValueError(
                f"kv_cache is shaped for {kv_cache.num_kv_heads} kv heads of {kv_cache.head_dim}, the model "
                f"has {model_config.num_key_value_heads} of {model_config.head_dim}"
            )
        self.model = model
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        if attention_backend is not None:
            model.set_attention_backend(attention_backend)
        # Whether this process's malloc now keeps large CPU activations in the heap (host_allocator.py).
        self.activations_in_heap = False
        # How much of the weights' memory is on 2 MiB pages (CPU; runner/huge_pages.py).
        self.weight_pages = HugePageReport(reason=f"not on {self.device.type}")
        if self.device.type == "cpu":
            model.choose_cpu_kernels(batch_invariant=batch_invariant)
            self.activations_in_heap = keep_activations_in_heap()
            # After the kernels chose their layouts: the weights are final (huge_pages.py).
            self.weight_pages = back_weights_with_huge_pages(model.weight_tensors())
            log_weight_pages(self.weight_pages)
        self.attention_backend = model.attention_backend
        self._metadata_seconds = 0.0  # the current step's attention metadata build (engine overhead, not forward)
        # Seconds spent in the model's forward and logits, the rest of a step being engine overhead.
        # Exact on CPU (synchronous); on CUDA it is launch time unless something synchronizes.
        self.last_forward_seconds = 0.0
        # Set by a server sharing the CPU with its event loop (LLMEngine.share_cpu_with_event_loop).
        self.step_threads: StepThreads | None = None
        # The decode paths beside the Python layers (the native CPU step, CUDA graphs) and the choice between them.
        self.decode = DecodePaths(model, kv_cache, self.device, self.attention_backend, max_num_seqs,
                                  max_model_len or model_config.max_position_embeddings, enforce_eager)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; returns float32 logits [len(logits_indices), vocab], one row per sampled token.

        That is one row per sequence whose prompt is complete after this step (a prefill chunk
        that stops mid-prompt has no row; a verified draft has one row per drafted position), in
        ``logits_indices`` order.
        """
        return self.run(batch).logits

    def run(self, batch: ForwardBatch, aux_layers: tuple[int, ...] = ()) -> StepOutput:
        """``execute`` that also returns every token's final hidden state and the residual streams
        entering ``aux_layers`` (what a speculative draft reads)."""
        if batch.num_tokens == 0:
            raise ValueError("a ForwardBatch must contain at least one token")
        # Positions run up to context_len - 1; checked on the host lists, so no device sync.
        longest = max(batch.context_lens)
        if longest > self.model_config.max_position_embeddings:
            raise ValueError(
                f"context length {longest} exceeds max_position_embeddings "
                f"{self.model_config.max_position_embeddings}"
            )
        policy = self.step_threads if self.device.type == "cpu" else None
        threads = None
        if policy is not None:
            # Per thread in OpenMP (the calling thread's team size), so only the engine thread is affected.
            threads = policy.for_step(batch.num_tokens, longest)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        batch = self._to_device(batch)
        self.kv_cache.copy_blocks(batch.block_copies)
        if batch.state_copies:
            assert self.kv_cache.states is not None, "state copies for a pool without states"
            self.kv_cache.states.apply(batch.state_copies)
        aux: list[torch.Tensor] = []
        self._metadata_seconds = 0.0
        start = time.perf_counter()
        with torch.inference_mode():
            choice = self.decode.choose(batch, aux_layers, self.model.dtype, lambda: self._prepare(batch, aux_layers))
            if choice.path == CUDA_GRAPHS:
                hidden, logits = self.decode.cuda_graphs(batch)
            else:
                # The native step finds what LFM2's conv layers read itself; a model with states passes their slots.
                recurrent = (None if choice.native is not None and self.kv_cache.states is None
                             else self.model.recurrent_inputs(batch, self.kv_cache))
                hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, choice.metadata, batch.lora,
                                    aux_layers, aux, choice.narrowing, choice.native, recurrent)
                rows = choice.narrowed[0].logits_indices if choice.narrowed else batch.logits_indices
                logits = self.model.compute_logits(hidden.index_select(0, rows))
        # The forward and logits only: the attention metadata is engine overhead, as before the decode paths.
        self.last_forward_seconds = time.perf_counter() - start - self._metadata_seconds
        if policy is not None and threads is not None:
            policy.record(batch.num_tokens, threads, self.last_forward_seconds, longest)
        return StepOutput(logits, hidden, aux)

    def _prepare(self, batch: ForwardBatch, aux_layers: tuple[int, ...]
                 ) -> tuple[object, Narrowing | None, list[ForwardBatch]]:
        """What the layers and the native step run on: the step's attention metadata (timed apart), then the
        blend's moves and narrowing."""
        start = time.perf_counter()
        metadata = self.attention_backend.prepare(batch, self.kv_cache.block_size)
        self._metadata_seconds = time.perf_counter() - start
        return (metadata, *self._blend(batch, aux_layers))

    def _blend(self, batch: ForwardBatch, aux_layers: tuple[int, ...]) -> tuple[Narrowing | None, list[ForwardBatch]]:
        """Move the step's moved K/V into place (turned to its new positions) and, for a blend, the narrowing the
        forward applies after the check layer; the list receives the narrowed batch once the forward made it."""
        narrowed: list[ForwardBatch] = []
        plan = batch.blend
        if batch.moves is not None:
            capture = plan.check_layer if plan is not None and plan.recompute_fraction > 0 else -1
            # The check layers and those before them run every row, so the moves start at the check layer.
            reference = move_kv(self.model.rotary_tables(), self.kv_cache, batch.moves.src, batch.moves.dst,
                                batch.moves.deltas, capture, first_layer=max(capture, 0))
            if plan is not None:
                plan.reference = reference
        if plan is None:
            return None, narrowed
        if aux_layers:
            raise NotImplementedError("a blended prefill returns the kept rows' hidden states only; speculative "
                                      "decoding with chunk reuse is not implemented")

        def apply() -> tuple[torch.Tensor, ForwardBatch, object]:
            keep = select_rows(plan, batch, self.kv_cache)
            narrowed.append(narrow_batch(batch, keep))
            return keep, narrowed[0], self.attention_backend.prepare(narrowed[0], self.kv_cache.block_size)

        return Narrowing(plan.narrow_before, apply), narrowed

    def _to_device(self, batch: ForwardBatch) -> ForwardBatch:
        if batch.input_ids.device == self.device and batch.slot_mapping.device == self.device:
            if batch.positions.device == self.device and batch.logits_indices.device == self.device:
                return batch
        non_blocking = self.device.type == "cuda"
        return replace(
            batch,
            input_ids=batch.input_ids.to(self.device, non_blocking=non_blocking),
            positions=batch.positions.to(self.device, non_blocking=non_blocking),
            slot_mapping=batch.slot_mapping.to(self.device, non_blocking=non_blocking),
            logits_indices=batch.logits_indices.to(self.device, non_blocking=non_blocking),
        )
