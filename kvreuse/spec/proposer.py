"""EagleProposer: after the target's step, bring the draft's K/V up to date and draft the next tokens.

Indexing that makes cached draft K/V exact: the draft entry stored at position p combines token p with
the feature of position p - 1 (and predicts token p + 1). Its K/V therefore depend on tokens 0..p only,
the same tokens as the target's K/V at p and as the block key that covers p. A block holds both, so a
prefix hit, a partial-block copy, a pin or a preemption brings the draft's K/V and features along,
correct by construction: the draft never needs a token beyond the hit boundary, and nothing of the
target is recomputed. (Shifting every draft position by one relative to the EAGLE papers changes no
attention score: rotary attention depends on position differences only.)

One step, per sequence the target ran:

1. catch-up: draft entries for every position whose target K/V became final this step, plus, when
   the sequence drafts, the entry at the token just sampled (its feature, of the position before, is
   final too); its output row gives the first drafted token;
2. chain: one more draft entry per further drafted token, fed the draft's own output feature.

The chain's entries sit past the sequence's computed tokens, in the lookahead slots the scheduler
reserved; the next step's catch-up overwrites them with final ones before any block holding them is
cached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache
from kvreuse.request import Request
from kvreuse.runner.model_runner import StepOutput
from kvreuse.sampling import Sampler
from kvreuse.spec.eagle import EagleDraft


@dataclass
class DraftJob:
    request: Request
    start: int  # first position the target computed this step
    valid_end: int  # positions [start, valid_end) now hold final target K/V and features
    num_propose: int  # tokens to draft after position valid_end - 1 (0: only fill the draft's K/V)
    table: list[int]  # the request's block table as this step's forward used it (covers the lookahead)


@dataclass
class Proposal:
    token_ids: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)  # the proposal distribution of each token (random)

    @property
    def probs(self) -> torch.Tensor | None:
        """[len(token_ids), V]: q of each drafted token, for rejection sampling (None when greedy)."""
        return torch.stack(self.q_rows) if self.q_rows else None


class EagleProposer:
    def __init__(self, draft: EagleDraft, kv_cache: KVCache, device: torch.device, sampler: Sampler) -> None:
        if kv_cache.features is None or kv_cache.num_layers <= draft.kv_layer:
            raise ValueError("the KV cache has no room for the draft (a draft layer and per-slot features)")
        self.draft = draft
        self.kv_cache = kv_cache
        self.device = device
        self.sampler = sampler
        self.block_size = kv_cache.block_size
        # Masks the draft's logits rows (requests, tokens each drafted so far, logits) in place: structured
        # outputs' grammars, so a constrained sequence drafts only what its grammar allows.
        self.draft_mask: Callable[[list[Request], list[list[int]], torch.Tensor], None] | None = None

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.draft.spec.aux_layers

    def store_features(self, output: StepOutput, slot_mapping: torch.Tensor) -> None:
        """Write the draft's input feature of every token the target ran, at its slot."""
        with torch.inference_mode():
            self.kv_cache.write_features(slot_mapping, self.draft.target_features(output.hidden, output.aux_hidden))

    def _slot(self, table: list[int], position: int) -> int:
        if position < 0:
            return self.kv_cache.zero_feature_slot
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, jobs: list[DraftJob]) -> dict[int, Proposal]:
        """Catch up and draft for every job; returns the proposals by job index."""
        tokens: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        drafting: list[int] = []  # job indices that draft, in logits-row order
        rows: list[int] = []
        included: list[DraftJob] = []
        for index, job in enumerate(jobs):
            end = job.valid_end + (1 if job.num_propose > 0 else 0)
            if end <= job.start:
                continue
            all_tokens = job.request.all_token_ids
            tokens.extend(all_tokens[job.start:end])
            positions.extend(range(job.start, end))
            query_lens.append(end - job.start)
            included.append(job)
            if job.num_propose > 0:
                drafting.append(index)
                rows.append(len(tokens) - 1)
        if not included:
            return {}
        tables = [job.table for job in included]
        with torch.inference_mode():
            out_rows, next_features = self._forward(tokens, positions, query_lens, tables, rows, None)
            proposals = {index: Proposal() for index in drafting}
            self._take(jobs, drafting, out_rows, proposals)
            step = 1
            while True:
                chained = [index for index in drafting if jobs[index].num_propose > step]
                if not chained:
                    break
                keep = [drafting.index(index) for index in chained]
                features = next_features[keep]
                chain_tokens = [proposals[index].token_ids[-1] for index in chained]
                chain_positions = [jobs[index].valid_end + step for index in chained]
                out_rows, next_features = self._forward(
                    chain_tokens, chain_positions, [1] * len(chained), [jobs[index].table for index in chained],
                    list(range(len(chained))), features)
                self._take(jobs, chained, out_rows, proposals)
                drafting = chained
                step += 1
        return proposals

    def _forward(self, tokens: list[int], positions: list[int], query_lens: list[int], tables: list[list[int]],
                 rows: list[int], features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward; returns (logits-ready rows, next features) of ``rows``."""
        device = self.device
        slots: list[int] = []
        feature_slots: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        start = 0
        for count, table in zip(query_lens, tables):
            seq_positions = positions[start:start + count]
            slots.extend(self._slot(table, p) for p in seq_positions)
            feature_slots.extend(self._slot(table, p - 1) for p in seq_positions)
            context = seq_positions[-1] + 1
            context_lens.append(context)
            block_tables.append(table[: -(-context // self.block_size)])
            start += count
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
            logits_indices=torch.tensor(rows, dtype=torch.long, device=device),
        )
        if features is None:
            assert self.kv_cache.features is not None
            features = self.kv_cache.features.index_select(0, torch.tensor(feature_slots, dtype=torch.long, device=device))
        metadata = self.draft.attention_backend.prepare(batch, self.block_size)
        for_logits, next_features = self.draft(batch.input_ids, batch.positions, features, self.kv_cache, metadata)
        return for_logits.index_select(0, batch.logits_indices), next_features.index_select(0, batch.logits_indices)

    def _take(self, jobs: list[DraftJob], indices: list[int], out_rows: torch.Tensor,
              proposals: dict[int, Proposal]) -> None:
        """Draft one token per job from the draft's logits: greedy requests take the argmax, random ones
        draw from q = softmax(logits / temperature) and keep q for verification."""
        logits = self.draft.compute_logits(out_rows)
        if self.draft_mask is not None:
            self.draft_mask([jobs[index].request for index in indices],
                            [proposals[index].token_ids for index in indices], logits)
        greedy = logits.argmax(dim=-1).tolist()
        for row, index in enumerate(indices):
            state = jobs[index].request.sampling_state
            assert state is not None
            proposal = proposals[index]
            if state.params.greedy:
                proposal.token_ids.append(int(greedy[row]))
                continue
            q = (logits[row] / state.params.temperature).softmax(dim=-1)
            proposal.token_ids.append(int(self.sampler.draw(q.unsqueeze(0), [state])[0]))
            proposal.q_rows.append(q)
