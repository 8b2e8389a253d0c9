"""RequestGroup: a user-visible request, n sequences sharing one prompt, and the outputs it reports.

The scheduler sees sequences (``kvreuse.request.Request``); the caller sees requests. A group keeps
what only the caller needs: each sample's ``CompletionOutput`` (token ids, logprobs, the delta since
the last output, finish reason), the request's metrics, the pins it asked for, made and hit, and its
owner (the tenant that sent it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvreuse.cache.pins import PinSpec
from kvreuse.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvreuse.request import Request
from kvreuse.sampling import TokenLogprobs


@dataclass
class Sample:
    """One sample: the scheduler's request and its output so far."""

    request: Request
    output: CompletionOutput

    def append(self, token_ids: list[int], logprobs: list[TokenLogprobs | None], now: float,
               metrics: RequestMetrics) -> None:
        """Record a step's tokens (its SamplingState already has them): the request's, the output's and its
        delta; the first one sets the time to first token."""
        request, output = self.request, self.output
        for token_id, token_logprobs in zip(token_ids, logprobs):
            request.append_token(token_id)
            output.token_ids.append(token_id)
            output.token_ids_delta.append(token_id)
            if output.logprobs is not None:
                output.logprobs.append(token_logprobs)
        if request.first_token_time is None:
            request.first_token_time = now
            if metrics.first_token_time is None:
                metrics.first_token_time = now


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sample]
    arrival_time: float
    pin_specs: list[PinSpec] = field(default_factory=list)  # pinned once computed (by sequence 0)
    pins_saved: list[str] = field(default_factory=list)
    pins_hit: list[str] = field(default_factory=list)
    owner: str | None = None  # the tenant that sent it (None: no keys, or the offline API)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def finished(self) -> bool:
        return all(seq.output.finished for seq in self.sequences)

    def to_output(self, cached_by_tier: Callable[[Request], dict[str, int] | None]) -> RequestOutput:
        """The request's output now; each sample's token delta is handed over once (and reset)."""
        outputs = []
        for sequence in self.sequences:
            output = sequence.output
            outputs.append(CompletionOutput(
                index=output.index, token_ids=list(output.token_ids), finish_reason=output.finish_reason,
                stop_reason=output.stop_reason, token_ids_delta=output.token_ids_delta,
                logprobs=list(output.logprobs) if output.logprobs is not None else None,
            ))
            output.token_ids_delta = []
        first = self.sequences[0].request
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            cached_tokens_by_tier=cached_by_tier(first),
            num_moved_tokens=first.num_moved_tokens,
            num_recomputed_tokens=first.num_recomputed_tokens,
            num_drafts=sum(sample.request.num_drafts for sample in self.sequences),
            num_draft_tokens=sum(sample.request.num_draft_tokens for sample in self.sequences),
            num_accepted_draft_tokens=sum(sample.request.num_accepted_draft_tokens for sample in self.sequences),
            metrics=self.metrics,
            pins_saved=list(self.pins_saved),
            pins_hit=list(self.pins_hit),
        )
