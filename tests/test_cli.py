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


def test_only_the_named_subcommand_is_imported():
    """`kvreuse route`, `kvreuse diagnose` and `kvreuse --help` parse without importing torch (the router
    and the offline diagnosis never need it); every sub-command still parses its own options."""
    probe = (
        "import sys\n"
        "from kvreuse.cli import build_parser\n"
        "for only, words in (('', ['--help']), ('route', ['route', '--backend', 'http://a:1']),\n"
        "                    ('diagnose', ['diagnose', 'log.jsonl', '--tokenizer', 't'])):\n"
        "    parser, _ = build_parser(only=only)\n"
        "    if only:\n"
        "        args = parser.parse_args(words)\n"
        "        print(only, args.command, getattr(args, 'backend', None) or args.tokenizer)\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("no torch"), result.stdout
    assert "route route ['http://a:1']" in result.stdout and "diagnose diagnose t" in result.stdout
    help_text = run_cli("--help", timeout=60)
    assert help_text.returncode == 0 and "distill-eagle" in help_text.stdout
    # Each sub-command's own --help: test_documented_commands.py::test_subcommand_help.
    wrong = run_cli("serve", "--model", "m", "--no-such-option", timeout=120)
    assert wrong.returncode == 2 and "--no-such-option" in wrong.stderr
    # A bad --stream-interval is named before the model loads (the model "m" does not exist).
    bad = run_cli("serve", "--model", "m", "--stream-interval", "0", timeout=120)
    assert bad.returncode == 2 and "stream_interval must be >= 1" in bad.stderr, bad.stderr
