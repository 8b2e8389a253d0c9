"""Where to keep a hybrid model's recurrent state, and which snapshots to keep: a simulation on the issue's workloads.

A hybrid model (Qwen3.5, LFM2, Nemotron-H) reuses a cached prefix only up to the deepest state snapshot at or
before the match (kvreuse/cache/state_snapshots.py); the tokens after it are recomputed. This script replays
request traces through the real prefix index (kvreuse/cache/prefix.py, a pool large enough that no block is
evicted, so only the snapshots' budget limits reuse) and the real snapshot index, and counts, for every request,
the tokens a transformer would reuse (the match) against those the hybrid reuses (the snapshot's position).
No model runs: what is measured is the placement and retention of snapshots, in tokens; a snapshot's bytes are the
model's (a fixed size per snapshot: the budget is given in snapshots).

Workloads (token ids are random; block size 16; prefill in chunks of 512 tokens):
- chat: 4 conversations of 8 turns, interleaved; each turn's prompt is the whole conversation so far and a new
  user message (30-80 tokens), its answer 60-150 tokens. Ideal: every turn reuses all of the previous turn;
- system: a 1,000-token system prompt and 32 questions (32-64 tokens) after it, answers of 64;
- short: a 40-token shared prefix (shorter than vLLM's hybrid blocks of 528 tokens and more) and 32 requests;
- mixed: another chat and another system prompt's questions at once, a request of each in turn.

Placements (where the engine takes snapshots while it computes a request):
- ``block-528``: every 528 tokens, kept without limit (vLLM's hybrid blocks; a reference, not a policy);
- ``finish``: where each request ends (prompt and answer: the next chat turn starts there);
- ``chunk``: also at each prefill chunk's end;
- ``branch``: also where the request left the cached path (its match's end, when no snapshot is there): the next
  request on that branch resumes from it; the engine ends a prefill chunk there to take it;
- ``branch+chunk``: both.
Retention: ``lru`` against ``saved`` (the least compute saved per byte first), at budgets of 4 to 256 snapshots.

    python benchmarks/simulate_state_snapshots.py [--budgets 4,8,16,32,64,256] [--seed 0] [--json OUT]

KVREUSE_BENCH_SMOKE=1 runs the same with fewer requests; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvreuse.cache.blocks import BlockPool
from kvreuse.cache.hashing import block_key, extend_block_keys
from kvreuse.cache.prefix import CacheNode, PrefixIndex
from kvreuse.cache.state_snapshots import POLICIES, StateSnapshots

BLOCK = 16
CHUNK = 512
VLLM_BLOCK = 528
PLACEMENTS = ("finish", "chunk", "branch", "branch+chunk")
SNAPSHOT_BYTES = 1  # the budget counts snapshots


@dataclass
class Request:
    conversation: int  # -1: none (its answer is not continued)
    prompt: list[int]
    answer: list[int]


@dataclass
class Tally:
    ideal: int = 0  # tokens a transformer reuses (the prefix match)
    reused: int = 0  # tokens resumed from a snapshot
    turns: int = 0  # requests with something to reuse
    near_ideal: int = 0  # requests that reused at least 95% of their match
    misses: list[str] = field(default_factory=list)


def chat_trace(rng: random.Random, conversations: int, turns: int) -> list[Request]:
    history = [[1, 2, 3] + [rng.randrange(1000, 30000) for _ in range(60)] for _ in range(conversations)]
    trace = []
    for _ in range(turns):
        for index in range(conversations):
            prompt = history[index] + [7, 8] + [rng.randrange(1000, 30000) for _ in range(rng.randint(30, 80))] + [9]
            answer = [rng.randrange(1000, 30000) for _ in range(rng.randint(60, 150))] + [10]
            trace.append(Request(index, prompt, answer))
            history[index] = prompt + answer
    return trace


def shared_trace(rng: random.Random, prefix_len: int, requests: int) -> list[Request]:
    prefix = [rng.randrange(1000, 30000) for _ in range(prefix_len)]
    return [Request(-1, prefix + [rng.randrange(1000, 30000) for _ in range(rng.randint(32, 64))],
                    [rng.randrange(1000, 30000) for _ in range(64)]) for _ in range(requests)]


class Replay:
    """The prefix index and snapshot index of one engine, fed one request at a time."""

    def __init__(self, placement: str, policy: str, budget: int | None) -> None:
        self.placement = placement
        self.index = PrefixIndex(BlockPool(1 << 16), BLOCK)
        self.snapshots = StateSnapshots(BLOCK, budget if budget is not None else 1 << 40, policy)
        self.namespace = b"simulated"

    def run(self, request: Request, tally: Tally) -> None:
        tokens = request.prompt
        keys: list[bytes] = []
        extend_block_keys(keys, self.namespace, tokens, BLOCK)
        match = self.index.match(self.namespace, tokens, keys, len(tokens) - 1)
        root = self.index.roots.get(self.namespace)
        if self.placement == "block-528":
            resume = match.num_tokens // VLLM_BLOCK * VLLM_BLOCK
        elif root is None:
            resume = 0
        else:
            hit = self.snapshots.lookup(root, match.nodes, tokens, match.num_tokens)
            resume = hit.resume
            if hit.explanation and len(tally.misses) < 3:
                tally.misses.append(hit.explanation)
        if match.num_tokens:
            tally.turns += 1
            tally.ideal += match.num_tokens
            tally.reused += resume
            tally.near_ideal += resume >= 0.95 * match.num_tokens
        everything = tokens + request.answer
        nodes = self._insert(everything)
        if self.placement == "block-528":
            return
        positions = {len(everything)}  # finish
        if "chunk" in self.placement:
            positions |= set(range(resume + CHUNK, len(tokens), CHUNK))
        if "branch" in self.placement and match.num_tokens > resume:
            positions.add(match.num_tokens)
        root = self.index.roots[self.namespace]
        for position in sorted(positions):
            anchor = nodes[position // BLOCK - 1] if position >= BLOCK else root
            reason = "finish" if position == len(everything) else "branch" if position == match.num_tokens else "chunk"
            self.snapshots.add(anchor, everything[position // BLOCK * BLOCK:position], SNAPSHOT_BYTES, None, reason)

    def _insert(self, tokens: list[int]) -> list[CacheNode]:
        keys: list[bytes] = []
        extend_block_keys(keys, self.namespace, tokens, BLOCK)
        parent: CacheNode | None = None
        nodes = []
        for number, key in enumerate(keys):
            held = parent if parent is not None else self.index.roots.get(self.namespace)
            node = held.children.get(key) if held is not None else None
            if node is None:
                block = tokens[number * BLOCK:(number + 1) * BLOCK]
                node = self.index.insert(self.namespace, parent, key, block, self.index.pool.allocate(1)[0])
            nodes.append(node)
            parent = node
        rest = tokens[len(keys) * BLOCK:]
        if rest and parent is not None:  # the partly filled last block, as the engine keeps it (a partial match)
            tail_key = block_key(keys[-1], rest)
            if tail_key not in parent.children:
                self.index.insert(self.namespace, parent, tail_key, rest, self.index.pool.allocate(1)[0], tail=True)
        return nodes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="4,8,16,32,64,256", help="snapshots kept at most, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = {"conversations": 4, "turns": 8, "questions": 32}
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":
        print("KVREUSE_BENCH_SMOKE=1: 2 conversations of 3 turns, 4 questions; the figures mean nothing", flush=True)
        sizes = {"conversations": 2, "turns": 3, "questions": 4}
    budgets = [int(value) for value in args.budgets.split(",")]
    rng = random.Random(args.seed)
    traces = {"chat": chat_trace(rng, sizes["conversations"], sizes["turns"]),
              "system": shared_trace(rng, 1000, sizes["questions"]),
              "short": shared_trace(rng, 40, sizes["questions"])}
    # Both at once, one request of each in turn: the conversations' snapshots compete with the system prompt's.
    traces["mixed"] = [request for pair in zip(chat_trace(rng, sizes["conversations"], sizes["turns"]),
                                               shared_trace(rng, 1000, sizes["questions"])) for request in pair]
    results: dict[str, dict] = {}
    print(f"\nblock {BLOCK}, prefill chunks of {CHUNK}; reused / ideal tokens (requests reusing >= 95% of their match)")
    for name, trace in traces.items():
        results[name] = {}
        print(f"\n{name}: {len(trace)} requests")
        print("| placement | policy | " + " | ".join(f"budget {budget}" for budget in budgets) + " |")
        print("|---|---|" + "---|" * len(budgets))
        rows = [("block-528", "-")] + [(placement, policy) for placement in PLACEMENTS for policy in POLICIES]
        for placement, policy in rows:
            cells = []
            for budget in budgets:
                replay = Replay(placement, policy if policy != "-" else "lru", None if placement == "block-528"
                                else budget)
                tally = Tally()
                for request in trace:
                    replay.run(request, tally)
                    replay.snapshots.check_integrity()
                share = tally.reused / tally.ideal if tally.ideal else 0.0
                results[name][f"{placement}/{policy}/{budget}"] = {
                    "reused": tally.reused, "ideal": tally.ideal, "share": share, "requests": tally.turns,
                    "near_ideal": tally.near_ideal, "kept": len(replay.snapshots), "misses": tally.misses}
                cells.append(f"{share:.3f} ({tally.near_ideal}/{tally.turns})")
            print(f"| {placement} | {policy} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"block": BLOCK, "chunk": CHUNK, "budgets": budgets, "seed": args.seed,
                                               "results": results}, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
