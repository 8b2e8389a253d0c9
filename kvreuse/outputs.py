"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    logprobs: list[Any] | None = None  # one kvreuse.sampling.TokenLogprobs per token when asked
    # Deltas since the previous output of this request (what a stream sends).
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_computed_prompt_tokens: int = 0  # prompt tokens that paid for prefill

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the cache: prefix hits and moved tokens (issue 39)
    metrics: RequestMetrics
    pins_saved: list[str] = field(default_factory=list)  # pins this request created (explicit caching)
    pins_hit: list[str] = field(default_factory=list)  # pinned entries this request reused
    # Where the cached tokens came from when KV tiers are on: device, host, disk, remote (None: no tiers).
    cached_tokens_by_tier: dict[str, int] | None = None
    # Reuse beyond the prefix (chunk_reuse): cached tokens whose K/V was moved in from other positions, and how
    # many of them the blend recomputed.
    num_moved_tokens: int = 0
    num_recomputed_tokens: int = 0
    # Speculative decoding, over the request's samples: verifications, drafted tokens verified, accepted ones.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
