"""What the engine reports about itself: ``EngineStats`` (a snapshot of its counters, read by
``LLM.stats`` and the server's metrics) and ``StepTiming`` (where one step's time went)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreuse.cache.manager import CacheStats
from kvreuse.spec.stats import SpecDecodeStats


@dataclass
class EngineStats:
    cache: CacheStats
    num_running: int
    num_waiting: int
    num_preemptions: int
    prompt_tokens: int  # prompt tokens of admitted requests
    generation_tokens: int
    steps: int
    num_loras_resident: int = 0
    # LoRA adapters (by name) of the running and of the waiting requests, and the most that run at once
    # (0 without LoRA): vLLM's lora_requests_info, which the Gateway API Inference Extension reads.
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    spec_decode: SpecDecodeStats | None = None
    tiers: dict[str, dict[str, Any]] | None = None  # per tier: queries, hits, bytes, times, verify failures

    def as_dict(self) -> dict[str, Any]:
        cache = self.cache
        spec = self.spec_decode.as_dict() if self.spec_decode is not None else {}
        if self.tiers is not None:
            spec = spec | {"kv_tiers": self.tiers}
        if cache.state_snapshot_budget_bytes:  # a hybrid model's recurrent-state snapshots
            spec = spec | {"state_snapshots": cache.state_snapshots, "state_snapshot_bytes": cache.state_snapshot_bytes,
                           "state_snapshot_budget_bytes": cache.state_snapshot_budget_bytes,
                           "state_snapshot_lent_bytes": cache.state_snapshot_lent_bytes}
        return spec | {
            "prefix_cache_queries_tokens": cache.query_tokens,
            "prefix_cache_hits_tokens": cache.hit_tokens,
            "prefix_cache_hit_rate": cache.hit_rate,
            "prefix_cache_evicted_blocks": cache.evicted_blocks,
            "blocks_total": cache.num_blocks,
            "blocks_in_use": cache.blocks_in_use,
            "blocks_idle_cached": cache.blocks_idle,
            "blocks_free": cache.blocks_free,
            "kv_cache_usage": cache.usage,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "steps": self.steps,
            "num_loras_resident": self.num_loras_resident,
        }


@dataclass
class StepTiming:
    """Where one engine step's time went. On CPU the forward is synchronous, so the split is exact."""

    num_tokens: int  # tokens the model ran (prefill chunks, decodes, drafted tokens to verify)
    num_seqs: int
    step_s: float  # the whole engine step: schedule, batch metadata, forward, sampling, cache updates
    forward_s: float  # of which the model's forward and logits
    output_s: float = 0.0  # after the step: detokenizing and stop strings (added by step_and_process)

    @property
    def overhead_s(self) -> float:
        """Time outside the model: everything but the forward, output processing included."""
        return self.step_s - self.forward_s + self.output_s
