"""An HTTP request crossing a Ray Serve handle, from the ingress to an engine replica, and its reply back.

The ingress (kvreuse/ray/deployments.py) reads the client's request into an `HTTPEnvelope` (method, path,
headers, body) plus the `RoutingHints` the request router keys the prompt with. The engine replica runs
the envelope through its own kvreuse server app in-process (`call_asgi`: the same FastAPI app ``kvreuse
serve`` runs, so every route, error and header is the server's) and streams the reply back as a
`ResponseStart` followed by body chunks. A kvreuse server sends nothing, not even the status line,
before the first token, so "no `ResponseStart` yet" means the client has seen nothing: the ingress may
send the request to another replica then, never after.

httpx's ASGITransport would buffer the whole reply (no streaming), hence the small ASGI caller here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvreuse.router.prompts import Prompt


@dataclass(frozen=True)
class RoutingHints:
    """What the request router needs of a request, computed once in the ingress (which has the
    tokenizer): its prompt, cache salt, requested model and session."""

    prompt: Prompt | None  # None: not a prompt the ingress could read (the replica answers it)
    cache_salt: str | None
    model: str | None
    session_id: str | None = None


@dataclass(frozen=True)
class HTTPEnvelope:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    hints: RoutingHints | None = None


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        return next((value.decode("latin-1") for key, value in self.headers if key.lower() == wanted), None)


async def call_asgi(app: Any, envelope: HTTPEnvelope) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``envelope`` through the ASGI ``app``; yield its `ResponseStart`, then each non-empty body chunk.
    Closing the generator early (the client went away, Ray cancelled the call) tells the app the client
    disconnected and cancels it, so the engine aborts the request."""
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_read = False

    async def receive() -> dict[str, Any]:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": envelope.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": envelope.method, "scheme": "http", "path": envelope.path, "raw_path": envelope.path.encode(),
        "root_path": "", "query_string": envelope.query_string, "headers": list(envelope.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # an app error after the reply began surfaces here
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
