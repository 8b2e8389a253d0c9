"""Server overhead on time to first token: TTFT a client measures minus TTFT inside the engine.

Requests go one at a time (streaming /v1/completions over one keep-alive httpx connection, as load
tools send them). For each, the client TTFT runs from sending the request to the first SSE event;
the engine's TTFT for the same request is the increase of ``kvreuse:time_to_first_token_seconds_sum``
on /metrics between a scrape before and one after (the engine measures from the moment the request
reached the server's handler, the arrival_time the handler passes to add_request). The difference is
what HTTP, routing and the SSE path add. Target: median under 5 ms.

Requests ask for one output token by default: the first SSE event then marks the first token even
when that token's text is empty (the server sends no event for a token that completes no character
yet, and a random-weight model often samples such byte tokens), so both sides time the same moment.

    python benchmarks/bench_server_overhead.py --preset tiny --dtype float32
    python benchmarks/bench_server_overhead.py --preset smollm2-135m
    python benchmarks/bench_server_overhead.py --base-url http://127.0.0.1:8000   # a running server

KVREUSE_BENCH_SMOKE=1 runs the same steps on the tiny preset with the smallest sizes (3 requests after
1 warm-up, 8-word prompts, a 32 MiB KV pool) and prints the same table in seconds: the test suite runs
the documented commands that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvreuse.bench.compare import wait_healthy

TTFT_SUM = "kvreuse:time_to_first_token_seconds_sum"
TTFT_COUNT = "kvreuse:time_to_first_token_seconds_count"
WORDS = ("book order shipping return gift card customer delivery address parcel refund invoice payment "
         "store shelf author novel chapter library reader queue week").split()


def machine_description(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    memory = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        memory = f"{int(Path('/proc/meminfo').read_text().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    accelerator = ""
    try:
        import torch

        if torch.cuda.is_available() and device != "cpu":
            accelerator = f", GPU {torch.cuda.get_device_name(0)}"
        version = torch.__version__
    except ImportError:
        version = "?"
    return f"{os.cpu_count()} cores ({cpu}), {memory} RAM{accelerator}, torch {version}, Python {platform.python_version()}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str, list[str]]:
    from kvreuse.model_tools.make_model import ensure_model

    model = args.model or str(ensure_model(args.preset, dtype=args.model_dtype))
    port = free_port()
    command = [sys.executable, "-m", "kvreuse.cli", "serve", "--model", model, "--port", str(port),
               "--dtype", args.dtype, "--device", args.device, "--kv-cache-memory", args.kv_cache_memory,
               "--stats-log-interval", "0"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, 600, lambda: log_path.read_text()[-3000:])
    except RuntimeError as error:
        process.kill()
        raise SystemExit(str(error)) from None
    return process, base_url, command


def scrape_ttft(client: httpx.Client) -> tuple[float, float]:
    """(sum, count) of the engine's TTFT histogram."""
    total = count = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(TTFT_SUM):
            total += float(line.rpartition(" ")[2])
        elif line.startswith(TTFT_COUNT):
            count += float(line.rpartition(" ")[2])
    return total, count


def one_request(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> float:
    """Client TTFT in seconds: request sent -> first SSE event (the server sends nothing earlier)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = time.perf_counter()
    first_event_at = None
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"request failed: {response.status_code} {response.read()!r}")
        for line in response.iter_lines():
            if first_event_at is None and line.startswith("data: "):
                first_event_at = time.perf_counter()
    if first_event_at is None:
        raise SystemExit("the stream carried no event")
    return first_event_at - started


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset made on first use (tiny, smollm2-135m, ...)")
    parser.add_argument("--model", default=None, help="a model folder instead of a preset")
    parser.add_argument("--model-dtype", default="bfloat16", help="dtype the preset folder is written in")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--base-url", default=None, help="measure a running server instead of starting one")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented commands this way
        args.preset, args.kv_cache_memory = "tiny", "32MiB"
        args.num_requests, args.warmup, args.prompt_words = 3, 1, 8
        print("KVREUSE_BENCH_SMOKE=1: smoke run on the tiny preset with the smallest sizes; the figures mean nothing")

    process = None
    log_dir = tempfile.TemporaryDirectory()
    server_command: list[str] = []
    try:
        if args.base_url:
            base_url = args.base_url.rstrip("/")
        else:
            process, base_url, server_command = start_server(args, Path(log_dir.name) / "server.log")
        with httpx.Client(base_url=base_url, timeout=300) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            rng = random.Random(args.seed)
            overheads: list[float] = []
            client_ttfts: list[float] = []
            engine_ttfts: list[float] = []
            for index in range(args.warmup + args.num_requests):
                # A fresh prompt each time: every request pays a real (uncached) prefill.
                prompt = f"{index}: " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                sum_before, count_before = scrape_ttft(client)
                client_ttft = one_request(client, model, prompt, args.max_tokens)
                sum_after, count_after = scrape_ttft(client)
                if count_after - count_before != 1:
                    raise SystemExit("another client is using this server: the TTFT histogram moved by "
                                     f"{count_after - count_before} requests")
                if index < args.warmup:
                    continue
                engine_ttft = sum_after - sum_before
                client_ttfts.append(client_ttft)
                engine_ttfts.append(engine_ttft)
                overheads.append(client_ttft - engine_ttft)
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
        log_dir.cleanup()

    ms = 1000.0
    print(f"machine: {machine_description(args.device)}")
    print(f"command: python {' '.join(sys.argv)}")
    if server_command:
        print(f"server:  {' '.join(server_command[1:])}")
    print(f"model:   {model}; {args.num_requests} streaming /v1/completions requests one at a time "
          f"({args.prompt_words}-word prompts, max_tokens {args.max_tokens}), {args.warmup} warm-up")
    print(f"client TTFT  median {statistics.median(client_ttfts) * ms:7.2f} ms   p90 {percentile(client_ttfts, 0.9) * ms:7.2f} ms")
    print(f"engine TTFT  median {statistics.median(engine_ttfts) * ms:7.2f} ms   p90 {percentile(engine_ttfts, 0.9) * ms:7.2f} ms")
    median_overhead = statistics.median(overheads) * ms
    print(f"overhead     median {median_overhead:7.2f} ms   p90 {percentile(overheads, 0.9) * ms:7.2f} ms   "
          f"mean {statistics.fmean(overheads) * ms:.2f} ms   (target: median < 5 ms: "
          f"{'met' if median_overhead < 5 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
