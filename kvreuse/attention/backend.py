"""The attention backend interface: what the model's attention layers call, and nothing more.

A backend turns a ``ForwardBatch`` into per-step metadata once (``prepare``) and then serves every
layer (``forward``): store the step's new K/V in their slots, then attend each sequence's queries over
its context as found through its block table. The interface sits below the model code (the model
calls it) and above the KV tensors it writes into; a GPU kernel (FlashAttention / FlashInfer style)
can replace ``TorchPagedAttention`` without touching the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache


class AttentionBackend(ABC):
    """What the model's attention layers call. ``prepare`` once per step, ``forward`` per layer."""

    @abstractmethod
    def prepare(self, batch: ForwardBatch, block_size: int) -> Any:
        """Build the step's metadata (index tensors, masks) from the batch."""

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> attention output [T, heads, head_dim].

        Also writes k and v into ``kv_cache`` at the step's slots.
        """
