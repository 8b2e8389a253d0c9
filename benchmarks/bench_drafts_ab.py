"""Cache drafts on against off, served, with the two servers up at once and their runs interleaved (issue 65).

bench_cache_drafts.py runs each system's whole set of workloads in turn, so drafts on and drafts off are measured
minutes apart. On a virtual machine whose speed moves by 10-30% within minutes (the 2-core EPYC VM of
docs/benchmarks.md: the same 16 streams with drafts off ran at 291 tok/s in one run and 460 in the next), an
on / off ratio taken that way measures the moment as much as the drafts. Here both servers are started first
(an idle server costs no CPU), and each round sends the same new prompts (bench_cache_drafts.py's workloads: no
round resends a prompt, so no round is served from what an earlier one cached or drafted) to one server, then to
the other, in the order on, off, then off, on in the next round. Reported per workload and phase (one stream:
--prompts requests one at a time, the median decode rate; streams: --streams requests at once, output tokens over
the wall time): the median of the rounds' on / off ratios, their range, and the medians of the rates. Greedy
texts are compared request by request.

    python benchmarks/bench_drafts_ab.py [--gguf FILE] [--workloads edit,quote,control] [--rounds 3] [--prompts 3]
        [--streams 16] [--max-tokens 160] [--json OUT]

FILE defaults to the packaged SmolLM2-135M-Instruct Q4_1 file. KVREUSE_BENCH_SMOKE=1 runs one round of one prompt
and 2 streams of 8 tokens on the tiny float32 preset (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvreuse.bench.compare import ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache_drafts as drafts  # noqa: E402  (the workloads, the client and the kvreuse server commands)
SYSTEMS = ("kvreuse", "kvreuse-off")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: the packaged SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--workloads", default="edit,quote,control",
                        help=f"comma-separated, among {list(drafts.WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3, help="requests a round sends one at a time (agent: loops)")
    parser.add_argument("--streams", type=int, default=16, help="requests a round sends at once (0: none)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--ctx-size", type=int, default=65536, help="each server's KV pool, in tokens")
    parser.add_argument("--json", default=None, help="write every round's figures and the ratios as JSON")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if any(workload not in drafts.WORKLOADS for workload in workloads):
        parser.error(f"--workloads must be among {list(drafts.WORKLOADS)}, got {args.workloads!r}")
    if args.rounds < 1 or args.prompts < 1 or args.streams < 0:
        parser.error("--rounds and --prompts must be at least 1, --streams at least 0")
    model = args.gguf
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":
        from kvreuse.model_tools.make_model import ensure_model

        print("KVREUSE_BENCH_SMOKE=1: one round, one prompt, 2 streams of 8 tokens on the tiny float32 preset; the "
              "figures mean nothing")
        model = str(ensure_model("tiny", dtype="float32"))
        args.rounds, args.prompts, args.streams, args.max_tokens, args.ctx_size = 1, 1, 2, 8, 4096
    if model is None:
        from kvreuse.loading.gguf import packaged_gguf

        path, why = packaged_gguf()
        if path is None:
            parser.error(f"no --gguf FILE and no packaged one: {why}")
        model = str(path)
    functions = drafts.stdlib_functions()
    per_round = args.prompts + args.streams
    # edit shows one function a request from the list's start, agent two a loop from its end (bench_cache_drafts.py)
    shown = per_round * args.rounds * (("edit" in workloads) + 2 * ("agent" in workloads))
    if shown > len(functions):
        parser.error(f"rounds x (prompts + streams) shows {shown} standard-library functions here, of "
                     f"{len(functions)}: fewer rounds, prompts or streams")
    flags = set(next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "").split())
    cpu_flags = [flag for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if flag in flags]
    print(f"machine: {drafts.machine_description()}; CPU flags {', '.join(cpu_flags)}")
    print(f"model: {model}; workloads {', '.join(workloads)}; {args.rounds} rounds of {args.prompts} one at a time "
          f"and {args.streams} at once, at most {args.max_tokens} tokens", flush=True)
    # The kvreuse commands of bench_cache_drafts.py (folders: kvreuse's own default dtype and quantization).
    shared = argparse.Namespace(streams=args.streams, ctx_size=args.ctx_size, llama_server=None, llama_spec_args="")
    figures: dict[str, dict[str, list[dict]]] = {w: {"one_stream": [], "streams": []} for w in workloads}
    unequal: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess(drafts.command_for("kvreuse", model, port_on := free_port(), shared),
                          Path(tmp) / "on.log", f"http://127.0.0.1:{port_on}") as on, \
            ServerProcess(drafts.command_for("kvreuse-off", model, port_off := free_port(), shared),
                          Path(tmp) / "off.log", f"http://127.0.0.1:{port_off}") as off:
        on.wait_ready(900)
        off.wait_ready(900)
        servers = {"kvreuse": on, "kvreuse-off": off}
        warm = [drafts.Job(f"warm-{n}", [{"role": "user", "content": f"Repeat this line exactly: {n} alpha beta gamma "
                                                                     f"delta epsilon {n}"}])
                for n in range(max(args.streams, 1))]
        for server in servers.values():  # lazy set-up out of the figures, as bench_cache_drafts.py does
            asyncio.run(drafts.one_at_a_time(server.base_url, warm[:1], 24))
            asyncio.run(drafts.all_at_once(server.base_url, warm, 24))
        for round_index in range(args.rounds):
            first = round_index * per_round
            order = SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]
            for workload in workloads:
                jobs = drafts.workload_jobs(workload, range(first, first + per_round), functions, drafts.AGENT_TURNS)
                phases = [("one_stream", jobs[:args.prompts])] + ([("streams", jobs[args.prompts:])] if args.streams
                                                                   else [])
                for phase, phase_jobs in phases:
                    measured, texts = {}, {}
                    for system in order:
                        url = servers[system].base_url
                        started = time.perf_counter()
                        replies = asyncio.run((drafts.all_at_once if phase == "streams" else drafts.one_at_a_time)(
                            url, phase_jobs, args.max_tokens))
                        wall = time.perf_counter() - started
                        result = drafts.phase_figures(replies, wall)
                        # A reply whose text came in one chunk has no decode rate (the tiny preset's bytes that
                        # complete no character): its phase is then timed as output tokens over the wall time.
                        measured[system] = result["decode_tok_s_median"] if phase == "one_stream" and \
                            result["decode_tok_s_median"] is not None else result["output_tok_s"]
                        texts[system] = {reply.key: reply.text for reply in replies}
                    on_texts, off_texts = texts["kvreuse"], texts["kvreuse-off"]
                    unequal += [key for key in on_texts if on_texts[key] != off_texts.get(key)]
                    entry = {"round": round_index, "on_tok_s": measured["kvreuse"],
                             "off_tok_s": measured["kvreuse-off"],
                             "ratio": measured["kvreuse"] / measured["kvreuse-off"], "requests": len(on_texts)}
                    figures[workload][phase].append(entry)
                    print(f"  round {round_index} {workload} {phase}: on {entry['on_tok_s']:.1f} off "
                          f"{entry['off_tok_s']:.1f} tok/s = {entry['ratio']:.2f}x", flush=True)
    print("\n| workload | phase | on / off, median of rounds (range) | on tok/s | off tok/s |")
    print("|---|---|---|---|---|")
    summary = {}
    for workload in workloads:
        for phase, rounds in figures[workload].items():
            if not rounds:
                continue
            ratios = [entry["ratio"] for entry in rounds]
            summary[f"{workload}/{phase}"] = statistics.median(ratios)
            print(f"| {workload} | {phase.replace('_', ' ')} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-"
                  f"{max(ratios):.2f}) | {statistics.median(e['on_tok_s'] for e in rounds):.1f} | "
                  f"{statistics.median(e['off_tok_s'] for e in rounds):.1f} |")
    total = sum(entry["requests"] for by_phase in figures.values() for rounds in by_phase.values() for entry in rounds)
    print(f"greedy texts, drafts on = off: {total - len(unequal)} of {total}"
          + (f"; differ: {', '.join(unequal[:5])}" if unequal else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": drafts.machine_description(), "cpu_flags": cpu_flags,
                                               "model": model, "args": vars(args), "rounds": figures,
                                               "median_ratios": summary, "unequal_texts": unequal}, indent=1))
        print(f"wrote {args.json}")
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
