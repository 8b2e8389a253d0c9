"""The FastAPI app: OpenAI-compatible routes over an `AsyncEngine`.

Handlers authenticate, parse and validate (every bad input is a 4xx in OpenAI's error shape before
anything reaches the engine), tokenize on the event loop (kvreuse.inputs, through the AsyncEngine's
own tokenizer), then stream the processed outputs. A stream sends nothing, not even its headers,
before the first token exists, so the time to first token a client measures is the real one. Stream
deltas are the output processor's ``text_delta``: text that could be the start of a stop string is
held back until it is clear it is not. A client that goes away aborts its request.
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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvreuse.cache.pins import PinSpec
from kvreuse.engine import LLMEngine
from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import PromptInput
from kvreuse.outputs import CompletionOutput, RequestOutput
from kvreuse.sampling import SamplingParams
from kvreuse.server.anthropic import register_anthropic_routes
from kvreuse.server.async_engine import AsyncEngine, EngineError
from kvreuse.server.auth import ApiKeyAuth, Tenant
from kvreuse.system_prompt import system_prompt_pin
from kvreuse.server.errors import (
    APIError, bad_request, internal_error, model_not_found, unavailable,
)
from kvreuse.server.protocol import (
    SSE_DONE, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, TokenTexts,
    chat_logprobs, completion_logprobs, dumps, model_card, parse_request, sse_event, usage,
)

logger = logging.getLogger("kvreuse.server")

ResultT = TypeVar("ResultT")

# Status for a request whose client went away before the answer (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class ServerConfig:
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    isolate_tenants: bool = False
    # Requests waiting for the engine beyond this get a 503 instead of an ever longer queue.
    max_waiting_requests: int = 1024
    model_root: str | None = None  # the "root" of the /v1/models entry (default: the model name)

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {self.max_waiting_requests}")


class ServerState:
    """What the routes share: the engine, the tokenizer, auth, and the drain / in-flight bookkeeping.
    Only touched on the event loop thread (the engine thread sees the AsyncEngine alone)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.llm_engine = engine.engine  # read-only use here: tokenizer, limits, prompt validation
        self.tokenizer = engine.tokenizer  # the event loop's own tokenizer object (the engine thread has another)
        self.model_name = engine.model_name
        self.max_model_len = self.llm_engine.max_model_len
        self.vocab_size = self.llm_engine.model_config.vocab_size
        self.auth = ApiKeyAuth(config.api_keys, config.isolate_tenants, config.admin_keys)
        self.token_texts = TokenTexts(self.tokenizer)
        self.created = int(time.time())
        self.draining = False
        self.num_in_flight = 0  # generation requests admitted and not yet answered in full

    # --- admission ----------------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down and accepts no new requests", code="draining")
        if not self.engine.is_running:
            raise unavailable("the engine is not running", code="engine_unavailable")

    def admit(self) -> _Admission:
        """Count a generation request in flight, or refuse it with a 503 (draining, overloaded)."""
        self.check_accepting()
        waiting = self.engine.stats.num_waiting + self.engine.num_pending_commands
        if waiting >= self.config.max_waiting_requests:
            raise unavailable(
                f"the server is overloaded: {waiting} requests are waiting for the engine "
                f"(max_waiting_requests={self.config.max_waiting_requests}); retry later", code="overloaded"
            )
        self.num_in_flight += 1
        return _Admission(self)

    # --- validation helpers -------------------------------------------------------------------------
    def authenticate(self, request: Request) -> Tenant | None:
        return self.auth.authenticate(request.headers.get("authorization"))

    def pin_owner_filter(self, tenant: Tenant | None) -> str | None:
        """Whose pins this caller may see and delete: None for all (an admin, or tenants not isolated)."""
        if tenant is not None and tenant.is_admin:
            return None
        return self.owner_of(tenant)

    def owner_of(self, tenant: Tenant | None) -> str | None:
        """Who owns pins made by this caller (only when tenants are isolated)."""
        return tenant.tenant_id if tenant is not None and self.auth.isolate_tenants else None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def checked_prompt(self, prompt: str | list[int], param: str) -> tuple[PromptInput, int]:
        """(the prompt for the engine, its token count); a bad prompt is a 400 naming ``param``."""
        try:
            tokenized = self.engine.inputs.from_prompt(prompt, param=param)
        except InvalidRequestError as error:
            raise bad_request(error.message, param, error.code) from None
        return tokenized.as_engine_prompt(), len(tokenized.token_ids)

    def check_stop_token_ids(self, stop_token_ids: list[int] | None) -> None:
        # An id beyond the vocabulary would fail inside the sampler, in the middle of a batch.
        for position, token_id in enumerate(stop_token_ids or []):
            if not 0 <= token_id < self.vocab_size:
                raise bad_request(f"stop_token_ids[{position}] = {token_id} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", "stop_token_ids")

    def max_tokens(self, requested: tuple[int | None, str], num_prompt_tokens: int) -> int:
        """The output budget: what the client asked for, or all the room the context leaves."""
        value, field_name = requested
        room = self.max_model_len - num_prompt_tokens
        if value is None:
            return room
        if value < 1:
            raise bad_request(f"{field_name} must be at least 1, got {value}", field_name)
        if value > room:
            raise bad_request(
                f"{field_name}={value} is too large: the prompt has {num_prompt_tokens} tokens and "
                f"max_model_len is {self.max_model_len}, so at most {room} tokens can be generated",
                field_name, code="context_length_exceeded",
            )
        return value


class _Admission:
    """One in-flight request; `release` is idempotent so every exit path may call it."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._state.num_in_flight -= 1


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
    pins: list[PinSpec] = field(default_factory=list)  # explicit caching, for the first prompt

    @property
    def n(self) -> int:
        return self.params[0].n

    def engine_request_id(self, prompt_index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt_index}"


class _ClientDisconnected(Exception):
    pass


# --- building the app ---------------------------------------------------------------------------------


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
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
        state.authenticate(request)
        state.check_model(model_id)
        return JSONResponse(_model_card(state))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival_time = time.monotonic()
        tenant = state.authenticate(request)
        state.check_accepting()
        body = parse_request(ChatCompletionRequest, await request.body())
        state.check_model(body.model)
        body.check()
        state.check_stop_token_ids(body.stop_token_ids)
        tokenized = state.engine.inputs.from_messages(body.messages, add_generation_prompt=body.add_generation_prompt)
        token_ids = tokenized.token_ids
        prompt, num_prompt_tokens = tokenized.as_engine_prompt(), len(token_ids)
        max_tokens = state.max_tokens(body.requested_max_tokens, num_prompt_tokens)
        renames = {"logprobs": "top_logprobs", "max_tokens": body.requested_max_tokens[1]}
        params = body.sampling_params(max_tokens=max_tokens, logprobs=body.num_logprobs, renames=renames)
        pins: list[PinSpec] = []
        if body.save_system_prompt_kv_cache:
            spec = system_prompt_pin(state.tokenizer, body.messages, token_ids)
            try:
                state.llm_engine.check_pin(spec, num_prompt_tokens)  # reads configuration only
            except ValueError as error:
                raise bad_request(str(error), "save_system_prompt_kv_cache") from None
            pins.append(dataclasses.replace(spec, owner=state.owner_of(tenant)))
        generation = _Generation(
            chat=True, request_id=f"chatcmpl-{uuid.uuid4().hex}", model=state.model_name, created=int(time.time()),
            prompts=[prompt], prompt_lengths=[num_prompt_tokens], params=[params],
            cache_salt=state.auth.cache_salt(tenant, body.cache_salt), arrival_time=arrival_time,
            stream=bool(body.stream), include_usage=body.include_usage_in_stream,
            num_logprobs=body.num_logprobs, user=body.user, pins=pins,
        )
        return await _serve(state, request, generation)

    @app.get("/v1/cache/pins")
    async def list_pins(request: Request) -> JSONResponse:
        owner = state.pin_owner_filter(state.authenticate(request))
        pins = await state.engine.call(lambda engine: [pin.as_dict() for pin in engine.list_pins()])
        visible = [pin for pin in pins if owner is None or pin["owner"] in (None, owner)]
        return JSONResponse({"object": "list", "data": visible})

    @app.delete("/v1/cache/pins/{pin_id}")
    async def delete_pin(pin_id: str, request: Request) -> JSONResponse:
        owner = state.pin_owner_filter(state.authenticate(request))

        def remove(engine: LLMEngine) -> dict[str, Any] | None:
            pin = engine.get_pin(pin_id)
            if pin is None or (owner is not None and pin.owner != owner):
                return None  # another tenant's pin is as good as absent
            return engine.unpin(pin_id).as_dict()

        removed = await state.engine.call(remove)
        if removed is None:
            raise APIError(404, f"no pin with id {pin_id!r}", error_type="not_found_error", param="pin_id")
        return JSONResponse({"id": pin_id, "object": "cache.pin", "deleted": True, "pin": removed})

    @app.get("/v1/cache/events")
    async def cache_events(request: Request) -> JSONResponse:
        """Block keys stored in / removed from the prefix cache since ``after`` (for kvreuse route).
        Every tenant's keys are in it, so it needs an admin key when keys are configured."""
        state.auth.require_admin(state.authenticate(request), "reading the KV event log")
        after = _query_int(request, "after", 0, 0, None)
        limit = _query_int(request, "limit", KV_EVENTS_PAGE, 1, KV_EVENTS_PAGE)
        log = state.llm_engine.kv_events
        batch = log.read(after, limit)
        return JSONResponse({"object": "cache.events", "epoch": log.epoch,
                             "block_size": state.llm_engine.kv_cache.block_size,
                             "events": [event.to_json() for event in batch.events],
                             "next_after": batch.next_after, "lost": batch.lost, "last_seq": batch.last_seq})

    register_anthropic_routes(app, state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival_time = time.monotonic()
        tenant = state.authenticate(request)
        state.check_accepting()
        body = parse_request(CompletionRequest, await request.body())
        state.check_model(body.model)
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
        generation = _Generation(
            chat=False, request_id=f"cmpl-{uuid.uuid4().hex}", model=state.model_name, created=int(time.time()),
            prompts=prompts, prompt_lengths=lengths, params=params,
            cache_salt=state.auth.cache_salt(tenant, body.cache_salt), arrival_time=arrival_time,
            stream=bool(body.stream), include_usage=body.include_usage_in_stream,
            num_logprobs=body.logprobs, user=body.user,
        )
        return await _serve(state, request, generation)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        state.authenticate(request)
        body = parse_request(TokenizeRequest, await request.body())
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
        inputs = state.engine.inputs
        if body.messages is not None:
            tokenized = inputs.from_messages(body.messages, add_generation_prompt=body.add_generation_prompt,
                                             validate=False)
        else:
            tokenized = inputs.from_text(body.prompt or "", add_special_tokens=body.add_special_tokens,
                                         validate=False)
        token_ids = tokenized.token_ids
        return JSONResponse({"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        state.authenticate(request)
        body = parse_request(DetokenizeRequest, await request.body())
        state.check_model(body.model)
        for position, token_id in enumerate(body.tokens):
            if not 0 <= token_id < state.vocab_size:
                raise bad_request(f"tokens[{position}] = {token_id} is outside the vocabulary "
                                  f"[0, {state.vocab_size})", "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        # It flushes every tenant's cache: an admin action whenever keys are configured.
        state.auth.require_admin(state.authenticate(request), "resetting the prefix cache")
        state.check_accepting()
        freed_blocks = await state.engine.call(lambda engine: engine.reset_prefix_cache())
        logger.info("prefix cache reset: %d idle blocks freed", freed_blocks)
        return JSONResponse({"freed_blocks": freed_blocks})

    return app


KV_EVENTS_PAGE = 4096  # most events one /v1/cache/events reply carries


def _query_int(request: Request, name: str, default: int, minimum: int, maximum: int | None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}", param=name) from None
    if value < minimum or (maximum is not None and value > maximum):
        limit = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise bad_request(f"{name} must be {limit}, got {value}", param=name)
    return value


def _model_card(state: ServerState) -> dict[str, Any]:
    kv_cache = state.llm_engine.kv_cache
    return model_card(state.model_name, state.config.model_root or state.model_name, state.created,
                      state.max_model_len, kv_cache.num_blocks, kv_cache.block_size)


# --- running a generation ---------------------------------------------------------------------------------


async def _serve(state: ServerState, request: Request, generation: _Generation) -> Response:
    admission = state.admit()
    if generation.user is not None and logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: user %r, %d prompt(s)", generation.request_id, generation.user, len(generation.prompts))
    engine = state.engine
    outputs = _merge([
        engine.generate(generation.engine_request_id(index), prompt, params,
                        cache_salt=generation.cache_salt, arrival_time=generation.arrival_time,
                        pins=generation.pins if index == 0 else ())
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
    except InvalidRequestError as error:  # the engine refused the request (the handlers' checks should have)
        raise bad_request(error.message, error.param, error.code) from None
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


@dataclass
class _StreamWriter:
    """Turns cumulative engine outputs into OpenAI SSE chunks (chat or completions)."""

    state: ServerState
    generation: _Generation
    choices: dict[int, _ChoiceStream] = field(default_factory=dict)
    last_outputs: dict[int, RequestOutput] = field(default_factory=dict)

    def __post_init__(self) -> None:
        generation = self.generation
        self.header = {
            "id": generation.request_id,
            "object": "chat.completion.chunk" if generation.chat else "text_completion",
            "created": generation.created,
            "model": generation.model,
        }
        for prompt_index, params in enumerate(generation.params):
            for sample in range(params.n):
                self.choices[prompt_index * params.n + sample] = _ChoiceStream()

    def encode(self, prompt_index: int, output: RequestOutput) -> bytes:
        self.last_outputs[prompt_index] = output
        parts: list[bytes] = []
        for completion in output.outputs:
            choice_index = prompt_index * self.generation.n + completion.index
            choice = self.choices[choice_index]
            if choice.finished:
                continue
            finished = completion.finish_reason is not None
            # Held back while it could still be the start of a stop string (kvreuse.output_processor).
            text = completion.text_delta
            entries = None
            if self.generation.num_logprobs is not None and completion.logprobs is not None and (text or finished):
                entries = completion.logprobs[choice.num_logprobs_sent:]
                choice.num_logprobs_sent = len(completion.logprobs)
            finish_reason = _finish_reason(completion) if finished else None
            if self.generation.chat:
                self._chat_chunks(parts, choice_index, choice, text, entries, finish_reason)
            else:
                self._completion_chunks(parts, choice_index, choice, text, entries, finish_reason)
            choice.finished = finished
        return b"".join(parts)

    def _event(self, choice: dict[str, Any]) -> bytes:
        payload: dict[str, Any] = {**self.header, "choices": [choice]}
        if self.generation.include_usage:
            payload["usage"] = None  # OpenAI's shape: usage only in the last chunk
        return sse_event(payload)

    def _chat_chunks(self, parts: list[bytes], index: int, choice: _ChoiceStream, text: str,
                     entries: Sequence[Any] | None, finish_reason: str | None) -> None:
        if not (text or entries or finish_reason):
            return  # e.g. a first token that completes no character yet: nothing to show, role included
        if not choice.started:
            # The role goes out with the first content, never earlier: a client timing the first
            # chunk measures the time to the first text.
            choice.started = True
            parts.append(self._event({"index": index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}))
        if text or entries:
            logprobs = None
            if entries is not None:
                logprobs = chat_logprobs(entries, self.state.token_texts, self.generation.num_logprobs or 0)
            parts.append(self._event({"index": index, "delta": {"content": text}, "logprobs": logprobs,
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


def _finish_reason(completion: CompletionOutput) -> str:
    # "abort" never reaches a client that is still listening; report anything else as OpenAI names it.
    return completion.finish_reason if completion.finish_reason in ("stop", "length") else "stop"


def _usage(generation: _Generation, outputs: dict[int, RequestOutput]) -> dict[str, Any]:
    completion_tokens = sum(len(c.token_ids) for output in outputs.values() for c in output.outputs)
    cached_tokens = sum(output.num_cached_tokens for output in outputs.values())
    return usage(sum(generation.prompt_lengths), completion_tokens, cached_tokens)


def _full_response(state: ServerState, generation: _Generation, finals: dict[int, RequestOutput]) -> dict[str, Any]:
    choices = []
    for prompt_index in range(len(generation.prompts)):
        for completion in finals[prompt_index].outputs:
            index = prompt_index * generation.n + completion.index
            choice: dict[str, Any] = {"index": index}
            if generation.chat:
                choice["message"] = {"role": "assistant", "content": completion.text}
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
            choice["finish_reason"] = _finish_reason(completion)
            choice["stop_reason"] = completion.stop_reason
            choices.append(choice)
    return {
        "id": generation.request_id,
        "object": "chat.completion" if generation.chat else "text_completion",
        "created": generation.created,
        "model": generation.model,
        "choices": choices,
        "usage": _usage(generation, finals),
    }
