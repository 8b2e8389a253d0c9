"""kvreuse make-model: folders must load offline in transformers with the shapes of the named models."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import cold_cache_env
from safetensors import safe_open

from kvreuse.model_tools.make_model import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    MIN_TOKENIZER_VOCAB,
    count_parameters,
    default_model_dir,
    ensure_model,
    main_make_model,
    make_model,
    trained_tokenizer_path,
)

ARCHES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", autouse=True)
def kvreuse_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh (cold) kvreuse cache for this module's tests (the session's built kernels linked in), and no
    network for transformers; the session's cache again after them."""
    with cold_cache_env(tmp_path_factory.mktemp("kvreuse-cache")) as cache:
        yield cache


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_model(root / arch, preset="tiny", arch=arch) for arch in ARCHES}


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for file_name in files:
        with safe_open(str(model_dir / file_name), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_folder_loads_in_transformers_with_our_weights(tiny_dirs: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_dirs[arch]
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    # Nothing left to random init and nothing ignored: every HF parameter name is right.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == read_config(model_dir)["architectures"][0]
    state = model.state_dict()
    for name, tensor in read_tensors(model_dir).items():
        assert torch.equal(state[name], tensor.float()), name
    logits = model(torch.tensor([[5, 17, 300, 2]])).logits
    assert logits.shape == (1, 4, read_config(model_dir)["vocab_size"])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_tokenizer_loads_in_transformers_and_matches_trained_tokenizer(tiny_dirs: dict[str, Path], arch: str) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import AutoTokenizer

    model_dir = tiny_dirs[arch]
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    raw = RawTokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "def f(x):\n    return x * 42  # café 🙂 — done!\n"
    # Same ids as the trained pipeline: no model-specific class rewrote the pre-tokenizer, no bos.
    assert hf_tokenizer.encode(text) == raw.encode(text).ids
    assert hf_tokenizer.decode(hf_tokenizer.encode(text)) == text
    assert hf_tokenizer.eos_token == IM_END
    assert len(hf_tokenizer) == read_config(model_dir)["vocab_size"]
    special_ids = hf_tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END])
    assert sorted(special_ids) == sorted(hf_tokenizer.all_special_ids)


def test_tiny_config_values_per_arch(tiny_dirs: dict[str, Path]) -> None:
    for arch, model_dir in tiny_dirs.items():
        config = read_config(model_dir)
        assert config["model_type"] == arch
        assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 128, 2)
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
        assert config["torch_dtype"] == "bfloat16"
        assert 900 <= config["vocab_size"] <= 1100
        im_end_id = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"][2]["id"]
        assert im_end_id in config["eos_token_id"]
        generation = json.loads((model_dir / "generation_config.json").read_text())
        assert im_end_id in generation["eos_token_id"]
        names = set(read_tensors(model_dir))
        assert ("model.layers.1.self_attn.q_proj.bias" in names) == (arch == "qwen2")
        assert ("model.layers.1.self_attn.k_norm.weight" in names) == (arch == "qwen3")
        expected_head_dim = 32 if arch == "qwen3" else 16
        assert config["head_dim"] == expected_head_dim
    llama = read_config(tiny_dirs["llama"])
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert llama["rope_scaling"]["original_max_position_embeddings"] < llama["max_position_embeddings"]
    assert read_config(tiny_dirs["mistral"])["sliding_window"] is None
    qwen3_tensors = read_tensors(tiny_dirs["qwen3"])
    assert qwen3_tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert qwen3_tensors["model.layers.0.self_attn.q_norm.weight"].shape == (32,)


REAL_PRESETS = {
    # preset: (model_type, hidden, layers, heads, kv heads, vocab, tied, rope_theta, max_pos, real parameter count)
    "smollm2-135m": ("llama", 576, 30, 9, 3, 49152, True, 100000.0, 8192, 134_515_008),
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 151936, True, 1000000.0, 32768, 494_032_768),
    "llama-3-8b": ("llama", 4096, 32, 32, 8, 128256, False, 500000.0, 8192, 8_030_261_248),
}


@pytest.mark.parametrize("preset", sorted(REAL_PRESETS))
def test_real_presets_have_real_shapes(tmp_path: Path, preset: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, hidden, layers, heads, kv_heads, vocab, tied, theta, max_pos, num_params = REAL_PRESETS[preset]
    model_dir = make_model(tmp_path / preset, preset=preset, write_weights=False)
    config = read_config(model_dir)
    assert config["model_type"] == model_type
    assert (config["hidden_size"], config["num_hidden_layers"]) == (hidden, layers)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (heads, kv_heads)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (vocab, tied)
    assert (config["rope_theta"], config["max_position_embeddings"]) == (theta, max_pos)
    # The config vocab is the real one even though the trained tokenizer is smaller.
    assert len(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]) < vocab
    assert count_parameters(preset) == num_params
    # transformers builds the same parameter count from our config.json (on meta: no memory).
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    assert sum(p.numel() for p in hf_model.parameters()) == num_params


def test_llama_3_8b_writes_no_weights_by_default(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "l8", preset="llama-3-8b")
    assert not list(model_dir.glob("*.safetensors*"))
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / "config.json").is_file()


def test_sharded_output_has_index_and_same_tensors(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    sharded = make_model(tmp_path / "sharded", preset="tiny", arch="qwen2", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 3
    assert all((sharded / name).is_file() for name in files)
    assert not (sharded / "model.safetensors").exists()
    tensors = read_tensors(sharded)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name in files:  # a shard is within the limit unless it holds one tensor bigger than it
        shard_names = [key for key, file_name in index["weight_map"].items() if file_name == name]
        shard_bytes = sum(tensors[key].numel() * tensors[key].element_size() for key in shard_names)
        assert shard_bytes <= 100_000 or len(shard_names) == 1
    # Values depend on (seed, name) only, so sharding does not change them.
    unsharded = read_tensors(tiny_dirs["qwen2"])
    assert set(unsharded) == set(tensors)
    assert all(torch.equal(unsharded[name], tensors[name]) for name in tensors)
    model, info = AutoModelForCausalLM.from_pretrained(sharded, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    # Re-making the same folder unsharded removes the stale shards and the index.
    make_model(tmp_path / "sharded", preset="tiny", arch="qwen2")
    assert sorted(p.name for p in (tmp_path / "sharded").glob("model*")) == ["model.safetensors"]


def test_weights_dtype_and_initialisation(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    bf16 = read_tensors(tiny_dirs["llama"])
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    fp32_dir = make_model(tmp_path / "fp32", preset="tiny", dtype="float32")
    assert read_config(fp32_dir)["torch_dtype"] == "float32"
    fp32 = read_tensors(fp32_dir)
    assert {t.dtype for t in fp32.values()} == {torch.float32}
    # Same values up to the bf16 rounding: the dtype only changes the storage.
    assert torch.equal(fp32["model.embed_tokens.weight"].bfloat16(), bf16["model.embed_tokens.weight"])
    assert torch.equal(fp32["model.norm.weight"], torch.ones(64))
    embed = fp32["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.002 and abs(embed.mean().item()) < 0.002
    # Different tensors get different random streams.
    assert not torch.equal(fp32["model.layers.0.mlp.gate_proj.weight"], fp32["model.layers.0.mlp.up_proj.weight"])


def test_same_seed_same_weights_other_seed_different(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    again = make_model(tmp_path / "again", preset="tiny", arch="llama", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_dirs["llama"] / "model.safetensors").read_bytes()
    other = make_model(tmp_path / "other", preset="tiny", arch="llama", seed=1)
    first, second = read_tensors(again), read_tensors(other)
    assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])
    assert torch.equal(first["model.norm.weight"], second["model.norm.weight"])


def test_chat_template_renders_chatml(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without_prompt == with_prompt[: -len("<|im_start|>assistant\n")]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\na\nb<|im_end|>\n"


def test_cli_no_weights_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main_make_model([str(out), "--preset", "smollm2-135m", "--no-weights", "--dtype", "float32"]) == 0
    assert not list(out.glob("*.safetensors*"))
    assert read_config(out)["torch_dtype"] == "float32"
    assert "smollm2-135m" in capsys.readouterr().out

    sharded = tmp_path / "cli-sharded"
    assert main_make_model([str(sharded), "--arch", "mistral", "--seed", "3", "--max-shard-size", "150KB"]) == 0
    assert (sharded / "model.safetensors.index.json").is_file()
    assert read_config(sharded)["model_type"] == "mistral"

    assert main_make_model([str(tmp_path / "bad"), "--max-shard-size", "lots"]) == 2
    assert "max_shard_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main_make_model([str(tmp_path / "bad"), "--preset", "gpt-5"])


def test_bad_arguments_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        make_model(tmp_path / "x", preset="gpt-5")
    with pytest.raises(ValueError, match="arch"):
        make_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="dtype"):
        make_model(tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="seed"):
        make_model(tmp_path / "x", seed=-1)
    with pytest.raises(ValueError, match=f"vocab_size_override.*{MIN_TOKENIZER_VOCAB}"):
        make_model(tmp_path / "x", vocab_size_override=100)


def test_vocab_size_override_keeps_config_vocab_at_least_tokenizer_size(tmp_path: Path) -> None:
    small = make_model(tmp_path / "small", vocab_size_override=512)
    assert read_config(small)["vocab_size"] == 512
    assert len(json.loads((small / "tokenizer.json").read_text())["model"]["vocab"]) <= 512
    assert read_tensors(small)["model.embed_tokens.weight"].shape == (512, 64)
    large = make_model(tmp_path / "large", vocab_size_override=5000)
    assert read_config(large)["vocab_size"] == 5000
    assert read_tensors(large)["lm_head.weight"].shape == (5000, 64)


def test_tokenizer_training_is_cached_and_deterministic(kvreuse_cache_dir: Path) -> None:
    path = trained_tokenizer_path(700)
    assert kvreuse_cache_dir in path.parents
    first = path.read_bytes()
    path.unlink()  # cold cache again: training must reproduce the same tokenizer
    retrained = trained_tokenizer_path(700)
    assert retrained == path and retrained.read_bytes() == first
    mtime = path.stat().st_mtime_ns
    assert trained_tokenizer_path(700) == path
    assert path.stat().st_mtime_ns == mtime  # served from the cache, not retrained


def test_tiny_is_fast_to_make(tmp_path: Path) -> None:
    start = time.perf_counter()
    make_model(tmp_path / "fast", preset="tiny", arch="qwen3", seed=7)
    # The budget is 3 s on a quiet machine; the margin absorbs a busy shared CI box.
    assert time.perf_counter() - start < 6.0
    assert (tmp_path / "fast" / "model.safetensors").stat().st_size < 2_000_000


def test_ensure_model_makes_once_atomically(kvreuse_cache_dir: Path) -> None:
    target = default_model_dir("tiny", arch="mistral")
    assert kvreuse_cache_dir in target.parents
    made = ensure_model("tiny", arch="mistral")
    assert made == target and (made / "model.safetensors").is_file()
    mtime = (made / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", arch="mistral") == made
    assert (made / "model.safetensors").stat().st_mtime_ns == mtime
    leftovers = [p.name for p in made.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []
