"""The mixture-of-experts layer (kvreuse/models/moe.py): routing as transformers routes, rows grouped by expert,
and the native layer (csrc/moe.cpp) equal to the Python loop bit for bit.

The layers come from the tiny Qwen3-MoE preset (8 experts, 2 per token) held as a Q8_0 GGUF file's blocks and
as float32 weights, so both the quantized kernels and plain products are covered.
"""

from __future__ import annotations

import pytest
import torch

from gguf_files import write_gguf
from kvreuse import LLM
from kvreuse.models import moe
from kvreuse.models.moe import SparseMoE


@pytest.fixture(scope="module")
def moe_llms(tiny_models, tmp_path_factory) -> dict[str, LLM]:
    path = write_gguf(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("moe") / "tiny-moe.q8_0.gguf", "Q8_0")
    return {"q8_0": LLM(str(path), dtype="float32", kv_cache_memory="8MiB"),
            "float32": LLM(str(tiny_models["qwen3_moe"]), dtype="float32", kv_cache_memory="8MiB")}


def _layers(llm: LLM) -> list[SparseMoE]:
    return [module for module in llm.engine.runner.model.modules() if isinstance(module, SparseMoE)]


def test_routing_is_transformers_top_k(moe_llms):
    layer = _layers(moe_llms["float32"])[0]
    x = torch.randn(5, layer.gate.input_size, generator=torch.Generator().manual_seed(0))
    weights, experts = layer.route(x)
    probabilities = torch.softmax(x @ layer.gate.weight.T, dim=-1)
    expected, chosen = torch.topk(probabilities, layer.top_k, dim=-1)
    assert torch.equal(experts, chosen)
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True))  # norm_topk_prob
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))


def test_each_expert_runs_once_per_step_for_all_its_rows(moe_llms):
    layer = _layers(moe_llms["q8_0"])[0]
    native, layer.native = layer.native, None  # the Python loop
    calls: list[int] = []
    hooks = [expert.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
             for expert in layer.experts]
    try:
        x = torch.randn(12, layer.gate.input_size, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            layer(x)
        _, experts = layer.route(x)
    finally:
        layer.native = native
        for hook in hooks:
            hook.remove()
    routed = torch.bincount(experts.reshape(-1), minlength=layer.num_experts)
    assert sorted(calls) == sorted(int(count) for count in routed if count > 0)
    assert sum(calls) == 12 * layer.top_k


@pytest.mark.parametrize("held", ["q8_0", "float32"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_native_layer_equals_the_python_loop(moe_llms, held, rows):
    layers = _layers(moe_llms[held])
    if moe.library() is None:
        pytest.skip("the native MoE layer is not built here")
    assert all(layer.native is not None and layer.native_max_rows >= 8 for layer in layers)
    generator = torch.Generator().manual_seed(rows)
    for layer in layers:
        x = torch.randn(rows, layer.gate.input_size, generator=generator)
        with torch.inference_mode():
            native = layer(x)
            held_native, layer.native = layer.native, None
            python = layer(x)
            layer.native = held_native
        assert torch.equal(native, python)


def test_native_layer_can_be_turned_off(moe_llms, monkeypatch):
    layer = _layers(moe_llms["q8_0"])[0]
    monkeypatch.setenv(moe.ENV, "0")
    try:
        assert layer.prepare_native() == f"{moe.ENV}=0" and layer.native is None
    finally:
        monkeypatch.delenv(moe.ENV)
        layer.prepare_native()
    assert layer.native is not None or moe.library() is None
