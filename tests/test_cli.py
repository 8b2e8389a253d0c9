"""The command line as a user runs it: ``kvreuse make-model`` and ``kvreuse demo`` in real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvreuse.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_make_model_then_demo_shows_warm_hits(tmp_path: Path):
    out = tmp_path / "model"
    made = run_cli("make-model", str(out), "--preset", "tiny", "--arch", "llama", "--dtype", "float32")
    assert made.returncode == 0, made.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    demo = run_cli("demo", "--model", str(out), "--num-requests", "3", "--max-tokens", "4", "--dtype", "float32",
                   "--kv-cache-memory", "64MiB", "--device", "cpu")
    assert demo.returncode == 0, demo.stderr
    rows = [line.split() for line in demo.stdout.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d+\s+[\d.]+\s", line)]
    assert len(rows) == 3
    prompt_tokens = [int(row[1]) for row in rows]
    cached = [int(row[2]) for row in rows]
    assert cached[0] == 0
    # Later requests reuse the shared system prompt (hundreds of tokens), not just a few tokens.
    assert all(c > 0.8 * p for c, p in zip(cached[1:], prompt_tokens[1:]))
    assert "TTFT cold" in demo.stdout and "hit rate" in demo.stdout


def test_debug_flag_logs_cache_decisions(tmp_path: Path):
    out = tmp_path / "model"
    assert run_cli("make-model", str(out), "--dtype", "float32").returncode == 0
    demo = run_cli("demo", "--model", str(out), "--num-requests", "2", "--max-tokens", "2", "--dtype", "float32",
                   "--kv-cache-memory", "64MiB", "--device", "cpu", "--debug")
    assert demo.returncode == 0, demo.stderr
    assert "reused 0 from the prefix cache" in demo.stderr
    assert re.search(r"reused [1-9]\d* from the prefix cache", demo.stderr)
    assert "KV cache:" in demo.stderr and "bytes per token" in demo.stderr


def test_bad_option_is_a_clear_error(tmp_path: Path):
    out = tmp_path / "model"
    assert run_cli("make-model", str(out), "--dtype", "float32").returncode == 0
    result = run_cli("demo", "--model", str(out), "--kv-cache-memory", "lots", "--device", "cpu")
    assert result.returncode != 0
    assert "kv_cache_memory" in result.stderr and "Traceback" not in result.stderr
