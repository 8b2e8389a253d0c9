"""Shared fixtures: tiny model folders made by ``kvreuse make-model`` (no network, ever)."""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


_PRIVATE_CACHE: str | None = None  # the throwaway cache this session made (removed at its end)
_LOCK_DIR: str | None = None  # where the xdist workers' lock files go (removed at the end)


def pytest_configure(config: pytest.Config) -> None:
    """Before collection (test modules ask at import whether a kernel builds, and a kernel library, once
    loaded, stays where it was loaded from): tests never reach a hub, trained tokenizers, models and the
    C++ kernels go to a throwaway cache, and every kernel is built there once (``_build_cpu_kernels``)."""
    global _PRIVATE_CACHE, _LOCK_DIR
    if not hasattr(config, "workerinput"):  # the controller (or a serial run): the xdist workers inherit it
        _LOCK_DIR = tempfile.mkdtemp(prefix="kvreuse-test-locks-")
        os.environ["KVREUSE_TEST_LOCK_DIR"] = _LOCK_DIR
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if "KVREUSE_CACHE_DIR" not in os.environ:
        _PRIVATE_CACHE = tempfile.mkdtemp(prefix="kvreuse-cache-")
        os.environ["KVREUSE_CACHE_DIR"] = _PRIVATE_CACHE
    # Every engine the suite starts (servers and CLI runs included) stays on plain F.linear unless a test clears
    # this: measuring the CPU kernels of real-shaped models in each fresh cache dir would cost the suite minutes
    # on a busy 2-core machine and make its numerics depend on the machine. tests/test_linear_kernels.py tests
    # the measured choice and the other kernels against plain; the real model's default path runs end to end in
    # tests/test_gguf.py (in process and through kvreuse demo), and batch-invariant mode's in
    # tests/test_batch_invariance.py.
    os.environ.setdefault("KVREUSE_LINEAR_KERNEL", "plain")
    # Without a GPU the Triton kernels' tests run them in Triton's interpreter, which works only if the variable is
    # set before anything imports triton (triton.language's own helpers are otherwise compiled-only): so here,
    # before any test module is imported.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    config.addinivalue_line("markers", "alone: under pytest-xdist, run while no other worker runs a test "
                                       "(tests that a busy CPU would fail)")
    _build_cpu_kernels()


# The modules that share one worker when pytest-xdist runs the suite on several (pyproject's addopts): the Ray
# Serve tests must (one cluster, the session's ray_address fixture of that worker, whose Serve proxy keeps port
# 8100); the documented commands need not (tests/ports.py holds a fixed port across workers), but as one group
# with them they make the suite's longest batch, which xdist hands out first.
ONE_WORKER_MODULES = ("test_documented_commands.py", "test_ray_serve.py", "test_ray_bench.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``), each module is one group, so its module-scoped servers and
    fixtures start once, on one worker; ONE_WORKER_MODULES are one group (xdist hands out the groups with
    the most tests first: that one, the longest batch of the suite, starts at once)."""
    if not hasattr(config, "workerinput"):  # not an xdist worker (a serial run, or the controller)
        return
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("one-worker" if name in ONE_WORKER_MODULES else name))


@contextmanager
def _cpu_turn(exclusive: bool) -> Iterator[None]:
    """A readers-writer lock over the workers of one xdist run (two files in the lock folder the controller
    made for this run): a test marked ``alone`` runs while no other worker runs a test; the others share.
    The turnstile keeps a waiting ``alone`` test from being passed by the other worker's next tests."""
    folder = Path(os.environ["KVREUSE_TEST_LOCK_DIR"])
    with open(folder / "turnstile", "a") as turnstile, open(folder / "lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(lock, fcntl.LOCK_EX)  # waits for the other worker's running test to end
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist, a test marked ``alone`` (what a busy core would fail: a replica killed while it
    still has tokens to produce, a spill that needs requests to pile up) runs with the other worker
    between tests; its setup and teardown included."""
    if "PYTEST_XDIST_TESTRUNUID" not in os.environ:
        yield
        return
    with _cpu_turn(item.get_closest_marker("alone") is not None):
        yield


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in (_PRIVATE_CACHE, _LOCK_DIR):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _offline_and_private_cache():
    """What pytest_configure set, and one OpenMP thread for the processes the tests start."""
    # Processes the tests start (servers, CLI runs) use one OpenMP thread: they run beside this process
    # and the documented-command runs on 2 cores, where torch's second thread mostly spins waiting for a
    # core (the suite's CPU time fell by a third). This process keeps its threads: torch read the
    # variable when it was imported, and tests/test_linear_kernels.py needs two for the split kernels.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield


def _build_cpu_kernels() -> None:
    """Every C++ kernel built into the session's cache now, once, before any test or process it starts needs
    one: otherwise the first engines to start build them side by side (each waiting on the others' locks), and
    a cache made fresh for a test rebuilds them all (minutes of the suite on 2 cores). A cache made fresh
    links its ``kernels`` here instead (``fresh_cache_dir``)."""
    if os.environ.get("KVREUSE_TEST_NO_CPU_KERNELS") == "1":
        return  # benchmarks/gpu_checks.sh: its tests run on CUDA, and a lent GPU's minutes are few
    from concurrent.futures import ThreadPoolExecutor

    from kvreuse.kernels import (
        decoder_layer,
        fused_ops,
        gated_delta,
        kv_codec,
        mamba2_scan,
        moe,
        paged_attention,
        qpacked,
        quant_ops,
        rowdot,
    )

    # Each library is one C++ file, one compiler process: two at a time keeps both cores of a CI machine busy
    # (one at a time left one idle for minutes). The ones that load the others' (decoder_layer, moe) come after
    # them; no library() is called twice at once (each caches its result, unlocked).
    failed = []
    for wave in ((quant_ops, paged_attention, rowdot, fused_ops, kv_codec, qpacked, gated_delta, mamba2_scan),
                 (decoder_layer, moe)):
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            failed += [module.__name__ for module, built in zip(wave, pool.map(lambda module: module.library(), wave))
                       if built is None]
    # Where a C++ compiler exists, a kernel that stops building fails the suite here (its tests would otherwise
    # skip, and the engine would quietly fall back to slower paths): the build's last line is in the log above.
    if failed and kernels_can_build():
        raise pytest.UsageError(f"the C++ kernels of {', '.join(failed)} did not build here, though a compiler "
                                f"exists (see the warning above)")


def kernels_can_build() -> bool:
    """Whether this machine builds kvreuse's C++ kernels: Linux on x86-64 or aarch64 with a C++ compiler."""
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
            and shutil.which(os.environ.get("CXX", "c++")) is not None)


def fresh_cache_dir(cache: Path) -> Path:
    """``cache`` as a cold kvreuse cache (no tokenizers, models or plans) that shares the session's built C++
    kernels: tests of what a cold cache does are not about building kernels (test_quant_kernels.py,
    test_rowdot.py and test_linear_kernels.py build them in their own folders on purpose)."""
    from kvreuse.config import cache_dir

    cache.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
    return cache


@contextmanager
def cold_cache_env(cache: Path) -> Iterator[Path]:
    """KVREUSE_CACHE_DIR set to a fresh cache (``fresh_cache_dir``) and no network, restored after."""
    fresh_cache_dir(cache)
    saved = {key: os.environ.get(key) for key in ("KVREUSE_CACHE_DIR", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({"KVREUSE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    try:
        yield cache
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, _offline_and_private_cache) -> dict[str, Path]:
    """One float32 tiny model folder per supported architecture."""
    from kvreuse.model_tools.make_model import make_model

    root = tmp_path_factory.mktemp("models")
    models = {arch: make_model(root / arch, preset="tiny", arch=arch, dtype="float32", seed=1) for arch in ARCHS}
    # The architectures with their own presets: experts, Gemma 3's windows (16 tokens) and norms, and gpt-oss's
    # windows (16 tokens) with sinks, biases, YaRN and clamped experts.
    for arch, preset in (("qwen3_moe", "tiny-moe"), ("gemma3", "tiny-gemma3"), ("gpt_oss", "tiny-gpt-oss")):
        models[arch] = make_model(root / arch, preset=preset, dtype="float32", seed=1)
    return models


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen2"]


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """The Ray cluster the Ray Serve tests deploy on: the suite's own (one head, two workers, started with
    ``ray start`` on a free head port: tests/ray_cluster.py), the same under .ci/run and the README's test
    command, never a cluster the environment names; stopped (its processes only) at the end of the session."""
    import ray_cluster

    cluster = ray_cluster.start()
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        yield cluster.address
    finally:
        if saved is None:
            del os.environ["RAY_ADDRESS"]
        else:
            os.environ["RAY_ADDRESS"] = saved
        ray_cluster.stop(cluster)
