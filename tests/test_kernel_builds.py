"""The suite stops where a C++ kernel fails to build on a machine that can build them (issue 64): otherwise the
kernel's tests skip, the engine falls back to slower paths with one warning, and everything stays green."""

from __future__ import annotations

import os

import conftest
import pytest

from kvreuse.kernels import fused_ops


@pytest.mark.skipif(not conftest.kernels_can_build() or os.environ.get("KVREUSE_TEST_NO_CPU_KERNELS") == "1",
                    reason="no C++ compiler here (or a CUDA run that builds none): the kernels are not expected")
def test_a_kernel_that_does_not_build_stops_the_suite(monkeypatch):
    conftest._build_cpu_kernels()  # every library built (cached): nothing to say
    monkeypatch.setattr(fused_ops, "library", lambda: None)  # as a failed build leaves it
    with pytest.raises(pytest.UsageError, match="kvreuse.kernels.fused_ops did not build"):
        conftest._build_cpu_kernels()
