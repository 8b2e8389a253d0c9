"""PNG plots of benchmark runs (matplotlib, Agg backend: no display needed).

``plot_run``: the TTFT distribution, TTFT of each request against when it was sent (coloured by the
share of its prompt served from cache, so cold requests stand out) and the hit rate.
``plot_comparison``: the same TTFT distribution for several systems, their median TTFT, throughput
and hit rate side by side. Figures are sized so the PNG stays well under 150 KB.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvreuse.bench.client import RequestResult
from kvreuse.bench.report import Summary

DPI = 90
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(index + 1) / len(ordered) for index in range(len(ordered))]


def _plain_log_ticks(axis: Any) -> None:
    """Log-scale ticks as plain numbers (120, not 1.2x10^2)."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    # Minor ticks labelled at 2x and 5x only, so a decade carries three labels, not nine.
    axis.set_minor_formatter(FuncFormatter(
        lambda value, _: f"{value:g}" if value > 0 and f"{value:e}"[0] in "25" else ""))


def _save(figure: Any, path: str | os.PathLike[str]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    figure.savefig(temporary, dpi=DPI, format="png")
    os.replace(temporary, target)


def plot_run(results: Sequence[RequestResult], summary: Summary, title: str, path: str | os.PathLike[str]) -> None:
    plt = _pyplot()
    ok = [result for result in results if result.success and result.ttft_s is not None]
    figure, (histogram, timeline, rates) = plt.subplots(1, 3, figsize=(13, 3.8),
                                                        gridspec_kw={"width_ratios": [1.2, 1.4, 0.7]})
    figure.suptitle(title, fontsize=9)
    ttfts_ms = [result.ttft_s * 1000 for result in ok]  # type: ignore[operator]
    if ttfts_ms:
        histogram.hist(ttfts_ms, bins=min(40, max(5, len(ttfts_ms) // 2)), color=COLORS[0], alpha=0.75)
        for label, value, style in (("median", summary.ttft.median if summary.ttft else None, "--"),
                                    ("p90", summary.ttft.p90 if summary.ttft else None, ":")):
            if value is not None:
                histogram.axvline(value * 1000, color="black", linestyle=style, linewidth=1,
                                  label=f"{label} {value * 1000:.0f} ms")
        histogram.legend(fontsize=8)
    histogram.set_xlabel("TTFT (ms)")
    histogram.set_ylabel("requests")
    histogram.set_title("TTFT distribution", fontsize=9)

    if ok:
        fractions = [result.cached_tokens / result.prompt_tokens if result.prompt_tokens else 0.0 for result in ok]
        points = timeline.scatter([result.start_s for result in ok], ttfts_ms, c=fractions, cmap="viridis",
                                  vmin=0, vmax=1, s=18)
        colorbar = figure.colorbar(points, ax=timeline)
        colorbar.set_label("cached share of prompt", fontsize=8)
    timeline.set_yscale("log")
    _plain_log_ticks(timeline.yaxis)
    timeline.set_xlabel("sent at (s from start)")
    timeline.set_ylabel("TTFT (ms, log)")
    timeline.set_title("TTFT per request", fontsize=9)

    labels, values = [], []
    if summary.cache_hit_rate is not None:
        labels.append("measured")
        values.append(summary.cache_hit_rate)
    if summary.ideal_hit_rate is not None:
        labels.append("ideal")
        values.append(summary.ideal_hit_rate)
    if values:
        bars = rates.bar(labels, values, color=COLORS[: len(values)])
        for bar, value in zip(bars, values):
            rates.text(bar.get_x() + bar.get_width() / 2, value + 0.02, f"{value:.1%}", ha="center", fontsize=8)
    else:
        rates.text(0.5, 0.5, "cached tokens\nnot reported", ha="center", va="center", transform=rates.transAxes)
    rates.set_ylim(0, 1.1)
    rates.set_title("prefix cache hit rate", fontsize=9)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)


def plot_comparison(systems: Sequence[tuple[str, Sequence[RequestResult], Summary]], title: str,
                    path: str | os.PathLike[str]) -> None:
    """One entry per system: (label, its results, its summary)."""
    plt = _pyplot()
    figure, (cdf, ttft_bars, throughput_bars, rates) = plt.subplots(
        1, 4, figsize=(14, 3.8), gridspec_kw={"width_ratios": [1.6, 1, 1, 1]})
    figure.suptitle(title, fontsize=9)
    labels = [label for label, _, _ in systems]
    colors = [COLORS[index % len(COLORS)] for index in range(len(systems))]
    for (label, results, _), color in zip(systems, colors):
        ttfts = [result.ttft_s * 1000 for result in results if result.success and result.ttft_s is not None]
        if ttfts:
            xs, ys = _ecdf(ttfts)
            cdf.step(xs, ys, where="post", label=label, color=color)
    cdf.set_xscale("log")
    _plain_log_ticks(cdf.xaxis)
    cdf.set_xlabel("TTFT (ms, log)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT distribution (CDF)", fontsize=9)
    cdf.legend(fontsize=8)

    def bars(axis: Any, values: list[float | None], heading: str, fmt: str) -> None:
        heights = [value or 0.0 for value in values]
        drawn = axis.bar(range(len(values)), heights, color=colors)
        top = max(heights) if heights else 0.0
        for bar, value in zip(drawn, values):
            text = "-" if value is None else format(value, fmt)
            axis.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + top * 0.02, text, ha="center", fontsize=8)
        axis.set_xticks(range(len(values)), labels, rotation=20, fontsize=8, ha="right")
        axis.set_ylim(0, top * 1.15 if top else 1)
        axis.set_title(heading, fontsize=9)

    bars(ttft_bars, [summary.ttft.median * 1000 if summary.ttft else None for _, _, summary in systems],
         "median TTFT (ms)", ".0f")
    bars(throughput_bars, [summary.output_throughput for _, _, summary in systems], "output tokens/s", ".1f")
    bars(rates, [summary.cache_hit_rate for _, _, summary in systems], "cache hit rate", ".1%")
    rates.set_ylim(0, 1.1)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)


def plot_turns(systems: Sequence[tuple[str, Summary]], title: str, path: str | os.PathLike[str]) -> None:
    """Per-turn hit rate and median TTFT of each system (workloads with turns: multi-turn, agent)."""
    plt = _pyplot()
    import textwrap

    figure, (rates, ttfts) = plt.subplots(1, 2, figsize=(11, 4))
    figure.suptitle("\n".join(textwrap.fill(line, 160) for line in title.splitlines()), fontsize=8)
    for index, (label, summary) in enumerate(systems):
        color = COLORS[index % len(COLORS)]
        turns = [turn for turn in summary.turns if turn.completed]
        rated = [turn for turn in turns if turn.hit_rate is not None]
        if rated:
            rates.plot([turn.turn for turn in rated], [turn.hit_rate for turn in rated], marker="o", color=color,
                       label=label)
        timed = [turn for turn in turns if turn.ttft_median_s is not None]
        if timed:
            ttfts.plot([turn.turn for turn in timed],
                       [turn.ttft_median_s * 1000 for turn in timed],  # type: ignore[operator]
                       marker="o", color=color, label=label)
    rates.set_ylim(0, 1.05)
    rates.set_xlabel("turn")
    rates.set_title("hit rate per turn (cached / prompt tokens)", fontsize=9)
    rates.legend(fontsize=8)
    ttfts.set_yscale("log")
    _plain_log_ticks(ttfts.yaxis)
    ttfts.set_xlabel("turn")
    ttfts.set_ylabel("ms, log")
    ttfts.set_title("median TTFT per turn", fontsize=9)
    ttfts.legend(fontsize=8)
    for axis in (rates, ttfts):
        axis.xaxis.get_major_locator().set_params(integer=True)
    figure.tight_layout()
    _save(figure, path)
    plt.close(figure)
