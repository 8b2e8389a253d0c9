"""The FastAPI app for one engine: error handling, health, metrics, models, and one router per API.

`build_app` takes a `ServerState` (kvreuse/server/state.py: what every route shares, the engine, auth,
adapters and the drain / in-flight bookkeeping), installs the error handlers (every bad input is a
4xx in OpenAI's error shape; `InvalidRequestError` maps by its ``param`` and ``code``; anything else is a
logged 500: server/errors.py's `api_error_of`, which /v1/messages renders in Anthropic's shape) and
includes the routers:

- `server/openai_routes.py`: /v1/chat/completions, /v1/completions, /tokenize, /detokenize
- `server/anthropic.py`: /v1/messages
- `server/cache_routes.py`: /v1/cache/pins, /v1/cache/events, /v1/cache/drift, /reset_prefix_cache
- `server/lora_routes.py`: /v1/load_lora_adapter, /v1/unload_lora_adapter
- `server/dashboard_routes.py`: /dashboard, /v1/cache/dashboard (and the sampler behind its time series)

The route modules import `ServerState` from state.py, never this module, so the imports run one way:
app -> routes -> state. A new capability adds its own router module and one ``include_router`` line here.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvreuse.errors import InvalidRequestError
from kvreuse.server.anthropic import anthropic_router
from kvreuse.server.cache_routes import cache_router
from kvreuse.server.dashboard_routes import install_dashboard
from kvreuse.server.errors import APIError, api_error_of
from kvreuse.server.lora_routes import lora_router
from kvreuse.server.openai_routes import openai_router
from kvreuse.server.protocol import model_card, remote_url_digest, validation_api_error
from kvreuse.server.state import ServedAdapter, ServerConfig, ServerState

# ServedAdapter, ServerConfig and ServerState live in kvreuse.server.state; the names stay importable here.
__all__ = ["ServedAdapter", "ServerConfig", "ServerState", "build_app"]


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app for one engine. Start ``state.engine`` before serving."""
    app = FastAPI(title="kvreuse", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.server = state

    # What a handler raises goes through the one mapping /v1/messages uses too (server/errors.py): an APIError
    # as it is, the request's mistake (InvalidRequestError, raised by the input module, SamplingParams, the tool
    # and grammar checks and the engine, with the field and code attached) a 400 naming the field, anything
    # else a logged 500.
    @app.exception_handler(APIError)
    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(Exception)
    async def error_handler(_: Request, error: Exception) -> JSONResponse:
        return _openai_error(api_error_of(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error_handler(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return _openai_error(APIError(error.status_code, str(error.detail), headers=error.headers))

    @app.exception_handler(RequestValidationError)
    async def validation_error_handler(_: Request, error: RequestValidationError) -> JSONResponse:
        # A route's typed parameters (FastAPI's own parsing): the 400 names the field, as parse_request's do;
        # the location's first part says where it was sent (body, query, path, header) and is no field.
        errors = [{**item, "loc": tuple(item["loc"])[1:] if len(item["loc"]) > 1 else tuple(item["loc"])}
                  for item in error.errors()]
        return _openai_error(validation_api_error(errors))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        content, content_type = state.engine.metrics.render()
        return Response(content, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        state.authenticate(request)
        adapters = [adapter.model_card(state.model_name, state.created) for adapter in state.adapters.values()]
        return JSONResponse({"object": "list", "data": [_model_card(state), *adapters]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
        state.authenticate(request)
        adapter = state.lora_of(model_id)
        if adapter is not None:
            return JSONResponse(adapter.model_card(state.model_name, state.created))
        return JSONResponse(_model_card(state))

    app.include_router(openai_router(state))
    app.include_router(anthropic_router(state))
    app.include_router(cache_router(state))
    app.include_router(lora_router(state))
    install_dashboard(app, state)
    return app


def _openai_error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def _model_card(state: ServerState) -> dict[str, Any]:
    kv_cache = state.llm_engine.kv_cache
    card = model_card(state.model_name, state.config.model_root or state.model_name, state.created,
                      state.max_model_len, kv_cache.num_blocks, kv_cache.block_size)
    # The pool's capacity per byte: what a quantized KV dtype (--kv-cache-dtype) changes.
    card["kv_cache_dtype"] = kv_cache.kv_cache_dtype
    card["kv_tokens_per_gib"] = kv_cache.tokens_per_gib
    draft_digest = state.llm_engine.draft_digest
    if draft_digest is not None:  # speculative decoding: part of every cache namespace (kvreuse route keys with it)
        card["draft_digest"] = draft_digest
    if state.llm_engine.kv_cache.states is not None:
        # A hybrid model (recurrent layers): a hit needs a state snapshot, so its KV events say where it keeps them
        # and kvreuse route credits it only up to those (cache/events.py).
        card["recurrent_state"] = True
    remote_url = state.llm_engine.config.cache.kv_remote_url
    store = state.llm_engine.tier_store
    if remote_url and store is not None:
        # A remote KV tier: servers showing the same pair read each other's blocks (kvreuse route groups
        # them). Only a digest of the URL without its password: the card is open to every tenant.
        card["kv_remote"] = {"url_digest": remote_url_digest(remote_url), "fingerprint": store.fingerprint}
    return card
