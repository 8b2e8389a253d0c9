"""Discrete-event simulation of the router policy (kvreuse.router.policy, the real class) over N
simulated backends: for tuning guards and costs in seconds instead of minutes of real servers.

Each backend runs prefills one at a time, first come first served (``--prefill-s-per-token`` per
uncached token; its real prefix cache is a set of block keys, filled as prefills start), then
decodes ``--output-len`` steps of ``--step-s`` each. The client keeps ``--concurrency`` requests in
flight. The router's loads are kept as kvreuse route keeps them. Printed per (policy, concurrency,
workload): hit rate (and a single server's), TTFT p50 and max/mean requests routed, means over seeds.
A model, not a measurement: figures for the docs come from bench_router.py.

    python benchmarks/simulate_router_policy.py --concurrency 8,16,32
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics

from kvreuse.router.policy import (
    BackendLoad,
    PolicyConfig,
    Router,
    RouteRequest,
    prompt_block_keys,
)

BLOCK = 16


def workload(name: str, seed: int, prefix_len: int = 512, question_len: int = 32) -> list[list[int]]:
    """bench_router.py's shapes: shared-prefix 8 groups x 6 shuffled; hot-prefix 48, 80% one prefix."""
    rng = random.Random(seed)
    if name == "shared-prefix":
        groups = [g for g in range(8) for _ in range(6)]
        rng.shuffle(groups)
    else:
        groups = [0 if rng.random() < 0.8 else 1 + rng.randrange(4) for _ in range(48)]
    return [[g * 100_000 + i for i in range(prefix_len)] + [rng.randrange(10**9) for _ in range(question_len)]
            for g in groups]


def simulate(name: str, config: PolicyConfig, num_backends: int, concurrency: int, seed: int,
             prefill_s_per_token: float, step_s: float, output_len: int) -> tuple[float, float, float]:
    """(hit rate, TTFT p50 in s, max/mean requests routed) of one run."""
    pending = workload(name, seed)
    router = Router(config)
    names = [f"b{i}" for i in range(num_backends)]
    loads = {n: BackendLoad() for n in names}
    for n in names:
        router.index.add_backend(n, 10**6)
    cached_keys: dict[str, set[bytes]] = {n: set() for n in names}
    busy_until = dict.fromkeys(names, 0.0)
    routed = dict.fromkeys(names, 0)
    events: list[tuple[float, int, str, str, float, int, RouteRequest]] = []
    order = itertools.count()
    totals = {"prompt": 0, "cached": 0, "in_flight": 0}
    ttfts: list[float] = []

    def send(now: float) -> None:
        tokens = pending.pop(0)
        request = RouteRequest(tuple(prompt_block_keys(tokens, BLOCK)), len(tokens))
        decision = router.choose(request, loads, now)
        backend = decision.backend
        router.record_sent(backend, request)
        routed[backend] += 1
        loads[backend].in_flight += 1
        loads[backend].queued_prefill_tokens += decision.uncached_tokens
        hit = next((i for i, key in enumerate(request.block_keys) if key not in cached_keys[backend]),
                   len(request.block_keys))
        start = max(now, busy_until[backend])
        busy_until[backend] = start + (len(tokens) - hit * BLOCK) * prefill_s_per_token + 0.005
        cached_keys[backend].update(request.block_keys)
        totals["prompt"] += len(tokens)
        totals["cached"] += hit * BLOCK
        totals["in_flight"] += 1
        heapq.heappush(events, (busy_until[backend], next(order), "first", backend, now, decision.uncached_tokens,
                                request))

    while pending and totals["in_flight"] < concurrency:
        send(0.0)
    while events:
        now, _, kind, backend, sent, uncached, request = heapq.heappop(events)
        load = loads[backend]
        if kind == "first":
            load.queued_prefill_tokens -= uncached
            load.num_decoding += 1
            ttfts.append(now - sent)
            finish = now + output_len * step_s * (1 + 0.1 * load.num_decoding)
            heapq.heappush(events, (finish, next(order), "done", backend, sent, 0, request))
        else:
            load.num_decoding -= 1
            load.in_flight -= 1
            router.record_finished(backend, request)
            totals["in_flight"] -= 1
            if pending:
                send(now)
    counts = list(routed.values())
    return totals["cached"] / totals["prompt"], statistics.median(ttfts), max(counts) / statistics.mean(counts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="cache-aware,round-robin")
    parser.add_argument("--num-backends", type=int, default=4)
    parser.add_argument("--concurrency", default="8,16,32")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--prefill-s-per-token", type=float, default=6e-3)
    parser.add_argument("--step-s", type=float, default=0.15)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--miss-cost-weight", type=float, default=PolicyConfig.miss_cost_weight)
    parser.add_argument("--min-in-flight-for-guard", type=int, default=PolicyConfig.min_in_flight_for_guard)
    args = parser.parse_args(argv)
    timing = {"prefill_s_per_token": args.prefill_s_per_token, "step_s": args.step_s, "output_len": args.output_len}
    for policy in args.policies.split(","):
        config = PolicyConfig(policy=policy, miss_cost_weight=args.miss_cost_weight,
                              min_in_flight_for_guard=args.min_in_flight_for_guard)
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for name in ("shared-prefix", "hot-prefix"):
                runs = [simulate(name, config, args.num_backends, concurrency, seed, **timing)
                        for seed in range(args.seeds)]
                single = statistics.mean(simulate(name, config, 1, concurrency, seed, **timing)[0]
                                         for seed in range(args.seeds))
                print(f"{policy:12s} {concurrency:3d} in flight {name:14s} "
                      f"hit {statistics.mean(r[0] for r in runs):6.1%} (single server {single:6.1%})  "
                      f"TTFT p50 {statistics.mean(r[1] for r in runs) * 1000:7.0f} ms  "
                      f"max/mean routed {statistics.mean(r[2] for r in runs):.2f}")


if __name__ == "__main__":
    main()
