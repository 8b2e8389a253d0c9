"""The documented Ray Serve benchmark (docs/benchmarks.md), run as typed with KVREUSE_BENCH_SMOKE=1 on the
suite's Ray cluster: it deploys one replica, then two under each request router, runs both workloads
through Ray Serve and prints its table. The figures of a smoke run mean nothing; that it runs does."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import ports
import pytest
import ray_cluster

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")

REPO = Path(__file__).resolve().parents[1]


def test_the_documented_ray_benchmark_runs(ray_address: str, tmp_path: Path):
    env = dict(os.environ, KVREUSE_BENCH_SMOKE="1", RAY_ADDRESS=ray_address, TMPDIR=str(tmp_path),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with ports.holding([ray_cluster.SERVE_PORT]):  # its deployments use Serve's proxy: no other one meanwhile
        done = subprocess.run(["bash", "-c", ray_cluster.BENCH_COMMAND], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in ("shared-prefix/one replica", "shared-prefix/kvreuse, 2 replicas", "shared-prefix/pow2, 2 replicas",
                 "multi-turn/kvreuse, 2 replicas", "routing cost per request"):
        assert line in done.stdout, done.stdout[-3000:]
    assert '"failed": 0' in done.stdout and '"failed": 1' not in done.stdout, done.stdout[-3000:]
