"""Qwen3.5-MoE and Qwen3-Next (issue 66): Qwen3.5's Gated DeltaNet and gated attention layers with experts for MLPs.

Every layer's MLP is a router over ``num_experts`` SwiGLU experts (the top ``num_experts_per_tok``, renormalised)
plus a shared expert whose output is scaled by sigmoid(x . shared_expert_gate). Logits and greedy float32 output
equal transformers' ``Qwen3_5MoeForCausalLM`` (prefill chunks, decode, mixed batches, preemption); prefix hits resume
from state snapshots as on Qwen3.5 and give a cache-free engine's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engine import reference_greedy, run_checked
from test_moe import native_and_python
from test_qwen3_5 import BLOCK, _step, gguf_files_run_as_their_folder, make_llm, prompt_ids, save_scaled_random

from kvreuse import SamplingParams
from kvreuse.cache.kv import KVCache
from kvreuse.cache.recurrent_state import RecurrentStatePool
from kvreuse.cache.state_slots import StateCopy
from kvreuse.layers.experts import SparseMoE
from kvreuse.loading.loader import load_model
from kvreuse.model_tools.make_model import count_parameters, make_model
from kvreuse.models.config import ModelConfig
from kvreuse.runner.model_runner import ModelRunner


def random_qwen3_5_moe(folder: Path, **overrides) -> Path:
    """The tiny preset's folder (the trained tokenizer) with transformers' own random init at a larger scale, norms
    included, so that the experts, the shared expert and its gate all move the logits."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    folder = make_model(folder, preset="tiny-qwen3.5-moe", dtype="float32", seed=3)
    written = json.loads((folder / "config.json").read_text())
    return save_scaled_random(folder, Qwen3_5MoeForCausalLM,
                              Qwen3_5MoeTextConfig(**{**written, "initializer_range": 0.2, **overrides}))


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory) -> Path:
    return random_qwen3_5_moe(tmp_path_factory.mktemp("qwen3_5_moe") / "tiny")


def test_the_config_reads_transformers_qwen3_5_moe_text_config():
    from transformers import Qwen3_5MoeTextConfig

    theirs = Qwen3_5MoeTextConfig(architectures=["Qwen3_5MoeForCausalLM"])
    config = ModelConfig.from_dict(theirs.to_dict())
    moe = config.moe
    assert moe is not None and all(moe.sparse_layers) and moe.norm_topk_prob
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
            moe.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert config.state_layers == [i for i, kind in enumerate(theirs.layer_types) if kind == "linear_attention"]
    assert config.rotary_dim == 64 and config.norm_style == "offset" and config.attention_output_gate
    # A token's MLP work counts the shared expert and its gate on each of the 40 layers.
    unshared = ModelConfig.from_dict({**theirs.to_dict(), "shared_expert_intermediate_size": 0})
    assert unshared.moe.shared_expert_intermediate_size == 0
    hidden = theirs.hidden_size
    assert config.forward_flops(0, 1) - unshared.forward_flops(0, 1) == 2 * 40 * (hidden + 3 * hidden * 512)
    with pytest.raises(ValueError, match="multimodal Qwen3.5-MoE"):
        ModelConfig.from_dict({**theirs.to_dict(), "architectures": ["Qwen3_5MoeForConditionalGeneration"]})


def test_logits_match_transformers_in_prefill_chunks_decode_and_mixed_batches(qwen3_5_moe):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(qwen3_5_moe, dtype=torch.float32).eval()
    model, config = load_model(qwen3_5_moe, torch.float32, torch.device("cpu"))
    layers = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(mlp, SparseMoE) and mlp.shared_expert is not None for mlp in layers)
    kv_cache = KVCache.for_model(config, 64, BLOCK, torch.float32, "cpu")
    kv_cache.states = RecurrentStatePool(4, len(config.state_layers), config.delta_value_heads, config.delta_key_dim,
                                         config.delta_value_dim, config.delta_conv_dim, config.conv_kernel)
    runner = ModelRunner(model, config, kv_cache, "cpu")
    first, second = prompt_ids(1, 26), prompt_ids(2, 9)
    with torch.no_grad():
        expected = [reference(torch.tensor([tokens])).logits[0] for tokens in (first, second)]
    done: dict[int, int] = {}
    close = dict(atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(_step(runner, [(1, first[:11], 0)], done, [StateCopy(None, 1)])[0], expected[0][10], **close)
    logits = _step(runner, [(1, first[11:12], 0), (3, second[:8], 8)], done, [StateCopy(None, 3)])
    torch.testing.assert_close(logits[0], expected[0][11], **close)
    torch.testing.assert_close(logits[1], expected[1][7], **close)
    logits = _step(runner, [(3, second[8:9], 8), (1, first[12:26], 0)], done, [])
    torch.testing.assert_close(logits[0], expected[1][8], **close)
    torch.testing.assert_close(logits[1], expected[0][25], **close)


def test_greedy_matches_transformers_alone_batched_chunked_preempted_and_after_hits(qwen3_5_moe):
    prompts = [prompt_ids(seed, length) for seed, length in ((1, 33), (2, 6), (3, 1), (4, 19))]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = greedy_equals_transformers(qwen3_5_moe, prompts, greedy)
    config = ModelConfig.from_pretrained(qwen3_5_moe)
    tight = make_llm(qwen3_5_moe, kv_cache_memory=14 * config.kv_bytes_per_token(torch.float32) * BLOCK
                     + 8 * config.state_bytes + 1, max_num_seqs=4, state_snapshot_fraction=0.5)
    assert run_checked(tight.engine, prompts, greedy) == expected
    assert tight.engine.stats().num_preemptions > 0
    # Prefix hits: the second request on a shared prefix keeps its state where it branched, the third resumes there;
    # a chat's next turn resumes where the first ended. Each gives what a cache-free engine gives.
    shared = prompt_ids(30, 24)
    asked = [shared + prompt_ids(seed, 5) for seed in (31, 32, 33)]
    cached, plain = make_llm(qwen3_5_moe), make_llm(qwen3_5_moe, enable_prefix_caching=False)
    outputs = [cached.generate([{"prompt_token_ids": prompt}], greedy)[0] for prompt in asked]
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 24]
    turn = asked[0] + list(outputs[0].outputs[0].token_ids) + prompt_ids(34, 4)
    outputs.append(cached.generate([{"prompt_token_ids": turn}], greedy)[0])
    assert outputs[-1].num_cached_tokens == len(asked[0]) + 10 - 1
    cold = plain.generate([{"prompt_token_ids": prompt} for prompt in asked + [turn]], greedy)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in cold]
    cached.engine.check_integrity()


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "qwen3.5-moe-1b"])
def test_make_model_writes_qwen3_5_moe_as_transformers_builds_it(tmp_path, preset):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    folder = make_model(tmp_path / preset, preset=preset, write_weights=False)
    written = json.loads((folder / "config.json").read_text())
    assert "intermediate_size" not in written and written["model_type"] == "qwen3_5_moe_text"
    with torch.device("meta"):
        real = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**written))
    assert count_parameters(preset, vocab_size=written["vocab_size"]) == sum(p.numel() for p in real.parameters())


def test_a_gguf_file_as_llama_cpp_writes_qwen3_5_moe_runs_as_its_folder(tmp_path):
    """llama.cpp's qwen35moe: Qwen3.5's keys and tensors, the experts stacked per kind (ffn_*_exps), the router as
    ffn_gate_inp, the shared expert as ffn_*_shexp and its gate as ffn_gate_inp_shexp, expert widths only (no
    feed_forward_length). A float32 file runs as its folder; a Q8_0 file runs quantized."""
    folder = random_qwen3_5_moe(tmp_path / "equal-heads", linear_num_key_heads=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    types = gguf_files_run_as_their_folder(folder, tmp_path / "qwen35moe", [prompt_ids(7, 19), prompt_ids(8, 4)],
                                           greedy, frozenset({"intermediate_size"}))
    assert types["model.layers.0.mlp.experts.0.gate_proj.weight"] == "Q8_0"
    assert types["model.layers.0.mlp.shared_expert.down_proj.weight"] == "Q8_0"


def random_qwen3_next(folder: Path, **overrides) -> Path:
    """A tiny Qwen3-Next folder (the trained tokenizer): transformers' own random init at a larger scale, two key
    heads to four value heads (so the fused projections' grouping matters), layer 1 a dense MLP (mlp_only_layers)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    folder = make_model(folder, preset="tiny-qwen3.5-moe", dtype="float32", seed=3)
    written = json.loads((folder / "config.json").read_text())
    for key in ("model_type", "architectures"):
        written.pop(key)
    config = Qwen3NextConfig(**{**written, "architectures": ["Qwen3NextForCausalLM"], "intermediate_size": 96,
                                "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": True,
                                "initializer_range": 0.2, **overrides})
    return save_scaled_random(folder, Qwen3NextForCausalLM, config, seed=1)


def greedy_equals_transformers(folder: Path, prompts: list[list[int]], greedy: SamplingParams) -> list[list[int]]:
    """transformers' greedy tokens for ``prompts`` (distinct, and not one token repeated), checked against kvreuse's
    alone, batched and in chunks of 8 tokens (prefix caching off); returns them."""
    expected = [reference_greedy(folder, prompt, max_new_tokens=greedy.max_tokens) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) == len(prompts)
    assert all(len(set(tokens)) > 2 for tokens in expected)
    llm = make_llm(folder, enable_prefix_caching=False)
    assert run_checked(llm.engine, prompts[:1], greedy) == expected[:1]
    assert run_checked(llm.engine, prompts, greedy) == expected
    assert run_checked(make_llm(folder, max_num_batched_tokens=8).engine, prompts, greedy) == expected
    return expected


def test_qwen3_next_runs_as_transformers_runs_it(tmp_path):
    folder = random_qwen3_next(tmp_path / "qwen3-next")
    config = ModelConfig.from_pretrained(folder)
    assert config.architecture == "Qwen3NextForCausalLM" and config.moe.sparse_layers == (True, False, True, True)
    assert config.moe.shared_expert_intermediate_size == 64 and config.state_layers == [0, 1, 2]
    prompts = [prompt_ids(seed, length) for seed, length in ((5, 29), (6, 7), (7, 14))]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = greedy_equals_transformers(folder, prompts, greedy)
    cached = make_llm(folder)
    turn = prompts[0] + expected[0] + prompt_ids(8, 5)
    first = cached.generate([{"prompt_token_ids": prompts[0]}], greedy)[0]
    again = cached.generate([{"prompt_token_ids": turn}], greedy)[0]
    assert again.num_cached_tokens == len(prompts[0]) + 10 - 1
    assert again.outputs[0].token_ids == reference_greedy(folder, turn, max_new_tokens=10)
    assert first.outputs[0].token_ids == expected[0]


def test_a_gguf_file_as_llama_cpp_writes_qwen3_next_runs_as_its_folder(tmp_path):
    """llama.cpp's qwen3next: in_proj_qkvz split into attn_qkv / attn_gate by its converter (value heads in HF's
    grouped order: no tiling, unlike its Qwen3.5 files), b and a fused per key head (ssm_ba, split at load, quantized
    rows as they are), experts and a shared expert on every layer."""
    folder = random_qwen3_next(tmp_path / "qwen3-next", mlp_only_layers=[])
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    types = gguf_files_run_as_their_folder(folder, tmp_path / "qwen3next", [prompt_ids(9, 17), prompt_ids(10, 5)],
                                           greedy)
    assert types["model.layers.0.linear_attn.in_proj_ba.weight"] == "Q8_0"
    assert not ModelConfig.from_pretrained(folder).delta_tiled_values


def test_the_shared_expert_gates_arithmetic_is_part_of_the_kv_fingerprint(qwen3_5_moe, tmp_path, monkeypatch):
    """The gate's sigmoid on rows of 64 copies rounds otherwise than eager sigmoid on [rows, 1] did, so K/V a tier
    stored before are another engine's: the fingerprint names it (with its width)."""
    from kvreuse.layers import experts

    def fingerprint(folder) -> str:
        return make_llm(folder, kv_disk_dir=str(tmp_path / "disk")).engine.tier_store.fingerprint

    named = fingerprint(qwen3_5_moe)
    monkeypatch.setattr(experts, "SIGMOID_ROW", 128)
    assert fingerprint(qwen3_5_moe) != named


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_shared_expert_gate_gives_a_row_the_same_bits_at_any_row_count(dtype):
    """Eager sigmoid on a [rows, 1] gate gives a row other bits with other row counts (its vector tail takes another
    exp); shared_expert_scale gives each row its bits alone, at 1,001 and 3,001 rows (past the library's grain, so
    split between threads) as at 3."""
    from kvreuse.layers.experts import shared_expert_scale

    logit = torch.randn(3001, 1, generator=torch.Generator().manual_seed(5)).mul(4).to(dtype)
    for rows in (3, 1001, 3001):
        together = shared_expert_scale(logit[:rows])
        alone = torch.cat([shared_expert_scale(logit[i:i + 1]) for i in range(rows)])
        assert torch.equal(together, alone), rows
        torch.testing.assert_close(together, torch.sigmoid(logit[:rows]))


@pytest.mark.parametrize("options", [{}, {"quantization": "int8", "dtype": "bfloat16"}], ids=["float32", "int8-bfloat16"])
def test_hits_resume_from_snapshots_and_change_no_bit_in_batch_invariant_mode(qwen3_5_moe, options):
    """Batch-invariant mode covers the experts (the router and the shared expert's gate on the row-dot GEMV, the
    gate's sigmoid row-invariant): a hit resumed from a snapshot, a batch and a chunked prefill give the tokens and
    logprobs of a cache-free engine that runs each prompt alone, bit for bit."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    shared = prompt_ids(40, 40)
    first, second, third = (shared + prompt_ids(seed, 5) for seed in (41, 42, 43))
    plain = make_llm(qwen3_5_moe, batch_invariant=True, enable_prefix_caching=False, **options)
    cached = make_llm(qwen3_5_moe, batch_invariant=True, **options)
    chunked = make_llm(qwen3_5_moe, batch_invariant=True, enable_prefix_caching=False, max_num_batched_tokens=7,
                       **options)
    layers = [module for module in cached.engine.runner.model.modules() if isinstance(module, SparseMoE)]
    assert layers and all(layer.router_layer.kernel is not None and layer.shared_expert_gate.kernel is not None
                          for layer in layers)

    def run(llm, prompts: list[list[int]]) -> list[tuple]:
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs), o.num_cached_tokens) for o in outputs]

    alone = {i: run(plain, [prompt])[0][:2] for i, prompt in enumerate((first, second, third))}
    assert [r[:2] for r in run(cached, [first])] == [alone[0]]
    assert [r[:2] for r in run(cached, [second])] == [alone[1]]  # keeps a state where the shared tokens end
    warm = run(cached, [third, first, second])  # resumed from it, in one batch
    assert [r[:2] for r in warm] == [alone[2], alone[0], alone[1]] and [r[2] for r in warm] == [40, 40, 40]
    assert [r[:2] for r in run(chunked, [first, second, third])] == [alone[0], alone[1], alone[2]]
    cached.engine.check_integrity()


@pytest.mark.parametrize("options", [{}, {"quantization": "int8"}, {"quantization": "int8", "dtype": "bfloat16"}],
                         ids=["float32", "int8", "int8-bfloat16"])
def test_the_native_moe_layer_adds_the_shared_expert_with_the_python_layers_bits(qwen3_5_moe, options):
    """The native MoE layer (csrc/moe.h) runs the shared expert and its gate too, by the same ops as SparseMoE.forward:
    each layer's output equals the Python layer's bit for bit at 1, 3 and 8 rows, on float weights and on int8 ones
    (qdot8's products), in float32 and bfloat16."""
    from kvreuse.kernels import moe as moe_kernels

    if moe_kernels.library() is None:
        pytest.skip("the native MoE layer is not built here")
    llm = make_llm(qwen3_5_moe, **options)
    layers = [module for module in llm.engine.runner.model.modules() if isinstance(module, SparseMoE)]
    assert layers and all(layer.native is not None and layer.native_shared for layer in layers)
    generator = torch.Generator().manual_seed(9)
    for layer in layers:
        for rows in (1, 3, 8):
            x = torch.randn(rows, layer.router_layer.input_size, generator=generator).to(layer.shared_expert_gate.dtype)
            native, python = native_and_python(layer, x)
            assert torch.equal(native, python), (rows, (native - python).abs().max())
            assert not torch.equal(native, layer.routed(x))  # the shared expert is in it


def test_the_native_decode_step_refuses_a_layer_with_a_shared_expert():
    """The native decode step's MoE layer runs the routed experts only: a layer with a shared expert runs op by op,
    saying so (Qwen3.5-MoE's attention layers; its Gated DeltaNet layers are refused for their experts too)."""
    from types import SimpleNamespace

    from kvreuse.layers.moe_config import MoEConfig
    from kvreuse.runner.decode.native_step import layer_args

    moe = SparseMoE(64, MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  norm_topk_prob=True, sparse_layers=(True,), shared_expert_intermediate_size=32),
                    "silu", torch.float32, torch.device("cpu"))
    moe.native, moe.native_max_rows = object(), 16  # as prepare_native leaves it
    assert layer_args(SimpleNamespace(self_attn=None, mlp=moe), 1) == (
        "a shared expert (the native decode step runs the routed experts only)")
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be 0"):
        MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                  sparse_layers=(True,), shared_expert_intermediate_size=-1)
