"""Reasoning turns (issue 39): an agent-like loop on a template that drops the earlier turns' thinking.

Qwen3's and DeepSeek-R1's chat templates render an earlier assistant turn without its ``<think>...</think>``.
Turn N+1's prompt then leaves turn N's cached sequence right after the assistant header: with prefix caching
alone, turn N's answer (and all that follows it) is computed again. With ``chunk_reuse`` the answer is found
further along turn N's cached sequence and its K/V moved earlier (re-rotated, 30% recomputed by default).

The loop: a system prompt, then --turns turns; turn k's prompt is the history (every earlier assistant message
holding its thinking, which the template drops) and a new user message. Each turn is measured, then written
into the cache as the model would have written it: a prefill of the prompt, ``<think>``, --thinking-tokens of
thinking, ``</think>``, an answer of --answer-tokens and ``<|im_end|>`` (random weights cannot write that
structure themselves). The texts are sentences of kvreuse's own corpus.

The model: a ``kvreuse make-model`` preset with Qwen3's thinking template (random weights), by default
``qwen3-think-135m`` (SmolLM2-135M's shapes written as qwen3). Three engines run the same loop:

- full prefill: prefix caching off (the reference for TTFT);
- prefix caching: on, chunk reuse off;
- chunk reuse: prefix caching and ``chunk_reuse=True`` (its defaults: 30% recomputed, chosen after a tenth of the layers).

Per turn: prompt tokens; cached tokens of each run (chunk reuse: with the moved answer, and how many of the
moved tokens the blend recomputed); TTFT (one greedy token, the engine idle), the median over --repeats
replays of the whole loop, each from an empty cache (the three engines take turns, repeat by repeat).

    python benchmarks/bench_reasoning_turns.py --json-out reasoning_turns.json

KVREUSE_BENCH_SMOKE=1 runs the same steps on the tiny-qwen3-think preset with the smallest sizes and prints the
same table: the suite runs the documented command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvreuse import LLM, SamplingParams
from kvreuse.bench.report import machine_description, write_json
from kvreuse.model_tools.make_model import CORPUS_PATH, IM_END, PRESETS, ensure_model

RUNS = {
    "full prefill": dict(enable_prefix_caching=False),
    "prefix caching": dict(enable_prefix_caching=True),
    "chunk reuse": dict(enable_prefix_caching=True, chunk_reuse=True),
}


@dataclass
class Turn:
    user: str
    thinking: str
    answer: str


@dataclass
class TurnFigures:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    moved_tokens: int = 0
    recomputed_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)


def corpus_sentences() -> list[str]:
    """The assistant lines of kvreuse's corpus, cut into sentences."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    lines = [line.removeprefix("<assistant> ") for line in text.splitlines() if line.startswith("<assistant> ")]
    return [s for line in lines for s in re.split(r"(?<=[.!?])\s+", line) if len(s.split()) >= 4]


def text_of(tokenizer: Any, sentences: list[str], rng: random.Random, tokens: int) -> str:
    """Sentences drawn at random until the text is about ``tokens`` tokens long."""
    kept: list[str] = []
    while not kept or len(tokenizer.encode(" ".join(kept))) < tokens:
        kept.append(rng.choice(sentences))
    return " ".join(kept)


def make_turns(tokenizer: Any, args: argparse.Namespace) -> tuple[str, list[Turn]]:
    rng = random.Random(args.seed)
    sentences = corpus_sentences()
    system = text_of(tokenizer, sentences, rng, args.system_tokens)
    turns = [Turn(user=text_of(tokenizer, sentences, rng, args.user_tokens),
                  thinking=text_of(tokenizer, sentences, rng, args.thinking_tokens),
                  answer=text_of(tokenizer, sentences, rng, args.answer_tokens)) for _ in range(args.turns)]
    return system, turns


def written(turn: Turn) -> str:
    """What a reasoning model writes after the assistant header (Qwen3's shape)."""
    return f"<think>\n{turn.thinking}\n</think>\n\n{turn.answer}"


def messages_for(system: str, turns: list[Turn], k: int) -> list[dict[str, str]]:
    """Turn k's prompt: the earlier turns with their thinking (the template drops it) and turn k's question."""
    messages = [{"role": "system", "content": system}]
    for turn in turns[:k]:
        messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": written(turn)}]
    return [*messages, {"role": "user", "content": turns[k].user}]


def run_loop(llm: LLM, system: str, turns: list[Turn], figures: list[TurnFigures], record: bool) -> None:
    """One pass of the loop from an empty cache: each turn timed, then written into the cache."""
    llm.reset_prefix_cache()
    tokenizer = llm.engine.tokenizer
    im_end = tokenizer.encode(IM_END)[-1]
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    for k, turn in enumerate(turns):
        prompt = llm.inputs.from_messages(messages_for(system, turns, k))
        started = time.perf_counter()
        output = llm.generate([prompt.as_engine_prompt()], one_token, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        figures[k].ttft_s.append(seconds)
        if record:
            figures[k].prompt_tokens = len(prompt.token_ids)
            figures[k].cached_tokens = output.num_cached_tokens
            figures[k].moved_tokens = output.num_moved_tokens
            figures[k].recomputed_tokens = output.num_recomputed_tokens
        # The turn as the model would have written it, thinking included, now in the cache (the same engine: a
        # chunk-reuse engine treats it as it would treat the turn's own generation).
        ids = prompt.token_ids + tokenizer.encode(written(turn)) + [im_end]
        llm.generate([ids], one_token, use_tqdm=False)


def check_template(llm: LLM, system: str, turns: list[Turn]) -> None:
    rendered = llm.engine.tokenizer.apply_chat_template(messages_for(system, turns, 1), add_generation_prompt=True)
    if "<think>" in rendered:
        raise SystemExit("the model's chat template keeps the earlier turns' thinking; use a preset with Qwen3's "
                         "thinking template (" + ", ".join(n for n, p in PRESETS.items() if p.thinking_template) + ")")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    thinking_presets = sorted(name for name, preset in PRESETS.items() if preset.thinking_template)
    parser.add_argument("--preset", default="qwen3-think-135m", choices=thinking_presets)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--thinking-tokens", type=int, default=384)
    parser.add_argument("--answer-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3, help="replays of the whole loop; TTFT is their median")
    parser.add_argument("--seed", type=int, default=0, help="which corpus sentences the texts are made of")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2: the first turn has no history")
    smoke = os.environ.get("KVREUSE_BENCH_SMOKE") == "1"
    if smoke:  # the suite runs the documented command this way
        args.preset, args.turns, args.repeats = "tiny-qwen3-think", 3, 1
        args.system_tokens, args.user_tokens, args.thinking_tokens, args.answer_tokens = 24, 12, 24, 16
        args.kv_cache_memory = "16MiB"
        print("KVREUSE_BENCH_SMOKE=1: smoke run on the tiny-qwen3-think preset with the smallest sizes; the figures "
              "mean nothing", flush=True)
    model = str(ensure_model(args.preset, dtype=args.dtype))

    report: dict[str, Any] = {"kind": "kvreuse-bench-reasoning-turns", "machine": machine_description(),
                              "torch_threads": torch.get_num_threads(), "command": " ".join(sys.argv),
                              "args": vars(args), "model": model, "runs": {}}
    # One prefill step per prompt (no chunked prefill): TTFT is the prompt's forward. The three engines run their
    # loops in turn, repeat by repeat, so a busy machine slows them alike.
    engines = {name: LLM(model, dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory,
                         max_num_batched_tokens=16384, **options) for name, options in RUNS.items()}
    first = next(iter(engines.values()))
    system, turns = make_turns(first.engine.tokenizer, args)
    check_template(first, system, turns)
    figures = {name: [TurnFigures() for _ in turns] for name in engines}
    print(f"{args.repeats} + 1 passes of {len(turns)} turns on each of: {', '.join(engines)}", flush=True)
    for name, llm in engines.items():
        run_loop(llm, system, turns, [TurnFigures() for _ in turns], record=False)  # warm-up, out of the figures
    for repeat in range(args.repeats):
        for name, llm in engines.items():
            run_loop(llm, system, turns, figures[name], record=repeat == 0)
            llm.engine.check_integrity()
    for name, run in figures.items():
        report["runs"][name] = [{**asdict(f), "ttft_p50_s": statistics.median(f.ttft_s)} for f in run]
    del engines, first
    gc.collect()
    if args.json_out:
        write_json(args.json_out, report)
    print_table(report, args)
    if args.json_out:
        print(f"wrote {args.json_out}")
    return 0


def print_table(report: dict[str, Any], args: argparse.Namespace) -> None:
    machine = report["machine"]
    print(f"\nmachine: {machine['cpu']}, {machine['cores']} cores, flags {','.join(machine['cpu_flags']) or '-'}, "
          f"torch threads {report['torch_threads']}, torch {machine['torch']}")
    print(f"model: {args.preset} (random weights), dtype {args.dtype}; {args.turns} turns: system ~{args.system_tokens} "
          f"tokens, user ~{args.user_tokens}, thinking ~{args.thinking_tokens} (dropped from later prompts), answer "
          f"~{args.answer_tokens}; TTFT = median of {args.repeats} loop(s)")
    runs = report["runs"]
    full, prefix, chunk = runs["full prefill"], runs["prefix caching"], runs["chunk reuse"]
    print(f"\n{'turn':>4s} {'prompt':>7s} {'cached':>7s} {'cached':>7s} {'moved':>6s} {'recomp':>6s} "
          f"{'TTFT ms':>8s} {'TTFT ms':>8s} {'TTFT ms':>8s} {'chunk /':>8s}")
    print(f"{'':>4s} {'tokens':>7s} {'prefix':>7s} {'chunk':>7s} {'':>6s} {'':>6s} "
          f"{'full':>8s} {'prefix':>8s} {'chunk':>8s} {'prefix':>8s}")
    for k in range(len(full)):
        p, c = prefix[k], chunk[k]
        print(f"{k + 1:4d} {p['prompt_tokens']:7d} {p['cached_tokens']:7d} {c['cached_tokens']:7d} "
              f"{c['moved_tokens']:6d} {c['recomputed_tokens']:6d} {full[k]['ttft_p50_s'] * 1000:8.1f} "
              f"{p['ttft_p50_s'] * 1000:8.1f} {c['ttft_p50_s'] * 1000:8.1f} "
              f"{c['ttft_p50_s'] / p['ttft_p50_s']:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
