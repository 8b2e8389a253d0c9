"""Real server processes for tests: start ``python -m kvreuse.cli serve`` on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvreuse.bench.compare import wait_healthy

# For helpers that poll a server in a loop: every new httpx client (httpx.get makes one per call) builds an
# SSL context, ~40 ms of CPU, which a loop polling every 50 ms turns into a busy core.
POLL = httpx.Client(timeout=30)
MODEL_NAME = "tiny-qwen2"
SERVER_OPTIONS = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "32MiB")


@dataclass
class RunningServer:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: Path, log_path: Path, *extra_args: str, port: int | None = None) -> RunningServer:
    """A server on ``port`` (default: a free one), once its /health answers 200."""
    port = port or free_port()
    command = [sys.executable, "-m", "kvreuse.cli", "serve", "--model", str(model_dir), *SERVER_OPTIONS,
               "--port", str(port), "--served-model-name", MODEL_NAME, *extra_args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server.base_url, process, 120, server.log_tail, interval_s=0.1)
    except RuntimeError:
        process.kill()
        raise
    return server


def stop_server(server: RunningServer) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


