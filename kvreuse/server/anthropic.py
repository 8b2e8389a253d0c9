"""``POST /v1/messages``: the Anthropic Messages API with explicit cache breakpoints.

``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on up to 4 content blocks (system or
message blocks): each breakpoint pins the prompt prefix that ends with that block, with that TTL,
refreshed on every hit. Usage reports Anthropic's three numbers, which add up to the prompt:
``cache_read_input_tokens`` (reused from the cache), ``cache_creation_input_tokens`` (computed and
written up to the last breakpoint) and ``input_tokens`` (the rest). Streaming sends Anthropic's
event sequence; nothing goes out before the first token exists. Errors are in Anthropic's shape, mapped as the
OpenAI routes' are (server/errors.py): a mistake in the request is a 4xx whose message starts with the field
(also in ``param``), anything else a 500 logged with its traceback.

Tool use goes through the same path as the OpenAI chat route: ``tools`` (name, description,
input_schema) become OpenAI-shaped tools that the chat template lists in the prompt, the history's
``tool_use`` blocks become an assistant message's ``tool_calls`` (the input object is written back by the
template as it writes JSON, which is how the tool-call grammar makes the model write arguments, so a
replayed call renders what was generated) and ``tool_result`` blocks become ``tool`` messages. The server's
tool-call parser reads the calls out of the generated text; ``tool_choice`` ``any`` or a named tool is
enforced by the parser's grammar (compiled before the request is queued). A ``cache_control`` on a tool pins
the prompt up to that tool, system prompt included: the template writes the tools into the system turn,
so the last tool's breakpoint holds the system prompt and every tool (Anthropic caches tools, then system,
then messages, in that order). The tools stay in the prompt whatever ``tool_choice`` says: the choice acts
on the logits only, so switching it never costs a cache hit.

``cache_control: {"type": "ephemeral", "scope": "chunk"}`` on a ``text`` or ``document`` block marks a chunk
(issue 39): its text is encoded on its own and its span goes to the engine with the prompt. A chunk mark is no
breakpoint (it pins nothing and does not count against the 4). Plain-text ``document`` blocks are accepted in
user messages, written into the prompt as their title, context and text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvreuse.cache.pins import PinSpec
from kvreuse.outputs import RequestOutput
from kvreuse.server.anthropic_protocol import (
    ContentBlocks,
    MessagesRequest,
    blocks_of,
    breakpoint_prefixes,
    check_chunk_marks,
    check_tool_history,
    openai_messages,
    tool_setup,
    validation_error,
)
from kvreuse.server.errors import APIError, api_error_of
from kvreuse.server.protocol import DRAFTS_FIELD, drafts_usage

if TYPE_CHECKING:
    from kvreuse.lora.request import LoRARequest
    from kvreuse.sampling import SamplingParams
    from kvreuse.server.auth import Tenant
    from kvreuse.server.state import ChatInputs, ServerState
    from kvreuse.tool_parsers import ToolParser


# --- errors in Anthropic's shape ----------------------------------------------------------------------
def anthropic_error(error: APIError) -> JSONResponse:
    """An error as this API's clients read it (server/errors.py maps every failure to an `APIError`)."""
    return JSONResponse(error.anthropic_body(), status_code=error.status_code, headers=error.headers)


# --- responses -------------------------------------------------------------------------------------------
def _stop_reason(output: RequestOutput, made_calls: bool = False) -> tuple[str, str | None]:
    completion = output.outputs[0]
    if completion.finish_reason == "length":
        return "max_tokens", None  # a call cut by max_tokens is reported, but as cut
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return ("tool_use" if made_calls else "end_turn"), None


def _usage(output: RequestOutput, last_breakpoint: int, output_tokens: int) -> dict[str, Any]:
    prompt = len(output.prompt_token_ids)
    read = output.num_cached_tokens
    creation = max(0, min(last_breakpoint, prompt) - read)
    usage: dict[str, Any] = {"input_tokens": prompt - read - creation, "cache_creation_input_tokens": creation,
                             "cache_read_input_tokens": read, "output_tokens": output_tokens}
    if output.cached_tokens_by_tier is not None:  # KV tiers: where cache_read_input_tokens came from
        usage[CACHE_READ_BY_TIER_FIELD] = dict(output.cached_tokens_by_tier)
    if output.num_moved_tokens:  # chunk reuse: read tokens moved in from other positions, and the recomputed
        usage[MOVED_INPUT_FIELD] = output.num_moved_tokens
        usage[RECOMPUTED_INPUT_FIELD] = output.num_recomputed_tokens
    if output.num_draft_tokens:  # speculative decoding: how the drafts fared, as in the OpenAI routes' usage
        usage[DRAFTS_FIELD] = drafts_usage(output.num_drafts, output.num_draft_tokens, output.num_accepted_draft_tokens)
    return usage


# kvreuse's extension of the Messages usage object (only with KV tiers), as the OpenAI routes' one.
CACHE_READ_BY_TIER_FIELD = "kvreuse_cache_read_input_tokens_by_tier"
# Chunk reuse (issue 39): of cache_read_input_tokens, those moved in from other positions, and the recomputed.
MOVED_INPUT_FIELD = "kvreuse_moved_input_tokens"
RECOMPUTED_INPUT_FIELD = "kvreuse_recomputed_input_tokens"


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@dataclass(frozen=True)
class _Prepared:
    """A Messages request, checked and turned into what the engine takes."""

    body: MessagesRequest
    tenant: Tenant | None
    lora_request: LoRARequest | None
    cache_salt: str | None
    inputs: ChatInputs
    params: SamplingParams
    pins: list[PinSpec]
    last_breakpoint: int  # where the last cache_control breakpoint ends (0: none); usage counts creation up to it
    tool_parser: ToolParser | None  # reads tool calls out of the reply (None: its text is all text)


def anthropic_router(state: ServerState) -> APIRouter:
    """``POST /v1/messages`` over the server's state."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        arrival_time = time.monotonic()
        try:
            prepared = await _prepare(state, request)
            return await _answer(state, prepared, arrival_time)
        except Exception as error:  # every failure in this API's shape, through the one mapping (server/errors.py)
            return anthropic_error(api_error_of(error))

    return router


def _authenticate(state: ServerState, request: Request) -> Tenant | None:
    # The anthropic SDK sends x-api-key; accept it as well as a bearer token.
    authorization = request.headers.get("authorization")
    if authorization is None and request.headers.get("x-api-key"):
        authorization = f"Bearer {request.headers['x-api-key']}"
    return state.auth.authenticate(authorization)


async def _prepare(state: ServerState, request: Request) -> _Prepared:
    """The request checked (a 4xx naming the field) and turned into the engine's inputs: the conversation, its
    tools and output budget as the OpenAI chat route turns them (`ServerState.chat_inputs`), the breakpoints'
    pins, and the sampling parameters with their constraint compiled."""
    tenant = _authenticate(state, request)
    state.check_accepting()
    try:
        body = MessagesRequest.model_validate_json(await request.body())
    except ValidationError as error:
        raise validation_error(error) from None
    if body.model != state.model_name and body.model not in state.adapters:
        raise APIError(404, f"model: {body.model!r} is not served here (try {state.model_name!r})", param="model",
                       code="model_not_found")
    adapter = state.adapters.get(body.model)
    check_tool_history(body.messages)
    check_chunk_marks(body)
    tools = tool_setup(body, state.tool_parser)
    salt = state.auth.cache_salt(tenant, None)
    conversation = openai_messages(blocks_of(body.system), [blocks_of(m.content) for m in body.messages],
                                   [m.role for m in body.messages])
    inputs = state.chat_inputs(conversation, tools=tools.tools or None, cache_salt=salt,
                               requested_max_tokens=(body.max_tokens, "max_tokens"))
    breakpoints = breakpoint_prefixes(state.engine.inputs, body, inputs.token_ids, tools.tools, salt or "")
    pins = [PinSpec(num_tokens=length, key=f"breakpoint\x00{salt or ''}\x00{inputs.token_ids[:length]}",
                    kind="breakpoint", ttl=ttl, owner=state.owner_of(tenant))
            for length, ttl in breakpoints if length >= state.llm_engine.kv.block_size]
    params = body.sampling_params(inputs.max_tokens, tools)
    # Compiled now (a refused grammar is a 400 naming tools); the engine then finds it ready.
    await state.check_constraint(params.structured_outputs)
    return _Prepared(body, tenant, adapter.lora_request if adapter is not None else None, salt, inputs, params, pins,
                     max((length for length, _ in breakpoints), default=0), tools.parser)


async def _answer(state: ServerState, prepared: _Prepared, arrival_time: float) -> Response:
    """Queue the request and answer it: the whole message, or its stream of events."""
    message_id = f"msg_{uuid.uuid4().hex}"
    admission = state.admit()
    lora_request = prepared.lora_request
    state.engine.metrics.request_started(prepared.body.model if lora_request is not None else None)
    outputs = state.engine.generate(message_id, prepared.inputs.prompt, prepared.params,
                                    cache_salt=prepared.cache_salt, arrival_time=arrival_time, pins=prepared.pins,
                                    lora_request=lora_request, owner=state.request_owner(prepared.tenant),
                                    stream=bool(prepared.body.stream))
    if prepared.body.stream:
        return StreamingResponse(_events(state, prepared, message_id, outputs, admission.release),
                                 media_type="text/event-stream")
    try:
        final = None
        async for output in outputs:
            final = output
    finally:
        admission.release()
    assert final is not None
    completion = final.outputs[0]
    blocks = ContentBlocks(prepared.tool_parser.stream() if prepared.tool_parser is not None else None)
    blocks.feed(completion.text, finished=True)
    stop_reason, stop_sequence = _stop_reason(final, blocks.made_calls)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
        "content": blocks.content(),
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": _usage(final, prepared.last_breakpoint, len(completion.token_ids)),
    })


async def _events(state: ServerState, prepared: _Prepared, message_id: str, outputs: AsyncIterator[RequestOutput],
                  release: Callable[[], None]) -> AsyncIterator[bytes]:
    """The reply as Anthropic's stream of events; nothing is sent before the first token exists."""
    started = False
    blocks = ContentBlocks(prepared.tool_parser.stream() if prepared.tool_parser is not None else None)
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
                    "usage": _usage(output, prepared.last_breakpoint, 1)}})
            # text_delta holds back a possible start of a stop string (kvreuse.output_processor), and
            # the parser's extractor holds back text that may still become a call.
            for name, data in blocks.feed(completion.text_delta, finished=output.finished):
                yield _sse(name, data)
            if output.finished:
                stop_reason, stop_sequence = _stop_reason(output, blocks.made_calls)
                usage = _usage(output, prepared.last_breakpoint, len(completion.token_ids))
                yield _sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                             "usage": {"output_tokens": usage["output_tokens"]}})
                yield _sse("message_stop", {"type": "message_stop"})
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # a client that went away aborts its request
        release()
