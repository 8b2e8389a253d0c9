"""Summaries of a benchmark run: latency distributions, throughput, cache hit rate, errors; the
printed table and the JSON document (every request included)."""

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

from kvreuse.bench.client import BenchmarkRun

REPORT_VERSION = 1


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def error_kind(message: str) -> str:
    """A short class for counting: 'HTTP 500', 'connection: RemoteProtocolError', 'timeout', ..."""
    head = message.split(":", 2)
    if message.startswith("connection:") and len(head) > 1:
        return "connection:" + head[1]
    return head[0]


def summarize(run: BenchmarkRun) -> Summary:
    results = run.results
    ok = [result for result in results if result.success]
    prompt_tokens = sum(result.prompt_tokens or 0 for result in ok)
    cached_tokens = sum(result.cached_tokens for result in ok)
    output_tokens = sum(result.output_tokens for result in ok)
    reported = sum(1 for result in ok if result.cached_tokens_reported)
    with_ideal = [result for result in ok if result.ideal_cached_tokens is not None and result.prompt_tokens]
    ideal_prompt = sum(result.prompt_tokens or 0 for result in with_ideal)
    duration = max(run.duration_s, 1e-9)
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
    lines.append(f"{'latency (ms)':<16}{'mean':>11}{'median':>11}{'p90':>11}{'p99':>11}{'max':>12}".ljust(width))
    for label, distribution in (("TTFT", summary.ttft), ("TPOT", summary.tpot), ("ITL", summary.itl),
                                ("E2E", summary.e2e)):
        if distribution is None:
            lines.append(f"{label:<16}{'-':>11}")
            continue
        lines.append(f"{label:<16}{_ms(distribution.mean):>11}{_ms(distribution.median):>11}"
                     f"{_ms(distribution.p90):>11}{_ms(distribution.p99):>11}{_ms(distribution.max):>12}")
    lines.append("=" * width)
    return "\n".join(lines)


def machine_description() -> dict[str, Any]:
    """Cores, CPU model, memory and accelerator of this machine (the client's; a compare run starts
    its servers here too)."""
    cpu = platform.processor() or platform.machine()
    memory_gib = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
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
    return {"cores": cores, "cpu": cpu, "memory_gib": memory_gib, "gpu": accelerator, "torch": torch_version,
            "python": platform.python_version()}


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
