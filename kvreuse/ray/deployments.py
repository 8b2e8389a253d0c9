"""The two Ray Serve deployments of a kvreuse application: `EngineReplica` (one engine each) and `Ingress`.

``Ingress`` is the HTTP entry (Ray Serve's proxy sends it every request): it reads the request, computes
the `RoutingHints` of the inference routes (prompt token ids with the servers' tokenizer and chat
template, cache salt, model) and sends an `HTTPEnvelope` to the engine deployment through its handle,
whose request router (kvreuse/ray/request_router.py) picks the replica. The reply streams back chunk
by chunk. Until a replica has sent its first byte (a kvreuse server sends nothing before the first
token), a failure (the replica died, is unreachable, or answered 429/503 while draining or full) sends
the request to another replica, up to ``max_attempts`` tries; after it, a request is never sent again:
a stream that breaks ends with an error event (OpenAI's ``{"error": ...}``, Anthropic's
``event: error``), a whole reply that breaks becomes a 502.

``EngineReplica`` builds exactly what ``kvreuse serve`` builds (kvreuse.server.serve.build_server) and
runs each envelope through that app in-process: every route, header, error, tenant and LoRA behaves as
on one server. It publishes its KV events in vLLM's format on an ephemeral port of its node and names
the socket, the KV block size and its cache namespace in ``record_replica_metadata``, which Ray Serve
hands to the request router once the replica is ready.

No ``from __future__ import annotations`` here: serve.ingress pickles the ingress class by value, and
FastAPI would then resolve string annotations such as ``Request`` in globals the pickle did not keep.
"""


import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from kvreuse.inputs import InputProcessor
from kvreuse.ray.http_bridge import HTTPEnvelope, ResponseStart, RoutingHints, call_asgi
from kvreuse.router.prompts import Prompt, cache_salt_of, prompt_of
from kvreuse.server.anthropic_protocol import (
    MessagesRequest,
    blocks_of,
    openai_messages,
)
from kvreuse.server.errors import APIError, unavailable
from kvreuse.server.kv_event_publisher import (
    KVEventsConfig,
    ZmqKVEventPublisher,
    start_kv_event_publisher,
)
from kvreuse.server.serve import build_server
from kvreuse.tokenizer import Tokenizer

logger = logging.getLogger("kvreuse.ray")

RETRY_STATUSES = frozenset({429, 502, 503, 504})
REPLICA_HEADER = "x-kvreuse-replica"  # which engine replica answered (Ray Serve's replica id)
SESSION_HEADER = "x-session-id"
_ROUTED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages"}
_DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


class EngineReplica:
    """One kvreuse engine and its server app; Ray Serve runs ``num_replicas`` of them."""

    def __init__(self, serve_args: argparse.Namespace) -> None:
        self._parts = build_server(serve_args)
        engine = self._parts.llm.engine
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        # The router's feed: vLLM-format KV events on this node's address, a port of the OS's choosing.
        node_ip = ray.util.get_node_ip_address()
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://{node_ip}:*",
                                replay_endpoint=f"tcp://{node_ip}:*", topic="kv")
        self._router_feed: ZmqKVEventPublisher | None = start_kv_event_publisher(
            events, engine.kv_events, engine.config.cache.block_size, engine.device.type)
        # --kv-events-config as on one server: a publisher for llm-d / Dynamo next to the router's own.
        self._user_publisher = (start_kv_event_publisher(self._parts.kv_events_config, engine.kv_events,
                                                         engine.config.cache.block_size, engine.device.type)
                                if self._parts.kv_events_config is not None else None)
        self._parts.engine.start()
        logger.info("engine replica %s ready: KV events on %s", self._replica_id,
                    self._router_feed.endpoint if self._router_feed else "-")

    def record_replica_metadata(self) -> dict[str, Any]:
        """Static facts the request router keys prompts with and follows KV events by."""
        engine = self._parts.llm.engine
        feed = self._router_feed
        return {
            "model": self._parts.state.model_name, "draft_digest": engine.draft_digest,
            "adapters": self._adapters(), "block_size": engine.config.cache.block_size,
            "num_blocks": engine.kv_cache.num_blocks,
            "kv_events": {"endpoint": feed.endpoint, "replay_endpoint": feed.replay_endpoint, "topic": "kv"}
            if feed is not None else None,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        stats = self._parts.engine.stats
        return {"kv_usage": stats.cache.usage, "num_waiting": stats.num_waiting, "num_running": stats.num_running,
                "adapters": self._adapters()}

    def check_health(self) -> None:
        if not self._parts.engine.is_running:
            raise RuntimeError("the engine loop stopped")

    def _adapters(self) -> dict[str, str]:
        return {name: adapter.digest for name, adapter in self._parts.state.adapters.items()}

    async def handle_http(self, envelope: HTTPEnvelope) -> AsyncIterator[ResponseStart | bytes]:
        async for part in call_asgi(self._parts.app, envelope):
            if isinstance(part, ResponseStart):
                part = ResponseStart(part.status, (*part.headers, (REPLICA_HEADER.encode(), self._replica_id.encode())))
            yield part

    def __del__(self) -> None:
        parts = getattr(self, "_parts", None)
        if parts is None:
            return
        parts.engine.shutdown()
        for publisher in (getattr(self, "_router_feed", None), getattr(self, "_user_publisher", None)):
            if publisher is not None:
                publisher.shutdown()


async def _relay(stream: Any, kind: str | None) -> AsyncIterator[bytes]:
    """Pass a streamed reply through; if the replica fails mid-stream, end with an error event."""
    try:
        async for chunk in stream:
            yield chunk
    except (RayActorError, ActorUnavailableError) as error:
        message = (f"the engine replica failed mid-stream ({type(error).__name__}); the request was not retried "
                   "because it had already produced tokens")
        logger.warning("%s", message)
        if kind == "messages":
            yield ("event: error\ndata: " + json.dumps({"type": "error", "error": {"type": "api_error",
                                                                                   "message": message}}) + "\n\n").encode()
        else:
            yield ("data: " + json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                                    "code": 502}}) + "\n\n").encode()
    finally:
        stream.cancel()  # the client went away: the replica's app sees a disconnect and aborts the request


def _error(status: int, message: str, kind: str | None) -> JSONResponse:
    if kind == "messages":
        return JSONResponse({"type": "error", "error": {"type": "api_error", "message": message}}, status_code=status)
    error = (unavailable(message, "no_replica") if status == 503
             else APIError(status, message, error_type="server_error", code="replica_failed"))
    return JSONResponse(error.body(), status_code=status, headers=error.headers)


def _tokenizer_path(args: argparse.Namespace) -> str:
    path = args.tokenizer or args.model
    if str(path).lower().endswith(".gguf"):
        from kvreuse.loading.loader import (
            resolve_tokenizer_path,  # a GGUF file's tokenizer
        )

        return str(resolve_tokenizer_path(path))
    return str(path)


# Defined after the helpers above: serve.ingress pickles the class (and what its methods name) as it decorates.
ingress_app = FastAPI(title="kvreuse on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class Ingress:
    """The HTTP entry: routing hints, the call to an engine replica, retries before the first byte."""

    def __init__(self, engine: Any, serve_args: argparse.Namespace, max_attempts: int = 3) -> None:
        self._engine = engine.options(stream=True, method_name="handle_http")
        self._max_attempts = max_attempts
        self._isolate_tenants = bool(serve_args.isolate_tenants)
        self._inputs = InputProcessor(Tokenizer(_tokenizer_path(serve_args)))

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        envelope = HTTPEnvelope(request.method, request.url.path, request.url.query.encode(),
                                tuple(request.headers.raw), body, self._hints(request, body))
        kind = _ROUTED_PATHS.get(request.url.path)
        last_error = "no replica answered"
        for attempt in range(self._max_attempts):
            if attempt:
                await asyncio.sleep(0.05 * 2 ** (attempt - 1))
            stream = self._engine.remote(envelope)
            try:
                start = await stream.__anext__()
            except (RayActorError, ActorUnavailableError) as error:
                last_error = f"the engine replica failed before answering ({type(error).__name__})"
                logger.warning("attempt %d of %s %s: %s; trying another replica", attempt + 1, request.method,
                               request.url.path, last_error)
                continue
            except StopAsyncIteration:
                last_error = "the engine replica closed the reply without a status"
                continue
            if not isinstance(start, ResponseStart):
                stream.cancel()
                last_error = "the engine replica sent a body before its status"
                continue
            if start.status in RETRY_STATUSES and attempt + 1 < self._max_attempts:
                stream.cancel()
                last_error = f"the engine replica answered {start.status}"
                continue
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
                       if k.decode("latin-1").lower() not in _DROPPED_HEADERS}
            if (start.header("content-type") or "").startswith("text/event-stream"):
                return StreamingResponse(_relay(stream, kind), status_code=start.status, headers=headers)
            chunks: list[bytes] = []
            try:
                async for chunk in stream:
                    chunks.append(chunk)
            except (RayActorError, ActorUnavailableError) as error:
                # Tokens were computed; sending the request again could run it twice.
                return _error(502, f"the engine replica failed while sending its reply ({type(error).__name__}); "
                                   "the request was not retried", kind)
            return Response(b"".join(chunks), status_code=start.status, headers=headers)
        return _error(503, f"{last_error} after {self._max_attempts} attempt(s)", kind)

    def _hints(self, request: Request, body: bytes) -> RoutingHints | None:
        kind = _ROUTED_PATHS.get(request.url.path)
        if kind is None or request.method != "POST":
            return None
        try:
            parsed = json.loads(body)
            if not isinstance(parsed, dict):
                return None
            authorization = request.headers.get("authorization")
            if kind == "messages":
                if authorization is None and request.headers.get("x-api-key"):
                    authorization = f"Bearer {request.headers['x-api-key']}"
                prompt = self._anthropic_prompt(body)
                salt = cache_salt_of({}, authorization, self._isolate_tenants)
            else:
                prompt = prompt_of(parsed, kind == "chat", self._inputs)
                salt = cache_salt_of(parsed, authorization, self._isolate_tenants)
        except (ValueError, TypeError, KeyError):  # the replica answers a bad body with the server's 400
            return None
        model = parsed.get("model") if isinstance(parsed.get("model"), str) else None
        return RoutingHints(prompt, salt, model, request.headers.get(SESSION_HEADER))

    def _anthropic_prompt(self, body: bytes) -> Prompt:
        """The /v1/messages prompt as the server builds it: the conversation in OpenAI's shape and the tools."""
        request = MessagesRequest.model_validate_json(body)
        conversation = openai_messages(blocks_of(request.system), [blocks_of(m.content) for m in request.messages],
                                       [m.role for m in request.messages])
        tools = [tool.as_openai() for tool in request.tools] if request.tools else None
        return Prompt(tuple(self._inputs.from_messages(conversation, tools=tools, validate=False).token_ids), None)
