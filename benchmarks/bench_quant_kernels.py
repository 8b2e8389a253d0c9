"""Quantized linear kernels at decode sizes: GB/s of weight streamed per format, qdot beside qdot8, one run.

A decode row's product reads each weight byte once, so its speed is how fast the weight streams: this
prints, for every format this CPU runs, the median time of one [rows, in] x [out, in]^T product on random
blocks (kernels/quant.py's ``random_quantized``) as weight gigabytes per second, for ``qdot`` (the weights
turned to float in registers) and ``qdot8`` (the inputs rounded to int8: per 32 values, per super-block of 256
for the K-quants on AVX512-VNNI, ``quant_ops.int8_group``), at each thread count asked. The weight is larger
than the caches (--out x --in), so the figure is memory plus arithmetic, as in a decode step.

    python benchmarks/bench_quant_kernels.py --out 16384 --in 2048 --threads 1,2

KVREUSE_BENCH_SMOKE=1 runs a small weight with a few calls and prints the same table: the suite runs the
documented command that way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvreuse.kernels import (
    quant,  # noqa: E402
    quant_ops,
)
from kvreuse.kernels.cpu import cpu_flags  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=int, default=16384, help="output features (weight rows)")
    parser.add_argument("--in", dest="in_features", type=int, default=2048, help="input features (multiple of 256)")
    parser.add_argument("--rows", type=int, default=1, help="input rows (decode rows)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--formats", default=",".join(quant.FORMATS))
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":
        print("KVREUSE_BENCH_SMOKE=1: a small weight, a few calls; the figures mean nothing")
        args.out, args.in_features, args.repeats = 256, 512, 3
    if args.in_features % 256:
        parser.error(f"--in must be a multiple of 256, got {args.in_features}")
    if not quant_ops.available():
        print("the quantized kernels did not build here (see the log)", file=sys.stderr)
        return 1
    flags = sorted(flag for flag in (cpu_flags() or ()) if flag.startswith(("avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                                                     "amx")))
    print(f"CPU flags: {', '.join(flags)}; torch {torch.__version__}; {args.rows} row(s) x [{args.out}, "
          f"{args.in_features}]")
    results = []
    x = torch.randn(args.rows, args.in_features, generator=torch.Generator().manual_seed(0))
    for fmt in args.formats.split(","):
        weight = quant.random_quantized(fmt, args.out, args.in_features, torch.Generator().manual_seed(1))
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            row = {"format": fmt, "threads": threads, "weight_mb": weight.nbytes / 1e6,
                   "qdot_gb_s": weight.nbytes / timed(lambda: quant_ops.qlinear(x, weight), args.repeats) / 1e9}
            if fmt in quant_ops.int8_formats():
                row["qdot8_gb_s"] = weight.nbytes / timed(lambda: quant_ops.qlinear_int8(x, weight), args.repeats) / 1e9
                row["int8_group"] = quant_ops.int8_group(fmt)
            results.append(row)
            qdot8 = f"qdot8 {row['qdot8_gb_s']:5.1f} GB/s (inputs per {row['int8_group']})" if "qdot8_gb_s" in row \
                else "qdot8 not run on this CPU"
            print(f"{fmt:6} {threads} thread(s): qdot {row['qdot_gb_s']:5.1f} GB/s   {qdot8}", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cpu_flags": flags, "rows": args.rows, "shape": [args.out,
                                                   args.in_features], "results": results}, indent=1))
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
