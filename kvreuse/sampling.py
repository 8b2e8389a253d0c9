"""Sampling parameters and the batched sampler.

`SamplingParams` uses vLLM's names and meanings so users can switch engines without rewriting their
calls. The engine builds one `SamplingState` per sequence (`SamplingState.create`) and calls
`state.append(token_id)` after each step; `Sampler` turns one step's logits into one token per row.

Order of operations inside the sampler, for each row:

1. penalties on the model's logits: repetition (HF style, over prompt and output tokens), then
   frequency and presence (OpenAI style, over output tokens only);
2. while fewer than ``min_tokens`` tokens were generated, EOS and ``stop_token_ids`` are masked;
3. logprobs, when asked for, are the log_softmax of these logits: after penalties and the
   ``min_tokens`` mask, before temperature, top-k, top-p and min-p (vLLM's default "raw"
   logprobs, so the numbers do not depend on how adventurous the sampling settings are);
4. greedy rows take the argmax; random rows divide by the temperature, then min-p, top-k and
   top-p keep a subset of tokens, and one token is drawn from the renormalised distribution.

Random draws use the exponential race (argmax of ``p_i / E_i`` with ``E_i ~ Exp(1)`` picks token i
with probability ``p_i``), so a seeded row only needs its own generator to fill ``E``: its tokens
do not depend on the rest of the batch, and unseeded rows share one draw from torch's default
generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from kvreuse.errors import InvalidRequestError
from kvreuse.kernels import fused_ops
from kvreuse.structured_outputs import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by them only amplifies noise.
GREEDY_TEMPERATURE_EPS = 1e-5
# Stop strings per request: OpenAI allows 4; every decode step scans each one, so the list is bounded.
MAX_STOP_STRINGS = 64

# torch.Generator.manual_seed accepts this range; checking it up front turns a late RuntimeError
# inside the engine loop into a ValueError when the request is made.
_MIN_SEED = -(2**63)
_MAX_SEED = 2**64 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request, with vLLM's field names and meanings.

    ``top_k`` of 0 or -1 turns top-k off (stored as 0). ``logprobs`` is the number of most likely
    tokens to report per generated token; the sampled token's own logprob is always reported when
    ``logprobs`` is not None. ``stop`` is normalised to a list and ``stop_token_ids`` to a list.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # What the output must match (a JSON schema, regex, choice, grammar): enforced by masking the logits
    # before temperature, top-k, top-p and min-p (kvreuse.grammar).
    structured_outputs: StructuredOutputsParams | None = None

    max_logprobs: ClassVar[int] = 20

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n must be an int >= 1, got {self.n!r}", "n")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                      "temperature")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or an int >= 1, got {self.top_k!r}", "top_k")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and (not _is_int(self.seed) or not _MIN_SEED <= self.seed <= _MAX_SEED):
            raise InvalidRequestError(f"seed must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}",
                                      "seed")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an int between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
                "min_tokens",
            )
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool, got {getattr(self, name)!r}", name)
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= self.max_logprobs
        ):
            raise InvalidRequestError(
                f"logprobs must be None or an int between 0 and {self.max_logprobs}, got {self.logprobs!r}",
                "logprobs",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}", name)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams", "structured_outputs")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}", "repetition_penalty"
            )

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise InvalidRequestError(
                f"stop must be a string, a list of strings or None, got {type(stop).__name__}", "stop"
            )
        if len(items) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed (every step checks each one)",
                "stop",
            )
        for item in items:
            if not isinstance(item, str) or not item:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {item!r}", "stop")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(stop_token_ids: object) -> list[int]:
        if stop_token_ids is None:
            return []
        if not isinstance(stop_token_ids, (list, tuple)):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of non-negative ints or None, got {type(stop_token_ids).__name__}",
                "stop_token_ids",
            )
        for token_id in stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative ints, got {token_id!r}",
                                          "stop_token_ids")
        return list(stop_token_ids)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(eq=False)
class SamplingState:
    """Per-sequence sampling state, built once by `create` and advanced by `append`.

    Penalty bookkeeping is incremental: the per-vocabulary count and seen tensors are made on the
    first sampler call (when the vocabulary size is known) and afterwards only the tokens appended
    since the previous call are added, so a step costs O(new tokens), not O(sequence length).
    """

    params: SamplingParams
    generator: torch.Generator | None  # seeded requests draw only from this
    # Token ids that must not be sampled while fewer than params.min_tokens were generated.
    min_tokens_blocked_ids: tuple[int, ...]
    # Kept only when the repetition penalty needs it (it covers the prompt too).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: list[int] = field(default_factory=list)
    # True while this row can take the all-greedy fast path: greedy, no penalties, no logprobs and
    # no active min_tokens mask. Kept current by `append` so the sampler reads one attribute per row.
    is_plain_greedy: bool = False
    _output_counts: torch.Tensor | None = field(default=None, repr=False)  # [V] float32
    _seen_mask: torch.Tensor | None = field(default=None, repr=False)  # [V] bool, prompt ∪ output
    _num_flushed_outputs: int = field(default=0, repr=False)  # output tokens already in the tensors

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        prompt_token_ids: Sequence[int] = (),
        sequence_index: int = 0,
    ) -> SamplingState:
        """State for one sequence. ``sequence_index`` (0..n-1) offsets the seed so the n samples of a
        seeded request differ from each other yet stay reproducible."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed + sequence_index)
        blocked: list[int] = [] if params.ignore_eos else [int(t) for t in eos_token_ids]
        blocked += [t for t in params.stop_token_ids if t not in blocked]
        state = cls(
            params=params,
            generator=generator,
            min_tokens_blocked_ids=tuple(blocked) if params.min_tokens > 0 else (),
            # Copied: the engine's token list may grow with outputs, which the seen mask adds itself.
            prompt_token_ids=tuple(prompt_token_ids) if params.repetition_penalty != 1.0 else (),
        )
        state.is_plain_greedy = state._compute_plain_greedy()
        return state

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def min_tokens_mask_active(self) -> bool:
        return bool(self.min_tokens_blocked_ids) and len(self.output_token_ids) < self.params.min_tokens

    def append(self, token_id: int) -> None:
        """Record the token sampled for this sequence in the last step."""
        self.output_token_ids.append(token_id)
        if not self.is_plain_greedy and len(self.output_token_ids) == self.params.min_tokens:
            self.is_plain_greedy = self._compute_plain_greedy()

    def _compute_plain_greedy(self) -> bool:
        params = self.params
        return (
            params.greedy and not params.has_penalties and params.logprobs is None and not self.min_tokens_mask_active
        )

    def penalty_tensors(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(output token counts [V] float32, seen-in-prompt-or-output mask [V] bool), brought up to
        date with the tokens appended since the last call."""
        if self._output_counts is None or self._output_counts.shape[0] != vocab_size:
            self._output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._seen_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._num_flushed_outputs = 0
            if self.prompt_token_ids:
                prompt_ids = self._checked_ids(self.prompt_token_ids, vocab_size, "prompt_token_ids")
                self._seen_mask[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        assert self._seen_mask is not None
        new_ids = self.output_token_ids[self._num_flushed_outputs :]
        if new_ids:
            checked = self._checked_ids(new_ids, vocab_size, "output token ids")
            ids = torch.tensor(checked, dtype=torch.long, device=device)
            self._output_counts.index_add_(0, ids, torch.ones(len(new_ids), dtype=torch.float32, device=device))
            self._seen_mask[ids] = True
            self._num_flushed_outputs = len(self.output_token_ids)
        return self._output_counts, self._seen_mask

    @staticmethod
    def _checked_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> list[int]:
        ids = list(token_ids)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"{what} must be in [0, {vocab_size}), got min {min(ids)} max {max(ids)}")
        return ids


class TokenLogprobs(NamedTuple):
    """Logprobs for one generated token (log_softmax after penalties, before temperature)."""

    token_id: int
    logprob: float
    rank: int  # 1 + number of tokens with a strictly higher logprob
    top_logprobs: list[tuple[int, float]]  # (token_id, logprob), most likely first; params.logprobs long


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask for logprobs


class Sampler:
    """Turns a step's logits [B, V] into one token per row, following each row's SamplingState.

    The input logits are never modified in place.
    """

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must have shape [len(states)={len(states)}, vocab_size], got {tuple(logits.shape)}"
            )
        num_rows = len(states)
        if num_rows == 0:
            return SamplerOutput([], [])
        # Common case: one argmax for the whole batch, nothing else.
        if all(state.is_plain_greedy for state in states):
            return SamplerOutput(fused_ops.argmax(logits).tolist(), [None] * num_rows)

        if logits.dtype != torch.float32:
            logits = logits.float()
        logits = self._apply_penalties(logits, states)
        logits = self._apply_min_tokens_mask(logits, states)

        greedy_rows = [i for i, state in enumerate(states) if state.params.greedy]
        if len(greedy_rows) == num_rows:
            token_ids = fused_ops.argmax(logits)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            if greedy_rows:
                greedy_index = self._index(greedy_rows, logits.device)
                token_ids[greedy_index] = fused_ops.argmax(logits[greedy_index])
            random_rows = [i for i, state in enumerate(states) if not state.params.greedy]
            random_index = self._index(random_rows, logits.device)
            token_ids[random_index] = self._sample_random(logits[random_index], [states[i] for i in random_rows])

        logprobs = self._logprobs(logits, token_ids, states)
        return SamplerOutput(token_ids.tolist(), logprobs)

    @staticmethod
    def _index(rows: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=device)

    @staticmethod
    def _row_values(values: list[float], device: torch.device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    def _apply_penalties(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        rows = [i for i, state in enumerate(states) if state.params.has_penalties]
        if not rows:
            return logits
        device, vocab_size = logits.device, logits.shape[1]
        counts_list, seen_list = zip(*(states[i].penalty_tensors(vocab_size, device) for i in rows))
        counts = torch.stack(counts_list)
        seen = torch.stack(seen_list)
        params = [states[i].params for i in rows]
        index = self._index(rows, device)
        penalized = logits[index]  # advanced indexing copies, so the caller's logits stay intact

        repetition = self._row_values([p.repetition_penalty for p in params], device)
        scaled = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
        penalized = torch.where(seen, scaled, penalized)
        penalized -= self._row_values([p.frequency_penalty for p in params], device) * counts
        penalized -= self._row_values([p.presence_penalty for p in params], device) * (counts > 0)

        if len(rows) == len(states):
            return penalized
        result = logits.clone()
        result[index] = penalized
        return result

    def _apply_min_tokens_mask(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        vocab_size = logits.shape[1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        for i, state in enumerate(states):
            if state.min_tokens_mask_active:
                # Ids beyond the logits (a tokenizer larger than the model's head) can never be sampled.
                blocked = [t for t in state.min_tokens_blocked_ids if t < vocab_size]
                row_ids += [i] * len(blocked)
                token_ids += blocked
        if not row_ids:
            return logits
        masked = logits.clone()
        masked[self._index(row_ids, logits.device), self._index(token_ids, logits.device)] = float("-inf")
        return masked

    def target_distribution(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits after penalties and the min_tokens mask, the probabilities a random row samples from)
        for rows with temperature > 0: what speculative verification accepts drafted tokens against."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        processed = self._apply_min_tokens_mask(self._apply_penalties(logits, states), states)
        return processed, self._random_probs(processed, list(states))

    def draw(self, probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """One token per row of ``probs`` [R, V] (need not be normalised), by the exponential race with
        each seeded row's own generator (exactly V draws per row)."""
        device, vocab_size = probs.device, probs.shape[1]
        exponentials = torch.empty_like(probs)
        unseeded_rows = [i for i, state in enumerate(states) if state.generator is None]
        if len(unseeded_rows) == len(states):
            exponentials.exponential_()
        else:
            if unseeded_rows:
                unseeded_index = self._index(unseeded_rows, device)
                exponentials[unseeded_index] = torch.empty(
                    len(unseeded_rows), vocab_size, device=device, dtype=probs.dtype
                ).exponential_()
            for i, state in enumerate(states):
                if state.generator is not None:
                    if state.generator.device.type != device.type:
                        raise ValueError(
                            f"generator of a seeded request is on {state.generator.device}, logits on {device}; "
                            "create the SamplingState on the logits' device"
                        )
                    # Exactly V draws per step from the row's own generator: reproducible alone.
                    exponentials[i].exponential_(generator=state.generator)
        # Exp(1) can round to 0; a zero would turn a masked token's 0 / 0 into NaN, which argmax picks.
        exponentials.clamp_(min=torch.finfo(exponentials.dtype).tiny)
        return probs.div(exponentials).argmax(dim=-1)

    def token_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, states: Sequence[SamplingState]
    ) -> list[TokenLogprobs | None]:
        """Logprobs of given tokens under ``logits`` (already penalised, as from ``target_distribution``)."""
        return self._logprobs(logits, token_ids, states)

    def _sample_random(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """One token per row of ``logits`` [R, V] for rows with temperature > 0."""
        return self.draw(self._random_probs(logits, states), states)

    def _random_probs(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, min-p, top-k and top-p applied, softmaxed: [R, V]."""
        device, vocab_size = logits.device, logits.shape[1]
        params = [state.params for state in states]
        scaled = logits / self._row_values([p.temperature for p in params], device)

        # min_p is relative to the most likely token, so it commutes with top-k/top-p (both keep that
        # token and renormalising does not change ratios); in log space: drop l_i < l_max + log(min_p).
        if any(p.min_p > 0 for p in params):
            log_min_p = self._row_values([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device)
            threshold = scaled.max(dim=-1, keepdim=True).values + log_min_p
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))

        truncated_rows = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if truncated_rows:
            all_rows = len(truncated_rows) == len(params)
            index = None if all_rows else self._index(truncated_rows, device)
            subset = scaled if index is None else scaled[index]
            truncated = self._top_k_top_p(subset, [params[i] for i in truncated_rows], vocab_size)
            if index is None:
                scaled = truncated
            else:
                scaled = scaled.clone()
                scaled[index] = truncated

        return scaled.softmax(dim=-1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams], vocab_size: int) -> torch.Tensor:
        """Mask to -inf what top-k, then top-p on the renormalised rest, removes. One sort for all rows.

        The sort is stable so among equal logits the lowest id comes first, as with argmax: top_k=1
        and a tiny top_p then pick exactly the greedy token.
        """
        device = logits.device
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], dtype=torch.long, device=device
            ).unsqueeze(1)
            positions = torch.arange(vocab_size, device=device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(positions >= top_k, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exactly 0 for the top token
            # Rows without top-p get +inf so rounding in the cumsum can never drop their tail.
            top_p = Sampler._row_values([p.top_p if p.top_p < 1.0 else math.inf for p in params], device)
            sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)

    def _logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, states: Sequence[SamplingState]
    ) -> list[TokenLogprobs | None]:
        result: list[TokenLogprobs | None] = [None] * len(states)
        rows = [i for i, state in enumerate(states) if state.params.logprobs is not None]
        if not rows:
            return result
        index = self._index(rows, logits.device)
        log_probs = logits[index].log_softmax(dim=-1)
        sampled = token_ids[index].unsqueeze(1)
        sampled_logprobs = log_probs.gather(1, sampled)
        ranks = (log_probs > sampled_logprobs).sum(dim=-1) + 1
        # A tiny test model can have fewer tokens than the 20 logprobs a request may ask for.
        num_top = min(max(states[i].params.logprobs or 0 for i in rows), logits.shape[1])
        top_values, top_ids = log_probs.topk(num_top, dim=-1) if num_top > 0 else (None, None)

        sampled_list = sampled.squeeze(1).tolist()
        sampled_logprob_list = sampled_logprobs.squeeze(1).tolist()
        rank_list = ranks.tolist()
        top_value_list = top_values.tolist() if top_values is not None else [[] for _ in rows]
        top_id_list = top_ids.tolist() if top_ids is not None else [[] for _ in rows]
        for position, row in enumerate(rows):
            wanted = states[row].params.logprobs or 0
            result[row] = TokenLogprobs(
                token_id=sampled_list[position],
                logprob=sampled_logprob_list[position],
                rank=rank_list[position],
                top_logprobs=list(zip(top_id_list[position][:wanted], top_value_list[position][:wanted])),
            )
        return result
