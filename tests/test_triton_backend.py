"""The triton attention backend inside the engine, run on CPU through Triton's interpreter (``TRITON_INTERPRET=1``:
the kernels execute with NumPy on CPU tensors), so CI's machines check what a GPU would run: greedy output equals
the torch backend's (the reference) token for token, cold and from the prefix cache (hits ending mid-block), on
the architectures whose layers differ (Gemma 3's windows, gpt-oss's windows with sinks), with the cache
invariants checked after every step; and a quantized pool. On a GPU the same tests run the compiled kernels.

The kernels' own cases (block sizes, GQA, head sizes, KV dtypes, splits) are in tests/test_triton_attention.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from test_cuda import run_checked  # noqa: E402

from kvreuse import LLM, SamplingParams  # noqa: E402
from kvreuse.attention.triton_paged import TritonPagedAttention  # noqa: E402

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def outputs(model_dir: Path, backend: str, prompts: list[list[int]], **options) -> tuple[list, list, list, list]:
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, kv_cache_memory="2MiB", block_size=4,
              attention_backend=backend, enforce_eager=True, **options)
    if backend == "triton":
        assert isinstance(llm.engine.runner.attention_backend, TritonPagedAttention)
    cold, cold_cached = run_checked(llm, prompts, GREEDY)
    warm, warm_cached = run_checked(llm, prompts, GREEDY)
    return cold, warm, cold_cached, warm_cached


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gpt_oss"])
def test_triton_backend_greedy_equals_the_torch_backend_cold_and_warm(tiny_models: dict[str, Path], arch: str):
    """Windows of 16 tokens (Gemma 3, gpt-oss) are passed by prompts of 21 and 27 tokens; gpt-oss's layers have
    sinks; qwen3 has GQA 2 with head size 32. Three prompts run at once: the steps mix a prefill with decodes."""
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(length)] for i, length in enumerate((5, 21, 27))]
    expected = outputs(tiny_models[arch], "torch", prompts)
    got = outputs(tiny_models[arch], "triton", prompts)
    assert got[0] == expected[0] and got[1] == expected[1]
    # Token-granular reuse: all of each prompt but its last token, hits ending mid-block (blocks of 4).
    assert got[2] == [0, 0, 0] and got[3] == [len(prompt) - 1 for prompt in prompts]


def test_triton_backend_on_a_quantized_pool(tiny_models: dict[str, Path]):
    """int8 codes and their scales, written by the backend's store and read by its kernels in place: greedy output
    equals the torch backend's on the same quantized pool, cold and warm."""
    prompts = [[(5 * i + 2 * j) % 250 + 1 for j in range(length)] for i, length in enumerate((9, 14))]
    expected = outputs(tiny_models["qwen2"], "torch", prompts, kv_cache_dtype="int8")
    got = outputs(tiny_models["qwen2"], "triton", prompts, kv_cache_dtype="int8")
    assert got == expected


def test_triton_backend_refusals(tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    """Asked for where it cannot run, the backend is refused naming why; under auto, CPU keeps its own kernel."""
    if torch.cuda.is_available():
        pytest.skip("the refusals are those of a machine without a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend 'triton' cannot run here: its kernels run on CUDA"):
        LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="2MiB", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The compiled decode is retired: the option is refused with the reason, whatever the backend.
    with pytest.raises(ValueError, match="enable_torch_compile is retired: decode steps run the native CPU step"):
        LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="2MiB", attention_backend="triton",
            enable_torch_compile=True)
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="2MiB")
    assert not isinstance(llm.engine.runner.attention_backend, TritonPagedAttention)
    assert llm.engine.runner.decode.cuda_graphs is None
    assert llm.engine.runner.decode.no_graphs_reason == "CUDA graphs need a CUDA device, this engine runs on cpu"


def test_graph_replay_buffers_on_cpu(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch):
    """The CUDA-graph runner's static buffers, padding and output rows, checked where no GPU is: CUDA graphs
    cannot be captured on CPU, so here (and only here) a graph's replay is stood in for by running the same
    forward over the same static buffers. Five ragged sequences replay the 8-row size (three padding rows with
    slot -1 and context 0), then smaller sizes as they finish; greedy output equals the eager engine's, cold and
    warm, with the invariants checked every step. On a GPU tests/test_cuda.py runs the real graphs."""
    if torch.cuda.is_available():
        pytest.skip("tests/test_cuda.py replays real graphs on this machine")
    from kvreuse.runner.decode import cuda_graphs

    class ForwardAsGraph:
        def __init__(self, runner: cuda_graphs.CudaGraphDecode, size: int) -> None:
            self.runner, self.size = runner, size

        def replay(self) -> None:
            _, hidden, logits = self.runner.graphs[self.size]
            new_hidden, new_logits = self.runner._forward(self.size)
            hidden.copy_(new_hidden)
            logits.copy_(new_logits)

    def capture(runner: cuda_graphs.CudaGraphDecode) -> float:
        with torch.inference_mode():
            for size in runner.sizes:
                hidden, logits = runner._forward(size)
                runner.graphs[size] = (ForwardAsGraph(runner, size), hidden, logits)
        return 0.0

    monkeypatch.setattr(cuda_graphs.CudaGraphDecode, "capture", capture)
    monkeypatch.setattr(cuda_graphs, "why_no_graphs", lambda model, device, backend, enforce_eager:
                        "enforce_eager" if enforce_eager else None)
    monkeypatch.setattr(cuda_graphs, "estimate_graph_memory", lambda *args: 0)
    from kvreuse.engine import builder
    from kvreuse.runner.decode import paths
    monkeypatch.setattr(builder, "why_no_graphs", lambda model, device, backend, enforce_eager: "stand-in")
    monkeypatch.setattr(paths, "why_no_graphs", cuda_graphs.why_no_graphs)
    prompts = [[(11 * i + 5 * j) % 250 + 1 for j in range(length)] for i, length in enumerate((3, 9, 14, 22, 40))]
    runs = {}
    for name, eager in (("graphs", False), ("eager", True)):
        llm = LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu", kv_cache_memory="2MiB", block_size=4,
                  attention_backend="triton", enforce_eager=eager, max_num_seqs=8)
        # Staggered lengths of output: the batch shrinks through the sizes 8, 4, 2, 1 as requests finish.
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW + index, ignore_eos=True)
                  for index in range(len(prompts))]
        results = [run_checked(llm, prompts, params)[0] for _ in ("cold", "warm")]
        runs[name] = (results, llm.engine.runner.decode.cuda_graphs)
    assert runs["graphs"][0] == runs["eager"][0]
    graphs = runs["graphs"][1]
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8] and graphs.replays > 10
    assert runs["eager"][1] is None


def test_commands_take_enforce_eager_and_the_triton_backend(tiny_model: Path):
    """``--enforce-eager`` and ``--attention-backend triton`` reach the engine from every command's options."""
    import argparse

    from kvreuse.engine_args import add_engine_arguments, llm_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model), "--device", DEVICE, "--dtype", "float32",
                              "--kv-cache-memory", "2MiB", "--attention-backend", "triton", "--enforce-eager"])
    llm = llm_from_args(args)
    assert llm.engine.config.enforce_eager and llm.engine.config.attention_backend == "triton"
    assert isinstance(llm.engine.runner.attention_backend, TritonPagedAttention)
    assert llm.engine.runner.decode.cuda_graphs is None and llm.engine.runner.decode.no_graphs_reason == "enforce_eager"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", str(tiny_model), "--attention-backend", "flash"])
