"""A Ray cluster of one head and two worker nodes on this machine, started with ``ray start`` (as users do).

.ci/run starts it before the suite (``python tests/ray_cluster.py start``) and stops it after; a test run
without one (a developer's machine) has tests/test_ray_serve.py start and stop its own. ``ray start``
on Linux replaces a loopback --node-ip-address with the machine's interface address for a multi-node
cluster (ray._private.services.resolve_ip_for_localhost), so Ray's own daemons listen there; kvreuse's
sockets (Serve's HTTP proxy, the replicas' KV events) bind where kvreuse says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

HEAD_PORT = 6390
# The commands the docs show (docs/ray.md, docs/benchmarks.md), run as typed on this cluster (RAY_ADDRESS
# names it): the deployment by tests/test_ray_serve.py in a folder where ./qwen05 is the suite's tiny model
# ("auto" finds the cluster), the benchmark by tests/test_ray_bench.py with KVREUSE_BENCH_SMOKE=1.
SERVE_COMMAND = "kvreuse serve --model ./qwen05 --ray-address auto --num-replicas 2 --max-replicas-per-node 1 --port 8100"
BENCH_COMMAND = "python benchmarks/bench_ray.py --preset smollm2-135m --dtype bfloat16 --temperature 1"
DOCUMENTED_COMMANDS = (SERVE_COMMAND, BENCH_COMMAND)


def ray_cli() -> str:
    found = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    return found


def start(head_port: int = HEAD_PORT) -> str:
    """Start the cluster; its address (HOST:PORT of the head)."""
    common = ["--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    # The head offers no CPU: Serve's controller, proxy and the ingress take none, so the engine replicas
    # (one CPU each) go to the workers, one per node with --max-replicas-per-node 1.
    subprocess.run([ray_cli(), "start", "--head", "--port", str(head_port), "--num-cpus", "0", "--include-dashboard",
                    "false", *common], check=True, capture_output=True, timeout=120)
    for _ in range(2):
        subprocess.run([ray_cli(), "start", "--address", f"127.0.0.1:{head_port}", "--num-cpus", "1", *common],
                       check=True, capture_output=True, timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the workers registered with the head
        status = subprocess.run([ray_cli(), "status", "--address", f"127.0.0.1:{head_port}"], capture_output=True,
                                text=True, timeout=60)
        if status.stdout.count(" node_") >= 3:
            break
        time.sleep(1)
    return f"127.0.0.1:{head_port}"


def stop() -> None:
    subprocess.run([ray_cli(), "stop", "--force"], capture_output=True, timeout=120)


if __name__ == "__main__":
    if sys.argv[1:2] == ["start"]:
        print(start(int(sys.argv[2]) if len(sys.argv) > 2 else HEAD_PORT))
    elif sys.argv[1:2] == ["stop"]:
        stop()
    else:
        raise SystemExit("usage: python tests/ray_cluster.py start [HEAD_PORT] | stop")
