"""kvreuse on a CUDA GPU: greedy output against transformers on the same GPU, then prefix reuse and decode speed.

For a session lent a GPU (the project's CI has none). One process:

  1. correctness: for each model (the tiny preset in float32, the qwen2.5-0.5b preset in float32 and in
     bfloat16), kvreuse's greedy tokens cold and warm (the second run served from the prefix cache) against
     transformers' greedy decoding with its own KV cache, both on the GPU; the count of equal outputs and,
     where one differs, the first differing position and the reference's top-2 logit margin there;
  2. prefix reuse: time to the first token of a new 2,048-token prompt (cold) and of the same prompt with
     a new 64-token end (warm) on kvreuse, and transformers' full prefill of the warm prompt;
  3. decode: tokens/s at 1 and 16 concurrent streams (64-token prompts, 128 tokens, ignore_eos) on kvreuse,
     and transformers' one-stream greedy decode.
Medians of --repeats; every timing synchronizes the device.

    python benchmarks/bench_cuda.py --json cuda.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch


def reference_greedy(model, prompt: list[int], max_new: int, device: torch.device) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per position, the margin between its top two logits."""
    tokens, margins = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        for _ in range(max_new):
            top = out.logits[0, -1].float().topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            out = model(torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, margins


def timed(function, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    function()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def correctness(model_dir: str, dtype: str, device: torch.device, prompts: list[list[int]], max_new: int) -> dict:
    from transformers import AutoModelForCausalLM

    from kvreuse import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    references = [reference_greedy(hf, prompt, max_new, device) for prompt in prompts]
    del hf
    llm = LLM(model_dir, dtype=dtype, device=str(device), kv_cache_memory="1GiB")
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    result: dict = {}
    for run in ("cold", "warm"):
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
        equal, differences = 0, []
        for output, (expected, margins) in zip(outputs, references):
            got = list(output.outputs[0].token_ids)
            if got == expected:
                equal += 1
                continue
            first = next(i for i in range(max_new) if got[i] != expected[i])
            differences.append({"position": first, "reference_top2_logit_margin": round(margins[first], 4)})
        result[run] = {"equal": equal, "of": len(prompts), "differences": differences,
                       "cached_tokens": [output.num_cached_tokens for output in outputs]}
    llm.engine.check_integrity()
    return result


def speed(model_dir: str, dtype: str, device: torch.device, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from kvreuse import LLM, SamplingParams

    rng = random.Random(0)
    vocab = 30_000

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(count)]

    llm = LLM(model_dir, dtype=dtype, device=str(device), kv_cache_memory="8GiB")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": tokens(256)}], one, use_tqdm=False)  # lazy set-up out of the figures
    cold, warm = [], []
    for _ in range(args.repeats):
        prefix = tokens(args.prefix_len)
        cold.append(timed(lambda: llm.generate([{"prompt_token_ids": prefix}], one, use_tqdm=False), device))
        suffixed = prefix + tokens(args.suffix_len)
        warm.append(timed(lambda: llm.generate([{"prompt_token_ids": suffixed}], one, use_tqdm=False), device))
    figures = {"kvreuse_ttft_cold_s": statistics.median(cold), "kvreuse_ttft_warm_s": statistics.median(warm)}
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for streams in (1, 16):
        rates = []
        for _ in range(args.repeats):
            prompts = [{"prompt_token_ids": tokens(64)} for _ in range(streams)]
            seconds = timed(lambda: llm.generate(prompts, decode, use_tqdm=False), device)
            rates.append(streams * args.decode_tokens / seconds)
        figures[f"kvreuse_decode_tok_s_{streams}_streams"] = statistics.median(rates)
    del llm
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    full, rates = [], []
    with torch.no_grad():
        hf(torch.tensor([tokens(256)], device=device))
        for _ in range(args.repeats):
            ids = torch.tensor([tokens(args.prefix_len + args.suffix_len)], device=device)
            full.append(timed(lambda: hf(ids), device))
            prompt = torch.tensor([tokens(64)], device=device)
            seconds = timed(lambda: hf.generate(prompt, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                                                do_sample=False), device)
            rates.append(args.decode_tokens / seconds)
    figures["transformers_full_prefill_s"] = statistics.median(full)
    figures["transformers_decode_tok_s_1_stream"] = statistics.median(rates)
    figures["kvreuse_warm_over_transformers_prefill"] = figures["kvreuse_ttft_warm_s"] / figures["transformers_full_prefill_s"]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    from kvreuse.models.make import ensure_model

    device = torch.device("cuda")
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    print(f"device: {results['device']}, torch {torch.__version__}", flush=True)
    rng = random.Random(1)
    for preset, dtype in (("tiny", "float32"), ("qwen2.5-0.5b", "float32"), ("qwen2.5-0.5b", "bfloat16")):
        model_dir = str(ensure_model(preset, dtype="float32" if dtype == "float32" else "bfloat16"))
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(0, vocab) for _ in range(length)] for length in (7, 33, 100, 257)]
        figures = correctness(model_dir, dtype, device, prompts, 24)
        results[f"greedy_{preset}_{dtype}"] = figures
        print(f"greedy {preset} {dtype}: " + json.dumps(figures), flush=True)
    figures = speed(str(ensure_model("qwen2.5-0.5b", dtype="bfloat16")), "bfloat16", device, args)
    results["speed_qwen2.5-0.5b_bfloat16"] = figures
    for key, value in figures.items():
        print(f"{key:48s} {value:.4g}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
