"""benchmarks/bench_draft_trees.py's replay, which no smoke run checks: a tree's rows are its trie's nodes, and on
text where the occurrences split the runner-up branch accepts what the majority chain misses. The smoke run of
the documented command is tests/test_documented_commands.py's."""

from __future__ import annotations

from bench_scripts import load_benchmark


def load_script():
    return load_benchmark("bench_draft_trees")


def test_a_trees_rows_are_its_distinct_nodes():
    bench = load_script()
    assert bench.trie_nodes([(1, 2, 3), (1, 2, 4), (5,)]) == 5
    assert bench.trie_nodes([(1, 2, 3)]) == 3
    assert bench.trie_nodes([]) == 0


def test_the_runner_up_branch_takes_what_the_chain_misses():
    bench = load_script()
    Conversation = bench.Conversation
    # Two earlier answers after (1, 2) go on 3 4 5 6, one goes on 20 21 22 23; the last request's answer is the
    # minority's, so the majority chain is rejected at its first token and the runner-up branch is taken whole.
    conversations = [Conversation([7, 1, 2], [3, 4, 5, 6]), Conversation([8, 1, 2], [3, 4, 5, 6]),
                     Conversation([6, 1, 2], [20, 21, 22, 23]), Conversation([9, 1, 2], [20, 21, 22, 23])]
    tallies = {mode: bench.replay(conversations, mode, 8, 2, 16) for mode in bench.MODES}
    chain, tree2 = tallies["chain"], tallies["tree-2"]
    assert chain.tokens == tree2.tokens == sum(len(c.output) for c in conversations)
    assert tree2.steps == chain.steps - 1  # the last request in one step instead of two
    assert tallies["any-ngram"].steps <= tallies["tree-all"].steps <= tree2.steps
    # Cut just past its last accepted token the chain takes the same steps with fewer rows: the last request's
    # first step (the chain rejected at once) verifies nothing but its own row.
    cut = tallies["chain-cut"]
    assert (cut.steps, cut.tokens) == (chain.steps, chain.tokens)
    assert chain.rows > cut.rows >= cut.tokens
    # The last request's first tree: the chain's 4 nodes, the runner-up's 4, and the bonus row.
    assert tree2.row_counts[9] == 1 and chain.row_counts[9] == 0


def test_the_step_cost_line_past_the_rows_measured():
    bench = load_script()
    costs = {1: 1.0, 2: 1.5, 3: 2.5}
    assert bench.seconds_at(costs, 2) == 1.5
    assert bench.seconds_at(costs, 5) == 4.5  # 2.5 + 1.0 a row, the last two counts' slope
