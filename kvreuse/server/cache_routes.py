"""Cache administration routes: pins (tenant-scoped), the drift report (tenant-scoped: why prompts miss),
the KV event log (admin), the cache reset (admin; which tiers it clears: ``?tiers=device,host,disk,remote``,
the device pool alone by default).

Where keys are configured a tenant sees and deletes only its own pins (an admin key sees all), and
reading the KV event log (every tenant's block keys; kvreuse route follows it) or flushing the
prefix cache needs an admin key.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvreuse.engine import LLMEngine
from kvreuse.server.errors import APIError, bad_request
from kvreuse.server.state import ServerState

logger = logging.getLogger("kvreuse.server")


def cache_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/cache/pins")
    async def list_pins(request: Request) -> JSONResponse:
        owner = state.pin_owner_filter(state.authenticate(request))
        pins = await state.engine.call(lambda engine: [pin.as_dict() for pin in engine.list_pins()])
        visible = [pin for pin in pins if owner is None or pin["owner"] in (None, owner)]
        return JSONResponse({"object": "list", "data": visible})

    @router.delete("/v1/cache/pins/{pin_id}")
    async def delete_pin(pin_id: str, request: Request) -> JSONResponse:
        owner = state.pin_owner_filter(state.authenticate(request))

        def remove(engine: LLMEngine) -> dict[str, Any] | None:
            pin = engine.get_pin(pin_id)
            if pin is None or (owner is not None and pin.owner != owner):
                return None  # another tenant's pin is as good as absent
            return engine.unpin(pin_id).as_dict()

        removed = await state.engine.call(remove)
        if removed is None:
            raise APIError(404, f"no pin with id {pin_id!r}", error_type="not_found_error", param="pin_id")
        return JSONResponse({"id": pin_id, "object": "cache.pin", "deleted": True, "pin": removed})

    @router.get("/v1/cache/drift")
    async def cache_drift(request: Request) -> JSONResponse:
        """Why recent prompts missed the cache (kvreuse.observatory.drift), as far as the caller may
        see: a tenant key sees the namespaces only it ever used, an admin key (or no keys) all."""
        scope = state.scope_of(state.authenticate(request))
        top = _query_int(request, "top", DRIFT_DEFAULT_TOP, 1, DRIFT_MAX_TOP)
        return JSONResponse(await state.engine.call(lambda engine: engine.drift_report(scope, top)))

    @router.get("/v1/cache/events")
    async def cache_events(request: Request) -> JSONResponse:
        """Block keys stored in / removed from the prefix cache since ``after`` (for kvreuse route).
        Every tenant's keys are in it, so it needs an admin key when keys are configured."""
        state.require_admin(request, "reading the KV event log")
        after = _query_int(request, "after", 0, 0, None)
        limit = _query_int(request, "limit", KV_EVENTS_PAGE, 1, KV_EVENTS_PAGE)
        log = state.llm_engine.kv_events
        batch = log.read(after, limit)
        return JSONResponse({"object": "cache.events", "epoch": log.epoch,
                             "block_size": state.llm_engine.kv_cache.block_size,
                             "events": [event.to_json() for event in batch.events],
                             "next_after": batch.next_after, "lost": batch.lost, "last_seq": batch.last_seq})

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        # It flushes every tenant's cache: an admin action whenever keys are configured.
        state.require_admin(request, "resetting the prefix cache")
        state.check_accepting()
        tiers = await _reset_tiers(request)
        freed_blocks = await state.engine.call(lambda engine: engine.reset_prefix_cache(tiers))
        logger.info("prefix cache reset (%s): %d idle blocks / entries freed", ", ".join(tiers), freed_blocks)
        return JSONResponse({"freed_blocks": freed_blocks, "tiers": list(tiers)})

    return router


KV_EVENTS_PAGE = 4096  # most events one /v1/cache/events reply carries
DRIFT_DEFAULT_TOP = 10  # groups a /v1/cache/drift reply carries without ?top=
DRIFT_MAX_TOP = 100
KV_TIERS = ("device", "host", "disk", "remote")  # what POST /reset_prefix_cache may clear


async def _reset_tiers(request: Request) -> tuple[str, ...]:
    """The tiers a reset clears: ``?tiers=device,disk`` or a JSON body ``{"tiers": ["device", "disk"]}``
    (or ``"device,disk"``); the device pool alone by default. An unknown name is a 400 naming ``tiers``;
    a known tier this server does not have is nothing to clear."""
    raw: Any = request.query_params.get("tiers")
    if raw is None:
        body = await request.body()
        if body.strip():
            try:
                document = json.loads(body)
            except ValueError:
                raise bad_request("the body must be a JSON object such as {\"tiers\": [\"device\", \"disk\"]}",
                                  param="tiers") from None
            if not isinstance(document, dict) or set(document) - {"tiers"}:
                raise bad_request("the body may only hold \"tiers\": a list of tier names or one "
                                  "comma-separated string", param="tiers")
            raw = document.get("tiers")
    if raw is None:
        return ("device",)
    if isinstance(raw, str):
        names = [name.strip() for name in raw.split(",")]
    elif isinstance(raw, list) and all(isinstance(name, str) for name in raw):
        names = [name.strip() for name in raw]
    else:
        raise bad_request("tiers must be a list of tier names or a comma-separated string", param="tiers")
    names = [name for name in names if name]
    if not names:
        raise bad_request(f"tiers is empty: name at least one of {', '.join(KV_TIERS)}", param="tiers")
    unknown = [name for name in names if name not in KV_TIERS]
    if unknown:
        raise bad_request(f"unknown tier(s) {', '.join(map(repr, unknown))} in tiers; tiers are "
                          f"{', '.join(KV_TIERS)}", param="tiers")
    return tuple(dict.fromkeys(names))


def _query_int(request: Request, name: str, default: int, minimum: int, maximum: int | None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}", param=name) from None
    if value < minimum or (maximum is not None and value > maximum):
        limit = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise bad_request(f"{name} must be {limit}, got {value}", param=name)
    return value
