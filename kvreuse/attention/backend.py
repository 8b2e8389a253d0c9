"""The attention backend interface: what the model's attention layers call, and nothing more.

A backend turns a ``ForwardBatch`` into per-step metadata once (``prepare``) and then serves every
layer (``forward``): store the step's new K/V in their slots, then attend each sequence's queries over
its context as found through its block table. The interface sits below the model code (the model
calls it) and above the KV tensors it writes into; a GPU kernel (FlashAttention / FlashInfer style)
can replace ``TorchPagedAttention`` without touching the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """What one layer's attention differs in from plain causal softmax(q k^T / sqrt(head_dim)) v.

    Passed by the layer on every call (vLLM's Attention layer holds the same three), so one backend and one
    step's metadata serve models whose layers differ: Gemma 3's five local layers to one global, gpt-oss's
    alternating windows with learned sinks.
    """

    sliding_window: int | None = None  # a query at position p sees keys p - sliding_window + 1 .. p (HF's rule)
    scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    sinks: torch.Tensor | None = None  # [heads] float32: a logit per head added to the softmax's denominator only

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.sinks is not None and (self.sinks.dim() != 1 or self.sinks.dtype != torch.float32):
            raise ValueError(f"sinks must be a float32 vector [heads], got {self.sinks.dtype} {tuple(self.sinks.shape)}")

    @property
    def is_plain(self) -> bool:
        return self.sliding_window is None and self.scale is None and self.sinks is None


PLAIN_ATTENTION = LayerAttention()


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
        layer: LayerAttention = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> attention output [T, heads, head_dim].

        Also writes k and v into ``kv_cache`` at the step's slots. ``layer``: this layer's window, scale and
        sinks. The cache keeps every token's K/V in every layer (a windowed layer's old keys included), so a
        prefix hit of any length finds what each layer needs.
        """
