"""ForwardBatch: everything the model runner needs for one engine step, passed explicitly.

The scheduler decides *which* tokens of *which* requests run; the runner's input builder
(``kvreuse.runner.input_batch``) turns that decision into this flat description, which the model and
the attention backend read. Sequences are concatenated: sequence i owns tokens
``[query_start[i], query_start[i] + query_lens[i])`` of ``input_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvreuse.cache.blocks import BlockCopy
from kvreuse.cache.state_slots import StateCopy


class ProjectionDeltas(Protocol):
    """What a step adds to its projections' outputs, row by row: ``kvreuse.lora.batch.LoRABatch`` (each
    adapter's delta on its token rows). The model calls ``apply`` after every adaptable projection; it
    knows nothing else of adapters, so the model code sits below the LoRA package."""

    def apply(self, linear: Any, x: torch.Tensor, out: torch.Tensor) -> None: ...

    def narrowed(self, keep: torch.Tensor, num_tokens: int) -> ProjectionDeltas: ...  # the same, for rows ``keep``


@dataclass
class KVMoves:
    """K/V to copy within the pool before the forward: slot ``src[i]`` to ``dst[i]``, K turned by ``deltas[i]``
    positions."""

    src: torch.Tensor  # [M] int64
    dst: torch.Tensor  # [M] int64
    deltas: torch.Tensor  # [M] int64


@dataclass
class BlendPlan:
    """The moved rows of a step, grouped by sequence, and how many of them to recompute."""

    moved_rows: torch.Tensor  # [M] rows of the step's tokens whose K/V ``KVMoves`` writes (in the same order)
    segments: list[tuple[int, int]]  # per blended sequence: (first index into moved_rows, count)
    check_layer: int  # select after this layer; -1: before layer 0 (no moved row kept)
    recompute_fraction: float  # of each sequence's moved rows, the share kept by deviation
    # The moved K and V at check_layer, float32 [M, kv_heads, head_dim] (set when the moves run).
    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    recomputed: list[int] = field(default_factory=list)  # per segment, moved rows kept (set by narrow)

    @property
    def narrow_before(self) -> int:
        """The index of the first layer that runs the narrowed rows."""
        return self.check_layer + 1


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64: new tokens of every sequence, concatenated
    positions: torch.Tensor  # [num_tokens] int64: absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot = block_id * block_size + offset
    query_lens: list[int]  # new tokens per sequence; sum == num_tokens
    context_lens: list[int]  # tokens of context per sequence *after* this step (cached + new)
    block_tables: list[list[int]]  # block ids per sequence, covering context_lens[i] tokens
    logits_indices: torch.Tensor  # [num_seqs] int64: row of the token whose logits are sampled
    block_copies: list[BlockCopy] = field(default_factory=list)  # done before the forward
    lora: ProjectionDeltas | None = None  # adapters of this step and their token rows (None: base model only)
    # Issue 39 (attention/blend.py). Per sequence, the positions of its rows when they are not the last
    # query_lens[i] positions of its context (a blend kept only some rows); None: every sequence is contiguous.
    listed_positions: list[list[int] | None] | None = None
    moves: KVMoves | None = None  # K/V moved within the pool before the forward
    blend: BlendPlan | None = None  # which moved rows the forward recomputes
    # A hybrid's per-sequence recurrent state (Qwen3.5): each sequence's slot of the state pool, and the copies between
    # slots (a snapshot into a resuming request's, ...) done before the forward; None / empty for every other model.
    state_slots: list[int] | None = None
    state_copies: list[StateCopy] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
