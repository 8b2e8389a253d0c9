"""On a CUDA GPU (skipped where there is none, as on CI): greedy output equals transformers' on the same
GPU for every architecture, cold and then served from the prefix cache (blocks of 4, so hits end
mid-block), with the cache core's invariants checked after every step; and bad input still fails alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvreuse import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def transformers_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            generated: list[int] = []
            out = model(torch.tensor([prompt], device="cuda"), use_cache=True)
            for _ in range(MAX_NEW):
                generated.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([[generated[-1]]], device="cuda"), past_key_values=out.past_key_values,
                            use_cache=True)
            results.append(generated)
    return results


def run_checked(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Step the engine by hand, checking the cache invariants after every step."""
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{id(prompts)}-{index}", {"prompt_token_ids": prompt}, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.check_integrity()
    ordered = [finished[f"r{id(prompts)}-{index}"] for index in range(len(prompts))]
    return [list(o.outputs[0].token_ids) for o in ordered], [o.num_cached_tokens for o in ordered]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_equals_transformers_on_the_gpu_cold_and_warm(tiny_models: dict[str, Path], arch: str):
    model_dir = tiny_models[arch]
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(length)] for i, length in enumerate((5, 17, 30))]
    expected = transformers_greedy(model_dir, prompts)
    llm = LLM(str(model_dir), dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=4)
    assert llm.engine.device.type == "cuda"
    cold, cold_cached = run_checked(llm, prompts)
    warm, warm_cached = run_checked(llm, prompts)
    assert cold == expected and warm == expected
    # Token-granular reuse: all of each prompt but its last token, which is computed to sample from.
    assert cold_cached == [0, 0, 0] and warm_cached == [len(prompt) - 1 for prompt in prompts]


def test_bad_input_fails_alone_on_the_gpu(tiny_model: Path):
    llm = LLM(str(tiny_model), dtype="float32", device="cuda", kv_cache_memory="8MiB", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([{"prompt_token_ids": list(range(1, 80))}], GREEDY, use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == MAX_NEW
    assert llm.stats()["blocks_free"] == llm.stats()["blocks_total"] - llm.stats()["blocks_idle_cached"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_pool_on_the_gpu(tiny_models: dict[str, Path], kv_cache_dtype: str):
    """The quantized pool's code on CUDA (kvreuse.cache.kv_quant: the same as on CPU): greedy output equals
    the model-dtype pool's on the same GPU, cold and from the cache, the invariants checked every step."""
    model_dir = tiny_models["qwen2"]
    prompts = [[(5 * i + 2 * j) % 250 + 1 for j in range(length)] for i, length in enumerate((9, 26, 41))]
    reference = LLM(str(model_dir), dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=4)
    expected, _ = run_checked(reference, prompts)
    llm = LLM(str(model_dir), dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=4,
              kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.kv_cache.kv.device.type == "cuda" and llm.engine.kv_cache.kv.element_size() == 1
    assert llm.engine.kv_cache.num_blocks > 1.5 * reference.engine.kv_cache.num_blocks
    cold, _ = run_checked(llm, prompts)
    warm, warm_cached = run_checked(llm, prompts)
    assert cold == expected and warm == expected
    assert warm_cached == [len(prompt) - 1 for prompt in prompts]
