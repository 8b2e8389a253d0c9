"""``POST /v1/messages``: the Anthropic Messages API with explicit cache breakpoints.

``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on up to 4 content blocks (system or
message blocks): each breakpoint pins the prompt prefix that ends with that block, with that TTL,
refreshed on every hit. Usage reports Anthropic's three numbers, which add up to the prompt:
``cache_read_input_tokens`` (reused from the cache), ``cache_creation_input_tokens`` (computed and
written up to the last breakpoint) and ``input_tokens`` (the rest). Streaming sends Anthropic's
event sequence; nothing goes out before the first token exists.

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
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvreuse.cache.pins import PinSpec
from kvreuse.errors import InvalidRequestError
from kvreuse.outputs import RequestOutput
from kvreuse.sampling import SamplingParams
from kvreuse.server.anthropic_protocol import (
    ContentBlocks,
    MessagesRequest,
    blocks_of,
    breakpoint_prefixes,
    check_chunk_marks,
    check_tool_history,
    openai_messages,
    tool_setup,
    validation_message,
)
from kvreuse.server.errors import APIError

if TYPE_CHECKING:
    from kvreuse.server.state import ServerState

# --- errors in Anthropic's shape ----------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    error_type = _ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": error_type, "message": message}}, status_code=status)


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
    return usage


# kvreuse's extension of the Messages usage object (only with KV tiers), as the OpenAI routes' one.
CACHE_READ_BY_TIER_FIELD = "kvreuse_cache_read_input_tokens_by_tier"
# Chunk reuse (issue 39): of cache_read_input_tokens, those moved in from other positions, and the recomputed.
MOVED_INPUT_FIELD = "kvreuse_moved_input_tokens"
RECOMPUTED_INPUT_FIELD = "kvreuse_recomputed_input_tokens"


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _named(message: str, param: str | None) -> str:
    """Anthropic's error has no field for the parameter: the message names it up front."""
    return message if param is None or message.startswith(param) else f"{param}: {message}"


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
                return anthropic_error(400, validation_message(error))
            if body.model != state.model_name and body.model not in state.adapters:
                return anthropic_error(404, f"model: {body.model!r} is not served here (try {state.model_name!r})")
            adapter = state.adapters.get(body.model)
            lora_request = adapter.lora_request if adapter is not None else None
            check_tool_history(body.messages)
            check_chunk_marks(body)
            tools = tool_setup(body, state.tool_parser)
            salt = state.auth.cache_salt(tenant, None)
            conversation = openai_messages(blocks_of(body.system), [blocks_of(m.content) for m in body.messages],
                                            [m.role for m in body.messages])
            # The tools are in the prompt whatever tool_choice says; replayed turns are encoded with the ids
            # generated under the same cache salt (the tenant's), as the OpenAI chat route does.
            tokenized = state.engine.inputs.from_messages(conversation, tools=tools.tools or None,
                                                          memory_scope=salt or "")
            token_ids = tokenized.token_ids
            prompt, num_prompt_tokens = tokenized.as_engine_prompt(), len(token_ids)
            max_tokens = state.max_tokens((body.max_tokens, "max_tokens"), num_prompt_tokens)
            block_size = state.llm_engine.kv.block_size
            breakpoints = breakpoint_prefixes(state.engine.inputs, body, token_ids, tools.tools, salt or "")
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
                # A format whose tags are special tokens needs them in the text to find the calls.
                skip_special_tokens=not (tools.parser is not None and tools.parser.needs_special_tokens),
                structured_outputs=tools.constraint,
            )
            # Compiled now (a refused grammar is a 400 naming tools); the engine then finds it ready.
            await state.check_constraint(params.structured_outputs)
        except APIError as error:
            return anthropic_error(error.status_code, _named(str(error.message), error.param))
        except InvalidRequestError as error:
            return anthropic_error(400, _named(error.message, error.param))
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
            completion = final.outputs[0]
            blocks = ContentBlocks(tools.parser.stream() if tools.parser is not None else None)
            blocks.feed(completion.text, finished=True)
            stop_reason, stop_sequence = _stop_reason(final, blocks.made_calls)
            return JSONResponse({
                "id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
                "content": blocks.content(),
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": _usage(final, last_breakpoint, len(completion.token_ids)),
            })

        async def events() -> AsyncIterator[bytes]:
            started = False
            blocks = ContentBlocks(tools.parser.stream() if tools.parser is not None else None)
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
                    # text_delta holds back a possible start of a stop string (kvreuse.output_processor), and
                    # the parser's extractor holds back text that may still become a call.
                    for name, data in blocks.feed(completion.text_delta, finished=output.finished):
                        yield _sse(name, data)
                    if output.finished:
                        stop_reason, stop_sequence = _stop_reason(output, blocks.made_calls)
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
