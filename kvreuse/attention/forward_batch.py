"""ForwardBatch: everything the model runner needs for one engine step, passed explicitly.

The scheduler decides *which* tokens of *which* requests run; the runner's input builder
(``kvreuse.runner.input_batch``) turns that decision into this flat description, which the model and
the attention backend read. Sequences are concatenated: sequence i owns tokens
``[query_start[i], query_start[i] + query_lens[i])`` of ``input_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvreuse.cache.blocks import BlockCopy

if TYPE_CHECKING:
    from kvreuse.attention.blend import BlendPlan, KVMoves


class ProjectionDeltas(Protocol):
    """What a step adds to its projections' outputs, row by row: ``kvreuse.lora.batch.LoRABatch`` (each
    adapter's delta on its token rows). The model calls ``apply`` after every adaptable projection; it
    knows nothing else of adapters, so the model code sits below the LoRA package."""

    def apply(self, linear: Any, x: torch.Tensor, out: torch.Tensor) -> None: ...

    def narrowed(self, keep: torch.Tensor, num_tokens: int) -> ProjectionDeltas: ...  # the same, for rows ``keep``


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

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
