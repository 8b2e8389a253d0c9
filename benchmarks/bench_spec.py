"""EAGLE speculative decoding on CPU: decode speed, acceptance, and the cache hits it must not cost.

One process, two engines on the same random-weight model of a preset's shapes: one without
speculation, one with an EAGLE-1 draft distilled from the target on the embedded corpus
(``kvreuse distill-eagle``; made once and kept in the kvreuse cache dir, or ``--draft DIR``).

  1. decode: at concurrency 1 and 4, held-out corpus prompts, greedy, fixed output length
     (ignore_eos); decode tokens/s = tokens after the first / (last finish - first first token),
     median of --repeats, the two engines interleaved so drift hits both alike;
  2. acceptance: rate, mean acceptance length (1 + accepted per verification), accepted per position;
  3. the shared-prefix hit rate of the same workload (a system prompt + questions, one at a time) on
     both engines: speculation must not change it (target: equal), nor any request's cached tokens.

    python benchmarks/bench_spec.py --preset smollm2-135m --dtype float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_engine import machine_description  # noqa: E402


def held_out_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """Token windows from the last tenth of the embedded corpus (distillation reads the rest)."""
    from kvreuse.model_tools.make_model import CORPUS_PATH

    text = CORPUS_PATH.read_text(encoding="utf-8")
    tail = tokenizer.encode(text[int(len(text) * 0.9):])
    step = max(1, (len(tail) - length) // max(1, count))
    return [tail[i * step: i * step + length] for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target folder (default: the preset's, made once)")
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft", default=None, help="EAGLE draft folder (default: distilled once and cached)")
    parser.add_argument("--distill-steps", type=int, default=None, help="steps when distilling (default: its own)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    smoke = os.environ.get("KVREUSE_BENCH_SMOKE") == "1"
    if smoke:  # the suite runs the documented command this way
        args.preset, args.prompt_tokens, args.output_tokens, args.repeats = "tiny", 16, 8, 1
        args.system_tokens, args.questions, args.distill_steps = 32, 3, 20
        print("KVREUSE_BENCH_SMOKE=1: smoke run on the tiny preset with the smallest sizes; the figures mean nothing")

    from kvreuse import LLM, SamplingParams
    from kvreuse.kernels.cpu import cpu_bfloat16_support
    from kvreuse.model_tools.distill import distill_eagle_draft
    from kvreuse.model_tools.make_model import cache_dir, ensure_model

    model = Path(args.model or ensure_model(args.preset, dtype="float32" if args.preset == "tiny" else "bfloat16"))
    draft = Path(args.draft) if args.draft else cache_dir() / "drafts" / f"{model.name}-eagle-distilled" \
        f"{'-s' + str(args.distill_steps) if args.distill_steps else ''}"
    if not (draft / "config.json").is_file():
        print(f"distilling an EAGLE draft for {model} into {draft} ...", flush=True)
        options = {"steps": args.distill_steps} if args.distill_steps else {}
        figures = distill_eagle_draft(model, draft, log=lambda *a: None, **options)
        print(f"distilled in {figures.get('seconds', float('nan')):.0f} s: {figures}")
    k = args.num_speculative_tokens
    common = dict(dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory)
    engines = {
        "off": LLM(str(model), **common),
        "eagle": LLM(str(model), **common, speculative_config={
            "method": "eagle", "model": str(draft), "num_speculative_tokens": k}),
    }
    tokenizer = engines["off"].get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)

    def decode_rate(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
        start = min(o.metrics.first_token_time for o in outputs)
        end = max(o.metrics.finished_time for o in outputs)
        return tokens / (end - start), [o.outputs[0].token_ids for o in outputs]

    prompts = held_out_prompts(tokenizer, 4 * (args.repeats + 1), args.prompt_tokens)
    rates: dict[tuple[str, int], list[float]] = {}
    identical = True
    for concurrency in (1, 4):
        for name, llm in engines.items():  # warm-up, outside the timings
            decode_rate(llm, prompts[:concurrency])
        for repeat in range(args.repeats):
            batch = prompts[4 + 4 * repeat: 4 + 4 * repeat + concurrency]
            results = {}
            for name, llm in engines.items():
                rate, tokens = decode_rate(llm, batch)
                rates.setdefault((name, concurrency), []).append(rate)
                results[name] = tokens
            identical &= results["off"] == results["eagle"]
    spec_stats = engines["eagle"].stats()

    # Shared-prefix hit rate: the same workload, one request at a time, on each engine's empty cache.
    system = held_out_prompts(tokenizer, 1, args.system_tokens)[0]
    questions = held_out_prompts(tokenizer, args.questions + 1, 24)[1:]
    hit_rates, cached = {}, {}
    for name, llm in engines.items():
        llm.reset_prefix_cache()
        before = llm.stats()
        cached[name] = [llm.generate([{"prompt_token_ids": system + q}], SamplingParams(temperature=0, max_tokens=8,
                        ignore_eos=True), use_tqdm=False)[0].num_cached_tokens for q in questions]
        after = llm.stats()
        hit_rates[name] = (after["prefix_cache_hits_tokens"] - before["prefix_cache_hits_tokens"]) / max(
            1, after["prefix_cache_queries_tokens"] - before["prefix_cache_queries_tokens"])

    flags = sorted({flag for flag in Path("/proc/cpuinfo").read_text().split() if flag in ("avx512_bf16", "amx_bf16")})
    print(f"{machine_description()}; CPU bf16 flags: {', '.join(flags) or 'none'}; {cpu_bfloat16_support()[1]}")
    print(f"model {model.name} ({args.dtype}), draft {draft.name} (k={k}), {args.prompt_tokens} prompt + "
          f"{args.output_tokens} output tokens, greedy, median of {args.repeats}")
    print(f"{'concurrency':<12} {'off tok/s':>10} {'eagle tok/s':>12} {'speedup':>8}")
    for concurrency in (1, 4):
        off = statistics.median(rates[("off", concurrency)])
        on = statistics.median(rates[("eagle", concurrency)])
        print(f"{concurrency:<12} {off:>10.1f} {on:>12.1f} {on / off:>8.2f}")
    print(f"acceptance rate {spec_stats['spec_decode_acceptance_rate']:.3f}, mean acceptance length "
          f"{spec_stats['spec_decode_mean_acceptance_length']:.2f}, accepted per position "
          f"{spec_stats['spec_decode_num_accepted_tokens_per_pos']} of {spec_stats['spec_decode_num_drafts']} drafts")
    print(f"outputs identical with and without speculation: {identical}")
    print(f"shared-prefix hit rate ({args.system_tokens}-token system prompt, {args.questions} questions): "
          f"off {hit_rates['off']:.3f}, eagle {hit_rates['eagle']:.3f}; cached tokens per request equal: "
          f"{cached['off'] == cached['eagle']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
