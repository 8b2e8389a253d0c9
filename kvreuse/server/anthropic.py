"""``POST /v1/messages``: the Anthropic Messages API with explicit cache breakpoints.

``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on up to 4 content blocks (system or
message blocks): each breakpoint pins the prompt prefix that ends with that block, with that TTL,
refreshed on every hit. Usage reports Anthropic's three numbers, which add up to the prompt:
``cache_read_input_tokens`` (reused from the cache), ``cache_creation_input_tokens`` (computed and
written up to the last breakpoint) and ``input_tokens`` (the rest). Streaming sends Anthropic's
event sequence; nothing goes out before the first token exists.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvreuse.cache.pins import PinSpec
from kvreuse.inputs import InputProcessor, common_prefix_length
from kvreuse.outputs import RequestOutput
from kvreuse.sampling import MAX_STOP_STRINGS, SamplingParams
from kvreuse.server.errors import APIError

if TYPE_CHECKING:
    from kvreuse.server.state import ServerState

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    # SamplingParams' cap, checked here so the 400 names this API's field, in Anthropic's error shape.
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # Request-level cache_control (newer SDKs): a breakpoint after the last block of the last message.
    cache_control: CacheControl | None = None


# --- errors in Anthropic's shape ----------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    error_type = _ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": error_type, "message": message}}, status_code=status)


def _field_path(location: tuple[Any, ...]) -> str:
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "list[TextBlock]"):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


# --- the prompt and its breakpoints ---------------------------------------------------------------------
def _blocks(content: str | list[TextBlock] | None) -> list[TextBlock]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    return list(content)


def _openai_messages(system: list[TextBlock], messages: list[list[TextBlock]], roles: list[str]) -> list[dict]:
    result: list[dict] = []
    if system:
        result.append({"role": "system", "content": [{"type": "text", "text": b.text} for b in system]})
    for role, blocks in zip(roles, messages):
        result.append({"role": role, "content": [{"type": "text", "text": b.text} for b in blocks]})
    return result


def breakpoint_prefixes(inputs: InputProcessor, body: MessagesRequest, prompt_ids: list[int]) -> list[tuple[int, float]]:
    """(prefix length in tokens, ttl seconds) for each cache_control block, in prompt order.

    The prefix of a breakpoint is the conversation rendered up to and including its block; its
    length is where those tokens stop agreeing with the full prompt's (robust to any template).
    """
    system = _blocks(body.system)
    messages = [_blocks(message.content) for message in body.messages]
    roles = [message.role for message in body.messages]
    marked: list[tuple[int, int, float]] = []  # (message index; -1 = system, block index, ttl)
    for block_index, block in enumerate(system):
        if block.cache_control is not None:
            marked.append((-1, block_index, TTL_SECONDS[block.cache_control.ttl]))
    for message_index, blocks in enumerate(messages):
        for block_index, block in enumerate(blocks):
            if block.cache_control is not None:
                marked.append((message_index, block_index, TTL_SECONDS[block.cache_control.ttl]))
    if body.cache_control is not None and messages and messages[-1]:
        marked.append((len(messages) - 1, len(messages[-1]) - 1, TTL_SECONDS[body.cache_control.ttl]))
    if len(marked) > MAX_BREAKPOINTS:
        raise APIError(400, f"at most {MAX_BREAKPOINTS} blocks may have cache_control, got {len(marked)}",
                       param="cache_control")
    prefixes = []
    for message_index, block_index, ttl in marked:
        if message_index == -1:
            partial = _openai_messages(system[: block_index + 1], [], [])
        else:
            partial = _openai_messages(system, messages[:message_index] + [messages[message_index][: block_index + 1]],
                                       roles[: message_index + 1])
        ids = inputs.from_messages(partial, add_generation_prompt=False, validate=False).token_ids
        prefixes.append((common_prefix_length(ids, prompt_ids), ttl))
    return prefixes


# --- responses -------------------------------------------------------------------------------------------
def _stop_reason(output: RequestOutput) -> tuple[str, str | None]:
    completion = output.outputs[0]
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _usage(output: RequestOutput, last_breakpoint: int, output_tokens: int) -> dict[str, Any]:
    prompt = len(output.prompt_token_ids)
    read = output.num_cached_tokens
    creation = max(0, min(last_breakpoint, prompt) - read)
    usage: dict[str, Any] = {"input_tokens": prompt - read - creation, "cache_creation_input_tokens": creation,
                             "cache_read_input_tokens": read, "output_tokens": output_tokens}
    if output.cached_tokens_by_tier is not None:  # KV tiers: where cache_read_input_tokens came from
        usage[CACHE_READ_BY_TIER_FIELD] = dict(output.cached_tokens_by_tier)
    return usage


# kvreuse's extension of the Messages usage object (only with KV tiers), as the OpenAI routes' one.
CACHE_READ_BY_TIER_FIELD = "kvreuse_cache_read_input_tokens_by_tier"


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def anthropic_router(state: ServerState) -> APIRouter:
    """``POST /v1/messages`` over the server's state."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        arrival_time = time.monotonic()
        try:
            # The anthropic SDK sends x-api-key; accept it as well as a bearer token.
            authorization = request.headers.get("authorization")
            if authorization is None and request.headers.get("x-api-key"):
                authorization = f"Bearer {request.headers['x-api-key']}"
            tenant = state.auth.authenticate(authorization)
            state.check_accepting()
            try:
                body = MessagesRequest.model_validate_json(await request.body())
            except ValidationError as error:
                first = error.errors()[0]
                return anthropic_error(400, f"{_field_path(first['loc'])}: {first['msg']}")
            if body.model != state.model_name and body.model not in state.adapters:
                return anthropic_error(404, f"model: {body.model!r} is not served here (try {state.model_name!r})")
            adapter = state.adapters.get(body.model)
            lora_request = adapter.lora_request if adapter is not None else None
            conversation = _openai_messages(_blocks(body.system), [_blocks(m.content) for m in body.messages],
                                            [m.role for m in body.messages])
            tokenized = state.engine.inputs.from_messages(conversation)
            token_ids = tokenized.token_ids
            prompt, num_prompt_tokens = tokenized.as_engine_prompt(), len(token_ids)
            max_tokens = state.max_tokens((body.max_tokens, "max_tokens"), num_prompt_tokens)
            block_size = state.llm_engine.kv.block_size
            breakpoints = breakpoint_prefixes(state.engine.inputs, body, token_ids)
            salt = state.auth.cache_salt(tenant, None)
            owner = tenant.tenant_id if tenant is not None and state.auth.isolate_tenants else None
            pins = [PinSpec(num_tokens=length, key=f"breakpoint\x00{salt or ''}\x00{token_ids[:length]}",
                            kind="breakpoint", ttl=ttl, owner=owner)
                    for length, ttl in breakpoints if length >= block_size]
            last_breakpoint = max((length for length, _ in breakpoints), default=0)
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                stop=body.stop_sequences or None,
            )
        except APIError as error:
            return anthropic_error(error.status_code, str(error.message))
        except ValueError as error:
            return anthropic_error(400, str(error))

        message_id = f"msg_{uuid.uuid4().hex}"
        admission = state.admit()
        state.engine.metrics.request_started(body.model if lora_request is not None else None)
        outputs = state.engine.generate(message_id, prompt, params, cache_salt=salt, arrival_time=arrival_time,
                                        pins=pins, lora_request=lora_request, owner=state.request_owner(tenant))
        if not body.stream:
            try:
                final = None
                async for output in outputs:
                    final = output
            finally:
                admission.release()
            assert final is not None
            stop_reason, stop_sequence = _stop_reason(final)
            completion = final.outputs[0]
            return JSONResponse({
                "id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
                "content": [{"type": "text", "text": completion.text}],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": _usage(final, last_breakpoint, len(completion.token_ids)),
            })

        async def events() -> AsyncIterator[bytes]:
            started = False
            try:
                async for output in outputs:
                    completion = output.outputs[0]
                    if not started and not completion.token_ids:
                        continue  # nothing is sent before the first token exists
                    if not started:
                        started = True
                        yield _sse("message_start", {"type": "message_start", "message": {
                            "id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
                            "content": [], "stop_reason": None, "stop_sequence": None,
                            "usage": _usage(output, last_breakpoint, 1)}})
                        yield _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                           "content_block": {"type": "text", "text": ""}})
                    # text_delta holds back a possible start of a stop string (kvreuse.output_processor).
                    delta = completion.text_delta
                    if delta:
                        yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                           "delta": {"type": "text_delta", "text": delta}})
                    if output.finished:
                        stop_reason, stop_sequence = _stop_reason(output)
                        yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                        usage = _usage(output, last_breakpoint, len(completion.token_ids))
                        yield _sse("message_delta", {"type": "message_delta",
                                                     "delta": {"stop_reason": stop_reason,
                                                               "stop_sequence": stop_sequence},
                                                     "usage": {"output_tokens": usage["output_tokens"]}})
                        yield _sse("message_stop", {"type": "message_stop"})
            finally:
                await outputs.aclose()  # a client that went away aborts its request
                admission.release()

        return StreamingResponse(events(), media_type="text/event-stream")

    return router
