"""kvreuse on a CUDA GPU: greedy output against transformers on the same GPU, then prefix reuse and decode speed.

For a session lent a GPU (the project's CI has none). One process:

  1. correctness: for each model (the tiny preset in float32, the qwen2.5-0.5b preset in float32 and in
     bfloat16), kvreuse's greedy tokens cold and warm (the second run served from the prefix cache) against
     transformers' greedy decoding with its own KV cache, both on the GPU, with the engine's CUDA defaults
     (triton attention, CUDA graphs); the count of equal outputs and, where one differs, the first differing
     position and the reference's top-2 logit margin there;
  2. for each engine configuration (--configs: torch_eager, what ran before issue 40; triton_eager;
     triton_graphs, the default), on the qwen2.5-0.5b preset in bfloat16:
     - prefix reuse: time to the first token of a new 2,048-token prompt (cold) and of the same prompt with
       a new 64-token end (warm);
     - decode: tokens/s at 1 and 16 concurrent streams (64-token prompts, 128 tokens, ignore_eos);
     - one stream's decode steps under torch.profiler: host launch calls and GPU kernels per step, GPU time
       per step, and its share of the unprofiled step's wall time (the GPU-busy share);
  3. transformers' full prefill of the warm prompt and its one-stream greedy decode.
Medians of --repeats; every timing synchronizes the device; the ratios against torch_eager come from the same
run.

    python benchmarks/bench_cuda.py --json cuda.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
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


CONFIGS = {
    # What the engine ran on CUDA before issue 40 (the reference backend, every op launched from Python) ...
    "torch_eager": {"attention_backend": "torch", "enforce_eager": True},
    # ... the Triton kernels alone ...
    "triton_eager": {"attention_backend": "triton", "enforce_eager": True},
    # ... and the default: the Triton kernels with decode steps replayed from CUDA graphs.
    "triton_graphs": {},
}
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")


def profile_decode(llm, prompt: list[int], steps: int, device: torch.device, trace: Path) -> dict:
    """One stream's decode steps under torch.profiler: host launch calls per step, and GPU time per step (kernels,
    copies and sets in the trace, graph-launched kernels included); then the same steps unprofiled for their wall
    time. The GPU-busy share is GPU time over unprofiled wall time."""
    from kvreuse import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16, ignore_eos=True)

    def start() -> None:
        engine.add_request(f"profile-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
        for _ in range(4):  # the prefill, then decode steps out of the figures
            engine.step()

    def finish() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    start()
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize(device)
    wall = (time.perf_counter() - begin) / steps
    finish()
    start()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize(device)
    finish()
    profiler.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    launches = sum(1 for event in events if event.get("name") in LAUNCH_CALLS)
    gpu = [event for event in events if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu_seconds = sum(float(event.get("dur", 0)) for event in gpu) / 1e6 / steps
    return {"wall_ms_per_step": wall * 1e3, "gpu_ms_per_step": gpu_seconds * 1e3,
            "gpu_busy_share": gpu_seconds / wall, "host_launch_calls_per_step": launches / steps,
            "gpu_kernels_per_step": sum(1 for event in gpu if event.get("cat") == "kernel") / steps}


def speed(model_dir: str, dtype: str, device: torch.device, args: argparse.Namespace, config: str,
          out_dir: Path) -> dict:
    from kvreuse import LLM, SamplingParams

    rng = random.Random(0)
    vocab = 30_000

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(count)]

    begin = time.perf_counter()
    llm = LLM(model_dir, dtype=dtype, device=str(device), kv_cache_memory="8GiB", **CONFIGS[config])
    figures: dict = {"engine_start_s": time.perf_counter() - begin}
    graphs = llm.engine.runner.decode.cuda_graphs
    if graphs is not None:
        figures["graph_sizes"] = graphs.sizes
        figures["graph_memory_mib"] = graphs.memory_bytes / 2**20
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # Lazy set-up out of the figures: a prompt, then a hit on it (the first chunk over cached context compiles
    # its kernel variant; unwarmed, it lands in the first warm figure).
    warmup = tokens(256)
    llm.generate([{"prompt_token_ids": warmup}], one, use_tqdm=False)
    llm.generate([{"prompt_token_ids": warmup + tokens(args.suffix_len)}], one, use_tqdm=False)
    cold, warm = [], []
    for _ in range(args.repeats):
        prefix = tokens(args.prefix_len)
        cold.append(timed(lambda: llm.generate([{"prompt_token_ids": prefix}], one, use_tqdm=False), device))
        suffixed = prefix + tokens(args.suffix_len)
        warm.append(timed(lambda: llm.generate([{"prompt_token_ids": suffixed}], one, use_tqdm=False), device))
    figures.update({"ttft_cold_s": statistics.median(cold), "ttft_warm_s": statistics.median(warm)})
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for streams in (1, 16):
        rates = []
        for _ in range(args.repeats):
            prompts = [{"prompt_token_ids": tokens(64)} for _ in range(streams)]
            seconds = timed(lambda: llm.generate(prompts, decode, use_tqdm=False), device)
            rates.append(streams * args.decode_tokens / seconds)
        figures[f"decode_tok_s_{streams}_streams"] = statistics.median(rates)
    figures["profile_1_stream"] = profile_decode(llm, tokens(64), args.profile_steps, device,
                                                 out_dir / f"trace_{config}.json")
    llm.engine.check_integrity()
    del llm
    torch.cuda.empty_cache()
    return figures


def transformers_speed(model_dir: str, dtype: str, device: torch.device, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    full, rates = [], []
    with torch.no_grad():
        hf(torch.tensor([[rng.randrange(100, 30_000) for _ in range(256)]], device=device))
        for _ in range(args.repeats):
            ids = torch.tensor([[rng.randrange(100, 30_000) for _ in range(args.prefix_len + args.suffix_len)]],
                               device=device)
            full.append(timed(lambda: hf(ids), device))
            prompt = torch.tensor([[rng.randrange(100, 30_000) for _ in range(64)]], device=device)
            seconds = timed(lambda: hf.generate(prompt, max_new_tokens=args.decode_tokens,
                                                min_new_tokens=args.decode_tokens, do_sample=False), device)
            rates.append(args.decode_tokens / seconds)
    return {"full_prefill_s": statistics.median(full), "decode_tok_s_1_stream": statistics.median(rates)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    from kvreuse.model_tools.make_model import ensure_model

    device = torch.device("cuda")
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    print(f"device: {results['device']}, torch {torch.__version__}", flush=True)
    rng = random.Random(1)
    out_dir = Path(tempfile.mkdtemp(prefix="kvreuse-cuda-traces-"))  # profiler traces: large, read then left there
    for preset, dtype in (() if args.skip_correctness else
                          (("tiny", "float32"), ("qwen2.5-0.5b", "float32"), ("qwen2.5-0.5b", "bfloat16"))):
        model_dir = str(ensure_model(preset, dtype="float32" if dtype == "float32" else "bfloat16"))
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(0, vocab) for _ in range(length)] for length in (7, 33, 100, 257)]
        figures = correctness(model_dir, dtype, device, prompts, 24)
        results[f"greedy_{preset}_{dtype}"] = figures
        print(f"greedy {preset} {dtype}: " + json.dumps(figures), flush=True)
    model_dir = str(ensure_model("qwen2.5-0.5b", dtype="bfloat16"))
    for config in args.configs.split(","):
        figures = speed(model_dir, "bfloat16", device, args, config, out_dir)
        results[f"speed_{config}"] = figures
        print(f"{config}: " + json.dumps(figures), flush=True)
        if args.json:  # after every configuration: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))
    results["transformers"] = transformers_speed(model_dir, "bfloat16", device, args)
    print("transformers: " + json.dumps(results["transformers"]), flush=True)
    base = results.get("speed_torch_eager")
    for config in ("triton_eager", "triton_graphs"):
        if base and f"speed_{config}" in results:
            figures = results[f"speed_{config}"]
            ratios = {f"{key}_over_torch_eager": figures[key] / base[key]
                      for key in ("decode_tok_s_1_streams", "decode_tok_s_16_streams")}
            ratios["ttft_warm_over_torch_eager"] = figures["ttft_warm_s"] / base["ttft_warm_s"]
            results[f"ratios_{config}"] = ratios
            print(f"{config} vs torch_eager: " + json.dumps(ratios), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
