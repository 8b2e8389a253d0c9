"""A quantized KV pool (``kv_cache_dtype`` int8 / fp8_e4m3 / fp8_e5m2; kvreuse.cache.kv_quant): what one token
costs, how close its K/V come back, a block's bytes round-tripping through a tier, and an engine serving
from it (cold and from the cache, the cache invariants checked after every step, speculative decoding
and the disk tier on top, a block written under one KV dtype never read under another)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.cache.blocks import BlockCopy
from kvreuse.cache.kv import KVCache
from kvreuse.cache.kv_quant import (
    dequantize,
    kv_bytes_per_token,
    quantize,
    resolve_kv_cache_dtype,
)
from kvreuse.engine import LLMEngine
from kvreuse.model_tools.make_draft import make_random_draft

SCHEMES = ("int8", "fp8_e4m3", "fp8_e5m2")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    ids = []
    for i, prompt in enumerate(prompts):
        ids.append(f"q-{id(prompts)}-{i}")
        engine.add_request(ids[-1], {"prompt_token_ids": prompt}, params)
    done = {}
    for _ in range(10_000):
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    stats = engine.stats().cache
    assert stats.blocks_in_use == 0 and stats.blocks_free + stats.blocks_idle == stats.num_blocks
    return [done[request_id] for request_id in ids]


def test_a_token_costs_one_byte_per_value_and_a_scale_per_head():
    int8 = resolve_kv_cache_dtype("int8")
    for head_dim, dtype, at_least in ((64, torch.bfloat16, 1.9), (64, torch.float32, 3.8), (128, torch.bfloat16, 1.95)):
        plain = kv_bytes_per_token(30, 3, head_dim, dtype, None)
        assert plain / kv_bytes_per_token(30, 3, head_dim, dtype, int8) >= at_least
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16, int8) == 2 * 30 * 3 * (64 + 2)
    assert resolve_kv_cache_dtype("fp8") == resolve_kv_cache_dtype("fp8_e4m3")
    assert resolve_kv_cache_dtype("auto") is None
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int4")


@pytest.mark.parametrize("name", SCHEMES)
def test_values_come_back_within_the_schemes_rounding(name: str):
    scheme = resolve_kv_cache_dtype(name)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=generator) * torch.logspace(-3, 3, 50).view(50, 1, 1)
    x[3] = 0.0  # a zero vector: zero scale guarded, zeros back
    x[7, 1, 5] = 1e4  # an outlier sets its own vector's scale only
    codes, scales = quantize(x, scheme)
    assert codes.dtype == scheme.storage_dtype and scales.dtype == torch.bfloat16 and scales.shape == (50, 4)
    back = dequantize(codes, scales, scheme, torch.float32)
    error = (back - x).abs()
    bound = rounding_bound(name, x)
    assert bool((error <= bound + 1e-30).all()), float((error - bound).max())
    assert bool((back[3] == 0).all())
    assert math.isclose(float(back[7, 1, 5]), 1e4, rel_tol=0.02)
    # The outlier's scale is its own vector's: the other heads of that token keep theirs.
    assert torch.equal(scales[7, [0, 2, 3]], quantize(x[7, [0, 2, 3]], scheme)[1]) and scales[7, 1] > 100 * scales[7, 0]


def rounding_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """How far a scheme's codes may put each value of ``x`` [..., head_dim] (one scale per last-dim vector). int8:
    half a step of amax / 127 (the bfloat16 scale rounded up by at most 2^-8); fp8: the format's relative step
    (2^-3 for e4m3's 3 mantissa bits, 2^-2 for e5m2) of each value, at least its smallest step."""
    scheme = resolve_kv_cache_dtype(name)
    amax = x.abs().amax(dim=-1, keepdim=True)
    if name == "int8":
        return amax / 127 * 0.5 * (1 + 2.0 ** -7)
    mantissa = 3 if name == "fp8_e4m3" else 2
    return x.abs() * 2.0 ** -mantissa + amax / scheme.max_code * 2.0 ** -6


@pytest.mark.parametrize("name", SCHEMES)
def test_a_blocks_bytes_and_copies_carry_codes_and_scales(name: str):
    cache = KVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                    device="cpu", feature_size=3, kv_cache_dtype=name)
    assert cache.kv.dtype == resolve_kv_cache_dtype(name).storage_dtype
    assert cache.block_bytes == 4 * kv_bytes_per_token(2, 2, 8, torch.bfloat16, resolve_kv_cache_dtype(name)) + 4 * 3 * 2
    slots = torch.arange(4, 8)  # block 1
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    for layer in range(2):
        cache.write(layer, slots, k * (layer + 1), v)
    cache.features[slots] = torch.randn(4, 3).to(torch.bfloat16)
    payload = cache.read_block(1)
    assert len(payload) == cache.block_bytes
    cache.write_block(3, payload)
    cache.copy_blocks([BlockCopy(src_block=1, dst_block=2, num_tokens=3)])
    for layer in range(2):
        original = cache.gather(layer, slots)[0]
        assert torch.equal(cache.gather(layer, torch.arange(12, 16))[0], original)  # the tier's bytes, exactly
        assert torch.equal(cache.gather(layer, torch.arange(8, 11))[0], original[:3])  # the copy
        # The codes' own rounding, then the bfloat16 read-back's (half an ulp: 2^-9 of each value).
        written = k * (layer + 1)
        bound = rounding_bound(name, written) * (1 + 2.0 ** -8) + written.abs() * 2.0 ** -8
        assert bool(((original.float() - written).abs() <= bound).all())
    assert torch.equal(cache.features[12:16], cache.features[4:8])
    with pytest.raises(ValueError, match="block payload"):
        cache.write_block(0, payload[:-1])


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernels_equal_the_pytorch_reference(name: str, dtype: torch.dtype):
    """kvreuse/kernels/csrc/kv_quant.cpp writes the same codes and scales as kv_quant.quantize and gathers the
    same values as kv_quant.dequantize, bit for bit, for any slots (repeats, any order, the last slot)."""
    from kvreuse.kernels.kv_codec import cpu_kv_codec

    codec = cpu_kv_codec()
    assert codec is not None, "the C++ kernels did not build here (see the log)"
    shape = dict(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=3, head_dim=64, dtype=dtype, device="cpu",
                 kv_cache_dtype=name)
    fast, reference = KVCache(**shape), KVCache(**shape, native_codec=False)
    assert fast.codec is not None and reference.codec is None
    generator = torch.Generator().manual_seed(1)
    slots = torch.tensor([31, 0, 5, 6, 7, 12, 13, 20])
    k = (torch.randn(8, 3, 64, generator=generator) * torch.logspace(-4, 2, 8).view(8, 1, 1)).to(dtype)
    v = torch.randn(8, 3, 64, generator=generator).to(dtype)
    k[2] = 0
    for cache in (fast, reference):
        cache.write(1, slots, k, v)
    assert torch.equal(fast.kv, reference.kv) and torch.equal(fast.scales, reference.scales)
    read = torch.tensor([5, 5, 31, 0, 13, 7, 6, 20, 12, 1])
    for out_dtype in (torch.float32, torch.bfloat16):
        for got, want in zip(fast.gather(1, read, out_dtype), reference.gather(1, read, out_dtype)):
            assert got.dtype == out_dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the pool"):
        fast.gather(1, torch.tensor([32]))


def test_a_quantized_pool_holds_twice_the_tokens(tiny_model: Path):
    pools = {name: LLM(str(tiny_model), dtype="bfloat16", device="cpu", kv_cache_memory="4MiB", block_size=4,
                       kv_cache_dtype=name).engine.kv_cache for name in ("auto", "int8", "fp8")}
    head_dim = pools["auto"].head_dim
    for name in ("int8", "fp8"):
        ratio = pools[name].num_blocks / pools["auto"].num_blocks
        assert ratio >= 2 * head_dim / (head_dim + 2) - 0.01, (name, ratio)
        assert pools[name].memory_bytes <= 4 * 2**20
        assert pools[name].tokens_per_gib / pools["auto"].tokens_per_gib == pytest.approx(2 * head_dim / (head_dim + 2))


@pytest.mark.parametrize("name", SCHEMES)
def test_an_engine_serves_from_a_quantized_pool_cold_and_warm(tiny_model: Path, name: str):
    """On the float32 tiny model the greedy tokens of int8 and fp8_e4m3 equal the model-dtype pool's, cold
    and when served from the cache (blocks of 4: hits end mid-block and copy partial blocks), with the
    invariants checked. fp8_e5m2 keeps 2 mantissa bits: on random weights, whose logits are nearly
    flat, that flips greedy choices (benchmarks/bench_kv_quant.py measures it on a real model), so it is
    held to the cache's behaviour only."""
    prompts = [[(7 * i + 3) % 200 + 5 for i in range(n)] for n in (9, 30, 57)]
    branch = prompts[2][:41] + [11, 12, 13]  # shares 41 tokens (10 blocks and a part) with the third
    reference = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4)
    expected = [out.outputs[0].token_ids for out in run_checked(reference.engine, [*prompts, branch])]
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4, kv_cache_dtype=name)
    cold = run_checked(llm.engine, prompts)
    branched = run_checked(llm.engine, [branch])
    warm = run_checked(llm.engine, prompts)
    if name != "fp8_e5m2":
        assert [out.outputs[0].token_ids for out in cold + branched] == expected
        assert [out.outputs[0].token_ids for out in warm] == expected[:3]
    assert branched[0].num_cached_tokens == 41
    assert [out.num_cached_tokens for out in warm] == [len(p) - 1 for p in prompts]


def test_speculative_decoding_runs_on_a_quantized_pool(tiny_models: dict[str, Path], tmp_path: Path):
    """The draft's K/V live in the pool too (one more layer, quantized like the target's): greedy output
    with speculation equals the same pool's output without it."""
    target = tiny_models["llama"]
    draft = make_random_draft(target, tmp_path / "draft", seed=5)
    prompts = [[(5 * i + 1) % 150 + 5 for i in range(n)] for n in (12, 33)]
    plain = LLM(str(target), dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4,
                kv_cache_dtype="int8")
    spec = LLM(str(target), dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4,
               kv_cache_dtype="int8", speculative_config={"method": "eagle", "model": str(draft),
                                                           "num_speculative_tokens": 3})
    assert spec.engine.kv_cache.scheme is not None and spec.engine.kv_cache.num_layers == plain.engine.kv_cache.num_layers + 1
    expected = [out.outputs[0].token_ids for out in run_checked(plain.engine, prompts)]
    for _ in range(2):  # cold, then from the cache (the draft's K/V and features come with the hit)
        assert [out.outputs[0].token_ids for out in run_checked(spec.engine, prompts)] == expected


def test_the_disk_tier_stores_the_quantized_bytes_and_never_crosses_kv_dtypes(tiny_model: Path, tmp_path: Path):
    prompts = [[(3 * i + 2) % 180 + 5 for i in range(40)], [(11 * i + 7) % 180 + 5 for i in range(40)]]
    disk = tmp_path / "disk"
    sizes = {}
    for name in ("auto", "int8", "bfloat16"):
        llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4,
                  kv_disk_dir=str(disk), kv_cache_dtype=name)
        first = run_checked(llm.engine, prompts)
        llm.engine.flush_tiers()
        llm.engine.reset_prefix_cache(("device",))
        again = run_checked(llm.engine, prompts)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
        # The second engine (other KV dtype, same folder) found none of the first one's records: all its
        # hits are its own, written by its first run.
        assert [o.cached_tokens_by_tier["disk"] for o in again] == [36, 36], name
        assert [o.cached_tokens_by_tier["disk"] for o in first] == [0, 0], name
        stats = llm.stats()["kv_tiers"]["disk"]
        assert stats["verify_failures"] == {}
        sizes[name] = (llm.engine.kv_cache.block_bytes, llm.engine.kv_cache.head_dim)
        del llm
    fingerprints = sorted(path.name for path in disk.iterdir())
    assert len(fingerprints) == 3  # one folder per fingerprint: the KV dtype is part of it
    head_dim = sizes["auto"][1]
    # A record holds the quantized bytes: float32 values (4 bytes) become 1 byte and a 2-byte scale per head.
    assert sizes["auto"][0] / sizes["int8"][0] == pytest.approx(4 * head_dim / (head_dim + 2))
    assert sizes["auto"][0] == 2 * sizes["bfloat16"][0]  # float32 values stored as bfloat16


def test_a_bfloat16_pool_under_a_float32_model(tiny_models: dict[str, Path], monkeypatch):
    """kv_cache_dtype bfloat16 (vLLM's value): the model computes in float32, the pool stores bfloat16, so
    twice the tokens fit and a decode step reads half the bytes. K/V come back as their bfloat16 rounding;
    the in-place kernel and the native step read the same values as the gathering torch backend (greedy
    equal, cold and warm), and the native step equals op by op bit for bit."""
    from kvreuse.runner.decode import native_step

    model = tiny_models["qwen3"]
    kwargs = dict(dtype="float32", device="cpu", kv_cache_memory="512KiB", block_size=4)
    auto = LLM(str(model), **kwargs).engine.kv_cache
    llm = LLM(str(model), kv_cache_dtype="bfloat16", **kwargs)
    cache = llm.engine.kv_cache
    assert (cache.dtype, cache.storage_dtype, cache.scheme) == (torch.float32, torch.bfloat16, None)
    assert cache.num_blocks == 2 * auto.num_blocks and cache.block_bytes * 2 == auto.block_bytes
    k = torch.randn(3, cache.num_kv_heads, cache.head_dim)
    slots = torch.tensor([5, 0, 9])
    cache.write(1, slots, k, -k)
    keys, values = cache.gather(1, slots)
    assert keys.dtype == torch.float32 and torch.equal(keys, k.bfloat16().float()) and torch.equal(values, -keys)
    prompts = [[(7 * i + 3) % 200 + 5 for i in range(n)] for n in (9, 30)]
    branch = prompts[1][:21] + [11, 12, 13]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = {}
    for name, backend, native in (("torch", "torch", "1"), ("kernel", "cpu_paged", "0"), ("native", "cpu_paged", "1")):
        monkeypatch.setenv(native_step.ENV, native)
        engine = LLM(str(model), kv_cache_dtype="bfloat16", attention_backend=backend, **kwargs).engine
        runs = [run_checked(engine, prompts, params), run_checked(engine, [branch], params),
                run_checked(engine, prompts, params)]
        outputs[name] = [[(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in run] for run in runs]
        assert runs[1][0].num_cached_tokens == 21
        if name == "native":
            assert 1 in {rows for rows, args in engine.runner.decode.native_step._args.items() if not isinstance(args, str)}
    assert outputs["native"] == outputs["kernel"]  # bit for bit
    assert [[ids for ids, _ in run] for run in outputs["kernel"]] == [[ids for ids, _ in run] for run in outputs["torch"]]


def test_the_capacity_report_names_the_kv_dtype(tiny_model: Path):
    llm = LLM(str(tiny_model), dtype="bfloat16", device="cpu", kv_cache_memory="4MiB", kv_cache_dtype="fp8")
    stats = llm.stats()
    assert stats["kv_cache_dtype"] == "fp8" and stats["kv_tokens_per_gib"] == llm.engine.kv_cache.tokens_per_gib
    capacity = stats["kv_tokens_per_gib"] * 4 // 1024  # tokens in the 4 MiB asked for
    assert llm.engine.kv_cache.num_slots <= capacity < llm.engine.kv_cache.num_slots + llm.engine.kv_cache.block_size


def test_bad_kv_cache_dtype_is_named(tiny_model: Path):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(tiny_model), device="cpu", kv_cache_dtype="int4")


def resident_pages(tensor: torch.Tensor) -> int:
    """Pages of ``tensor``'s memory the process has resident (mincore over its page-aligned span)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    vec = (ctypes.c_ubyte * (-(-length // mmap.PAGESIZE)))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vec)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_cpu_pool_is_resident_only_where_written(kv_cache_dtype):
    """A CPU pool costs resident memory as its blocks fill, not at start-up: its zeros are pages the kernel
    has not handed out yet. They still read as zeros, and a written block costs about its own pages."""
    import mmap

    cache = KVCache(num_layers=4, num_blocks=512, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32,
                    device="cpu", kv_cache_dtype=kv_cache_dtype)
    pool_pages = cache.kv.numel() * cache.kv.element_size() // mmap.PAGESIZE
    assert pool_pages >= 512 and resident_pages(cache.kv) == 0
    slots = torch.arange(32, 48)
    for layer in range(cache.num_layers):
        cache.write(layer, slots, torch.randn(16, 4, 64), torch.randn(16, 4, 64))
    written = resident_pages(cache.kv)
    # One block in every layer, K and V: 4 x 2 x 16 slots x 4 heads x 64 values, plus the pages they straddle.
    block_pages = 4 * 2 * (16 * 4 * 64 * cache.kv.element_size() // mmap.PAGESIZE + 2)
    assert 0 < written <= block_pages < pool_pages // 8
    # (reading untouched pages maps the kernel's zero page, so this comes after counting)
    assert not cache.kv[:, :, :32].any() and not cache.kv[:, :, 48:].any() and cache.kv[:, :, 32:48].any()
