"""``kvreuse serve``: load the engine, start its loop thread, run uvicorn, drain on SIGTERM.

uvicorn's own signal handling would stop accepting connections at once and then re-raise the
signal (exit status -15). Here the first SIGTERM / SIGINT starts a drain instead: requests in
flight run to completion, new ones get a 503 (the socket stays open so clients get a clear answer,
not a refused connection), and once nothing is in flight (or ``--drain-timeout`` passed) uvicorn
shuts down, the engine loop stops, the KV blocks still queued for the disk and remote tiers are
written (``AsyncEngine.shutdown`` flushes them), and the process exits 0. A second signal stops
waiting for requests (the flush still runs; each Redis write is bounded by its timeout).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from kvreuse.lora.request import LoRARequest
from kvreuse.tool_parsers import PARSERS

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvreuse.config import CacheConfig
    from kvreuse.engine import LLMEngine
    from kvreuse.llm import LLM
    from kvreuse.server.async_engine import AsyncEngine
    from kvreuse.server.kv_event_publisher import KVEventsConfig
    from kvreuse.server.state import ServerState

logger = logging.getLogger("kvreuse.server")

_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvreuse serve`` beyond the engine's (see kvreuse.engine_args.add_engine_arguments)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send and see (default: the --model value)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="a key clients must send as 'Authorization: Bearer KEY'; repeat for several")
    parser.add_argument("--api-keys-file", default=None, help="file with one API key per line (# comments)")
    parser.add_argument("--admin-key", action="append", default=None,
                        help="a key that may also act on every tenant: POST /reset_prefix_cache, GET "
                             "/v1/cache/events (what kvreuse route reads), loading and unloading LoRA adapters, "
                             "every tenant's pins; accepted wherever an API key is, as its own tenant; repeatable")
    parser.add_argument("--admin-keys-file", default=None, help="file with one admin key per line (# comments)")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to serve (PEFT folders or .safetensors files); clients select one with "
                             "\"model\": NAME (needs --enable-lora)")
    parser.add_argument("--lora-dir", action="append", default=None, metavar="DIR",
                        help="folder POST /v1/load_lora_adapter may read adapters from (repeatable; without it "
                             "loading over HTTP is off)")
    parser.add_argument("--isolate-tenants", action="store_true",
                        help="derive each request's cache namespace from its API key (salts starting "
                             "with 'public:' stay shared)")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="answer 503 while more requests than this wait for the engine")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds SIGTERM waits for requests in flight before exiting anyway")
    parser.add_argument("--stats-log-interval", type=float, default=10.0,
                        help="seconds between engine stats log lines while busy (0: off)")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                        help="a streamed response's chunks carry the tokens of this many steps' worth (SGLang's and "
                             "vLLM's option; the first token and the last always go at once): fewer chunks leave "
                             "the cores to the step (default 1: every token)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    parser.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                        help="how the model writes tool calls (vLLM's names): hermes (Qwen2.5/Qwen3, ChatML "
                             "<tool_call> models, the models kvreuse make-model makes), llama3_json, mistral "
                             "(default: chosen from the chat template; none found: requests that need tool calls "
                             "get a 400)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM compatibility and changes nothing: tool_choice 'auto' is always "
                             "served when there is a tool-call parser")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="vLLM's KV event publisher settings, e.g. '{\"enable_kv_cache_events\": true, "
                             "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", "
                             "\"replay_endpoint\": \"tcp://127.0.0.1:5558\", \"topic\": \"kv-events\"}': "
                             "block stored / removed events in vLLM's ZMQ + msgpack format, for llm-d's and "
                             "Dynamo's KV-aware routers (they carry token ids: bind to a trusted address)")
    parser.add_argument("--warm-prompts", default=None,
                        help="JSON list of system prompts (strings), message lists, or {messages, cache_salt} "
                             "objects, computed and pinned at start-up (use a 'public:' salt to share one "
                             "across isolated tenants)")


@dataclass
class ServerParts:
    """One server, built and not yet started: what ``kvreuse serve`` runs under uvicorn and a Ray Serve
    engine replica (kvreuse/ray) runs in-process."""

    llm: LLM
    engine: AsyncEngine
    state: ServerState
    app: FastAPI
    kv_events_config: KVEventsConfig | None


def build_server(args: argparse.Namespace) -> ServerParts:
    """Load the model and build the app from ``kvreuse serve``'s options; a bad option raises ValueError
    naming it. Start ``parts.engine`` (and the KV event publisher, if any) before serving."""
    # The options are checked before anything imports torch: a mistake is reported in a fraction of a second.
    from kvreuse.engine_args import llm_from_args
    from kvreuse.server.auth import load_api_keys
    from kvreuse.server.kv_event_publisher import KVEventsConfig

    api_keys = load_api_keys(args.api_key, args.api_keys_file)
    admin_keys = load_api_keys(args.admin_key, args.admin_keys_file, what="admin_key")
    lora_modules = parse_lora_modules(args.lora_modules or [])
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.isolate_tenants and not (api_keys or admin_keys):
        raise ValueError("--isolate-tenants needs --api-key or --api-keys-file: tenants are told apart by key")
    if args.stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1 (tokens a streamed chunk waits for), "
                         f"got {args.stream_interval}")
    if args.drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0 seconds, got {args.drain_timeout}")
    kv_events_config = KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    from kvreuse.server.app import build_app
    from kvreuse.server.async_engine import AsyncEngine
    from kvreuse.server.state import ServedAdapter, ServerConfig, ServerState

    config = ServerConfig(api_keys=tuple(api_keys), admin_keys=tuple(admin_keys), isolate_tenants=args.isolate_tenants,
                          lora_dirs=tuple(args.lora_dir or ()), tool_call_parser=args.tool_call_parser,
                          max_waiting_requests=args.max_waiting_requests, model_root=args.model)
    started = time.monotonic()
    llm = llm_from_args(args)
    if args.warm_prompts:
        warm_up(llm.engine, args.warm_prompts, {lora.lora_name: lora for lora in lora_modules})
    engine = AsyncEngine(llm.engine, stats_log_interval_s=args.stats_log_interval,
                         stream_interval=args.stream_interval)
    state = ServerState(engine, config)
    for lora in lora_modules:  # loaded and checked now: a bad adapter stops the start with its reason
        state.adapters[lora.lora_name] = ServedAdapter(lora, llm.engine.adapter_digest(lora))
    app = build_app(state)
    speculative = llm.engine.config.speculative
    logger.info("model %s loaded in %.1f s (served as %r, max_model_len %d, device %s, dtype %s)%s%s",
                args.model, time.monotonic() - started, state.model_name, state.max_model_len,
                llm.engine.device, llm.engine.dtype,
                f"; speculative decoding: {speculative.method} draft {speculative.model} (digest "
                f"{llm.engine.draft_digest}, in /v1/models), {speculative.num_speculative_tokens} tokens per step"
                if speculative is not None and speculative.uses_draft_model else "",
                f"; {len(api_keys)} API key(s), {len(admin_keys)} admin key(s)"
                f"{', tenants isolated' if args.isolate_tenants else ''}" if api_keys or admin_keys else "")
    logger.info("tool calls: %s", f"{state.tool_parser.name} parser" + (
        "" if args.tool_call_parser else " (chosen from the chat template)")
                if state.tool_parser is not None else "no parser (the chat template writes no tool-call format we know; "
                "--tool-call-parser names one)")
    if llm.engine.tier_store is not None:
        logger.info("KV tiers: %s; model fingerprint %s (pending tier writes are flushed at exit)",
                    describe_tiers(llm.engine.config.cache), llm.engine.tier_store.fingerprint)
    return ServerParts(llm, engine, state, app, kv_events_config)


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; returns the exit status."""
    from kvreuse.server.kv_event_publisher import start_kv_event_publisher

    parts = build_server(args)
    uvicorn_config = uvicorn.Config(
        parts.app, host=args.host, port=args.port, log_level="info", access_log=args.access_log,
        timeout_keep_alive=30, lifespan="off",
    )
    server = DrainingServer(uvicorn_config, parts.state, drain_timeout_s=args.drain_timeout)
    publisher = None
    if parts.kv_events_config is not None:
        engine = parts.llm.engine
        publisher = start_kv_event_publisher(parts.kv_events_config, engine.kv_events, engine.config.cache.block_size,
                                             engine.device.type)
    parts.engine.start()
    try:
        server.run()
    finally:
        parts.engine.shutdown()
        if publisher is not None:
            publisher.shutdown()
    logger.info("server stopped")
    return 0


def describe_tiers(cache_config: CacheConfig) -> str:
    """The KV tiers for the start-up log, the remote URL without its password."""
    from kvreuse.engine_args import redact_url

    parts = []
    if cache_config.kv_host_memory:
        parts.append(f"host {cache_config.kv_host_memory / 2**30:.2f} GiB")
    if cache_config.kv_disk_dir:
        parts.append(f"disk {cache_config.kv_disk_dir} ({cache_config.kv_disk_size / 2**30:.2f} GiB)")
    if cache_config.kv_remote_url:
        parts.append(f"remote {redact_url(cache_config.kv_remote_url)}")
    return ", ".join(parts) or "none"


def parse_lora_modules(specs: list[str]) -> list[LoRARequest]:
    """``--lora-modules name=path ...`` as LoRARequests (ids numbered from 1 in the given order)."""
    loras: list[LoRARequest] = []
    for number, spec in enumerate(specs, start=1):
        name, separator, path = spec.partition("=")
        if not separator or not name or not path:
            raise ValueError(f"lora_modules: expected NAME=PATH, got {spec!r}")
        if any(lora.lora_name == name for lora in loras):
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        loras.append(LoRARequest(name, number, path))
    return loras


def warm_up(engine: LLMEngine, path: str, loras: dict[str, LoRARequest]) -> None:
    """Pin every prompt of a --warm-prompts file before serving (strings pin as system prompts); an
    entry's ``"model"`` may name a --lora-modules adapter, which then keys the entry."""
    import json
    from pathlib import Path

    from kvreuse.system_prompt import pin_prompt_now

    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"warm_prompts {path!r}: cannot read a JSON list: {error}") from None
    if not isinstance(entries, list):
        raise ValueError(f"warm_prompts {path!r}: expected a JSON list of strings or message lists")
    for index, entry in enumerate(entries):
        cache_salt, lora = None, None
        if isinstance(entry, dict):  # {"messages": [...] or "system": "...", "cache_salt": "public:...", "model": ...}
            cache_salt = entry.get("cache_salt")
            model = entry.get("model")
            if model is not None and model != engine.model_name:
                lora = loras.get(model)
                if lora is None:
                    raise ValueError(f"warm_prompts[{index}].model: {model!r} is neither the served model nor a "
                                     f"--lora-modules adapter")
            entry = entry.get("messages", entry.get("system"))
        if isinstance(entry, str):
            entry = [{"role": "system", "content": entry}]
        if not isinstance(entry, list) or not all(isinstance(m, dict) for m in entry):
            raise ValueError(f"warm_prompts[{index}]: expected a string, a list of messages, or "
                             f'{{"messages": [...], "cache_salt": "..."}}')
        try:
            pin = pin_prompt_now(engine, entry, kind="warm", cache_salt=cache_salt, request_id=f"warm-{index}",
                                 lora_request=lora)
        except ValueError as error:
            raise ValueError(f"warm_prompts[{index}]: {error}") from None
        logger.info("warm prompt %d pinned as %s (%d tokens, cache_salt %r)", index, pin.pin_id, pin.num_tokens,
                    cache_salt)


class CleanExitServer(uvicorn.Server):
    """A uvicorn.Server that exits with status 0 after SIGTERM / SIGINT: uvicorn raises the signal
    again once it has shut down (exit status -15), which supervisors read as a crash."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        # Unlike uvicorn, the signal is not raised again: a clean shutdown is a clean exit.


class DrainingServer(CleanExitServer):
    """A uvicorn.Server whose SIGTERM / SIGINT drains in-flight requests before shutting down."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is None:
            # Runs between bytecodes of the event loop thread; on_tick acts on it within 0.1 s.
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            self.state.draining = True
            logger.info("signal %d: draining %d request(s) in flight; new requests get 503",
                        sig, self.state.num_in_flight)
        else:
            logger.info("signal %d again: exiting without waiting for requests in flight", sig)
            self.should_exit = True
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain_deadline is None:
            return False
        if self.state.num_in_flight == 0:
            logger.info("drained: no request in flight, shutting down")
            return True
        if time.monotonic() >= self.drain_deadline:
            logger.warning("drain timeout: exiting with %d request(s) still in flight", self.state.num_in_flight)
            return True
        return False
