"""benchmarks/bench_chunk_reuse.py's pieces that no smoke run shows: the chunk-reuse modes not built yet are
refused with a message (never stand-in figures), and the yardsticks count what they say. The smoke run of
the documented command is tests/test_documented_commands.py's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_chunk_reuse.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_chunk_reuse", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


def run_script(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)


def test_modes_not_built_exit_saying_so() -> None:
    result = run_script("--modes", "shift,recompute-15")
    assert result.returncode == 1
    assert "'shift'" in result.stderr and "'recompute-15'" in result.stderr
    assert "not implemented yet" in result.stderr
    assert "prompt set" not in result.stdout  # refused before anything was measured


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
