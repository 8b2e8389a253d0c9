"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /tokenize, /detokenize.

Handlers authenticate, parse and validate (every bad input is a 4xx before anything reaches the
engine), tokenize on the event loop (kvreuse.inputs, through the AsyncEngine's own tokenizer), then
serve the processed outputs. A stream sends nothing, not even its headers, before the first token
exists, so the time to first token a client measures is the real one. Stream deltas are the output
processor's ``text_delta``: text that could be the start of a stop string is held back until it is
clear it is not. A client that goes away aborts its request.

Tools: a chat request's ``tools`` are rendered into the prompt by the chat template (the same prompt
whatever ``tool_choice`` says); ``tool_choice`` is enforced by the tool-call parser's grammar as the request's
constraint. Each choice's text goes through the parser (`ToolParser.extract`, or one streaming extractor per
choice) into ``content`` and ``tool_calls``, whose ``arguments`` are the generated text itself, so the next
turn that sends them back renders, and with the generation memory encodes, what was generated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvreuse.cache.pins import PinSpec
from kvreuse.inputs import PromptInput
from kvreuse.outputs import CompletionOutput, RequestOutput
from kvreuse.sampling import SamplingParams
from kvreuse.server.async_engine import EngineError
from kvreuse.server.errors import bad_request, internal_error
from kvreuse.server.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_logprobs,
    completion_logprobs,
    dumps,
    parse_request,
    sse_event,
    sum_cached_by_tier,
    tool_call_delta_json,
    tool_call_json,
    usage,
)
from kvreuse.server.state import ServedAdapter, ServerState
from kvreuse.system_prompt import system_prompt_pin
from kvreuse.tool_parsers import StreamDelta, ToolCallDelta, ToolCallStream, ToolParser

logger = logging.getLogger("kvreuse.server")

ResultT = TypeVar("ResultT")

# Status for a request whose client went away before the answer (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival_time = time.monotonic()
        tenant = state.authenticate(request)
        state.check_accepting()
        body = parse_request(ChatCompletionRequest, await request.body())
        adapter = state.lora_of(body.model)
        body.check()
        state.check_stop_token_ids(body.stop_token_ids)
        cache_salt = state.auth.cache_salt(tenant, body.cache_salt)
        inputs = state.chat_inputs(body.messages, tools=body.tools, cache_salt=cache_salt,
                                   requested_max_tokens=body.requested_max_tokens,
                                   add_generation_prompt=body.add_generation_prompt)
        tools = body.tool_setup(state.tool_parser)
        renames = {"logprobs": "top_logprobs", "max_tokens": body.requested_max_tokens[1]}
        params = body.sampling_params(max_tokens=inputs.max_tokens, logprobs=body.num_logprobs, renames=renames,
                                      tools=tools)
        await state.check_constraint(params.structured_outputs)
        pins: list[PinSpec] = []
        if body.save_system_prompt_kv_cache:
            spec = system_prompt_pin(state.tokenizer, body.messages, inputs.token_ids,
                                     adapter=adapter.digest if adapter is not None else None)
            try:
                state.llm_engine.check_pin(spec, inputs.num_prompt_tokens)  # reads configuration only
            except ValueError as error:
                raise bad_request(str(error), "save_system_prompt_kv_cache") from None
            pins.append(dataclasses.replace(spec, owner=state.owner_of(tenant)))
        generation = _Generation(
            chat=True, request_id=f"chatcmpl-{uuid.uuid4().hex}", model=body.model or state.model_name,
            created=int(time.time()), adapter=adapter,
            prompts=[inputs.prompt], prompt_lengths=[inputs.num_prompt_tokens], params=[params],
            cache_salt=cache_salt, arrival_time=arrival_time,
            stream=bool(body.stream), include_usage=body.include_usage_in_stream,
            num_logprobs=body.num_logprobs, user=body.user, pins=pins, owner=state.request_owner(tenant),
            tool_parser=tools.parser, return_token_ids=bool(body.return_token_ids),
        )
        return await _serve(state, request, generation)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival_time = time.monotonic()
        tenant = state.authenticate(request)
        state.check_accepting()
        body = parse_request(CompletionRequest, await request.body())
        adapter = state.lora_of(body.model)
        body.check()
        state.check_stop_token_ids(body.stop_token_ids)
        prompts: list[PromptInput] = []
        lengths: list[int] = []
        params: list[SamplingParams] = []
        for raw_prompt in body.prompts():
            prompt, num_prompt_tokens = state.checked_prompt(raw_prompt, "prompt")
            max_tokens = state.max_tokens(body.requested_max_tokens, num_prompt_tokens)
            prompts.append(prompt)
            lengths.append(num_prompt_tokens)
            params.append(body.sampling_params(max_tokens=max_tokens, logprobs=body.logprobs, renames={}))
        await state.check_constraint(params[0].structured_outputs if params else None)
        generation = _Generation(
            chat=False, request_id=f"cmpl-{uuid.uuid4().hex}", model=body.model or state.model_name,
            created=int(time.time()), adapter=adapter,
            prompts=prompts, prompt_lengths=lengths, params=params,
            cache_salt=state.auth.cache_salt(tenant, body.cache_salt), arrival_time=arrival_time,
            stream=bool(body.stream), include_usage=body.include_usage_in_stream,
            num_logprobs=body.logprobs, user=body.user, owner=state.request_owner(tenant),
            return_token_ids=bool(body.return_token_ids),
        )
        return await _serve(state, request, generation)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        tenant = state.authenticate(request)
        body = parse_request(TokenizeRequest, await request.body())
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
        inputs = state.engine.inputs
        if body.messages is not None:
            # As a chat request without a cache_salt would be encoded (its replayed turns as generated).
            tokenized = inputs.from_messages(body.messages, add_generation_prompt=body.add_generation_prompt,
                                             tools=body.tools, validate=False,
                                             memory_scope=state.auth.cache_salt(tenant, None) or "")
        elif body.tools is not None:
            raise bad_request("tools go with messages (they are rendered by the chat template)", "tools")
        else:
            tokenized = inputs.from_text(body.prompt or "", add_special_tokens=body.add_special_tokens,
                                         validate=False)
        token_ids = tokenized.token_ids
        result: dict[str, Any] = {"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids}
        if tokenized.chunk_spans:  # kvreuse's extension: where the messages' chunk parts lie (issue 39)
            result["chunk_spans"] = [list(span) for span in tokenized.chunk_spans]
        return JSONResponse(result)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        state.authenticate(request)
        body = parse_request(DetokenizeRequest, await request.body())
        state.check_model(body.model)
        for position, token_id in enumerate(body.tokens):
            if not 0 <= token_id < state.vocab_size:
                raise bad_request(f"tokens[{position}] = {token_id} is outside the vocabulary "
                                  f"[0, {state.vocab_size})", "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})

    return router


@dataclass
class _Generation:
    """A validated chat or completions request, ready for the engine."""

    chat: bool
    request_id: str
    model: str
    created: int
    prompts: list[PromptInput]
    prompt_lengths: list[int]
    params: list[SamplingParams]  # one per prompt (the output budget depends on the prompt length)
    cache_salt: str | None
    arrival_time: float
    stream: bool
    include_usage: bool
    num_logprobs: int | None  # None: no logprobs
    user: str | None
    adapter: ServedAdapter | None = None  # the LoRA adapter "model" named (None: the base model)
    pins: list[PinSpec] = field(default_factory=list)  # explicit caching, for the first prompt
    owner: str | None = None  # the caller's tenant id when keys are configured (the observatory's tenant rule)
    tool_parser: ToolParser | None = None  # reads tool calls out of each chat choice (None: text is content)
    return_token_ids: bool = False  # vLLM's return_token_ids: prompt and output token ids beside the text

    @property
    def n(self) -> int:
        return self.params[0].n

    def engine_request_id(self, prompt_index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt_index}"


class _ClientDisconnected(Exception):
    pass


# --- running a generation ---------------------------------------------------------------------------------


async def _serve(state: ServerState, request: Request, generation: _Generation) -> Response:
    admission = state.admit()
    if generation.user is not None and logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: user %r, %d prompt(s)", generation.request_id, generation.user, len(generation.prompts))
    engine = state.engine
    lora_request = generation.adapter.lora_request if generation.adapter is not None else None
    engine.metrics.request_started(lora_request.lora_name if lora_request is not None else None)
    outputs = _merge([
        engine.generate(generation.engine_request_id(index), prompt, params,
                        cache_salt=generation.cache_salt, arrival_time=generation.arrival_time,
                        pins=generation.pins if index == 0 else (), lora_request=lora_request,
                        owner=generation.owner, stream=generation.stream)
        for index, (prompt, params) in enumerate(zip(generation.prompts, generation.params))
    ])
    handed_to_stream = False
    try:
        if not generation.stream:
            finals = await _unless_disconnected(request, _collect_finals(outputs))
            return Response(dumps(_full_response(state, generation, finals)), media_type="application/json")
        # Headers go out with the first token, not before: what the client times is the real TTFT.
        first = await _unless_disconnected(request, anext(outputs))
        writer = _StreamWriter(state, generation)
        response = _EventStreamResponse(_stream_body(writer, first, outputs), on_close=admission.release)
        handed_to_stream = True
        return response
    except _ClientDisconnected:
        logger.debug("%s: the client went away; request aborted", generation.request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except EngineError as error:
        raise internal_error(str(error)) from None
    # Anything else goes to the app's error mapping: the engine refusing the request (InvalidRequestError, which
    # the handlers' checks should have found) a 400 naming the field, any other fault a logged 500.
    finally:
        if not handed_to_stream:
            admission.release()
            try:
                await outputs.aclose()  # aborts whatever is still running (no-op once finished)
            except RuntimeError:  # still running in a task being cancelled: its own cleanup aborts
                pass


async def _merge(
    generators: Sequence[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as (prompt index, output), in arrival order."""
    if len(generators) == 1:
        try:
            async for output in generators[0]:
                yield 0, output
        finally:
            await generators[0].aclose()  # type: ignore[attr-defined]  # aborts the request if unfinished
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, generator: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in generator:
                merged.put_nowait((index, output))
            merged.put_nowait((index, None))
        except Exception as error:
            merged.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(index, generator)) for index, generator in enumerate(generators)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a request still running is aborted by its generator's cleanup


async def _collect_finals(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, output in outputs:
        if output.finished:
            finals[index] = output
    return finals


async def _unless_disconnected(request: Request, awaitable: Awaitable[ResultT]) -> ResultT:
    """Await ``awaitable`` unless the client disconnects first (then cancel it and raise)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _EventStreamResponse(StreamingResponse):
    """SSE response whose cleanup (abort if unfinished, release the admission) always runs."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()  # type: ignore[attr-defined]
            except RuntimeError:  # already closing after a cancellation
                pass
            self._on_close()


async def _stream_body(
    writer: _StreamWriter, first: tuple[int, RequestOutput], outputs: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[bytes]:
    try:
        try:
            yield writer.encode(*first)
            async for index, output in outputs:
                data = writer.encode(index, output)
                if data:
                    yield data
        except EngineError as error:
            yield sse_event(internal_error(str(error)).body())
            yield SSE_DONE
            return
        if writer.generation.include_usage:
            yield writer.usage_event()
        yield SSE_DONE
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]


# --- response bodies -----------------------------------------------------------------------------------------


@dataclass
class _ChoiceStream:
    started: bool = False
    finished: bool = False
    num_logprobs_sent: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    tool_stream: ToolCallStream | None = None  # this choice's own extractor (chat with tools)
    made_calls: bool = False
    num_token_ids_sent: int = 0  # return_token_ids: the output ids already in a chunk
    started_ids: bool = False  # return_token_ids: the prompt's ids went out (in this choice's first chunk)


@dataclass
class _StreamWriter:
    """Turns cumulative engine outputs into OpenAI SSE chunks (chat or completions)."""

    state: ServerState
    generation: _Generation
    choices: dict[int, _ChoiceStream] = field(default_factory=dict)
    last_outputs: dict[int, RequestOutput] = field(default_factory=dict)
    # return_token_ids: the choice being written, its output ids and its prompt's (set per choice by ``encode``).
    _ids: tuple[_ChoiceStream, Sequence[int], Sequence[int]] | None = None

    def __post_init__(self) -> None:
        generation = self.generation
        self.header = {
            "id": generation.request_id,
            "object": "chat.completion.chunk" if generation.chat else "text_completion",
            "created": generation.created,
            "model": generation.model,
        }
        parser = generation.tool_parser
        for prompt_index, params in enumerate(generation.params):
            for sample in range(params.n):
                self.choices[prompt_index * params.n + sample] = _ChoiceStream(
                    tool_stream=parser.stream() if parser is not None else None)

    def encode(self, prompt_index: int, output: RequestOutput) -> bytes:
        self.last_outputs[prompt_index] = output
        parts: list[bytes] = []
        for completion in output.outputs:
            choice_index = prompt_index * self.generation.n + completion.index
            choice = self.choices[choice_index]
            if choice.finished:
                continue
            # return_token_ids: the chunks written below carry the ids since the last chunk (``_event``).
            self._ids = (choice, completion.token_ids, output.prompt_token_ids) if self.generation.return_token_ids \
                else None
            finished = completion.finish_reason is not None
            # Held back while it could still be the start of a stop string (kvreuse.output_processor).
            text = completion.text_delta
            entries = None
            if self.generation.num_logprobs is not None and completion.logprobs is not None and (text or finished):
                entries = completion.logprobs[choice.num_logprobs_sent:]
                choice.num_logprobs_sent = len(completion.logprobs)
            if self.generation.chat:
                delta = StreamDelta(content=text)
                if choice.tool_stream is not None:
                    # Text that may still become a call is held back by the extractor until it is decided.
                    delta = choice.tool_stream.feed(text)
                    if finished:
                        rest = choice.tool_stream.finish()
                        delta.content += rest.content
                        delta.tool_calls += rest.tool_calls
                    choice.made_calls = choice.made_calls or bool(delta.tool_calls)
                finish_reason = _finish_reason(completion, choice.made_calls) if finished else None
                self._chat_chunks(parts, choice_index, choice, delta, entries, finish_reason)
            else:
                finish_reason = _finish_reason(completion) if finished else None
                self._completion_chunks(parts, choice_index, choice, text, entries, finish_reason)
            choice.finished = finished
        return b"".join(parts)

    def _event(self, choice: dict[str, Any]) -> bytes:
        payload: dict[str, Any] = {**self.header, "choices": [choice]}
        if self._ids is not None:  # vLLM's stream shape: the prompt's ids in a choice's first chunk, then deltas
            stream, token_ids, prompt_token_ids = self._ids
            if not stream.started_ids:
                stream.started_ids = True
                if self.generation.chat:
                    payload["prompt_token_ids"] = list(prompt_token_ids)
                else:
                    choice["prompt_token_ids"] = list(prompt_token_ids)
            choice["token_ids"] = list(token_ids[stream.num_token_ids_sent:])
            stream.num_token_ids_sent = len(token_ids)
        if self.generation.include_usage:
            payload["usage"] = None  # OpenAI's shape: usage only in the last chunk
        return sse_event(payload)

    def _chat_chunks(self, parts: list[bytes], index: int, choice: _ChoiceStream, delta: StreamDelta,
                     entries: Sequence[Any] | None, finish_reason: str | None) -> None:
        text = delta.content
        # The role goes out with the first content or call; with tools, with the first token, whatever the
        # extractor holds back (a call's head takes tens of tokens to be certain: a client timing the first
        # chunk would otherwise time the call's name, where a text reply's first chunk is its first token).
        # A reply that opens with a call, or whose first token decides nothing yet, has null content.
        if not choice.started and (delta or entries or finish_reason or choice.tool_stream is not None):
            choice.started = True
            opening = "" if text or not (delta.tool_calls or choice.tool_stream is not None) else None
            parts.append(self._event({"index": index, "delta": {"role": "assistant", "content": opening},
                                      "logprobs": None, "finish_reason": None}))
        if not (delta or entries or finish_reason):
            return  # e.g. a token that completes no character yet, or text held back: nothing more to show
        logprobs = None
        if entries:
            logprobs = chat_logprobs(entries, self.state.token_texts, self.generation.num_logprobs or 0)
        if text or (logprobs is not None and not delta.tool_calls):
            parts.append(self._event({"index": index, "delta": {"content": text}, "logprobs": logprobs,
                                      "finish_reason": None}))
            logprobs = None
        if delta.tool_calls:
            calls = [tool_call_delta_json(call) for call in _merged(delta.tool_calls)]
            parts.append(self._event({"index": index, "delta": {"tool_calls": calls}, "logprobs": logprobs,
                                      "finish_reason": None}))
        if finish_reason is not None:
            parts.append(self._event({"index": index, "delta": {}, "logprobs": None,
                                      "finish_reason": finish_reason}))

    def _completion_chunks(self, parts: list[bytes], index: int, choice: _ChoiceStream, text: str,
                           entries: Sequence[Any] | None, finish_reason: str | None) -> None:
        if not (text or entries or finish_reason):
            return
        logprobs = None
        if entries is not None:
            logprobs, choice.text_offset = completion_logprobs(entries, self.state.token_texts, choice.text_offset)
        parts.append(self._event({"index": index, "text": text, "logprobs": logprobs,
                                  "finish_reason": finish_reason}))

    def usage_event(self) -> bytes:
        return sse_event({**self.header, "choices": [], "usage": _usage(self.generation, self.last_outputs)})


def _finish_reason(completion: CompletionOutput, made_calls: bool = False) -> str:
    # "abort" never reaches a client that is still listening; report anything else as OpenAI names it.
    if completion.finish_reason == "length":
        return "length"  # a call cut by max_tokens is reported, but as cut
    return "tool_calls" if made_calls else "stop"


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One stream piece per call: consecutive deltas of the same call joined (its head and its first
    argument text go out together)."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and delta.id is None and delta.name is None:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + delta.arguments)
        else:
            merged.append(delta)
    return merged


def _usage(generation: _Generation, outputs: dict[int, RequestOutput]) -> dict[str, Any]:
    completion_tokens = sum(len(c.token_ids) for output in outputs.values() for c in output.outputs)
    cached_tokens = sum(output.num_cached_tokens for output in outputs.values())
    by_tier = sum_cached_by_tier(output.cached_tokens_by_tier for output in outputs.values())
    moved = (sum(output.num_moved_tokens for output in outputs.values()),
             sum(output.num_recomputed_tokens for output in outputs.values()))
    drafts = (sum(output.num_drafts for output in outputs.values()),
              sum(output.num_draft_tokens for output in outputs.values()),
              sum(output.num_accepted_draft_tokens for output in outputs.values()))
    return usage(sum(generation.prompt_lengths), completion_tokens, cached_tokens, by_tier, moved, drafts)


def _full_response(state: ServerState, generation: _Generation, finals: dict[int, RequestOutput]) -> dict[str, Any]:
    choices = []
    for prompt_index in range(len(generation.prompts)):
        for completion in finals[prompt_index].outputs:
            index = prompt_index * generation.n + completion.index
            choice: dict[str, Any] = {"index": index}
            made_calls = False
            if generation.chat:
                choice["message"] = {"role": "assistant", "content": completion.text}
                if generation.tool_parser is not None:
                    content, calls = generation.tool_parser.extract(completion.text)
                    choice["message"]["content"] = content or None
                    if calls:
                        choice["message"]["tool_calls"] = [tool_call_json(call) for call in calls]
                        made_calls = True
                choice["logprobs"] = (
                    chat_logprobs(completion.logprobs or [], state.token_texts, generation.num_logprobs or 0)
                    if generation.num_logprobs is not None else None
                )
            else:
                choice["text"] = completion.text
                choice["logprobs"] = (
                    completion_logprobs(completion.logprobs or [], state.token_texts)[0]
                    if generation.num_logprobs is not None else None
                )
            choice["finish_reason"] = _finish_reason(completion, made_calls)
            choice["stop_reason"] = completion.stop_reason
            if generation.return_token_ids:  # vLLM's places: a completion choice has its prompt's ids too
                choice["token_ids"] = list(completion.token_ids)
                if not generation.chat:
                    choice["prompt_token_ids"] = list(finals[prompt_index].prompt_token_ids)
            choices.append(choice)
    response = {
        "id": generation.request_id,
        "object": "chat.completion" if generation.chat else "text_completion",
        "created": generation.created,
        "model": generation.model,
        "choices": choices,
        "usage": _usage(generation, finals),
    }
    if generation.return_token_ids and generation.chat:
        response["prompt_token_ids"] = list(finals[0].prompt_token_ids)
    return response
