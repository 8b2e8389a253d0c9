"""Backend state of the router: health probes, /metrics scrapes and per-backend counters.

A `BackendPool` owns one `Backend` per ``--backend`` URL. The router's own accounting (in flight,
queued prefill tokens, decoding) is updated by the proxy as requests go and come back; KV usage and
the prefix-cache hit rate come from the backend's ``/metrics``, scraped with each health probe. The
model card (``/v1/models``) gives the KV pool size, adapters, speculative draft and the remote KV tier
the backend shares (``kv_remote``), read at start and again when a backend comes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.router.policy import BackendLoad

logger = logging.getLogger("kvreuse.router")

# Sample names (a counter's sample carries the "_total" its family name drops).
_SCRAPED = frozenset({"kvreuse:kv_cache_usage_perc", "kvreuse:num_requests_running", "kvreuse:num_requests_waiting",
                      "kvreuse:prefix_cache_hits_total", "kvreuse:prefix_cache_queries_total"})


def parse_metrics(text: str) -> dict[str, float]:
    """The kvreuse gauges and counters the router reads, from Prometheus text exposition.

    A server labels them with its one ``model_name``, so each name has one sample; unparsable text
    raises ValueError.
    """
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name in _SCRAPED}


def remote_group_of(card: dict[str, Any]) -> str | None:
    """The remote group of a /v1/models base card: "<url_digest>/<fingerprint>" of its ``kv_remote``
    (the same Redis database and the same model fingerprint), None without one."""
    remote = card.get("kv_remote")
    if not isinstance(remote, dict):
        return None
    digest, fingerprint = remote.get("url_digest"), remote.get("fingerprint")
    if not (isinstance(digest, str) and digest and isinstance(fingerprint, str) and fingerprint):
        return None
    return f"{digest}/{fingerprint}"


KV_EVENT_PAGES_PER_PROBE = 8  # pages of KV events (4,096 each) one probe applies before it yields


@dataclass
class Backend:
    name: str  # the URL as given, without a trailing slash
    load: BackendLoad = field(default_factory=BackendLoad)
    capacity_blocks: int | None = None
    model_name: str | None = None
    max_model_len: int | None = None
    # LoRA adapters the backend serves: name -> digest of its weights (its cache identity), from /v1/models.
    adapters: dict[str, str] = field(default_factory=dict)
    # Digest of the speculative draft the backend runs (None: none), from /v1/models: its engine keys
    # every block with it, so the router's keys for this backend must too.
    draft_digest: str | None = None
    # The remote KV tier the backend shares ("<url digest>/<model fingerprint>" from its card's kv_remote;
    # None: none): backends showing the same one read each other's blocks.
    kv_remote: str | None = None
    # A hybrid model's server (its card's "recurrent_state"): it reuses a prefix only from a state snapshot on it.
    recurrent_state: bool = False
    consecutive_failures: int = 0
    routed_requests: int = 0
    routed_matched_tokens: int = 0  # the router's estimate of prompt tokens it sent to a warm cache
    routed_remote_tokens: int = 0  # ... and of those the backend loads from its remote KV tier
    reported_prompt_tokens: int = 0  # from usage in the backend's replies
    reported_cached_tokens: int = 0
    reported_cached_by_tier: dict[str, int] = field(default_factory=dict)  # kvreuse's usage extension
    failed_requests: int = 0
    server_metrics: dict[str, float] = field(default_factory=dict)
    # KV events (GET /v1/cache/events): "live" while the index follows them, "unavailable" when the
    # server has none (the index is the router's own guess), "lost" after a gap in the sequence.
    kv_events: str = "unknown"
    kv_events_epoch: str | None = None
    kv_events_after: int = 0
    kv_events_applied: int = 0
    kv_events_lost: int = 0

    @property
    def hit_rate(self) -> float | None:
        """The backend's own prefix-cache hit rate (hit tokens / looked-up tokens), all time."""
        queries = self.server_metrics.get("kvreuse:prefix_cache_queries_total")
        hits = self.server_metrics.get("kvreuse:prefix_cache_hits_total")
        if not queries or hits is None:
            return None
        return hits / queries

    def describe(self, estimated_cached_blocks: int) -> dict[str, Any]:
        return {
            "url": self.name, "healthy": self.load.healthy, "model": self.model_name,
            "draft_digest": self.draft_digest, "kv_remote": self.kv_remote,
            "in_flight": self.load.in_flight, "queued_prefill_tokens": self.load.queued_prefill_tokens,
            "decoding": self.load.num_decoding, "kv_usage": self.load.kv_usage,
            "num_requests_running": self.server_metrics.get("kvreuse:num_requests_running"),
            "num_requests_waiting": self.load.num_waiting,
            "estimated_cached_blocks": estimated_cached_blocks, "capacity_blocks": self.capacity_blocks,
            "routed_requests": self.routed_requests, "routed_matched_tokens": self.routed_matched_tokens,
            "routed_remote_tokens": self.routed_remote_tokens,
            "reported_prompt_tokens": self.reported_prompt_tokens,
            "reported_cached_tokens": self.reported_cached_tokens,
            "reported_cached_by_tier": dict(self.reported_cached_by_tier), "failed_requests": self.failed_requests,
            "hit_rate": self.hit_rate, "kv_events": self.kv_events, "kv_events_applied": self.kv_events_applied,
            "kv_events_lost": self.kv_events_lost,
        }


class BackendPool:
    """Probes every backend's ``/health`` (the router's state calls `probe_all` on its interval); calls
    back when one goes down or up."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient,
                 probe_timeout_s: float = 2.0, on_down: Callable[[Backend], None] | None = None,
                 on_up: Callable[[Backend], None] | None = None, block_size: int = 16,
                 on_kv_events: Callable[[Backend, list[tuple[str, bytes]]], None] | None = None,
                 on_kv_reset: Callable[[Backend], None] | None = None, api_key: str | None = None,
                 on_card: Callable[[Backend], None] | None = None) -> None:
        if not urls:
            raise ValueError("backend: give at least one --backend URL")
        names = [url.rstrip("/") for url in urls]
        if len(set(names)) != len(names):
            raise ValueError(f"backend: the same URL is given twice in {urls}")
        for name in names:
            if not name.startswith(("http://", "https://")):
                raise ValueError(f"backend must be an http:// or https:// URL, got {name!r}")
        self.backends: dict[str, Backend] = {name: Backend(name) for name in names}
        self._client = client
        self._block_size = block_size
        self._on_kv_events = on_kv_events
        self._on_kv_reset = on_kv_reset
        # The router's own calls (model card, KV events) carry this key; requests carry the client's.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._probe_timeout_s = probe_timeout_s
        self._on_down = on_down
        self._on_up = on_up
        self._on_card = on_card  # after each model card read (remote group, draft, adapters may change)

    @property
    def loads(self) -> dict[str, BackendLoad]:
        return {name: backend.load for name, backend in self.backends.items()}

    def mark_down(self, backend: Backend, why: str) -> None:
        if backend.load.healthy:
            logger.warning("backend %s is down (%s): out of rotation, its index entries dropped", backend.name, why)
            backend.load.healthy = False
            if self._on_down is not None:
                self._on_down(backend)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(backend) for backend in self.backends.values()))

    async def probe(self, backend: Backend) -> None:
        try:
            response = await self._client.get(f"{backend.name}/health", timeout=self._probe_timeout_s)
            healthy = response.status_code == 200
            why = f"/health answered {response.status_code}"
        except httpx.HTTPError as error:
            healthy, why = False, f"{type(error).__name__}: {error}"
        if not healthy:
            backend.consecutive_failures += 1
            self.mark_down(backend, why)
            return
        backend.consecutive_failures = 0
        if backend.model_name is None or not backend.load.healthy:
            # Read again when a backend comes back: a restarted server may run another draft or adapters.
            await self._read_model_card(backend)
        await self._scrape(backend)
        if self._on_kv_events is not None and backend.kv_events != "unavailable":
            await self._read_kv_events(backend)
        if not backend.load.healthy:
            logger.info("backend %s is back: it rejoins with an empty index", backend.name)
            backend.load.healthy = True
            if self._on_up is not None:
                self._on_up(backend)

    async def _read_model_card(self, backend: Backend) -> None:
        try:
            response = await self._client.get(f"{backend.name}/v1/models", timeout=self._probe_timeout_s,
                                              headers=self._headers)
            cards = response.json()["data"]
            card = cards[0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return
        # kvreuse lists each adapter after the base model, with its parent and the digest its KV is keyed by.
        backend.adapters = {
            entry["id"]: entry["adapter_digest"] for entry in cards[1:]
            if isinstance(entry, dict) and isinstance(entry.get("id"), str)
            and isinstance(entry.get("adapter_digest"), str) and entry.get("parent") == card.get("id")
        }
        backend.model_name = card.get("id")
        backend.max_model_len = card.get("max_model_len")
        draft_digest = card.get("draft_digest")
        draft_digest = draft_digest if isinstance(draft_digest, str) and draft_digest else None
        if draft_digest != backend.draft_digest:
            logger.info("backend %s %s", backend.name, f"runs the speculative draft {draft_digest}: its blocks are "
                        "keyed with that digest" if draft_digest else "runs no speculative draft")
        backend.draft_digest = draft_digest
        # A server that reports its KV pool size (kvreuse does) sets the bound of its share of the index.
        capacity = card.get("kv_cache_blocks") or card.get("num_gpu_blocks")
        if isinstance(capacity, int) and capacity > 0:
            backend.capacity_blocks = capacity
        block_size = card.get("kv_block_size")
        if isinstance(block_size, int) and block_size != self._block_size:
            logger.warning("backend %s caches blocks of %d tokens, the router hashes blocks of %d "
                           "(--block-size): its prefix matches will be off", backend.name, block_size,
                           self._block_size)
        backend.recurrent_state = card.get("recurrent_state") is True
        kv_remote = remote_group_of(card)
        if kv_remote != backend.kv_remote:
            logger.info("backend %s %s", backend.name, f"shares the remote KV tier {kv_remote}" if kv_remote
                        else "has no remote KV tier")
        backend.kv_remote = kv_remote
        if self._on_card is not None:
            self._on_card(backend)

    async def _read_kv_events(self, backend: Backend) -> None:
        """Apply the backend's KV events since the last read (a few pages at most per probe)."""
        for _ in range(KV_EVENT_PAGES_PER_PROBE):
            try:
                response = await self._client.get(f"{backend.name}/v1/cache/events", headers=self._headers,
                                                  params={"after": backend.kv_events_after},
                                                  timeout=self._probe_timeout_s)
            except httpx.HTTPError:
                return  # the health probe decides about the backend; the index keeps its guesses
            if response.status_code in (404, 405):
                logger.info("backend %s publishes no KV events: the router estimates its cache", backend.name)
                backend.kv_events = "unavailable"
                return
            try:
                page = response.json()
                epoch, events = page["epoch"], page["events"]
                next_after, lost = int(page["next_after"]), int(page["lost"])
                decoded = [(event["type"], bytes.fromhex(event["key"])) for event in events]
            except (ValueError, KeyError, TypeError):
                logger.warning("backend %s: unreadable KV events (HTTP %d)", backend.name, response.status_code)
                return
            if epoch != backend.kv_events_epoch:
                if backend.kv_events_epoch is not None:
                    # The server restarted: its cache is empty, whatever the index believed.
                    logger.info("backend %s restarted (new KV event epoch): its index entries dropped",
                                backend.name)
                    if self._on_kv_reset is not None:
                        self._on_kv_reset(backend)
                backend.kv_events_epoch, backend.kv_events_after = epoch, 0
                continue
            if lost:
                backend.kv_events_lost += lost
                logger.warning("backend %s: %d KV events lost (the router fell behind); its index is a "
                               "guess until the evicted blocks age out", backend.name, lost)
            backend.kv_events = "lost" if backend.kv_events_lost else "live"
            if decoded:
                self._on_kv_events(backend, decoded)
                backend.kv_events_applied += len(decoded)
            backend.kv_events_after = next_after
            if not decoded:
                return

    async def _scrape(self, backend: Backend) -> None:
        try:
            response = await self._client.get(f"{backend.name}/metrics", timeout=self._probe_timeout_s)
        except httpx.HTTPError:
            return
        if response.status_code != 200:
            return
        try:
            backend.server_metrics = parse_metrics(response.text)
        except ValueError as error:
            logger.warning("backend %s: unreadable /metrics (%s)", backend.name, error)
            return
        backend.load.kv_usage = backend.server_metrics.get("kvreuse:kv_cache_usage_perc", 0.0)
        backend.load.num_waiting = int(backend.server_metrics.get("kvreuse:num_requests_waiting", 0))
