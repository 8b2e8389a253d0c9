"""The cache drafter (issue 65): drafts copied from the request's own tokens and its namespace's earlier
sequences, verified in one pass, exact.

Greedy outputs with drafting equal those without, token for token and logprob for logprob, on tiny models of
each kind drafting runs on (float32 and bfloat16 folders, a GGUF Q4_1 file), cold, after a prefix hit and in
batches; sampled outputs keep the target's distribution (point-mass rejection sampling, tested statistically);
a draft never crosses a namespace; a grammar cuts a draft at the first forbidden token and forced tokens are
drafted; the cost model keeps rows that pay; configuration errors name the field. Every engine run checks the
cache invariants after each step.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_gguf import gguf_dir, made_gguf  # noqa: F401  (gguf_dir is the fixture made_gguf writes into)
from test_spec import make_agreeing_pair

from kvreuse import LLM, SamplingParams
from kvreuse.cache.hashing import namespace_key
from kvreuse.config import SpeculativeConfig
from kvreuse.engine import LLMEngine
from kvreuse.kernels import paged_attention, quant_ops, rowdot
from kvreuse.model_tools.make_draft import make_random_draft
from kvreuse.sampling import Sampler, SamplingState
from kvreuse.spec.cache_drafter import SHARE_RUN, CacheDrafter, NamespaceStore
from kvreuse.spec.draft_cost import STALE_STEPS, AcceptanceRate, DraftCost, expected_gains
from kvreuse.spec.verify import VerifyItem, verify
from kvreuse.structured_outputs import StructuredOutputsParams

kernels = pytest.mark.skipif(not (paged_attention.available() and rowdot.available() and quant_ops.available()),
                             reason="the CPU kernels do not build here (batch-invariant mode needs them)")
CACHE = {"method": "cache"}
OFF = {"method": "none"}


class FlatCost(DraftCost):
    """Every row count priced the same, so every draft is verified: for the tests of what verification does,
    which must not hang on how fast the machine ran a step (under a loaded CI two workers' steps vary 2x). The
    engine still records its steps into it (``measured_rows``); the cost model's own decisions have their tests
    above, on recorded times."""

    def step_seconds(self, rows: int) -> float | None:
        return 1e-3


def drafting_every_row(llm: LLM) -> LLM:
    llm.engine.spec.cost = FlatCost()
    return llm


# --- the drafter alone -----------------------------------------------------------------------------------------

def test_the_request_s_own_tokens_draft_the_continuation_of_the_longest_match():
    drafter = CacheDrafter(prompt_lookup_min=2, prompt_lookup_max=8, namespace_tokens=0)
    tokens = [1, 2, 3, 4, 5, 6, 9, 9, 3, 4, 7, 8, 2, 3, 4]
    draft = drafter.propose(0, None, tokens, 3)
    # "2 3 4" occurs at the start (followed by 5 6 9) and "3 4" after the 9s (followed by 7): the longer wins.
    assert draft.token_ids == [5, 6, 9] and draft.match_len == 3 and draft.source == "request"
    assert draft.confidence == [1.0, 1.0, 1.0]
    tokens.extend([11, 12])  # the same list grows: indexed incrementally, and "11 12" never occurred before
    assert drafter.propose(0, None, tokens, 3).token_ids == []


def test_occurrences_vote_and_the_share_is_the_confidence():
    drafter = CacheDrafter(prompt_lookup_min=2, prompt_lookup_max=2, namespace_tokens=0)
    tokens = [5, 6, 1, 0, 5, 6, 1, 0, 5, 6, 2, 0, 5, 6]
    draft = drafter.propose(0, None, tokens, 2)
    assert draft.token_ids == [1, 0]
    assert draft.confidence == pytest.approx([2 / 3, 1.0])


def test_a_namespace_drafts_only_from_its_own_sequences():
    drafter = CacheDrafter(prompt_lookup_min=2, prompt_lookup_max=8, namespace_tokens=1000)
    written = list(range(100, 140))
    drafter.finish(1, "tenant-a", written)
    assert drafter.stored_tokens("tenant-a") == 40 and drafter.stored_tokens("tenant-b") == 0
    query = [7, 8, 110, 111, 112]
    same = drafter.propose(2, "tenant-a", list(query), 4)
    assert same.token_ids == [113, 114, 115, 116] and same.source == "namespace"
    assert drafter.propose(3, "tenant-b", list(query), 4).token_ids == []
    assert drafter.propose(4, None, list(query), 4).token_ids == []


def test_all_namespaces_together_stay_within_the_budget_least_recently_used_first():
    drafter = CacheDrafter(prompt_lookup_min=2, prompt_lookup_max=4, namespace_tokens=100)
    drafter.finish(1, "a", list(range(0, 60)))
    drafter.finish(2, "b", list(range(100, 160)))  # over the budget: namespace a, the least recently used, goes
    assert drafter.stored_tokens("a") == 0 and drafter.stored_tokens("b") == 60
    drafter.finish(3, "b", list(range(200, 230)))
    drafter.finish(4, "c", list(range(300, 330)))
    assert drafter.stored_tokens("b") + drafter.stored_tokens("c") <= 100 and drafter.stored_tokens("c") == 30


def test_the_store_keeps_a_shared_prefix_once_and_evicts_the_least_recently_used():
    store = NamespaceStore(key_len=2, budget=3 * SHARE_RUN + 40)
    system = list(range(1000, 1000 + 2 * SHARE_RUN))  # two runs every sequence shares
    store.add(system + [1, 2, 3, 4], overlap=4)
    store.add(system + [5, 6, 7, 8], overlap=4)
    assert store.tokens.num_tokens == 2 * SHARE_RUN + 4 + 8  # the second kept 4 tokens before its own part
    for value in range(10, 60):  # more than the budget: the oldest sequences go, the store stays within it
        store.add([value] * 8 + [value + 1] * 8, overlap=4)
    assert store.tokens.num_tokens <= 3 * SHARE_RUN + 40
    assert all(store.tokens.sequences.values())


# --- the cost model ---------------------------------------------------------------------------------------------

def test_the_draft_length_maximises_expected_tokens_per_second_of_measured_steps():
    cost = DraftCost()
    sure, likely, unlikely = expected_gains([1.0] * 8, 1.0), expected_gains([1.0] * 8, 0.8), expected_gains([1.0] * 8, 0.2)
    assert likely[:3] == pytest.approx([0.8, 0.64, 0.512])
    assert cost.allocate([likely], num_sequences=1) == [0]  # nothing measured: the undrafted step measures it
    cost.record(1, 4.7e-3)
    assert cost.allocate([sure], 1) == [4]  # past what is measured: one pass of 4 rows further at a time
    cost.record(5, 17.1e-3)
    assert cost.allocate([sure], 1) == [8]  # 9 tokens in at most 2 x 17.1 ms beats 1 in 4.7: further still
    # The Xeon's SmolLM2 Q4_1 step (docs/benchmarks.md): cheap up to 4 rows, a jump above.
    for rows, ms in ((1, 4.7), (2, 5.9), (4, 8.0), (5, 17.1), (9, 15.6), (16, 20.3), (17, 21.8), (24, 30.3),
                     (40, 52.0), (64, 80.0), (144, 150.0)):
        cost.record(rows, ms / 1e3)
    assert cost.step_seconds(3) == pytest.approx((5.9 + 8.0) / 2 / 1e3)  # between measured counts
    assert cost.step_seconds(200) is None
    # Sure drafts: all 8 pay (9 tokens in 15.6 ms against 1 in 4.7).
    assert cost.allocate([sure], 1) == [8]
    # Likely ones: 3 of them, in the cheap rows (1 + 0.8 + 0.64 + 0.51 tokens in 8.0 ms), not 8 in the slow ones.
    assert cost.allocate([likely], 1) == [3]
    assert cost.allocate([unlikely], 1) == [0]  # unlikely ones: none
    # 16 streams: a row costs what a token is worth; the same likely draft is not worth it, a certain one is.
    assert cost.allocate([likely], 16) == [0]
    assert cost.allocate([sure], 16) == [8]
    # A step's drafts are sized together: two likely ones alone at one stream would take 3 each; together their
    # best tokens go first and the step stops where the next row costs more than it brings.
    assert cost.allocate([likely, likely], 2) == [1, 1]
    # Past the largest count measured (144) a step goes 4 rows further at most, not the 160 rows offered.
    assert cost.allocate([sure] * 20, 144) == [1] * 4 + [0] * 16
    # Sixteen sure drafts of 8 (144 rows) are not worth what one is: 16 + 8 rows take the best.
    mixed = cost.allocate([sure] + [likely] * 15, 16)
    assert mixed == [8] + [0] * 15
    assert cost.allocate([sure] * 16, 16) == [8] * 16  # 144 rows: 144 tokens in 150 ms against 16 in 20.3


def test_a_row_count_measured_slow_once_is_measured_again():
    cost = DraftCost()
    for rows, ms in ((1, 4.7), (2, 5.9), (3, 7.0), (4, 8.0)):
        cost.record(rows, ms / 1e3)
    likely = expected_gains([1.0] * 3, 0.8)
    assert cost.allocate([likely], 1) == [3]
    cost.record(4, 0.5)  # one step met something else: 4 rows now look slow, so they are not chosen
    assert cost.allocate([likely], 1) == [2]
    for _ in range(STALE_STEPS):  # steps at one row: the 4-row time grows stale
        cost.record(1, 4.7e-3)
    assert cost.allocate([likely], 1) == [3]  # tried again once, to measure it
    assert cost.allocate([likely], 1) == [2]  # and not at every step
    for _ in range(10):
        cost.record(4, 8.0e-3)
    assert cost.allocate([likely], 1) == [3]


def test_the_drafter_is_skipped_only_where_no_draft_could_pay():
    # The Xeon's qwen2.5-0.5b Q8_0 steps (docs/benchmarks.md): the 17th row costs half a step.
    cost = DraftCost()
    for rows, ms in ((1, 26.0), (2, 27.5), (4, 30.0), (11, 47.3), (16, 52.1), (18, 76.2), (19, 76.1)):
        cost.record(rows, ms / 1e3)
    assert not cost.may_pay(16, 16 * 8)  # 16 streams: even certain drafts lose (at most 19 rows are measured)
    assert cost.may_pay(1, 8)  # one stream: a certain draft pays
    assert not cost.may_pay(1, 0)  # nothing to draft
    assert cost.may_pay(19, 8)  # 20 rows were never measured: allocate may explore them
    assert not DraftCost().may_pay(1, 8)  # nothing measured: the step measures its rows undrafted
    # Whenever it says no, allocate keeps nothing, whatever the gains (each at most one).
    rng, skipped = random.Random(0), 0
    for _ in range(300):
        num_sequences = rng.randrange(1, 24)
        drafts = [expected_gains([rng.random() ** 0.3 for _ in range(rng.randrange(1, 9))], rng.random())
                  for _ in range(rng.randrange(1, num_sequences + 1))]
        if not cost.may_pay(num_sequences, sum(map(len, drafts))):
            assert cost.allocate(drafts, num_sequences) == [0] * len(drafts)
            skipped += 1
    assert skipped > 50  # the steps above 11 sequences (82 of these 300)
    for _ in range(STALE_STEPS):  # steps at 16 rows only: the 18- and 19-row times grow stale
        cost.record(16, 52.1e-3)
    assert cost.may_pay(16, 8)  # a re-measurement is due: allocate may choose one


def test_the_acceptance_rate_follows_the_latest_drafts():
    rate = AcceptanceRate()
    for _ in range(10):
        rate.record(num_drafted=4, num_accepted=0)
    assert rate.rate < 0.1
    for _ in range(10):
        rate.record(num_drafted=4, num_accepted=4)
    assert rate.rate > 0.9


# --- verification: a point-mass proposal keeps the target distribution -------------------------------------------

def test_rejection_sampling_of_a_cache_draft_keeps_the_target_distribution():
    vocab = 6
    target_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3]] * 2)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    sampler = Sampler()
    trials = 6000
    counts = torch.zeros(vocab)
    for trial in range(trials):
        drafted = trial % 3  # a cache draft is one token, whatever it is: its proposal is a point mass
        state = SamplingState.create(params, "cpu")
        [result] = verify(sampler, target_logits, [VerifyItem(state, 0, [drafted], None)], lambda i, t, c: None)
        counts[result.token_ids[0]] += 1
    expected = target_logits[0].softmax(-1) * trials
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 25, (counts, expected)  # 5 degrees of freedom: p < 0.0002 by chance


# --- the engine: exact ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def looping_model(tmp_path_factory) -> str:
    """A float32 model whose next token is a function of the current one (test_spec's agreeing target)."""
    target, _ = make_agreeing_pair(tmp_path_factory.mktemp("looping"))
    return str(target)


def echo_prompts(model: str, starts: tuple[int, ...] = (11, 12)) -> list[list[int]]:
    """For each start token, the model's own greedy walk from it, then the start again: from there the model writes
    the walk a second time, which the drafter copies from the prompt."""
    llm = LLM(model, device="cpu", kv_cache_memory="2MiB", dtype="float32", speculative_config=OFF)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    walks = [output.outputs[0].token_ids for output in llm.generate([{"prompt_token_ids": [s]} for s in starts],
                                                                    params)]
    return [[start, *walk, start] for start, walk in zip(starts, walks)]


def looping_prompts(vocab: int = 300) -> list[list[int]]:
    """Prompts that repeat a random phrase (the drafter finds it) and one that repeats nothing."""
    generator = torch.Generator().manual_seed(7)
    phrase = torch.randint(3, vocab, (7,), generator=generator).tolist()
    shared = torch.randint(3, vocab, (21,), generator=generator).tolist()
    return [shared + phrase * 4, shared + phrase * 2 + [5, 6], shared + phrase,
            torch.randint(3, vocab, (30,), generator=generator).tolist()]


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, prefix: str = "r",
                together: bool = True, **options) -> list[tuple[list[int], str]]:
    """Greedy ids and logprobs of each prompt, the cache's invariants checked after every step."""
    done = {}
    groups = [list(enumerate(prompts))] if together else [[item] for item in enumerate(prompts)]
    for group in groups:
        for index, prompt in group:
            engine.add_request(f"{prefix}{index}", {"prompt_token_ids": prompt}, params, **options)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output
            engine.check_integrity()
    assert engine.stats().cache.blocks_in_use == 0
    return [(list(done[f"{prefix}{i}"].outputs[0].token_ids), repr(done[f"{prefix}{i}"].outputs[0].logprobs))
            for i in range(len(prompts))]


KINDS = {  # name: (model, LLM options, whether its greedy walks also reject drafts: the tiny llama accepts all)
    "float32 folder": ("qwen2", dict(dtype="float32", block_size=4), True),
    "bfloat16 folder": ("llama", dict(dtype="bfloat16", block_size=16), False),
    "GGUF Q4_1": ("llama-plain:Q4_1", dict(dtype="bfloat16", block_size=16), True),
}


def model_of(tiny_models, gguf_dir, name: str) -> str:
    arch, _, kind = name.partition(":")
    return str(made_gguf(tiny_models, gguf_dir, arch, kind) if kind else tiny_models[arch])


@kernels
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_output_with_drafts_equals_without_bit_for_bit(tiny_models, gguf_dir, kind):
    name, options, rejects = KINDS[kind]
    path = model_of(tiny_models, gguf_dir, name)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = looping_prompts()
    common = dict(device="cpu", kv_cache_memory="2MiB", batch_invariant=True, **options)
    plain = run_checked(LLM(path, speculative_config=OFF, **common).engine, prompts, params, together=False)
    drafting = drafting_every_row(LLM(path, speculative_config=CACHE, **common)).engine
    alone = run_checked(drafting, prompts, params, prefix="a", together=False)
    # Again, in one batch, every prompt a prefix hit now, and the namespace's store full of the first run.
    batched = run_checked(drafting, prompts, params, prefix="b", together=True)
    assert alone == plain and batched == plain
    stats = drafting.stats().spec_decode
    assert stats.num_accepted_tokens > 0, "nothing was accepted: the test would not see a wrong verification"
    if rejects:  # the wrong drafts' rows were computed and their K/V overwritten, and nothing changed
        assert stats.num_draft_tokens > stats.num_accepted_tokens, "nothing was rejected"


@kernels
def test_by_default_drafting_runs_where_batch_invariant_mode_is_on(tiny_models, gguf_dir, monkeypatch):
    monkeypatch.delenv("KVREUSE_LINEAR_KERNEL", raising=False)
    gguf = made_gguf(tiny_models, gguf_dir, "llama-plain", "Q4_1")
    default = LLM(str(gguf), device="cpu", kv_cache_memory="2MiB")
    assert (default.engine.spec is not None) == bool(default.engine.config.batch_invariant)
    folder = LLM(str(tiny_models["qwen2"]), device="cpu", kv_cache_memory="2MiB", dtype="float32")
    assert folder.engine.config.batch_invariant is False and folder.engine.spec is None
    # Asked for, on a folder: the mode comes on with it.
    asked = LLM(str(tiny_models["qwen2"]), device="cpu", kv_cache_memory="2MiB", dtype="float32",
                speculative_config=CACHE)
    assert asked.engine.config.batch_invariant is True and asked.engine.spec.cache is not None
    assert LLM(str(gguf), device="cpu", kv_cache_memory="2MiB", speculative_config=OFF).engine.spec is None


@kernels
def test_the_cost_model_measures_decode_and_verification_steps_only(looping_model):
    llm = drafting_every_row(LLM(looping_model, device="cpu", kv_cache_memory="2MiB", dtype="float32",
                                 block_size=4, speculative_config=CACHE))
    prompts = echo_prompts(looping_model)
    run_checked(llm.engine, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.stats().spec_decode.num_drafts > 0
    rows = llm.engine.spec.cost.measured_rows
    # Two sequences decoding, each verifying at most 8 drafted tokens: the steps measured; their prefill (one
    # step of both prompts) priced rows low and is left out.
    assert rows and max(rows) <= len(prompts) * (1 + llm.engine.spec.num_speculative_tokens)
    assert sum(map(len, prompts)) not in rows


@kernels
def test_verification_rows_run_in_the_native_step(looping_model):
    llm = drafting_every_row(LLM(looping_model, device="cpu", kv_cache_memory="2MiB", dtype="float32",
                                 block_size=4, speculative_config=CACHE))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    run_checked(llm.engine, echo_prompts(looping_model)[:1], params)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 8
    steps = llm.engine.runner.decode.steps
    assert steps["native_step"] > 0 and steps["layers"] == 0, steps


@kernels
def test_a_namespace_store_drafts_for_the_same_namespace_only(tiny_models):
    llm = LLM(str(tiny_models["qwen2"]), device="cpu", kv_cache_memory="2MiB", dtype="float32", block_size=4,
              speculative_config=CACHE)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = looping_prompts()[3]
    run_checked(engine, [prompt], params, prefix="a", cache_salt="tenant-a")
    own = namespace_key("tenant-a", None, engine.model_name, None)
    other = namespace_key("tenant-b", None, engine.model_name, None)
    assert engine.spec.cache.stored_tokens(own) == len(prompt) + 12
    assert engine.spec.cache.stored_tokens(other) == 0
    # The same prompt's end, asked in the other namespace: nothing to draft from; in its own: the output follows.
    probe = [1, 2] + prompt[-6:]
    assert engine.spec.cache.propose(-1, other, list(probe), 4).token_ids == []
    assert engine.spec.cache.propose(-2, own, list(probe), 4).source == "namespace"


@kernels
def test_seeded_sampling_drafts_nothing_and_unseeded_sampling_drafts(looping_model):
    llm = drafting_every_row(LLM(looping_model, device="cpu", kv_cache_memory="2MiB", dtype="float32",
                                 block_size=4, speculative_config=CACHE))
    prompts = echo_prompts(looping_model)
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=3)
    first = run_checked(llm.engine, prompts, seeded, prefix="s1-")
    assert llm.engine.stats().spec_decode.num_drafts == 0
    assert run_checked(llm.engine, prompts, seeded, prefix="s2-") == first  # and the store full of it changes nothing
    # Unseeded, random rows: verified by rejection sampling (top_k=1 makes the target's p a point mass, so the
    # output is the greedy one and the drafts on the looping model are accepted).
    greedy = run_checked(llm.engine, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), "g-")
    drafted_before = llm.engine.stats().spec_decode.num_drafts
    sampled = run_checked(llm.engine, prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=16,
                                                              ignore_eos=True), prefix="u-")
    assert [ids for ids, _ in sampled] == [ids for ids, _ in greedy]
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > drafted_before and stats.num_accepted_tokens > 0


@kernels
def test_a_grammar_cuts_drafts_and_its_forced_tokens_are_drafted(tiny_models):
    llm = drafting_every_row(LLM(str(tiny_models["qwen2"]), device="cpu", kv_cache_memory="2MiB",
                                 dtype="float32", block_size=4, speculative_config=CACHE))
    plain = LLM(str(tiny_models["qwen2"]), device="cpu", kv_cache_memory="2MiB", dtype="float32", block_size=4,
                batch_invariant=True, speculative_config=OFF)
    pattern = r"The answer is (yes|no)\. Thank you for asking, and goodbye(!|\.)"
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern))
    # The second prompt holds the answer followed by more words: a draft copied from it runs past the grammar's end.
    prompts = ["Reply please.", "Say: The answer is yes. Thank you for asking, and goodbye! See you at the docks."]

    def ended(outputs) -> list[tuple]:
        return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                for o in outputs]

    drafted = ended(llm.generate(prompts, params))
    assert drafted == ended(plain.generate(prompts, params))
    assert all(text.startswith("The answer is ") and "goodbye" in text for text, *_ in drafted)
    stats = llm.engine.stats().spec_decode
    # The fixed words are forced by the grammar: drafted, and every one accepted; the one token drafted past the
    # second prompt's end is the only one refused.
    assert stats.num_accepted_tokens > 10 and stats.num_draft_tokens - stats.num_accepted_tokens == 1
    structured = llm.engine.structured
    engine = llm.engine
    engine.add_request("g", "Reply please.", params)
    request = engine.scheduler.waiting[-1]
    key = id(request)
    while structured.has_pending():
        structured.resolve(block_s=0.1)
    forced = structured.allowed_draft(key, [])
    assert forced and "The answer is ".startswith(llm.get_tokenizer().decode(forced))
    bad = llm.get_tokenizer().encode("xyz", add_special_tokens=False)
    assert structured.allowed_draft(key, bad) == forced  # a forbidden first token: the forced ones instead
    assert structured.allowed_draft(key, forced[:1] + bad) == forced[:1]  # cut at the first forbidden token
    engine.abort_request("g")


@kernels
def test_with_an_eagle_draft_each_step_takes_the_better_draft(looping_model, tmp_path):
    """A random EAGLE draft (accepts almost nothing) beside the cache drafter, batch-invariant mode on: the echoed
    walks are drafted by the cache, the rest by EAGLE, and greedy output is the plain run's."""
    draft = make_random_draft(looping_model, tmp_path / "draft", seed=5)
    both = drafting_every_row(LLM(looping_model, device="cpu", kv_cache_memory="2MiB", dtype="float32",
                                  block_size=4, batch_invariant=True,
                                  speculative_config={"method": "eagle", "model": str(draft),
                                                      "num_speculative_tokens": 2}))
    plain = LLM(looping_model, device="cpu", kv_cache_memory="2MiB", dtype="float32", block_size=4,
                batch_invariant=True, speculative_config=OFF)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = echo_prompts(looping_model) + looping_prompts()[3:]
    assert run_checked(both.engine, prompts, params) == run_checked(plain.engine, prompts, params)
    spec = both.engine.spec
    assert spec.eagle is not None and spec.cache is not None
    assert spec.drafts_by_source["cache"] > 0 and spec.drafts_by_source["eagle"] > 0


def test_bad_speculative_configs_name_the_field(tiny_models):
    for value, field in ((dict(method="cache", num_speculative_tokens=0), "num_speculative_tokens"),
                         (dict(method="cache", prompt_lookup_min=0), "prompt_lookup_min"),
                         (dict(method="cache", prompt_lookup_min=5, prompt_lookup_max=3), "prompt_lookup_max"),
                         (dict(method="cache", namespace_tokens=-1), "namespace_tokens"),
                         (dict(method="cache", model="x"), "model"),
                         (dict(method="ngram", bogus=1), "bogus"),
                         (dict(method="none", num_speculative_tokens=2), "num_speculative_tokens"),
                         (dict(method="suffix"), "method"),
                         ({}, "method")):
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_value(value)
    assert SpeculativeConfig.from_value({"method": "ngram"}).namespace_tokens == 0  # vLLM's: the request only
    assert SpeculativeConfig.from_value('{"method": "cache", "num_speculative_tokens": 4}').as_dict() == {
        "method": "cache", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 16,
        "namespace_tokens": 1 << 17}
    with pytest.raises(ValueError, match="batch_invariant=False"):
        LLM(str(tiny_models["qwen2"]), device="cpu", kv_cache_memory="2MiB", dtype="float32",
            speculative_config=CACHE, batch_invariant=False)
    with pytest.raises(ValueError, match="verifies drafts exactly only in batch-invariant mode.*LoRA"):
        LLM(str(tiny_models["qwen2"]), device="cpu", kv_cache_memory="2MiB", dtype="float32",
            speculative_config=CACHE, enable_lora=True)
