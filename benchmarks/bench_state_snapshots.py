"""A hybrid's state snapshots in the engine: the tokens resumed against the snapshot budget, LRU against ``saved``.

Qwen3.5's Gated DeltaNet layers keep one state per sequence; a prefix hit resumes from a snapshot of it (docs/models.md).
This runs the issue's mixed trace through kvreuse's engine (``LLM``, offline, one request at a time, greedy): 4 chats
of 8 turns (each turn its whole history, the previous answer included, and 24 new tokens) taking turns with questions
after a shared 1,000-token system prompt (8 between each round of chat turns), at each snapshot budget
(``state_snapshot_fraction`` set so the snapshots hold that many states) and retention policy. Per request it counts
the tokens reused (the response's cached_tokens: resumed from a snapshot) against the ideal (every token an earlier
request computed: the previous turn's prompt and answer, or the system prompt after the first question), and the
requests that reused at least 95% of their ideal. The K/V pool holds every block (a hit is only ever cut short by a
missing state). The hit rates do not depend on the model's size, so it runs the tiny-qwen3.5 preset; the bytes a
snapshot takes at Qwen3.5-0.8B's shapes come from its config.

    python benchmarks/bench_state_snapshots.py --json state_snapshots.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

from kvreuse import LLM, SamplingParams
from kvreuse.model_tools.make_model import make_model
from kvreuse.models.config import ModelConfig

POOL_BYTES = 64 * 2**20


def trace(rng: random.Random, chats: int, turns: int, questions: int, system_tokens: int, turn_tokens: int,
          vocab: int) -> list[tuple[str, int, list[int]]]:
    """(kind, chat index or -1, new tokens) in the order sent: each round one turn of every chat, then questions."""
    new = lambda count: [rng.randrange(3, vocab) for _ in range(count)]  # noqa: E731
    system = new(system_tokens)
    order: list[tuple[str, int, list[int]]] = []
    for _ in range(turns):
        for chat in range(chats):
            order.append(("chat", chat, new(turn_tokens)))
        for _ in range(questions):
            order.append(("question", -1, system + new(turn_tokens)))
    return order


def run(model: str, policy: str, snapshots: int, state_bytes: int, order: list[tuple[str, int, list[int]]],
        answer_tokens: int, system_tokens: int) -> dict:
    llm = LLM(model, dtype="float32", device="cpu", kv_cache_memory=POOL_BYTES, block_size=16, max_num_seqs=1,
              state_snapshot_fraction=(snapshots + 0.5) * state_bytes / POOL_BYTES, state_snapshot_policy=policy)
    assert llm.engine.kv.states.num_slots == 1 + snapshots
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    history: dict[int, list[int]] = {}
    reused = ideal = near = requests = 0
    system_seen = False
    for kind, chat, tokens in order:
        if kind == "chat":
            before = history.get(chat, [])
            prompt = before + tokens
            best = max(0, len(before) - 1) if before else 0  # all but the last answer token (never computed)
        else:
            prompt = tokens
            best = system_tokens if system_seen else 0
            system_seen = True
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        if kind == "chat":
            history[chat] = prompt + list(output.outputs[0].token_ids)
        if best:
            requests += 1
            reused += min(output.num_cached_tokens, best)
            ideal += best
            near += output.num_cached_tokens >= 0.95 * best
    llm.engine.check_integrity()
    return {"policy": policy, "snapshots": snapshots, "reused": reused, "ideal": ideal,
            "reused_share": reused / ideal if ideal else 0.0, "requests": requests, "requests_95": near,
            "snapshot_bytes_kept": llm.engine.kv.states.snapshots.num_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="1,2,4,8,16", help="snapshots the budget holds, comma-separated")
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--questions", type=int, default=8, help="system-prompt questions after each round of turns")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--turn-tokens", type=int, default=24)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    budgets = [int(value) for value in args.budgets.split(",")]
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented command this way
        budgets, args.turns, args.questions, args.system_tokens = [1, 4], 2, 2, 40
        print("KVREUSE_BENCH_SMOKE=1: the smallest sizes; the figures mean nothing")
    with tempfile.TemporaryDirectory() as folder:
        real = ModelConfig.from_pretrained(make_model(Path(folder) / "qwen3.5-0.8b", preset="qwen3.5-0.8b",
                                                      write_weights=False))
        model = make_model(Path(folder) / "tiny-qwen3.5", preset="tiny-qwen3.5", dtype="float32", seed=1)
        config = ModelConfig.from_pretrained(model)
        order = trace(random.Random(args.seed), args.chats, args.turns, args.questions, args.system_tokens,
                      args.turn_tokens, min(config.vocab_size, 1000))
        results = [run(str(model), policy, count, config.state_bytes, order, args.answer_tokens, args.system_tokens)
                   for count in budgets for policy in ("lru", "saved")]
    share = lambda count: count * real.state_bytes / (2**30)  # noqa: E731
    print(f"a snapshot at Qwen3.5-0.8B's shapes: {real.state_bytes / 2**20:.1f} MiB "
          f"({len(real.state_layers)} Gated DeltaNet layers)")
    print(f"trace: {args.chats} chats x {args.turns} turns, {args.questions} questions after a {args.system_tokens}-token "
          f"system prompt per round; {len(order)} requests")
    print("| snapshots kept (0.8B: GiB) | lru: reused / ideal (requests >= 95%) | saved: reused / ideal (requests >= 95%) |")
    print("|---|---|---|")
    for count in budgets:
        cells = [next(r for r in results if r["snapshots"] == count and r["policy"] == policy) for policy in ("lru", "saved")]
        print(f"| {count} ({share(count):.2f}) | " + " | ".join(
            f"{cell['reused_share']:.3f} ({cell['requests_95']}/{cell['requests']})" for cell in cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"snapshot_bytes_qwen3_5_0_8b": real.state_bytes, "results": results,
                                               "trace": {key: getattr(args, key) for key in (
                                                   "chats", "turns", "questions", "system_tokens", "turn_tokens",
                                                   "answer_tokens", "seed")}}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
