"""Agent benchmark: N agents x T turns of tool calls, kvreuse beside llama.cpp's llama-server, per turn.

Every agent resends its system prompt, a tool list of about 2,000 tokens and its whole history each
turn, plus the previous turn's tool call (as the server returned it) and a tool result of a few
hundred tokens (kvreuse/bench/agent.py). Each system runs in turn on this machine (kvreuse serve,
then llama-server --jinja on a GGUF of the same model folder), same workload, same seed; the
table gives each turn's hit rate (cached / prompt tokens) and median TTFT side by side, and how
many replies carried a tool call.

Systems (``--systems``, run in that order): ``kvreuse`` and ``llama-server`` send the OpenAI
``tools`` with ``tool_choice: "required"``; ``kvreuse-no-tools`` and ``llama-server-no-tools`` send
the same tool list as text in the system prompt and no ``tools`` (a baseline for a server without
tool calling: replies are text, fed back as assistant messages). llama-server needs
``--llama-server BIN --gguf FILE``, the two lines ``bash ../shared/tools/llama_cpp_peer.sh MODEL_DIR
f32`` prints.

    python benchmarks/bench_agent.py --model models/smollm2-135m-v2384 --dtype float32 --temperature 1 \\
        --llama-server BIN --gguf models/smollm2-135m-v2384.f32.gguf

KVREUSE_BENCH_SMOKE=1 runs the same steps with the smallest sizes (2 agents x 2 turns, a 200-token
tool list; the tiny preset unless --model is given) and prints the same table; a llama-server
system whose binary or GGUF is missing is then skipped with a note (in a real run that is an
error). Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvreuse.bench.client import ClientConfig, LoadClient
from kvreuse.bench.compare import (
    SERVED_MODEL_NAME,
    LlamaServer,
    ServerProcess,
    free_port,
    sigterm_as_interrupt,
    system_command,
)
from kvreuse.bench.options import add_agent_arguments, agent_options, smoke_mode
from kvreuse.bench.report import (
    Summary,
    format_table,
    format_turns_comparison,
    machine_description,
    percentile,
    summarize,
    write_json,
)
from kvreuse.bench.workloads import RandomOptions, generate_workload

SYSTEMS = ("kvreuse", "kvreuse-no-tools", "llama-server", "llama-server-no-tools")
# Above this many cores used by processes outside the run, its timings are flagged as disturbed.
DISTURBED_CORES = 0.3


class OtherLoad:
    """Cores kept busy by processes outside this benchmark (this process, the client, and the server
    under test) while a system runs: all busy CPU time from /proc/stat minus the CPU time of those
    processes. On a shared machine a run that others disturbed shows it (None where /proc is absent)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.start = self._sample()

    @staticmethod
    def _busy() -> int:
        fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        return sum(fields) - fields[3] - fields[4]  # all but idle and iowait

    def _mine(self) -> int:
        total = 0
        for pid in self.pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
        return total

    def _sample(self) -> tuple[float, int, int] | None:
        try:
            return time.monotonic(), self._busy(), self._mine()
        except (OSError, ValueError, IndexError):
            return None

    def cores(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        others = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, others / ticks / (end[0] - self.start[0]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the --preset folder, made once)")
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", help="kvreuse's dtype; give llama-server a GGUF of the same")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="kvreuse's KV pool")
    parser.add_argument("--systems", default="kvreuse,llama-server", help=f"comma-separated, among {list(SYSTEMS)}")
    parser.add_argument("--llama-server", default=None, help="llama-server's binary (llama_cpp_peer.sh prints it)")
    parser.add_argument("--gguf", default=None, help="a GGUF of the same model folder")
    parser.add_argument("--llama-ctx-size", type=int, default=32768, help="llama-server's KV buffer (tokens)")
    parser.add_argument("--llama-cache-ram", type=int, default=4096, help="llama-server's host prompt cache (MiB)")
    parser.add_argument("--max-concurrency", type=int, default=4, help="requests in flight (agents run concurrently)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--warmup-requests", type=int, default=2, help="short unrelated requests before timing")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=None, help="JSON with every system's summary and requests")
    parser.add_argument("--plot", default=None, help="PNG of hit rate and median TTFT per turn")
    add_agent_arguments(parser.add_argument_group("agent workload"))
    args = parser.parse_args(argv)
    args.systems = [label.strip() for label in args.systems.split(",") if label.strip()]
    unknown = [label for label in args.systems if label not in SYSTEMS]
    if unknown or not args.systems or len(set(args.systems)) != len(args.systems):
        parser.error(f"--systems must name each of {list(SYSTEMS)} at most once, got {args.systems}")
    return args


def llama_available(args: argparse.Namespace) -> str | None:
    """Why llama-server cannot run (None: it can)."""
    try:
        LlamaServer(args.llama_server or "", args.gguf or "").check()
    except ValueError as error:
        return str(error)
    return None


def run_system(label: str, args: argparse.Namespace, model_dir: str, tokenizer: Any, log_dir: Path) -> dict[str, Any]:
    """Start one system's server, warm it up, run the agent workload (tools as text for -no-tools), stop it."""
    base = label.removesuffix("-no-tools")
    options = replace(agent_options(args), no_tools=label.endswith("-no-tools") or args.agent_no_tools)
    workload = generate_workload("agent", tokenizer, options, args.seed)
    llama = LlamaServer(args.llama_server, args.gguf, slots=args.max_concurrency, ctx_size=args.llama_ctx_size,
                        cache_ram_mib=args.llama_cache_ram) if base == "llama-server" else None
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = system_command(base, model_dir, port, args.dtype, args.device, args.kv_cache_memory, llama)
    print(f"\n[{label}] {workload.describe()}\n[{label}] starting: {' '.join(command)}", flush=True)
    started = time.monotonic()
    config = ClientConfig(base_url=base_url, model=SERVED_MODEL_NAME, endpoint="chat",
                          max_concurrency=args.max_concurrency, seed=args.seed, temperature=args.temperature,
                          timeout_s=args.timeout, progress=False)
    with ServerProcess(command, log_dir / f"{label}.log", base_url) as server:
        server.wait_ready(args.startup_timeout)
        print(f"[{label}] ready in {time.monotonic() - started:.1f} s", flush=True)
        if args.warmup_requests:
            warmup = generate_workload("random", tokenizer, RandomOptions(input_len=48, output_len=4,
                                                                        num_requests=args.warmup_requests),
                                       args.seed + 10_007)
            warm_config = replace(config, endpoint="completions", request_rate=math.inf, max_concurrency=1)
            warm = LoadClient(warm_config).run(warmup.requests)
            if not any(result.success for result in warm.results):
                raise RuntimeError(f"[{label}] warm-up failed: {warm.results[0].error}\n{server.log_tail()}")
        assert server.process is not None
        load = OtherLoad([os.getpid(), server.process.pid])
        run = LoadClient(config, tokenizer).run(workload.requests)
        others = load.cores()
    summary = summarize(run)
    print(format_table(summary, f"agent: {label}"), flush=True)
    if others is not None:
        note = " (disturbed: repeat this run)" if others > DISTURBED_CORES else ""
        print(f"[{label}] other processes kept {others:.2f} cores busy during the run{note}", flush=True)
    failed = [result for result in run.results if result.error and not result.error.startswith("skipped")]
    if failed:
        print(f"[{label}] first error: {failed[0].error}", flush=True)
    return {"label": label, "command": command, "workload": workload, "run": run, "summary": summary,
            "other_cores": others}


def print_summary(results: list[dict[str, Any]]) -> None:
    """The side-by-side per-turn table, then one line per system: all turns, and the turns after the
    first (each of which could reuse its agent's whole previous turn)."""
    summaries: dict[str, Summary] = {result["label"]: result["summary"] for result in results}
    print()
    print(format_turns_comparison(summaries, "agent: hit rate and median TTFT per turn"))
    print(f"{'system':<24}{'done':>8}{'calls':>8}{'hit rate':>10}{'turns>0 hit':>13}{'TTFT med ms':>13}"
          f"{'turns>0 TTFT':>14}{'others':>8}")
    for system in results:
        label, summary, others = system["label"], system["summary"], system["other_cores"]
        later = [turn for turn in summary.turns if turn.turn > 0]
        prompt, cached = sum(turn.prompt_tokens for turn in later), sum(turn.cached_tokens for turn in later)
        later_ttft = [request.ttft_s for request in system["run"].results
                      if request.success and request.turn > 0 and request.ttft_s is not None]
        calls = "-" if summary.tool_calls_returned is None else str(summary.tool_calls_returned)
        print(f"{label:<24}{f'{summary.completed}/{summary.num_requests}':>8}{calls:>8}"
              f"{'-' if summary.cache_hit_rate is None else f'{summary.cache_hit_rate:.1%}':>10}"
              f"{f'{cached / prompt:.1%}' if prompt and summary.cache_hit_rate is not None else '-':>13}"
              f"{'-' if summary.ttft is None else f'{summary.ttft.median * 1000:.0f}':>13}"
              f"{f'{percentile(later_ttft, 50) * 1000:.0f}' if later_ttft else '-':>14}"
              f"{'-' if others is None else f'{others:.2f}':>8}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if smoke_mode():  # the suite runs the documented command this way
        args.agent_num_agents, args.agent_num_turns, args.agent_tools_len = 2, 2, 200
        args.agent_result_len, args.agent_system_prompt_len, args.agent_task_len = 16, 16, 8
        args.agent_num_tool_sets, args.max_concurrency, args.warmup_requests = 1, 2, 1
        args.kv_cache_memory, args.llama_ctx_size, args.llama_cache_ram = "64MiB", 4096, 256
        if not args.model:
            args.preset = "tiny"
        print("KVREUSE_BENCH_SMOKE=1: smoke run with the smallest sizes; the figures mean nothing", flush=True)
    from kvreuse.bench.options import load_tokenizer

    if args.model:
        model_dir = args.model
    else:
        from kvreuse.model_tools.make_model import ensure_model

        model_dir = str(ensure_model(args.preset))
    tokenizer = load_tokenizer(model_dir)
    systems = list(args.systems)
    missing = llama_available(args) if any(label.startswith("llama-server") for label in systems) else None
    if missing is not None:
        if not smoke_mode():
            print(f"error: {missing}", file=sys.stderr)
            return 2
        print(f"llama-server: skipped in this smoke run ({missing}); a real run needs it", flush=True)
        systems = [label for label in systems if not label.startswith("llama-server")]
    log_dir = Path(tempfile.mkdtemp(prefix="kvreuse-bench-agent-"))
    print(f"model {model_dir}, kvreuse {args.dtype} on {args.device}; server logs in {log_dir}", flush=True)
    with sigterm_as_interrupt():
        results = [run_system(label, args, model_dir, tokenizer, log_dir) for label in systems]
    print_summary(results)
    if args.out:
        write_json(args.out, {
            "kind": "kvreuse-bench-agent", "version": 1, "model": model_dir, "dtype": args.dtype,
            "gguf": args.gguf, "command": " ".join(sys.argv), "machine": machine_description(),
            "systems": {result["label"]: {
                "command": " ".join(result["command"]), "workload": result["workload"].describe(),
                "other_processes_cores": result["other_cores"],
                "summary": result["summary"].as_dict(),
                "requests": [request.as_dict() for request in result["run"].results]} for result in results},
        })
        print(f"wrote {args.out}")
    if args.plot:
        from kvreuse.bench.plot import plot_turns

        options = agent_options(args)
        plot_turns([(result["label"], result["summary"]) for result in results],
                   f"agent: {options.num_agents} agents x {options.num_turns} turns, tool list ~{options.tools_len} "
                   f"tokens, results {options.result_len} tokens, at most {options.output_len} out; model "
                   f"{Path(model_dir).name} ({args.dtype}), {os.cpu_count()} cores", args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(result["summary"].completed == result["summary"].num_requests for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
