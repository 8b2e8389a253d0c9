"""SpeculativeDecoding: what an engine step does differently when it drafts tokens to verify.

Two drafters, either or both:

- ``EagleProposer`` (an EAGLE draft model): the forward also returns every token's hidden state, from which the
  draft's input feature of each token is stored at its slot; after the target's tokens are verified and
  appended, the draft's K/V catch up with the positions that became final and each decoding sequence drafts
  its next tokens. With random sampling the proposal distribution of each drafted token is kept until that
  verification (rejection sampling needs it).
- ``CacheDrafter``: tokens copied from the request's own text and its namespace's earlier sequences
  (spec/cache_drafter.py); its proposal is a point mass (the drafted token), which verification handles.

A sequence's draft goes in ``Request.spec_token_ids`` for the next step to verify. With both drafters, the one
expected to add more accepted tokens drafts the step (the cache draft's expected tokens from its confidence and
the request's acceptance; EAGLE's from its measured mean accepted length). The step's cache drafts are cut
together, to the tokens whose verification rows pay for themselves beside every other draft's rows
(spec/draft_cost.py); a constrained sequence's cache draft stops at
the first token its grammar forbids, and a grammar that forces tokens drafts them. A seeded random request is
drafted for by EAGLE only as before and never by the cache: its draws must not depend on what the namespace
holds or on the machine's timing. Counters under vLLM's names (``SpecDecodeStats``), and per request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable

import torch

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.request import Request, RequestStatus
from kvreuse.runner.input_batch import StepItem
from kvreuse.runner.model_runner import ModelRunner
from kvreuse.spec.cache_drafter import CacheDrafter
from kvreuse.spec.draft_cost import AcceptanceRate, DraftCost, expected_gains
from kvreuse.spec.proposer import DraftJob, EagleProposer, Proposal
from kvreuse.spec.stats import SpecDecodeStats, acceptance_rate, mean_acceptance_length

logger = logging.getLogger("kvreuse")

EAGLE, CACHE = "eagle", "cache"


class SpeculativeDecoding:
    def __init__(self, num_speculative_tokens: int, block_size: int, eagle: EagleProposer | None = None,
                 cache: CacheDrafter | None = None) -> None:
        if eagle is None and cache is None:
            raise ValueError("speculative decoding needs a drafter")
        self.eagle = eagle
        self.cache = cache
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.stats = SpecDecodeStats(num_speculative_tokens)
        self.cost = DraftCost()
        # EAGLE's accepted tokens per verification (decayed sums, from a prior of one), against which a cache
        # draft's expected tokens are compared when both drafters run.
        self._eagle_accepted = 1.0
        self._eagle_drafts = 1.0
        # A constrained sequence's draft as its grammar allows it (key, drafted) -> kept tokens (or forced ones).
        self.constrain: Callable[[int, list[int]], list[int]] | None = None
        self._draft_probs: dict[int, torch.Tensor] = {}  # id(Request) -> q of its drafted tokens (random sampling)
        self._acceptance: dict[int, AcceptanceRate] = {}  # id(Request) -> how its drafts fared
        self._source: dict[int, str] = {}  # id(Request) -> the drafter of its pending draft
        self.drafts_by_source: Counter[str] = Counter()  # drafts each drafter made (tests and --debug read it)

    @property
    def proposer(self) -> EagleProposer | None:
        return self.eagle

    def forward(self, runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
        """The target's step (storing every token's draft input feature for EAGLE); returns the logits."""
        if self.eagle is None:
            return runner.execute(batch)
        output = runner.run(batch, self.eagle.aux_layers)
        self.eagle.store_features(output, batch.slot_mapping)
        return output.logits

    def take_draft_probs(self, request: Request, num_drafted: int) -> torch.Tensor | None:
        """The proposal distribution of the tokens ``request`` drafted (None: greedy, none drafted, or a cache
        draft, whose proposal is the drafted token itself)."""
        probs = self._draft_probs.pop(id(request), None)
        return probs[:num_drafted] if probs is not None else None

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        self.stats.record(num_drafted, num_accepted)
        request.num_drafts += 1
        request.num_draft_tokens += num_drafted
        request.num_accepted_draft_tokens += num_accepted
        self._acceptance.setdefault(id(request), AcceptanceRate()).record(num_drafted, num_accepted)
        if self._source.get(id(request)) == EAGLE:
            self._eagle_accepted = 0.9 * self._eagle_accepted + num_accepted
            self._eagle_drafts = 0.9 * self._eagle_drafts + 1

    def record_step(self, rows: int, step_seconds: float) -> None:
        """A step's measured time, for the cost of a verification row."""
        self.cost.record(rows, step_seconds)

    def forget(self, request: Request) -> None:
        """``request`` ended (finished, stopped by a string, aborted): drop what was kept for it; its tokens go to
        its namespace's store for the cache drafter."""
        key = id(request)
        if request.num_drafts:
            logger.debug("request %s: %d drafts, %d of %d drafted tokens accepted (rate %.2f, mean accepted length %.2f)",
                         request.request_id, request.num_drafts, request.num_accepted_draft_tokens,
                         request.num_draft_tokens,
                         acceptance_rate(request.num_accepted_draft_tokens, request.num_draft_tokens),
                         mean_acceptance_length(request.num_accepted_draft_tokens, request.num_drafts))
        self._draft_probs.pop(key, None)
        self._acceptance.pop(key, None)
        self._source.pop(key, None)
        if self.cache is not None:
            self.cache.finish(key, request.namespace, request.all_token_ids)

    def stats_snapshot(self) -> SpecDecodeStats:
        """A copy: the server reads stats on another thread while the engine keeps counting."""
        return dataclasses.replace(self.stats, accepted_per_position=list(self.stats.accepted_per_position))

    def draft(self, items: list[StepItem], max_model_len: int, num_sequences: int) -> None:
        """Bring EAGLE's K/V up to date for every sequence that ran and draft the next tokens of those that
        decode next step (``num_sequences`` of them in all, for the cost of a row)."""
        jobs: list[DraftJob] = []  # EAGLE's, one per item
        limits: list[int] = []
        for item in items:
            request = item.request
            request.spec_token_ids = []
            valid_end = request.num_computed_tokens
            limit = 0
            if request.status is not RequestStatus.FINISHED and valid_end == request.num_tokens - 1:
                params = request.sampling_params
                limit = max(0, min(
                    self.num_speculative_tokens,
                    params.max_tokens - request.num_output_tokens - 1,  # drafts the target can still take
                    max_model_len - request.num_tokens - 1,
                ))
            limits.append(limit)
            if self.eagle is not None:  # it writes its chain's K/V into the lookahead slots the sequence holds
                eagle_limit = min(limit, len(item.table) * self.block_size - valid_end)
                jobs.append(DraftJob(request, item.start, valid_end, max(0, eagle_limit), item.table))
        if self.eagle is None and not self.cost.may_pay(num_sequences, sum(limits)):
            return  # no cache draft could pay for its rows this step: skip the lookups
        eagle: dict[int, Proposal] = self.eagle.run(jobs) if self.eagle is not None else {}
        eagle_expected = self._eagle_accepted / self._eagle_drafts
        # Each sequence's cache draft (uncut), or EAGLE's where it is expected to add more; then the cache drafts
        # are cut together, against the rows every draft of the step adds (spec/draft_cost.py).
        cached: list[tuple[Request, list[int], list[float]]] = []
        eagle_rows, eagle_tokens = 0, 0.0
        for index, (item, limit) in enumerate(zip(items, limits)):
            if limit <= 0:
                continue
            request = item.request
            key = id(request)
            proposal = eagle.get(index)
            tokens, gains = self._cache_draft(request, limit)
            if tokens and (proposal is None or sum(gains) >= eagle_expected):
                cached.append((request, tokens, gains))
            elif proposal is not None and proposal.token_ids:
                request.spec_token_ids = proposal.token_ids
                self._source[key] = EAGLE
                self.drafts_by_source[EAGLE] += 1
                eagle_rows += len(proposal.token_ids)
                eagle_tokens += eagle_expected
                if proposal.probs is not None:
                    self._draft_probs[key] = proposal.probs
        if not cached:
            return
        keep = self.cost.allocate([gains for _, _, gains in cached], num_sequences, eagle_rows, eagle_tokens)
        for (request, tokens, _), count in zip(cached, keep):
            if count:
                request.spec_token_ids = tokens[:count]
                self._source[id(request)] = CACHE
                self.drafts_by_source[CACHE] += 1

    def _cache_draft(self, request: Request, limit: int) -> tuple[list[int], list[float]]:
        """The cache drafter's tokens for ``request`` (as its grammar allows), and each one's expected accepted
        tokens (a token its grammar forces: one)."""
        if self.cache is None:
            return [], []
        state = request.sampling_state
        if state is not None and state.generator is not None and not state.params.greedy:
            return [], []  # seeded: its draws must not depend on the namespace or the machine
        key = id(request)
        draft = self.cache.propose(key, request.namespace, request.all_token_ids, limit)
        tokens, confidence = draft.token_ids, draft.confidence
        if self.constrain is not None:
            kept = self.constrain(key, tokens)
            if kept != tokens[:len(kept)]:  # the grammar forces these: the target takes them whatever it computes
                forced = kept[:limit]
                return forced, [1.0] * len(forced)
            tokens, confidence = kept, confidence[:len(kept)]
        if not tokens:
            return [], []
        acceptance = self._acceptance.get(key)
        rate = acceptance.rate if acceptance is not None else AcceptanceRate().rate
        return tokens, expected_gains(confidence, rate)
