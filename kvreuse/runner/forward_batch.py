"""ForwardBatch: everything the model runner needs for one engine step, passed explicitly.

The scheduler decides *which* tokens of *which* requests run; the engine turns that decision into
this flat description. Sequences are concatenated: sequence i owns tokens
``[query_start[i], query_start[i] + query_lens[i])`` of ``input_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from kvreuse.lora.batch import LoRABatch


class BlockCopy(NamedTuple):
    """Copy the KV of the first ``num_tokens`` slots of ``src_block`` into ``dst_block``.

    This is how a prefix hit that ends inside a cached block is reused token by token: the shared
    block cannot be written by the new request, so the matching tokens are copied into its own block.
    """

    src_block: int
    dst_block: int
    num_tokens: int


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
    lora: LoRABatch | None = None  # adapters of this step and their token rows (None: base model only)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
