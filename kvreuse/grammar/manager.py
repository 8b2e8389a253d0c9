"""StructuredOutputManager: the engine's side of structured outputs, one matcher per sequence.

- ``add``: a sequence with a constraint gets its compiled grammar (``GrammarCompiler``: cached by the
  constraint's canonical key, compiled off the engine thread). Not compiled yet: the sequence waits in
  the queue (``Request.waiting_for_grammar``) and ``resolve`` gives it its matcher once the compile is
  done, or reports the error.
- ``apply``: before sampling, every constrained logits row gets its token mask: a sampling row the
  mask of the sequence's state now, and with speculation one row per drafted position, each with the
  mask after the drafts before it (llguidance consumes the drafts to compute them, then rolls back).
  Disallowed tokens get -inf, so temperature, top-k, top-p and min-p only ever see allowed tokens, and
  a draft the grammar refuses is rejected by verification like any token the target would not pick.
  EOS is allowed exactly where the grammar may end.
- ``accept``: the tokens a step appended to a sequence advance its matcher; a grammar that can go no
  further ends the sequence.

Only the tokens a sequence samples ever reach its matcher: a prefix hit or a preemption by recompute
recomputes KV without sampling, so the matcher's state stays that of the tokens it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import torch

from kvreuse.errors import InvalidRequestError
from kvreuse.grammar.compiler import CompiledGrammar, GrammarCompiler
from kvreuse.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("kvreuse")


@dataclass
class MaskRows:
    """A constrained sequence's logits rows in this step: ``first_row`` samples after the tokens it holds,
    the next ``len(draft_token_ids)`` rows after each drafted token."""

    key: int
    first_row: int
    draft_token_ids: list[int]


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._pending: dict[int, Future[CompiledGrammar]] = {}
        self._executor: llguidance.LLExecutor | None = None  # made on first use (it starts threads)
        words = -(-vocab_size // 32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._words = words

    # --- sequences ------------------------------------------------------------------------------------
    def add(self, key: int, params: StructuredOutputsParams) -> bool:
        """Give sequence ``key`` its grammar; True when it is ready now. Raises InvalidRequestError at once
        when the constraint is already known to be refused."""
        future = self.compiler.submit(params)
        if future.done():
            self._matchers[key] = future.result().matcher()  # raises the refusal
            return True
        self._pending[key] = future
        return False

    def has_pending(self) -> bool:
        return bool(self._pending)

    def resolve(self, block_s: float = 0.0) -> dict[int, InvalidRequestError | None]:
        """Sequences whose compile finished since the last call: None (ready) or the refusal. With
        ``block_s``, wait that long for a first one (the engine has nothing else to run)."""
        if not self._pending:
            return {}
        if block_s > 0:
            wait(list(self._pending.values()), timeout=block_s, return_when="FIRST_COMPLETED")
        resolved: dict[int, InvalidRequestError | None] = {}
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            try:
                self._matchers[key] = future.result().matcher()
                resolved[key] = None
            except InvalidRequestError as error:
                resolved[key] = error
        return resolved

    def remove(self, key: int) -> None:
        self._matchers.pop(key, None)
        self._pending.pop(key, None)

    def is_constrained(self, key: int) -> bool:
        return key in self._matchers

    # --- a step -------------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, rows: list[MaskRows]) -> None:
        """Mask the constrained rows of ``logits`` [num_rows, vocab] in place."""
        rows = [entry for entry in rows if entry.key in self._matchers]
        if not rows:
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()  # fills a batch's masks in parallel, the GIL released
        bitmask = torch.full((logits.shape[0], self._words), -1, dtype=torch.int32)
        plain = [(self._matchers[entry.key], entry.first_row) for entry in rows if not entry.draft_token_ids]
        drafted = [(self._matchers[entry.key], entry.first_row, entry.draft_token_ids)
                   for entry in rows if entry.draft_token_ids]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), self._words * 4, bitmask.shape[0])
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), self._words * 4,
                                                                    bitmask.shape[0])
        self._mask(logits, bitmask, sorted({entry.first_row + offset for entry in rows
                                            for offset in range(len(entry.draft_token_ids) + 1)}))

    def mask_drafts(self, keys: Sequence[int], drafted: Sequence[Sequence[int]], logits: torch.Tensor) -> None:
        """Mask the draft model's logits row of each sequence after the tokens it drafted so far, so
        speculation proposes what the grammar allows (verification stays exact either way; this keeps the
        acceptance rate of constrained sequences)."""
        rows = [(row, self._matchers[key], tokens) for row, (key, tokens) in enumerate(zip(keys, drafted))
                if key in self._matchers]
        if not rows:
            return
        bitmask = torch.full((logits.shape[0], self._words), -1, dtype=torch.int32)
        for row, matcher, tokens in rows:
            consumed = matcher.try_consume_tokens(list(tokens)) if tokens else 0
            if consumed == len(tokens):
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask.numpy(), row)
            if consumed:
                matcher.rollback(consumed)
        self._mask(logits, bitmask, [row for row, _, _ in rows])

    def allowed_draft(self, key: int, drafted: list[int]) -> list[int]:
        """A cache draft for sequence ``key`` as its grammar allows it: up to the first token it forbids; where
        none is left, the tokens the grammar forces next (the target can take nothing else, so they are free
        drafts). An unconstrained sequence's draft is returned as it is."""
        matcher = self._matchers.get(key)
        if matcher is None:
            return drafted
        valid = matcher.validate_tokens(drafted) if drafted else 0
        if valid:
            return drafted[:valid]
        return list(matcher.compute_ff_tokens())

    def _mask(self, logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
        """-inf on the tokens ``bitmask`` disallows, in rows ``indices`` of ``logits``."""
        index = torch.tensor(indices, dtype=torch.long)
        allowed = ((bitmask[index].unsqueeze(-1) >> self._shifts) & 1).view(len(indices), -1)[:, : logits.shape[1]]
        with torch.inference_mode():  # the logits are the forward's inference tensors
            index = index.to(logits.device)
            masked = logits.index_select(0, index)
            masked.masked_fill_(allowed.to(logits.device) == 0, float("-inf"))
            logits.index_copy_(0, index, masked)

    def accept(self, key: int, token_ids: Sequence[int]) -> int | None:
        """Advance sequence ``key`` by the tokens it was given this step (an EOS ends it, unconsumed). None while
        its grammar can go on; else how many of ``token_ids`` it took before it could go no further, so the
        sequence ends after them (tokens a verified draft added past that point are dropped, as a step without
        drafts would never have made them)."""
        matcher = self._matchers.get(key)
        if matcher is None:
            return None
        tokens = list(token_ids)
        if tokens and tokens[-1] in self.eos_token_ids:
            tokens.pop()
        for count, token in enumerate(tokens, start=1):
            if not matcher.consume_token(token):
                # Cannot happen for tokens sampled under the mask; if it does, stop rather than run unconstrained.
                logger.error("structured outputs: a sampled token was refused by its grammar (%s); ending the "
                             "sequence", matcher.get_error())
                return count
            if matcher.is_stopped():
                return count
        return len(token_ids) if matcher.is_stopped() else None
