"""Async streaming load client for any OpenAI-compatible server.

Each request is a streaming POST to /v1/completions (default) or /v1/chat/completions with
``stream_options.include_usage``; the client times the first content event (TTFT), the gaps between
content events (ITL) and the end of the stream, and reads prompt / cached / output tokens from the
final usage chunk (cached from ``usage.prompt_tokens_details.cached_tokens``, the standard field;
0 and flagged when a server does not report it). Only standard request fields are sent, plus vLLM's
``ignore_eos`` unless turned off, so vLLM, SGLang and llama.cpp's server accept the same requests.

Arrivals are a seeded Poisson process (``request_rate``) or all at once, optionally behind a
concurrency limit. A multi-turn request waits for the previous turn of its conversation and carries
that turn's real reply in its history.

Agent requests (workload ``agent``) always go to /v1/chat/completions with the workload's ``tools``,
``tool_choice: "required"`` and ``parallel_tool_calls: false``, and without ``ignore_eos`` (a forced
call must be able to end); without tools (the workload's no-tools baseline) they are plain chat
turns. Each agent's turns run one after another, agents concurrently. A turn's prompt is the
previous turn's messages plus the reply's tool calls exactly as streamed (agent.py) and the tool
results. Cached tokens: ``usage.prompt_tokens_details.cached_tokens`` where the server sends it
(kvreuse, vLLM, recent llama-server), else llama-server's ``timings.cache_n`` (its ``timings.prompt_n``
are the tokens it computed, so the prompt is their sum when usage is missing).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvreuse.bench.agent import (
    AgentReply,
    ToolCallDeltas,
    assistant_message,
    first_messages,
    followup_messages,
)
from kvreuse.bench.workloads import BenchRequest, TextTokenizer
from kvreuse.inputs import common_prefix_length

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT_FORMATS = ("text", "ids")
# Below this many seconds per output token between the first and the last chunk, the output did
# not stream: it arrived at once.
BURST_S_PER_TOKEN = 0.0005


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    prompt_format: str = "text"
    request_rate: float = math.inf  # requests per second; inf sends every request at once
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    api_key: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {list(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {list(PROMPT_FORMATS)}, got {self.prompt_format!r}")
        if self.prompt_format == "ids" and self.endpoint != "completions":
            raise ValueError("prompt_format 'ids' needs endpoint 'completions' (chat messages are text)")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests/s (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class RequestResult:
    """What one request measured; times in seconds, ``start_s`` from the start of the run."""

    request_id: str
    group: str
    conversation: str | None
    turn: int
    success: bool = False
    error: str | None = None
    status_code: int | None = None
    scheduled_s: float = 0.0  # Poisson arrival time
    start_s: float = 0.0  # when it was actually sent (later: a concurrency slot, the previous turn)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    cached_tokens_reported: bool = False
    output_tokens: int = 0
    usage_reported: bool = False
    # Every chunk came in one burst at the end (a server that streams nothing for tokens without
    # text): TTFT is then really the whole request, and TPOT / ITL mean nothing.
    output_arrived_at_end: bool = False
    expected_prompt_tokens: int | None = None
    expected_output_tokens: int = 0
    ideal_cached_tokens: int | None = None
    # The prompt's length as the client tokenized it for the ideal figure (a server that encodes earlier
    # replies by their sampled ids counts differently): the ideal hit rate's denominator.
    ideal_prompt_tokens: int | None = None
    generated_text: str = ""
    finish_reason: str | None = None
    # Where cached_tokens came from: "usage" (prompt_tokens_details) or "timings" (llama-server's cache_n).
    cached_tokens_source: str | None = None
    # Agent requests: the tool calls the reply carried, as streamed (empty: none came back); None otherwise.
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def tool_call_returned(self) -> bool | None:
        """Whether an agent turn's reply carried a tool call (None for other requests)."""
        return None if self.tool_calls is None else bool(self.tool_calls)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's definition)."""
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "group": self.group, "conversation": self.conversation,
            "turn": self.turn, "success": self.success, "error": self.error, "status_code": self.status_code,
            "scheduled_s": self.scheduled_s, "start_s": self.start_s, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s, "itl_s": self.itl_s, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "cached_tokens_reported": self.cached_tokens_reported,
            "output_tokens": self.output_tokens, "usage_reported": self.usage_reported,
            "output_arrived_at_end": self.output_arrived_at_end,
            "expected_prompt_tokens": self.expected_prompt_tokens,
            "expected_output_tokens": self.expected_output_tokens,
            "ideal_cached_tokens": self.ideal_cached_tokens, "ideal_prompt_tokens": self.ideal_prompt_tokens,
            "finish_reason": self.finish_reason, "cached_tokens_source": self.cached_tokens_source,
            "tool_calls": self.tool_calls,
        }


@dataclass
class BenchmarkRun:
    results: list[RequestResult]
    duration_s: float  # first request sent -> last request finished


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times of a Poisson process at ``request_rate`` (seeded); all 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


@dataclass
class _History:
    """The turns of one conversation so far: (user text, reply text); for an agent, the messages its
    last turn sent and that turn's reply."""

    turns: list[tuple[str, str]] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    reply: AgentReply | None = None


def compose_text(request: BenchRequest, history: Sequence[tuple[str, str]]) -> str:
    """The completions prompt: prefix, earlier turns with their replies, the new message."""
    return request.prefix_text + "".join(user + reply for user, reply in history) + request.user_text


def compose_messages(request: BenchRequest, history: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": request.prefix_text}] if request.prefix_text else []
    for user, reply in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": request.user_text})
    return messages


def compose_agent_messages(request: BenchRequest, previous: Sequence[dict[str, Any]] | None,
                           reply: AgentReply | None) -> list[dict[str, Any]]:
    """An agent turn's messages: turn 0 the system prompt and the task; a later turn the previous
    turn's messages plus its reply (tool calls untouched) and the tool results (agent.py)."""
    if request.turn == 0 or previous is None or reply is None:
        return first_messages(request.prefix_text, request.user_text)
    return [*previous, *followup_messages(reply, request.tool_result_text)]


def agent_tools(request: BenchRequest) -> list[dict[str, Any]] | None:
    return None if request.tools_json is None else json.loads(request.tools_json)


class LoadClient:
    """Sends a workload's requests and measures each one."""

    def __init__(self, config: ClientConfig, tokenizer: TextTokenizer | None = None) -> None:
        if config.prompt_format == "ids" and tokenizer is None:
            raise ValueError("prompt_format 'ids' needs a tokenizer")
        self._tools_of: dict[str | None, list[dict[str, Any]] | None] = {}
        self.config = config
        self.tokenizer = tokenizer

    def run(self, requests: Sequence[BenchRequest]) -> BenchmarkRun:
        return asyncio.run(self.run_async(requests))

    async def run_async(self, requests: Sequence[BenchRequest]) -> BenchmarkRun:
        config = self.config
        _check_dependencies(requests)
        if config.prompt_format == "ids" and any(request.agent for request in requests):
            raise ValueError("the agent workload sends chat messages: use --prompt-format text")
        offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
        finished = {(r.conversation, r.turn): asyncio.Event() for r in requests if r.conversation is not None}
        histories: dict[str, _History] = {}
        failed_turns: set[tuple[str | None, int]] = set()
        # A 2-request stream needs no more than 2 connections; an unbounded run needs one per request.
        limit = config.max_concurrency or max(1, len(requests))
        semaphore = asyncio.Semaphore(limit)
        progress = _progress_bar(len(requests), config.progress)
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        timeout = httpx.Timeout(config.timeout_s, connect=min(30.0, config.timeout_s))
        limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
        # Prompt text (and chat messages) of each successful request, for the ideal hit rate.
        sent_prompts: dict[str, tuple[str, list[dict[str, Any]] | None]] = {}
        async with httpx.AsyncClient(base_url=config.base_url.rstrip("/"), headers=headers, timeout=timeout,
                                     limits=limits) as http:
            run_start = time.perf_counter()

            async def one(request: BenchRequest, offset: float) -> RequestResult:
                result = RequestResult(request.request_id, request.group, request.conversation, request.turn,
                                       scheduled_s=offset, expected_output_tokens=request.max_tokens,
                                       expected_prompt_tokens=request.prompt_tokens)
                delay = run_start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                dependency = request.depends_on
                if dependency is not None:
                    await finished[dependency].wait()
                try:
                    if dependency is not None and dependency in failed_turns:
                        result.error = "skipped: the previous turn of its conversation failed"
                        return result
                    state = histories.setdefault(request.conversation, _History()) \
                        if request.conversation is not None else _History()
                    endpoint = "chat" if request.agent else config.endpoint
                    async with semaphore:
                        if request.agent:
                            body, text = self._agent_body(request, state)
                        else:
                            body, text = self._body(request, state.turns)
                        result.start_s = time.perf_counter() - run_start
                        await _stream_request(http, ENDPOINTS[endpoint], body, endpoint, result,
                                              agent=request.agent)
                    if result.success:
                        sent_prompts[request.request_id] = (text, body.get("messages"))
                        if request.agent:
                            state.messages = body["messages"]
                            state.reply = AgentReply(result.generated_text, result.tool_calls or [])
                        elif request.conversation is not None:
                            state.turns.append((request.user_text, result.generated_text))
                    return result
                finally:
                    if not result.success:
                        failed_turns.add((request.conversation, request.turn))
                    if request.conversation is not None:
                        finished[(request.conversation, request.turn)].set()
                    progress.update(1)

            try:
                results = await asyncio.gather(*(one(request, offset) for request, offset in zip(requests, offsets)))
            finally:
                progress.close()
            duration = time.perf_counter() - run_start
        if self.tokenizer is not None:
            # After the run, so tokenizing never delays the timestamps of requests in flight.
            tools = {request.request_id: agent_tools(request) for request in requests if request.agent}
            self._fill_ideal(results, sent_prompts, self.tokenizer, tools)
        return BenchmarkRun(list(results), duration)

    def _agent_body(self, request: BenchRequest, state: _History) -> tuple[dict[str, Any], str]:
        """An agent turn's chat request: the history with the previous reply fed back, the tools with
        ``tool_choice: "required"``; no ``ignore_eos`` with tools."""
        config = self.config
        body: dict[str, Any] = {"model": config.model, "max_tokens": request.max_tokens,
                                "temperature": config.temperature, "stream": True,
                                "stream_options": {"include_usage": True},
                                "messages": compose_agent_messages(request, state.messages, state.reply)}
        if request.tools_json is not None:
            if request.tools_json not in self._tools_of:  # parsed once per tool list
                self._tools_of[request.tools_json] = json.loads(request.tools_json)
            body |= {"tools": self._tools_of[request.tools_json], "tool_choice": "required",
                     "parallel_tool_calls": False}
        elif config.ignore_eos:
            body["ignore_eos"] = True
        return body, ""

    def _body(self, request: BenchRequest, history: Sequence[tuple[str, str]]) -> tuple[dict[str, Any], str]:
        """(request body, prompt text) with standard OpenAI fields only (plus ignore_eos when asked)."""
        config = self.config
        body: dict[str, Any] = {"model": config.model, "max_tokens": request.max_tokens,
                                "temperature": config.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if config.ignore_eos:
            body["ignore_eos"] = True
        text = compose_text(request, history)
        if config.endpoint == "chat":
            body["messages"] = compose_messages(request, history)
        elif config.prompt_format == "ids":
            assert self.tokenizer is not None
            body["prompt"] = self.tokenizer.encode(text)
        else:
            body["prompt"] = text
        return body, text

    @staticmethod
    def _fill_ideal(results: Sequence[RequestResult], sent_prompts: dict[str, tuple[str, Any]],
                    tokenizer: TextTokenizer, agent_tools_of: dict[str, Any] | None = None) -> None:
        """Tokens an unbounded, token-granular prefix cache could have served: the longest prefix a
        request shares with the prompt + reply of any request sent before it (never the last prompt
        token, whose logits are needed). Chat prompts are rendered with the tokenizer's template;
        agent turns with their tools and their reply's tool calls (no figure where the template
        cannot render them)."""
        render_chat = getattr(tokenizer, "apply_chat_template_ids", None)
        agent_tools_of = agent_tools_of or {}
        earlier: list[tuple[int, ...]] = []
        for result in sorted(results, key=lambda result: result.start_s):
            sent = sent_prompts.get(result.request_id)
            if sent is None:
                continue
            text, messages = sent
            reply = result.generated_text
            if result.request_id in agent_tools_of:
                if render_chat is None:
                    return
                tools = agent_tools_of[result.request_id]
                extra = {} if tools is None else {"tools": tools}
                answer = assistant_message(AgentReply(reply, result.tool_calls or []))
                try:
                    prompt = render_chat(messages, **extra)
                    after = render_chat([*messages, answer], add_generation_prompt=False, **extra)
                except Exception:  # noqa: BLE001 - a template, or a call cut short by max_tokens, may not render
                    continue
            elif messages is None:
                prompt, after = tokenizer.encode(text), tokenizer.encode(text + reply)
            elif render_chat is not None:
                try:
                    prompt = render_chat(messages)
                    after = render_chat([*messages, {"role": "assistant", "content": reply}],
                                        add_generation_prompt=False)
                except ValueError:  # no chat template: no ideal figure for chat
                    return
            else:
                return
            result.ideal_cached_tokens = min(_longest_shared_prefix(tuple(prompt), earlier), max(0, len(prompt) - 1))
            result.ideal_prompt_tokens = len(prompt)
            bisect.insort(earlier, tuple(after))


def _check_dependencies(requests: Sequence[BenchRequest]) -> None:
    present = {(request.conversation, request.turn) for request in requests}
    for request in requests:
        if request.depends_on is not None and request.depends_on not in present:
            raise ValueError(f"request {request.request_id} depends on turn {request.turn - 1} of conversation "
                             f"{request.conversation}, which is not in the workload")


def _longest_shared_prefix(sequence: tuple[int, ...], ordered: list[tuple[int, ...]]) -> int:
    """Longest common prefix of ``sequence`` with any of ``ordered`` (sorted): the best match is a
    neighbour of where ``sequence`` would be inserted."""
    position = bisect.bisect_left(ordered, sequence)
    best = 0
    for neighbour in ordered[max(0, position - 1):position + 1]:
        best = max(best, common_prefix_length(sequence, neighbour))
    return best


async def _stream_request(http: httpx.AsyncClient, path: str, body: dict[str, Any], endpoint: str,
                          result: RequestResult, agent: bool = False) -> None:
    """Send one streaming request and fill ``result``; never raises for a failed request.

    TTFT is the first event that carries a choice: servers send it when the first token exists,
    even where its text is still empty (vLLM streams a chunk per token; a chat stream opens with
    the role). ITL are the gaps between token chunks. A stream whose chunks all came in one burst
    at the end (a server that sends nothing for tokens without text) is flagged. ``agent``: the
    streamed tool calls are joined into ``result.tool_calls``.
    """
    started = time.perf_counter()
    first_event_at: float | None = None
    last_event_at = 0.0
    token_times: list[float] = []
    texts: list[str] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    tool_calls = ToolCallDeltas()
    saw_done = False
    try:
        async with http.stream("POST", path, json=body) as response:
            result.status_code = response.status_code
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {_error_message(detail)}"
                return
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    saw_done = True
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    result.error = f"malformed stream event: {data[:200]!r}"
                    return
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    result.error = f"server error event: {_error_message(json.dumps(chunk))}"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if isinstance(chunk.get("timings"), dict):  # llama-server
                    timings = chunk["timings"]
                for choice in chunk.get("choices") or []:
                    text, is_token = _choice_event(choice, endpoint)
                    if endpoint == "chat" and isinstance(choice.get("delta"), dict):
                        tool_calls.add(choice["delta"].get("tool_calls"))
                    if choice.get("finish_reason"):
                        result.finish_reason = str(choice["finish_reason"])
                    if first_event_at is None:
                        first_event_at = now
                    last_event_at = now
                    if is_token:
                        token_times.append(now)
                    texts.append(text)
    except httpx.TimeoutException as error:
        result.error = f"timeout: {type(error).__name__}"
        return
    except httpx.HTTPError as error:
        result.error = f"connection: {type(error).__name__}: {error}"
        return
    finished = time.perf_counter()
    if not saw_done:
        result.error = "stream ended without [DONE]"
        return
    if first_event_at is None:
        result.error = "stream carried no choices"
        return
    result.success = True
    result.ttft_s = first_event_at - started
    result.e2e_s = finished - started
    result.itl_s = [later - earlier for earlier, later in zip(token_times, token_times[1:])]
    result.generated_text = "".join(texts)
    if agent:
        result.tool_calls = tool_calls.calls()
    if usage is not None:
        result.usage_reported = True
        result.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        result.output_tokens = _int_or_none(usage.get("completion_tokens")) or len(token_times)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and _int_or_none(details.get("cached_tokens")) is not None:
            result.cached_tokens = int(details["cached_tokens"])
            result.cached_tokens_reported = True
            result.cached_tokens_source = "usage"
    else:
        # Without usage, token chunks stand in for tokens (a server may merge or skip some).
        result.output_tokens = len(token_times)
    if not result.cached_tokens_reported and timings is not None and _int_or_none(timings.get("cache_n")) is not None:
        # llama-server: cache_n prompt tokens came from its cache, prompt_n were computed.
        result.cached_tokens = int(timings["cache_n"])
        result.cached_tokens_reported = True
        result.cached_tokens_source = "timings"
        if result.prompt_tokens is None and _int_or_none(timings.get("prompt_n")) is not None:
            result.prompt_tokens = result.cached_tokens + int(timings["prompt_n"])
    # Real decoding takes milliseconds per token; chunks closer together than this came in one burst.
    result.output_arrived_at_end = (result.output_tokens >= 2 and
                                    last_event_at - first_event_at < BURST_S_PER_TOKEN * (result.output_tokens - 1))


async def sse_chunks(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of one streamed OpenAI request, for the benchmark scripts that time them themselves: a
    RuntimeError on a status other than 200 (with the body) or on an error event; ``[DONE]`` ends it."""
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode(errors='replace')}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk and not chunk.get("choices"):
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            yield chunk


def _choice_event(choice: dict[str, Any], endpoint: str) -> tuple[str, bool]:
    """(text, whether the event is a token): a chunk with text, or an empty one that is neither the
    opening role chunk of a chat stream nor a finish-only chunk."""
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        opening = "role" in delta and not delta.get("tool_calls")
    else:
        text = choice.get("text") or ""
        opening = False
    if text:
        return text, True
    return "", not opening and choice.get("finish_reason") is None


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _error_message(detail: str) -> str:
    try:
        payload = json.loads(detail)
    except json.JSONDecodeError:
        return detail[:300]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:300]
        if isinstance(error, str):
            return error[:300]
        if "detail" in payload:
            return str(payload["detail"])[:300]
    return detail[:300]


class _NoProgress:
    def update(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")
