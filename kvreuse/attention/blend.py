"""Blending moved K/V into a prefill (issue 39): which rows a step recomputes after the check layer.

A step whose sequences read some prompt tokens' K/V from elsewhere in the pool (a chunk seen at another
position, an earlier turn's tokens moved earlier) runs those tokens' rows only as far as it must:

- K/V moved in is turned to its new position (``kvreuse.attention.rope_shift``) and written into the sequence's
  own slots before the forward; the rows are candidates to skip;
- layers ``0 .. check_layer`` run every row, so the moved tokens' K/V there is computed afresh (layer 0's K/V
  depends on the token and its position only, so it is exact either way);
- after ``check_layer``, each sequence keeps the ``recompute_fraction`` of its moved rows whose fresh K/V
  there deviates most from the moved K/V (CacheBlend's selection), plus every row that was not moved (the
  question, new documents, the first tokens of each chunk that EPIC-style recompute forces); the other moved
  rows are dropped from the batch, so later layers read their moved K/V from the pool;
- ``check_layer`` -1 drops the moved rows before layer 0: a pure shift (llama.cpp's ``--cache-reuse``), or
  EPIC alone when the first tokens of each chunk are forced.

The narrowed step is an ordinary ``ForwardBatch`` whose sequences list their rows' positions
(``listed_positions``), so the attention backends attend each kept query to every key at or before its own
position, moved keys included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvreuse.attention.forward_batch import BlendPlan, ForwardBatch
from kvreuse.cache.kv import KVCache

# The check layer when none is given: about a tenth of the model's depth. On SmolLM2-135M (30 layers), choosing
# after layer 3 rather than layer 1 took the answers shared with full prefill from 0.71x to 1.01x the float32
# noise floor at 30% recomputed, for 0.01x more TTFT (0.45x full prefill; docs/benchmarks.md, issue 39).
CHECK_LAYER_DEPTH_SHARE = 0.1


def default_check_layer(num_layers: int) -> int:
    """A tenth of ``num_layers``, rounded, and below the last layer where the model has two or more."""
    return max(0, min(round(num_layers * CHECK_LAYER_DEPTH_SHARE), num_layers - 2))


def resolved_check_layer(check_layer: int | None, num_layers: int) -> int:
    """``CacheConfig.chunk_check_layer``, its default (None) made a layer of this model."""
    return default_check_layer(num_layers) if check_layer is None else check_layer


@dataclass(frozen=True)
class BlendSettings:
    """How a step recomputes moved K/V (``CacheConfig``'s chunk_* fields)."""

    check_layer: int  # a layer of the model (resolved_check_layer)
    recompute_fraction: float = 0.3
    recompute_first: int = 0  # EPIC: the first tokens of each moved span always recomputed

    def plan(self, moved_rows: torch.Tensor, segments: list[tuple[int, int]]) -> BlendPlan:
        check_layer = self.check_layer if self.recompute_fraction > 0 else -1
        return BlendPlan(moved_rows, segments, check_layer, self.recompute_fraction)


@dataclass
class Narrowing:
    """What the model's forward calls before layer ``at_layer``: ``apply()`` returns the rows to keep, the
    narrowed batch and its attention metadata (the runner builds it: selection needs the pool)."""

    at_layer: int
    apply: Callable[[], tuple[torch.Tensor, ForwardBatch, Any]]


def deviation(kv_cache: KVCache, layer: int, slots: torch.Tensor,
              reference: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per slot, the squared distance between the K/V now at ``slots`` and ``reference``: [M] float32."""
    keys, values = kv_cache.gather(layer, slots, torch.float32)
    return (keys - reference[0]).square().sum(dim=(1, 2)) + (values - reference[1]).square().sum(dim=(1, 2))


def select_rows(plan: BlendPlan, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
    """Rows of ``batch`` to keep after ``plan.check_layer``, ascending: every row that was not moved, plus
    each sequence's most deviating moved rows. Fills ``plan.recomputed``."""
    keep = torch.ones(batch.num_tokens, dtype=torch.bool, device=batch.input_ids.device)
    keep[plan.moved_rows] = False
    scores = None
    if plan.check_layer >= 0 and plan.recompute_fraction > 0:
        assert plan.reference is not None, "the moves ran before the forward"
        scores = deviation(kv_cache, plan.check_layer, batch.slot_mapping[plan.moved_rows], plan.reference)
    plan.recomputed = []
    for first, count in plan.segments:
        chosen = min(count, math.ceil(plan.recompute_fraction * count)) if scores is not None else 0
        if chosen:
            top = torch.topk(scores[first:first + count], chosen).indices + first
            keep[plan.moved_rows[top]] = True
        plan.recomputed.append(chosen)
    return keep.nonzero().squeeze(1)


def narrow_batch(batch: ForwardBatch, keep: torch.Tensor) -> ForwardBatch:
    """``batch`` reduced to rows ``keep`` (ascending; each sequence's sampled rows among them). Sequences that
    lost rows list their kept rows' positions."""
    mask = torch.zeros(batch.num_tokens, dtype=torch.bool, device=keep.device)
    mask[keep] = True
    new_index = mask.cumsum(0) - 1  # a kept row's index in the narrowed batch
    counts: list[int] = []
    listed: list[list[int] | None] = []
    positions = batch.positions.tolist()
    kept_rows = keep.tolist()
    cursor = 0
    start = 0
    old_listed = batch.listed_positions or [None] * batch.num_seqs
    for query_len, earlier in zip(batch.query_lens, old_listed):
        end = start + query_len
        rows = []
        while cursor < len(kept_rows) and kept_rows[cursor] < end:
            rows.append(kept_rows[cursor])
            cursor += 1
        if not rows:
            raise ValueError("a sequence lost every row of the step; its last token is never moved")
        counts.append(len(rows))
        listed.append([positions[row] for row in rows] if len(rows) < query_len or earlier is not None else None)
        start = end
    logits_indices = new_index[batch.logits_indices]
    if not bool(mask[batch.logits_indices].all()):
        raise ValueError("a sampled row was dropped from the step")
    return replace(
        batch,
        input_ids=batch.input_ids[keep], positions=batch.positions[keep], slot_mapping=batch.slot_mapping[keep],
        query_lens=counts, logits_indices=logits_indices, block_copies=[],
        lora=batch.lora.narrowed(keep, batch.num_tokens) if batch.lora is not None else None,
        listed_positions=listed if any(entry is not None for entry in listed) else None,
        moves=None, blend=None)
