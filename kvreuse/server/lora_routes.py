"""LoRA adapter administration: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes).

Both need an admin key where keys are configured, and an adapter can only be read from inside the
folders given with ``--lora-dir``, so no client can make the server open an arbitrary file. Loading
under a name that is already served reloads it: the name then maps to the digest of the new
weights, and KV computed with the old ones can never be hit by it.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvreuse.lora.request import LoRARequest
from kvreuse.server.errors import APIError, bad_request
from kvreuse.server.protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    parse_request,
)
from kvreuse.server.state import ServedAdapter, ServerState

logger = logging.getLogger("kvreuse.server")


def checked_lora_path(path: str, lora_dirs: tuple[str, ...]) -> Path:
    """``path`` resolved (symbolic links followed), if it lies inside one of ``lora_dirs``; else a 400."""
    if not lora_dirs:
        raise bad_request("loading adapters over HTTP is off: start the server with --lora-dir DIR to allow "
                          "adapters from DIR", "lora_path")
    resolved = Path(os.path.realpath(path))
    for root in lora_dirs:
        real_root = os.path.realpath(root)
        if os.path.commonpath([real_root, str(resolved)]) == real_root:
            return resolved
    raise bad_request(f"lora_path {path!r} is outside the allowed --lora-dir folders", "lora_path")


def lora_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    numbers = itertools.count(1000)  # lora_int_id of adapters loaded over HTTP (kept for vLLM compatibility)

    def require_lora(request: Request, action: str) -> None:
        state.require_admin(request, action)
        if state.llm_engine.lora is None:
            raise bad_request("the server was started without --enable-lora", "lora_name")

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        require_lora(request, "loading a LoRA adapter")
        body = parse_request(LoadLoRAAdapterRequest, await request.body())
        if body.lora_name == state.model_name:
            raise bad_request(f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
        path = checked_lora_path(body.lora_path, state.config.lora_dirs)
        lora = LoRARequest(body.lora_name, next(numbers), str(path))
        # On the engine thread: it owns the adapter manager. A refused adapter raises InvalidRequestError (400).
        digest = await state.engine.call(lambda engine: engine.lora.resolve(lora, reload=True))
        state.adapters[body.lora_name] = ServedAdapter(lora, digest)
        logger.info("adapter %r loaded from %s (digest %s)", body.lora_name, path, digest[:12])
        return JSONResponse({"object": "lora_adapter", "lora_name": body.lora_name, "adapter_digest": digest})

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        require_lora(request, "unloading a LoRA adapter")
        body = parse_request(UnloadLoRAAdapterRequest, await request.body())
        if body.lora_name not in state.adapters:
            raise APIError(404, f"no adapter named {body.lora_name!r} is served", error_type="not_found_error",
                           param="lora_name")
        del state.adapters[body.lora_name]
        await state.engine.call(lambda engine: engine.lora.remove(body.lora_name))
        return JSONResponse({"object": "lora_adapter", "lora_name": body.lora_name, "deleted": True})

    return router
