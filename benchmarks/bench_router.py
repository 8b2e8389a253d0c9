"""Router benchmark: N kvreuse servers behind ``kvreuse route``, cache-aware against round-robin.

For each workload (shared-prefix, hot-prefix) the same requests go (1) to one server alone (the
"single server holding every prefix" hit-rate baseline), then (2) through the router under each
policy. Every backend's prefix cache is reset before each run. Reported per run: prefix-cache hit
rate (cached / prompt tokens, from each reply's usage), TTFT p50 / p90 as the client measures it,
max / mean requests per backend (from the router's /backends) and max / mean of each backend's
time-averaged requests in flight (sampled from /backends every 0.1 s).

    python benchmarks/bench_router.py --model models/smollm2-135m-v2384 --dtype bfloat16 --temperature 1
    python benchmarks/bench_router.py --preset tiny --dtype float32

KVREUSE_BENCH_SMOKE=1 runs the same steps with the smallest sizes (tiny preset unless --model is given,
2 backends, the shared-prefix workload of 2 groups x 2 prompts with 64-token prefixes, both policies)
and prints the same table: the test suite runs the documented command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvreuse.bench.compare import wait_healthy as poll_health

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
    try:
        poll_health(url, process, timeout_s, lambda: log.read_text()[-3000:])
    except RuntimeError as error:
        raise RuntimeError(f"{url}: {error}") from None


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


class InFlightSampler:
    """Polls the router's /backends every ``interval_s`` while a run goes: each backend's time-averaged
    number of requests in flight (the load the guards act on; routed counts weigh a 32-token hit the
    same as a 544-token miss)."""

    def __init__(self, router_url: str, interval_s: float = 0.1) -> None:
        self._url, self._interval_s = router_url, interval_s
        self._sums: dict[str, float] = {}
        self._samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._done.wait(self._interval_s):
                try:
                    backends = client.get(f"{self._url}/backends").json()["backends"]
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                for backend in backends:
                    self._sums[backend["url"]] = self._sums.get(backend["url"], 0.0) + backend["in_flight"]
                self._samples += 1

    def summary(self) -> dict[str, Any]:
        if not self._samples:
            return {}
        means = {url: total / self._samples for url, total in self._sums.items()}
        average = statistics.mean(means.values())
        return {"mean_in_flight": means, "max_over_mean_in_flight": max(means.values()) / average if average else None}


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
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented command this way
        args.preset, args.num_backends, args.kv_cache_memory, args.workloads = "tiny", 2, "32MiB", "shared-prefix"
        args.prefix_len, args.num_groups, args.prompts_per_group, args.hot_requests = 64, 2, 2, 4
        args.output_len, args.max_concurrency = 2, 2
        print("KVREUSE_BENCH_SMOKE=1: smoke run with the smallest sizes; the figures mean nothing", flush=True)

    from kvreuse.bench.workloads import (
        HotPrefixOptions,
        SharedPrefixOptions,
        generate_workload,
    )
    from kvreuse.model_tools.make_model import ensure_model
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
                sampler = InFlightSampler(router.url)
                try:
                    before = routed_counts(router.url)
                    sampler.start()
                    results = run_workload(router.url, workload.requests, tokenizer, args)
                    sampler.stop()
                    after = routed_counts(router.url)
                finally:
                    sampler.stop()
                    stop(router)
                summary = summarize(results, {url: after[url] - before[url] for url in after})
                summary.update(sampler.summary())
                report["runs"][f"{name}/{policy}"] = summary
                print(f"  {policy}: {json.dumps(summary)}", flush=True)
    finally:
        for backend in backends:
            stop(backend)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print_table(report["runs"])
    return 0


def print_table(runs: dict[str, dict[str, Any]]) -> None:
    """One line per run, then the ratios the router's goals are stated in."""
    print(f"\n{'workload/run':30s} {'hit rate':>8s} {'TTFT p50':>10s} {'TTFT p90':>10s} "
          f"{'max/mean routed':>15s} {'max/mean in flight':>18s}")
    for name, run in runs.items():
        routed, in_flight = run.get("max_over_mean_load"), run.get("max_over_mean_in_flight")
        print(f"{name:30s} {run['hit_rate']:8.1%} {run['ttft_p50_s'] * 1000:8.0f} ms {run['ttft_p90_s'] * 1000:7.0f} ms "
              f"{'-' if routed is None else f'{routed:.2f}':>15} {'-' if in_flight is None else f'{in_flight:.2f}':>18}")
    for workload in sorted({name.split("/")[0] for name in runs}):
        single, aware, rr = (runs.get(f"{workload}/{run}") for run in ("single-server", "cache-aware", "round-robin"))
        if single and aware:
            print(f"{workload}: cache-aware hit rate / single server {aware['hit_rate'] / single['hit_rate']:.3f}")
        if aware and rr:
            print(f"{workload}: TTFT p50 round-robin / cache-aware {rr['ttft_p50_s'] / aware['ttft_p50_s']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
