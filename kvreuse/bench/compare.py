"""``kvreuse bench compare``: the same workload against kvreuse (prefix caching on, off), plain
transformers and, given its binary and a GGUF of the same model (``--llama-server BIN --gguf FILE``,
from ../shared/tools/llama_cpp_peer.sh), llama.cpp's llama-server, in one run on one machine.

Each system runs as a server subprocess on a free loopback port, one at a time so they never share
the cores: start, wait for /health, send a few short unrelated warm-up requests, run the workload
(same seed, same client), stop with SIGTERM. Ratios come from this one run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kvreuse.bench.client import BenchmarkRun, LoadClient
from kvreuse.bench.options import (
    build_workload,
    client_config,
    config_dict,
    load_tokenizer,
    workload_dict,
)
from kvreuse.bench.workloads import (
    RandomOptions,
    TextTokenizer,
    Workload,
    generate_workload,
)

SYSTEMS = ("kvreuse", "kvreuse-no-cache", "transformers", "llama-server")
SERVED_MODEL_NAME = "bench-model"


@dataclass(frozen=True)
class LlamaServer:
    """How llama-server runs beside kvreuse: as a server for several clients, with ``--jinja`` (the
    model's chat template, tool calling), one slot per concurrent request, the unified KV buffer of
    ``ctx_size`` tokens and ``cache_ram_mib`` of host prompt cache (its serving defaults), as many
    threads as this process may use."""

    binary: str
    gguf: str
    slots: int = 4
    ctx_size: int = 32768
    cache_ram_mib: int = 4096

    def check(self) -> None:
        if not (Path(self.binary).is_file() and os.access(self.binary, os.X_OK)):
            raise ValueError(f"--llama-server must be llama-server's binary, got {self.binary!r} "
                             "(bash ../shared/tools/llama_cpp_peer.sh MODEL_DIR prints it)")
        if not Path(self.gguf).is_file():
            raise ValueError(f"--gguf must be a GGUF file of the model, got {self.gguf!r}")

    def command(self, port: int) -> list[str]:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(port), "--jinja",
                "-np", str(self.slots), "-c", str(self.ctx_size), "--kv-unified", "--cache-ram",
                str(self.cache_ram_mib), "-t", str(threads), "--alias", SERVED_MODEL_NAME, "--no-webui"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def system_command(label: str, model_dir: str, port: int, dtype: str, device: str, kv_cache_memory: str,
                   llama: LlamaServer | None = None) -> list[str]:
    if label == "llama-server":
        if llama is None:
            raise ValueError("the llama-server system needs --llama-server BIN and --gguf FILE")
        return llama.command(port)
    if label in ("kvreuse", "kvreuse-no-cache"):
        command = [sys.executable, "-m", "kvreuse.cli", "serve", "--model", model_dir, "--port", str(port),
                   "--dtype", dtype, "--device", device, "--kv-cache-memory", kv_cache_memory,
                   "--served-model-name", SERVED_MODEL_NAME, "--stats-log-interval", "0"]
        if label == "kvreuse-no-cache":
            command.append("--no-enable-prefix-caching")
        return command
    if label == "transformers":
        return [sys.executable, "-m", "kvreuse.bench.reference_server", "--model", model_dir, "--port", str(port),
                "--dtype", dtype, "--device", device, "--served-model-name", SERVED_MODEL_NAME]
    raise ValueError(f"systems must be among {list(SYSTEMS)}, got {label!r}")


def wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float,
                 log_tail: Callable[[], str] = lambda: "", interval_s: float = 0.2) -> None:
    """Poll ``base_url``/health until it answers 200; RuntimeError (with ``log_tail()``) if ``process`` exits
    first or ``timeout_s`` passes. One client for every poll: each new httpx client builds an SSL context,
    ~40 ms of CPU that would compete with the server's own start-up."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with status {process.returncode}:\n{log_tail()}")
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {timeout_s:g} s:\n{log_tail()}")
            time.sleep(interval_s)


class ServerProcess:
    """A server subprocess with its log file; stopped with SIGTERM (then SIGKILL) on exit."""

    def __init__(self, command: list[str], log_path: Path, base_url: str) -> None:
        self.command = command
        self.log_path = log_path
        self.base_url = base_url
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        wait_healthy(self.base_url, self.process, timeout_s, self.log_tail, interval_s=0.25)

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def __exit__(self, *exc_info: Any) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _resolve_device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """Both systems get the same explicit device and dtype (their "auto" rules differ)."""
    import torch

    from kvreuse.loading.loader import resolve_dtype

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = resolve_dtype(dtype, device)
    return device, str(resolved).removeprefix("torch.")


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def comparison_ratios(summaries: dict[str, Any]) -> dict[str, Any]:
    """kvreuse against each other system: TTFT (lower is better), throughput and hit rate."""
    ratios: dict[str, Any] = {}
    base = summaries.get("kvreuse")
    if base is None:
        return ratios
    for label, other in summaries.items():
        if label == "kvreuse":
            continue
        ratios[f"kvreuse / {label}"] = {
            "ttft_median": _ratio(base.ttft.median if base.ttft else None, other.ttft.median if other.ttft else None),
            "ttft_mean": _ratio(base.ttft.mean if base.ttft else None, other.ttft.mean if other.ttft else None),
            "ttft_p90": _ratio(base.ttft.p90 if base.ttft else None, other.ttft.p90 if other.ttft else None),
            "output_throughput": _ratio(base.output_throughput, other.output_throughput),
            "request_throughput": _ratio(base.request_throughput, other.request_throughput),
            "e2e_mean": _ratio(base.e2e.mean if base.e2e else None, other.e2e.mean if other.e2e else None),
        }
    return ratios


def format_comparison(summaries: dict[str, Any], ratios: dict[str, Any], title: str) -> str:
    labels = list(summaries)
    column = max(14, *(len(label) + 2 for label in labels))
    width = 30 + column * len(labels)
    lines = [f" {title} ".center(width, "="), f"{'':<30}" + "".join(f"{label:>{column}}" for label in labels)]

    def row(name: str, values: list[str]) -> None:
        lines.append(f"{name:<30}" + "".join(f"{value:>{column}}" for value in values))

    def ms(distribution: Any, field: str) -> str:
        return "-" if distribution is None else f"{getattr(distribution, field) * 1000:.1f}"

    row("completed / failed", [f"{s.completed} / {s.failed}" for s in summaries.values()])
    row("TTFT median (ms)", [ms(s.ttft, "median") for s in summaries.values()])
    row("TTFT mean (ms)", [ms(s.ttft, "mean") for s in summaries.values()])
    row("TTFT p90 (ms)", [ms(s.ttft, "p90") for s in summaries.values()])
    row("TPOT median (ms)", [ms(s.tpot, "median") for s in summaries.values()])
    row("E2E mean (ms)", [ms(s.e2e, "mean") for s in summaries.values()])
    row("output throughput (tok/s)", [f"{s.output_throughput:.1f}" for s in summaries.values()])
    row("request throughput (req/s)", [f"{s.request_throughput:.3f}" for s in summaries.values()])
    row("cache hit rate", ["-" if s.cache_hit_rate is None else f"{s.cache_hit_rate:.1%}" for s in summaries.values()])
    row("duration (s)", [f"{s.duration_s:.1f}" for s in summaries.values()])
    if ratios:
        lines.append("-" * width)
        for name, values in ratios.items():
            shown = ", ".join(f"{key} {value:.3f}" for key, value in values.items() if value is not None)
            lines.append(f"{name}: {shown}")
    lines.append("=" * width)
    return "\n".join(lines)


def _warmup_workload(tokenizer: TextTokenizer, seed: int, count: int) -> Workload:
    # Short random prompts with a different seed: they share nothing with the measured workload.
    return generate_workload("random", tokenizer, RandomOptions(input_len=48, output_len=4, num_requests=count),
                             seed + 10_007)


def run_compare(args: argparse.Namespace) -> int:
    from kvreuse.bench.report import machine_description, write_json

    labels = [label.strip() for label in args.systems.split(",") if label.strip()]
    for label in labels:
        if label not in SYSTEMS:
            raise ValueError(f"systems must be among {list(SYSTEMS)}, got {label!r}")
    if len(set(labels)) != len(labels) or not labels:
        raise ValueError(f"systems must name each system once, got {args.systems!r}")
    if args.warmup_requests < 0:
        raise ValueError(f"warmup_requests must be >= 0, got {args.warmup_requests}")
    llama = llama_server_of(args) if "llama-server" in labels else None
    if args.model:
        model_dir = args.model
    else:
        from kvreuse.model_tools.make_model import ensure_model

        print(f"preparing the {args.preset} preset (made once, cached)...", flush=True)
        model_dir = str(ensure_model(args.preset))
    device, dtype = _resolve_device_and_dtype(args.device, args.dtype)
    tokenizer = load_tokenizer(model_dir)
    workload = build_workload(args, tokenizer)
    warmup = _warmup_workload(tokenizer, args.seed, args.warmup_requests) if args.warmup_requests else None
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvreuse-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"workload: {workload.describe()}\nmodel {model_dir}, {dtype} on {device}; server logs in {log_dir}",
          flush=True)

    runs: dict[str, BenchmarkRun] = {}
    summaries: dict[str, Any] = {}
    commands: dict[str, list[str]] = {}
    with sigterm_as_interrupt():
        _run_systems(args, labels, model_dir, device, dtype, tokenizer, workload, warmup, log_dir, runs, summaries,
                     commands, llama)

    ratios = comparison_ratios(summaries)
    title = f"{workload.name}: kvreuse vs " + ", ".join(label for label in labels if label != "kvreuse")
    print()
    print(format_comparison(summaries, ratios, title))
    if any(summary.turns for summary in summaries.values()):
        from kvreuse.bench.report import format_turns_comparison

        print(format_turns_comparison(summaries, f"{workload.name}: per turn"))
    if args.out:
        document = {
            "kind": "kvreuse-bench-compare",
            "version": 1,
            "model": model_dir,
            "dtype": dtype,
            "device": device,
            "kv_cache_memory": args.kv_cache_memory,
            "config": config_dict(client_config(args, "", SERVED_MODEL_NAME), args),
            "workload": workload_dict(workload),
            "machine": machine_description(),
            "ratios": ratios,
            "systems": {
                label: {"command": " ".join(commands[label]), "summary": summaries[label].as_dict(),
                        "requests": [result.as_dict() for result in runs[label].results]}
                for label in labels
            },
        }
        write_json(args.out, document)
        print(f"wrote {args.out}")
    if args.plot:
        from kvreuse.bench.plot import plot_comparison

        plot_comparison([(label, runs[label].results, summaries[label]) for label in labels],
                        f"{workload.describe()}\nmodel {Path(model_dir).name}, {dtype} on {device}, "
                        f"{os.cpu_count()} cores", args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(summary.completed for summary in summaries.values()) else 1


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the run like Ctrl-C, so the server subprocess of the moment is stopped too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def llama_server_of(args: argparse.Namespace) -> LlamaServer:
    """The llama-server options of ``kvreuse bench compare``, checked."""
    if not args.llama_server or not args.gguf:
        raise ValueError("the llama-server system needs --llama-server BIN and --gguf FILE")
    llama = LlamaServer(args.llama_server, args.gguf, slots=args.max_concurrency or 4, ctx_size=args.llama_ctx_size,
                        cache_ram_mib=args.llama_cache_ram)
    llama.check()
    return llama


def _run_systems(args: argparse.Namespace, labels: list[str], model_dir: str, device: str, dtype: str,
                 tokenizer: TextTokenizer, workload: Workload, warmup: Workload | None, log_dir: Path,
                 runs: dict[str, BenchmarkRun], summaries: dict[str, Any], commands: dict[str, list[str]],
                 llama: LlamaServer | None = None) -> None:
    """Each system in turn: start its server, warm it up, run the workload, stop it."""
    from kvreuse.bench.report import format_table, summarize

    for label in labels:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        command = system_command(label, model_dir, port, dtype, device, args.kv_cache_memory, llama)
        commands[label] = command
        print(f"\n[{label}] starting: {' '.join(command)}", flush=True)
        started = time.monotonic()
        with ServerProcess(command, log_dir / f"{label}.log", base_url) as server:
            server.wait_ready(args.startup_timeout)
            print(f"[{label}] ready in {time.monotonic() - started:.1f} s", flush=True)
            config = client_config(args, base_url, SERVED_MODEL_NAME)
            if warmup is not None:
                warm_config = replace(config, request_rate=math.inf, max_concurrency=1, progress=False)
                warm = LoadClient(warm_config).run(warmup.requests)
                if not any(result.success for result in warm.results):
                    raise RuntimeError(f"[{label}] warm-up failed: {warm.results[0].error}\n{server.log_tail()}")
            run = LoadClient(config, tokenizer).run(workload.requests)
        runs[label] = run
        summaries[label] = summarize(run)
        print(format_table(summaries[label], f"{workload.name}: {label}"), flush=True)
