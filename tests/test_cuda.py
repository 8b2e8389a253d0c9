"""On a CUDA GPU (skipped where there is none, as on CI): greedy output equals transformers' on the same
GPU for every architecture, cold and then served from the prefix cache (blocks of 4, so hits end
mid-block), with the cache core's invariants checked after every step; the engine's CUDA defaults (the triton
attention backend, decode steps replayed from CUDA graphs) equal eager and the torch reference; and bad input
still fails alone. tests/test_triton_backend.py and tests/test_triton_attention.py run here on the compiled
kernels too (on CI, through Triton's interpreter)."""

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


def run_checked(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
                ) -> tuple[list[list[int]], list[int]]:
    """Step the engine by hand, checking the cache invariants after every step; (tokens, cached tokens) per prompt.
    ``params``: one for every prompt, or a list with one per prompt. (tests/test_triton_backend.py uses it too.)"""
    engine = llm.engine
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for index, (prompt, prompt_params) in enumerate(zip(prompts, per_prompt)):
        engine.add_request(f"r{id(prompts)}-{index}", {"prompt_token_ids": prompt}, prompt_params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.check_integrity()
    ordered = [finished[f"r{id(prompts)}-{index}"] for index in range(len(prompts))]
    return [list(o.outputs[0].token_ids) for o in ordered], [o.num_cached_tokens for o in ordered]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gpt_oss"])
def test_greedy_equals_transformers_on_the_gpu_cold_and_warm(tiny_models: dict[str, Path], arch: str):
    """The engine as a GPU user gets it: triton attention, and decode steps from CUDA graphs (but for the MoE
    model, whose routing is on the host). Prompts pass the 16-token windows of gemma3 and gpt_oss."""
    from kvreuse.attention.triton_paged import TritonPagedAttention

    model_dir = tiny_models[arch]
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(length)] for i, length in enumerate((5, 17, 30))]
    expected = transformers_greedy(model_dir, prompts)
    llm = LLM(str(model_dir), dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=4)
    assert llm.engine.device.type == "cuda"
    runner = llm.engine.runner
    assert isinstance(runner.attention_backend, TritonPagedAttention)
    cold, cold_cached = run_checked(llm, prompts)
    warm, warm_cached = run_checked(llm, prompts)
    assert cold == expected and warm == expected
    if arch in ("qwen3_moe", "gpt_oss"):
        assert runner.decode.cuda_graphs is None and "mixture-of-experts" in runner.decode.no_graphs_reason
    else:
        assert runner.decode.cuda_graphs is not None and runner.decode.cuda_graphs.replays > 0
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


def test_cuda_graphs_equal_eager_and_the_torch_reference(tiny_models: dict[str, Path]):
    """Five sequences of ragged lengths decode together (the graph of 8 rows, three padding rows that store
    nothing), then a smaller batch as they finish: greedy output with graphs equals enforce_eager's and the torch
    backend's, cold and warm, the invariants checked every step. The graphs' memory is taken from kv_cache_memory."""
    model_dir = tiny_models["qwen2"]
    prompts = [[(11 * i + 5 * j) % 250 + 1 for j in range(length)] for i, length in enumerate((3, 9, 14, 22, 40))]
    runs = {}
    for name, options in (("graphs", {}), ("eager", {"enforce_eager": True}),
                          ("torch", {"attention_backend": "torch", "enforce_eager": True})):
        llm = LLM(str(model_dir), dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=4,
                  max_num_seqs=8, **options)
        cold, _ = run_checked(llm, prompts)
        warm, warm_cached = run_checked(llm, prompts)
        assert warm_cached == [len(prompt) - 1 for prompt in prompts]
        runs[name] = (cold, warm, llm.engine.runner, llm.engine.kv_cache.num_blocks)
    assert runs["graphs"][:2] == runs["eager"][:2] == runs["torch"][:2]
    graphs = runs["graphs"][2].cuda_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8] and graphs.replays > 0
    assert runs["eager"][2].cuda_graphs is None and runs["eager"][2].no_graphs_reason == "enforce_eager"
    assert runs["graphs"][3] < runs["eager"][3]  # the graphs' activations came out of the pool's budget


def test_triton_kernels_equal_the_torch_reference_on_the_gpu_in_bfloat16(tiny_models: dict[str, Path]):
    """bfloat16 on the GPU: the triton backend's logits of a prefill and of decode steps against the torch
    backend's, within bfloat16's rounding (their summation orders differ)."""
    model_dir = tiny_models["qwen3"]
    prompt = [(3 * j) % 250 + 1 for j in range(37)]
    logprobs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", kv_cache_memory="8MiB", block_size=16,
                  attention_backend=backend)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        logprobs[backend] = (list(output.token_ids), [entry.logprob for entry in output.logprobs])
    assert logprobs["triton"][0][:2] == logprobs["torch"][0][:2]
    assert torch.allclose(torch.tensor(logprobs["triton"][1][:2]), torch.tensor(logprobs["torch"][1][:2]), atol=0.1)
