"""SpeculativeConfig: vLLM's ``speculative_config`` dict, validated once at start-up.

``{"method": "eagle" | "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": k}`` with vLLM's
names; a bad value fails with the field named, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("eagle", "eagle3")
# Verification computes 1 + k target tokens per step; beyond this a draft that is ever wrong costs
# more in rejected rows than it can save.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    model: str  # the draft's folder
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config.model must name the draft's folder")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict, or the JSON text of ``--speculative-config``; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"--speculative-config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
        known = {"method", "model", "num_speculative_tokens"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        missing = sorted(name for name in known if name not in value)
        if missing:
            raise ValueError(f"speculative_config lacks {', '.join(missing)}")
        return cls(method=value["method"], model=str(value["model"]),
                   num_speculative_tokens=value["num_speculative_tokens"])
