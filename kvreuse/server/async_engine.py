"""The engine loop on its own thread, met by asyncio handlers through queues.

The engine is not thread-safe, so every engine call (add_request, step, abort_request, stats,
reset_prefix_cache) happens on one thread. Handlers tokenize and validate on the event loop, then
post commands to an inbox that the engine thread drains at the start of each iteration; each
step's outputs go back to the per-request asyncio queues in one ``call_soon_threadsafe`` per step.
An idle engine thread blocks on the inbox (no busy loop).

`AsyncEngine.stats` is the snapshot ``/metrics`` and admission read. The engine thread replaces it
before it hands anything to an event loop (`_publish`): after applying a batch of commands, and after
each step, the new snapshot goes out first and only then the outputs, errors and call results that
iteration produced. So a client that has read a request's first byte finds it running in a scrape
made afterwards, and one that has read the last finds it gone.

Outputs are cumulative (all token ids and logprobs so far), so a consumer that falls behind only
needs the newest one: `AsyncEngine.generate` skips to the latest queued output. For the same reason the
engine thread need not send every step's output (``stream_interval``, SGLang's and vLLM's
``--stream-interval``): a streamed request's output goes to its event loop when ``stream_interval`` new
tokens have come since the last one sent, and a request answered whole (``stream=False``) gets its first
and its finished output only. The first output and the finished one always go at once, and a request with
stop strings gets every output (they are found in the text, on the event loop). Each output sent wakes the
event loop and the client: on 2 cores that is a core taken from the step's thread team every token (docs/
benchmarks.md, "The served one stream on an AMD EPYC").

Text is made on the event loop, not the engine thread: `generate` runs the engine's token ids
through an `OutputProcessor` (detokenizing, stop strings, stream holdback) and sends a finish
command back when a stop string ends a sample. The event loop has its own `Tokenizer` object
(``AsyncEngine.tokenizer``, also behind ``AsyncEngine.inputs`` for encoding), the engine thread
keeps the engine's: no tokenizer object is used from two threads. Both event-loop processors share one
`GenerationMemory` (recorded as samples finish, read as chats are encoded), which the event loop alone
touches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvreuse.cache.pins import PinSpec
from kvreuse.engine import EngineStats, LLMEngine
from kvreuse.inputs import GenerationMemory, InputProcessor, PromptInput
from kvreuse.lora.request import LoRARequest
from kvreuse.output_processor import OutputProcessor
from kvreuse.outputs import RequestOutput
from kvreuse.runner import thread_team
from kvreuse.sampling import SamplingParams
from kvreuse.server.metrics import (
    PeriodicStatsLogger,
    ServerMetrics,
    cache_config_labels,
)
from kvreuse.tokenizer import Tokenizer

logger = logging.getLogger("kvreuse.server")

ResultT = TypeVar("ResultT")


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


@dataclass
class _Stream:
    """Where the outputs of one request go, and what the metrics need to remember about it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    # Send an output once this many new tokens have come since the last one sent (None: the finished one only).
    interval: int | None = 1
    first_output_seen: bool = False
    last_output_time: float = 0.0
    tokens_sent: int = 0  # the output tokens of the last output sent (counted where interval is not 1)


@dataclass
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    stream: _Stream
    pins: tuple[PinSpec, ...] = ()
    lora_request: LoRARequest | None = None
    owner: str | None = None  # the caller's tenant id (keys configured), for the observatory's tenant rule


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FinishSequence:
    """A stop string ended this sample (the event loop saw it in the text)."""

    request_id: str
    index: int
    stop_reason: str


@dataclass
class _Call:
    function: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


class _Stop:
    pass


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread; `generate` streams its outputs to asyncio code."""

    def __init__(self, engine: LLMEngine, *, stats_log_interval_s: float = 10.0, stream_interval: int = 1) -> None:
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1 (tokens), got {stream_interval!r}")
        self.engine = engine
        self.stream_interval = stream_interval
        self.model_name = engine.model_name
        # The event loop's own tokenizer object (the engine thread uses engine.tokenizer).
        self.tokenizer = Tokenizer(engine.tokenizer.path)
        # One generation memory shared by the event loop's outputs and inputs: a finished sample's text is
        # recorded with the ids sampled for it, and a chat that replays it (the next turn of an agent loop)
        # is encoded as those ids, so the turn hits the cache through its generated tokens (kvreuse.inputs).
        self.generation_memory = GenerationMemory()
        self.inputs = InputProcessor(self.tokenizer, engine.max_model_len, engine.model_config.vocab_size,
                                     generation_memory=self.generation_memory)
        self._outputs = OutputProcessor(self.tokenizer, self.generation_memory)
        # Tier counters are read live (TieredStore.snapshot takes the store's lock): its writer thread
        # keeps counting after the step that queued the blocks.
        # Replaced whole after every iteration; readers on other threads see one consistent snapshot.
        self.stats: EngineStats = engine.stats()
        self.metrics = ServerMetrics(engine.model_name, lambda: self.stats,
                                     engine.tier_store.snapshot if engine.tier_store is not None else None,
                                     cache_config_labels(engine.config, self.stats.cache.num_blocks))
        self._stats_logger = PeriodicStatsLogger(stats_log_interval_s, logger, self.stats)
        self._inbox: queue.SimpleQueue[_Add | _Abort | _FinishSequence | _Call | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        # What the engine thread has produced for the event loops and not yet sent: `_publish` sends it
        # after replacing the stats snapshot (engine thread only).
        self._outbox: list[Callable[[], Any]] = []
        self._thread: threading.Thread | None = None
        # The thread that started the loop, and its torch thread count before it handed its team back.
        self._starter: tuple[int, int | None] | None = None
        self.failure: BaseException | None = None  # set if the loop itself died

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        policy = self.engine.share_cpu_with_event_loop()
        if policy is not None:
            logger.info("CPU steps of at most %d tokens run on %d or %d threads, whichever measures faster with "
                        "the event loop beside them", policy.small_step_tokens, policy.small_step_threads,
                        policy.threads)
        threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, args=(threads,), name="kvreuse-engine", daemon=True)
        self._thread.start()
        # This thread built the engine (parallel ops: an OpenMP team); the loop thread makes a second one,
        # and two teams make libgomp put the step's team to sleep between regions (runner/thread_team.py).
        self._starter = (threading.get_ident(), thread_team.hand_back_team())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (requests still in flight are aborted), wait for the thread, then wait for the
        KV tier writes still queued (disk, remote) so a clean exit loses none of the computed blocks."""
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        self._thread.join(timeout_s)
        self._thread = None
        if self._starter is not None and self._starter[0] == threading.get_ident():
            thread_team.restore_threads(self._starter[1])
        self._starter = None
        self.flush_tiers()

    def flush_tiers(self) -> None:
        """Wait for the background tier writer to store every queued block (bounded: each Redis write
        times out, and a Redis that failed is skipped for a while). Safe from any thread: it touches the
        store's queue only."""
        store = self.engine.tier_store
        if store is None:
            return
        started = time.monotonic()
        try:
            self.engine.flush_tiers()
        except Exception:  # an exit must still complete
            logger.exception("flushing the KV tiers failed")
            return
        logger.info("KV tiers flushed in %.2f s (%s)", time.monotonic() - started,
                    ", ".join(tier.name for tier in store.tiers))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_pending_commands(self) -> int:
        return self._inbox.qsize()

    # --- asyncio side -------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        pins: Sequence[PinSpec] = (),
        lora_request: LoRARequest | None = None,
        owner: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its processed outputs (text, stream deltas) until the finished
        one: with ``stream``, one every ``stream_interval`` tokens, else the first and the finished one
        (module docstring). Leaving early (the client went away, the task was cancelled) aborts the
        request, so its KV blocks return to the pool."""
        if not self.is_running:
            raise EngineError("the engine loop is not running")
        tokenized = self.inputs.from_prompt(prompt, validate=False)  # handlers validated it already
        # Its generated text is remembered under its cache salt, the scope its tenant's next turn is encoded in.
        self._outputs.add_request(request_id, tokenized.token_ids, params, memory_scope=cache_salt or "")
        # Stop strings are found in the text, here: their request needs every output to stop where they end.
        interval = 1 if params.stop else self.stream_interval if stream else None
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), interval)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._inbox.put(_Add(request_id, tokenized.as_engine_prompt(), params, cache_salt, arrival, stream,
                             tuple(pins), lora_request, owner))
        finished = False
        # The finish reason is counted here, as the client sees it: a stop string found in the text ends a
        # request on this side, and the engine, not told yet, may end it by length in the same step.
        finish_reason: str | None = None
        try:
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty() and not isinstance(item, BaseException):
                    item = stream.queue.get_nowait()  # outputs are cumulative: the newest says it all
                if isinstance(item, BaseException):
                    finished = True  # the engine side has already dropped the request
                    raise item
                processed = self._outputs.process(item)
                for index, stop_string in processed.stopped:
                    self._inbox.put(_FinishSequence(request_id, index, stop_string))
                finished = processed.output.finished
                if finished:
                    finish_reason = processed.output.outputs[0].finish_reason or "stop"
                yield processed.output
                if finished:
                    return
        finally:
            self._outputs.abort(request_id)
            if not finished:
                self._inbox.put(_Abort(request_id))
                self.metrics.request_finished("abort")
            elif finish_reason is not None:
                self.metrics.request_finished(finish_reason)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def call(self, function: Callable[[LLMEngine], ResultT]) -> ResultT:
        """Run ``function(engine)`` on the engine thread (e.g. reset_prefix_cache) and return its result."""
        if not self.is_running:
            raise EngineError("the engine loop is not running")
        command = _Call(function)
        self._inbox.put(command)
        return await asyncio.wrap_future(command.future)

    # --- engine thread ------------------------------------------------------------------------------
    def _run(self, threads: int) -> None:
        engine = self.engine
        torch.set_num_threads(threads)  # the starting thread's count (a new thread's default may differ)
        try:
            while True:
                if engine.has_unfinished_requests():
                    commands = self._drain_inbox()
                else:
                    timeout = self._stats_logger.seconds_until_due(self.stats, time.monotonic())
                    try:
                        commands = [self._inbox.get(timeout=timeout)]
                    except queue.Empty:
                        commands = []
                    commands += self._drain_inbox()
                for command in commands:
                    if isinstance(command, _Stop):
                        self._fail_all(EngineError("the server is shutting down"), include_queued=True)
                        return
                    self._apply(command)
                if commands:
                    # Adds, aborts, finishes and calls changed the engine now: a step may take a while.
                    self._publish()
                if engine.has_unfinished_requests():
                    self._step()
                self._publish()
                self._stats_logger.maybe_log(self.stats, time.monotonic())
        except BaseException as error:  # the loop must never die silently: fail every waiter
            logger.exception("the engine loop stopped")
            self.failure = error
            self._fail_all(EngineError(f"the engine loop stopped: {error}"), include_queued=True)

    def _publish(self, *, best_effort: bool = False) -> None:
        """Replace the stats snapshot, then send the event loops what this thread produced since the
        last call. In this order: each output is posted after the engine state behind it is readable
        by a scrape, never before (posted first, a client could read the output and scrape the previous
        snapshot, e.g. a request whose first token it holds as not running). ``best_effort``: the engine
        may be broken (the loop is dying); send anyway."""
        try:
            self.stats = self.engine.stats()
        except Exception:
            if not best_effort:
                raise
            logger.exception("reading the engine stats failed")
        finally:
            outbox, self._outbox = self._outbox, []
            for send in outbox:
                send()

    def _send(self, stream: _Stream, item: Any) -> None:
        """Queue ``item`` (an output or an error) for the stream's event loop; `_publish` sends it."""
        self._outbox.append(functools.partial(_call_soon, stream.loop, _put_all, [(stream, item)]))

    def _drain_inbox(self) -> list[_Add | _Abort | _Call | _Stop]:
        commands = []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort | _FinishSequence | _Call) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            try:
                engine.add_request(command.request_id, command.prompt, command.params,
                                   cache_salt=command.cache_salt, arrival_time=command.arrival_time,
                                   pins=command.pins, lora_request=command.lora_request, owner=command.owner)
            except ValueError as error:  # handlers validate first; this is a last line of defence
                self._send(command.stream, error)
                return
            self._streams[command.request_id] = command.stream
        elif isinstance(command, _FinishSequence):
            if command.request_id in self._streams:
                final = engine.finish_sequence(command.request_id, command.index, command.stop_reason)
                if final is not None:  # its waiter has its text already; only the bookkeeping is left
                    self._record_finished(final)
        elif isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                engine.abort_request(command.request_id)
        else:
            future = command.future
            try:
                result = command.function(engine)
            except Exception as error:
                self._outbox.append(functools.partial(future.set_exception, error))
            else:
                self._outbox.append(functools.partial(future.set_result, result))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            # A failed step leaves the batch in an unknown state: abort what ran, keep serving.
            logger.exception("engine step failed; aborting %d request(s) in flight", len(self._streams))
            self._fail_all(EngineError(f"the engine failed while running this request: {error}"))
            return
        now = time.monotonic()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        metrics = self.metrics
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if not stream.first_output_seen:
                stream.first_output_seen = True
                ttft = output.metrics.time_to_first_token
                if ttft is not None:
                    metrics.time_to_first_token.observe(ttft)
                metrics.prompt_tokens_cached.inc(output.num_cached_tokens)
                if output.num_moved_tokens:
                    metrics.prompt_tokens_moved.inc(output.num_moved_tokens)
                    metrics.prompt_tokens_recomputed.inc(output.num_recomputed_tokens)
            else:
                metrics.inter_token_latency.observe(now - stream.last_output_time)
            stream.last_output_time = now
            if output.finished:
                self._record_finished(output)
            elif stream.interval != 1:
                tokens = sum(len(completion.token_ids) for completion in output.outputs)
                if stream.tokens_sent and (stream.interval is None or tokens - stream.tokens_sent < stream.interval):
                    continue  # the next output sent holds these tokens too (outputs are cumulative)
                stream.tokens_sent = tokens or 1
            deliveries.setdefault(stream.loop, []).append((stream, output))
        for loop, items in deliveries.items():
            self._outbox.append(functools.partial(_call_soon, loop, _put_all, items))

    def _record_finished(self, output: RequestOutput) -> None:
        """Forget a finished request's stream and record its latency (its finish reason is counted by its
        waiter, ``generate``, as the client sees it)."""
        del self._streams[output.request_id]
        e2e = output.metrics.e2e_latency
        if e2e is not None:
            self.metrics.e2e_request_latency.observe(e2e)

    def _fail_all(self, error: BaseException, *, include_queued: bool = False) -> None:
        """Abort every request in the engine and hand ``error`` to its waiter; with
        ``include_queued`` also the commands not yet applied (the loop is about to end)."""
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be broken; the waiters must still hear about it
                logger.exception("abort of %s failed", request_id)
            self._send(stream, error)
        self._streams.clear()
        if include_queued:
            for command in self._drain_inbox():
                if isinstance(command, _Add):
                    self._send(command.stream, error)
                elif isinstance(command, _Call):
                    self._outbox.append(functools.partial(command.future.set_exception, error))
        self._publish(best_effort=True)


def _put_all(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop is closed (server exit): nobody is waiting any more
        pass
