"""EAGLE speculative decoding: lossless outputs, draft K/V reused exactly, no lost cache hits.

Three drafts per target: a random one (accepts almost nothing), one built to agree with its target
(accepts everything), and the agreeing one corrupted at one draft position. Every engine run here
checks the cache invariants after each step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvreuse import LLM, SamplingParams
from kvreuse.cache.hashing import extend_block_keys, namespace_key
from kvreuse.config import SpeculativeConfig
from kvreuse.engine import LLMEngine
from kvreuse.model_tools.make_draft import (
    draft_config,
    make_random_draft,
    random_draft_tensors,
    write_draft,
)
from kvreuse.model_tools.make_model import make_model
from kvreuse.models.config import ModelConfig
from kvreuse.sampling import Sampler, SamplingState
from kvreuse.spec.proposer import Proposal
from kvreuse.spec.verify import VerifyItem, verify

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def spec(draft: Path, k: int, method: str = "eagle") -> dict:
    return {"method": method, "model": str(draft), "num_speculative_tokens": k}


def make_llm(model_dir: Path, draft: Path | None = None, k: int = 2, method: str = "eagle", **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=BLOCK)
    options.update(kwargs)
    if draft is not None:
        options["speculative_config"] = spec(draft, k, method)
    return LLM(str(model_dir), **options)


def prompt_ids(seed: int, length: int, vocab: int = 300) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY,
                prefix: str = "r") -> list:
    """Step the engine to completion, checking the cache invariants after every step."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{index}", {"prompt_token_ids": prompt}, params)
    done = {}
    for _ in range(10_000):
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    stats = engine.stats().cache
    assert stats.blocks_in_use == 0, "a finished workload left blocks in use"
    return [done[f"{prefix}{index}"] for index in range(len(prompts))]


def tokens_of(outputs: list) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """A random EAGLE-1 and EAGLE-3 draft for the llama tiny model, and an agreeing target/draft pair."""
    root = tmp_path_factory.mktemp("drafts")
    target = tiny_models["llama"]
    folders = {
        "target": target,
        "random": make_random_draft(target, root / "random", seed=5),
        "random3": make_random_draft(target, root / "random3", method="eagle3", seed=6, aux_layers=(0, 1, 1)),
    }
    agree_target, agree_draft = make_agreeing_pair(root)
    folders["agree_target"] = agree_target
    folders["agree"] = agree_draft
    return folders


def make_agreeing_pair(root: Path, noise: float = 0.0) -> tuple[Path, Path]:
    """A target whose attention and MLP add nothing (o_proj = down_proj = 0), so its next token is
    argmax(lm_head(norm(embed(token)))), and a draft that passes the embedding straight through
    (fc = [I | 0], its own o_proj = down_proj = 0): argmax(lm_head(embed(token))), the same token
    because RMSNorm only rescales the row. Its K/V are still written and read. ``noise`` perturbs fc so
    the draft agrees only on some tokens."""
    target = make_model(root / "agree-target", preset="tiny", arch="llama", dtype="float32", seed=2)
    weights = load_file(target / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    dconfig = draft_config(config, "eagle")
    tensors = random_draft_tensors(dconfig, "eagle", seed=7)
    hidden = config["hidden_size"]
    passthrough = torch.eye(hidden)
    if noise:
        passthrough += noise * torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(3)) / hidden ** 0.5
    tensors["fc.weight"] = torch.cat((passthrough, torch.zeros(hidden, hidden)), dim=1)
    tensors["layers.0.self_attn.o_proj.weight"].zero_()
    tensors["layers.0.mlp.down_proj.weight"].zero_()
    return target, write_draft(root / "agree", dconfig, tensors)


# --- losslessness --------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("kind", ["random", "random3", "agree", "disagree"])
def test_greedy_output_equals_no_speculation(drafts, kind, k):
    """Cold, then warm (whole prompts cached), then prompts hitting mid-block, in a batch of different
    lengths: token for token the same as without speculation."""
    target = drafts["agree_target"] if kind in ("agree", "disagree") else drafts["target"]
    draft = drafts["agree" if kind == "disagree" else kind]
    method = "eagle3" if kind == "random3" else "eagle"
    shared = prompt_ids(1, 13)
    prompts = [shared + prompt_ids(10 + i, 3 + 4 * i) for i in range(3)] + [prompt_ids(30, 7)]
    mid_block = [shared[:10] + prompt_ids(40, 6), shared + prompt_ids(41, 1)]
    base = make_llm(target).engine
    expected = [tokens_of(run_checked(base, batch, prefix=f"b{i}-")) for i, batch in
                enumerate((prompts, prompts, mid_block))]
    engine = make_llm(target, draft, k, method).engine
    if kind == "disagree":
        corrupt_position(engine, position=min(1, k - 1))
    got = [tokens_of(run_checked(engine, batch, prefix=f"s{i}-")) for i, batch in
           enumerate((prompts, prompts, mid_block))]
    assert got == expected
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > 0
    if kind == "agree":
        assert stats.acceptance_rate == 1.0
    if kind == "disagree":
        position = min(1, k - 1)
        assert stats.accepted_per_position[position:] == [0] * (k - position)
        assert all(count == stats.num_drafts for count in stats.accepted_per_position[:position])


def corrupt_position(engine: LLMEngine, position: int) -> None:
    """Make the draft wrong at one chain position (the proposer's other positions are untouched)."""
    proposer = engine.proposer
    assert proposer is not None
    original = proposer.run
    vocab = engine.model_config.vocab_size

    def run(jobs):
        proposals: dict[int, Proposal] = original(jobs)
        for proposal in proposals.values():
            if len(proposal.token_ids) > position:
                proposal.token_ids[position] = (proposal.token_ids[position] + 1) % vocab
        return proposals

    proposer.run = run  # type: ignore[method-assign]


def test_chunked_prefill_preemption_and_n_greater_than_one(drafts):
    target, draft = drafts["target"], drafts["random"]
    prompts = [prompt_ids(50 + i, 18 + 3 * i) for i in range(6)]
    expected = tokens_of(run_checked(make_llm(target).engine, prompts))
    # Chunked prefill: a 16-token budget splits every prompt and mixes chunks with verifications.
    chunked = make_llm(target, draft, 3, max_num_batched_tokens=16).engine
    assert tokens_of(run_checked(chunked, prompts)) == expected
    # Preemption: 24 blocks of 4 for 6 requests of ~45 tokens (plus lookahead): forced.
    config = ModelConfig.from_pretrained(target)
    per_token = config.kv_bytes_per_token(torch.float32) + (2 * config.kv_size + config.hidden_size) * 4
    tight = make_llm(target, draft, 3, kv_cache_memory=per_token * BLOCK * 24, max_model_len=64).engine
    assert tight.kv.pool.num_blocks == 24
    assert tokens_of(run_checked(tight, prompts)) == expected
    assert tight.stats().num_preemptions > 0
    # n > 1: greedy samples equal each other and the single-sample output.
    outputs = run_checked(make_llm(target, draft, 2).engine, prompts[:2],
                          SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True))
    for output, want in zip(outputs, expected[:2]):
        assert [sample.token_ids for sample in output.outputs] == [want, want]


def test_stop_strings_eos_and_max_tokens_end_where_they_would_without_speculation(drafts):
    target = drafts["agree_target"]  # accepts every draft, so stops land inside accepted runs
    llm_plain, llm_spec = make_llm(target), make_llm(target, drafts["agree"], 4)
    prompts = ["Hello there, how are you", "The quick brown fox jumps", "abc def ghi"]
    plain = llm_plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for index, output in enumerate(plain):
        text = output.outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        eos = output.outputs[0].token_ids[5]
        for params in (SamplingParams(temperature=0, max_tokens=30, stop=[stop]),
                       SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[eos]),
                       SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)):
            want = llm_plain.generate([prompts[index]], params)[0].outputs[0]
            got = llm_spec.generate([prompts[index]], params)[0].outputs[0]
            assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
                (want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert llm_spec.stats()["spec_decode_acceptance_rate"] == 1.0


def test_lora_adapter_with_speculation_matches_without(drafts, tmp_path):
    pytest.importorskip("peft")
    from test_lora import make_adapter

    from kvreuse.lora.request import LoRARequest

    target = drafts["target"]
    adapter = make_adapter(target, tmp_path / "adapter", rank=4)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [prompt_ids(70 + i, 12 + i) for i in range(3)]
    plain = make_llm(target, enable_lora=True).generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                          lora_request=lora)
    llm = make_llm(target, drafts["random"], 3, enable_lora=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    base = make_llm(target).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in base]


# --- the cache: nothing lost, nothing wrong -----------------------------------------------------

def test_cached_tokens_are_the_same_with_and_without_speculation(drafts):
    target, draft = drafts["target"], drafts["random"]
    system = prompt_ids(80, 22)
    prompts = [system + prompt_ids(81 + i, 5 + i) for i in range(4)] + [system[:9] + prompt_ids(90, 4)]
    cached = []
    for engine in (make_llm(target).engine, make_llm(target, draft, 3).engine):
        outputs = [run_checked(engine, [prompt], prefix=f"c{i}-")[0] for i, prompt in enumerate(prompts)]
        cached.append([output.num_cached_tokens for output in outputs])
        cached.append(engine.stats().cache.hit_tokens)
    assert cached[0] == cached[2] and cached[1] == cached[3]
    assert sum(cached[0]) > 0


def _draft_state(engine: LLMEngine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The draft layer's K/V and the features of every cached full block of ``tokens``."""
    keys: list[bytes] = []
    namespace = namespace_key(None, None, engine.model_name, engine.draft_digest)
    extend_block_keys(keys, namespace, tokens, engine.kv.block_size)
    match = engine.kv.index.match(namespace, tokens, keys, len(tokens))
    slots = torch.tensor([node.block_id * BLOCK + offset for node in match.nodes for offset in range(BLOCK)])
    layer = engine.model_config.num_hidden_layers
    kv = engine.kv_cache
    assert kv.features is not None
    return kv.kv[layer][:, slots].clone(), kv.features[slots].clone(), len(match.nodes)


def test_draft_kv_after_a_prefix_hit_equals_the_draft_kv_computed_cold(drafts):
    """A prompt that reuses a cached prefix (full blocks and a partial one) ends up with exactly the
    draft K/V and features a cold engine computes for it: nothing at the hit boundary is stale."""
    target, draft = drafts["target"], drafts["random"]
    shared = prompt_ids(100, 14)  # 3 full blocks and 2 tokens of a fourth
    first, second = shared + prompt_ids(101, 9), shared + prompt_ids(102, 11)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    warm = make_llm(target, draft, 2).engine
    run_checked(warm, [first], params, prefix="w1-")
    [hit] = run_checked(warm, [second], params, prefix="w2-")
    assert hit.num_cached_tokens == 14
    cold = make_llm(target, draft, 2).engine
    [fresh] = run_checked(cold, [second], params, prefix="c-")
    assert fresh.num_cached_tokens == 0 and hit.outputs[0].token_ids == fresh.outputs[0].token_ids
    sequence = second + hit.outputs[0].token_ids
    warm_kv, warm_features, warm_blocks = _draft_state(warm, sequence)
    cold_kv, cold_features, cold_blocks = _draft_state(cold, sequence)
    assert warm_blocks == cold_blocks >= 6
    torch.testing.assert_close(warm_kv, cold_kv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(warm_features, cold_features, rtol=1e-4, atol=1e-5)
    assert float(warm_kv.abs().sum()) > 0  # the draft layer was really written


def test_pinned_system_prompt_hits_with_speculation(drafts):
    target, draft = drafts["target"], drafts["random"]
    system = prompt_ids(110, 21)
    llm = make_llm(target, draft, 2)
    pin = llm.pin(system)
    assert pin["tokens"] == 20
    [output] = llm.generate([{"prompt_token_ids": system + prompt_ids(111, 5)}], GREEDY)
    # The 20 pinned tokens, and the 21st from the tail the pinning request left (its draft K/V too).
    assert output.num_cached_tokens == 21 and output.pins_hit == [pin["id"]]
    [plain] = make_llm(target).generate([{"prompt_token_ids": system + prompt_ids(111, 5)}], GREEDY)
    assert output.outputs[0].token_ids == plain.outputs[0].token_ids


def test_the_draft_is_part_of_the_cache_namespace(drafts):
    """Engines with another draft, or none, compute other block keys: no block of one is read as the other's."""
    target = drafts["target"]
    digests = {make_llm(target, drafts[name], 2, "eagle3" if name == "random3" else "eagle").engine.draft_digest
               for name in ("random", "random3")}
    assert len(digests) == 2 and None not in digests
    same = make_llm(target, drafts["random"], 4).engine.draft_digest
    assert same in digests  # the digest is of the draft's files, not of k or the process


# --- sampling: rejection sampling keeps the target's distribution ---------------------------------

def test_rejection_sampling_keeps_the_target_distribution():
    vocab = 6
    target_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3]] * 2)
    draft_q = torch.tensor([0.05, 0.05, 0.6, 0.1, 0.1, 0.1])
    params = SamplingParams(temperature=1.0, max_tokens=8)
    sampler = Sampler()
    trials = 6000
    counts = torch.zeros(vocab)
    generator = torch.Generator().manual_seed(0)
    for _ in range(trials):
        drafted = int(torch.multinomial(draft_q, 1, generator=generator))
        state = SamplingState.create(params, "cpu")
        [result] = verify(sampler, target_logits, [VerifyItem(state, 0, [drafted], draft_q.unsqueeze(0))],
                          lambda i, t, c: None)
        counts[result.token_ids[0]] += 1
    expected = target_logits[0].softmax(-1) * trials
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 25, (counts, expected)  # 5 degrees of freedom: p < 0.0002 by chance


def test_seeded_sampling_with_speculation_is_reproducible(drafts):
    llm = make_llm(drafts["agree_target"], drafts["agree"], 3)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=11)
    prompts = ["one two three", "four five six seven"]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert first == second
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


# --- counters and configuration -------------------------------------------------------------------

def test_counters_add_up(drafts):
    llm = make_llm(drafts["agree_target"], drafts["agree"], 4)
    corrupt_position(llm.engine, position=2)
    llm.generate([{"prompt_token_ids": prompt_ids(120 + i, 9 + i)} for i in range(3)], GREEDY)
    stats = llm.stats()
    per_position = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_position) == 4 and sum(per_position) == stats["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))
    assert per_position[2:] == [0, 0] and per_position[0] > 0
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    assert stats["spec_decode_acceptance_rate"] == pytest.approx(
        stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"])


def test_bad_speculative_configs_and_drafts_fail_with_the_reason(drafts, tmp_path):
    target = drafts["target"]
    for value, field in ((dict(method="medusa", model="x", num_speculative_tokens=2), "method"),
                         (dict(method="eagle", model="x", num_speculative_tokens=0), "num_speculative_tokens"),
                         (dict(method="eagle", model="x"), "num_speculative_tokens"),
                         (dict(method="eagle", model="x", num_speculative_tokens=2, extra=1), "extra"),
                         ("{not json", "JSON")):
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_value(value)
    with pytest.raises(ValueError, match="holds an 'eagle3' draft"):
        make_llm(target, drafts["random3"], 2, "eagle")
    with pytest.raises(ValueError, match="not a folder"):
        make_llm(target, tmp_path / "missing", 2)
    # A draft for another model size: the hidden size does not fit.
    other = make_model(tmp_path / "other", preset="tiny", dtype="float32")
    config = json.loads((other / "config.json").read_text())
    config.update(hidden_size=config["hidden_size"] * 2, intermediate_size=256)
    wrong = write_draft(tmp_path / "wrong", draft_config(config, "eagle"),
                        random_draft_tensors(draft_config(config, "eagle"), "eagle"))
    with pytest.raises(ValueError, match="hidden_size"):
        make_llm(target, wrong, 2)
    # Not an EAGLE folder at all: the target itself.
    with pytest.raises(ValueError, match="not an EAGLE draft"):
        make_llm(target, target, 2)


def test_disk_tier_keeps_the_draft_kv_with_the_target_kv(drafts, tmp_path):
    """A block stored on disk by a speculative engine holds the draft's K/V and features too: a second
    engine (a restart) loads them and ends up with the draft state a cold run computes."""
    target, draft = drafts["target"], drafts["random"]
    prompt = prompt_ids(130, 26)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = make_llm(target, draft, 2, kv_disk_dir=str(tmp_path / "disk")).engine
    [cold] = run_checked(first, [prompt], params, prefix="d1-")
    first.flush_tiers()
    second = make_llm(target, draft, 2, kv_disk_dir=str(tmp_path / "disk")).engine
    [warm] = run_checked(second, [prompt], params, prefix="d2-")
    assert warm.cached_tokens_by_tier == {"device": 0, "disk": 24}
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    sequence = prompt + warm.outputs[0].token_ids
    warm_kv, warm_features, blocks = _draft_state(second, sequence)
    cold_kv, cold_features, _ = _draft_state(first, sequence)
    assert blocks >= 6
    torch.testing.assert_close(warm_kv, cold_kv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(warm_features, cold_features, rtol=1e-4, atol=1e-5)
    # An engine without the draft (or with another) has another fingerprint: no hit on those files.
    plain = make_llm(target, kv_disk_dir=str(tmp_path / "disk")).engine
    [other] = run_checked(plain, [prompt], params, prefix="d3-")
    assert other.num_cached_tokens == 0


def test_batch_invariant_speculation_gives_every_token_the_same_bits(drafts):
    """Batch-invariant mode (issue 63) with an EAGLE draft: verification rows compute each token's logits with the
    same bits as a plain decode row, so the logprobs of every generated token equal a run without speculation,
    cold or after a prefix hit; and the draft layer's K/V and features after a hit equal a cold engine's exactly
    (the default path holds them within rounding only: the test above)."""
    target, draft = drafts["target"], drafts["random"]
    shared = prompt_ids(100, 14)
    first, second = shared + prompt_ids(101, 9), shared + prompt_ids(102, 11)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)

    def generated(output) -> tuple[list[int], str]:
        return output.outputs[0].token_ids, repr(output.outputs[0].logprobs)

    [plain] = run_checked(make_llm(target, batch_invariant=True, enable_prefix_caching=False).engine, [second], params)
    warm = make_llm(target, draft, 2, batch_invariant=True).engine
    run_checked(warm, [first], params, prefix="w1-")
    [hit] = run_checked(warm, [second], params, prefix="w2-")
    cold = make_llm(target, draft, 2, batch_invariant=True).engine
    [fresh] = run_checked(cold, [second], params, prefix="c-")
    assert hit.num_cached_tokens == 14 and warm.stats().spec_decode.num_draft_tokens > 0
    assert generated(hit) == generated(fresh) == generated(plain)
    sequence = second + hit.outputs[0].token_ids
    warm_kv, warm_features, warm_blocks = _draft_state(warm, sequence)
    cold_kv, cold_features, cold_blocks = _draft_state(cold, sequence)
    assert warm_blocks == cold_blocks >= 6
    assert torch.equal(warm_kv, cold_kv) and torch.equal(warm_features, cold_features)
