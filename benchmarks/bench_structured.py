"""What a JSON-schema constraint costs: decode speed with the grammar's token mask vs unconstrained, and
grammar compile time, cold and cached.

Steps, in one process on one engine:
  1. compile a realistic tool-call-sized schema on a fresh compiler (cold), then submit it again (cached);
  2. for 1 and --concurrency sequences: the same prompts decoded --max-tokens tokens without a constraint
     and with the schema (its array of strings has a large ``minItems``, so no sequence ends early);
     the median decode step time over every step where all sequences decode, --repeats runs each, in
     alternation; tokens/s = sequences / step time.

    python benchmarks/bench_structured.py --preset smollm2-135m --dtype float32

KVREUSE_BENCH_SMOKE=1 runs the same steps on the tiny preset with 8 tokens, one repeat and 2 sequences,
and prints the same table in seconds: the test suite runs the documented command that way. Its figures
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_engine import machine_description  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"enum": ["search", "read", "write", "summarise"]},
        "priority": {"type": "integer", "minimum": 0, "maximum": 9},
        "owner": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 256},
    },
    "required": ["action", "priority", "owner", "notes"],
    "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                          "id": {"type": "integer"}},
                         "required": ["name", "id"], "additionalProperties": False}},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented command this way
        args.preset, args.repeats, args.max_tokens, args.concurrency = "tiny", 1, 8, 2
        print("KVREUSE_BENCH_SMOKE=1: smoke run on the tiny preset with the smallest sizes; the figures mean nothing")

    from kvreuse import LLM, SamplingParams
    from kvreuse.grammar.compiler import GrammarCompiler
    from kvreuse.model_tools.make_model import ensure_model
    from kvreuse.sampling import StructuredOutputsParams

    model = args.model or str(ensure_model(args.preset, dtype=args.dtype))
    llm = LLM(model, dtype=args.dtype, device="cpu", kv_cache_memory="512MiB")
    engine = llm.engine
    constraint = StructuredOutputsParams(json=SCHEMA)

    fresh = GrammarCompiler(engine.structured.compiler.tokenizer_path, engine.model_config.vocab_size,
                            sorted(engine.eos_token_ids))
    started = time.perf_counter()
    fresh.compile(constraint)  # cold: the tokenizer trie is built once per engine, then the grammar
    cold_first_ms = (time.perf_counter() - started) * 1e3
    other = StructuredOutputsParams(json={**SCHEMA, "title": "another schema"})
    started = time.perf_counter()
    fresh.compile(other)  # cold grammar, warm tokenizer: what a new schema costs on a running engine
    cold_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    fresh.compile(StructuredOutputsParams(json=json.loads(json.dumps(SCHEMA))))  # the same schema resent
    cached_ms = (time.perf_counter() - started) * 1e3
    fresh.shutdown()

    prompts = [f"Plan task {index} as JSON:" for index in range(args.concurrency)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up

    def decode_step_s(count: int, constrained: bool) -> float:
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=args.max_tokens, ignore_eos=True,
                                structured_outputs=constraint if constrained else None)
        llm.reset_prefix_cache()
        engine.step_timings.clear()
        llm.generate(prompts[:count], params, use_tqdm=False)
        steps = [t.step_s + t.output_s for t in engine.step_timings if t.num_tokens == t.num_seqs == count]
        return statistics.median(steps)

    rows = []
    for count in sorted({1, args.concurrency}):
        plain, masked = [], []
        for _ in range(args.repeats):  # alternating, so drift in machine load hits both alike
            plain.append(decode_step_s(count, False))
            masked.append(decode_step_s(count, True))
        rows.append((count, count / statistics.median(plain), count / statistics.median(masked)))

    print(f"machine: {machine_description()}")
    print(f"model: {model} ({args.dtype}), {args.max_tokens} tokens per sequence, median of {args.repeats} runs")
    print(f"{'grammar compile':<34} ms")
    print(f"{'  cold (first, with tokenizer)':<34} {cold_first_ms:.1f}")
    print(f"{'  cold (new schema)':<34} {cold_ms:.1f}")
    print(f"{'  cached (same schema resent)':<34} {cached_ms:.3f}")
    print(f"{'concurrency':<14}{'plain tok/s':>14}{'schema tok/s':>14}{'schema / plain':>16}")
    for count, plain_rate, masked_rate in rows:
        print(f"{count:<14}{plain_rate:>14.1f}{masked_rate:>14.1f}{masked_rate / plain_rate:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
