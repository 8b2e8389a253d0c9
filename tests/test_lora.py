"""Multi-LoRA: outputs equal transformers + PEFT token for token, and the cache never mixes adapters.

Adapters are made here with PEFT (``init_lora_weights=False``, so B is not zero and the adapter
really changes the outputs), float32, on the tiny Llama and Qwen2 folders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvreuse import LLM, LoRARequest, SamplingParams
from kvreuse.cache.hashing import namespace_key
from kvreuse.errors import InvalidRequestError

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def make_adapter(model_dir: Path, out: Path, *, rank: int = 8, alpha: float = 16, seed: int = 0,
                 rslora: bool = False, targets: list[str] | None = None, **extra) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_MODULES, init_lora_weights=False,
                        use_rslora=rslora, lora_dropout=0.0, **extra)
    model = get_peft_model(base, config)
    with torch.no_grad():  # PEFT's random init is small: make the adapter change greedy outputs for sure
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(8.0)
    model.save_pretrained(out)
    return out


_references: dict[tuple[Path, Path | None], object] = {}


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    """transformers (+ PEFT) greedy decoding with its own KV cache."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _references.get((model_dir, adapter_dir))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir)
        model = model.eval()
        _references[(model_dir, adapter_dir)] = model
    generated: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new):
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1000, (length,), generator=generator).tolist()


def make_llm(model_dir: Path, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4, enable_lora=True,
                   max_loras=2, max_lora_rank=16)
    options.update(kwargs)
    return LLM(str(model_dir), **options)


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def adapters(tiny_models: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "llama-a": make_adapter(tiny_models["llama"], root / "llama-a", seed=1),
        "llama-b": make_adapter(tiny_models["llama"], root / "llama-b", seed=2, targets=["q_proj", "v_proj", "down_proj"]),
        "qwen2-a": make_adapter(tiny_models["qwen2"], root / "qwen2-a", seed=3),
        "qwen2-rs": make_adapter(tiny_models["qwen2"], root / "qwen2-rs", seed=4, rank=4, alpha=8, rslora=True),
    }


@pytest.mark.parametrize(("arch", "adapter"), [("llama", "llama-a"), ("llama", "llama-b"), ("qwen2", "qwen2-a"),
                                               ("qwen2", "qwen2-rs")])
def test_greedy_equals_peft_cold_warm_and_mid_block(tiny_models, adapters, arch, adapter):
    model_dir, adapter_dir = tiny_models[arch], adapters[adapter]
    llm = make_llm(model_dir)
    lora = LoRARequest(adapter, 1, str(adapter_dir))
    base_prompt = prompt(10, 21)
    cold = llm.generate([{"prompt_token_ids": base_prompt}], GREEDY, use_tqdm=False, lora_request=lora)[0]
    expected = peft_greedy(model_dir, adapter_dir, base_prompt)
    assert cold.outputs[0].token_ids == expected
    assert cold.num_cached_tokens == 0
    assert expected != peft_greedy(model_dir, None, base_prompt)  # the adapter changes the output
    warm = llm.generate([{"prompt_token_ids": base_prompt}], GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert warm.num_cached_tokens == 20 and warm.outputs[0].token_ids == expected
    # A hit that ends inside a block (token-granular reuse), then new tokens under the adapter.
    longer = base_prompt[:18] + prompt(11, 9)
    mid = llm.generate([{"prompt_token_ids": longer}], GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert mid.num_cached_tokens == 18 and mid.outputs[0].token_ids == peft_greedy(model_dir, adapter_dir, longer)
    llm.engine.check_integrity()


def test_mixed_batch_equals_each_request_alone(tiny_models, adapters):
    model_dir = tiny_models["llama"]
    a = LoRARequest("a", 1, str(adapters["llama-a"]))
    b = LoRARequest("b", 2, str(adapters["llama-b"]))
    prompts = [{"prompt_token_ids": prompt(20 + i, 13 + 3 * i)} for i in range(6)]
    loras = [a, b, None, b, a, None]
    mixed = make_llm(model_dir).generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    alone_llm = make_llm(model_dir, enable_prefix_caching=False)
    alone = [alone_llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora)[0] for p, lora in zip(prompts, loras)]
    assert token_ids(mixed) == token_ids(alone)
    assert token_ids(mixed)[2] == peft_greedy(model_dir, None, prompts[2]["prompt_token_ids"])
    assert token_ids(mixed)[0] == peft_greedy(model_dir, adapters["llama-a"], prompts[0]["prompt_token_ids"])


def test_cache_never_mixes_adapters(tiny_models, adapters, tmp_path):
    model_dir = tiny_models["llama"]
    llm = make_llm(model_dir)
    a = LoRARequest("a", 1, str(adapters["llama-a"]))
    b = LoRARequest("b", 2, str(adapters["llama-b"]))
    shared = {"prompt_token_ids": prompt(30, 24)}
    assert llm.generate([shared], GREEDY, use_tqdm=False, lora_request=a)[0].num_cached_tokens == 0
    assert llm.generate([shared], GREEDY, use_tqdm=False, lora_request=b)[0].num_cached_tokens == 0
    assert llm.generate([shared], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0  # the base model
    assert llm.generate([shared], GREEDY, use_tqdm=False, lora_request=a)[0].num_cached_tokens == 23
    # The same weights under another name and id share KV: identity is the digest, not the name.
    alias = LoRARequest("a-again", 7, str(adapters["llama-a"]))
    assert llm.generate([shared], GREEDY, use_tqdm=False, lora_request=alias)[0].num_cached_tokens == 23

    # A base request whose cache_salt is the adapter's digest string lands in another namespace.
    digest = llm.engine.adapter_digest(a)
    assert namespace_key(digest, None, "m") != namespace_key(None, digest, "m")
    salted = llm.generate([shared], GREEDY, use_tqdm=False, cache_salt=digest)[0]
    assert salted.num_cached_tokens == 0

    # The same name reloaded in place with new weights: no hit, output of the new weights.
    moving = tmp_path / "moving"
    shutil.copytree(adapters["llama-a"], moving)
    reloaded = LoRARequest("moving", 3, str(moving))
    first = llm.generate([shared], GREEDY, use_tqdm=False, lora_request=reloaded)[0]
    assert first.num_cached_tokens == 23  # same weights as "a" so far
    new_weights = make_adapter(model_dir, tmp_path / "new-weights", seed=5)  # same shapes, other values
    shutil.copy(new_weights / "adapter_model.safetensors", moving / "adapter_model.safetensors")
    second = llm.generate([shared], GREEDY, use_tqdm=False, lora_request=reloaded)[0]
    assert second.num_cached_tokens == 0
    assert second.outputs[0].token_ids == peft_greedy(model_dir, new_weights, shared["prompt_token_ids"])
    assert second.outputs[0].token_ids != first.outputs[0].token_ids
    llm.engine.check_integrity()


def test_at_most_max_loras_resident_and_unloading_keeps_kv(tiny_models, adapters, tmp_path):
    model_dir = tiny_models["llama"]
    llm = make_llm(model_dir, max_loras=1)
    a = LoRARequest("a", 1, str(adapters["llama-a"]))
    b = LoRARequest("b", 2, str(adapters["llama-b"]))
    shared = {"prompt_token_ids": prompt(40, 17)}
    outputs = llm.generate([shared, shared, shared], GREEDY, use_tqdm=False, lora_request=[a, b, a])
    assert len(llm.engine.lora.resident) == 1
    assert token_ids(outputs)[0] == token_ids(outputs)[2]
    loads = llm.engine.lora.num_loads
    again = llm.generate([shared], GREEDY, use_tqdm=False, lora_request=a)[0]  # "a" was unloaded for "b"
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == token_ids(outputs)[0]
    assert llm.engine.lora.num_loads >= loads


def test_bare_safetensors_file_as_in_the_seed(tiny_models, adapters, tmp_path):
    model_dir = tiny_models["qwen2"]
    folder = tmp_path / "bare"
    folder.mkdir()
    bare = folder / "french_adapter.safetensors"
    shutil.copy(adapters["qwen2-a"] / "adapter_model.safetensors", bare)
    llm = make_llm(model_dir)
    with pytest.raises(InvalidRequestError, match="lora_alpha") as error:
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("french", 1, str(bare)))
    assert error.value.param == "lora_alpha"
    config = json.loads((adapters["qwen2-a"] / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({"lora_alpha": config["lora_alpha"]}))
    ids = prompt(50, 15)
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("french", 1, str(bare)))[0]
    assert out.outputs[0].token_ids == peft_greedy(model_dir, adapters["qwen2-a"], ids)


@pytest.mark.parametrize(("change", "field"), [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"target_modules": ["embed_tokens"]}, "target_modules"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
])
def test_refusals_name_the_field(tiny_models, adapters, tmp_path, change, field):
    folder = tmp_path / "bad"
    shutil.copytree(adapters["llama-a"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(change)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    llm = make_llm(tiny_models["llama"])
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 1, str(folder)))
    assert error.value.param == field, error.value
    assert not llm.engine.has_unfinished_requests()


def test_rank_shape_and_module_refusals(tiny_models, adapters, tmp_path):
    llm = make_llm(tiny_models["llama"], max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="max_lora_rank=4") as error:
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters["llama-a"])))
    assert error.value.param == "max_lora_rank"
    llm = make_llm(tiny_models["llama"])
    # An adapter made for another model (qwen2's tiny shapes differ from llama's? then the shape check fires).
    wrong = tmp_path / "wrong"
    shutil.copytree(adapters["llama-a"], wrong)
    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    name = next(n for n in tensors if n.endswith("q_proj.lora_B.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match="do not fit the base model"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("w", 1, str(wrong)))
    extra = tmp_path / "extra"
    shutil.copytree(adapters["llama-a"], extra)
    tensors = load_file(str(extra / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 4)
    save_file(tensors, str(extra / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(extra)))
    assert error.value.param == "target_modules"
    off = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    with pytest.raises(InvalidRequestError, match="enable_lora") as error:
        off.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters["llama-a"])))


def test_seed_lora_example_through_kvreuse_run(tiny_models, adapters, tmp_path):
    """The system prompt cache seed's LoRA example, end to end through the real console script."""
    import os
    import subprocess

    model_dir = tiny_models["qwen2"]
    french = tmp_path / "french_adapter.safetensors"
    shutil.copy(adapters["qwen2-a"] / "adapter_model.safetensors", french)
    shutil.copy(adapters["qwen2-a"] / "adapter_config.json", tmp_path / "adapter_config.json")
    system = "Translate the following to French. Keep the register and the punctuation of the original. " * 2
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]
    batch = {
        "available_lora_weights": {"french": str(french)},
        "requests": [
            {"messages": conversation, "lora_name": "french", "save_system_prompt_kv_cache": True, "max_tokens": 3},
            {"messages": conversation, "lora_name": "french", "max_tokens": 3},
            {"messages": conversation, "max_tokens": 3},  # the base model: never the adapter's entry
            {"messages": conversation, "lora_name": "german", "max_tokens": 3},
        ],
    }
    path, out = tmp_path / "batch.json", tmp_path / "results.json"
    path.write_text(json.dumps(batch))
    done = subprocess.run(["kvreuse", "run", str(path), "--model", str(model_dir), "--output", str(out),
                           "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8MiB"],
                          capture_output=True, text=True, timeout=180, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr
    saved, reused, base, unknown = json.loads(out.read_text())["results"]
    assert saved["error"] is None and len(saved["saved_entries"]) == 1
    assert reused["hit_entries"] == saved["saved_entries"] and reused["metrics"]["reused_tokens"] > 20
    assert base["error"] is None and base["hit_entries"] == [] and base["metrics"]["reused_tokens"] == 0
    assert base["text"] != saved["text"] or saved["text"] == ""
    assert "requests[3]" in unknown["error"] and "'german' is not in available_lora_weights" in unknown["error"]


def test_pins_saved_under_an_adapter_serve_only_that_adapter(tiny_models, adapters):
    model_dir = tiny_models["qwen2"]
    llm = make_llm(model_dir, kv_cache_memory="16MiB")
    french = LoRARequest("french", 1, str(adapters["qwen2-a"]))
    system = [{"role": "system", "content": "Translate the following to French, keeping the tone. " * 4}]
    pin = llm.pin(system, lora_request=french)
    assert pin["tokens"] >= 16 and pin["adapter"] == llm.engine.adapter_digest(french)
    question = system + [{"role": "user", "content": "Hello"}]
    base = llm.chat(question, GREEDY, use_tqdm=False)[0]
    assert base.num_cached_tokens == 0 and base.pins_hit == []
    adapted = llm.chat(question, GREEDY, use_tqdm=False, lora_request=french)[0]
    assert adapted.pins_hit == [pin["id"]] and adapted.num_cached_tokens >= pin["tokens"]
    assert llm.pin(system)["id"] != pin["id"]  # the base model's entry is another entry


def test_router_keys_an_adapter_request_as_the_engine_does(tiny_models, adapters):
    """The router maps a served adapter name to (base model, digest) from /v1/models, so its block keys
    are the engine's: a prefix cached under one adapter never draws a request for another, or the base."""
    from kvreuse.router.app import RouterConfig, RouterState

    model_dir = tiny_models["qwen2"]
    llm = make_llm(model_dir, served_model_name="m", block_size=16, kv_cache_memory="16MiB")
    french = LoRARequest("french", 1, str(adapters["qwen2-a"]))
    messages = [{"role": "system", "content": "Translate the following to French, keeping the tone. " * 4},
                {"role": "user", "content": "Hello"}]
    engine = llm.engine
    engine.add_request("r", llm.inputs.from_messages(messages).as_engine_prompt(), GREEDY, lora_request=french)
    engine.step()
    engine_keys = list(engine.scheduler.running[0].block_keys)
    assert len(engine_keys) >= 2

    state = RouterState(RouterConfig(backends=("http://a",), tokenizer=str(model_dir)))
    backend = state.pool.backends["http://a"]
    backend.model_name, backend.adapters = "m", {"french": engine.adapter_digest(french)}
    adapted = state.route_request({"model": "french", "messages": messages}, chat=True, session_id=None)
    base = state.route_request({"model": "m", "messages": messages}, chat=True, session_id=None)
    assert list(adapted.block_keys[: len(engine_keys)]) == engine_keys
    assert not set(adapted.block_keys) & set(base.block_keys)


def test_adapters_pins_and_tenants_work_unchanged_on_a_quantized_pool(tiny_models, adapters):
    """kv_cache_dtype int8 (issue 31): an adapter's blocks stay its own, a pin saved under it serves only it,
    a tenant's salt keeps its own namespace, with the cache invariants checked after the runs. (Greedy
    tokens are not compared with the model-dtype pool's here: this adapter's random, amplified weights make
    near-ties that any rounding flips; tests/test_kv_quant.py compares them without an adapter.)"""
    model_dir = tiny_models["qwen2"]
    french = LoRARequest("french", 1, str(adapters["qwen2-a"]))
    shared = {"prompt_token_ids": prompt(40, 26)}
    llm = make_llm(model_dir, kv_cache_memory="16MiB", kv_cache_dtype="int8")
    assert llm.engine.kv_cache.scheme is not None
    assert llm.generate([shared], GREEDY, use_tqdm=False, lora_request=french)[0].num_cached_tokens == 0
    assert llm.generate([shared], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0  # the base model: a miss
    assert llm.generate([shared], GREEDY, use_tqdm=False, cache_salt="tenant-b",
                        lora_request=french)[0].num_cached_tokens == 0  # another tenant: a miss
    assert llm.generate([shared], GREEDY, use_tqdm=False, lora_request=french)[0].num_cached_tokens == 25
    system = [{"role": "system", "content": "Translate the following to French, keeping the tone. " * 4}]
    pin = llm.pin(system, lora_request=french)
    question = system + [{"role": "user", "content": "Hello"}]
    assert llm.chat(question, GREEDY, use_tqdm=False)[0].pins_hit == []
    adapted = llm.chat(question, GREEDY, use_tqdm=False, lora_request=french)[0]
    assert adapted.pins_hit == [pin["id"]] and adapted.num_cached_tokens >= pin["tokens"]
    llm.engine.check_integrity()
