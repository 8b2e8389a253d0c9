"""Hybrid models (issue 66), first step: LFM2's gated short convolutions among attention layers, run cold.

Greedy float32 output equals transformers' ``Lfm2ForCausalLM`` token for token, alone, in batches and in chunked
prefills (the conv state carried between chunks in its slot); a preempted and recomputed sequence starts from a
zero state; the paged pool holds K/V for the attention layers only. The short convolution over a flat batch of
sequences equals ``F.conv1d`` per sequence. What a hybrid cannot do yet is refused by name (speculation, chunk
reuse, KV tiers, LoRA); prefix caching is off for it until the recurrent-state snapshots are wired.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf_files import write_gguf
from test_engine import reference_greedy, run_checked

from kvreuse import LLM, SamplingParams
from kvreuse.layers.short_conv import ConvWindows, causal_conv
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


def test_the_short_convolution_over_a_flat_batch_equals_conv1d_per_sequence():
    torch.manual_seed(0)
    hidden, kernel, slots = 8, 3, 5
    weight = torch.randn(hidden, 1, kernel)
    bias = torch.randn(hidden)
    states = torch.randn(slots, kernel - 1, hidden)
    before = states.clone()
    # Three sequences: one fresh (its slot's old state must be ignored), one continuing with a single row (a
    # decode step: its new state is one old row and the new one), one continuing with four rows.
    lengths, starts, used = [3, 1, 4], [0, 9, 5], [4, 0, 2]
    rows = torch.randn(sum(lengths), hidden)
    windows = ConvWindows.build(used, starts, lengths, kernel, torch.device("cpu"))
    out = causal_conv(rows, weight, bias, windows, states)
    first = 0
    for length, start, slot in zip(lengths, starts, used):
        past = torch.zeros(kernel - 1, hidden) if start == 0 else before[slot]
        sequence = torch.cat((past, rows[first:first + length]))  # [K - 1 + L, H]
        expected = F.conv1d(sequence.t().unsqueeze(0), weight, bias, groups=hidden)[0].t()
        torch.testing.assert_close(out[first:first + length], expected)
        assert torch.equal(states[slot], sequence[-(kernel - 1):])
        first += length
    assert torch.equal(states[1], before[1]) and torch.equal(states[3], before[3])  # slots not in the step


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
    # The K/V a token costs: six attention layers, not sixteen.
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 8 * 64 * 6 * 2
    with pytest.raises(ValueError, match="names no attention layer"):
        ModelConfig.from_dict({**released, "full_attn_idxs": []})


def test_greedy_matches_transformers_alone_batched_and_chunked(tiny_lfm2):
    prompts = [prompt_ids(seed, length) for seed, length in ((1, 37), (2, 5), (3, 1), (4, 23))]
    expected = [reference_greedy(tiny_lfm2, prompt, max_new_tokens=12) for prompt in prompts]
    llm = make_llm(tiny_lfm2)
    assert llm.engine.kv_cache.num_layers == 1  # the one attention layer's K/V; the conv layers keep states
    assert run_checked(llm.engine, prompts[:1], GREEDY) == expected[:1]
    assert run_checked(llm.engine, prompts, GREEDY) == expected  # together, slots reused after the first run
    # Chunks of 8 tokens a step: the long prompts' states carried from chunk to chunk, beside others decoding.
    chunked = make_llm(tiny_lfm2, max_num_batched_tokens=8)
    assert run_checked(chunked.engine, prompts, GREEDY) == expected
    assert chunked.engine.state_slots.in_use == 0


def test_preempted_sequences_recompute_from_a_zero_state(tiny_lfm2):
    prompts = [prompt_ids(10 + seed, 30) for seed in range(4)]
    expected = [reference_greedy(tiny_lfm2, prompt, max_new_tokens=24) for prompt in prompts]
    # 16 blocks of 4 tokens: four sequences of 54 tokens cannot all stay; some are preempted and recomputed.
    per_block = ModelConfig.from_pretrained(tiny_lfm2).kv_bytes_per_token(torch.float32) * 4
    llm = make_llm(tiny_lfm2, kv_cache_memory=16 * per_block)
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


def test_what_a_hybrid_cannot_do_yet_is_refused_by_name(tiny_lfm2, caplog):
    with caplog.at_level("INFO", logger="kvreuse"):
        llm = make_llm(tiny_lfm2)
    assert llm.engine.kv.enable_prefix_caching is False
    assert "prefix caching: off for this hybrid model" in caplog.text
    assert llm.engine.spec is None
    prompt = prompt_ids(5, 20)
    llm.generate([{"prompt_token_ids": prompt}] * 2, GREEDY)
    assert llm.engine.stats().cache.hit_tokens == 0
    for options, words in (({"speculative_config": {"method": "cache"}}, "speculative_config on a hybrid"),
                           ({"chunk_reuse": True}, "chunk_reuse on a hybrid"),
                           ({"kv_host_memory": "8MiB"}, "KV tiers on a hybrid"),
                           ({"enable_lora": True}, "enable_lora on a hybrid")):
        with pytest.raises(ValueError, match=words):
            make_llm(tiny_lfm2, **options)


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
