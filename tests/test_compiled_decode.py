"""``enable_torch_compile``: decode steps through torch.compile'd graphs (kvreuse/runner/decode/compiled_decode.py).

The compiled engine must produce transformers' greedy tokens and the eager engine's logprobs (within
float tolerance), with the cache invariants checked after every step; every pure decode step must run
compiled, and the graphs built at start-up must cover every step that follows (no compile while
serving). The split and packed kernels are forced so that their compiled forms (baddbmm in place of
inductor's one-row bmm rewrite; oneDNN's linear as an opaque op) run too.

Real inductor compiles with its C++ wrapper: the first run on a machine takes about a minute for
these tiny models; inductor's disk cache makes later runs faster.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from test_engine import GREEDY, make_llm, prompt_ids, reference_greedy, run_checked
from torch._dynamo.utils import counters

from kvreuse import LLM, SamplingParams
from kvreuse.engine_args import add_engine_arguments, llm_from_args
from kvreuse.kernels import quant_ops
from kvreuse.layers import plan_book
from kvreuse.layers.linear import Linear
from kvreuse.layers.plan_book import ALWAYS, LinearKernel, LinearPlan
from kvreuse.runner.decode.compiled_decode import CompiledDecode

_engines: dict[str, tuple[LLM, LLM]] = {}


def compiled_and_eager(folder, monkeypatch, kernel: str) -> tuple[LLM, LLM]:
    """The tiny model on ``kernel`` compiled and eager, made once per kernel (compiling takes seconds)."""
    if kernel not in _engines:
        monkeypatch.setenv(plan_book.KERNEL_ENV, kernel)
        _engines[kernel] = (make_llm(folder, enable_torch_compile=True, max_num_seqs=8),
                            make_llm(folder, max_num_seqs=8))
    return _engines[kernel]


@pytest.mark.parametrize("kernel", ["split_in", "packed", "rowdot8"])
def test_compiled_decode_matches_transformers_and_eager(tiny_models, monkeypatch, kernel):
    if kernel == "packed" and not plan_book.packing_available(torch.float32):
        pytest.skip("no oneDNN on this build")
    if kernel == "rowdot8" and not plan_book.rowdot_runs(torch.float32):
        pytest.skip("the row-dot kernel did not build here (no compiler)")
    folder = tiny_models["qwen2"]  # q/k/v bias: the compiled split_in adds it after the baddbmm
    compiled, eager = compiled_and_eager(folder, monkeypatch, kernel)
    runner = compiled.engine.runner
    steps_before = runner.compiled_decode.steps
    assert runner.compiled_decode is not None and eager.engine.runner.compiled_decode is None
    assert all(m.kernel is not None and m.kernel.plan.kernels == {kernel}
               for m in compiled.engine.model.modules() if isinstance(m, Linear))
    graphs_before = counters["stats"]["unique_graphs"]
    compiled.engine.step_timings.clear()

    # One stream, then five requests of different lengths finishing at different steps (the batch
    # shrinks 5 -> 1 and the contexts differ: the padded-mask graph and the one-stream graph).
    prompts = [prompt_ids(seed, length) for seed, length in enumerate((7, 3, 19, 11, 26))]
    one = run_checked(compiled.engine, prompts[:1], GREEDY)
    assert one == [reference_greedy(folder, prompts[0])]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (4, 9, 12, 6, 10)]
    outputs = compiled.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = eager.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for got, want, prompt, param in zip(outputs, expected, prompts, params):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].token_ids == reference_greedy(folder, prompt, param.max_tokens)
        got_lp = [lp.logprob for lp in got.outputs[0].logprobs]
        want_lp = [lp.logprob for lp in want.outputs[0].logprobs]
        assert got_lp == pytest.approx(want_lp, abs=1e-4)
    compiled.engine.check_integrity()

    # Every pure decode step (all tokens decodes; the prompts have 3+ tokens, so a one-token step is
    # never a prefill) ran compiled, and none of them needed a new graph.
    decode_steps = sum(1 for t in compiled.engine.step_timings if t.num_tokens == t.num_seqs)
    assert decode_steps > 0 and runner.compiled_decode.steps - steps_before == decode_steps
    assert counters["stats"]["unique_graphs"] == graphs_before


def test_prefill_and_mixed_steps_stay_eager(tiny_models, monkeypatch):
    compiled, _ = compiled_and_eager(tiny_models["qwen2"], monkeypatch, "split_in")
    engine = compiled.engine
    steps = engine.runner.compiled_decode.steps
    engine.add_request("short", {"prompt_token_ids": prompt_ids(1, 5)}, GREEDY)
    engine.step()  # the short prompt's prefill
    assert engine.runner.compiled_decode.steps == steps
    engine.add_request("long", {"prompt_token_ids": prompt_ids(2, 40)}, GREEDY)
    engine.step()  # a mixed step: the long prompt's prefill and the short request's decode
    assert engine.runner.compiled_decode.steps == steps
    engine.step()  # both decode
    assert engine.runner.compiled_decode.steps == steps + 1
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()


def test_warm_up_covers_each_range_of_a_plan(tiny_models):
    """One graph set per range of batch sizes over which no layer changes kernel, up to max_num_seqs."""
    llm = make_llm(tiny_models["llama"])
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    linears[0].kernel = LinearKernel(linears[0].weight.detach(), None,
                                     LinearPlan(((1, "split_in"), (8, "transposed"), (ALWAYS, "split_out"))))
    linears[1].kernel = LinearKernel(linears[1].weight.detach(), None, LinearPlan(((40, "plain"), (ALWAYS, "transposed"))))
    compiled = CompiledDecode(model, llm.engine.kv_cache, torch.device("cpu"))
    assert compiled.batch_sizes(64) == [1, 2, 9, 41]
    assert compiled.batch_sizes(16) == [1, 2, 9]
    assert compiled.batch_sizes(1) == [1]


def test_the_command_line_flag_compiles_only_what_max_num_seqs_allows(tiny_models):
    """``--enable-torch-compile`` as every model-loading command parses it; with --max-num-seqs 1 the
    one-sequence graph is the only one built, and it serves every decode step."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    folder = tiny_models["mistral"]
    args = parser.parse_args(["--model", str(folder), "--enable-torch-compile", "--max-num-seqs", "1",
                              "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8MiB"])
    graphs_before = counters["stats"]["unique_graphs"]
    llm = llm_from_args(args)
    assert counters["stats"]["unique_graphs"] == graphs_before + 1
    prompt = prompt_ids(7, 9)
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_greedy(folder, prompt)
    assert llm.engine.runner.compiled_decode.steps == GREEDY.max_tokens - 1
    assert counters["stats"]["unique_graphs"] == graphs_before + 1


def test_compiled_decode_runs_int8_rounded_products_on_a_quantized_file(tiny_models, monkeypatch, tmp_path):
    """qdot8 (offered to float32 engines since it runs on AVX2) traces under torch.compile: the compiled
    decode of a Q4_1 file on it gives the eager engine's tokens."""
    from gguf_files import without_rope_scaling, write_gguf


    if "q4_1" not in quant_ops.int8_formats():
        pytest.skip("no int8 dot products on this CPU")
    path = write_gguf(without_rope_scaling(tiny_models["llama"], tmp_path / "plain"), tmp_path / "q4_1.gguf", "Q4_1")
    monkeypatch.setenv(plan_book.KERNEL_ENV, "qdot8")
    compiled = LLM(str(path), dtype="float32", kv_cache_memory="1MiB", max_num_seqs=2, enable_torch_compile=True)
    eager = LLM(str(path), dtype="float32", kv_cache_memory="1MiB", max_num_seqs=2)
    assert compiled.engine.runner.model.runs_int8_activations()
    prompts = [{"prompt_token_ids": prompt_ids(seed, length)} for seed, length in ((1, 7), (2, 12))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = compiled.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert compiled.engine.runner.compiled_decode.steps > 0
