"""The router's dashboard: every backend's ``GET /v1/cache/dashboard``, fetched with the caller's own
``Authorization`` header (so each backend scopes the reply to that caller, exactly as if it were asked
directly), side by side. A backend that is down, slow or refuses the key is a line in the reply, never
an error page: the others still show.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

FETCH_TIMEOUT_S = 3.0  # a backend slower than this shows as down for this poll


@dataclass(frozen=True)
class BackendTarget:
    url: str  # the backend's base URL, as the router names it
    healthy: bool  # the router's probes' view: a backend known down is not asked (no connect timeout per poll)


async def fleet_dashboard(client: httpx.AsyncClient, backends: list[BackendTarget],
                          authorization: str | None) -> dict[str, Any]:
    replies = await asyncio.gather(*(_one(client, backend, authorization) for backend in backends))
    return {
        "object": "router.dashboard",
        "time": round(time.time(), 3),
        # No backend answered with data and one wants a key: the page asks for a key.
        "auth_required": any(r["status"] == "unauthorized" for r in replies)
                         and not any(r["status"] == "ok" for r in replies),
        "backends": replies,
    }


async def _one(client: httpx.AsyncClient, backend: BackendTarget, authorization: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"url": backend.url, "healthy": backend.healthy, "status": "down", "status_code": None,
                             "error": None, "dashboard": None}
    if not backend.healthy:
        entry["error"] = "failing the router's health probes"
        return entry
    headers = {"Accept": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    try:
        response = await client.get(f"{backend.url}/v1/cache/dashboard", headers=headers, timeout=FETCH_TIMEOUT_S)
    except httpx.HTTPError as error:
        entry["error"] = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return entry
    entry["status_code"] = response.status_code
    if response.status_code in (401, 403):
        entry["status"] = "unauthorized"
        entry["error"] = _error_message(response)
        return entry
    if response.status_code != 200:
        entry["status"] = "error"
        entry["error"] = _error_message(response)
        return entry
    try:
        entry["dashboard"] = response.json()
    except ValueError:
        entry["status"] = "error"
        entry["error"] = "the reply is not JSON"
        return entry
    entry["status"] = "ok"
    return entry


def _error_message(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return f"HTTP {response.status_code}: {message}"
