"""The CPU paged attention kernel alone, one call per layer as a decode step makes it, in both of its
bf16 layouts: ``bf16_dot`` (AVX512_BF16 dot products over keys transposed and values paired as bf16
words, csrc/paged_attention.cpp) and ``float_rows`` (the pool read as float32 rows, what every other dtype
and CPU runs; forced with ``paged_attention.use_bf16_dot(False)``).

Cases (bf16 pool and queries, 16-token blocks): qwen2.5-0.5b's shapes (14 query heads over 2 KV heads of
64) with one decode row after 4,000 tokens and 16 rows after 128 each, and SmolLM2-135M's (9 over 3 of 64)
the same way. Each runs with one pool called again and again (``warm``: its K/V stay in cache) and with
--layers pools called in turn (``cold``: as in a decode step of that many layers, whose pools together
outgrow the caches). The layouts take turns, round by round; each figure is the median microseconds of a
call over --rounds rounds of --calls calls. Both layouts' outputs are checked equal to each other first
(within bf16 rounding). --window W runs every call as a layer with a sliding window of W keys (a decode
row then reads its last W keys only).

    python benchmarks/bench_paged_attention.py --json-out paged_attention.json

KVREUSE_BENCH_SMOKE=1 runs tiny sizes and prints the same table: the suite runs the documented command
that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

from kvreuse.bench.report import machine_description, write_json
from kvreuse.kernels import paged_attention

LAYOUTS = ("bf16_dot", "float_rows")
BLOCK = 16


def make_case(heads: int, kv_heads: int, dim: int, context: int, seqs: int, layers: int,
              generator: torch.Generator) -> dict:
    per_seq = -(-context // BLOCK)
    slots = (seqs * per_seq + 1) * BLOCK
    pools = [(torch.randn(slots, kv_heads, dim, generator=generator).to(torch.bfloat16),
              torch.randn(slots, kv_heads, dim, generator=generator).to(torch.bfloat16)) for _ in range(layers)]
    return {
        "q": torch.randn(seqs, heads, dim, generator=generator).to(torch.bfloat16),
        "pools": pools,
        "tables": (torch.randperm(seqs * per_seq, generator=generator) + 1).view(seqs, per_seq),
        "starts": torch.arange(seqs, dtype=torch.int64),
        "query_lens": torch.ones(seqs, dtype=torch.int64),
        "context_lens": torch.full((seqs,), context, dtype=torch.int64),
        "scale": 1.0 / math.sqrt(dim),
    }


def call(case: dict, out: torch.Tensor, layer: int, window: int = 0) -> None:
    k_pool, v_pool = case["pools"][layer % len(case["pools"])]
    torch.ops.kvreuse_attn.paged_attention(
        out, case["q"], k_pool, v_pool, None, None, case["tables"], case["starts"], case["query_lens"],
        case["context_lens"], BLOCK, -1, case["scale"], window, None, 0, None, None, None)


def use(layout: str) -> None:
    paged_attention.use_bf16_dot(layout != "float_rows")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="pools called in turn for the cold figures")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=96, help="calls per round and layout")
    parser.add_argument("--window", type=int, default=0,
                        help="a sliding window of this many keys for every call (0: none, a plain layer)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    cases = {"qwen2.5-0.5b, 1 row after 4,000": (14, 2, 64, 4000, 1),
             "qwen2.5-0.5b, 16 rows after 128": (14, 2, 64, 128, 16),
             "SmolLM2-135M, 1 row after 4,000": (9, 3, 64, 4000, 1),
             "SmolLM2-135M, 16 rows after 128": (9, 3, 64, 128, 16)}
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":
        print("KVREUSE_BENCH_SMOKE=1: tiny contexts, a few calls; the figures mean nothing")
        cases = {name: shape[:3] + (min(shape[3], 40), shape[4]) for name, shape in cases.items()}
        args.layers, args.rounds, args.calls = 2, 2, 2
    if not paged_attention.available():
        print("the paged attention kernel did not build here (the log says why): nothing to measure", file=sys.stderr)
        return 1
    layouts = LAYOUTS if paged_attention.has_bf16_dot() else ("float_rows",)
    machine = machine_description()
    print(f"{machine.get('cpu')}, flags {' '.join(machine.get('cpu_flags') or [])}; {torch.get_num_threads()} threads; "
          f"layouts: {', '.join(layouts)}" + ("" if len(layouts) == 2 else " (no AVX512_BF16 build here)"))
    generator = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, shape in cases.items():
        case = make_case(*shape, args.layers, generator)
        outs = {}
        for layout in layouts:  # warm-up, and the outputs compared
            use(layout)
            outs[layout] = torch.empty_like(case["q"])
            call(case, outs[layout], 0, args.window)
        if len(layouts) == 2:
            torch.testing.assert_close(outs["bf16_dot"].float(), outs["float_rows"].float(), atol=2e-2, rtol=2e-2)
        times: dict[str, dict[str, list[float]]] = {layout: {"warm": [], "cold": []} for layout in layouts}
        for _ in range(args.rounds):
            for layout in layouts:
                use(layout)
                for mode in ("warm", "cold"):
                    started = time.perf_counter()
                    for index in range(args.calls):
                        call(case, outs[layout], 0 if mode == "warm" else index, args.window)
                    times[layout][mode].append((time.perf_counter() - started) / args.calls * 1e6)
        results[name] = {layout: {mode: statistics.median(values) for mode, values in by_mode.items()}
                         for layout, by_mode in times.items()}
    use("bf16_dot")
    print(f"\n{'us per call (median of rounds)':40s}" + "".join(f"{layout + ' ' + mode:>18s}" for layout in layouts
                                                               for mode in ("warm", "cold")))
    for name, by_layout in results.items():
        print(f"{name:40s}" + "".join(f"{by_layout[layout][mode]:18.1f}" for layout in layouts
                                      for mode in ("warm", "cold")))
    if args.json_out:
        write_json(args.json_out, {"machine": machine, "args": vars(args), "results": results})
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
