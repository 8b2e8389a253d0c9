"""The mixture-of-experts layer (kvreuse/layers/experts.py): routing as transformers routes, rows grouped by expert,
and the native layer (csrc/moe.cpp) equal to the Python loop bit for bit.

The layers come from the tiny Qwen3-MoE preset (8 experts, 2 per token) held as a Q8_0 GGUF file's blocks and
as float32 weights, so both the quantized kernels and plain products are covered; gpt-oss's (a biased router
softmaxed over its top 4 of 8, biased experts, the clamped SwiGLU) from the tiny-gpt-oss preset with its experts'
gate|up weights scaled up so the clamp bites, in float32, bfloat16 and int8.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from gguf_files import write_gguf
from safetensors.torch import load_file, save_file

from kvreuse import LLM
from kvreuse.kernels import moe, quant_ops
from kvreuse.layers import experts
from kvreuse.layers.experts import KERNEL_CODES, SparseMoE
from kvreuse.layers.plan_book import ALWAYS, LinearPlan


@pytest.fixture(scope="module")
def moe_llms(tiny_models, tmp_path_factory) -> dict[str, LLM]:
    path = write_gguf(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("moe") / "tiny-experts.q8_0.gguf", "Q8_0")
    return {"q8_0": LLM(str(path), dtype="float32", kv_cache_memory="8MiB"),
            "float32": LLM(str(tiny_models["qwen3_moe"]), dtype="float32", kv_cache_memory="8MiB")}


@pytest.fixture(scope="module")
def gpt_oss_llms(tiny_models, tmp_path_factory) -> dict[str, LLM]:
    """tiny-gpt-oss with its experts' gate|up weights 100x the preset's: gate and up values of some 16 on a unit
    input, well past swiglu_limit (7) on both sides, and some within it."""
    folder = tmp_path_factory.mktemp("gpt-oss") / "scaled"
    shutil.copytree(tiny_models["gpt_oss"], folder)
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith("mlp.experts.gate_up_proj"):
            weights[name] = weights[name] * 100.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return {"float32": LLM(str(folder), dtype="float32", kv_cache_memory="8MiB"),
            "bfloat16": LLM(str(folder), dtype="bfloat16", kv_cache_memory="8MiB"),
            "int8": LLM(str(folder), dtype="float32", quantization="int8", kv_cache_memory="8MiB"),
            "int8-bfloat16": LLM(str(folder), dtype="bfloat16", quantization="int8", kv_cache_memory="8MiB")}


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
    monkeypatch.setenv(experts.ENV, "0")
    try:
        assert layer.prepare_native() == f"{experts.ENV}=0" and layer.native is None
    finally:
        monkeypatch.delenv(experts.ENV)
        layer.prepare_native()
    assert layer.native is not None  # back on (the suite does not start where the library fails to build)


def native_and_python(layer: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        native = layer(x)
        held_native, layer.native = layer.native, None
        try:
            python = layer(x)
        finally:
            layer.native = held_native
    return native, python


@pytest.mark.parametrize("held", ["float32", "bfloat16", "int8", "int8-bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_native_gpt_oss_layer_equals_the_python_loop(gpt_oss_llms, held, rows):
    """The router's bias and softmax over the top k, the experts' biases (added by at::linear on float weights, after
    the quantized product on int8 ones) and the clamped SwiGLU, bit for bit."""
    if moe.library() is None:
        pytest.skip("the native MoE layer is not built here")
    layers = _layers(gpt_oss_llms[held])
    assert layers and all(layer.native is not None and layer.native_max_rows >= 8 for layer in layers)
    assert all(layer.softmax_after_topk and layer.expert_bias for layer in layers)
    generator = torch.Generator().manual_seed(100 + rows)
    dtype = torch.bfloat16 if "bfloat16" in held else torch.float32
    clamped_gate = clamped_up = within = 0
    for layer in layers:
        x = torch.randn(rows, layer.router_layer.input_size, generator=generator).to(dtype)
        native, python = native_and_python(layer, x)
        assert native.dtype == dtype and torch.equal(native, python)
        # The clamp is reached: each routed expert's gate above the limit, its up past it on either side.
        _, experts = layer.route(x)
        with torch.inference_mode():
            for expert in experts.unique().tolist():
                mlp = layer.experts[expert]
                gate, up = mlp.gate_up_proj(x).split(mlp.intermediate_size, dim=-1)
                clamped_gate += int((gate > mlp.swiglu_limit).sum())
                clamped_up += int((up.abs() > mlp.swiglu_limit).sum())
                within += int((gate.abs() < mlp.swiglu_limit).sum())
    assert clamped_gate > 0 and clamped_up > 0 and within > 0


@pytest.mark.parametrize("held", ["q8_0", "gpt-oss int8", "gpt-oss int8-bfloat16"])
def test_grouped_experts_on_two_kernels_equal_the_python_loop(moe_llms, gpt_oss_llms, held):
    """The native layer runs all routed experts' products in one grouped call per kernel: with plans that put
    odd row counts on the int8-input kernel and even ones on the float one, a step's experts split between the
    two (gathered, multiplied, put back in place), and the output is the Python loop's bit for bit, biases
    (gpt-oss) included."""
    if moe.library() is None:
        pytest.skip("the native MoE layer is not built here")
    if "q8_0" not in quant_ops.int8_formats():
        pytest.skip("q8_0 does not run on int8 inputs on this CPU")
    llm = moe_llms["q8_0"] if held == "q8_0" else gpt_oss_llms[held.split()[1]]
    layer = _layers(llm)[0]
    plan = LinearPlan(tuple((rows, "qdot8" if rows % 2 else "qdot") for rows in range(1, 12)) + ((ALWAYS, "qdot"),))
    kernels = [linear.kernel for expert in layer.experts for linear in (expert.gate_up_proj, expert.down_proj)]
    saved = [kernel.plans for kernel in kernels]
    try:
        for kernel in kernels:
            kernel.plans = [plan] * len(kernel.parts)
        assert layer.prepare_native() is None
        assert layer.native_args[3][:4] == [KERNEL_CODES[name] for name in ("qdot8", "qdot", "qdot8", "qdot")]
        dtype = torch.bfloat16 if "bfloat16" in held else torch.float32
        generator = torch.Generator().manual_seed(11)
        for rows in (1, 2, 7, 12):
            x = torch.randn(rows, layer.router_layer.input_size, generator=generator).to(dtype)
            _, experts = layer.route(x)
            counts = torch.bincount(experts.reshape(-1))
            native, python = native_and_python(layer, x)
            assert torch.equal(native, python), rows
            if rows == 12:  # both kernels in one step
                assert {int(c) % 2 for c in counts if c > 0} == {0, 1}
    finally:
        for kernel, plans in zip(kernels, saved):
            kernel.plans = plans
        layer.prepare_native()


def test_native_gpt_oss_layer_routes_by_the_biased_router(gpt_oss_llms):
    """Without the router's bias or with softmax-then-top-k, the layer's output would differ: a router bias large
    enough to pin each row's experts gives the native layer the same pinned choice as the Python loop."""
    if moe.library() is None:
        pytest.skip("the native MoE layer is not built here")
    layer = _layers(gpt_oss_llms["float32"])[0]
    router = layer.router_layer
    saved = router.bias.detach().clone()
    try:
        with torch.no_grad():
            router.bias.copy_(torch.tensor([0.0, 50.0, 0.0, 50.0, 0.0, 50.0, 50.0, 0.0]))
        assert layer.prepare_native() is None
        x = torch.randn(3, router.input_size, generator=torch.Generator().manual_seed(7))
        _, experts = layer.route(x)
        assert experts.sort(-1).values.tolist() == [[1, 3, 5, 6]] * 3
        native, python = native_and_python(layer, x)
        assert torch.equal(native, python)
    finally:
        with torch.no_grad():
            router.bias.copy_(saved)
        layer.prepare_native()
