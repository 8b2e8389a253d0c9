"""Router benchmark: N kvreuse servers behind ``kvreuse route``, cache-aware against round-robin.

For each workload (shared-prefix, hot-prefix) the same requests go (1) to one server alone (the
"single server holding every prefix" hit-rate baseline), then (2) through the router under each
policy. Every backend's prefix cache is reset before each run. Reported per run: prefix-cache hit
rate (cached / prompt tokens, from each reply's usage), TTFT p50 / p90 as the client measures it,
and max / mean requests per backend (from the router's /backends).

    python benchmarks/bench_router.py --model models/smollm2-135m-v2384 --dtype bfloat16 --temperature 1
    python benchmarks/bench_router.py --preset tiny --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MODEL_NAME = "bench-model"


@dataclass
class Process:
    url: str
    process: subprocess.Popen


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy:\n{log.read_text()[-3000:]}")


def start(command: list[str], port: int, log: Path, env: dict[str, str]) -> Process:
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, log)
    return Process(url, process)


def stop(process: Process) -> None:
    if process.process.poll() is None:
        process.process.terminate()
        try:
            process.process.wait(30)
        except subprocess.TimeoutExpired:
            process.process.kill()


def reset_caches(backends: list[Process]) -> None:
    for backend in backends:
        httpx.post(f"{backend.url}/reset_prefix_cache", timeout=60).raise_for_status()


def run_workload(url: str, requests: Any, tokenizer: Any, args: argparse.Namespace) -> list[Any]:
    from kvreuse.bench.client import ClientConfig, LoadClient

    config = ClientConfig(base_url=url, model=MODEL_NAME, request_rate=args.request_rate,
                          max_concurrency=args.max_concurrency, seed=args.seed, progress=False,
                          temperature=args.temperature)
    return LoadClient(config, tokenizer).run(requests).results


def summarize(results: list[Any], routed: dict[str, int] | None) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    summary: dict[str, Any] = {
        "requests": len(results), "failed": len(results) - len(ok),
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
    }
    if routed is not None:
        counts = list(routed.values())
        summary["routed"] = routed
        summary["max_over_mean_load"] = max(counts) / statistics.mean(counts) if sum(counts) else None
    return summary


def routed_counts(router_url: str) -> dict[str, int]:
    state = httpx.get(f"{router_url}/backends", timeout=10).json()
    return {b["url"]: b["routed_requests"] for b in state["backends"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--model", default=None, help="a model folder (instead of the preset's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-backends", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--threads-per-backend", type=int, default=1, help="OMP threads of each backend (CPU)")
    parser.add_argument("--policies", default="cache-aware,round-robin")
    parser.add_argument("--workloads", default="shared-prefix,hot-prefix")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=6)
    parser.add_argument("--hot-requests", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="1 on random weights whose greedy output can be text-less bytes (no chunk to time)")
    parser.add_argument("--router-args", default="", help="extra router options, e.g. '--min-in-flight-for-guard 4'")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)

    from kvreuse.bench.workloads import HotPrefixOptions, SharedPrefixOptions, generate_workload
    from kvreuse.models.make import ensure_model
    from kvreuse.tokenizer import Tokenizer

    model_dir = Path(args.model) if args.model else ensure_model(args.preset, dtype=args.dtype)
    tokenizer = Tokenizer(model_dir)
    options = {
        "shared-prefix": SharedPrefixOptions(num_groups=args.num_groups, prompts_per_group=args.prompts_per_group,
                                             system_prompt_len=args.prefix_len, question_len=32,
                                             output_len=args.output_len),
        "hot-prefix": HotPrefixOptions(num_cold_prefixes=args.num_backends, hot_fraction=0.8,
                                       prefix_len=args.prefix_len, question_len=32, output_len=args.output_len,
                                       num_requests=args.hot_requests),
    }
    workloads = {name: generate_workload(name, tokenizer, options[name], args.seed)
                 for name in args.workloads.split(",")}
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads_per_backend))
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_router_logs"
    logs.mkdir(exist_ok=True)
    backends: list[Process] = []
    report: dict[str, Any] = {"args": vars(args), "runs": {}}
    try:
        for index in range(args.num_backends):
            port = free_port()
            backends.append(start([sys.executable, "-m", "kvreuse.cli", "serve", "--model", str(model_dir),
                                   "--dtype", args.dtype, "--device", args.device, "--kv-cache-memory",
                                   args.kv_cache_memory, "--port", str(port), "--served-model-name", MODEL_NAME,
                                   "--stats-log-interval", "0"], port, logs / f"backend{index}.log", env))
        for name, workload in workloads.items():
            print(f"== {workload.describe()}", flush=True)
            reset_caches(backends)
            single = summarize(run_workload(backends[0].url, workload.requests, tokenizer, args), None)
            report["runs"][f"{name}/single-server"] = single
            print(f"  single server: {json.dumps(single)}", flush=True)
            for policy in args.policies.split(","):
                reset_caches(backends)
                port = free_port()
                router = start([sys.executable, "-m", "kvreuse.router", "--port", str(port), "--policy", policy,
                                "--tokenizer", str(model_dir), *args.router_args.split(), *[x for b in backends for x in ("--backend", b.url)]],
                               port, logs / f"router-{policy}.log", dict(os.environ))
                try:
                    before = routed_counts(router.url)
                    results = run_workload(router.url, workload.requests, tokenizer, args)
                    after = routed_counts(router.url)
                finally:
                    stop(router)
                summary = summarize(results, {url: after[url] - before[url] for url in after})
                report["runs"][f"{name}/{policy}"] = summary
                print(f"  {policy}: {json.dumps(summary)}", flush=True)
    finally:
        for backend in backends:
            stop(backend)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
