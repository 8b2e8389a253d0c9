"""The FastAPI app for one engine: error handling, health, metrics, models, and one router per API.

`build_app` takes a `ServerState` (kvreuse/server/state.py: what every route shares, the engine, auth,
adapters and the drain / in-flight bookkeeping), installs the error handlers (every bad input is a
4xx in OpenAI's error shape; `InvalidRequestError` maps by its ``param`` and ``code``) and includes
the routers:

- `server/openai_routes.py`: /v1/chat/completions, /v1/completions, /tokenize, /detokenize
- `server/anthropic.py`: /v1/messages
- `server/cache_routes.py`: /v1/cache/pins, /v1/cache/events, /v1/cache/drift, /reset_prefix_cache
- `server/lora_routes.py`: /v1/load_lora_adapter, /v1/unload_lora_adapter
- `server/dashboard_routes.py`: /dashboard, /v1/cache/dashboard (and the sampler behind its time series)

The route modules import `ServerState` from state.py, never this module, so the imports run one way:
app -> routes -> state. A new capability adds its own router module and one ``include_router`` line here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvreuse.errors import InvalidRequestError
from kvreuse.server.anthropic import anthropic_router
from kvreuse.server.cache_routes import cache_router
from kvreuse.server.dashboard_routes import install_dashboard
from kvreuse.server.errors import APIError, bad_request, internal_error
from kvreuse.server.lora_routes import lora_router
from kvreuse.server.openai_routes import openai_router
from kvreuse.server.protocol import model_card, remote_url_digest
from kvreuse.server.state import ServedAdapter, ServerConfig, ServerState

# ServedAdapter, ServerConfig and ServerState live in kvreuse.server.state; the names stay importable here.
__all__ = ["ServedAdapter", "ServerConfig", "ServerState", "build_app"]

logger = logging.getLogger("kvreuse.server")


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app for one engine. Start ``state.engine`` before serving."""
    app = FastAPI(title="kvreuse", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(APIError)
    async def api_error_handler(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error_handler(_: Request, error: StarletteHTTPException) -> JSONResponse:
        api_error = APIError(error.status_code, str(error.detail))
        return JSONResponse(api_error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request_handler(_: Request, error: InvalidRequestError) -> JSONResponse:
        # Raised by the input module, SamplingParams and the engine, with the field and code attached.
        return JSONResponse(bad_request(error.message, error.param, error.code).body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def validation_error_handler(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(bad_request(str(error)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected_error_handler(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error while handling a request")
        return JSONResponse(internal_error(f"internal error: {type(error).__name__}").body(), status_code=500)

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
    remote_url = state.llm_engine.config.cache.kv_remote_url
    store = state.llm_engine.tier_store
    if remote_url and store is not None:
        # A remote KV tier: servers showing the same pair read each other's blocks (kvreuse route groups
        # them). Only a digest of the URL without its password: the card is open to every tenant.
        card["kv_remote"] = {"url_digest": remote_url_digest(remote_url), "fingerprint": store.fingerprint}
    return card
