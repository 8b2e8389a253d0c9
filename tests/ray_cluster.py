"""The suite's Ray cluster: one head and two worker nodes on this machine, started with ``ray start`` (as users
do) by the ``ray_address`` fixture (tests/conftest.py), the same way under .ci/run and the README's test
command, and stopped at the end of the session.

The cluster is the suite's own: its head listens on a free port (a cluster another run left behind, or a
user's, is never reused or disturbed), every process of it carries ``CLUSTER_MARK`` in its environment
(inherited from ``ray start``), and ``stop`` ends exactly those processes, where ``ray stop`` would end every
Ray process on the machine. ``ray start`` on Linux replaces a loopback --node-ip-address with the machine's
interface address for a multi-node cluster (ray._private.services.resolve_ip_for_localhost), so Ray's own
daemons listen there; kvreuse's sockets (Serve's HTTP proxy, the replicas' KV events) bind where kvreuse says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import ports
from ports import free_port, marked

CLUSTER_MARK = "KVREUSE_TEST_RAY_CLUSTER"
START_TIMEOUT_S = 300  # one `ray start` on a busy 2-core machine
# The commands the docs show (docs/ray.md, docs/benchmarks.md), run as typed on this cluster (RAY_ADDRESS
# names it): the deployment by tests/test_ray_serve.py in a folder where ./qwen05 is the suite's tiny model
# ("auto" finds the cluster), the benchmark by tests/test_ray_bench.py with KVREUSE_BENCH_SMOKE=1. Both use
# Ray Serve's one HTTP proxy on SERVE_PORT: they hold it (tests/ports.py) while they deploy, one at a time.
SERVE_PORT = 8100
SERVE_COMMAND = "kvreuse serve --model ./qwen05 --ray-address auto --num-replicas 2 --max-replicas-per-node 1 --port 8100"
BENCH_COMMAND = "python benchmarks/bench_ray.py --preset smollm2-135m --dtype bfloat16 --temperature 1"
DOCUMENTED_COMMANDS = (SERVE_COMMAND, BENCH_COMMAND)


@dataclass(frozen=True)
class Cluster:
    address: str  # HOST:PORT of the head
    mark: str  # the value of CLUSTER_MARK in its processes' environment


def ray_cli() -> str:
    return shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")


def _ray(args: list[str], env: dict[str, str], what: str) -> None:
    try:
        done = subprocess.run([ray_cli(), *args], env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"{what}: `ray {' '.join(args)}` did not finish in {START_TIMEOUT_S} s:\n"
                           f"{(error.stdout or b'')[-3000:]!r}\n{(error.stderr or b'')[-3000:]!r}") from None
    if done.returncode != 0:
        raise RuntimeError(f"{what}: `ray {' '.join(args)}` exited with status {done.returncode}:\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def start(workers: int = 2) -> Cluster:
    """A head (no CPU: Serve's controller, proxy and the ingress take none, so the engine replicas, one CPU
    each, go to the workers, one per node with --max-replicas-per-node 1) and ``workers`` worker nodes."""
    cluster = Cluster(f"127.0.0.1:{free_port()}", uuid.uuid4().hex)
    env = dict(os.environ, **{CLUSTER_MARK: cluster.mark})
    env.pop("RAY_ADDRESS", None)
    common = ["--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    try:
        _ray(["start", "--head", "--port", cluster.address.rsplit(":", 1)[1], "--num-cpus", "0",
              "--include-dashboard", "false", "--ray-client-server-port", str(free_port()), *common],
             env, "the Ray head")
        for _ in range(workers):
            _ray(["start", "--address", cluster.address, "--num-cpus", "1", *common], env, "a Ray worker node")
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the workers registered with the head
            status = subprocess.run([ray_cli(), "status", "--address", cluster.address], env=env,
                                    capture_output=True, text=True, timeout=60)
            if status.stdout.count(" node_") >= workers + 1:
                return cluster
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster at {cluster.address} has not {workers + 1} nodes after "
                                   f"{START_TIMEOUT_S} s:\n{status.stdout[-3000:]}\n{status.stderr[-3000:]}")
            time.sleep(1)
    except BaseException:
        stop(cluster)
        raise


def stop(cluster: Cluster, grace_s: float = 15.0) -> None:
    """End every process of the cluster (SIGTERM, then SIGKILL after ``grace_s``), and no other."""
    ports.end([process for process in marked(cluster.mark, CLUSTER_MARK) if process.pid != os.getpid()], grace_s)
