#!/usr/bin/env bash
# Everything a session lent an NVIDIA GPU runs for the CUDA path, in one command (GPU time is short):
#   1. benchmarks/bench_cuda.py: torch_eager (what ran before issue 40) and triton_graphs (the default) side by
#      side on the qwen2.5-0.5b preset in bfloat16, then transformers (BENCH_ARGS adds options, e.g. the
#      correctness section is skipped here because the tests below hold it);
#   2. the GPU tests: tests/test_cuda.py (greedy equals transformers for every architecture with the CUDA defaults,
#      graphs equal eager and the torch reference, invariants after every step) and tests/test_triton_backend.py,
#      on the compiled kernels (CI runs the latter through Triton's interpreter).
# Results go to $OUT (default gpu-out/): machine.txt, bench.log, cuda.json, tests.log.
#
#   bash benchmarks/gpu_checks.sh
#
# Wheels the GPU machine lacks (llguidance) may sit in .whl/ beside it; they are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
timeout "${BENCH_SECONDS:-170}" python3 benchmarks/bench_cuda.py --json "$OUT/cuda.json" \
    ${BENCH_ARGS:---skip-correctness --configs torch_eager,triton_graphs --repeats 2} 2>&1 | tee "$OUT/bench.log"
# The tests run on CUDA: the CPU kernels the suite prebuilds are not needed (tests/conftest.py).
KVREUSE_TEST_NO_CPU_KERNELS=1 timeout "${TEST_SECONDS:-130}" python3 -m pytest -p no:cacheprovider -n 4 -q \
    tests/test_cuda.py tests/test_triton_backend.py 2>&1 | tee "$OUT/tests.log"
