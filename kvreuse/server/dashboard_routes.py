"""The live dashboard of one server: ``GET /dashboard`` (the page) and ``GET /v1/cache/dashboard`` (its
JSON, scoped to the caller like the pins: where keys are configured a key is required, a tenant key
sees only its own entries (kvreuse/observatory/scope.py decides for the tree, the drift report and the
hit counters; pins follow GET /v1/cache/pins), an admin key sees all).

The hit-rate time series comes from a sampler on the event loop (kvreuse/observatory/dashboard.py)
that reads the engine's per-owner counters once a second through `AsyncEngine.call`, as every engine
access from the loop must. uvicorn runs without lifespan events here (serve.py), so the sampler is
started by the first HTTP request the server gets (any path): before that no request has reached
the engine, so there is nothing to sample.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Send
from starlette.types import Scope as ASGIScope

from kvreuse.engine import LLMEngine
from kvreuse.observatory.dashboard import (
    SHARED_OWNER,
    DashboardHistory,
    EngineReading,
    HitSampler,
    counters_from,
)
from kvreuse.observatory.dashboard_page import PageConfig, dashboard_page_router
from kvreuse.observatory.scope import ALL, Scope
from kvreuse.server.state import ServerState

TREE_TOP = 8  # largest subtrees shown
DRIFT_TOP = 10  # drift groups shown
HISTORY_SAMPLES = 600  # ten minutes at one sample a second
SAMPLE_INTERVAL_S = 1.0
HIT_RATE_WINDOW_S = 10.0
# The engine view (tree, drift report, pins) is built on the engine thread, between steps; the drift
# report re-aligns recent misses (tens of ms with a full log). Pages poll every 1.5 s, so one view per
# caller scope is reused: always for VIEW_MIN_AGE_S, and while the engine has not moved for VIEW_MAX_AGE_S.
VIEW_MIN_AGE_S = 2.0
VIEW_MAX_AGE_S = 5.0
VIEW_CACHE_SCOPES = 64


def install_dashboard(app: FastAPI, state: ServerState) -> None:
    """The page, its JSON and the sampler behind the time series (one call in the app factory)."""
    history = DashboardHistory(HISTORY_SAMPLES, HIT_RATE_WINDOW_S)
    sampler = HitSampler(lambda: _read_engine(state), history, pool=lambda: _pool_blocks(state),
                         marker=lambda: _activity_marker(state), interval_s=SAMPLE_INTERVAL_S)
    app.add_middleware(_StartSampler, start=sampler.ensure_started)
    app.include_router(dashboard_page_router(PageConfig("server", lambda: state.auth.enabled)))
    app.include_router(dashboard_router(state, history))


def dashboard_router(state: ServerState, history: DashboardHistory) -> APIRouter:
    router = APIRouter()
    views = _ViewCache(VIEW_CACHE_SCOPES)

    @router.get("/v1/cache/dashboard")
    async def dashboard(request: Request) -> JSONResponse:
        tenant = state.authenticate(request)
        scope = state.scope_of(tenant)
        pin_owner = state.pin_owner_filter(tenant)  # pins: the rule of GET /v1/cache/pins
        key = (scope, pin_owner)
        marker, now = _activity_marker(state), time.monotonic()
        view = views.get(key, marker, now)
        if view is None:
            view = await state.engine.call(lambda engine: _engine_view(engine, scope, pin_owner))
            views.put(key, marker, now, view)
        return JSONResponse(_document(state, scope, history, view))

    return router


@dataclass
class _ViewCache:
    """Engine views by caller scope, least recently built dropped first (event loop only)."""

    capacity: int
    _entries: OrderedDict[Hashable, tuple[Hashable, float, dict[str, Any]]] = field(default_factory=OrderedDict)

    def get(self, key: Hashable, marker: Hashable, now: float) -> dict[str, Any] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        built_marker, built, view = entry
        age = now - built
        return view if age < VIEW_MIN_AGE_S or (marker == built_marker and age < VIEW_MAX_AGE_S) else None

    def put(self, key: Hashable, marker: Hashable, now: float, view: dict[str, Any]) -> None:
        self._entries[key] = (marker, now, view)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


async def _read_engine(state: ServerState) -> EngineReading:
    def read(engine: LLMEngine) -> EngineReading:  # on the engine thread
        return EngineReading(counters_from(engine.hit_counters(ALL)), engine.pins.pinned_blocks())

    return await state.engine.call(read)


def _pool_blocks(state: ServerState) -> dict[str, int]:
    cache = state.engine.stats.cache  # the snapshot the engine thread replaces after every iteration
    return {"free": cache.blocks_free, "idle": cache.blocks_idle, "in_use": cache.blocks_in_use}


def _activity_marker(state: ServerState) -> tuple[int, int, int]:
    """Changes whenever the engine may have counted something: read from the stats snapshot the engine
    thread replaces after every iteration (safe to read on the loop)."""
    stats = state.engine.stats
    return stats.steps, stats.cache.query_tokens, stats.cache.hit_tokens


def _owner_visible(scope: Scope) -> Callable[[str], bool]:
    """Whether this caller may see the counters of an owner label (``"shared"``: requests without one)."""
    return lambda owner: scope.may_see_owner(None if owner == SHARED_OWNER else owner)


def _engine_view(engine: LLMEngine, scope: Scope, pin_owner: str | None) -> dict[str, Any]:
    """Everything the dashboard reads from the engine, in one trip to the engine thread. ``pin_owner``:
    whose pins the caller sees besides the unowned ones (None: all), as GET /v1/cache/pins."""
    pins = [pin for pin in engine.list_pins() if pin_owner is None or pin.owner in (None, pin_owner)]
    return {
        "tree": engine.cache_tree(scope, top=TREE_TOP),
        "drift": engine.drift_report(scope, top=DRIFT_TOP),
        "counters": engine.hit_counters(scope),
        "pins": [pin.as_dict() for pin in pins],
        # Distinct blocks: pins that share a prefix share its blocks.
        "pinned_blocks": len({id(node) for pin in pins for node in pin.nodes}),
    }


def _document(state: ServerState, scope: Scope, history: DashboardHistory, view: dict[str, Any]) -> dict[str, Any]:
    now = time.time()
    visible = _owner_visible(scope)
    stats = state.engine.stats  # the pool-wide figures are the same for every caller, as on /metrics
    cache = stats.cache
    counters = {owner: counter for owner, counter in counters_from(view["counters"]).items() if visible(owner)}
    return {
        "object": "cache.dashboard",
        "model": state.model_name,
        "time": round(now, 3),
        "scope": {"tenant": scope.tenant_id, "sees_all": scope.sees_all},
        "hit_rate": history.recent(counters, visible, scope.sees_all, now),
        "series": history.series(visible, include_total=scope.sees_all) | {"interval_s": SAMPLE_INTERVAL_S},
        "blocks": {"block_size": cache.block_size, "total": cache.num_blocks, "free": cache.blocks_free,
                   "idle": cache.blocks_idle, "in_use": cache.blocks_in_use, "pinned": view["pinned_blocks"]},
        "requests": {"running": stats.num_running, "waiting": stats.num_waiting},
        "tree": view["tree"],
        "pins": [_pin_entry(pin, now) for pin in view["pins"]],
        "drift": view["drift"],
        "tiers": stats.tiers,
    }


def _pin_entry(pin: dict[str, Any], now: float) -> dict[str, Any]:
    expires = pin.get("expires")
    ttl_left = None if expires is None else round(max(0.0, expires - now), 1)
    return {"id": pin["id"], "kind": pin["kind"], "tokens": pin["tokens"], "blocks": pin["blocks"],
            "hits": pin["hits"], "ttl": pin["ttl"], "ttl_left_s": ttl_left, "owner": pin["owner"],
            "adapter": pin["adapter"]}


class _StartSampler:
    """Pure ASGI middleware (no per-request work beyond one call): starts the sampler on the server's
    event loop at its first request, since uvicorn runs without lifespan events here."""

    def __init__(self, app: ASGIApp, start: Callable[[], None]) -> None:
        self.app = app
        self.start = start

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.start()
        await self.app(scope, receive, send)
