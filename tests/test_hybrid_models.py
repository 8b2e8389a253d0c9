"""Hybrid models (issue 66): LFM2's gated short convolutions among attention layers.

Greedy float32 output equals transformers' ``Lfm2ForCausalLM`` token for token, cold, alone, in batches, in
chunked prefills and after preemption; the pool holds K/V for the attention layers and a plane row per conv layer
and token (each token's convolution input), so a prefix hit ending at any token resumes with nothing recomputed
and, in batch-invariant mode, changes no bit of the output (warm, batched, drafted, or from the host tier). The
short convolution over a flat batch of sequences equals ``F.conv1d`` per sequence. What a hybrid cannot do yet is
refused by name (an EAGLE draft, chunk reuse, LoRA).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf_files import write_gguf
from test_cache_drafts import FlatCost, looping_prompts
from test_engine import reference_greedy, run_checked

from kvreuse import LLM, SamplingParams
from kvreuse.kernels import fused_ops
from kvreuse.layers.short_conv import ConvTaps, reference_short_conv
from kvreuse.loading.gguf import read_gguf
from kvreuse.model_tools.make_model import count_parameters, make_model
from kvreuse.models.config import ModelConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_lfm2(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("lfm2") / "tiny-lfm2", preset="tiny-lfm2", dtype="float32", seed=3)


def prompt_ids(seed: int, length: int, vocab: int = 300) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


def make_llm(model_dir: Path, **options) -> LLM:
    settings = dict(dtype="float32", device="cpu", kv_cache_memory="2MiB", block_size=4)
    settings.update(options)
    return LLM(str(model_dir), **settings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_short_convolution_over_a_flat_batch_equals_conv1d_per_sequence_and_the_kernel_its_reference(dtype):
    torch.manual_seed(0)
    hidden, kernel, block_size = 8, 3, 4
    weight = torch.randn(kernel, hidden)  # tap-major float32, as DepthwiseConvWeight.taps gives it
    bias = torch.randn(hidden)
    planes = torch.randn(41, hidden).to(dtype)  # 10 blocks of 4 slots, then the zero row
    planes[40] = 0
    # Three sequences: one new (position 0: the taps before it read the zero row), one continuing with a single
    # row (a decode step) whose last two inputs sit in another block, one continuing with four rows.
    tables, starts, lengths = [[2, 3], [5, 0, 7], [9, 1, 6]], [0, 9, 5], [3, 1, 4]
    slot_of = lambda table, position: table[position // block_size] * block_size + position % block_size  # noqa: E731
    slot_mapping = torch.tensor([slot_of(table, start + i) for table, start, length in zip(tables, starts, lengths)
                                 for i in range(length)])
    bcx = torch.randn(sum(lengths), 3 * hidden).to(dtype)
    b, c, x = bcx.float().split(hidden, dim=-1)
    before = planes.clone()
    taps = ConvTaps.build(slot_mapping, starts, lengths, tables, block_size, kernel, zero_slot=40)
    out = reference_short_conv(bcx, weight, bias, planes, taps)
    written = planes.clone()
    first = 0
    for table, start, length in zip(tables, starts, lengths):
        past = torch.stack([before[slot_of(table, p)].float() if p >= 0 else torch.zeros(hidden)
                            for p in range(start - kernel + 1, start)])
        rows = (b * x)[first:first + length].to(dtype).float()
        sequence = torch.cat((past, rows))  # [K - 1 + L, H]
        conv = F.conv1d(sequence.t().unsqueeze(0), weight.t().unsqueeze(1), bias, groups=hidden)[0].t()
        expected = c[first:first + length] * conv.to(dtype).float()
        torch.testing.assert_close(out[first:first + length].float(), expected,
                                   **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
        first += length
    assert torch.equal(written[slot_mapping], (bcx[:, :hidden] * bcx[:, 2 * hidden:]))  # B * x written to its slot
    untouched = torch.ones(41, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert torch.equal(written[untouched], before[untouched])
    if not fused_ops.available():
        pytest.skip("the fused kernels could not be built here")
    planes = before.clone()
    fused = fused_ops.short_conv(bcx, weight, bias, planes, taps.slots, slot_mapping)
    assert torch.equal(fused, out) and torch.equal(planes, written)  # the kernel is its reference, bit for bit
    with pytest.raises(RuntimeError, match="taps: slot out of range"):
        fused_ops.short_conv(bcx, weight, bias, planes, taps.slots + 41, slot_mapping)


def test_lfm2_config_reads_the_released_spellings_as_transformers_does():
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    released = {  # LFM2-350M's config.json spellings (block_ff_dim, tie_embedding, full_attn_idxs, norm_eps)
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 1024,
        "block_ff_dim": 6656, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
        "norm_eps": 1e-5, "conv_L_cache": 3, "conv_bias": False, "tie_embedding": True,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14], "rope_theta": 1000000.0, "max_position_embeddings": 128000,
    }
    config = ModelConfig.from_dict(released)
    theirs = Lfm2Config(**{key: value for key, value in released.items() if key != "architectures"})
    assert config.intermediate_size == Lfm2MLP(theirs).w1.out_features == 4608
    assert config.recurrent_layers == [i for i, kind in enumerate(theirs.layer_types) if kind == "conv"]
    assert config.num_kv_layers == 6 and config.kv_layer_of(8) == 2 and config.conv_kernel == 3
    assert config.tie_word_embeddings and config.qk_norm and config.rms_norm_eps == 1e-5
    # What a token costs in the pool: K/V on the six attention layers (12 KiB), a plane row on the ten conv
    # layers (20 KiB).
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 8 * 64 * 6 * 2 + 10 * 1024 * 2
    with pytest.raises(ValueError, match="names no attention layer"):
        ModelConfig.from_dict({**released, "full_attn_idxs": []})


def test_greedy_matches_transformers_alone_batched_and_chunked(tiny_lfm2):
    prompts = [prompt_ids(seed, length) for seed, length in ((1, 37), (2, 5), (3, 1), (4, 23))]
    expected = [reference_greedy(tiny_lfm2, prompt, max_new_tokens=12) for prompt in prompts]
    llm = make_llm(tiny_lfm2, enable_prefix_caching=False)
    # The one attention layer's K/V, and the three conv layers' planes (a row of 64 values per token each).
    kv_cache = llm.engine.kv_cache
    assert kv_cache.num_layers == 1 and tuple(kv_cache.planes.shape) == (3, kv_cache.num_slots + 1, 64)
    assert run_checked(llm.engine, prompts[:1], GREEDY) == expected[:1]
    assert run_checked(llm.engine, prompts, GREEDY) == expected
    # Chunks of 8 tokens a step: each chunk reads the inputs the chunk before wrote, beside others decoding.
    chunked = make_llm(tiny_lfm2, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert run_checked(chunked.engine, prompts, GREEDY) == expected


def test_prefix_hits_end_at_any_token_and_change_no_bit(tiny_lfm2):
    """Batch-invariant mode: cold, a full hit, a hit ending mid-block, a later chat turn over the first one's
    output, and all of them again in one batch give the same tokens and logprobs; the hits cover every token
    computed before (cached_tokens), the 40-token shared prefix included."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    shared = prompt_ids(30, 40)
    cold_prompts = [shared + prompt_ids(31, 6), shared[:38] + prompt_ids(32, 5)]
    plain = make_llm(tiny_lfm2, batch_invariant=True, enable_prefix_caching=False)
    cached = make_llm(tiny_lfm2, batch_invariant=True)

    def run(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs), o.num_cached_tokens) for o in outputs]

    first = run(cached, cold_prompts[:1])
    assert first[0][2] == 0
    assert [r[:2] for r in first] == [r[:2] for r in run(plain, cold_prompts[:1])]
    again = run(cached, cold_prompts)
    assert [r[:2] for r in again] == [r[:2] for r in run(plain, cold_prompts)]
    assert [r[2] for r in again] == [len(cold_prompts[0]) - 1, 38]  # everything but the last token; to token 38
    turn2 = cold_prompts[0] + list(first[0][0]) + prompt_ids(33, 7)
    warm = run(cached, [turn2])
    assert warm[0][:2] == run(plain, [turn2])[0][:2]
    assert warm[0][2] == len(cold_prompts[0]) + len(first[0][0]) - 1  # all of the first turn but its last token
    assert cached.engine.stats().cache.hit_tokens > 0


def test_preempted_sequences_recompute_exactly(tiny_lfm2):
    prompts = [prompt_ids(10 + seed, 30) for seed in range(4)]
    expected = [reference_greedy(tiny_lfm2, prompt, max_new_tokens=24) for prompt in prompts]
    # 16 blocks of 4 tokens: four sequences of 54 tokens cannot all stay; some are preempted and recomputed.
    per_block = ModelConfig.from_pretrained(tiny_lfm2).kv_bytes_per_token(torch.float32) * 4
    llm = make_llm(tiny_lfm2, kv_cache_memory=16 * per_block, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert run_checked(llm.engine, prompts, params) == expected
    assert llm.engine.stats().num_preemptions > 0


def test_a_token_s_logprobs_do_not_depend_on_its_batch(tiny_lfm2):
    prompts = [prompt_ids(20 + seed, 9 + 7 * seed) for seed in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    # Batch-invariant mode: every product on the kernel that gives a row the same bits at any row count; the
    # convolution sums each row alone.
    llm = make_llm(tiny_lfm2, batch_invariant=True)
    alone = [llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0] for prompt in prompts]
    together = [output.outputs[0] for output in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [repr(o.logprobs) for o in together] == [repr(o.logprobs) for o in alone]


def test_what_a_hybrid_cannot_do_yet_is_refused_by_name(tiny_lfm2):
    draft = tiny_lfm2  # refused before any draft is read
    for options, words in (({"speculative_config": {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}},
                            "method 'eagle' on a hybrid model"),
                           ({"chunk_reuse": True}, "chunk_reuse on a hybrid model"),
                           ({"enable_lora": True}, "enable_lora on a hybrid model")):
        with pytest.raises(ValueError, match=words):
            make_llm(tiny_lfm2, **options)


def test_cache_drafts_and_the_host_tier_change_no_bit(tiny_lfm2):
    """Drafted rows write their inputs like any row (a rejected one's is overwritten later, as its K/V is); a
    block evicted to the host tier and brought back carries its planes."""
    # The tiny random model repeats its last token: a run of 7s in the prompt followed by a 9 is drafted (and the
    # 9 rejected) while its output is 7s, which other drafts copy (accepted).
    prompts = looping_prompts()[:2] + [[31, 7, 7, 7, 7, 9, 12, 50, 61, 7, 7, 7, 7, 9, 13, 44, 90, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)

    cached: list[int] = []

    def run(llm: LLM) -> list[tuple]:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
        cached[:] = [o.num_cached_tokens for o in outputs]
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in outputs]

    plain = run(make_llm(tiny_lfm2, batch_invariant=True, speculative_config={"method": "none"}))
    drafting = make_llm(tiny_lfm2, speculative_config={"method": "cache"})
    drafting.engine.spec.cost = FlatCost()  # every draft verified: this tests verification, not the cost model
    assert run(drafting) == plain and run(drafting) == plain
    stats = drafting.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    tiered = make_llm(tiny_lfm2, batch_invariant=True, kv_host_memory="4MiB", kv_cache_memory="256KiB")
    assert run(tiered) == plain
    tiered.engine.reset_prefix_cache()  # the device copies go; the host tier keeps them
    assert run(tiered) == plain
    assert cached[0] >= 32, cached  # read back from the host tier, planes and all


def test_make_model_writes_lfm2_350m_s_shapes(tmp_path):
    from transformers import Lfm2Config

    folder = make_model(tmp_path / "lfm2-350m", preset="lfm2-350m", write_weights=False)
    written = json.loads((folder / "config.json").read_text())
    theirs = Lfm2Config(**{key: value for key, value in written.items() if key != "architectures"})
    ours = ModelConfig.from_pretrained(folder)
    assert theirs.layer_types == ["full_attention" if ours.kv_layer_of(i) != ours.kv_layer_of(i + 1) else "conv"
                                  for i in range(15)] + ["conv"]
    assert ours.recurrent_layers == [0, 1, 3, 4, 6, 7, 9, 11, 13, 15] and ours.intermediate_size == 4608
    # LFM2-350M's parameters at its real vocabulary (65,536): transformers builds the same count from the config.
    with torch.device("meta"):
        from transformers import Lfm2ForCausalLM
        real = Lfm2ForCausalLM(Lfm2Config(**{**written, "vocab_size": 65536}))
    assert count_parameters("lfm2-350m", vocab_size=65536) == sum(p.numel() for p in real.parameters())


def test_a_gguf_file_as_llama_cpp_writes_lfm2_runs_as_its_folder(tiny_lfm2, tmp_path):
    """llama.cpp's layout: KV heads per layer (zero on the conv layers), shortconv.* tensors, the depthwise kernel
    as [H, K], the adjusted feed-forward width, the final norm as token_embd_norm. A float32 file is its folder;
    a Q8_0 file holds the conv projections quantized and runs on the quantized kernels."""
    path = write_gguf(tiny_lfm2, tmp_path / "tiny-lfm2.gguf", "F32")
    folder, gguf = make_llm(tiny_lfm2), make_llm(path)
    ours, theirs = folder.engine.model_config, gguf.engine.model_config
    differing = {field for field in ours.__dataclass_fields__ if getattr(ours, field) != getattr(theirs, field)}
    assert differing <= {"eos_token_id", "bos_token_id", "torch_dtype", "rms_norm_eps"}
    prompts = [prompt_ids(7, 21), prompt_ids(8, 3)]
    assert run_checked(gguf.engine, prompts, GREEDY) == run_checked(folder.engine, prompts, GREEDY)
    quantized = write_gguf(tiny_lfm2, tmp_path / "tiny-lfm2.q8_0.gguf", "Q8_0")
    types = read_gguf(quantized).tensor_types
    assert types["model.layers.0.conv.in_proj.weight"] == "Q8_0" and types["model.layers.0.conv.conv.weight"] == "F32"
    q8 = make_llm(quantized, dtype="bfloat16")
    outputs = run_checked(q8.engine, prompts, GREEDY)
    assert [len(tokens) for tokens in outputs] == [12, 12]
