"""Shared fixtures: tiny model folders made by ``kvreuse make-model`` (no network, ever)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session", autouse=True)
def _offline_and_private_cache(tmp_path_factory: pytest.TempPathFactory):
    """Tests never reach a hub, and trained tokenizers / models go to a throwaway cache."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("KVREUSE_CACHE_DIR", str(tmp_path_factory.mktemp("kvreuse-cache")))
    # Every engine the suite starts (servers and CLI runs included) stays on plain F.linear: measuring
    # the CPU kernels of real-shaped models in each fresh cache dir would cost the suite minutes on a
    # busy 2-core machine and make its numerics depend on the machine. tests/test_linear_kernels.py
    # tests the measured choice and the other kernels against plain.
    os.environ.setdefault("KVREUSE_LINEAR_KERNEL", "plain")
    # Processes the tests start (servers, CLI runs) use one OpenMP thread: they run beside this process
    # and the documented-command runs on 2 cores, where torch's second thread mostly spins waiting for a
    # core (the suite's CPU time fell by a third). This process keeps its threads: torch read the
    # variable when it was imported, and tests/test_linear_kernels.py needs two for the split kernels.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, _offline_and_private_cache) -> dict[str, Path]:
    """One float32 tiny model folder per supported architecture."""
    from kvreuse.models.make import make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, preset="tiny", arch=arch, dtype="float32", seed=1) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen2"]


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """The Ray cluster the Ray Serve tests deploy on: .ci/run's (RAY_ADDRESS), else one started here with
    ``ray start`` (one head, two workers: tests/ray_cluster.py) and stopped at the end of the session."""
    import ray_cluster

    address = os.environ.get("RAY_ADDRESS")
    if address:
        yield address
        return
    address = ray_cluster.start()
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        del os.environ["RAY_ADDRESS"]
        ray_cluster.stop()
