"""Model tests: our pure-PyTorch Llama family against transformers' own implementation.

Tiny random checkpoints are written with transformers (Llama with llama3 rope scaling, Mistral,
Qwen2 with q/k/v bias and tied embeddings, Qwen3 with q/k norm and head_dim != hidden/heads, Qwen3-MoE
with renormalised top-2 of 8 experts and a dense layer, Gemma 3 with a windowed and a global layer, gpt-oss with
a 5-token window, sinks, biases, YaRN and clamped experts, Qwen3 with YaRN), loaded
through ``load_model`` and run through ``ModelRunner`` over a paged KV cache with scattered block ids;
the logits must match transformers' for a full prompt, for a prompt split into chunks followed by a
decode, and for several sequences in one batch. Also: sharded checkpoints, config parsing of real
config.json spellings, dummy weights, dtype resolution and the errors for bad checkpoints; YaRN's parameters,
gpt-oss's router and MoE layer and its MXFP4 dequantization against transformers' own functions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.attention.torch_paged import TorchPagedAttention
from kvreuse.cache.kv import KVCache
from kvreuse.kernels import moe, quant_ops
from kvreuse.kernels.cpu import cpu_supports_bfloat16
from kvreuse.loading import load_model, resolve_dtype, resolve_model_path
from kvreuse.models import ModelConfig
from kvreuse.runner.model_runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 64
COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6,
)
ARCHITECTURES = {
    "llama3": (
        transformers.LlamaConfig, transformers.LlamaForCausalLM,
        dict(rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }, rope_theta=10000.0),
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=4096)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    # 8 experts, 2 per token, renormalised; layer 1 dense (mlp_only_layers).
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
    # A 5-token window on layer 0 with its own rope base, layer 1 global with linear rope scaling; the prompts
    # (23 and 30 tokens, chunks of 9 and 13) run far past the window, so a wrong window changes the logits.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=32, sliding_window=5, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
    # Windows of 5 tokens on even layers, learned sinks, q/k/v/o biases, a biased router softmaxed over its top 2 of
    # 8, biased experts (their gate_up weights scaled up in _save_hf_model so the SwiGLU's clamp at 7 bites) and
    # YaRN over an original context of 16 (the prompts run past it).
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
    # YaRN on an architecture other than gpt-oss: truncated ramp, mscale / mscale_all_dim attention factor.
    "qwen3_yarn": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        head_dim=32, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                      "mscale": 1.0, "mscale_all_dim": 0.5, "rope_theta": 10000.0})),
}
# gpt-oss's expert gate_up weights at 10x _randomize's scale: gate values well past swiglu_limit (7).
_SCALED_UP = {"gpt_oss": ("mlp.experts.gate_up_proj", 10.0)}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that a wrong rope, bias or norm changes the logits visibly."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def _save_hf_model(kind: str, folder: Path, **save_kwargs) -> torch.nn.Module:
    config_class, model_class, extra = ARCHITECTURES[kind]
    hf_model = model_class(config_class(**COMMON, **extra)).eval()
    _randomize(hf_model, seed=len(kind))
    if kind in _SCALED_UP:
        suffix, factor = _SCALED_UP[kind]
        with torch.no_grad():
            for name, parameter in hf_model.named_parameters():
                if name.endswith(suffix):
                    parameter.mul_(factor)
    hf_model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    return hf_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    saved = {}
    for kind in ARCHITECTURES:
        folder = tmp_path_factory.mktemp(kind)
        saved[kind] = (folder, _save_hf_model(kind, folder))
    return saved


def _hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


class PagedSequence:
    """Test-side bookkeeping for one sequence: its tokens so far and its (scattered) block ids."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self.num_computed = 0


def _make_batch(steps: list[tuple[PagedSequence, list[int]]]) -> ForwardBatch:
    """A ForwardBatch where each (sequence, new_tokens) continues that sequence; every row sampled."""
    input_ids, positions, slots, query_lens, context_lens, tables, logits_indices = [], [], [], [], [], [], []
    for sequence, new_tokens in steps:
        start = sequence.num_computed
        end = start + len(new_tokens)
        input_ids += new_tokens
        positions += list(range(start, end))
        slots += [sequence.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        query_lens.append(len(new_tokens))
        context_lens.append(end)
        tables.append(sequence.block_ids[: -(-end // BLOCK_SIZE)])
        logits_indices.append(len(input_ids) - 1)
        sequence.num_computed = end
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        input_ids=as_long(input_ids), positions=as_long(positions), slot_mapping=as_long(slots),
        query_lens=query_lens, context_lens=context_lens, block_tables=tables,
        logits_indices=as_long(logits_indices),
    )


def _runner(folder: Path) -> tuple[ModelRunner, ModelConfig]:
    model, config = load_model(folder, torch.float32, torch.device("cpu"))
    kv_cache = KVCache.for_model(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    return ModelRunner(model, config, kv_cache, "cpu"), config


# Block ids deliberately out of order and far apart.
SCATTERED_BLOCKS = [37, 2, 50, 11, 29, 5, 61, 18, 44, 8, 23, 33]


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_full_prompt_logits_match_transformers(checkpoints, kind):
    folder, hf_model = checkpoints[kind]
    runner, _ = _runner(folder)
    prompt = [int(t) for t in torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1))]
    expected = _hf_logits(hf_model, prompt)

    batch = _make_batch([(PagedSequence(SCATTERED_BLOCKS), prompt)])
    logits = runner.execute(batch)
    assert logits.shape == (1, 256) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], expected[-1], atol=1e-4, rtol=1e-4)

    # Every position, straight through the model: hidden states for all rows are right too.
    fresh_cache = KVCache.for_model(runner.model_config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    batch = _make_batch([(PagedSequence(SCATTERED_BLOCKS), prompt)])
    metadata = TorchPagedAttention().prepare(batch, BLOCK_SIZE)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, fresh_cache, metadata)
        all_logits = runner.model.compute_logits(hidden)
    torch.testing.assert_close(all_logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_chunked_prefill_then_decode_matches_transformers(checkpoints, kind):
    folder, hf_model = checkpoints[kind]
    runner, _ = _runner(folder)
    tokens = [int(t) for t in torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2))]
    expected = _hf_logits(hf_model, tokens)
    sequence = PagedSequence(SCATTERED_BLOCKS)
    # 9 tokens, then 13 more continuing the cached 9, then single-token decodes.
    chunks = [tokens[:9], tokens[9:22]] + [[token] for token in tokens[22:]]
    for chunk in chunks:
        logits = runner.execute(_make_batch([(sequence, chunk)]))
        torch.testing.assert_close(logits[0], expected[sequence.num_computed - 1], atol=1e-4, rtol=1e-4)


def test_mixed_batch_of_sequences_matches_transformers(checkpoints):
    folder, hf_model = checkpoints["qwen3"]
    runner, _ = _runner(folder)
    generator = torch.Generator().manual_seed(3)
    prompts = [[int(t) for t in torch.randint(0, 256, (n,), generator=generator)] for n in (17, 6, 11)]
    expected = [_hf_logits(hf_model, prompt) for prompt in prompts]
    sequences = [PagedSequence(SCATTERED_BLOCKS[0:5]), PagedSequence(SCATTERED_BLOCKS[5:8]),
                 PagedSequence(SCATTERED_BLOCKS[8:12])]
    # Step 1: sequence 0 prefills 10 tokens, sequence 1 its whole prompt but the last token.
    runner.execute(_make_batch([(sequences[0], prompts[0][:10]), (sequences[1], prompts[1][:5])]))
    # Step 2: a continuing chunk, a decode and a fresh prompt in one batch.
    logits = runner.execute(_make_batch([
        (sequences[0], prompts[0][10:]), (sequences[1], prompts[1][5:]), (sequences[2], prompts[2]),
    ]))
    for row, reference in enumerate(expected):
        torch.testing.assert_close(logits[row], reference[-1], atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = _save_hf_model("llama3", tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert (tmp_path / "model.safetensors.index.json").is_file()
    runner, _ = _runner(tmp_path)
    prompt = list(range(3, 15))
    logits = runner.execute(_make_batch([(PagedSequence(SCATTERED_BLOCKS), prompt)]))
    torch.testing.assert_close(logits[0], _hf_logits(hf_model, prompt)[-1], atol=1e-4, rtol=1e-4)


def _copy_config(source: Path, destination: Path) -> None:
    destination.mkdir(exist_ok=True)
    (destination / "config.json").write_text((source / "config.json").read_text())


def test_missing_weight_is_named(checkpoints, tmp_path):
    folder, _ = checkpoints["qwen2"]
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    _copy_config(folder, tmp_path)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weight.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unexpected_and_misshaped_weights_are_named(checkpoints, tmp_path):
    folder, _ = checkpoints["llama3"]
    tensors = load_file(folder / "model.safetensors")
    _copy_config(folder, tmp_path)
    save_file({**tensors, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.extra\.weight'"):
        load_model(tmp_path, torch.float32, "cpu")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(64, 64\)"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
    }))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(tmp_path, torch.float32, "cpu", load_format="dummy")


def test_newer_architectures_not_built_are_refused_saying_what_is_missing():
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 256}
    with pytest.raises(ValueError, match=r"multimodal Gemma 3"):
        ModelConfig.from_dict({**base, "architectures": ["Gemma3ForConditionalGeneration"]})
    # Granite 4 (issue 66): what it lacks beside the Mamba-2 layers that run.
    with pytest.raises(ValueError, match=r"'GraniteMoeHybridForCausalLM' is not supported: a hybrid model \(IBM's "
                                         r"Granite 4\): its Mamba-2 layers run as Nemotron-H's do, but its experts"):
        ModelConfig.from_dict({**base, "architectures": ["GraniteMoeHybridForCausalLM"]})
    gemma = {**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 4}
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelConfig.from_dict({**gemma, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="layer_types has 3 entries, the model 2 layers"):
        ModelConfig.from_dict({**gemma, "layer_types": ["sliding_attention"] * 3})
    with pytest.raises(ValueError, match="num_experts_per_tok must be between 1 and num_experts"):
        ModelConfig.from_dict({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                               "num_experts_per_tok": 5, "moe_intermediate_size": 32})


GPT_OSS_BASE = {"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 32, "vocab_size": 256,
                "num_local_experts": 8, "num_experts_per_tok": 4}


def test_gpt_oss_config_takes_transformers_defaults_and_names_bad_fields():
    config = ModelConfig.from_dict(GPT_OSS_BASE)  # every field transformers defaults left out
    hf = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_BASE.items() if k != "architectures"})
    assert config.head_dim == hf.head_dim == 64 and config.sliding_window == hf.sliding_window == 128
    assert [config.layer_window(i) for i in range(4)] == [128 if kind == "sliding_attention" else None
                                                         for kind in hf.layer_types]
    assert config.attention_bias and config.o_proj_bias and config.attention_sinks and not config.tie_word_embeddings
    assert config.rope_theta == hf.rope_parameters["rope_theta"] and config.rms_norm_eps == hf.rms_norm_eps
    assert (config.rope_scaling.factor, config.rope_scaling.original_max_position_embeddings,
            config.rope_scaling.truncate) == (32.0, 4096, False)
    moe = config.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.swiglu_limit,
            moe.swiglu_alpha) == (8, 4, 32, hf.swiglu_limit, hf.swiglu_alpha)
    assert moe.router_bias and moe.softmax_after_topk and moe.expert_bias and all(moe.sparse_layers)
    with pytest.raises(ValueError, match="swiglu_limit must be positive, got -1.0"):
        ModelConfig.from_dict({**GPT_OSS_BASE, "swiglu_limit": -1.0})
    with pytest.raises(ValueError, match="num_experts_per_tok must be between 1 and num_experts \\(8\\), got 9"):
        ModelConfig.from_dict({**GPT_OSS_BASE, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match=r"quantization_config.quant_method 'gptq' is not supported.*mxfp4"):
        ModelConfig.from_dict({**GPT_OSS_BASE, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="layer_types names sliding_attention layers but sliding_window is null"):
        ModelConfig.from_dict({**GPT_OSS_BASE, "sliding_window": None})
    with pytest.raises(ValueError, match="yarn rope_scaling factor must be positive, got 0.0"):
        ModelConfig.from_dict({**GPT_OSS_BASE, "rope_scaling": {"rope_type": "yarn", "factor": 0.0,
                                                                 "original_max_position_embeddings": 4096}})
    with pytest.raises(ValueError, match="lacks the mixture-of-experts field 'num_experts_per_tok'"):
        ModelConfig.from_dict({k: v for k, v in GPT_OSS_BASE.items() if k != "num_experts_per_tok"})


YARN_VARIANTS = [  # each a rope_parameters dict; transformers' _compute_yarn_parameters is the reference
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},  # gpt-oss's
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's, truncated ramp
    {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
     "original_max_position_embeddings": 4096},  # DeepSeek's spelling: an attention factor of 1
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.7, "original_max_position_embeddings": 2048},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8192},  # factor from the ratio
]


@pytest.mark.parametrize("variant", range(len(YARN_VARIANTS)))
def test_yarn_frequencies_and_attention_factor_equal_transformers(variant):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvreuse.layers.rotary import RotaryEmbedding, rope_inverse_frequencies

    parameters = {**YARN_VARIANTS[variant], "rope_theta": 1000000.0}
    hf_config = transformers.Qwen3Config(hidden_size=512, num_attention_heads=4, head_dim=128,
                                         max_position_embeddings=65536, rope_parameters=dict(parameters))
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    config = ModelConfig.from_dict({**QWEN25_05B_CONFIG, "architectures": ["Qwen3ForCausalLM"], "hidden_size": 512,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                                    "max_position_embeddings": 65536, "rope_scaling": dict(parameters)})
    assert config.rope_scaling.attention_factor == pytest.approx(expected_factor, rel=1e-12)
    inv_freq = rope_inverse_frequencies(128, config.rope_theta, config.rope_scaling, torch.device("cpu"))
    assert torch.equal(inv_freq, expected_inv_freq)
    # cos / sin carry the attention factor, as transformers' rotary embedding multiplies them.
    rotary = RotaryEmbedding(128, 64, config.rope_theta, config.rope_scaling, torch.device("cpu"))
    positions = torch.arange(64)
    freqs = positions[:, None].float() * expected_inv_freq[None, :]
    assert torch.equal(rotary.cos_cache, freqs.cos() * expected_factor)
    assert torch.equal(rotary.sin_cache, freqs.sin() * expected_factor)


def test_gpt_oss_router_and_experts_equal_transformers(checkpoints):
    """The router (bias, softmax over the top k logits only) and the whole MoE layer (interleaved gate / up
    split per expert, biases, the clamped SwiGLU) against transformers' modules on the same weights."""
    from kvreuse.layers import experts
    from kvreuse.layers.experts import SparseMoE

    folder, hf_model = checkpoints["gpt_oss"]
    model, _ = load_model(folder, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(5)
    for index, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, SparseMoE)
        hf_mlp = hf_model.model.layers[index].mlp
        x = torch.randn(9, 64, generator=generator)
        with torch.no_grad():
            _, hf_scores, hf_indices = hf_mlp.router(x)
            weights, experts = layer.mlp.route(x)
            assert torch.equal(experts, hf_indices)
            torch.testing.assert_close(weights, hf_scores, atol=1e-6, rtol=1e-6)
            # Softmax over the chosen logits, not over all experts: the weights sum to one.
            torch.testing.assert_close(weights.sum(-1), torch.ones(9))
            hf_out, _ = hf_mlp(x[None])
            torch.testing.assert_close(layer.mlp(x), hf_out[0], atol=1e-4, rtol=1e-4)
            # The native MoE layer (csrc/moe.h) computes gpt-oss's layer too: the Python loop's numbers exactly.
            if moe.library() is not None:
                assert layer.mlp.prepare_native() is None
                assert torch.equal(layer.mlp(x[:8]), layer.mlp.native.forward(x[:8]))
                native, layer.mlp.native = layer.mlp.native, None
                assert torch.equal(layer.mlp(x[:8]), native.forward(x[:8]))
                layer.mlp.native = native
    # Its biased experts, sinks, windows and output bias all run in the native decode step (test_native_step.py).
    if moe.library() is not None:
        assert model.native_step_refusal is None


def test_clamped_swiglu_equals_transformers_apply_gate():
    from kvreuse.layers.mlp import clamped_swiglu

    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(transformers.GptOssConfig(
        num_local_experts=2, hidden_size=8, intermediate_size=16))
    gate_up = torch.randn(5, 32, generator=torch.Generator().manual_seed(6)) * 10  # far past the limit of 7
    expected = experts._apply_gate(gate_up)
    # transformers interleaves gate and up; kvreuse holds them apart.
    assert torch.equal(clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], 7.0, 1.702), expected)
    assert not torch.equal(clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], 1e9, 1.702), expected)


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvreuse.models.llama import dequantize_mxfp4

    generator = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=generator)
    scales[0, 0, 0] = 0  # the smallest scale, 2**-127
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 10, 128)
    # transformers returns the matrices transposed for its x @ W ([E, in, out]).
    for dtype in (torch.float32, torch.bfloat16):
        expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert torch.equal(ours.to(dtype), expected)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :3])


def test_gpt_oss_mxfp4_folder_loads_as_its_dequantized_weights(checkpoints, tmp_path):
    """A folder in OpenAI's release format (experts as *_blocks / *_scales, quantization_config mxfp4) gives
    transformers' logits for the same weights dequantized; on CPU its experts stay MXFP4."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, _ = checkpoints["gpt_oss"]
    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    generator = torch.Generator().manual_seed(8)
    packed, dense = {}, {}
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stacked = tensors.pop(name)  # [E, in, out]
        experts, inputs, outputs = stacked.shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(118, 124, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=generator)
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    (tmp_path / "mxfp4").mkdir()
    (tmp_path / "dense").mkdir()
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps({
        **config, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}}))
    _copy_config(folder, tmp_path / "dense")
    save_file({**tensors, **packed}, tmp_path / "mxfp4" / "model.safetensors")
    save_file({**tensors, **dense}, tmp_path / "dense" / "model.safetensors")
    hf_model = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    runner, _ = _runner(tmp_path / "mxfp4")
    if quant_ops.available():  # held as MXFP4 (4.25 bits a weight), read by the quantized kernels
        expert = runner.model.model.layers[0].mlp.experts[0]
        assert [part.format.name for part in expert.gate_up_proj.quantized] == ["mxfp4", "mxfp4"]
        assert [part.format.name for part in expert.down_proj.quantized] == ["mxfp4"]
    prompt = [int(t) for t in torch.randint(0, 256, (19,), generator=generator)]
    logits = runner.execute(_make_batch([(PagedSequence(SCATTERED_BLOCKS), prompt)]))
    torch.testing.assert_close(logits[0], _hf_logits(hf_model, prompt)[-1], atol=1e-4, rtol=1e-4)
    # A pair missing its scales is named.
    save_file({**tensors, **{k: v for k, v in packed.items() if not k.endswith("layers.1.mlp.experts.down_proj_scales")}},
              tmp_path / "mxfp4" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        load_model(tmp_path / "mxfp4", torch.float32, "cpu")


def test_gemma3_layer_pattern_and_rope_bases_from_either_spelling():
    base = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 12, "intermediate_size": 128, "vocab_size": 256, "sliding_window": 512,
            "head_dim": 32, "query_pre_attn_scalar": 32}
    old = ModelConfig.from_dict({**base, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    new = ModelConfig.from_dict({**base, "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                         for i in range(12)],
                                 "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                        "rope_theta": 1e6},
                                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    for config in (old, new):
        assert [config.layer_window(i) for i in range(12)] == ([512] * 5 + [None]) * 2
        assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.factor) == (1e6, 1e4, 8.0)
        assert config.attention_scale == 32 ** -0.5 and config.embedding_scale == 8.0 and config.tie_word_embeddings


def test_no_weight_files_is_a_clear_error(checkpoints, tmp_path):
    _copy_config(checkpoints["mistral"][0], tmp_path)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(tmp_path, torch.float32, "cpu")


QWEN25_05B_CONFIG = {  # the shape of Qwen/Qwen2.5-0.5B-Instruct's config.json (old-style keys)
    "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA32_CONFIG = {  # the shape of meta-llama/Llama-3.2-1B's config.json
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def test_config_parses_real_config_spellings():
    qwen = ModelConfig.from_dict(QWEN25_05B_CONFIG)
    assert qwen.head_dim == 64 and qwen.attention_bias and not qwen.qk_norm
    assert qwen.sliding_window is None  # named but switched off by use_sliding_window
    assert qwen.rope_theta == 1e6 and qwen.rope_scaling is None and qwen.tie_word_embeddings
    assert qwen.eos_token_ids == (151645,) and qwen.torch_dtype == "bfloat16"
    assert qwen.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 64 * 24 * 2

    llama = ModelConfig.from_dict(LLAMA32_CONFIG)
    assert llama.rope_scaling is not None and llama.rope_scaling.factor == 32.0
    assert llama.rope_scaling.original_max_position_embeddings == 8192
    assert llama.eos_token_ids == (128001, 128008, 128009) and not llama.attention_bias

    mistral = ModelConfig.from_dict({**LLAMA32_CONFIG, "architectures": ["MistralForCausalLM"],
                                     "rope_scaling": None, "sliding_window": 4096})
    assert mistral.sliding_window == 4096 and mistral.rope_scaling is None


def test_config_rejects_unsupported_rope_and_bad_heads():
    with pytest.raises(ValueError, match=r"rope_scaling type 'longrope' is not supported.*llama3, linear, yarn"):
        ModelConfig.from_dict({**LLAMA32_CONFIG, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"num_attention_heads \(32\) must be a multiple of num_key_value_heads"):
        ModelConfig.from_dict({**LLAMA32_CONFIG, "num_key_value_heads": 5})
    with pytest.raises(ValueError, match="required field 'vocab_size'"):
        ModelConfig.from_dict({k: v for k, v in LLAMA32_CONFIG.items() if k != "vocab_size"})


def test_dummy_weights_need_no_files_and_follow_the_seed(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25_05B_CONFIG, "hidden_size": 64,
                                                      "intermediate_size": 96, "num_attention_heads": 4,
                                                      "num_hidden_layers": 2, "vocab_size": 300}))
    model_a, config = load_model(tmp_path, torch.float32, "cpu", load_format="dummy", seed=0)
    model_b, _ = load_model(tmp_path, torch.float32, "cpu", load_format="dummy", seed=0)
    model_c, _ = load_model(tmp_path, torch.float32, "cpu", load_format="dummy", seed=1)
    weight_a = model_a.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(weight_a, model_b.model.layers[0].self_attn.qkv_proj.weight)
    assert not torch.equal(weight_a, model_c.model.layers[0].self_attn.qkv_proj.weight)
    assert 0.015 < float(weight_a.std()) < 0.025
    assert torch.all(model_a.model.norm.weight == 1)
    kv_cache = KVCache.for_model(config, 8, BLOCK_SIZE, torch.float32, "cpu")
    logits = ModelRunner(model_a, config, kv_cache, "cpu").execute(
        _make_batch([(PagedSequence([3, 1, 6]), list(range(10)))])
    )
    assert logits.shape == (1, 300) and torch.isfinite(logits).all()


def test_bfloat16_model_stays_close_to_float32(checkpoints):
    folder, _ = checkpoints["qwen2"]
    prompt = list(range(40, 60))
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model, config = load_model(folder, dtype, "cpu")
        kv_cache = KVCache.for_model(config, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu")
        runner = ModelRunner(model, config, kv_cache, "cpu")
        results.append(runner.execute(_make_batch([(PagedSequence(SCATTERED_BLOCKS), prompt)]))[0])
    assert results[1].dtype == torch.float32
    assert (results[0] - results[1]).abs().max() < 0.05 * results[0].abs().max()


def test_resolve_dtype_and_model_path(tmp_path):
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu") == torch.float16
    expected_auto = torch.bfloat16 if cpu_supports_bfloat16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected_auto
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float8", "cpu")
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no-such-model"))


def test_runner_rejects_positions_beyond_the_model(checkpoints):
    runner, config = _runner(checkpoints["llama3"][0])
    sequence = PagedSequence([0] * 80)  # never written: the check comes first
    sequence.num_computed = config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 256"):
        runner.execute(_make_batch([(sequence, [1])]))


AVX512_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512vl avx512dq\n"


def test_auto_dtype_is_bfloat16_only_where_the_cpu_does_it_natively():
    from kvreuse.kernels.cpu import cpu_bfloat16_support, cpu_flags

    # Plain AVX-512: oneDNN would emulate bf16 (its own probe says "supported"), so not native.
    flags = cpu_flags(AVX512_ONLY)
    assert flags is not None and "avx512f" in flags
    native, reason = cpu_bfloat16_support(flags)
    assert not native and "no native bfloat16" in reason
    assert cpu_bfloat16_support(cpu_flags(AVX512_ONLY.replace("avx512dq", "avx512dq avx512_bf16")))[0]
    assert cpu_bfloat16_support(cpu_flags("flags : avx2 amx_tile amx_bf16\n"))[0]
    assert cpu_bfloat16_support(cpu_flags("Features\t: fp asimd bf16 i8mm\n"))[0]  # aarch64
    assert cpu_flags("no flags here") is None
    assert not cpu_bfloat16_support(frozenset())[0]


def test_auto_dtype_reason_names_the_deciding_fact():
    from kvreuse.kernels.cpu import cpu_supports_bfloat16
    from kvreuse.loading.loader import resolve_dtype_with_reason

    dtype, reason = resolve_dtype_with_reason("auto", "cpu")
    assert dtype == (torch.bfloat16 if cpu_supports_bfloat16() else torch.float32)
    assert reason.startswith("auto: the CPU has")
    assert resolve_dtype_with_reason("float32", "cpu") == (torch.float32, "as asked")


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
@pytest.mark.parametrize("window", [None, 5])
def test_forward_flops_counts_the_checkpoints_matmuls(checkpoints, kind, window):
    """forward_flops from the config equals a count over the real modules' weight shapes plus a query by
    query count of visible keys (the benchmark's warm/cold floor is built on it)."""
    folder, hf_model = checkpoints[kind]
    config = ModelConfig.from_pretrained(folder)
    config = dataclasses.replace(config, sliding_window=window)
    layers = hf_model.model.layers
    linear_per_token = sum(module.in_features * module.out_features
                           for module in layers.modules() if isinstance(module, torch.nn.Linear))
    head = hf_model.lm_head.weight.shape
    heads, head_dim = config.num_attention_heads, config.head_dim
    for cached, new, sampled in ((0, 12, 1), (9, 3, 1), (7, 1, 2)):
        visible = sum(min(position + 1, window or position + 1) for position in range(cached, cached + new))
        expected = 2 * (linear_per_token * new + len(layers) * 2 * heads * head_dim * visible
                        + sampled * head[0] * head[1])
        assert config.forward_flops(cached, new, sampled) == expected, (cached, new, sampled)
