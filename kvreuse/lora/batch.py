"""Applying several adapters in one batch: rows grouped by adapter, one small matmul pair per group.

The engine puts each step's tokens in a `LoRABatch` (which adapter, which token rows); every adapted
projection then adds ``(x[rows] @ A.T) @ B.T * scaling`` to its output columns for those rows. Base
rows get nothing. Pure PyTorch, the same on CPU and CUDA; the metadata travels in the ForwardBatch,
never through a global.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvreuse.lora.adapter import LoRAAdapter


class AdaptableLinear(Protocol):
    """What LoRABatch needs of a (possibly fused) projection."""

    output_sizes: list[int]
    lora_layer: int | None  # the decoder layer it belongs to
    lora_modules: tuple[str, ...]  # PEFT's module name of each fused part, e.g. ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class LoRASegment:
    adapter: LoRAAdapter
    rows: slice | torch.Tensor | None  # token rows that use it: a contiguous run, an index, or None (all)


@dataclass(frozen=True)
class LoRABatch:
    segments: Sequence[LoRASegment]

    def narrowed(self, keep: torch.Tensor, num_tokens: int) -> LoRABatch:
        """The same adapters for the rows ``keep`` (ascending) of a step of ``num_tokens`` rows, renumbered
        (a blended prefill dropping rows after its check layer: attention/blend.py)."""
        segments = []
        for segment in self.segments:
            mine = torch.zeros(num_tokens, dtype=torch.bool, device=keep.device)
            mine[segment.rows if segment.rows is not None else slice(None)] = True
            rows = mine[keep].nonzero().squeeze(1)
            if len(rows):
                segments.append(LoRASegment(segment.adapter, None if len(rows) == len(keep) else rows))
        return LoRABatch(segments)

    def apply(self, linear: AdaptableLinear, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add every segment's adapter delta to ``out`` (= base projection of ``x``), in place."""
        if linear.lora_layer is None:
            return
        for segment in self.segments:
            adapter, rows = segment.adapter, segment.rows
            if rows is None:
                inputs = x
            elif isinstance(rows, slice):
                inputs = x[rows]
            else:
                inputs = x.index_select(0, rows)
            fused = adapter.fused(linear.lora_layer, linear.lora_modules, linear.output_sizes)
            if fused is None:
                continue
            # Two matmuls for every part of a fused projection (qkv, gate_up): the parts' A stacked, their
            # B block-diagonal (kvreuse.lora.adapter.FusedLoRA); PEFT's lora_B(lora_A(x)) * scaling.
            delta = F.linear(F.linear(inputs, fused.stacked_a), fused.expand_b)
            columns = fused.output_slice
            if rows is None:
                out[:, columns].add_(delta, alpha=adapter.scaling)
            elif isinstance(rows, slice):
                out[rows, columns].add_(delta, alpha=adapter.scaling)
            else:
                out[:, columns].index_add_(0, rows, delta, alpha=adapter.scaling)
