"""Speculative decoding's counters, under vLLM's ``vllm:spec_decode_*`` names (the server exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def acceptance_rate(num_accepted: float, num_draft_tokens: float) -> float:
    """Accepted over drafted tokens (0 before any draft)."""
    return num_accepted / num_draft_tokens if num_draft_tokens else 0.0


def mean_acceptance_length(num_accepted: float, num_drafts: float) -> float:
    """Tokens a verification step yielded: 1 (the target's own) + accepted drafts per draft made (0 before any)."""
    return 1 + num_accepted / num_drafts if num_drafts else 0.0


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters, as vLLM's ``vllm:spec_decode_*`` metrics."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verifications of at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "spec_decode_mean_acceptance_length": mean_acceptance_length(self.num_accepted_tokens, self.num_drafts),
        }
