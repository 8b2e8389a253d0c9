"""Turning a step's logits into tokens, with or without drafted tokens to verify.

Every sequence that samples this step has ``1 + len(draft)`` consecutive logits rows: row j is the
target's distribution for the token after ``draft[:j]``. Positions are walked in order for all
sequences at once, so the sampling state (penalties, the min_tokens mask) of row j already includes
the tokens taken at rows < j, exactly as if they had been decoded one per step:

- a row with no drafted token to check (the last one, or every row without speculation) is sampled
  by the ordinary Sampler, so speculation off is the engine's old path, draw for draw;
- a greedy row takes the Sampler's argmax: the drafted token is accepted when it equals it, else the
  argmax is the corrected token and the sequence stops here;
- a random row uses standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
  accept the drafted token d with probability min(1, p(d) / q(d)), where p is the target's processed
  distribution and q the draft's proposal distribution; on rejection draw from normalise(max(p - q, 0)).
  A cache draft's q is the drafted token itself: accept with probability p(d), else draw from p without d.
  The output then has exactly the target's distribution. Seeded requests draw only from their own
  generator, so a fixed seed reproduces.

A sequence also stops at the first token that ends it (EOS, a stop token, max_tokens, the context
limit); tokens drafted after it are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvreuse.sampling import Sampler, SamplingState, TokenLogprobs


@dataclass
class VerifyItem:
    state: SamplingState
    first_row: int  # its first logits row; rows first_row .. first_row + len(draft_token_ids)
    draft_token_ids: list[int] = field(default_factory=list)
    # [len(draft_token_ids), V]: q of each drafted token (random rows); None: q is the drafted token itself (a
    # cache draft's point mass)
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifyResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_accepted: int = 0  # drafted tokens kept
    finish: tuple[str, int | None] | None = None


def verify(sampler: Sampler, logits: torch.Tensor, items: list[VerifyItem],
           finish_check: Callable[[int, int, int], tuple[str, int | None] | None]) -> list[VerifyResult]:
    """Tokens for every item (see the module doc). ``finish_check(item_index, token_id, count)`` returns
    (finish_reason, stop_reason) when taking ``token_id`` as the item's ``count``-th token of the step
    ends its sequence, else None.

    Appends every taken token to its item's SamplingState.
    """
    results = [VerifyResult() for _ in items]
    alive = list(range(len(items)))
    position = 0
    while alive:
        plain: list[int] = []  # rows sampled as usual: greedy rows and rows with nothing left to verify
        rejection: list[int] = []  # random rows with a drafted token to accept or reject
        for i in alive:
            item = items[i]
            if position < len(item.draft_token_ids) and not item.state.params.greedy:
                rejection.append(i)
            else:
                plain.append(i)
        taken: dict[int, tuple[int, TokenLogprobs | None, bool]] = {}  # item -> (token, logprobs, accepted)
        if plain:
            sampled = sampler(_rows(logits, [items[i].first_row + position for i in plain]),
                              [items[i].state for i in plain])
            for i, token, token_logprobs in zip(plain, sampled.token_ids, sampled.logprobs):
                drafts = items[i].draft_token_ids
                taken[i] = (token, token_logprobs, position < len(drafts) and token == drafts[position])
        if rejection:
            taken.update(_rejection_sample(sampler, logits, items, rejection, position))
        still_alive = []
        for i in alive:
            token, token_logprobs, accepted = taken[i]
            result = results[i]
            result.token_ids.append(token)
            result.logprobs.append(token_logprobs)
            items[i].state.append(token)
            result.finish = finish_check(i, token, len(result.token_ids))
            if accepted:
                result.num_accepted += 1
            if accepted and result.finish is None:
                still_alive.append(i)
        alive = still_alive
        position += 1
    return results


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: the tensor itself where that is every row in order (a step without drafts, the
    common case; the sampler never writes its input), else a copy of those rows."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows, device=logits.device))


def _rejection_sample(sampler: Sampler, logits: torch.Tensor, items: list[VerifyItem], rows_of: list[int],
                      position: int) -> dict[int, tuple[int, TokenLogprobs | None, bool]]:
    states = [items[i].state for i in rows_of]
    rows = torch.tensor([items[i].first_row + position for i in rows_of], device=logits.device)
    processed, target_probs = sampler.target_distribution(logits.index_select(0, rows), states)
    chosen: list[int] = []
    accepted: list[bool] = []
    for row, i in enumerate(rows_of):
        item = items[i]
        drafted = item.draft_token_ids[position]
        p = target_probs[row]
        if item.draft_probs is None:  # a point mass on the drafted token
            q = torch.zeros_like(p)
            q[drafted] = 1.0
        else:
            q = item.draft_probs[position].to(p.device, torch.float32)
        uniform = torch.rand((), generator=item.state.generator, device=p.device) if item.state.generator is not None \
            else torch.rand((), device=p.device)
        # Accept with probability min(1, p/q): u * q < p avoids dividing by a tiny q.
        if float(uniform) * float(q[drafted]) < float(p[drafted]):
            chosen.append(drafted)
            accepted.append(True)
            continue
        residual = (p - q).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p
        chosen.append(int(sampler.draw(residual.unsqueeze(0), [item.state])[0]))
        accepted.append(False)
    token_tensor = torch.tensor(chosen, dtype=torch.long, device=logits.device)
    logprobs = sampler.token_logprobs(processed, token_tensor, states)
    return {i: (chosen[row], logprobs[row], accepted[row]) for row, i in enumerate(rows_of)}
