"""Would a token tree beat the cache drafter's one chain? Measured on the real greedy outputs of the four workloads.

Issue 65 asks for a token tree "when the matches branch": several continuations verified in one pass. Before
building tree masks in three attention kernels, this script measures what a tree could bring, on the same
workloads as benchmarks/bench_cache_drafts.py (edit, agent, quote, control; their prompts imported from it):

1. Each workload's requests run offline, one at a time, greedy (``LLM.chat``; agent: its turns in order, under
   its JSON schema). Greedy output does not depend on the drafts, so these are the tokens any drafter must guess.
2. Replaying each request token by token, a fresh ``CacheDrafter`` (the engine's, same settings, fed the same
   finished requests in the same order, one namespace) drafts at every step, and the step takes the accepted
   tokens plus one. Four ways to draft, each a tree of up to ``--draft-tokens`` levels:
   - ``chain``: the drafter's majority chain (what the engine verifies, before the cost model cuts it);
   - ``chain-cut``: the same chain cut just past its last accepted token (knowing the answer): the best any cut
     of this drafter's chain could do, the cost model's ceiling;
   - ``tree-2``: the chain and the runner-up continuation where the occurrences first disagree;
   - ``tree-all``: every distinct continuation of the longest-match occurrences the drafter found (its whole
     candidate set as a trie);
   - ``any-ngram``: the best continuation of every occurrence (the latest 64) of the sequence's last
     ``prompt_lookup_min`` tokens, in its own text or the namespace's store, whatever longer match it has: an
     upper bound for any tree an n-gram drafter over the cache's text could build (its rows are not counted:
     it needs knowing the answer).
   For each: tokens per step and rows per step (a tree's rows: its distinct nodes plus the bonus row).
3. The machine's cost of a step by its rows: one sequence's decode steps run with 0 to R-1 drafted tokens
   appended (always rejected: random tokens), ``--steps`` steps each, the median step time. A mode's rate is its
   tokens over the sum of its steps' times, against the chain's and against one token per one-row step (no
   drafts), and each tree's gain over the chain follows; ``break-even`` is the
   cost of an extra row, as a share of a one-row step, at which the tree would only match the chain (a flat
   per-row price: 1 + c (rows - 1)).

    python benchmarks/bench_draft_trees.py [--model FILE] [--prompts 8] [--max-tokens 160] [--json OUT]

FILE defaults to the packaged SmolLM2-135M-Instruct Q4_1 file. KVREUSE_BENCH_SMOKE=1 runs the tiny preset with
one prompt, 8 tokens and few steps; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache_drafts as workloads  # a sibling script: its prompts and agent loop

from kvreuse.config import CACHE_DRAFT_TOKENS
from kvreuse.inputs import common_prefix_length
from kvreuse.spec.cache_drafter import CacheDrafter, TokenIndex

MODES = ("chain", "chain-cut", "tree-2", "tree-all", "any-ngram")
NAMESPACE = "bench"
ANY_NGRAM_OCCURRENCES = 64


@dataclass
class Conversation:
    """One request as the engine saw it: its prompt's ids and its greedy output's ids."""

    prompt: list[int]
    output: list[int]


@dataclass
class Tally:
    steps: int = 0
    tokens: int = 0
    rows: int = 0
    row_counts: Counter = field(default_factory=Counter)  # rows -> steps with that many


def greedy_conversations(llm, workload: str, prompts: int, max_tokens: int) -> list[Conversation]:
    from kvreuse import SamplingParams
    from kvreuse.structured_outputs import StructuredOutputsParams

    functions = workloads.stdlib_functions()
    jobs = workloads.workload_jobs(workload, range(prompts), functions, workloads.AGENT_TURNS)
    conversations = []
    for job in jobs:
        structured = None
        if job.response_format is not None:
            structured = StructuredOutputsParams(json=job.response_format["json_schema"]["schema"])
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=structured)
        messages = list(job.messages)
        for follow_up in [None, *job.follow_ups]:
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
            output = llm.chat(messages, params, use_tqdm=False)[0]
            conversations.append(Conversation(list(output.prompt_token_ids), list(output.outputs[0].token_ids)))
            messages.append({"role": "assistant", "content": output.outputs[0].text})
    return conversations


def trie_nodes(branches: list[tuple[int, ...]]) -> int:
    """Distinct nodes of the trie the branches make (the rows verifying them as one tree takes)."""
    return len({branch[:depth] for branch in branches for depth in range(1, len(branch) + 1)})


def every_occurrence(indexes: list[TokenIndex], tokens: list[int]) -> list[tuple[list[int], int]]:
    """Every occurrence (the latest ANY_NGRAM_OCCURRENCES per index) of the sequence's last key_len tokens."""
    found = []
    for index in indexes:
        tail = list(tokens[-index.key_len:])
        for entry in index.index.get(hash(tuple(tail)), [])[-ANY_NGRAM_OCCURRENCES:]:
            sequence = index.sequences.get(entry >> 32)
            end = entry & 0xFFFFFFFF
            if sequence is not None and end < len(sequence) and sequence[end - index.key_len:end] == tail:
                found.append((sequence, end))
    return found


def replay(conversations: list[Conversation], mode: str, depth: int, lookup_min: int, lookup_max: int) -> Tally:
    drafter = CacheDrafter(lookup_min, lookup_max, 128 * 1024)
    tally = Tally()
    for key, conversation in enumerate(conversations):
        prompt, output = conversation.prompt, conversation.output
        tokens = list(prompt)
        position = 0
        while position < len(output):
            truth = output[position:position + depth]
            chain = drafter.propose(key, NAMESPACE, tokens, depth).token_ids
            taken, rows = common_prefix_length(chain, truth), len(chain)
            if mode == "chain-cut":  # drafted up to its last accepted token: the row after it yields the next one
                rows = taken
            if chain and mode not in ("chain", "chain-cut"):
                if mode == "any-ngram":
                    for sequence, start in every_occurrence(drafter.indexes(key, NAMESPACE), tokens):
                        taken = max(taken, common_prefix_length(sequence[start:start + depth], truth))
                else:
                    continuations = [tuple(sequence[start:start + depth])
                                     for sequence, start in drafter.occurrences(key, NAMESPACE, tokens)[1]]
                    branches = [tuple(chain)] + tree_branches(mode, tuple(chain), continuations)
                    taken = max(common_prefix_length(branch, truth) for branch in branches)
                    rows = trie_nodes(branches)
            step_tokens = min(taken + 1, len(output) - position)
            tally.steps += 1
            tally.tokens += step_tokens
            tally.rows += rows + 1
            tally.row_counts[rows + 1] += 1
            tokens.extend(output[position:position + step_tokens])
            position += step_tokens
        drafter.finish(key, NAMESPACE, prompt + output)
    return tally


def tree_branches(mode: str, chain: tuple[int, ...], continuations: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    if mode == "tree-all":
        return sorted(set(continuations) - {chain})
    for depth in range(len(chain)):  # tree-2: the runner-up where the occurrences following the chain split
        agreeing = [each for each in continuations if each[:depth] == chain[:depth] and len(each) > depth]
        votes = Counter(each[depth] for each in agreeing)
        if len(votes) > 1:
            runner_up = [token for token, _ in votes.most_common(2)][1]
            return [next(each for each in agreeing if each[depth] == runner_up)]
    return []


def step_costs(llm, max_rows: int, steps: int) -> dict[int, float]:
    """Median seconds of one sequence's decode step with rows - 1 drafted (rejected) tokens, rows 1..max_rows."""
    from kvreuse import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    chooser = random.Random(0)
    engine.add_request("row-costs", "Write a long story about a lighthouse keeper.",
                       SamplingParams(temperature=0, max_tokens=max_rows * steps * 2 + 64, ignore_eos=True))
    while not any(request.num_output_tokens for request in engine.scheduler.running):
        engine.step()  # the prompt
    request = engine.scheduler.running[0]
    costs = {}
    for rows in range(1, max_rows + 1):
        times = []
        for _ in range(steps + 1):
            # Tokens the greedy answer will not take: every one is rejected, so each step yields one token.
            request.spec_token_ids = [chooser.randrange(vocab) for _ in range(rows - 1)]
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        costs[rows] = statistics.median(times[1:])
    engine.abort_request("row-costs")
    return costs


def seconds_at(costs: dict[int, float], rows: int) -> float:
    if rows in costs:
        return costs[rows]
    top = max(costs)  # past the rows measured: the last two counts' line
    return costs[top] + (costs[top] - costs[top - 1]) * (rows - top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or folder (default: the packaged SmolLM2 Q4_1)")
    parser.add_argument("--workloads", default="edit,agent,quote,control")
    parser.add_argument("--prompts", type=int, default=8, help="requests per workload (agent: loops of 6 turns)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--draft-tokens", type=int, default=CACHE_DRAFT_TOKENS, help="a draft's depth")
    parser.add_argument("--steps", type=int, default=24, help="steps timed per row count")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from kvreuse import LLM
    from kvreuse.loading.gguf import packaged_gguf
    from kvreuse.model_tools.make_model import ensure_model

    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":
        print("KVREUSE_BENCH_SMOKE=1: the tiny preset, 1 prompt, 8 tokens, 2 steps a row count; the figures mean "
              "nothing", flush=True)
        args.model, args.prompts, args.max_tokens, args.steps = str(ensure_model("tiny", dtype="float32")), 1, 8, 2
    if args.model is None:  # the packaged SmolLM2 file, or a usage error saying why there is none
        found, why = packaged_gguf()
        args.model = str(found) if found is not None else parser.error(f"--model not given and {why}")
    # The cache drafter asked for by name: it also turns on batch-invariant mode, as the default does on a
    # Q4_1 file; the drafts change no greedy token, and the step costs below are of verification steps.
    llm = LLM(args.model, speculative_config={"method": "cache"})
    drafter = llm.engine.spec.cache
    lookup_min, lookup_max = drafter.min_len, drafter.max_len
    print(f"model {args.model}; draft depth {args.draft_tokens}; prompt lookup {lookup_min}-{lookup_max}", flush=True)

    figures: dict[str, dict] = {}
    tallies: dict[str, dict[str, Tally]] = {}
    for workload in args.workloads.split(","):
        start = time.perf_counter()
        conversations = greedy_conversations(llm, workload, args.prompts, args.max_tokens)
        tallies[workload] = {mode: replay(conversations, mode, args.draft_tokens, lookup_min, lookup_max)
                             for mode in MODES}
        print(f"{workload}: {len(conversations)} requests, {sum(len(c.output) for c in conversations)} output "
              f"tokens ({time.perf_counter() - start:.0f} s)", flush=True)
    max_rows = max(max(tally.row_counts) for by_mode in tallies.values() for tally in by_mode.values())
    costs = step_costs(llm, min(max_rows, 2 * args.draft_tokens + 1), args.steps)
    print("step ms by rows: " + ", ".join(f"{rows}: {seconds * 1e3:.2f}" for rows, seconds in costs.items()))

    print("\n| workload | mode | tokens / step | rows / step | rate vs chain | rate vs no drafts "
          "| break-even row cost |")
    print("|---|---|---|---|---|---|---|")
    for workload, by_mode in tallies.items():
        chain = by_mode["chain"]
        chain_seconds = sum(seconds_at(costs, rows) * count for rows, count in chain.row_counts.items())
        figures[workload] = {}
        for mode, tally in by_mode.items():
            per_step, rows_per_step = tally.tokens / tally.steps, tally.rows / tally.steps
            seconds = sum(seconds_at(costs, rows) * count for rows, count in tally.row_counts.items())
            versus = (tally.tokens / seconds) / (chain.tokens / chain_seconds) if mode != "any-ngram" else None
            # Against one token a step at one row's time (what the same requests take without drafts).
            over_plain = (tally.tokens / seconds) * costs[1] if mode != "any-ngram" else None
            chain_per_step, chain_rows = chain.tokens / chain.steps, chain.rows / chain.steps
            # Rate parity under a flat row price c: T_t / (1 + c (R_t - 1)) = T_c / (1 + c (R_c - 1)).
            denominator = chain_per_step * (rows_per_step - 1) - per_step * (chain_rows - 1)
            even = (per_step - chain_per_step) / denominator if mode in ("tree-2", "tree-all") and denominator > 0 \
                else None
            figures[workload][mode] = {"steps": tally.steps, "tokens": tally.tokens, "tokens_per_step": per_step,
                                       "rows_per_step": rows_per_step, "rate_vs_chain": versus,
                                       "rate_vs_no_drafts": over_plain,
                                       "break_even_row_cost": even}
            print(f"| {workload} | {mode} | {per_step:.3f} | "
                  f"{rows_per_step:.2f}{' (not counted)' if mode == 'any-ngram' else ''} | "
                  f"{'' if versus is None else f'{versus:.3f}x'} | "
                  f"{'' if over_plain is None else f'{over_plain:.3f}x'} | {'' if even is None else f'{even:.3f}'} |")
    one_row = costs[1]
    print("\nmeasured price of an extra row (share of a one-row step): "
          + ", ".join(f"{rows}: {(seconds / one_row - 1) / (rows - 1):.3f}" for rows, seconds in costs.items()
                      if rows > 1))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "draft_tokens": args.draft_tokens, "prompts": args.prompts,
            "max_tokens": args.max_tokens, "step_ms": {rows: seconds * 1e3 for rows, seconds in costs.items()},
            "workloads": figures, "machine": workloads.machine_description()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
