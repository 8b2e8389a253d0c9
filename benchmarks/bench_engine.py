"""Engine benchmark: kvreuse against transformers (and optionally llama.cpp) on the same model folder, in one run.

Figures (medians of --repeats runs, ratios computed within this run; the machine and its CPU flags first):
  1. TTFT warm / TTFT cold for a shared prefix (default 2,048 tokens) + a new suffix (64 tokens);
     transformers' usual practice for the warm case (a deep copy of a saved prompt cache) alongside;
     the FLOP floor of that ratio (ModelConfig.forward_flops of the warm step over the cold one).
  2. Cold prefill tokens/s, kvreuse / transformers, on the same prompt.
  3. A workload with no sharing: throughput with prefix caching on / off.
  4. Decode tokens/s with 16 concurrent requests and with one stream, against transformers generating
     one request at a time, against the same engine with every linear layer on plain F.linear
     (the kernels before issue 14: the before/after ratio in one run); the share
     of each decode step spent outside the model (scheduling, metadata, sampling, detokenizing).
  5. Prefix match of a 32k-token prompt in the cache core (hashing reported separately).
  6. With --llama-server BIN --gguf FILE (from ../shared/tools/llama_cpp_peer.sh): llama.cpp's cold
     and warm TTFT on the same shapes (when ttft is in --only) and its one-stream decode tokens/s,
     each repeat right after kvreuse's one-stream decode.

    python benchmarks/bench_engine.py --preset qwen2.5-0.5b --dtype bfloat16

KVREUSE_BENCH_SMOKE=1 runs the same steps on the tiny preset with the smallest sizes (one repeat, short
prompts, a small KV pool) and prints the same table in seconds: the test suite runs the documented
commands that way (tests/test_documented_commands.py). Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f"{memory_kib / 2**20:.0f} GiB"
    except OSError:
        memory = "?"
    return f"{os.cpu_count()} cores ({cpu}), {memory} RAM, torch {torch.__version__}, {torch.get_num_threads()} threads"


def random_tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(count)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def time_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_ttft(llm, hf_model, args, rng, vocab) -> dict:
    from kvreuse import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    cold, warm, hf_cold, hf_warm = [], [], [], []
    for _ in range(args.repeats):
        prefix = random_tokens(rng, args.prefix_len, vocab)
        suffixes = [random_tokens(rng, args.suffix_len, vocab) for _ in range(2)]
        llm.reset_prefix_cache()
        out = llm.generate({"prompt_token_ids": prefix + suffixes[0]}, one, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        cold.append(out.metrics.time_to_first_token)
        out = llm.generate({"prompt_token_ids": prefix + suffixes[1]}, one, use_tqdm=False)[0]
        assert out.num_cached_tokens >= args.prefix_len, out.num_cached_tokens
        warm.append(out.metrics.time_to_first_token)

        full = torch.tensor([prefix + suffixes[0]])
        with torch.inference_mode():
            hf_cold.append(time_call(lambda: hf_model(full, logits_to_keep=1)))
            saved = hf_model(torch.tensor([prefix]), use_cache=True).past_key_values
            suffix = torch.tensor([suffixes[1]])

            def warm_hf():
                cache = copy.deepcopy(saved)  # the saved prompt cache must not be extended in place
                hf_model(suffix, past_key_values=cache, use_cache=True, logits_to_keep=1)

            hf_warm.append(time_call(warm_hf))
    prompt_len = args.prefix_len + args.suffix_len
    # The lowest warm/cold any engine can reach if both run at the same FLOP rate: the warm step still
    # computes the suffix through every layer, attending over the whole cached prefix.
    config = llm.engine.model_config
    floor = config.forward_flops(args.prefix_len, args.suffix_len) / config.forward_flops(0, prompt_len)
    return {
        "kvreuse_ttft_cold_s": median(cold),
        "kvreuse_ttft_warm_s": median(warm),
        "kvreuse_warm_over_cold": median(warm) / median(cold),
        "warm_over_cold_flop_floor": floor,
        "kvreuse_warm_over_cold_over_floor": median(warm) / median(cold) / floor,
        "transformers_ttft_cold_s": median(hf_cold),
        "transformers_ttft_warm_copied_cache_s": median(hf_warm),
        "transformers_warm_over_cold": median(hf_warm) / median(hf_cold),
        "kvreuse_cold_prefill_tok_s": prompt_len / median(cold),
        "transformers_cold_prefill_tok_s": prompt_len / median(hf_cold),
        "cold_prefill_speed_ratio": median(hf_cold) / median(cold),
    }


def bench_no_sharing(llm_on, llm_off, args, rng, vocab) -> dict:
    from kvreuse import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.nosharing_output, ignore_eos=True)
    on, off = [], []
    for _ in range(args.repeats):
        prompts = [{"prompt_token_ids": random_tokens(rng, args.nosharing_prompt, vocab)}
                   for _ in range(args.nosharing_requests)]
        tokens = args.nosharing_requests * (args.nosharing_prompt + args.nosharing_output)
        # Alternate the order so drift in machine speed does not favour one side.
        for llm, sink in ((llm_on, on), (llm_off, off)) if len(on) % 2 == 0 else ((llm_off, off), (llm_on, on)):
            sink.append(tokens / time_call(lambda: llm.generate(prompts, params, use_tqdm=False)))
    return {
        "nosharing_tok_s_caching_on": median(on),
        "nosharing_tok_s_caching_off": median(off),
        "nosharing_on_over_off": median(on) / median(off),
    }


def decode_rate(llm, args, rng, vocab, concurrency: int) -> tuple[float, float]:
    """Decode tokens/s of ``concurrency`` requests generating together (median of --repeats), and the
    share of the decode steps' time spent outside the model (scheduling, metadata, sampling, output)."""
    from kvreuse import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    rates, overheads = [], []
    for _ in range(args.repeats):
        prompts = [{"prompt_token_ids": random_tokens(rng, args.decode_prompt, vocab)}
                   for _ in range(concurrency)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        llm.engine.step_timings.clear()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        # Decode rate: tokens after each request's first one, over the time after the last prefill.
        first_token = max(o.metrics.first_token_time for o in outputs)
        decode_tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
        rates.append(decode_tokens / (max(o.metrics.finished_time for o in outputs) - first_token))
        decodes = [t for t in llm.engine.step_timings if t.num_tokens == t.num_seqs == concurrency]
        overheads.append(sum(t.overhead_s for t in decodes) / sum(t.step_s + t.output_s for t in decodes))
    return median(rates), median(overheads)


def hf_decode_rate(hf_model, args, rng, vocab) -> float:
    """transformers generating one request at a time with its KV cache (tokens/s after the first)."""
    rates = []
    for _ in range(args.repeats):
        prompt = torch.tensor([random_tokens(rng, args.decode_prompt, vocab)])
        with torch.inference_mode():
            out = hf_model(prompt, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            cache = out.past_key_values
            start = time.perf_counter()
            for _ in range(args.decode_tokens - 1):
                out = hf_model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                cache = out.past_key_values
            rates.append((args.decode_tokens - 1) / (time.perf_counter() - start))
    return median(rates)


def bench_decode(llm, llm_plain, hf_model, args, rng, vocab) -> dict:
    """Decode rates at --concurrency and at one stream; with ``llm_plain`` (the same engine on plain
    F.linear) the engines alternate repeat by repeat, so drift in the machine favours neither."""
    once = argparse.Namespace(**{**vars(args), "repeats": 1})
    engines = {"measured": llm} | ({"plain": llm_plain} if llm_plain is not None else {})
    rates: dict[tuple[str, int], list[float]] = {}
    overheads: dict[int, list[float]] = {}
    for _ in range(args.repeats):
        for concurrency in (args.concurrency, 1):
            for name, engine in engines.items():
                rate, overhead = decode_rate(engine, once, rng, vocab, concurrency)
                rates.setdefault((name, concurrency), []).append(rate)
                overheads.setdefault((name, concurrency), []).append(overhead)
    concurrent, one = median(rates["measured", args.concurrency]), median(rates["measured", 1])
    hf = hf_decode_rate(hf_model, args, rng, vocab)
    results = {
        "kvreuse_decode_tok_s_concurrent": concurrent,
        "transformers_decode_tok_s_one_by_one": hf,
        "decode_speed_ratio": concurrent / hf,
        "concurrency": args.concurrency,
        "step_overhead_share_concurrent": median(overheads["measured", args.concurrency]),
        "kvreuse_decode_tok_s_one_stream": one,
        "step_overhead_share_one_stream": median(overheads["measured", 1]),
        "one_stream_vs_transformers": one / hf,
    }
    if llm_plain is not None:  # before issue 14: every linear layer on plain F.linear
        plain, plain_one = median(rates["plain", args.concurrency]), median(rates["plain", 1])
        results |= {
            "plain_kernels_decode_tok_s_concurrent": plain,
            "decode_concurrent_measured_over_plain_kernels": concurrent / plain,
            "plain_kernels_decode_tok_s_one_stream": plain_one,
            "decode_one_stream_measured_over_plain_kernels": one / plain_one,
        }
    return results


SETTLE_S = 2.0  # seconds between llama-server's requests and the next decode measurement


def bench_llama_server(llm, args, rng, vocab) -> dict:
    """llama.cpp's llama-server on a GGUF of the same folder (../shared/tools/llama_cpp_peer.sh): cold and
    warm TTFT of the same prefix + suffix shapes (one slot, its prompt cache reused across requests),
    and one-stream decode tokens/s from the server's own timings, each repeat right after kvreuse's
    one-stream decode of the same shape (the machine's memory bandwidth drifts over minutes)."""
    import subprocess

    import httpx

    port = 8097
    command = [args.llama_server, "-m", args.gguf, "-c", str(args.prefix_len + args.suffix_len + 256),
               "-np", "1", "-t", str(torch.get_num_threads()), "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=600) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"llama-server did not start: {' '.join(command)}")
                time.sleep(0.5)

            def complete(tokens: list[int], n_predict: int) -> tuple[float, dict]:
                body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": True,
                        "ignore_eos": True}
                start = time.perf_counter()
                response = client.post(f"{url}/completion", json=body)
                response.raise_for_status()
                return time.perf_counter() - start, response.json()

            cold, warm, decode, ours = [], [], [], []
            one_repeat = argparse.Namespace(**{**vars(args), "repeats": 1})
            for _ in range(args.repeats):
                if "ttft" in args.only.split(","):
                    prefix = random_tokens(rng, args.prefix_len, vocab)
                    suffixes = [random_tokens(rng, args.suffix_len, vocab) for _ in range(2)]
                    cold.append(complete(prefix + suffixes[0], 1)[0])
                    seconds, body = complete(prefix + suffixes[1], 1)
                    assert body["timings"]["prompt_n"] <= args.suffix_len + 16, body["timings"]  # prefix reused
                    warm.append(seconds)
                # llama-server's threads keep spinning for a moment after a request: let them settle so
                # they do not slow the measurement that follows (ours, then llama.cpp's own).
                time.sleep(SETTLE_S)
                ours.append(decode_rate(llm, one_repeat, rng, vocab, 1)[0])
                time.sleep(SETTLE_S)
                _, body = complete(random_tokens(rng, args.decode_prompt, vocab), args.decode_tokens)
                decode.append(body["timings"]["predicted_per_second"])
    finally:
        server.terminate()
        server.wait(timeout=30)
    results = {
        "llama_cpp_decode_tok_s_one_stream": median(decode),
        "kvreuse_decode_tok_s_one_stream_beside_llama_cpp": median(ours),
        "kvreuse_one_stream_over_llama_cpp": median(ours) / median(decode),
    }
    if cold:
        results |= {"llama_cpp_ttft_cold_s": median(cold), "llama_cpp_ttft_warm_s": median(warm),
                    "llama_cpp_warm_over_cold": median(warm) / median(cold)}
    return results


def kernel_summary(llm) -> str:
    """Which kernel each linear shape of the model runs on (layers/plan_book.py's measured verdicts)."""
    from kvreuse.layers.linear import Linear

    model = llm.engine.model
    verdicts: dict[str, str] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            shape = f"{sum(module.output_sizes)}x{module.input_size}"
            verdicts[shape] = module.kernel.plan.describe() if module.kernel is not None else "plain"
    if model._tied_head_kernel is not None:
        verdicts["tied head"] = model._tied_head_kernel.plan.describe()
    return "; ".join(f"{shape} {verdict}" for shape, verdict in verdicts.items())


def weight_memory(llm) -> dict:
    """The model's weights and what the kernels' second layouts add to them, in MiB."""
    model = llm.engine.model
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    weights += sum(m.kernel.weight_bytes for m in model.modules()
                   if getattr(m, "kernel", None) is not None and getattr(m, "weight", None) is None)
    return {"weights_mib": weights / 2**20, "weight_layouts_extra_mib": model.cpu_kernel_extra_bytes / 2**20}


def bench_prefix_match(args) -> dict:
    from kvreuse.cache.hashing import namespace_key
    from kvreuse.cache.manager import KVCacheManager
    from kvreuse.request import Request
    from kvreuse.sampling import SamplingParams

    rng = random.Random(0)
    length = args.match_len
    tokens = random_tokens(rng, length, 150_000)
    namespace = namespace_key(None, None, "bench")
    kv = KVCacheManager(num_blocks=length // 16 + 8, block_size=16)
    first = Request("first", tokens, SamplingParams(), namespace, 0.0)
    match = kv.match(first)
    kv.admit(first, match, length)
    first.num_computed_tokens = length
    kv.cache_computed_blocks(first)
    kv.end_step()
    kv.free(first)
    hashing, matching = [], []
    for _ in range(50):
        request = Request("again", list(tokens), SamplingParams(), namespace, 0.0)
        hashing.append(time_call(lambda: kv.update_block_keys(request)))
        result = None

        def do_match():
            nonlocal result
            result = kv.index.match(namespace, request.all_token_ids, request.block_keys, length - 1)

        matching.append(time_call(do_match))
        assert result.num_tokens == length - 1
    return {"prefix_match_tokens": length, "prefix_match_ms": median(matching) * 1e3,
            "block_hashing_ms": median(hashing) * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: made from --preset)")
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--nosharing-requests", type=int, default=16)
    parser.add_argument("--nosharing-prompt", type=int, default=256)
    parser.add_argument("--nosharing-output", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--decode-prompt", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--match-len", type=int, default=32768)
    parser.add_argument("--only", default="ttft,nosharing,decode,match")
    parser.add_argument("--no-plain-baseline", action="store_true",
                        help="skip the second engine on plain F.linear kernels (the before/after decode figures)")
    parser.add_argument("--llama-server", default=None,
                        help="llama.cpp's llama-server binary (../shared/tools/llama_cpp_peer.sh prints it)")
    parser.add_argument("--gguf", default=None, help="the GGUF of the same model folder, for --llama-server")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    only = set(args.only.split(","))
    kv_cache_memory = "2GiB"
    smoke = os.environ.get("KVREUSE_BENCH_SMOKE") == "1"
    if smoke:  # the documented commands, run by the test suite: same code path, smallest sizes
        args.preset, args.repeats = "tiny", 1  # a --model folder is kept (the suite passes tiny ones)
        args.prefix_len, args.suffix_len, args.match_len = 64, 16, 1024
        args.nosharing_requests, args.nosharing_prompt, args.nosharing_output = 2, 32, 2
        args.concurrency, args.decode_prompt, args.decode_tokens = 2, 16, 4
        kv_cache_memory = "16MiB"
        print("KVREUSE_BENCH_SMOKE=1: smoke run on the tiny preset with the smallest sizes; the figures mean nothing")

    from kvreuse.layers.plan_book import gemm_cpu_flags

    results: dict = {"machine": machine_description(), "cpu_flags": gemm_cpu_flags() or "none of the GEMM flags",
                     "command": " ".join(["python"] + sys.argv)}
    if smoke:
        results["smoke"] = "KVREUSE_BENCH_SMOKE=1 (tiny preset, smallest sizes: not a measurement)"
    if "match" in only:
        results.update(bench_prefix_match(args))
    if only & {"ttft", "nosharing", "decode"}:
        from transformers import AutoModelForCausalLM

        from kvreuse import LLM
        from kvreuse.model_tools.make_model import ensure_model

        model_dir = args.model or str(ensure_model(args.preset, dtype=args.dtype))
        dtype = getattr(torch, args.dtype)
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        vocab = min(hf_model.config.vocab_size, 30_000)
        rng = random.Random(1)
        llm = LLM(model_dir, dtype=args.dtype, device="cpu", kv_cache_memory=kv_cache_memory)
        results["model"] = f"{args.preset} ({model_dir}), {args.dtype}"
        results["linear_kernels"] = kernel_summary(llm)
        results.update(weight_memory(llm))
        if "ttft" in only:
            results.update(bench_ttft(llm, hf_model, args, rng, vocab))
            results["kvreuse_warm_ttft_over_transformers"] = (
                results["kvreuse_ttft_warm_s"] / results["transformers_ttft_warm_copied_cache_s"])
        if "decode" in only:
            llm_plain = None
            if not args.no_plain_baseline:
                before = os.environ.get("KVREUSE_LINEAR_KERNEL")
                os.environ["KVREUSE_LINEAR_KERNEL"] = "plain"  # read once, when the engine chooses its kernels
                llm_plain = LLM(model_dir, dtype=args.dtype, device="cpu", kv_cache_memory=kv_cache_memory)
                if before is None:
                    os.environ.pop("KVREUSE_LINEAR_KERNEL")
                else:
                    os.environ["KVREUSE_LINEAR_KERNEL"] = before
            results.update(bench_decode(llm, llm_plain, hf_model, args, rng, vocab))
            del llm_plain
        if args.llama_server:
            if not args.gguf:
                parser.error("--llama-server needs --gguf")
            results.update(bench_llama_server(llm, args, rng, vocab))
            if "kvreuse_ttft_warm_s" in results:
                results["kvreuse_warm_ttft_over_llama_cpp"] = results["kvreuse_ttft_warm_s"] / results["llama_cpp_ttft_warm_s"]
        if "nosharing" in only:
            llm_off = LLM(model_dir, dtype=args.dtype, device="cpu", kv_cache_memory=kv_cache_memory,
                          enable_prefix_caching=False)
            results.update(bench_no_sharing(llm, llm_off, args, rng, vocab))
    for key, value in results.items():
        print(f"{key:48s} {value:.4g}" if isinstance(value, float) else f"{key:48s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
