"""Prometheus metrics at ``/metrics`` (names as vLLM's, prefix ``kvreuse:``) and the periodic stats log.

The gauges that load-aware routers read are also exported under vLLM's own names and labels
(``model_name``, ``engine``), so the Gateway API Inference Extension's endpoint picker, llm-d and other
tools written for vLLM read a kvreuse server unchanged: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info`` (value: the
time of the snapshot; labels ``max_lora``, ``running_lora_adapters``, ``waiting_lora_adapters``, adapter
names comma-separated) and ``vllm:cache_config_info`` (value 1; the KV pool's settings as labels).

Everything lives in a `CollectorRegistry` owned by one `ServerMetrics` (no module globals, so two
apps in one process never share counters). Engine totals (cache queries and hits, tokens,
preemptions, evictions, running / waiting, KV usage) are read from the latest `EngineStats` snapshot
when Prometheus scrapes; per-request latencies are histograms the engine loop observes as outputs
come out of the engine. With speculative decoding the engine's draft counters are exported too
(``kvreuse:spec_decode_*``: vLLM's ``spec_decode_*`` names under kvreuse's prefix, not under ``vllm:``), with the
acceptance rate and mean acceptance length as gauges; without it they are absent. With KV tiers
(host, disk, remote) their counters are exported with a ``tier`` label (``kvreuse:kv_tier_*``);
without tiers they are absent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvreuse.config import EngineConfig
from kvreuse.engine.stats import EngineStats
from kvreuse.spec.stats import SpecDecodeStats, acceptance_rate, mean_acceptance_length

PREFIX = "kvreuse:"
VLLM_PREFIX = "vllm:"
VLLM_ENGINE = "0"  # vLLM's ``engine`` label: the engine index within a server (kvreuse runs one)
FINISH_REASONS = ("stop", "length", "abort")
# Buckets reach down to a millisecond: a cached prefill or a GPU decode step is that fast.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                       0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
               45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


# The reasons kvreuse.cache.tiers.record gives for a refused record: present at 0 from the start (a
# reason not listed here still shows up once it happens).
VERIFY_FAILURE_REASONS = ("format", "fingerprint", "key", "tokens", "layout", "checksum", "truncated")
# (metric name, key in EngineStats.tiers[tier], help) of the per-tier KV counters.
_TIER_COUNTERS = (
    ("kv_tier_queries", "queries", "Blocks looked up in a KV tier (a lookup stops at the first miss)."),
    ("kv_tier_hits", "hits", "Blocks loaded from a KV tier into the device pool."),
    ("kv_tier_hit_bytes", "hit_bytes", "Bytes of KV loaded from a tier into the device pool."),
    ("kv_tier_stores", "stores", "Blocks written to a KV tier."),
    ("kv_tier_store_bytes", "store_bytes", "Bytes written to a KV tier (records with their headers)."),
    ("kv_tier_load_seconds", "load_seconds", "Seconds spent reading a KV tier (lookups, on the engine thread)."),
    ("kv_tier_store_seconds", "store_seconds", "Seconds spent writing a KV tier (the background writer)."),
    ("kv_tier_write_errors", "write_errors", "Blocks a KV tier failed to write (a full disk, an unreachable Redis); "
                                             "the block stays in memory, nothing partial is left."),
    ("kv_tier_write_drops", "write_drops", "Blocks not queued for a KV tier's writer because its queue was full "
                                           "(kv_write_queue_size) or the writer had ended."),
    ("kv_tier_state_lookups", "state_lookups", "A hybrid model's recurrent-state lookups that asked a KV tier."),
    ("kv_tier_state_hits", "state_hits", "A hybrid model's recurrent states loaded from a KV tier (a request resumed "
                                         "there)."),
    ("kv_tier_state_stores", "state_stores", "A hybrid model's recurrent states written to a KV tier (also counted "
                                             "in kv_tier_stores)."),
)


class ServerMetrics:
    """The server's Prometheus registry. ``engine_stats`` returns the latest engine snapshot;
    ``tier_stats`` (with KV tiers) returns the tiers' counters now: the background writer updates them
    after the engine step that queued the blocks, so the step's snapshot would lag while the engine idles."""

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats],
                 tier_stats: Callable[[], dict[str, dict[str, Any]] | None] | None = None,
                 cache_config: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time from the request reaching the server's handler to its first token.",
            labels, registry=self.registry, buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Time between two engine outputs of one request.",
            labels, registry=self.registry, buckets=INTER_TOKEN_BUCKETS,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Time from arrival to the last token of a request.",
            labels, registry=self.registry, buckets=E2E_BUCKETS,
        ).labels(model_name)
        self._request_success = Counter(
            f"{PREFIX}request_success", "Finished requests by finish reason (stop, length, abort).",
            [*labels, "finished_reason"], registry=self.registry,
        )
        for reason in FINISH_REASONS:  # present from the start, so rates work before the first one
            self._request_success.labels(model_name, reason)
        self.prompt_tokens_cached = Counter(
            f"{PREFIX}prompt_tokens_cached", "Prompt tokens of requests that were served from the prefix cache.",
            labels, registry=self.registry,
        ).labels(model_name)
        # Chunk reuse (issue 39): of the cached prompt tokens, those moved in from other positions, and the
        # ones among them recomputed to blend them in.
        self.prompt_tokens_moved = Counter(
            f"{PREFIX}prompt_tokens_moved", "Cached prompt tokens whose K/V was moved in from other positions "
            "(chunk hits and turns moved earlier).", labels, registry=self.registry,
        ).labels(model_name)
        self.prompt_tokens_recomputed = Counter(
            f"{PREFIX}prompt_tokens_recomputed", "Moved prompt tokens recomputed to blend them into their new context.",
            labels, registry=self.registry,
        ).labels(model_name)
        # Requests per LoRA adapter (mirrors vLLM's lora_requests_info; "" is the base model).
        self._lora_requests = Counter(
            f"{PREFIX}lora_requests", "Generation requests by the LoRA adapter they ran with ('' = base model).",
            [*labels, "lora_name"], registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(model_name, engine_stats, tier_stats))
        self.registry.register(_VLLMCollector(model_name, engine_stats, cache_config or {}))

    def request_started(self, lora_name: str | None) -> None:
        self._lora_requests.labels(self.model_name, lora_name or "").inc()

    def request_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        """(Prometheus text exposition, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineStatsCollector:
    """Engine counters and gauges, read from the snapshot at scrape time."""

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats],
                 tier_stats: Callable[[], dict[str, dict[str, Any]] | None] | None = None) -> None:
        self._model_name = model_name
        self._engine_stats = engine_stats
        self._tier_stats = tier_stats

    def collect(self) -> Iterable[Metric]:
        stats = self._engine_stats()
        cache = stats.cache
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", cache.query_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", cache.hit_tokens),
            ("prompt_tokens", "Prompt tokens of admitted requests.", stats.prompt_tokens),
            ("generation_tokens", "Generated tokens.", stats.generation_tokens),
            ("num_preemptions", "Requests preempted to free KV blocks.", stats.num_preemptions),
            ("prefix_cache_evictions", "Cached KV blocks evicted to make room.", cache.evicted_blocks),
        )
        for name, documentation, value in counters:
            family = CounterMetricFamily(f"{PREFIX}{name}", documentation, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
        gauges = (
            ("num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("num_requests_waiting", "Sequences waiting to be admitted.", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).", cache.usage),
            ("lora_resident_adapters", "LoRA adapters loaded on the device (at most max_loras).",
             stats.num_loras_resident),
        )
        if cache.state_snapshot_budget_bytes:  # a hybrid model's recurrent-state snapshots
            gauges += (
                ("state_snapshots", "Recurrent-state snapshots kept (a hybrid model's hits resume from them).",
                 cache.state_snapshots),
                ("state_snapshot_bytes", "Bytes the recurrent-state snapshots hold.", cache.state_snapshot_bytes),
                ("state_snapshot_budget_bytes", "The snapshots' budget (state_snapshot_fraction of the pool).",
                 cache.state_snapshot_budget_bytes),
                ("state_snapshot_lent_bytes", "Idle running-request state slots lent to the snapshots beyond the "
                 "budget (called back at admission).", cache.state_snapshot_lent_bytes),
            )
        for name, documentation, value in gauges:
            family = GaugeMetricFamily(f"{PREFIX}{name}", documentation, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
        if stats.spec_decode is not None:
            yield from self._spec_decode(stats.spec_decode)
        tiers = self._tier_stats() if self._tier_stats is not None else stats.tiers
        if tiers is not None:
            yield from self._kv_tiers(tiers)

    def _kv_tiers(self, tiers: dict[str, dict[str, Any]]) -> Iterable[Metric]:
        """Per-tier counters of the KV tiers behind the device pool (label ``tier``: host, disk, remote),
        from one consistent copy (``TieredStore.snapshot``, as in ``EngineStats.tiers``)."""
        for name, key, documentation in _TIER_COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}{name}", documentation, labels=["model_name", "tier"])
            for tier, counts in tiers.items():
                family.add_metric([self._model_name, tier], counts.get(key, 0))
            yield family
        family = CounterMetricFamily(
            f"{PREFIX}kv_tier_verify_failures",
            "Stored blocks refused when read back, by tier and reason (format, fingerprint, key, tokens, layout, "
            "checksum, truncated); each is served as a miss and dropped from its tier.",
            labels=["model_name", "tier", "reason"],
        )
        for tier, counts in tiers.items():
            failures = counts.get("verify_failures") or {}
            for reason in dict.fromkeys((*VERIFY_FAILURE_REASONS, *failures)):
                family.add_metric([self._model_name, tier, reason], failures.get(reason, 0))
        yield family

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterable[Metric]:
        """vLLM's spec_decode counters. The engine thread updates ``spec`` while this reads it: the
        per-position counts are read first and the accepted total is their sum (the engine's rule), so
        one scrape never shows them apart, nor more accepted than drafted tokens (counted before)."""
        per_position = list(spec.accepted_per_position)
        counters = (
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", sum(per_position)),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
            ("spec_decode_num_drafts", "Verifications of at least one draft token.", spec.num_drafts),
        )
        for name, documentation, value in counters:
            family = CounterMetricFamily(f"{PREFIX}{name}", documentation, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
        family = CounterMetricFamily(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first drafted token).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(per_position):
            family.add_metric([self._model_name, str(position)], count)
        yield family
        accepted, drafted = sum(per_position), spec.num_draft_tokens
        for name, documentation, value in (
                ("spec_decode_acceptance_rate", "Accepted over drafted tokens since start.",
                 acceptance_rate(accepted, drafted)),
                ("spec_decode_mean_acceptance_length",
                 "Tokens a verification step yielded since start: 1 + accepted tokens per draft.",
                 mean_acceptance_length(accepted, spec.num_drafts))):
            gauge = GaugeMetricFamily(f"{PREFIX}{name}", documentation, labels=["model_name"])
            gauge.add_metric([self._model_name], value)
            yield gauge


def cache_config_labels(config: EngineConfig, num_blocks: int) -> dict[str, str]:
    """vllm:cache_config_info's labels: the KV pool's settings under vLLM's CacheConfig names (values as
    vLLM renders them: ``str`` of each; ``num_gpu_blocks`` is the pool's block count on any device),
    plus kvreuse's byte budget."""
    cache = config.cache
    return {"block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching), "num_gpu_blocks": str(num_blocks),
            "kv_cache_memory": str(cache.kv_cache_memory)}


class _VLLMCollector:
    """The gauges routers written for vLLM read, under vLLM's names and labels, from the same snapshot."""

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats], cache_config: dict[str, str]) -> None:
        self._labels = [model_name, VLLM_ENGINE]
        self._engine_stats = engine_stats
        self._cache_config = dict(cache_config)

    def collect(self) -> Iterable[Metric]:
        stats = self._engine_stats()
        gauges = (
            ("num_requests_running", "Number of requests in model execution batches.", stats.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.cache.usage),
        )
        for name, documentation, value in gauges:
            family = GaugeMetricFamily(f"{VLLM_PREFIX}{name}", documentation, labels=["model_name", "engine"])
            family.add_metric(self._labels, value)
            yield family
        family = GaugeMetricFamily(f"{VLLM_PREFIX}lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric([str(stats.max_loras), ",".join(stats.waiting_adapters), ",".join(stats.running_adapters)],
                          time.time())
        yield family
        if self._cache_config:
            names = sorted(self._cache_config)
            family = GaugeMetricFamily(f"{VLLM_PREFIX}cache_config_info", "Information of the LLMEngine CacheConfig",
                                       labels=names)
            family.add_metric([self._cache_config[name] for name in names], 1.0)
            yield family


@dataclass
class _Totals:
    time: float
    prompt_tokens: int
    generation_tokens: int
    query_tokens: int
    hit_tokens: int
    steps: int
    draft_tokens: int = 0  # speculative decoding (0 without it)
    accepted_tokens: int = 0
    drafts: int = 0

    @classmethod
    def of(cls, stats: EngineStats, now: float) -> _Totals:
        spec = stats.spec_decode
        return cls(now, stats.prompt_tokens, stats.generation_tokens, stats.cache.query_tokens,
                   stats.cache.hit_tokens, stats.steps,
                   *((spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_drafts) if spec is not None else ()))


class PeriodicStatsLogger:
    """One log line per interval while the engine works: throughput, queue, KV usage, hit rate."""

    def __init__(self, interval_s: float, logger: logging.Logger, first: EngineStats) -> None:
        self.interval_s = interval_s
        self._logger = logger
        self._last = _Totals.of(first, time.monotonic())

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def seconds_until_due(self, stats: EngineStats, now: float) -> float | None:
        """How long an idle engine loop may sleep before the last busy interval must be logged;
        None when nothing happened since the last line (sleep until work arrives)."""
        if not self.enabled or stats.steps == self._last.steps:
            return None
        return max(0.0, self._last.time + self.interval_s - now)

    def maybe_log(self, stats: EngineStats, now: float) -> None:
        if not self.enabled or now - self._last.time < self.interval_s:
            return
        current = _Totals.of(stats, now)
        last, self._last = self._last, current
        if current.steps == last.steps:
            return  # idle the whole interval: nothing worth a line
        elapsed = current.time - last.time
        queries = current.query_tokens - last.query_tokens
        hits = current.hit_tokens - last.hit_tokens
        interval_hit_rate = f"{100 * hits / queries:.1f}%" if queries else "n/a"
        self._logger.info(
            "engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV usage %.1f%%, "
            "prefix-cache hit rate %s (last %.0f s), %.1f%% (all time)",
            (current.prompt_tokens - last.prompt_tokens) / elapsed,
            (current.generation_tokens - last.generation_tokens) / elapsed,
            stats.num_running, stats.num_waiting, 100 * stats.cache.usage,
            interval_hit_rate, elapsed, 100 * stats.cache.hit_rate,
        )
        if stats.spec_decode is not None:
            drafted = current.draft_tokens - last.draft_tokens
            accepted = current.accepted_tokens - last.accepted_tokens
            drafts = current.drafts - last.drafts
            self._logger.info(
                "speculative decoding: acceptance rate %s, mean acceptance length %s, %d of %d draft tokens "
                "accepted (last %.0f s); acceptance rate %.1f%% (all time)",
                f"{100 * accepted / drafted:.1f}%" if drafted else "n/a",
                f"{1 + accepted / drafts:.2f}" if drafts else "n/a", accepted, drafted, elapsed,
                100 * stats.spec_decode.acceptance_rate,
            )
