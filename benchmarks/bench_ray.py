"""kvreuse on Ray Serve: kvreuse's request router against Ray Serve's default (power of two choices).

The same requests go through Ray Serve to (1) one engine replica (the "one server holding every
prefix" hit-rate baseline), then (2) N replicas under each request router, each a fresh deployment
(``kvreuse serve --ray-address ...``, as the docs show it: every replica starts with an empty cache)
that runs the workloads one after the other (shared-prefix: groups of requests sharing a long system
prompt; multi-turn: conversations whose every turn repeats the earlier ones; they share no prefix). Reported per run, from the replicas' own
replies: prefix-cache hit rate (cached / prompt tokens), TTFT p50 / p99 as the client measures it,
throughput (requests/s and output tokens/s over the run); and the routing policy's own cost per
request (keying a 2,048-token prompt and choosing among the replicas, measured in-process).

    python benchmarks/bench_ray.py --preset smollm2-135m --dtype bfloat16 --temperature 1

Without --ray-address (or RAY_ADDRESS) it starts a local cluster as docs/ray.md does (``ray start``: a head offering no
CPU, one worker node of one CPU per replica) and stops it at the end. KVREUSE_BENCH_SMOKE=1 runs the same
steps with the smallest sizes (tiny preset, 2 replicas, 2 groups x 2 prompts, 1 conversation of 2 turns)
and prints the same table: the suite runs the documented command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvreuse.bench.compare import wait_healthy

MODEL_NAME = "bench-model"


def start_cluster(num_workers: int, head_port: int) -> str:
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    common = ["--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    subprocess.run([ray, "start", "--head", "--port", str(head_port), "--num-cpus", "0", "--include-dashboard", "false",
                    *common], check=True, capture_output=True, timeout=180)
    for _ in range(num_workers):
        subprocess.run([ray, "start", "--address", f"127.0.0.1:{head_port}", "--num-cpus", "1", *common], check=True,
                       capture_output=True, timeout=180)
    return f"127.0.0.1:{head_port}"


def stop_cluster() -> None:
    ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=180)


def deploy(args: argparse.Namespace, model_dir: Path, address: str, replicas: int, router: str, log: Path) -> subprocess.Popen:
    command = ["kvreuse", "serve", "--model", str(model_dir), "--dtype", args.dtype, "--kv-cache-memory",
               args.kv_cache_memory, "--served-model-name", MODEL_NAME, "--stats-log-interval", "0",
               "--ray-address", address, "--num-replicas", str(replicas), "--max-replicas-per-node", "1",
               "--ray-request-router", router, "--port", str(args.port)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 600
    while "serving on" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"deployment failed:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    wait_healthy(f"http://127.0.0.1:{args.port}", process, 300, lambda: log.read_text(errors="replace")[-3000:])
    # Every replica answers before the clock starts (Ray reports them running once their engine is loaded).
    for _ in range(4 * replicas):
        httpx.post(f"http://127.0.0.1:{args.port}/v1/completions", timeout=300,
                   json={"model": MODEL_NAME, "prompt": "warm up", "max_tokens": 1}).raise_for_status()
    return process


def undeploy(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_workload(port: int, requests: Any, tokenizer: Any, args: argparse.Namespace) -> Any:
    from kvreuse.bench.client import ClientConfig, LoadClient

    config = ClientConfig(base_url=f"http://127.0.0.1:{port}", model=MODEL_NAME, request_rate=args.request_rate,
                          max_concurrency=args.max_concurrency, seed=args.seed, progress=False,
                          temperature=args.temperature)
    return LoadClient(config, tokenizer).run(requests)


def summarize(run: Any) -> dict[str, Any]:
    results = run.results
    ok = [r for r in results if r.success]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    return {
        "requests": len(results), "failed": len(results) - len(ok), "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] if ttfts else None,
        "requests_per_s": len(ok) / run.duration_s if run.duration_s else None,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / run.duration_s if run.duration_s else None,
        "duration_s": run.duration_s,
    }


def routing_cost(tokenizer: Any, num_replicas: int, repeats: int = 200) -> dict[str, float]:
    """The policy's work per request in the ingress process: block keys of a 2,048-token prompt and one
    choice among ``num_replicas`` whose indexes hold 4,096 blocks each (medians, microseconds)."""
    from kvreuse.router.policy import BackendLoad, PolicyConfig, Router
    from kvreuse.router.prompts import Namespace, Prompt, route_request

    router = Router(PolicyConfig(block_size=16))
    names = [f"replica-{i}" for i in range(num_replicas)]
    namespaces = {name: Namespace(MODEL_NAME, None, None) for name in names}
    for i, name in enumerate(names):
        router.index.add_backend(name, 4096)
        filler = route_request(Prompt(tuple(range(i * 100_000, i * 100_000 + 4096 * 16)), None), None, None,
                               namespaces, 16)
        router.record_sent(name, filler)
    prompt = Prompt(tuple(range(2048)), None)
    loads = {name: BackendLoad() for name in names}
    keying, choosing = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        route = route_request(prompt, None, None, namespaces, 16)
        keyed = time.perf_counter()
        router.choose(route, loads, time.monotonic())
        keying.append(keyed - started)
        choosing.append(time.perf_counter() - keyed)
    return {"keying_2048_tokens_us": statistics.median(keying) * 1e6, "choose_us": statistics.median(choosing) * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--model", default=None, help="a model folder (instead of the preset's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--routers", default="kvreuse,pow2")
    parser.add_argument("--workloads", default="shared-prefix,multi-turn")
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: the system prompt's tokens")
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=6)
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--user-len", type=int, default=256, help="multi-turn: tokens of each user message")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="1 on random weights whose greedy output can be text-less bytes (no chunk to time)")
    parser.add_argument("--ray-address", default=None,
                        help="an existing cluster (default: RAY_ADDRESS, else a cluster started here and stopped after)")
    parser.add_argument("--port", type=int, default=8100, help="Ray Serve's HTTP port")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented command this way
        args.preset, args.num_replicas, args.kv_cache_memory = "tiny", 2, "32MiB"
        args.prefix_len, args.num_groups, args.prompts_per_group = 64, 2, 2
        args.num_conversations, args.num_turns, args.output_len, args.max_concurrency = 1, 2, 2, 2
        args.user_len, args.request_rate = 16, float("inf")
        print("KVREUSE_BENCH_SMOKE=1: smoke run with the smallest sizes; the figures mean nothing", flush=True)

    from kvreuse.bench.workloads import (
        MultiTurnOptions,
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
        # A short shared system prompt: each conversation's own history is most of every turn's prompt.
        "multi-turn": MultiTurnOptions(num_conversations=args.num_conversations, num_turns=args.num_turns,
                                       system_prompt_len=64, user_len=args.user_len, output_len=args.output_len),
    }
    workloads = {name: generate_workload(name, tokenizer, options[name], args.seed) for name in args.workloads.split(",")}
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_ray_logs"
    logs.mkdir(exist_ok=True)
    address = args.ray_address or os.environ.get("RAY_ADDRESS")  # Ray's own variable: a running cluster
    started_cluster = address is None
    address = address or start_cluster(args.num_replicas, head_port=6391)
    report: dict[str, Any] = {"args": vars(args), "runs": {}, "routing_cost": routing_cost(tokenizer, args.num_replicas)}
    try:
        # One fresh deployment per configuration (empty caches), running the workloads one after the other
        # (their prompts share no prefix, and the KV pool holds both).
        for label, replicas, router in [("one replica", 1, "kvreuse"),
                                        *[(f"{r}, {args.num_replicas} replicas", args.num_replicas, r)
                                          for r in args.routers.split(",")]]:
            process = deploy(args, model_dir, address, replicas, router, logs / f"{router}-{replicas}.log")
            try:
                for name, workload in workloads.items():
                    summary = summarize(run_workload(args.port, workload.requests, tokenizer, args))
                    report["runs"][f"{name}/{label}"] = summary
                    print(f"  {name}, {label}: {json.dumps(summary)}", flush=True)
            finally:
                undeploy(process)
    finally:
        if started_cluster:
            stop_cluster()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print_table(report, args.num_replicas)
    return 0


def print_table(report: dict[str, Any], num_replicas: int) -> None:
    runs = report["runs"]
    print(f"\n{'workload / run':36s} {'hit rate':>8s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'req/s':>7s} {'out tok/s':>9s}")
    for name, run in runs.items():
        p50, p99 = run["ttft_p50_s"], run["ttft_p99_s"]
        print(f"{name:36s} {run['hit_rate']:8.1%} {'-' if p50 is None else f'{p50 * 1000:7.0f} ms':>10s} "
              f"{'-' if p99 is None else f'{p99 * 1000:7.0f} ms':>10s} {run['requests_per_s'] or 0:7.2f} "
              f"{run['output_tokens_per_s'] or 0:9.1f}")
    for workload in sorted({name.split("/")[0] for name in runs}):
        one = runs.get(f"{workload}/one replica")
        ours = runs.get(f"{workload}/kvreuse, {num_replicas} replicas")
        pow2 = runs.get(f"{workload}/pow2, {num_replicas} replicas")
        if one and ours and one["hit_rate"]:
            print(f"{workload}: kvreuse router hit rate / one replica {ours['hit_rate'] / one['hit_rate']:.3f}")
        if ours and pow2 and ours["ttft_p50_s"] and pow2["ttft_p50_s"]:
            print(f"{workload}: TTFT p50 pow2 / kvreuse router {pow2['ttft_p50_s'] / ours['ttft_p50_s']:.2f}")
    cost = report["routing_cost"]
    print(f"routing cost per request: keying a 2,048-token prompt {cost['keying_2048_tokens_us']:.0f} us, "
          f"choosing among {num_replicas} replicas {cost['choose_us']:.0f} us")


if __name__ == "__main__":
    sys.exit(main())
