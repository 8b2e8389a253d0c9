"""A decode step's element-wise kernels (kernels/csrc/fused_ops.cpp) against the PyTorch ops they replace, one run.

For each kernel, on a model's shapes (--preset, default qwen2.5-0.5b: hidden 896, intermediate 4,864,
vocabulary 151,936) at 1 and 16 rows (one stream, 16 streams): the median time of --repeats calls of the
kernel and of its PyTorch reference, interleaved in rounds so the machine's drift hits both alike, and
the ratio. The kernels: the RMSNorm with its residual add, SiLU-and-multiply, and greedy sampling's
argmax over the vocabulary (``fused_ops.argmax`` against ``torch.argmax``). Each pair's outputs are
checked equal first (argmax bit for bit, the others within float rounding).

    python benchmarks/bench_fused_ops.py --json-out fused_ops.json

KVREUSE_BENCH_SMOKE=1 runs the tiny preset's shapes with a few calls and prints the same table: the
suite runs the documented command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvreuse.bench.report import machine_description
from kvreuse.kernels import fused_ops
from kvreuse.model_tools.make_model import PRESETS


def timed(fn: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def compare(kernel: Callable[[], object], reference: Callable[[], object], rounds: int,
            calls: int) -> tuple[float, float]:
    """Median seconds per call of each, over ``rounds`` interleaved rounds of ``calls`` calls."""
    for fn in (kernel, reference):
        timed(fn, 3)
    kernel_s, reference_s = [], []
    for _ in range(rounds):
        kernel_s.append(timed(kernel, calls))
        reference_s.append(timed(reference, calls))
    return statistics.median(kernel_s), statistics.median(reference_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20, help="calls per round")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":
        print("KVREUSE_BENCH_SMOKE=1: the tiny preset's shapes, a few calls; the figures mean nothing")
        args.preset, args.rounds, args.calls = "tiny", 2, 2
    if not fused_ops.available():
        print("the fused kernels did not build here: nothing to compare", file=sys.stderr)
        return 1
    preset = PRESETS[args.preset]
    hidden, intermediate = preset.hidden_size, preset.intermediate_size
    vocab = preset.vocab_size or preset.tokenizer_vocab_size  # the tiny preset's is its tokenizer's
    machine = machine_description()
    print(f"{args.preset}: hidden {hidden}, intermediate {intermediate}, vocabulary {vocab}; float32, "
          f"{torch.get_num_threads()} threads; {machine.get('cpu')}, flags {' '.join(machine.get('cpu_flags') or [])}")
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"{'kernel':<22}{'rows':>5}{'kernel us':>12}{'torch us':>12}{'torch / kernel':>16}")
    for rows in (1, 16):
        x = torch.randn(rows, hidden, generator=generator)
        residual = torch.randn(rows, hidden, generator=generator)
        weight = 1 + 0.1 * torch.randn(hidden, generator=generator)
        gate_up = 3 * torch.randn(rows, 2 * intermediate, generator=generator)
        logits = 4 * torch.randn(rows, vocab, generator=generator)
        torch.testing.assert_close(fused_ops.silu_mul(gate_up), fused_ops.reference_silu_mul(gate_up.clone()))
        assert torch.equal(fused_ops.argmax(logits), logits.argmax(dim=-1))
        cases = {
            # The residual stream is updated in place by both; its values grow, which costs neither more.
            "rms_norm + residual": (lambda: fused_ops.rms_norm(x, weight, 1e-6, residual),
                                    lambda: fused_ops.reference_rms_norm(x, weight, 1e-6, residual)),
            "silu_mul": (lambda: fused_ops.silu_mul(gate_up),
                         lambda: fused_ops.reference_silu_mul(gate_up.clone())),
            "argmax (sampler)": (lambda: fused_ops.argmax(logits), lambda: logits.argmax(dim=-1)),
        }
        for name, (kernel, reference) in cases.items():
            kernel_s, reference_s = compare(kernel, reference, args.rounds, args.calls)
            rows_out.append({"kernel": name, "rows": rows, "kernel_us": kernel_s * 1e6,
                             "torch_us": reference_s * 1e6})
            print(f"{name:<22}{rows:>5}{kernel_s * 1e6:>12.1f}{reference_s * 1e6:>12.1f}"
                  f"{reference_s / kernel_s:>15.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"preset": args.preset, "machine": machine, "rounds": args.rounds,
                                                   "calls": args.calls, "results": rows_out}, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
