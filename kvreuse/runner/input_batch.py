"""From the scheduler's decision to the model's input: one ``ForwardBatch`` per engine step.

For every scheduled sequence the step runs tokens ``[num_computed_tokens, + num_tokens)``: the ones
not computed yet and, with speculation, the drafted tokens to verify after them. Each token gets its
position and the KV slot its block table gives; a sequence whose prompt is complete after this step
gets logits rows (one, or one per drafted position plus one). With LoRA, the sequences of one adapter
sit side by side, so each adapter owns one contiguous run of rows (``LoRABatch``).

``StepItem`` is what the engine keeps of each sequence between the forward and the update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvreuse.attention.blend import BlendSettings
from kvreuse.attention.forward_batch import ForwardBatch, KVMoves
from kvreuse.cache.blocks import BlockCopy
from kvreuse.cache.state_slots import StateCopy
from kvreuse.lora.batch import LoRABatch, LoRASegment
from kvreuse.lora.manager import LoRAManager
from kvreuse.request import Request
from kvreuse.scheduler import ScheduledRequest


@dataclass
class StepItem:
    """One scheduled sequence of a step, as its forward saw it."""

    request: Request
    start: int  # num_computed_tokens before the step
    num_tokens: int  # tokens the target ran (including drafted ones)
    draft_token_ids: list[int]  # drafted tokens among them, verified this step
    table: list[int]  # its block table as the forward used it
    first_row: int | None  # its first logits row (None: a prefill chunk that samples nothing)
    blend_segment: int | None = None  # its place in the step's BlendPlan.segments (None: nothing moved)


def build_forward_batch(
    scheduled: Sequence[ScheduledRequest],
    block_size: int,
    device: torch.device,
    block_copies: list[BlockCopy],
    lora: LoRAManager | None = None,
    copy_tables: bool = False,
    blend: BlendSettings | None = None,
    state_copies: list[StateCopy] | None = None,
) -> tuple[ForwardBatch, list[StepItem]]:
    """The step's ForwardBatch and its items, in the batch's order. ``copy_tables``: keep a copy of each
    block table as it is now (the draft's catch-up reads the table the forward used, after the request
    may have grown). ``blend``: how sequences with moved spans (``Request.moved_spans``, taken here) recompute
    them; their moves and the blend plan go in the batch. ``state_copies``: a hybrid's state copies to run first
    (cache/state_slots.py); its sequences' state slots go in the batch."""
    move_src: list[int] = []
    move_dst: list[int] = []
    move_deltas: list[int] = []
    moved_rows: list[int] = []
    segments: list[tuple[int, int]] = []
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    block_tables: list[list[int]] = []
    logits_indices: list[int] = []
    items: list[StepItem] = []
    state_slots: list[int] = []
    adapter_rows: dict[str, list[int]] = {}
    if lora is not None:
        scheduled = sorted(scheduled, key=lambda item: item.request.adapter or "")
    for scheduled_item in scheduled:
        request, count = scheduled_item.request, scheduled_item.num_tokens
        drafts = list(request.spec_token_ids)
        start = request.num_computed_tokens
        end = start + count
        if request.adapter is not None:
            adapter_rows.setdefault(request.adapter, []).extend(range(len(input_ids), len(input_ids) + count))
        input_ids.extend(request.all_token_ids[start : end - len(drafts)])
        input_ids.extend(drafts)
        positions.extend(range(start, end))
        table = request.block_ids
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_lens.append(count)
        context_lens.append(end)
        block_tables.append(table[: -(-end // block_size)])
        first_row = None
        if end - len(drafts) == request.num_tokens:  # the prompt is complete: this step yields tokens
            first_row = len(logits_indices)
            logits_indices.extend(range(len(input_ids) - len(drafts) - 1, len(input_ids)))
        segment = None
        if request.moved_spans:
            assert blend is not None and end == request.num_tokens and not drafts, "a blend runs the whole rest"
            segment, first_moved = len(segments), len(moved_rows)
            row_of_start = len(input_ids) - count
            for span in request.moved_spans:
                forced = min(blend.recompute_first, span.num_tokens)
                request.num_recomputed_tokens += forced
                request.num_moved_tokens += span.num_tokens
                for offset in range(forced, span.num_tokens):
                    position = span.start + offset
                    move_src.append(span.source_slots[offset])
                    move_dst.append(table[position // block_size] * block_size + position % block_size)
                    move_deltas.append(span.delta)
                    moved_rows.append(row_of_start + position - start)
            segments.append((first_moved, len(moved_rows) - first_moved))
            request.moved_spans = []
        if request.state_slot is not None:
            state_slots.append(request.state_slot)
        items.append(StepItem(request, start, count, drafts, list(table) if copy_tables else table, first_row,
                              segment))
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long).to(device, non_blocking=True),
        positions=torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=block_tables,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long).to(device, non_blocking=True),
        block_copies=block_copies,
        lora=_lora_batch(lora, adapter_rows, len(input_ids), device),
        state_slots=state_slots if state_slots else None,
        state_copies=state_copies or [],
    )
    if state_slots and len(state_slots) != len(query_lens):
        raise RuntimeError("some sequences of a step have a state slot and some do not")
    if moved_rows:
        assert blend is not None
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)  # noqa: E731
        batch.moves = KVMoves(as_tensor(move_src), as_tensor(move_dst), as_tensor(move_deltas))
        batch.blend = blend.plan(as_tensor(moved_rows), segments)
    return batch, items


def _lora_batch(lora: LoRAManager | None, adapter_rows: dict[str, list[int]], num_tokens: int,
                device: torch.device) -> LoRABatch | None:
    """The step's adapters and their token rows (rows of the base model get no segment)."""
    if not adapter_rows or lora is None:
        return None
    in_use = set(adapter_rows)
    segments = []
    for digest, rows in adapter_rows.items():
        adapter = lora.activate(digest, in_use)
        if len(rows) == num_tokens:
            segments.append(LoRASegment(adapter, None))
        elif rows[-1] - rows[0] + 1 == len(rows):  # contiguous (the batch is sorted by adapter)
            segments.append(LoRASegment(adapter, slice(rows[0], rows[-1] + 1)))
        else:
            segments.append(LoRASegment(adapter, torch.tensor(rows, dtype=torch.long, device=device)))
    return LoRABatch(segments)
