"""Pins under pressure: a pinned 2,000-token system prompt survives a flood of unrelated traffic.

Steps, in one process on one engine:
  1. pin a system prompt (about --system-tokens tokens); cache a second, unpinned one of the same size;
  2. warm TTFT: a request with the pinned system prompt and a new question (median of --repeats);
  3. flood: unrelated prompts totalling --flood-factor x the KV pool's capacity;
  4. TTFT of a request with the pinned system prompt (should stay warm) and with the unpinned one
     (evicted by the flood: cold), medians of --repeats, each repeat after its own flood.

    python benchmarks/bench_pins.py --preset smollm2-135m

KVREUSE_BENCH_SMOKE=1 runs the same steps on the tiny preset with the smallest sizes (one repeat, a
128-token system prompt, a 2 MiB pool flooded twice over by 64-token prompts) and prints the same table
in seconds: the test suite runs the documented command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_engine import machine_description  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="96MiB")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--flood-factor", type=float, default=10.0)
    parser.add_argument("--flood-prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented command this way
        args.preset, args.repeats, args.kv_cache_memory = "tiny", 1, "2MiB"
        args.system_tokens, args.flood_factor, args.flood_prompt_len = 128, 2.0, 64
        print("KVREUSE_BENCH_SMOKE=1: smoke run on the tiny preset with the smallest sizes; the figures mean nothing")

    from kvreuse import LLM, SamplingParams
    from kvreuse.model_tools.make_model import ensure_model

    model = args.model or str(ensure_model(args.preset, dtype=args.dtype))
    llm = LLM(model, dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory)
    tokenizer = llm.get_tokenizer()
    capacity = llm.stats()["blocks_total"] * llm.engine.kv.block_size
    rng = random.Random(0)
    # ids well inside the trained tokenizer, so prompts decode to text and back exactly
    vocab = min(2000, tokenizer.vocab_size)

    def text_of(length: int) -> str:
        # Random ids decode to text that re-encodes to more tokens; cut that encoding to the length.
        text = tokenizer.decode([rng.randrange(100, vocab) for _ in range(length)])
        return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:length])

    def conversation(system: str, question: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    one = SamplingParams(temperature=0, max_tokens=1)

    def ttft(system: str) -> tuple[float, int]:
        output = llm.chat(conversation(system, text_of(32)), one, use_tqdm=False)[0]
        return output.metrics.time_to_first_token, output.num_cached_tokens

    pinned_system, unpinned_system = text_of(args.system_tokens), text_of(args.system_tokens)
    pin = llm.pin([{"role": "system", "content": pinned_system}])
    llm.chat(conversation(unpinned_system, "warm it"), one, use_tqdm=False)
    warm_runs = [ttft(pinned_system) for _ in range(args.repeats)]
    warm = [seconds for seconds, _ in warm_runs]

    flood_requests = int(args.flood_factor * capacity / args.flood_prompt_len) + 1
    after_pinned, after_unpinned, cached_pinned, cached_unpinned = [], [], [], []
    for _ in range(args.repeats):
        flood = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.flood_prompt_len)]}
                 for _ in range(flood_requests)]
        llm.generate(flood, one, use_tqdm=False)
        seconds, cached = ttft(pinned_system)
        after_pinned.append(seconds)
        cached_pinned.append(cached)
        llm.generate(flood[: flood_requests // 2], one, use_tqdm=False)  # evict anything the last probe left
        seconds, cached = ttft(unpinned_system)
        after_unpinned.append(seconds)
        cached_unpinned.append(cached)

    warm_median = statistics.median(warm)
    print(f"machine                     {machine_description()}")
    print(f"model                       {args.preset} ({model}), {args.dtype}")
    print(f"KV pool                     {capacity} tokens; pinned {pin['tokens']} tokens; flood "
          f"{flood_requests} x {args.flood_prompt_len} tokens per repeat ({args.flood_factor:g}x the pool)")
    print(f"evicted blocks              {llm.stats()['prefix_cache_evicted_blocks']}")
    print(f"TTFT warm hit (median)      {warm_median * 1000:.1f} ms "
          f"(cached {statistics.median(cached for _, cached in warm_runs):.0f} tokens; runs "
          f"{', '.join(f'{seconds * 1000:.0f}' for seconds in warm)} ms)")
    print(f"TTFT pinned, after flood    {statistics.median(after_pinned) * 1000:.1f} ms "
          f"(runs {', '.join(f'{seconds * 1000:.0f}' for seconds in after_pinned)} ms) "
          f"(cached {statistics.median(cached_pinned):.0f} tokens)")
    print(f"TTFT unpinned, after flood  {statistics.median(after_unpinned) * 1000:.1f} ms "
          f"(cached {statistics.median(cached_unpinned):.0f} tokens)")
    print(f"pinned-after-flood / warm   {statistics.median(after_pinned) / warm_median:.3f}  (goal <= 1.2)")
    print(f"unpinned-after-flood / warm {statistics.median(after_unpinned) / warm_median:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
