"""Qwen3.5 (issue 66's second hybrid): Gated DeltaNet layers among gated attention layers.

Logits and greedy float32 output equal transformers' ``Qwen3_5ForCausalLM`` (prefill, chunked prefill, decode, mixed
batches, preemption); the native delta-rule loop equals its PyTorch reference; each sequence's state lives in a slot
of the state pool, and a finished request leaves it as a snapshot at its last computed token. A hit resumes from the
deepest snapshot at or before the blocks' match: a chat's next turn at the end of the previous one, and, after one
request branched off a shared prefix nobody had snapshotted (and kept its state there), every later request on that
prefix at its last shared token (40 tokens included). In batch-invariant mode none of it changes a bit of the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_files import write_gguf
from test_engine import reference_greedy, run_checked

from kvreuse import LLM, SamplingParams
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache
from kvreuse.cache.pins import PinSpec
from kvreuse.cache.recurrent_state import RecurrentStatePool
from kvreuse.cache.state_slots import StateCopy
from kvreuse.kernels import gated_delta as delta_kernel
from kvreuse.layers.gated_delta import StateInputs, delta_rule_reference, l2_normalize
from kvreuse.loading.gguf import read_gguf
from kvreuse.loading.loader import load_model
from kvreuse.model_tools.make_model import count_parameters, make_model
from kvreuse.models.config import ModelConfig
from kvreuse.runner.model_runner import ModelRunner

BLOCK = 4


def random_qwen3_5(folder: Path, **overrides) -> Path:
    """A tiny Qwen3.5 folder (the trained tokenizer) whose weights are transformers' own random init at a larger
    scale, norms included, so every layer moves the logits (make-model's 0.02 weights repeat one token)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    folder = make_model(folder, preset="tiny-qwen3.5", dtype="float32", seed=3)
    written = json.loads((folder / "config.json").read_text())
    return save_scaled_random(folder, Qwen3_5ForCausalLM, Qwen3_5TextConfig(**{**written, "initializer_range": 0.2,
                                                                               **overrides}))


def save_scaled_random(folder: Path, model_class: type, config: object, seed: int = 0) -> Path:
    """transformers' own random init of ``model_class(config)`` (its initializer_range set by the caller), the norms
    drawn around zero too, saved into ``folder`` over make-model's weights."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory) -> Path:
    """Two key heads to four value heads (grouped value attention in the delta rule)."""
    return random_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny")


def prompt_ids(seed: int, length: int, vocab: int = 300) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_llm(folder: Path, **options) -> LLM:
    settings = dict(dtype="float32", device="cpu", kv_cache_memory="4MiB", block_size=BLOCK)
    settings.update(options)
    return LLM(str(folder), **settings)


def test_the_native_delta_rule_equals_its_reference():
    if not delta_kernel.available():
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    generator = torch.Generator().manual_seed(0)
    rows, key_heads, value_heads, key_dim, value_dim = 13, 2, 4, 16, 8
    q = l2_normalize(torch.randn(rows, key_heads, key_dim, generator=generator))
    k = l2_normalize(torch.randn(rows, key_heads, key_dim, generator=generator))
    v = torch.randn(rows, value_heads, value_dim, generator=generator)
    g = -torch.rand(rows, value_heads, generator=generator)
    beta = torch.rand(rows, value_heads, generator=generator)
    states = torch.randn(4, 2, value_heads, key_dim, value_dim, generator=generator)
    # Three sequences: one of 5 rows in slot 3, one decode row in slot 0, one of 7 rows in slot 1 (layer 1 of 2).
    inputs = StateInputs([3, 0, 1], [0, 5, 6], [5, 1, 7], None)  # type: ignore[arg-type]
    initial, expected_states = states.clone(), states.clone()
    expected = delta_rule_reference(q, k, v, g, beta, expected_states, 1, inputs)
    out = delta_kernel.gated_delta_rule(q, k, v, g, beta, states, 1, inputs.slots, inputs.starts, inputs.lens)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(states, expected_states, atol=1e-6, rtol=1e-5)
    assert torch.equal(states[2], expected_states[2]) and torch.equal(states[:, 0], expected_states[:, 0])
    # llama.cpp's tiled order (value head h reads key head h % Hk): the same computation with the value heads moved
    # from (key head, i) to (i, key head), in the reference and the native loop alike.
    order = torch.arange(value_heads).reshape(key_heads, -1).T.reshape(-1)  # tiled position -> HF's head
    moved = [initial[:, :, order].clone(), initial[:, :, order].clone()]
    tiled_reference = delta_rule_reference(q, k, v[:, order], g[:, order], beta[:, order], moved[0], 1, inputs, True)
    tiled = delta_kernel.gated_delta_rule(q, k, v[:, order].contiguous(), g[:, order].contiguous(),
                                          beta[:, order].contiguous(), moved[1], 1, inputs.slots, inputs.starts,
                                          inputs.lens, tiled=True)
    grouped_states = initial.clone()
    grouped = delta_rule_reference(q, k, v, g, beta, grouped_states, 1, inputs)
    torch.testing.assert_close(tiled_reference, grouped[:, order], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(tiled, tiled_reference, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(moved[1], grouped_states[:, :, order], atol=1e-6, rtol=1e-5)


def test_the_native_activations_equal_pytorch_and_give_a_value_the_same_bits_anywhere():
    """SiLU, sigmoid and the DeltaNet's gates with the scalar exp: PyTorch's values, and a value's bits whatever its
    place in the tensor (PyTorch's own exp gives a tensor's last values another rounding)."""
    if not delta_kernel.available():
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(37, 13, generator=generator) * 6  # 481 values: vector tails in any layout
    for kind, reference in ((delta_kernel.SILU, torch.nn.functional.silu), (delta_kernel.SIGMOID, torch.sigmoid)):
        out = delta_kernel.pointwise(x, kind)
        torch.testing.assert_close(out, reference(x), atol=1e-6, rtol=1e-6)
        assert torch.equal(delta_kernel.pointwise(x[5:], kind), out[5:])  # the same rows alone: the same bits
        assert torch.equal(delta_kernel.pointwise(x.bfloat16(), kind), delta_kernel.pointwise(x.bfloat16().float(), kind))
    owned = x.clone()
    assert delta_kernel.pointwise_(owned, delta_kernel.SILU) is owned and torch.equal(owned, delta_kernel.pointwise(x, 0))
    a, b = torch.randn(9, 4, generator=generator) * 12, torch.randn(9, 4, generator=generator)  # softplus' x > 20 too
    a_log, dt_bias = torch.randn(4, generator=generator), torch.randn(4, generator=generator)
    g, beta = delta_kernel.delta_gates(a, b, a_log, dt_bias)
    torch.testing.assert_close(g, -a_log.exp() * torch.nn.functional.softplus(a + dt_bias), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(beta, torch.sigmoid(b), atol=1e-6, rtol=1e-6)
    assert torch.equal(delta_kernel.delta_gates(a[3:], b[3:], a_log, dt_bias)[0], g[3:])


def test_the_config_reads_transformers_qwen3_5_text_config():
    from transformers import Qwen3_5TextConfig

    theirs = Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"])
    config = ModelConfig.from_dict(theirs.to_dict())
    assert config.state_layers == [i for i, kind in enumerate(theirs.layer_types) if kind == "linear_attention"]
    assert config.num_kv_layers == theirs.layer_types.count("full_attention") == 8
    assert config.rotary_dim == 64 and config.norm_style == "offset" and config.qk_norm and config.conv_kernel == 4
    assert (config.delta_key_heads, config.delta_value_heads, config.delta_key_dim, config.delta_value_dim) == (
        16, 32, 128, 128)
    # A snapshot: per Gated DeltaNet layer 32 heads of 128 x 128 float32 and 3 conv inputs of 2 x 2048 + 4096.
    assert config.state_bytes == 24 * 4 * (32 * 128 * 128 + 3 * 8192)
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 4 * 256 * 8 * 2  # K/V on the 8 attention layers only
    with pytest.raises(ValueError, match="multimodal Qwen3.5"):
        ModelConfig.from_dict({**theirs.to_dict(), "architectures": ["Qwen3_5ForConditionalGeneration"]})


def _step(runner: ModelRunner, sequences: list[tuple[int, list[int], int]], done: dict[int, int],
          copies: list[StateCopy]) -> torch.Tensor:
    """One step of (slot, new tokens, first block) per sequence (8 blocks each from its first); logits of each last row."""
    ids, positions, slots, lens, contexts, tables, last = [], [], [], [], [], [], []
    for slot, tokens, first_block in sequences:
        start = done.get(slot, 0)
        blocks = list(range(first_block, first_block + 8))
        ids += tokens
        positions += range(start, start + len(tokens))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(tokens))]
        lens.append(len(tokens))
        contexts.append(start + len(tokens))
        tables.append(blocks[: -(-(start + len(tokens)) // BLOCK)])
        last.append(len(ids) - 1)
        done[slot] = start + len(tokens)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    batch = ForwardBatch(as_long(ids), as_long(positions), as_long(slots), lens, contexts, tables, as_long(last),
                         state_slots=[slot for slot, _, _ in sequences], state_copies=copies)
    return runner.execute(batch)


def test_logits_match_transformers_in_prefill_chunks_decode_and_mixed_batches(qwen3_5):
    logits_match_transformers_in_steps(qwen3_5)


def logits_match_transformers_in_steps(folder: Path) -> None:
    """A state-pool hybrid's logits equal transformers' (float32): the first prompt in chunks of 9 and 13 (alone),
    then decode rows beside the second prompt's prefill, then both decoding together; the pool's slots start dirty."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, config = load_model(folder, torch.float32, torch.device("cpu"))
    kv_cache = KVCache.for_model(config, 64, BLOCK, torch.float32, "cpu")
    kv_cache.states = RecurrentStatePool(4, len(config.state_layers), *config.state_matrix_shape,
                                         config.state_conv_dim, config.conv_kernel)
    kv_cache.states.ssm.normal_()  # a slot's old contents must not leak into a sequence that starts there
    kv_cache.states.conv.normal_()
    runner = ModelRunner(model, config, kv_cache, "cpu")
    first, second = prompt_ids(1, 30), prompt_ids(2, 12)
    with torch.no_grad():
        expected = [reference(torch.tensor([tokens])).logits[0] for tokens in (first, second)]
    done: dict[int, int] = {}
    close = dict(atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(_step(runner, [(2, first[:9], 0)], done, [StateCopy(None, 2)])[0], expected[0][8], **close)
    torch.testing.assert_close(_step(runner, [(2, first[9:22], 0)], done, [])[0], expected[0][21], **close)
    logits = _step(runner, [(2, first[22:23], 0), (0, second[:10], 8)], done, [StateCopy(None, 0)])
    torch.testing.assert_close(logits[0], expected[0][22], **close)
    torch.testing.assert_close(logits[1], expected[1][9], **close)
    for index in range(23, 30):
        logits = _step(runner, [(0, second[10 + index % 2:11 + index % 2], 8), (2, first[index:index + 1], 0)]
                       if index < 25 else [(2, first[index:index + 1], 0)], done, [])
        torch.testing.assert_close(logits[-1], expected[0][index], **close)


def test_greedy_matches_transformers_alone_batched_chunked_and_preempted(qwen3_5):
    prompts = [prompt_ids(seed, length) for seed, length in ((1, 37), (2, 5), (3, 1), (4, 23))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [reference_greedy(qwen3_5, prompt, max_new_tokens=12) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) == 4 and all(len(set(tokens)) > 2 for tokens in expected)
    llm = make_llm(qwen3_5, enable_prefix_caching=False)
    assert llm.engine.kv_cache.num_layers == 1 and llm.engine.kv_cache.states is not None
    assert run_checked(llm.engine, prompts[:1], greedy) == expected[:1]
    assert run_checked(llm.engine, prompts, greedy) == expected
    chunked = make_llm(qwen3_5, max_num_batched_tokens=8)
    assert run_checked(chunked.engine, prompts, greedy) == expected
    # 16 blocks of 4 tokens: four sequences of up to 49 tokens cannot all stay; the preempted ones resume from the
    # snapshot their preemption left (or recompute where it went), and still agree.
    per_block = ModelConfig.from_pretrained(qwen3_5).kv_bytes_per_token(torch.float32) * BLOCK
    state = ModelConfig.from_pretrained(qwen3_5).state_bytes
    tight = make_llm(qwen3_5, kv_cache_memory=16 * per_block + 8 * state + 1, max_num_seqs=4,
                     state_snapshot_fraction=0.5)
    assert run_checked(tight.engine, prompts, greedy) == expected
    assert tight.engine.stats().num_preemptions > 0


def test_hits_resume_from_snapshots_and_change_no_bit(qwen3_5):
    """Batch-invariant mode: every run below gives the tokens and logprobs a cache-free engine gives."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    shared = prompt_ids(30, 40)
    first, second, third = (shared + prompt_ids(seed, 6) for seed in (31, 32, 33))
    plain = make_llm(qwen3_5, batch_invariant=True, enable_prefix_caching=False)
    cached = make_llm(qwen3_5, batch_invariant=True)

    def run(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs), o.num_cached_tokens) for o in outputs]

    def same(warm: list[tuple], prompts: list[list[int]]) -> list[int]:
        assert [r[:2] for r in warm] == [r[:2] for r in run(plain, prompts)]
        return [r[2] for r in warm]

    out_first = run(cached, [first])
    assert same(out_first, [first]) == [0]
    # The shared 40 tokens are cached as blocks, but the only state kept is at the end of the first request: the
    # second recomputes them, stops its first chunk at token 40 and keeps its state there ...
    assert same(run(cached, [second]), [second]) == [0]
    states = cached.engine.kv.states
    assert states.num_branches == 1
    # ... where the third resumes, as does every later one on that prefix (a batch of them too).
    assert same(run(cached, [third]), [third]) == [40]
    assert same(run(cached, [first, second]), [first, second]) == [40, 40]
    # The first request's next turn resumes where it ended: all it computed (every token but its last output).
    turn2 = first + list(out_first[0][0]) + prompt_ids(34, 7)
    assert same(run(cached, [turn2]), [turn2]) == [len(first) + 10 - 1]
    # A next turn whose answer's tokens differ (a client that sent its text back, split otherwise) resumes where the
    # first request's prompt ended: its state was kept there too.
    retold = first + prompt_ids(35, 9) + prompt_ids(36, 7)
    assert same(run(cached, [retold]), [retold]) == [len(first)]
    assert states.num_prompts >= 4
    snapshots = cached.engine.kv.states.snapshots
    assert 0 < snapshots.num_bytes <= snapshots.budget_bytes
    cached.engine.check_integrity()


def test_a_state_within_the_first_block_is_kept_resumed_and_goes_with_its_root(qwen3_5):
    """Token-granular on a hybrid too: a chat turn that ends inside the first block (a short first message), a prompt
    end and a branch there are resumed from, with the bits of a cache-free engine; those states hang on the
    namespace's root and go when its last block does."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    plain = make_llm(qwen3_5, batch_invariant=True, enable_prefix_caching=False, block_size=16)
    cached = make_llm(qwen3_5, batch_invariant=True, block_size=16)

    def run(prompt: list[int]) -> tuple[list[int], int]:
        warm, cold = (llm.generate([{"prompt_token_ids": prompt}], params)[0] for llm in (cached, plain))
        assert (warm.outputs[0].token_ids, repr(warm.outputs[0].logprobs)) == \
            (cold.outputs[0].token_ids, repr(cold.outputs[0].logprobs))
        cached.engine.check_integrity()
        return list(warm.outputs[0].token_ids), warm.num_cached_tokens

    first = prompt_ids(80, 6)
    answer, hit = run(first)
    assert hit == 0
    # The next turn resumes where the first ended, 9 tokens into the first block.
    assert run(first + answer + prompt_ids(81, 3))[1] == len(first) + len(answer) - 1
    # A prompt that goes on from the second turn's prompt but not its answer resumes at that prompt's end (kept once
    # the namespace has a root: the first request's tail made it).
    turn2 = first + answer + prompt_ids(81, 3)
    assert run(turn2 + prompt_ids(82, 2))[1] == len(turn2)
    # No branch is kept within the first block: a shared start that short (a chat template's header) costs less to
    # recompute than a state copy and a prefill chunk cut there.
    assert run(first[:5] + prompt_ids(83, 4))[1] == 0
    assert run(first[:5] + prompt_ids(84, 4))[1] == 0
    snapshots = cached.engine.kv.states.snapshots
    assert any(snapshot.anchor.is_root for snapshot in snapshots.snapshots())
    cached.engine.reset_prefix_cache()
    assert len(snapshots) == 0
    cached.engine.check_integrity()


def test_a_miss_on_a_missing_snapshot_explains_itself(qwen3_5, caplog):
    llm = make_llm(qwen3_5)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    shared = prompt_ids(40, 20)
    llm.generate([{"prompt_token_ids": shared + prompt_ids(41, 5)}], params)
    engine = llm.engine
    engine.add_request("probe", {"prompt_token_ids": shared + prompt_ids(42, 5)}, params)
    request = engine.scheduler.waiting[0]
    match = engine.kv.match(request)
    assert match.num_tokens == 0 and request.state_hit is not None and request.state_hit.matched == 20
    assert request.state_hit.explanation == "no state kept on this prefix: 20 matched tokens recomputed"
    with caplog.at_level("DEBUG", logger="kvreuse"):
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_integrity()
    assert "request probe: no state kept on this prefix: 20 matched tokens recomputed" in caplog.text
    assert engine.drift_report()["state_misses"] == {"requests": 1, "tokens": 20}
    # The probe kept its state at token 20 (a branch): the next request on that prefix resumes there.
    engine.add_request("next", {"prompt_token_ids": shared + prompt_ids(43, 5)}, params)
    assert engine.kv.match(engine.scheduler.waiting[0]).num_tokens == 20


def test_snapshots_stay_within_their_budget_and_free_their_slots(qwen3_5):
    state = ModelConfig.from_pretrained(qwen3_5).state_bytes
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for policy in ("saved", "lru"):
        llm = make_llm(qwen3_5, kv_cache_memory="4MiB", max_num_seqs=2, state_snapshot_fraction=3 * state / 2**22,
                       state_snapshot_policy=policy)
        states = llm.engine.kv.states
        assert states.num_slots == 2 + 3
        prompts = [prompt_ids(50 + seed, 10 + seed) for seed in range(8)]
        run_checked(llm.engine, prompts, params)
        # The budget's three kept, and two more in the running requests' slots while none runs (lent: they come back
        # at the next admissions).
        assert len(states.snapshots) == 5 and states.num_free == 0 and states.snapshots.lent_bytes == 2 * state
        llm.generate([{"prompt_token_ids": prompt_ids(70, 9)}, {"prompt_token_ids": prompt_ids(71, 9)}], params)
        llm.engine.check_integrity()
        llm.engine.reset_prefix_cache()
        assert len(states.snapshots) == 0 and states.num_free == 5  # gone with their blocks


def test_a_pinned_prefix_keeps_its_state_while_the_pin_holds(qwen3_5):
    """A hybrid's pinned prefix is worth its blocks only with the state at their end: the request that pins it stops
    a prefill chunk there and keeps a pin snapshot, which retention (LRU here, two snapshots' room) leaves alone while
    the pin holds, and drops like any other once it is gone."""
    state = ModelConfig.from_pretrained(qwen3_5).state_bytes
    llm = make_llm(qwen3_5, kv_cache_memory="4MiB", max_num_seqs=2, state_snapshot_fraction=2 * state / 2**22,
                   state_snapshot_policy="lru")
    engine, states = llm.engine, llm.engine.kv.states
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    system = prompt_ids(60, 22)  # the pin covers its first 20 tokens (5 blocks of 4)
    engine.add_request("pinning", {"prompt_token_ids": system + prompt_ids(61, 5)}, params,
                       pins=[PinSpec(num_tokens=22, key="system")])
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    (pin,) = engine.list_pins()
    pinned = [s for s in states.snapshots.snapshots() if s.reason == "pin"]
    assert [s.position for s in pinned] == [20] and states.snapshots.protected(pinned[0])

    def flood(seed: int) -> None:  # other requests' finish and prompt snapshots churn through the budget
        run_checked(engine, [prompt_ids(seed + i, 9 + i) for i in range(6)], params)

    flood(70)
    # Two in the budget and two in the idle running slots' (lent), the pin's among them, in the budget's part.
    assert len(states.snapshots) == 4 and pinned[0] in states.snapshots.snapshots()
    warm = llm.generate([{"prompt_token_ids": system + prompt_ids(62, 5)}], params)[0]
    assert warm.num_cached_tokens == 20  # resumed at the pin's end (the blocks matched 22 tokens)
    engine.unpin(pin.pin_id)
    assert not states.snapshots.protected(pinned[0])
    flood(80)
    assert pinned[0] not in states.snapshots.snapshots()  # an ordinary snapshot again: LRU dropped it
    engine.check_integrity()


def test_what_qwen3_5_cannot_do_yet_is_refused_by_name(qwen3_5):
    for options, words in (({"speculative_config": {"method": "cache"}}, "would take in the rejected drafts"),
                           ({"speculative_config": {"method": "eagle", "model": str(qwen3_5),
                                                    "num_speculative_tokens": 2}}, "method 'eagle' on a hybrid"),
                           ({"chunk_reuse": True}, "chunk_reuse on a hybrid model"),
                           ({"enable_lora": True}, "enable_lora on a hybrid model"),
                           ({"kv_cache_memory": "24KiB"}, "cannot hold Qwen3_5ForCausalLM's recurrent states")):
        with pytest.raises(ValueError, match=words):
            make_llm(qwen3_5, **options)
    # Left unset, the cache drafter stays off on it (batch-invariant mode would turn it on elsewhere).
    assert make_llm(qwen3_5, batch_invariant=True).engine.spec is None


def test_make_model_writes_qwen3_5_0_8b_s_shapes(tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    folder = make_model(tmp_path / "qwen3.5-0.8b", preset="qwen3.5-0.8b", write_weights=False)
    written = json.loads((folder / "config.json").read_text())
    ours = ModelConfig.from_pretrained(folder)
    assert ours.state_layers == [layer for layer in range(24) if layer % 4 != 3] and ours.rotary_dim == 64
    with torch.device("meta"):
        real = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**written, "vocab_size": 248320}))
    assert count_parameters("qwen3.5-0.8b", vocab_size=248320) == sum(p.numel() for p in real.parameters())


def gguf_files_run_as_their_folder(folder: Path, stem: Path, prompts: list[list[int]], greedy: SamplingParams,
                                   may_differ: frozenset[str] = frozenset()) -> dict[str, str]:
    """A float32 GGUF copy of ``folder`` (as llama.cpp writes it: tests/gguf_files.py) reads as the same config (but
    ``may_differ`` and what a file does not carry) and gives its greedy tokens; a Q8_0 copy runs. Returns the Q8_0
    file's tensor types."""
    ours, theirs = make_llm(folder), make_llm(write_gguf(folder, stem.with_suffix(".gguf"), "F32"))
    differing = {field for field in ours.engine.model_config.__dataclass_fields__
                 if getattr(ours.engine.model_config, field) != getattr(theirs.engine.model_config, field)}
    assert differing <= {"eos_token_id", "bos_token_id", "torch_dtype", "rms_norm_eps"} | may_differ
    expected = run_checked(ours.engine, prompts, greedy)
    assert run_checked(theirs.engine, prompts, greedy) == expected
    quantized = write_gguf(folder, stem.with_suffix(".q8_0.gguf"), "Q8_0")
    lengths = [len(tokens) for tokens in run_checked(make_llm(quantized).engine, prompts, greedy)]
    assert lengths == [greedy.max_tokens] * len(prompts)
    return read_gguf(quantized).tensor_types


def test_a_gguf_file_as_llama_cpp_writes_qwen3_5_runs_as_its_folder(tmp_path):
    """llama.cpp's layout: the Gated DeltaNet layers by attention.recurrent_layers and their heads by the ssm.* keys,
    rope over rope.dimension_count of each head, (1 + weight) norms but the DeltaNet's output norm, A_log stored as
    -exp(A_log), the depthwise kernel as [C, K]. A float32 file runs as its folder; a Q8_0 file runs quantized."""
    folder = random_qwen3_5(tmp_path / "equal-heads", linear_num_key_heads=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [prompt_ids(7, 21), prompt_ids(8, 3)]
    types = gguf_files_run_as_their_folder(folder, tmp_path / "qwen35", prompts, greedy)
    assert types["model.layers.0.linear_attn.in_proj_qkv.weight"] == "Q8_0"
    assert types["model.layers.0.linear_attn.A_log"] == "F32"
    # Fewer key heads than value heads: the file holds the value heads in llama.cpp's tiled order, and runs as the
    # folder (whose heads are in HF's grouped order) does.
    grouped_folder = random_qwen3_5(tmp_path / "grouped")
    grouped = make_llm(write_gguf(grouped_folder, tmp_path / "grouped.gguf", "F32"))
    assert grouped.engine.model_config.delta_tiled_values
    assert run_checked(grouped.engine, prompts, greedy) == run_checked(make_llm(grouped_folder).engine, prompts, greedy)


def randomize_mixer_and_states(mixer: torch.nn.Module, pool: RecurrentStatePool) -> None:
    """A recurrent mixer's parameters and a state pool's slots drawn at random (a native mixer test's start)."""
    with torch.no_grad():
        for parameter in mixer.parameters():
            parameter.normal_(0.0, 0.5)
    pool.ssm.normal_()
    pool.conv.normal_()


def native_mixer_matches_its_reference_in_any_step(pool: RecurrentStatePool, mix, close: dict) -> None:
    """``mix(rows, inputs, native)`` (a recurrent mixer over the projections' ``rows``, its states in ``pool``): the
    native call gives the op-by-op path's values for a step of three sequences (slot 3 prefilling 7 rows, slot 0
    decoding, slot 1 prefilling 4), and slot 3's rows the same bits, and the same final state, when they come in
    pieces with a decode row among them and beside another sequence (what a snapshot hit needs)."""
    initial = (pool.ssm.clone(), pool.conv.clone())

    def run(groups_of_rows: list[tuple[int, int, int]], native: bool) -> torch.Tensor:
        """Each (slot, first row, rows) of the projections as one step; returns the rows' mixed outputs in order."""
        pick = torch.cat([torch.arange(start, start + length) for _, start, length in groups_of_rows])
        starts, offset = [], 0
        for _, _, length in groups_of_rows:
            starts.append(offset)
            offset += length
        inputs = StateInputs([slot for slot, _, _ in groups_of_rows], starts, [n for _, _, n in groups_of_rows], pool)
        return mix(pick, inputs, native)

    def reset() -> None:
        pool.ssm.copy_(initial[0])
        pool.conv.copy_(initial[1])

    steps = [(3, 0, 7), (0, 7, 1), (1, 8, 4)]
    reference = run(steps, native=False)
    reset()
    whole = run(steps, native=True)
    torch.testing.assert_close(whole.float(), reference.float(), **close)
    states = (pool.ssm.clone(), pool.conv.clone())
    reset()
    alone = torch.cat([run([(3, 0, 3)], True), run([(3, 3, 1)], True), run([(3, 4, 3), (0, 7, 1)], True)[:3]])
    assert torch.equal(alone, whole[:7])
    assert torch.equal(pool.ssm[3], states[0][3]) and torch.equal(pool.conv[3], states[1][3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_delta_mixer_equals_the_op_by_op_path_and_gives_a_row_the_same_bits_in_any_step(dtype):
    """The Gated DeltaNet between its projections in one native call (convolution, L2 norms, gates, the rule, the
    gated output norm; bfloat16's roundings where the op-by-op path rounds): that path's values, and for a sequence's
    rows the same bits in one prefill chunk, in pieces with decode rows, or beside another sequence's rows."""
    if not delta_kernel.available():
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    from kvreuse.layers.gated_delta import GatedDeltaNet

    torch.manual_seed(0)
    key_heads, value_heads, key_dim, value_dim, kernel, hidden = 2, 4, 16, 8, 4, 32
    for tiled in (False, True):
        mixer = GatedDeltaNet(hidden, key_heads, value_heads, key_dim, value_dim, kernel, 1e-6, 1, dtype,
                              torch.device("cpu"), tiled_values=tiled)
        pool = RecurrentStatePool(4, 2, value_heads, key_dim, value_dim, mixer.conv_dim, kernel)
        randomize_mixer_and_states(mixer, pool)
        with torch.no_grad():
            mixed, z, b, a = mixer.in_proj(torch.randn(12, hidden, dtype=dtype)).split(
                [mixer.conv_dim, mixer.value_size, value_heads, value_heads], dim=-1)

        def mix(pick: torch.Tensor, inputs: StateInputs, native: bool) -> torch.Tensor:
            if native:
                return delta_kernel.delta_mixer(mixed[pick], z[pick], a[pick], b[pick], mixer.conv1d.weight, pool.conv,
                                                mixer.A_log, mixer.dt_bias, mixer.norm.weight, pool.ssm, 1, inputs.slots,
                                                inputs.starts, inputs.lens, key_heads, tiled, 1e-6,
                                                dtype == torch.bfloat16).to(dtype)
            with torch.no_grad():
                return mixer.reference(mixed[pick], z[pick], b[pick], a[pick], inputs, dtype)

        close = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
        native_mixer_matches_its_reference_in_any_step(pool, mix, close)
