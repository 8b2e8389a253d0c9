"""The router's HTTP side: a FastAPI app that routes OpenAI requests to backends and passes replies through.

Completions and chat completions are routed by the policy (kvreuse.router.policy); every other path
goes to any healthy backend, except the live dashboard (``GET /dashboard``, ``GET /v1/cache/dashboard``),
which the router answers itself from every backend's (kvreuse/observatory/dashboard_fleet.py).
Replies pass through byte for byte (status, headers, body, SSE events). A kvreuse server sends
nothing, not even headers, before the first token, so "before the first byte" is "before the
response headers": until then a failed attempt (connection error, 429, 502, 503, 504) is retried on
another backend, at most ``max_retries`` times, with exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from kvreuse.inputs import InputProcessor
from kvreuse.observatory.dashboard_fleet import BackendTarget, fleet_dashboard
from kvreuse.observatory.dashboard_page import PageConfig, dashboard_page_router
from kvreuse.router.backends import Backend, BackendPool
from kvreuse.router.policy import PolicyConfig, RouteDecision, Router, RouteRequest
from kvreuse.router.prompts import Namespace, cache_salt_of, prompt_of, route_request
from kvreuse.server.errors import unavailable
from kvreuse.tokenizer import Tokenizer

logger = logging.getLogger("kvreuse.router")

RETRY_STATUSES = frozenset({429, 502, 503, 504})
SESSION_HEADER = "x-session-id"
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-authorization", "proxy-authenticate", "host"})


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...]
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tokenizer: str | None = None
    default_capacity_blocks: int = 4096  # used when a backend does not report its KV pool size
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    probe_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    kv_events: bool = True  # follow the backends' GET /v1/cache/events where they publish them
    backend_api_key: str | None = None  # for the router's own calls to the backends
    # The backends run with --isolate-tenants: a request's namespace comes from its API key, as theirs do.
    isolate_tenants: bool = False

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("backend: give at least one --backend URL")
        if self.default_capacity_blocks < 1:
            raise ValueError(f"backend_capacity_blocks must be >= 1, got {self.default_capacity_blocks}")
        if not 0 <= self.max_retries <= 10:
            raise ValueError(f"max_retries must be in 0..10, got {self.max_retries}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s}")
        if not self.probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be > 0, got {self.probe_interval_s}")


class RouterMetrics:
    """The router's own Prometheus registry (prefix ``kvreuse_router:``)."""

    def __init__(self, state: RouterState) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvreuse_router:requests", "Routed requests by backend and outcome "
                                "(ok, error_status, failed, no_backend).", ["backend", "outcome"],
                                registry=self.registry)
        self.retries = Counter("kvreuse_router:retries", "Attempts retried on another backend, by reason.",
                               ["reason"], registry=self.registry)
        self.decisions = Counter("kvreuse_router:decisions", "Routing decisions by reason (cache, remote, "
                                 "spill, session, fallback, round-robin, least-loaded).", ["reason"], registry=self.registry)
        self.prompt_tokens = Counter("kvreuse_router:prompt_tokens", "Prompt tokens routed, by backend.",
                                     ["backend"], registry=self.registry)
        self.matched_tokens = Counter("kvreuse_router:matched_tokens", "Prompt tokens routed to a backend "
                                      "believed to hold them, by backend.", ["backend"], registry=self.registry)
        self.remote_matched_tokens = Counter(
            "kvreuse_router:remote_matched_tokens", "Prompt tokens routed to a backend that is believed to "
            "load them from the remote KV tier it shares (not held in its own pool), by backend.", ["backend"],
            registry=self.registry)
        self.registry.register(_BackendCollector(state))


class _BackendCollector:
    def __init__(self, state: RouterState) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        gauges = {
            "healthy": ("1 while the backend passes its health probes.", lambda b: float(b.load.healthy)),
            "in_flight": ("Requests sent to the backend and not finished.", lambda b: b.load.in_flight),
            "queued_prefill_tokens": ("Uncached prompt tokens waiting for their first byte.",
                                      lambda b: b.load.queued_prefill_tokens),
            "estimated_cached_blocks": ("Blocks the router believes the backend holds.",
                                        lambda b: self._state.router.index.num_blocks(b.name)),
            "backend_kv_usage": ("The backend's kvreuse:kv_cache_usage_perc at the last probe.",
                                 lambda b: b.load.kv_usage),
        }
        for name, (documentation, read) in gauges.items():
            family = GaugeMetricFamily(f"kvreuse_router:{name}", documentation, labels=["backend"])
            for backend in self._state.pool.backends.values():
                family.add_metric([backend.name], float(read(backend)))
            yield family


class RouterState:
    """Everything one router app owns: backends, policy, tokenizer, HTTP client, metrics."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s, connect=5.0),
                                                  limits=httpx.Limits(max_connections=1000,
                                                                      max_keepalive_connections=100))
        self.router = Router(config.policy)
        self.pool = BackendPool(list(config.backends), self.client, block_size=config.policy.block_size,
                                on_down=self._backend_down, on_up=self._backend_up,
                                on_kv_events=self._apply_kv_events if config.kv_events else None,
                                on_kv_reset=self._backend_down, api_key=config.backend_api_key,
                                on_card=self._card_read)
        for name in self.pool.backends:
            self.router.index.add_backend(name, config.default_capacity_blocks)
        # The servers' own input processing (chat template, encode), so the router's token ids and
        # block keys are theirs; no max_model_len / vocabulary checks: the backend answers those.
        self.inputs: InputProcessor | None = None
        if config.tokenizer is not None:
            tokenizer_dir = config.tokenizer
            if str(tokenizer_dir).lower().endswith(".gguf"):
                from kvreuse.loading.loader import (
                    resolve_tokenizer_path,  # torch: only for a GGUF file's tokenizer
                )

                tokenizer_dir = str(resolve_tokenizer_path(tokenizer_dir))
            self.inputs = InputProcessor(Tokenizer(tokenizer_dir))
        self.metrics = RouterMetrics(self)

    def _backend_down(self, backend: Backend) -> None:
        dropped = self.router.backend_failed(backend.name)
        logger.info("dropped %d index entries of %s", dropped, backend.name)

    def _card_read(self, backend: Backend) -> None:
        self.router.set_remote_group(backend.name, backend.kv_remote)
        if backend.recurrent_state:
            self.router.set_recurrent(backend.name)

    def _apply_kv_events(self, backend: Backend, events: list[tuple[str, bytes]]) -> None:
        index = self.router.index
        for kind, key in events:
            if kind == "stored":
                index.record(backend.name, (key,))
                self.router.record_remote(backend.name, (key,))  # written through to its remote tier
            elif kind == "removed":
                index.remove(backend.name, key)  # gone from its pool, not from the remote
            elif kind == "state_stored":  # a hybrid model's state kept on this block (cache/events.py)
                self.router.record_state(backend.name, (key,))  # and in its remote group's tiers
            elif kind == "state_removed":
                index.remove_state(backend.name, key)  # from its pool; the remote tiers keep their copy

    def _backend_up(self, backend: Backend) -> None:
        self.router.backend_failed(backend.name)  # whatever it held before may be gone (restart)
        self._apply_capacity(backend)

    def _apply_capacity(self, backend: Backend) -> None:
        self.router.index.add_backend(backend.name, backend.capacity_blocks or self.config.default_capacity_blocks)

    async def start(self) -> None:
        await self.pool.probe_all()
        for backend in self.pool.backends.values():
            self._apply_capacity(backend)
        healthy = [b.name for b in self.pool.backends.values() if b.load.healthy]
        logger.info("router over %d backend(s), %d healthy: %s; policy %s", len(self.pool.backends),
                    len(healthy), ", ".join(healthy) or "none", self.config.policy.policy)

    async def run_probes(self) -> None:
        """Forever, each probe interval: probe every backend and forget expired sessions (whose ids
        would otherwise pile up for the router's lifetime); cancelled at shutdown."""
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            await self.pool.probe_all()
            self.router.expire_sessions(time.monotonic())

    @property
    def default_model(self) -> str | None:
        return next((b.model_name for b in self.pool.backends.values() if b.model_name), None)

    def cache_identity(self, model: str | None) -> tuple[str | None, str | None]:
        """(model, adapter digest) of the namespace a backend keys this request's KV under: a name that a
        backend serves as a LoRA adapter is its base model plus the adapter's digest (the engines' rule)."""
        for backend in self.pool.backends.values():
            digest = backend.adapters.get(model) if model is not None else None
            if digest is not None:
                return backend.model_name, digest
        return model, None

    def backend_namespaces(self, model: str | None) -> dict[str, tuple[str | None, str | None, str | None]]:
        """backend -> (model, adapter digest, draft digest) of the namespace that backend keys this
        request's KV under: its own adapter of that name where it serves one (else the fleet's,
        `cache_identity`), and its own speculative draft, so the keys are each engine's own."""
        fleet_model, fleet_adapter = self.cache_identity(model)
        namespaces = {}
        for name, backend in self.pool.backends.items():
            digest = backend.adapters.get(model) if model is not None else None
            if digest is not None:
                namespaces[name] = (backend.model_name, digest, backend.draft_digest)
            else:
                namespaces[name] = (fleet_model, fleet_adapter, backend.draft_digest)
        return namespaces

    def route_request(self, body: Any, chat: bool, session_id: str | None,
                      authorization: str | None = None) -> RouteRequest:
        """The request's block keys (kvreuse.router.prompts), per backend where the backends key it in
        different namespaces (speculative drafts, adapter weights)."""
        if not isinstance(body, dict):
            return RouteRequest((), 0, session_id)
        model = body.get("model") if isinstance(body.get("model"), str) else self.default_model
        try:
            prompt = prompt_of(body, chat, self.inputs)
        except (ValueError, TypeError):  # InvalidRequestError included: the backend answers it with a 400
            prompt = None
        namespaces = {name: Namespace(*namespace) for name, namespace in self.backend_namespaces(model).items()}
        return route_request(prompt, cache_salt_of(body, authorization, self.config.isolate_tenants), session_id,
                             namespaces, self.config.policy.block_size)

    def describe_backends(self) -> dict[str, Any]:
        return {"policy": self.config.policy.policy, "block_size": self.config.policy.block_size,
                "tokenizer": self.config.tokenizer,
                "backends": [backend.describe(self.router.index.num_blocks(name))
                             for name, backend in self.pool.backends.items()],
                "remote_groups": self.describe_remote_groups()}

    def describe_remote_groups(self) -> dict[str, Any]:
        """Remote KV tiers shared by backends: group -> its backends and the blocks the router believes it holds."""
        groups: dict[str, Any] = {}
        for name, backend in self.pool.backends.items():
            if backend.kv_remote is not None:
                group = groups.setdefault(backend.kv_remote, {
                    "backends": [], "estimated_blocks": self.router.remote_index.num_blocks(backend.kv_remote)})
                group["backends"].append(name)
        return groups


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"}


def _reply_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP}


def build_router_app(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        probes = asyncio.create_task(state.run_probes())
        try:
            yield
        finally:
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
            await state.client.aclose()

    app = FastAPI(title="kvreuse router", lifespan=lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = sum(b.load.healthy for b in state.pool.backends.values())
        return JSONResponse({"status": "ok" if healthy else "no healthy backend", "healthy_backends": healthy},
                            status_code=200 if healthy else 503)

    @app.get("/backends")
    async def backends() -> JSONResponse:
        return JSONResponse(state.describe_backends())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # The live dashboard across the backends (before the catch-all, which would proxy it to one backend).
    app.include_router(dashboard_page_router(PageConfig("router", lambda: None)))

    @app.get("/v1/cache/dashboard")
    async def dashboard(request: Request) -> JSONResponse:
        targets = [BackendTarget(name, backend.load.healthy) for name, backend in state.pool.backends.items()]
        return JSONResponse(await fleet_dashboard(state.client, targets, request.headers.get("authorization")))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _routed(state, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _routed(state, request, chat=False)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"])
    async def anything_else(path: str, request: Request) -> Response:
        body = await request.body()
        # No prompt to route by: the least loaded healthy backend answers (round-robin among equals).
        route = RouteRequest((), 0, None)
        return await _proxy(state, request, body, route, path="/" + path, routed=False)

    return app


async def _routed(state: RouterState, request: Request, chat: bool) -> Response:
    body_bytes = await request.body()
    try:
        body = json.loads(body_bytes)
    except ValueError:
        body = None  # forwarded as is: the backend answers with its own 400
    route = state.route_request(body, chat, request.headers.get(SESSION_HEADER), request.headers.get("authorization"))
    return await _proxy(state, request, body_bytes, route, path=request.url.path, routed=True)


async def _proxy(state: RouterState, request: Request, body: bytes, route: RouteRequest, path: str,
                 routed: bool) -> Response:
    config = state.config
    excluded: set[str] = set()
    last_reply: tuple[int, bytes, dict[str, str]] | None = None
    query = f"?{request.url.query}" if request.url.query else ""
    for attempt in range(config.max_retries + 1):
        if attempt:
            await asyncio.sleep(config.retry_backoff_s * 2 ** (attempt - 1))
        try:
            decision = state.router.choose(route, state.pool.loads, time.monotonic(), exclude=excluded)
        except LookupError:
            if not excluded or not any(b.load.healthy for b in state.pool.backends.values()):
                break
            excluded.clear()  # every healthy backend failed this request once: try them again
            decision = state.router.choose(route, state.pool.loads, time.monotonic())
        backend = state.pool.backends[decision.backend]
        load = backend.load
        load.in_flight += 1
        load.queued_prefill_tokens += decision.uncached_tokens
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("route %s: %s (%s), %d of %d blocks cached there (+%d in its remote tier), loads %s",
                         path, backend.name, decision.reason, decision.matched_blocks, decision.remote_blocks,
                         len(route.block_keys),
                         {b.name: (b.load.in_flight, b.load.queued_prefill_tokens, b.load.num_decoding)
                          for b in state.pool.backends.values()})
        if routed:
            # Recorded now, not when the reply starts: a server sends its headers with the first token,
            # and requests sharing this prefix that arrive during its prefill must find it here.
            state.router.record_sent(backend.name, route)
        try:
            upstream = state.client.build_request(request.method, backend.name + path + query, content=body,
                                                  headers=_forward_headers(request))
            response = await _send(state.client, upstream)
        except httpx.TransportError as error:
            load.in_flight -= 1
            state.router.record_finished(backend.name, route)
            load.queued_prefill_tokens -= decision.uncached_tokens
            backend.failed_requests += 1
            if isinstance(error, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
                state.pool.mark_down(backend, f"{type(error).__name__} on a request")
            state.metrics.retries.labels("connection").inc()
            excluded.add(backend.name)
            continue
        except BaseException:
            load.in_flight -= 1
            state.router.record_finished(backend.name, route)
            load.queued_prefill_tokens -= decision.uncached_tokens
            raise
        load.queued_prefill_tokens -= decision.uncached_tokens
        if response.status_code in RETRY_STATUSES and attempt < config.max_retries:
            content = await response.aread()
            await response.aclose()
            load.in_flight -= 1
            state.router.record_finished(backend.name, route)
            state.metrics.retries.labels(str(response.status_code)).inc()
            last_reply = (response.status_code, content, _reply_headers(response))
            excluded.add(backend.name)
            continue
        if routed:
            _count_routed(state, backend, decision, route)
        outcome = "ok" if response.status_code < 400 else "error_status"
        load.num_decoding += 1
        return StreamingResponse(_pass_through(state, backend, route, response, outcome), status_code=response.status_code,
                                 headers=_reply_headers(response))
    state.metrics.requests.labels("", "no_backend").inc()
    if last_reply is not None:
        status, content, headers = last_reply
        return Response(content, status_code=status, headers=headers)
    error = unavailable(f"no healthy backend could take the request after {config.max_retries + 1} attempt(s)",
                        "no_backend")
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


async def _send(client: httpx.AsyncClient, upstream: httpx.Request) -> httpx.Response:
    """``client.send(upstream, stream=True)``; a backend killed while the connection to it was being made can make
    httpcore over anyio raise AttributeError (``getpeername`` on the socket anyio already dropped) rather than a
    transport error: that is the backend failing, so it is a ``ConnectError`` here (retried elsewhere, not a 500)."""
    try:
        return await client.send(upstream, stream=True)
    except AttributeError as error:
        raise httpx.ConnectError(f"the connection closed while it was made: {error}", request=upstream) from error


def _count_routed(state: RouterState, backend: Backend, decision: RouteDecision, route: RouteRequest) -> None:
    block_size = state.config.policy.block_size
    matched_tokens = min(decision.matched_blocks * block_size, route.num_prompt_tokens)
    remote_tokens = min((decision.matched_blocks + decision.remote_blocks) * block_size,
                        route.num_prompt_tokens) - matched_tokens
    backend.routed_requests += 1
    backend.routed_matched_tokens += matched_tokens
    backend.routed_remote_tokens += remote_tokens
    if remote_tokens:
        state.metrics.remote_matched_tokens.labels(backend.name).inc(remote_tokens)
    state.metrics.decisions.labels(decision.reason).inc()
    state.metrics.prompt_tokens.labels(backend.name).inc(route.num_prompt_tokens)
    state.metrics.matched_tokens.labels(backend.name).inc(matched_tokens)


async def _pass_through(state: RouterState, backend: Backend, route: RouteRequest, response: httpx.Response,
                        outcome: str) -> AsyncIterator[bytes]:
    usage = UsageReader(response.headers.get("content-type", ""))
    try:
        async for chunk in response.aiter_raw():
            usage.feed(chunk)
            yield chunk
    except httpx.HTTPError as error:
        # Bytes already reached the client: no retry is possible, the client sees a cut stream.
        outcome = "failed"
        backend.failed_requests += 1
        logger.warning("backend %s failed mid-response: %s", backend.name, error)
        raise
    finally:
        await response.aclose()
        backend.load.num_decoding -= 1
        backend.load.in_flight -= 1
        state.router.record_finished(backend.name, route)
        state.metrics.requests.labels(backend.name, outcome).inc()
        _count_usage(backend, usage.usage())


class UsageReader:
    """The ``usage`` object of a reply, read off the bytes as they pass through.

    An SSE stream (``text/event-stream``) is split into lines as it comes; of its ``data:`` events
    only the last one naming "usage" is kept and decoded at the end (OpenAI's shape: ``"usage": null``
    in every chunk, the numbers in the last one), so a long stream costs one JSON decode. A JSON
    reply is decoded whole at the end. Any other reply has no usage.
    """

    def __init__(self, content_type: str) -> None:
        self._streaming = content_type.startswith("text/event-stream")
        self._json = content_type.startswith("application/json")
        self._pending = bytearray()  # the JSON body so far, or the SSE line not yet complete
        self._usage_event: bytes | None = None

    def feed(self, chunk: bytes) -> None:
        if not (self._streaming or self._json):
            return
        self._pending += chunk
        if not self._streaming:
            return
        end = self._pending.rfind(b"\n")
        if end < 0:
            return
        for line in self._pending[:end].split(b"\n"):
            if line.startswith(b"data:") and b'"usage"' in line:
                self._usage_event = bytes(line[len(b"data:"):])
        del self._pending[:end + 1]

    def usage(self) -> dict[str, Any] | None:
        payload = self._usage_event if self._streaming else bytes(self._pending) if self._json else None
        if payload is None:
            return None
        try:
            document = json.loads(payload)
        except ValueError:  # a reply cut short, or not what its content type says
            return None
        usage = document.get("usage") if isinstance(document, dict) else None
        return usage if isinstance(usage, dict) else None


def _count_usage(backend: Backend, usage: dict[str, Any] | None) -> None:
    if usage is None:
        return
    prompt_tokens = usage.get("prompt_tokens")
    if isinstance(prompt_tokens, int):
        backend.reported_prompt_tokens += prompt_tokens
    details = usage.get("prompt_tokens_details") or {}
    cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached_tokens, int):
        backend.reported_cached_tokens += cached_tokens
    by_tier = details.get("kvreuse_cached_tokens_by_tier") if isinstance(details, dict) else None
    if isinstance(by_tier, dict):  # a kvreuse backend with KV tiers: where its cached tokens came from
        for tier, tokens in by_tier.items():
            if isinstance(tier, str) and isinstance(tokens, int):
                backend.reported_cached_by_tier[tier] = backend.reported_cached_by_tier.get(tier, 0) + tokens
