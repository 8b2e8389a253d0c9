"""Summaries of a benchmark run: latency distributions, throughput, cache hit rate, errors; the
printed table and the JSON document (every request included). Workloads with turns (multi-turn,
agent) also get one row per turn: hit rate (cached / prompt tokens of that turn's requests) and
median TTFT, and for agents how many replies carried a tool call."""

from __future__ import annotations

import json
import math
import os
import platform
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvreuse.bench.client import BenchmarkRun, RequestResult

REPORT_VERSION = 1
# The CPU features that decide which kernels run (named in the machine description of a report).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be between 0 and 100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


@dataclass(frozen=True)
class Distribution:
    """Statistics of one latency, in seconds."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        return cls(len(values), sum(values) / len(values), percentile(values, 50), percentile(values, 90),
                   percentile(values, 99), min(values), max(values))


@dataclass(frozen=True)
class TurnSummary:
    """The requests of one turn index across conversations / agents (successful ones for the figures)."""

    turn: int
    requests: int
    completed: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float | None  # cached / prompt tokens of this turn; None when the server reports no cached tokens
    ideal_hit_rate: float | None
    # Cached tokens over what the previous turn of the same conversation left behind (its prompt plus its
    # output): 1.0 when every turn reuses its whole previous turn; None on turn 0.
    previous_turn_reuse: float | None
    prompt_tokens_median: float | None
    ttft_median_s: float | None
    tool_calls_returned: int | None  # agent turns whose reply carried a tool call; None for other workloads


@dataclass(frozen=True)
class Summary:
    num_requests: int
    completed: int
    failed: int
    errors: dict[str, int]  # error kind -> count
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # prompt + output tokens per second
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cache_hit_rate: float | None  # cached / prompt tokens; None when the server reports no cached tokens
    cached_tokens_reported: int  # requests whose usage carried prompt_tokens_details.cached_tokens
    ideal_hit_rate: float | None  # what an unbounded token-granular prefix cache could reach
    output_at_end: int  # requests whose output arrived in one burst at the end (their TTFT = E2E)
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    # Workloads with turns: one entry per turn index (empty otherwise).
    turns: tuple[TurnSummary, ...] = ()
    # Agent workloads: completed turns whose reply carried a tool call, and those that did not.
    tool_calls_returned: int | None = None
    no_tool_call: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def error_kind(message: str) -> str:
    """A short class for counting: 'HTTP 500', 'connection: RemoteProtocolError', 'timeout', ..."""
    head = message.split(":", 2)
    if message.startswith("connection:") and len(head) > 1:
        return "connection:" + head[1]
    return head[0]


def _ideal_prompt(result: RequestResult) -> int:
    """The ideal figure's denominator: the prompt as the client tokenized it (else as the server counted it)."""
    return result.ideal_prompt_tokens or result.prompt_tokens or 0


def turn_summaries(results: Sequence[RequestResult]) -> tuple[TurnSummary, ...]:
    """Per-turn figures of the conversation requests among ``results`` (none: an empty tuple)."""
    by_turn: dict[int, list[RequestResult]] = {}
    by_key: dict[tuple[str, int], RequestResult] = {}
    for result in results:
        if result.conversation is not None:
            by_turn.setdefault(result.turn, []).append(result)
            by_key[(result.conversation, result.turn)] = result
    turns = []
    for turn, members in sorted(by_turn.items()):
        ok = [result for result in members if result.success]
        prompt = sum(result.prompt_tokens or 0 for result in ok)
        cached = sum(result.cached_tokens for result in ok)
        reported = any(result.cached_tokens_reported for result in ok)
        with_ideal = [result for result in ok if result.ideal_cached_tokens is not None and _ideal_prompt(result)]
        ideal_prompt = sum(_ideal_prompt(result) for result in with_ideal)
        ttfts = [result.ttft_s for result in ok if result.ttft_s is not None]
        prompts = [float(result.prompt_tokens) for result in ok if result.prompt_tokens is not None]
        agent = [result for result in ok if result.tool_calls is not None]
        carried = reused = 0
        for result in ok:
            previous = by_key.get((result.conversation or "", turn - 1))
            if previous is not None and previous.success and previous.prompt_tokens:
                carried += previous.prompt_tokens + previous.output_tokens
                reused += result.cached_tokens
        turns.append(TurnSummary(
            turn=turn, requests=len(members), completed=len(ok), prompt_tokens=prompt, cached_tokens=cached,
            hit_rate=cached / prompt if reported and prompt else None,
            ideal_hit_rate=(sum(result.ideal_cached_tokens or 0 for result in with_ideal) / ideal_prompt
                            if ideal_prompt else None),
            previous_turn_reuse=reused / carried if carried and reported else None,
            prompt_tokens_median=percentile(prompts, 50) if prompts else None,
            ttft_median_s=percentile(ttfts, 50) if ttfts else None,
            tool_calls_returned=sum(1 for result in agent if result.tool_calls) if agent else None,
        ))
    return tuple(turns)


def summarize(run: BenchmarkRun) -> Summary:
    results = run.results
    ok = [result for result in results if result.success]
    prompt_tokens = sum(result.prompt_tokens or 0 for result in ok)
    cached_tokens = sum(result.cached_tokens for result in ok)
    output_tokens = sum(result.output_tokens for result in ok)
    reported = sum(1 for result in ok if result.cached_tokens_reported)
    with_ideal = [result for result in ok if result.ideal_cached_tokens is not None and _ideal_prompt(result)]
    ideal_prompt = sum(_ideal_prompt(result) for result in with_ideal)
    duration = max(run.duration_s, 1e-9)
    agent = [result for result in ok if result.tool_calls is not None]
    returned = sum(1 for result in agent if result.tool_calls)
    return Summary(
        num_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=dict(Counter(error_kind(result.error) for result in results if result.error)),
        duration_s=run.duration_s,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(prompt_tokens + output_tokens) / duration,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        output_tokens=output_tokens,
        cache_hit_rate=cached_tokens / prompt_tokens if reported and prompt_tokens else None,
        cached_tokens_reported=reported,
        ideal_hit_rate=(sum(result.ideal_cached_tokens or 0 for result in with_ideal) / ideal_prompt
                        if ideal_prompt else None),
        output_at_end=sum(1 for result in ok if result.output_arrived_at_end),
        ttft=Distribution.of([result.ttft_s for result in ok if result.ttft_s is not None]),
        tpot=Distribution.of([tpot for result in ok if (tpot := result.tpot_s) is not None]),
        itl=Distribution.of([gap for result in ok for gap in result.itl_s]),
        e2e=Distribution.of([result.e2e_s for result in ok if result.e2e_s is not None]),
        turns=turn_summaries(results),
        tool_calls_returned=returned if agent else None,
        no_tool_call=len(agent) - returned if agent else None,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def format_table(summary: Summary, title: str) -> str:
    """The end-of-run table (latencies in ms)."""
    width = 72
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<44}{value:>28}")

    row("Requests: completed / failed", f"{summary.completed} / {summary.failed}")
    for kind, count in sorted(summary.errors.items()):
        row(f"  error {kind}", str(count))
    row("Duration (s)", f"{summary.duration_s:.2f}")
    row("Request throughput (req/s)", f"{summary.request_throughput:.3f}")
    row("Output token throughput (tok/s)", f"{summary.output_throughput:.1f}")
    row("Total token throughput (tok/s)", f"{summary.total_token_throughput:.1f}")
    row("Prompt / cached / output tokens",
        f"{summary.prompt_tokens} / {summary.cached_tokens} / {summary.output_tokens}")
    if summary.cache_hit_rate is None:
        row("Cache hit rate (cached / prompt tokens)", "not reported by server")
    else:
        row("Cache hit rate (cached / prompt tokens)", _rate(summary.cache_hit_rate))
        if summary.cached_tokens_reported < summary.completed:
            row("  requests without cached_tokens (counted 0)", str(summary.completed - summary.cached_tokens_reported))
    row("Ideal hit rate (unbounded prefix cache)", _rate(summary.ideal_hit_rate))
    if summary.output_at_end:
        row("Output in one burst at the end (TTFT = E2E)", f"{summary.output_at_end} requests")
    if summary.tool_calls_returned is not None:
        row("Agent turns: tool call back / none", f"{summary.tool_calls_returned} / {summary.no_tool_call}")
    lines.append(f"{'latency (ms)':<16}{'mean':>11}{'median':>11}{'p90':>11}{'p99':>11}{'max':>12}".ljust(width))
    for label, distribution in (("TTFT", summary.ttft), ("TPOT", summary.tpot), ("ITL", summary.itl),
                                ("E2E", summary.e2e)):
        if distribution is None:
            lines.append(f"{label:<16}{'-':>11}")
            continue
        lines.append(f"{label:<16}{_ms(distribution.mean):>11}{_ms(distribution.median):>11}"
                     f"{_ms(distribution.p90):>11}{_ms(distribution.p99):>11}{_ms(distribution.max):>12}")
    if summary.turns:
        lines.append(format_turns(summary.turns))
    lines.append("=" * width)
    return "\n".join(lines)


def format_turns(turns: Sequence[TurnSummary]) -> str:
    """One row per turn: requests, tool calls back (agents), median prompt tokens, hit rate (and the ideal
    one), share of the previous turn (prompt + output) reused, TTFT median."""
    agent = any(turn.tool_calls_returned is not None for turn in turns)
    header = f"{'turn':<6}{'done':>6}" + (f"{'calls':>7}" if agent else "") + \
        f"{'prompt med':>12}{'hit rate':>10}{'ideal':>8}{'prev reused':>13}{'TTFT med ms':>13}"
    lines = [header]
    for turn in turns:
        calls = f"{'-' if turn.tool_calls_returned is None else turn.tool_calls_returned:>7}" if agent else ""
        prompt = "-" if turn.prompt_tokens_median is None else f"{turn.prompt_tokens_median:.0f}"
        lines.append(f"{turn.turn:<6}{f'{turn.completed}/{turn.requests}':>6}{calls}{prompt:>12}"
                     f"{_rate(turn.hit_rate):>10}{_rate(turn.ideal_hit_rate):>8}{_rate(turn.previous_turn_reuse):>13}"
                     f"{_ms(turn.ttft_median_s):>13}")
    return "\n".join(lines)


def format_turns_comparison(summaries: dict[str, Summary], title: str) -> str:
    """Per-turn hit rate, share of the previous turn reused ("prev") and median TTFT of several systems side
    by side (and tool calls back, for agents)."""
    labels = [label for label, summary in summaries.items() if summary.turns]
    if not labels:
        return ""
    agent = any(summary.tool_calls_returned is not None for summary in summaries.values())
    per_system = ("hit rate", "prev", "TTFT ms") + (("calls",) if agent else ())
    column = 10
    span = max(column * len(per_system), *(len(label) + 2 for label in labels))
    column = span // len(per_system)
    span = column * len(per_system)
    width = 6 + span * len(labels)
    lines = [f" {title} ".center(width, "="),
             f"{'':<6}" + "".join(f"{label:>{span}}" for label in labels),
             f"{'turn':<6}" + "".join(f"{name:>{column}}" for _ in labels for name in per_system)]
    by_turn = {label: {turn.turn: turn for turn in summaries[label].turns} for label in labels}
    for index in sorted({turn for turns in by_turn.values() for turn in turns}):
        cells = []
        for label in labels:
            turn = by_turn[label].get(index)
            cells += [_rate(turn.hit_rate) if turn else "-", _rate(turn.previous_turn_reuse) if turn else "-",
                      _ms(turn.ttft_median_s) if turn else "-"]
            if agent:
                cells.append("-" if turn is None or turn.tool_calls_returned is None
                             else f"{turn.tool_calls_returned}/{turn.completed}")
        lines.append(f"{index:<6}" + "".join(f"{cell:>{column}}" for cell in cells))
    lines.append("=" * width)
    return "\n".join(lines)


def machine_description() -> dict[str, Any]:
    """Cores, CPU model, memory and accelerator of this machine (the client's; a compare run starts
    its servers here too)."""
    cpu = platform.processor() or platform.machine()
    memory_gib = None
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == (platform.processor() or platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                present = set(line.split(":", 1)[1].split())
                flags = [flag for flag in CPU_FLAGS if flag in present]
        memory_gib = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    accelerator = None
    try:
        import torch

        if torch.cuda.is_available():
            accelerator = torch.cuda.get_device_name(0)
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": cores, "cpu": cpu, "cpu_flags": flags, "memory_gib": memory_gib, "gpu": accelerator,
            "torch": torch_version, "python": platform.python_version()}


def run_document(run: BenchmarkRun, summary: Summary, config: dict[str, Any],
                 workload: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "kvreuse-bench-serve",
        "version": REPORT_VERSION,
        "config": config,
        "workload": workload,
        "machine": machine_description(),
        "summary": summary.as_dict(),
        "requests": [result.as_dict() for result in run.results],
    }


def write_json(path: str | os.PathLike[str], document: dict[str, Any]) -> None:
    target = Path(path)
    if target.parent and not target.parent.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    os.replace(temporary, target)
