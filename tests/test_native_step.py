"""The native decode step (runner/decode/native_step.py, csrc/decoder_layer.cpp): a decoder layer in one call that
makes the op-by-op path's kernel calls from C++, so its outputs are that path's bit for bit.

Compared in the engine, on the same prompts (cold, hits ending mid-block, batched decode rows, a pool small
enough to preempt), with the cache invariants checked after every step: the tiny float32 folder of every
architecture (q/k/v biases, q/k norms, rope scaling, tied embeddings; gpt-oss's windows, sinks, output bias,
YaRN and biased experts) and GGUF files of quantized formats on both quantized kernels, against
``KVREUSE_NATIVE_STEP=0``; layers with windows, scales and sinks. That the native step is what ran is checked
too, and what it does not cover (quantized KV, LoRA rows, products on dequantized tiles) is said and runs op
by op.
"""

from __future__ import annotations

import logging

import pytest
import torch
from gguf_files import write_gguf
from test_gguf import gguf_dir, made_gguf  # noqa: F401  (gguf_dir is the fixture made_gguf writes into)
from test_nemotron_h import random_nemotron_h
from test_qwen3_5 import random_qwen3_5

from kvreuse import LLM, SamplingParams
from kvreuse.engine.builder import offset_norm_kernel
from kvreuse.kernels import decoder_layer, fused_ops, quant_ops
from kvreuse.model_tools.make_model import make_model
from kvreuse.runner.decode import native_step

pytestmark = pytest.mark.skipif(decoder_layer.library() is None, reason="the native decoder layer does not build here")


def _runs(llm: LLM, rounds: list[list[list[int]]], max_tokens: int = 6) -> list:
    """Greedy token ids and logprobs of each round's prompts, run together, invariants checked every step."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    results = []
    for number, prompts in enumerate(rounds):
        for index, prompt in enumerate(prompts):
            engine.add_request(f"{number}-{index}", {"prompt_token_ids": prompt}, params)
        done = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = (output.outputs[0].token_ids, repr(output.outputs[0].logprobs))
            engine.check_integrity()
        results.append([done[f"{number}-{index}"] for index in range(len(prompts))])
    return results


def _rounds(seed: int = 5) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 300, (45,), generator=generator).tolist()
    return [[shared + [7, 8, 9], shared[:30] + [5] * 3],
            [shared[:43] + [11, 12], shared + [7, 8, 9], shared[:22] + [4, 5, 6]]]


def _both(monkeypatch, path: str, **kwargs) -> tuple[LLM, LLM]:
    monkeypatch.setenv(native_step.ENV, "0")
    op_by_op = LLM(path, **kwargs)
    monkeypatch.delenv(native_step.ENV)
    return LLM(path, **kwargs), op_by_op


def _native_rows(llm: LLM) -> set[int]:
    """The row counts whose steps ran the native layers."""
    step = llm.engine.runner.decode.native_step
    assert step is not None
    return {rows for rows, args in step._args.items() if not isinstance(args, str)}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"])
def test_float32_folders_equal_op_by_op_bit_for_bit(tiny_models, monkeypatch, arch):
    native, op_by_op = _both(monkeypatch, str(tiny_models[arch]), dtype="float32", device="cpu", block_size=4,
                             kv_cache_memory="256KiB", max_num_batched_tokens=24)
    assert op_by_op.engine.runner.decode.native_step is None
    rounds = _rounds()
    assert _runs(native, rounds) == _runs(op_by_op, rounds)
    assert {1, 2, 3} <= _native_rows(native)
    assert native.engine.stats().cache.hit_tokens > 0
    # The decode paths' choice, counted: prefills on the layers, decode steps native; with the step off, none.
    paths, off = native.engine.runner.decode.steps, op_by_op.engine.runner.decode.steps
    assert paths["native_step"] > 0 and paths["layers"] > 0 and paths["cuda_graphs"] == 0
    assert off["native_step"] == 0 and off["layers"] == sum(paths.values())


@pytest.mark.parametrize("arch,kind,kernel", [("llama-plain", "Q4_1", "qdot"), ("llama-plain", "Q4_1", "qdot8"),
                                              ("qwen2", "Q8_0", "qdot8"), ("qwen2", "Q5_0", "qdot"),
                                              ("qwen3_moe", "Q8_0", "qdot8"), ("gpt_oss", "MXFP4", "qdot8")])
def test_quantized_files_equal_op_by_op_on_each_kernel(tiny_models, gguf_dir, monkeypatch, arch, kind, kernel):
    """Both quantized kernels (qdot8 where this CPU runs the format on int8 inputs, else its qdot fallback,
    as op by op), a file whose q/k/v have a bias and Q5_0 parts."""
    path = made_gguf(tiny_models, gguf_dir, arch, kind)
    monkeypatch.setenv("KVREUSE_LINEAR_KERNEL", kernel)
    native, op_by_op = _both(monkeypatch, str(path), dtype="float32", block_size=4, kv_cache_memory="256KiB",
                             max_num_batched_tokens=24)
    rounds = _rounds(seed=6)
    assert _runs(native, rounds) == _runs(op_by_op, rounds)
    assert 1 in _native_rows(native)
    qkv = native.engine.runner.decode.native_step._args[1][0]
    expected = native_step.KERNEL_CODES[kernel if kind.lower() in quant_ops.int8_formats() else "qdot"]
    assert set(qkv.kernels) == {expected}
    if arch in ("qwen3_moe", "gpt_oss"):  # the experts run inside the native step (DecodeLayers.set_experts)
        assert qkv.experts is not None and qkv.parts[2:] == [0, 0]
        assert set(qkv.experts[3]) == {expected}  # the gate|up products' kernel per row count


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    """Each hybrid's tiny folder (``_hybrid``), made once for the module."""
    made: dict[str, object] = {}

    def folder(arch: str) -> object:
        if arch not in made:
            made[arch] = _hybrid(tmp_path_factory.mktemp(f"{arch}-folder"), arch)
        return made[arch]
    return folder


def _hybrid(root, arch: str) -> object:
    """A tiny LFM2 folder (make-model's); a tiny Qwen3.5 folder with transformers' larger random init and fewer key
    heads than value heads (its GGUF file then holds the value heads in llama.cpp's tiled order); a tiny Nemotron-H
    folder (Mamba-2 blocks around its attention and MLP blocks) with transformers' larger random init."""
    if arch == "lfm2":
        return make_model(root / "tiny-lfm2", preset="tiny-lfm2", dtype="float32", seed=3)
    if arch == "nemotron_h":
        return random_nemotron_h(root / "tiny-nemotron-h")
    return random_qwen3_5(root / "tiny-qwen3.5")


@pytest.mark.parametrize("arch,kind,dtype", [("lfm2", "F32", "float32"), ("lfm2", "Q8_0", "bfloat16"),
                                             ("qwen3_5", "F32", "float32"), ("qwen3_5", "Q8_0", "bfloat16"),
                                             ("nemotron_h", "F32", "float32"), ("nemotron_h", "Q8_0", "bfloat16")])
def test_hybrid_layers_equal_op_by_op_bit_for_bit(tmp_path_factory, hybrid_folder, monkeypatch, arch, kind, dtype):
    """A hybrid's layers in the native step: LFM2's conv layers (DecodeLayers.add_conv_layer: each row's convolution
    inputs found from the block tables, read from and written to the planes), Qwen3.5's Gated DeltaNet layers over
    each sequence's state slot (add_delta_layer), its gated attention with partial rotary and its (1 + weight) norms;
    Nemotron-H's blocks (add_block, add_mamba_block: attention without rotary, the squared-ReLU MLP, Mamba-2); a hit
    ending mid-block, rows of several sequences, chunks over cached context; bit for bit the op-by-op path's,
    a Q8_0 file in bfloat16 too."""
    folder = hybrid_folder(arch)
    path = folder if kind == "F32" else write_gguf(folder, tmp_path_factory.mktemp(arch) / f"{arch}.q8_0.gguf", kind)
    native, op_by_op = _both(monkeypatch, str(path), dtype=dtype, device="cpu", block_size=4,
                             kv_cache_memory="512KiB", max_num_batched_tokens=24)
    assert op_by_op.engine.runner.decode.native_step is None
    rounds = _rounds(seed=7)
    assert _runs(native, rounds) == _runs(op_by_op, rounds)
    assert {1, 2} <= _native_rows(native)
    held = native.engine.runner.decode.native_step._args[1]
    recurrent = [index for index, layer in enumerate(held)
                 if (layer.conv or layer.delta or layer.mamba) is not None]
    config = native.engine.model_config
    assert recurrent == (config.state_layers if arch == "nemotron_h" else config.recurrent_layers)
    assert 0 < len(recurrent) < len(held)
    if arch == "nemotron_h":
        kinds = {native_step.BLOCK_KINDS[kind] for kind in ("attention", "mlp", "mamba")}
        assert {layer.block for layer in held} == kinds
        # Its norms outside float32 run in the fused float32-scale kernel (PyTorch's rms_norm before): in the KV
        # fingerprint, so records from before are never served.
        assert offset_norm_kernel(config, native.engine.kv_cache) == (dtype == "bfloat16")
    if arch == "qwen3_5":
        assert all(layer.gated_rotary_dim == native.engine.model_config.rotary_dim
                   for index, layer in enumerate(held) if index not in recurrent)
    assert native.engine.stats().cache.hit_tokens > 0
    assert native.engine.runner.decode.steps["native_step"] > 0
    cache, reference = native.engine.kv_cache, op_by_op.engine.kv_cache
    if arch == "lfm2":
        assert torch.equal(cache.planes, reference.planes)  # the same inputs written
    else:
        assert torch.equal(cache.states.ssm, reference.states.ssm) and torch.equal(cache.states.conv,
                                                                                reference.states.conv)


def test_what_it_does_not_cover_runs_op_by_op_and_is_said(tiny_models, gguf_dir, monkeypatch, caplog):
    # A quantized KV pool: the layers' store is the codec's; every step runs op by op.
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", device="cpu", kv_cache_memory="256KiB",
              kv_cache_dtype="int8")
    _runs(llm, _rounds()[:1])
    assert _native_rows(llm) == set()
    # More decode rows than the quantized kernel's plan runs on qdot (DEFAULT_PLAN: dequantized tiles above 8).
    path = made_gguf(tiny_models, gguf_dir, "llama-plain", "Q4_1")
    monkeypatch.setenv("KVREUSE_LINEAR_KERNEL", "plain")
    with caplog.at_level(logging.INFO, logger="kvreuse"):
        llm = LLM(str(path), dtype="float32", kv_cache_memory="1MiB")
        _runs(llm, [[[3 + index, 40, 41] for index in range(10)]], max_tokens=3)
    assert "decode step: one native call for the decoder layers" in caplog.text
    assert "10-row steps run op by op (qtile products at 10 rows)" in caplog.text
    assert 10 not in _native_rows(llm)
    # Off by its variable, said at start.
    caplog.clear()
    monkeypatch.setenv(native_step.ENV, "0")
    with caplog.at_level(logging.INFO, logger="kvreuse"):
        LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu", kv_cache_memory="256KiB")
    assert f"decode step: op by op ({native_step.ENV}=0)" in caplog.text


def test_layers_with_windows_scales_and_sinks_equal_op_by_op(tiny_models, monkeypatch):
    """A layer's window, its own softmax scale and its sinks reach the native layer's kernel call as the op-by-op
    path hands them over (DecodeLayers.set_attention): with each on a different layer, outputs are equal bit for bit,
    cold and from the cache, windows shorter than the prompts."""
    from kvreuse.attention.backend import LayerAttention

    native, op_by_op = _both(monkeypatch, str(tiny_models["qwen2"]), dtype="float32", device="cpu", block_size=4,
                             kv_cache_memory="256KiB", max_num_batched_tokens=24)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for llm in (native, op_by_op):
        layers = llm.engine.runner.model.model.layers
        layers[0].self_attn.layer_attention = LayerAttention(sliding_window=5, sinks=sinks)
        layers[1].self_attn.layer_attention = LayerAttention(scale=0.3, sliding_window=9)
    rounds = _rounds(seed=7)
    assert _runs(native, rounds) == _runs(op_by_op, rounds)
    assert {1, 2} <= _native_rows(native)
    held = native.engine.runner.decode.native_step._args[1]
    assert held[0].attention.sinks is sinks and held[1].attention.scale == 0.3


def test_lora_rows_run_op_by_op(tiny_models):
    """A batch with an adapter's rows runs op by op (the deltas are added per projection in Python)."""
    from kvreuse.attention.cpu_paged import NativeAttentionMetadata
    from kvreuse.attention.forward_batch import ProjectionDeltas

    llm = LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu", kv_cache_memory="256KiB")
    step, kv_cache = llm.engine.runner.decode.native_step, llm.engine.runner.kv_cache
    hidden = torch.zeros(1, llm.engine.model_config.hidden_size)
    decode_rows = NativeAttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.int64), fresh_prefills=[], paged=None,
                                          context_chunks=[], covers_whole_batch=False, paged_covers_whole_batch=True)
    assert step.layers_for(1, hidden.dtype, kv_cache, decode_rows, None) is not None
    lora = ProjectionDeltas.__new__(ProjectionDeltas)
    assert step.layers_for(1, hidden.dtype, kv_cache, decode_rows, lora) is None
    assert step.layers_for(1, hidden.dtype, kv_cache, object(), None) is None  # another backend's metadata


def test_bad_arguments_are_refused_by_name(tiny_models):
    llm = LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu", kv_cache_memory="256KiB")
    layer = llm.engine.runner.model.model.layers[0]
    args = native_step.layer_args(layer, 1)
    pools = llm.engine.runner.kv_cache.layer_pools(0)[:2]
    held = torch.classes.kvreuse_step.DecodeLayers(args.eps, 1.0, 1, 1, 1, 4)
    with pytest.raises(RuntimeError, match="parts must count the parts of qkv, o, gate_up and down"):
        held.add_layer(args.weights, args.kernels, args.formats, [1, 1, 1], args.qkv_bias, args.input_norm,
                       args.post_norm, None, None, *pools)
    with pytest.raises(RuntimeError, match="parts do not add up to the weights"):
        held.add_layer(args.weights, args.kernels, args.formats, [1, 1, 1, 2], args.qkv_bias, args.input_norm,
                       args.post_norm, None, None, *pools)
    held.add_layer(args.weights, args.kernels, args.formats, args.parts, args.qkv_bias, args.input_norm,
                   args.post_norm, None, None, *pools)
    assert held.num_layers() == 1
    hidden = torch.zeros(1, llm.engine.model_config.hidden_size)
    empty = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"layers \[0, 2\) are not within the 1 held"):
        held.run(hidden, torch.zeros(1), torch.zeros(1), empty, empty, empty, empty, empty, empty, 0, 2, [], [], [])
    with pytest.raises(RuntimeError, match="hidden must be contiguous"):
        held.run(torch.zeros(4, hidden.shape[1]).t(), torch.zeros(1), torch.zeros(1), empty, empty, empty, empty, empty,
                 empty, 0, 1, [], [], [])
    with pytest.raises(RuntimeError, match="one state slot, start and length per sequence"):
        held.run(hidden, torch.zeros(1), torch.zeros(1), empty, empty, empty, empty, empty, empty, 0, 1, [0], [], [])
    # The hybrids' layers: a gated attention's rotary within its head, a conv layer after set_planes, a Gated
    # DeltaNet layer under offset norms.
    with pytest.raises(RuntimeError, match="rotary_dim must be even and within head_dim"):
        held.set_gated_attention(0, 3)
    with pytest.raises(RuntimeError, match="set_planes first"):
        held.add_conv_layer(args.weights, args.kernels, args.formats, args.parts, None, None, args.input_norm,
                            args.post_norm, torch.zeros(3, 4), None, torch.zeros(5, 4))
    with pytest.raises(RuntimeError, match="set_offset_norms first"):
        held.add_delta_layer(args.weights, args.kernels, args.formats, args.parts, args.input_norm, args.post_norm,
                             *[torch.zeros(1)] * 6, 0, 1, False, 1, 1, 1)


def test_int8_activations_are_part_of_the_kv_fingerprint(tiny_models, gguf_dir, monkeypatch, tmp_path):
    """K/V computed by products over int8-rounded inputs (qdot8), or over tiles of weights rounded to bf16
    (qtile_bf16), differ from the exact products': engines on the same file with and without them never
    share a tier's records."""
    path = made_gguf(tiny_models, gguf_dir, "llama-plain", "Q4_1")
    disk = tmp_path / "disk"
    # A float32 engine with exact or int8-rounded inputs; a bfloat16 engine's prefill products on dequantized
    # tiles in float32 (qtile) or rounded to bf16 (qtile_bf16): other K/V bytes, other records each time.
    cases = [("float32", "qdot", "runs_int8_activations", False), ("float32", "qdot8", "runs_int8_activations", True),
             ("bfloat16", "qtile", "runs_bf16_tiles", False), ("bfloat16", "qtile_bf16", "runs_bf16_tiles", True)]
    for count, (dtype, kernel, runs, expected) in enumerate(cases, 1):
        monkeypatch.setenv("KVREUSE_LINEAR_KERNEL", kernel)
        llm = LLM(str(path), dtype=dtype, kv_cache_memory="256KiB", block_size=4, kv_disk_dir=str(disk))
        assert getattr(llm.engine.runner.model, runs)() == expected
        llm.generate([{"prompt_token_ids": list(range(5, 30))}], SamplingParams(max_tokens=2, temperature=0.0))
        llm.engine.flush_tiers()
        if count in (2, 4):
            assert len(list(disk.iterdir())) == count
    # qdot8's arithmetic revised (its float sums round otherwise, quant_ops.INT8_ARITHMETIC): the records an
    # engine of the earlier revision stored are another's.
    monkeypatch.setenv("KVREUSE_LINEAR_KERNEL", "qdot8")
    monkeypatch.setattr(quant_ops, "INT8_ARITHMETIC", quant_ops.INT8_ARITHMETIC + 1)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="256KiB", block_size=4, kv_disk_dir=str(disk))
    llm.generate([{"prompt_token_ids": list(range(5, 30))}], SamplingParams(max_tokens=2, temperature=0.0))
    llm.engine.flush_tiers()
    assert len(list(disk.iterdir())) == 5


def test_the_fused_expert_activation_and_offset_norm_are_part_of_the_kv_fingerprint(tiny_models, monkeypatch,
                                                                                    tmp_path):
    """gpt-oss's experts take their clamped SwiGLU from one kernel (exp from SLEEF on every value) where it is
    built, from eager ops (std::exp on their chunks' tails) where not; Gemma's (1 + weight) norms (Qwen3.5's too)
    from one kernel (a row's sum in its own order) or from PyTorch's rms_norm: K/V bytes that may differ, so the
    two never share a tier's records. Qwen3-MoE's experts (SiLU) and norms are the same either way."""
    options = dict(dtype="float32", kv_cache_memory="8MiB", block_size=4, kv_disk_dir=str(tmp_path / "disk"))
    with_kernel = {arch: LLM(str(tiny_models[arch]), **options).engine.tier_store.fingerprint
                   for arch in ("gpt_oss", "qwen3_moe", "gemma3")}
    monkeypatch.setattr(fused_ops, "available", lambda: False)
    assert LLM(str(tiny_models["gpt_oss"]), **options).engine.tier_store.fingerprint != with_kernel["gpt_oss"]
    assert LLM(str(tiny_models["gemma3"]), **options).engine.tier_store.fingerprint != with_kernel["gemma3"]
    assert LLM(str(tiny_models["qwen3_moe"]), **options).engine.tier_store.fingerprint == with_kernel["qwen3_moe"]


def test_the_float_kernels_and_the_attention_backend_are_part_of_the_kv_fingerprint(tiny_models, monkeypatch,
                                                                                     tmp_path):
    """Float weights' product kernels other than plain F.linear (rowdot's, the split products') and an attention
    backend other than the CPU default (the torch reference) compute K/V that differ by rounding: each is in
    the fingerprint, so engines that differ in them never share a tier's records. The native decode step is
    not: it equals the op-by-op layers bit for bit (the tests above), and the fingerprint is the same."""
    options = dict(dtype="float32", kv_cache_memory="256KiB", block_size=4, kv_disk_dir=str(tmp_path / "disk"))
    path = str(tiny_models["qwen2"])

    def fingerprint(**extra) -> str:
        return LLM(path, **options, **extra).engine.tier_store.fingerprint

    plain = fingerprint()  # the suite's KVREUSE_LINEAR_KERNEL=plain: every float product on F.linear
    assert fingerprint(attention_backend="torch") != plain
    monkeypatch.setenv("KVREUSE_LINEAR_KERNEL", "rowdot")
    llm = LLM(path, **options)
    assert "rowdot" in llm.engine.runner.model.float_product_kernels()
    assert llm.engine.tier_store.fingerprint != plain
    monkeypatch.setenv("KVREUSE_LINEAR_KERNEL", "plain")
    monkeypatch.setenv(native_step.ENV, "0")
    assert fingerprint() == plain
