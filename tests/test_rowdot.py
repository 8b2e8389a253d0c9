"""The row-dot GEMV (kernels/rowdot.py, kernels/csrc/rowdot.cpp): built here, equal to F.linear within float
tolerance, traced by torch.compile, refusing bad input, and optional where no compiler builds it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvreuse.kernels import build, rowdot
from kvreuse.layers import plan_book

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                    reason="no C++ compiler to build the row-dot kernel")


@pytest.fixture(scope="module")
def built() -> Path:
    """The library this process loaded (built in whichever cache dir the first caller had set)."""
    library = rowdot.library()
    assert library is not None and library.is_file(), "the row-dot kernel did not build (see the log)"
    return library


@needs_compiler
@pytest.mark.parametrize("dtype", rowdot.DTYPES, ids=str)
@pytest.mark.parametrize("group", rowdot.GROUPS)
@pytest.mark.parametrize("shape", [(37, 83), (96, 80), (8, 16), (5, 7), (1030, 300)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_rowdot_matches_f_linear(built, dtype, group, shape):
    """Shapes with and without a vector tail (83, 7 features; bf16 steps 32 at a time on AVX512-BF16),
    output rows that do not fill a pass of 8, a single pass, and enough rows for both threads; 0 to 17
    input rows."""
    torch.manual_seed(0)
    weight = torch.randn(*shape).to(dtype)
    # Against the exact product of the same (rounded) inputs: a float32 sum of up to 300 products of
    # N(0, 1) values (outputs ~17) is off by ~1e-5 in another order; a bf16 output is that sum rounded
    # once (half a step: 2**-9 relative). A dropped tail or a wrong row would be off by ~1.
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2**-8, 1e-3)

    def check(x: torch.Tensor) -> None:
        got = rowdot.rowdot(x, weight, group)
        assert got.dtype == dtype and got.shape == (x.shape[0], shape[0])
        expected = F.linear(x.double(), weight.double())
        torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol)

    for rows in (0, 1, 2, 5, 17):
        check(torch.randn(rows, shape[1]).to(dtype))
    check(torch.randn(shape[1], 3).to(dtype).t())  # a non-contiguous input (a transposed view)


@needs_compiler
def test_rowdot_refuses_bad_input(built):
    weight = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16, got BFloat16 and Float"):
        rowdot.rowdot(torch.randn(1, 32, dtype=torch.bfloat16), weight, 1)
    with pytest.raises(RuntimeError, match="got Half and Half"):
        rowdot.rowdot(torch.randn(1, 32, dtype=torch.float16), weight.half(), 1)
    with pytest.raises(RuntimeError, match="x has 31 features, weight expects 32"):
        rowdot.rowdot(torch.randn(1, 31), weight, 1)
    with pytest.raises(RuntimeError, match="group must be 1 or 8, got 3"):
        rowdot.rowdot(torch.randn(1, 32), weight, 3)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, in\]"):
        rowdot.rowdot(torch.randn(32), weight, 1)


@needs_compiler
def test_rowdot_under_torch_compile(built):
    """The op has a fake implementation, so a fullgraph compile with inductor's C++ wrapper (as the
    compiled decode uses) traces it and calls it, with pointwise work fused around it."""
    torch.manual_seed(0)
    weight, x = torch.randn(40, 24), torch.randn(3, 24)

    def step(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.relu(rowdot.rowdot(x * 2, weight, 8)) + 1

    compiled = torch.compile(step, fullgraph=True, options={"cpp_wrapper": True})
    torch.testing.assert_close(compiled(x, weight), step(x, weight))
    torch.testing.assert_close(compiled(x, weight), torch.relu(F.linear(x * 2, weight)) + 1, rtol=1e-5, atol=1e-5)


def test_build_name_follows_the_cpu(monkeypatch):
    """Code built with -march=native for one CPU must not load on another sharing the cache dir."""
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma"}))
    avx2 = rowdot.build_name()
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma", "avx512f"}))
    assert rowdot.build_name() != avx2 and rowdot.build_name().startswith("kvreuse_rowdot_")


def test_without_a_compiler_the_library_kernels_remain(tmp_path):
    """A fresh process whose compiler fails: the build is refused with one warning, the planner offers
    only the library kernels, and an engine-shaped measurement still runs."""
    script = (
        "import torch\n"
        "from kvreuse.kernels import rowdot\nfrom kvreuse.layers import plan_book\n"
        "assert not rowdot.available()\n"
        "names = plan_book.runnable_kernels(torch.float32, (512, 512))\n"
        "assert 'plain' in names and not {'rowdot', 'rowdot8'} & set(names), names\n"
        "times = plan_book.measure(512, 512, torch.float32, names, (1, 2))\n"
        "assert set(times) == set(names)\n"
        "print('fallback ok')\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "KVREUSE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fallback ok" in result.stdout
    assert "the row-dot GEMV could not be built" in result.stderr
    assert not list((tmp_path / "kernels").glob("*/*.so"))


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


@needs_compiler
def test_a_built_kernel_loads_without_the_compiler(built):
    """Once built in a cache dir, a later process loads the library directly: even with a failing
    compiler it runs (the build's name already digests source, flags, torch and CPU)."""
    script = ("import torch\nfrom kvreuse.kernels import rowdot\nassert rowdot.available()\n"
              "x, w = torch.randn(2, 40), torch.randn(24, 40)\n"
              "torch.testing.assert_close(rowdot.rowdot(x, w, 8), x @ w.t(), rtol=1e-5, atol=1e-5)\n")
    _run(script, {"CXX": "/bin/false", "KVREUSE_CACHE_DIR": str(built.parents[2])})  # <cache>/kernels/<name>/


def test_an_engine_forced_onto_a_library_kernel_never_builds(tmp_path):
    """KVREUSE_LINEAR_KERNEL=<a library kernel> (as the suite's engines run) asks only about that kernel:
    no build is tried, so no compiler time at start-up."""
    script = ("import torch\nfrom kvreuse.layers import plan_book\n"
              "plan = plan_book.PlanBook().plan_for(torch.float32, (512, 512))\n"
              "assert plan == plan_book.LinearPlan.single('transposed'), plan\n")
    result = _run(script, {"CXX": "/bin/false", "KVREUSE_CACHE_DIR": str(tmp_path),
                           plan_book.KERNEL_ENV: "transposed"})
    assert "row-dot" not in result.stderr and not (tmp_path / "kernels").exists()
