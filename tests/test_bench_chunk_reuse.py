"""benchmarks/bench_chunk_reuse.py's pieces that no smoke run shows: the blended teacher-forced distributions
are the engine's own, an unknown mode is a usage error, and the yardsticks count what they say. The smoke run of
the documented command is tests/test_documented_commands.py's."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_chunk_reuse.py"


def load_script():
    return load_benchmark("bench_chunk_reuse")


def run_script(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)


def test_the_blended_teacher_forced_distributions_equal_full_prefills_at_full_recompute(tiny_model: Path) -> None:
    """The KL yardstick of the chunk-reuse modes runs the engine's own blend: recomputing every moved token, its
    distributions are full prefill's (float32), and a pure shift's are not."""
    from kvreuse import LLM

    bench = load_script()
    sections = [bench.Section(f"s{i}", f"Section {i}: " + " ".join(f"word{i}x{j}" for j in range(30))) for i in range(3)]
    reference = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="16MiB", enable_prefix_caching=False)
    seen = reference.engine.inputs.from_messages(bench.conversation(sections, [0, 1, 2], bench.SEEN_QUESTION))
    measured = reference.engine.inputs.from_messages(bench.conversation(sections, [2, 0, 1], "What is s0 about?"))
    answer = bench.greedy_answer(reference, measured, 6)
    full = bench.teacher_forced(reference, measured.token_ids, answer, 4)
    kl = {}
    for fraction in (1.0, 0.0):
        llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="16MiB", chunk_reuse=True,
                  chunk_check_layer=0, chunk_recompute_fraction=fraction)
        bench.timed_first_token(llm, seen)
        kl[fraction] = bench.kl_divergence(full, bench.blend_teacher_forced(llm, measured, answer, 4))
    assert kl[1.0] == pytest.approx(0.0, abs=1e-6) and kl[0.0] > 1e-6


def test_unknown_modes_are_a_usage_error() -> None:
    result = run_script("--modes", "blend")
    assert result.returncode == 2
    assert "unknown --modes ['blend']" in result.stderr and "recompute-30" in result.stderr


def test_yardsticks() -> None:
    bench = load_script()
    assert bench.shared_before_difference([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert bench.shared_before_difference([1, 2, 3], [1, 2, 3]) == 3
    assert bench.shared_before_difference([5], [1, 2]) == 0
    reference = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]), dim=-1)
    assert bench.kl_divergence(reference, reference) == pytest.approx(0.0, abs=1e-7)
    other = torch.log_softmax(torch.tensor([[0.0, 2.0, -1.0], [0.0, 0.0, 0.0]]), dim=-1)
    p = reference[0].exp()
    expected = float((p * (reference[0] - other[0])).sum()) / 2  # the second position agrees: KL 0
    assert bench.kl_divergence(reference, other) == pytest.approx(expected, rel=1e-6)


def test_the_pooled_summary_pools_every_set_against_its_own_yardsticks() -> None:
    bench = load_script()

    def run(ttft: list[float], shared: list[int], kl: list[float]) -> dict:
        return {"ttft_s": ttft, "shared_answer_tokens": shared, "kl": kl}

    def prompt_set(full_ttft: list[float], blend_ttft: list[float], blend_shared: list[int]) -> dict:
        return {"runs": {"full prefill": run(full_ttft, [32, 32], [0.0, 0.0]),
                         "noise floor (float32 compute)": run([1.0, 1.0], [20, 10], [0.001, 0.003]),
                         "chunk reuse: shift": run([0.1, 0.1], [5, 5], [0.1, 0.3]),
                         "chunk reuse: default": run(blend_ttft, blend_shared, [0.02, 0.02])}}

    report = {"sets": {"0": prompt_set([2.0, 4.0], [1.0, 1.0], [10, 20]),
                       "1": prompt_set([1.0, 1.0], [0.3, 0.4], [6, 4])}}
    pooled = bench.pooled_summary(report)
    assert pooled["prompts"] == 4
    default = pooled["runs"]["chunk reuse: default"]
    assert default["ttft_over_full"] == pytest.approx(0.35)  # the median of 0.5, 0.25, 0.3, 0.4
    assert default["shared_mean"] == pytest.approx(10.0)
    assert default["shared_over_floor"] == pytest.approx(10.0 / 15.0)  # the floor's 20, 10, 20, 10
    assert default["shared_sem"] == pytest.approx(statistics.stdev([10, 20, 6, 4]) / 2)
    assert default["kl_over_shift"] == pytest.approx(0.02 / 0.2)
    del report["sets"]["1"]["runs"]["chunk reuse: shift"]
    assert bench.pooled_summary(report) is None  # sets that ran other runs are not pooled
