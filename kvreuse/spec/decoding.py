"""SpeculativeDecoding: what an engine step does differently when an EAGLE draft is loaded.

The forward also returns every token's hidden state, from which the draft's input feature of each
token is stored at its slot; after the target's tokens are verified and appended, the draft's K/V
catch up with the positions that became final and each decoding sequence drafts its next tokens
(``EagleProposer``), kept in ``Request.spec_token_ids`` for the next step to verify. With random
sampling the proposal distribution of each drafted token is kept until that verification (rejection
sampling needs it). Counters under vLLM's names (``SpecDecodeStats``).
"""

from __future__ import annotations

import dataclasses

import torch

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.request import Request, RequestStatus
from kvreuse.runner.input_batch import StepItem
from kvreuse.runner.model_runner import ModelRunner
from kvreuse.spec.proposer import DraftJob, EagleProposer
from kvreuse.spec.stats import SpecDecodeStats


class SpeculativeDecoding:
    def __init__(self, proposer: EagleProposer, num_speculative_tokens: int, block_size: int) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.stats = SpecDecodeStats(num_speculative_tokens)
        self._draft_probs: dict[int, torch.Tensor] = {}  # id(Request) -> q of its drafted tokens (random sampling)

    def forward(self, runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
        """The target's step, storing every token's draft input feature; returns the logits."""
        output = runner.run(batch, self.proposer.aux_layers)
        self.proposer.store_features(output, batch.slot_mapping)
        return output.logits

    def take_draft_probs(self, request: Request, num_drafted: int) -> torch.Tensor | None:
        """The proposal distribution of the tokens ``request`` drafted (None when greedy or none drafted)."""
        probs = self._draft_probs.pop(id(request), None)
        return probs[:num_drafted] if probs is not None else None

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.stats.record(num_drafted, num_accepted)

    def forget(self, request: Request) -> None:
        """``request`` ended (finished, stopped by a string, aborted): drop what was kept for it."""
        self._draft_probs.pop(id(request), None)

    def stats_snapshot(self) -> SpecDecodeStats:
        """A copy: the server reads stats on another thread while the engine keeps counting."""
        return dataclasses.replace(self.stats, accepted_per_position=list(self.stats.accepted_per_position))

    def draft(self, items: list[StepItem], max_model_len: int) -> None:
        """Bring the draft's K/V up to date for every sequence that ran and draft the next tokens of
        those that decode next step."""
        jobs: list[DraftJob] = []
        for item in items:
            request = item.request
            request.spec_token_ids = []
            valid_end = request.num_computed_tokens
            num_propose = 0
            if request.status is not RequestStatus.FINISHED and valid_end == request.num_tokens - 1:
                params = request.sampling_params
                num_propose = max(0, min(
                    self.num_speculative_tokens,
                    params.max_tokens - request.num_output_tokens - 1,  # drafts the target can still take
                    max_model_len - request.num_tokens - 1,
                    len(item.table) * self.block_size - valid_end,  # the lookahead slots held
                ))
            jobs.append(DraftJob(request, item.start, valid_end, num_propose, item.table))
        for index, proposal in self.proposer.run(jobs).items():
            request = jobs[index].request
            request.spec_token_ids = proposal.token_ids
            if proposal.probs is not None:
                self._draft_probs[id(request)] = proposal.probs
