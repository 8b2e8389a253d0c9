"""Multi-LoRA cost: the same workload on the base model, on one adapter, and spread over 4 adapters.

One process, one engine (enable_lora, max_loras=4), random-weight model of a preset's shapes and
random rank-R adapters on every projection (q, k, v, o, gate, up, down), written here as PEFT folders.

  1. throughput: N requests at once (distinct prompts, fixed output length, ignore_eos), output tokens/s,
     median of --repeats, for: base only, all on adapter 0, round-robin over 4 adapters;
  2. warm TTFT: a --prefix-tokens shared prefix, cached first, then a new suffix; median of --repeats,
     base vs an adapter (each against its own cached prefix).

Targets (issue 11): 4-adapter throughput >= 0.7x base; adapter warm TTFT within 1.1x of base's.

    python benchmarks/bench_lora.py --preset smollm2-135m --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_engine import machine_description  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(config, out: Path, rank: int, seed: int) -> Path:
    """A PEFT-format adapter with random A and B (B non-zero, so it changes the outputs)."""
    from kvreuse.lora.adapter import module_shape

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in MODULES:
            in_features, out_features = module_shape(config, module)
            group = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none"}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented command this way
        args.preset, args.num_requests, args.prompt_tokens, args.output_tokens = "tiny", 4, 16, 4
        args.prefix_tokens, args.repeats, args.rank = 64, 1, 4
        print("KVREUSE_BENCH_SMOKE=1: smoke run on the tiny preset with the smallest sizes; the figures mean nothing")

    from kvreuse import LLM, LoRARequest, SamplingParams
    from kvreuse.model_tools.make_model import ensure_model

    model = args.model or str(ensure_model(args.preset, dtype="bfloat16" if args.preset != "tiny" else "float32"))
    llm = LLM(model, dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory, enable_lora=True,
              max_loras=4, max_lora_rank=max(args.rank, 16))
    config = llm.engine.model_config
    folder = Path(tempfile.mkdtemp(prefix="kvreuse-bench-lora-"))
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(write_random_adapter(config, folder / f"a{i}", args.rank, i)))
             for i in range(4)]
    rng = random.Random(0)
    vocab = min(config.vocab_size, 2000)

    def ids(length: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(length)]

    decode = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    for lora in loras:  # load every adapter once, outside the timings
        llm.generate([{"prompt_token_ids": ids(8)}], one, use_tqdm=False, lora_request=lora)

    def throughput(assign) -> float:
        prompts = [{"prompt_token_ids": ids(args.prompt_tokens)} for _ in range(args.num_requests)]
        started = time.perf_counter()
        outputs = llm.generate(prompts, decode, use_tqdm=False, lora_request=[assign(i) for i in range(len(prompts))])
        elapsed = time.perf_counter() - started
        return sum(len(output.outputs[0].token_ids) for output in outputs) / elapsed

    layouts = {"base": lambda i: None, "1 adapter": lambda i: loras[0], "4 adapters": lambda i: loras[i % 4]}
    rates: dict[str, list[float]] = {name: [] for name in layouts}
    throughput(layouts["4 adapters"])  # warm-up
    for _ in range(args.repeats):
        for name, assign in layouts.items():  # interleaved, so drift hits every layout alike
            rates[name].append(throughput(assign))
    medians = {name: statistics.median(values) for name, values in rates.items()}

    def warm_ttft(lora) -> float:
        prefix = ids(args.prefix_tokens)
        llm.generate([{"prompt_token_ids": prefix + ids(16)}], one, use_tqdm=False, lora_request=lora)
        times = []
        for _ in range(args.repeats):
            output = llm.generate([{"prompt_token_ids": prefix + ids(16)}], one, use_tqdm=False, lora_request=lora)[0]
            assert output.num_cached_tokens >= args.prefix_tokens - 16, output.num_cached_tokens
            times.append(output.metrics.time_to_first_token)
        return statistics.median(times)

    ttft = {"base": warm_ttft(None), "adapter": warm_ttft(loras[1])}
    from kvreuse.kernels.cpu import cpu_bfloat16_support

    print(f"{machine_description()}; {cpu_bfloat16_support()[1]}")
    print(f"model {model} ({args.dtype}), rank {args.rank} on {len(MODULES)} modules x {config.num_hidden_layers} "
          f"layers, {args.num_requests} requests x {args.prompt_tokens} prompt + {args.output_tokens} output tokens, "
          f"median of {args.repeats}")
    print(f"{'layout':<12} {'output tok/s':>12} {'vs base':>8}")
    for name, value in medians.items():
        print(f"{name:<12} {value:>12.1f} {value / medians['base']:>8.2f}")
    print(f"warm TTFT ({args.prefix_tokens}-token cached prefix + 16 new): base {ttft['base'] * 1000:.1f} ms, "
          f"adapter {ttft['adapter'] * 1000:.1f} ms, ratio {ttft['adapter'] / ttft['base']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
