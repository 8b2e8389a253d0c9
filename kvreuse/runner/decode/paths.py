"""Which decode path serves a step: the one place that decides it, and counts what it decided.

Three paths compute a step, each equal to the first (the tests hold each to it):

- ``layers``: the model's Python layers op by op, every kernel the plan book chose (the reference; every step
  no other path takes: prefills, chunks, LoRA rows, quantized KV pools, narrowed blends, ...);
- ``native_step``: on CPU, a step whose every token is the paged kernel's (decode rows, short chunks over cached
  context) over a float pool without LoRA rows runs all its decoder layers in one C++ call (native_step.py);
- ``cuda_graphs``: on CUDA with the Triton backend, a pure decode step replays the graph captured for its padded
  batch size (cuda_graphs.py), with no attention metadata built at all.

CUDA graphs are asked first because they need no metadata; the native step is asked after the metadata and the
blend's narrowing exist, since both decide whether it covers the step. ``KVREUSE_NATIVE_STEP=0`` turns the
native step off (benchmarks/bench_gguf.py's op-by-op system measures it that way) and ``enforce_eager`` the graphs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.blend import Narrowing
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache
from kvreuse.models.llama import LlamaFamilyForCausalLM
from kvreuse.runner.decode import native_step
from kvreuse.runner.decode.cuda_graphs import CudaGraphDecode, why_no_graphs

logger = logging.getLogger(__name__)

LAYERS, NATIVE_STEP, CUDA_GRAPHS = "layers", "native_step", "cuda_graphs"


@dataclass
class DecodeChoice:
    """The path for one step, with what it runs on: the graphs need nothing more; the other two the step's
    attention metadata and the blend's narrowing (prepared for them); ``native`` is the native step's held
    layers for this step's row count (None on the other paths)."""

    path: str
    metadata: Any = None
    narrowing: Narrowing | None = None
    narrowed: list[ForwardBatch] | None = None
    native: native_step.HeldLayers | None = None


class DecodePaths:
    """The decode paths an engine's runner can take, built once at engine start, and ``choose``."""

    def __init__(self, model: LlamaFamilyForCausalLM, kv_cache: KVCache, device: torch.device,
                 attention_backend: AttentionBackend, max_num_seqs: int, max_model_len: int,
                 enforce_eager: bool) -> None:
        self.kv_cache = kv_cache
        self.native_step = native_step.for_model(model, device)
        self.cuda_graphs: CudaGraphDecode | None = None
        self.no_graphs_reason = why_no_graphs(model, device, attention_backend, enforce_eager)
        if self.no_graphs_reason is None:
            self.cuda_graphs = CudaGraphDecode(model, kv_cache, device, max_num_seqs, max_model_len)
            seconds = self.cuda_graphs.capture()
            logger.info("CUDA graphs: decode batch sizes %s captured in %.1f s, %.1f MiB; eager: prefill, chunks over "
                        "cached context, mixed steps, LoRA rows, speculative steps", self.cuda_graphs.sizes,
                        seconds, self.cuda_graphs.memory_bytes / 2**20)
        elif device.type == "cuda":
            logger.info("CUDA graphs: off (%s); every step runs eagerly", self.no_graphs_reason)
        self.steps: Counter[str] = Counter()  # steps per path since start (tests and benchmarks read it)

    def choose(self, batch: ForwardBatch, aux_layers: tuple[int, ...], dtype: torch.dtype,
               prepare: Callable[[], tuple[Any, Narrowing | None, list[ForwardBatch]]]) -> DecodeChoice:
        """The path for ``batch`` (already on the device). ``prepare`` builds the attention metadata and runs the
        blend's moves (returning the narrowing); it is called unless the graphs take the step, which need neither."""
        if self.cuda_graphs is not None and self.cuda_graphs.applies(batch, aux_layers):
            choice = DecodeChoice(CUDA_GRAPHS)
        else:
            metadata, narrowing, narrowed = prepare()
            native = None
            if self.native_step is not None and narrowing is None:
                native = self.native_step.layers_for(batch.num_tokens, dtype, self.kv_cache, metadata, batch.lora)
            choice = DecodeChoice(NATIVE_STEP if native is not None else LAYERS, metadata, narrowing, narrowed, native)
        self.steps[choice.path] += 1
        return choice
