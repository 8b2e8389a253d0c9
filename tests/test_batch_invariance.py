"""Batch-invariant mode (``batch_invariant=True``, ``--batch-invariant``; issue 63): a token's logits are the same
bits however it was computed.

The same prompts (a shared prefix whose hits end mid-block, then different suffixes), greedy, run cold (prefix
caching off, each alone), warm alone after the prefix was cached, warm all together, and cold in prefill chunks
of a few tokens: every generated token's top logprobs (log_softmax of its logits, compared as the exact floats)
and ids must be equal in all of them. On tiny models of every weight kind kvreuse runs on CPU kernels: float32
and bfloat16 folders, GGUF Q8_0 and Q4_1 (int8 activations where the CPU runs them), ``--quantization int8``, a
quantized KV pool, two block sizes. Below: the products give a row the same bits at any row count, the
attention the same bits in any step, and the same harness catches the default (measured, per row count) path
differing.
"""

from __future__ import annotations

import pytest
import torch
from test_gguf import gguf_dir, made_gguf  # noqa: F401  (gguf_dir is the fixture made_gguf writes into)

from kvreuse import LLM, SamplingParams
from kvreuse.attention import cpu_paged
from kvreuse.kernels import paged_attention, qpacked, quant_ops, rowdot
from kvreuse.kernels.quant import random_quantized
from kvreuse.layers import plan_book, quantized_linear

pytestmark = pytest.mark.skipif(not (paged_attention.available() and rowdot.available() and quant_ops.available()),
                                reason="the CPU kernels do not build here")

MAX_TOKENS = 6


def prompts(seed: int = 3, shared_len: int = 45) -> tuple[list[int], list[list[int]]]:
    """A shared prefix (45 tokens: hits end mid-block at block sizes 4 and 16) and four prompts over it."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 300, (shared_len,), generator=generator).tolist()
    tails = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (3, 9, 1, 17)]
    return shared, [shared + tail for tail in tails]


def run(llm: LLM, batch: list[list[int]], together: bool) -> list[tuple[list[int], str]]:
    """Greedy ids and top logprobs of each prompt, all submitted at once or one after another; the cache's
    invariants checked after every step."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    done: dict[str, tuple[list[int], str]] = {}
    groups = [list(enumerate(batch))] if together else [[item] for item in enumerate(batch)]
    for group in groups:
        for index, prompt in group:
            engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = (list(output.outputs[0].token_ids), repr(output.outputs[0].logprobs))
            engine.check_integrity()
    return [done[str(index)] for index in range(len(batch))]


def every_way(path: str, shared_len: int = 45, **options) -> dict[str, list[tuple[list[int], str]]]:
    shared, batch = prompts(shared_len=shared_len)
    results = {}
    results["cold, alone"] = run(LLM(path, enable_prefix_caching=False, **options), batch, together=False)
    warm = LLM(path, **options)
    run(warm, [shared], together=True)  # the prefix cached
    results["warm, alone"] = run(warm, batch, together=False)
    assert warm.engine.stats().cache.hit_tokens >= 4 * (shared_len - 5)
    together = LLM(path, **options)
    run(together, [shared], together=True)
    results["warm, batch of 4"] = run(together, batch, together=True)
    for tokens in (5, 13):
        chunked = LLM(path, enable_prefix_caching=False, max_num_batched_tokens=tokens, max_num_seqs=4, **options)
        results[f"cold, chunks of {tokens}, batch of 4"] = run(chunked, batch, together=True)
    return results


def assert_all_equal(results: dict[str, list[tuple[list[int], str]]]) -> None:
    (first_name, first), *rest = results.items()
    for name, got in rest:
        for index, (a, b) in enumerate(zip(first, got)):
            assert a == b, f"prompt {index}: {first_name} and {name} differ:\n{a}\n{b}"


CASES = {  # name: (model, LLM options)
    "qwen2 folder, float32, blocks of 4": ("qwen2", dict(dtype="float32", block_size=4)),
    "llama folder, bfloat16, blocks of 16": ("llama", dict(dtype="bfloat16", block_size=16)),
    "qwen3 folder, float32, int8 KV": ("qwen3", dict(dtype="float32", block_size=4, kv_cache_dtype="int8")),
    "qwen2 folder, --quantization int8, bfloat16": ("qwen2", dict(dtype="bfloat16", quantization="int8", block_size=4)),
    # q8_0, q4_1 and q4_0 run on the packed int8 kernel where the CPU has AVX512-VNNI (kernels/qpacked.py), q5_0 on
    # the bf16 kernel (qdot): every quantized product kind batch-invariant mode picks.
    "GGUF Q8_0, float32": ("qwen2:Q8_0", dict(dtype="float32", block_size=4)),
    "GGUF Q4_1, bfloat16, blocks of 16": ("llama-plain:Q4_1", dict(dtype="bfloat16", block_size=16)),
    "GGUF Q4_0, bfloat16, int8 KV": ("mistral:Q4_0", dict(dtype="bfloat16", block_size=4, kv_cache_dtype="int8")),
    "GGUF Q5_0, float32": ("qwen2:Q5_0", dict(dtype="float32", block_size=4)),
    # Mixture-of-experts layers: the router on the row-dot GEMV, each expert's rows on the quantized kernels above
    # (a row's product does not depend on which rows share its expert), sums in ascending expert order.
    "qwen3_moe folder, float32": ("qwen3_moe", dict(dtype="float32", block_size=4)),
    "qwen3_moe GGUF Q8_0, bfloat16": ("qwen3_moe:Q8_0", dict(dtype="bfloat16", block_size=4)),
}


def model_path(tiny_models, gguf_dir, name: str) -> str:
    arch, _, kind = name.partition(":")
    return str(made_gguf(tiny_models, gguf_dir, arch, kind) if kind else tiny_models[arch])


@pytest.mark.parametrize("case", list(CASES))
def test_cold_warm_batched_and_chunked_runs_give_the_same_bits(tiny_models, gguf_dir, case):
    name, options = CASES[case]
    results = every_way(model_path(tiny_models, gguf_dir, name), device="cpu", kv_cache_memory="1MiB",
                        batch_invariant=True, **options)
    assert_all_equal(results)


def test_gguf_products_run_on_the_packed_kernel_where_it_runs(tiny_models, gguf_dir):
    """The cases above test the packed kernel, not a fallback: a q8_0 file's products run on it (where the CPU
    has AVX512-VNNI), the native decode step included; a q5_0 file's do not."""
    from kvreuse.runner.decode.native_step import KERNEL_CODES

    options = dict(device="cpu", kv_cache_memory="1MiB", batch_invariant=True, dtype="float32", block_size=4)
    llm = LLM(str(model_path(tiny_models, gguf_dir, "qwen2:Q8_0")), **options)
    model = llm.engine.runner.model
    assert model.runs_packed_products() == qpacked.available()
    assert model.runs_int8_activations() != qpacked.available()  # qdot8 where the packed kernel does not run
    run(llm, prompts()[1][:1], together=True)
    held = [args for args in llm.engine.runner.decode.native_step._args.values() if not isinstance(args, str)]
    assert held, "the native step ran"
    assert all((KERNEL_CODES["qpacked8"] in layer.kernels) == qpacked.available() for args in held for layer in args)
    other = LLM(str(model_path(tiny_models, gguf_dir, "qwen2:Q5_0")), **options).engine.runner.model
    assert not other.runs_packed_products()


def test_preempted_and_resumed_requests_give_the_same_bits(tiny_models, gguf_dir):
    """Four requests in a pool too small for all of them: one is preempted mid-decode and resumed, its generated
    tokens' K/V recomputed in a prefill; every token's logits equal a cold run's alone."""
    for name in ("qwen2", "qwen2:Q8_0"):
        path = model_path(tiny_models, gguf_dir, name)
        shared, batch = prompts()
        options = dict(device="cpu", dtype="float32", block_size=4, batch_invariant=True)
        cold = run(LLM(path, enable_prefix_caching=False, kv_cache_memory="1MiB", **options), batch, together=False)
        tight = LLM(path, kv_cache_memory="36KiB", max_model_len=72, **options)  # 72 tokens of K/V
        assert run(tight, batch, together=True) == cold, name
        assert tight.engine.stats().num_preemptions >= 1, name


def test_kv_blocks_have_the_same_bytes_however_they_were_computed(tiny_models, gguf_dir, tmp_path):
    """The K/V bytes themselves: each engine writes every block it computes through to a disk tier; the same block
    (same key: the same tokens after the same prefix) written by a cold run alone, by chunked prefills of a batch,
    and by a prefill of the prompts followed by their generated tokens (K/V a decode step computed elsewhere) is
    the same record, byte for byte."""
    path = model_path(tiny_models, gguf_dir, "qwen2:Q8_0")  # float32 K/V: no bf16 rounding to hide a difference
    options = dict(device="cpu", dtype="float32", block_size=4, batch_invariant=True, kv_cache_memory="1MiB")
    shared, batch = prompts()
    outputs = run(LLM(path, kv_disk_dir=str(tmp_path / "alone"), **options), batch, together=False)
    run(LLM(path, kv_disk_dir=str(tmp_path / "chunked"), max_num_batched_tokens=5, max_num_seqs=4, **options), batch,
        together=True)
    # The prompts with their generated tokens (all but the last, whose K/V no step computed) as new prompts.
    extended = [prompt + ids[:-1] for prompt, (ids, _) in zip(batch, outputs)]
    run(LLM(path, kv_disk_dir=str(tmp_path / "extended"), **options), extended, together=True)

    def records(name: str) -> dict[str, bytes]:
        files = sorted((tmp_path / name).rglob("*.kvb"))
        return {file.name: file.read_bytes() for file in files}

    alone, chunked, prefilled = records("alone"), records("chunked"), records("extended")
    prompt_blocks = len({tuple(prompt[:end]) for prompt in batch for end in range(4, len(prompt) + 1, 4)})
    assert len(alone) > prompt_blocks, "the blocks the decode steps filled are written too"
    assert set(alone) == set(chunked) and set(alone) <= set(prefilled)
    assert {key for key in alone if alone[key] != chunked[key]} == set()
    assert {key for key in alone if alone[key] != prefilled[key]} == set()


def test_contexts_longer_than_a_partition_in_the_native_step_and_op_by_op(tiny_models, monkeypatch):
    """A 530-token shared prefix: rows attend over three 256-key partitions, cold prefills and decode rows
    alike in the native step (DecodeLayers.set_partition_size) and op by op (KVREUSE_NATIVE_STEP=0); both
    paths give the same bits, and each the same bits however the token was computed."""
    from kvreuse.runner.decode import native_step

    options = dict(device="cpu", kv_cache_memory="4MiB", batch_invariant=True, dtype="float32", block_size=16,
                   max_model_len=1024)
    native = every_way(str(tiny_models["qwen2"]), shared_len=530, **options)
    monkeypatch.setenv(native_step.ENV, "0")
    op_by_op = every_way(str(tiny_models["qwen2"]), shared_len=530, **options)
    assert_all_equal(native)
    assert_all_equal({"native step": native["cold, alone"], "op by op": op_by_op["cold, alone"]})


def test_the_harness_sees_the_default_path_differ(tiny_models, gguf_dir):
    """Without the switch, a GGUF file's products change kernel with the row count (qdot for a few rows, tiles
    above: the suite's default plan) and fresh prefills run SDPA: the same comparison finds a difference."""
    results = every_way(model_path(tiny_models, gguf_dir, "qwen2:Q8_0"), device="cpu", kv_cache_memory="1MiB",
                        dtype="float32", block_size=4)
    with pytest.raises(AssertionError, match="differ"):
        assert_all_equal(results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_products_give_a_row_the_same_bits_at_any_row_count(dtype):
    weight = torch.randn(96, 160).to(dtype)
    x = torch.randn(300, 160).to(dtype)
    product = plan_book.LinearKernel(weight, torch.randn(96).to(dtype), plan_book.invariant_plan(dtype))
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 7, 8, 9, 64, 65, 300):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_0", "q4_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_products_give_a_row_the_same_bits_at_any_row_count(fmt, dtype):
    weight = random_quantized(fmt, 96, 256, torch.Generator().manual_seed(1))
    plan = quantized_linear.invariant_plan(weight, dtype)
    product = quantized_linear.QuantizedLinearKernel([weight], None, [plan])
    x = torch.randn(300, 256).to(dtype)
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 7, 8, 9, 64, 65, 300):
        assert torch.equal(product(x[:rows]), alone[:rows]), (fmt, rows)


def test_what_it_does_not_cover_is_refused_by_name(tiny_models, gguf_dir):
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(str(tiny_models["gemma3"]), dtype="float32", device="cpu", kv_cache_memory="1MiB", batch_invariant=True)
    with pytest.raises(ValueError, match="LoRA"):
        LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu", kv_cache_memory="1MiB", batch_invariant=True,
            enable_lora=True)
    with pytest.raises(ValueError, match="cpu_paged"):
        LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu", kv_cache_memory="1MiB", batch_invariant=True,
            attention_backend="torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [cpu_paged.INVARIANT_PARTITION, 0])
def test_a_rows_attention_is_the_same_bits_in_any_step(dtype, partition_size):
    """One sequence of 700 tokens (three partitions): its last rows attended in one call of all 700 queries (a cold
    prefill), as a 40-query chunk over 660 cached keys, as single decode rows, and beside another long sequence in
    one call. With the fixed partition the rows are equal bit for bit; with the kernel's own choice (0: by the
    step's total keys and threads) the whole prefill splits otherwise, and this test sees it."""
    from test_paged_attention import Pool

    heads, kv_heads, dim, length = 6, 2, 64, 700
    pool = Pool(16, kv_heads, dim, dtype, "auto", num_blocks=2 * length // 16 + 8, seed=4)
    table, other = pool.new_table(length), pool.new_table(length)
    pool.write(table, 0, length)
    pool.write(other, 0, length)
    q = pool.random(length, heads, dim)

    def attend(query_lens, context_lens, tables, queries):
        starts = [sum(query_lens[:index]) for index in range(len(query_lens))]
        out = torch.empty_like(queries)
        rows = paged_attention.paged_rows(query_lens, context_lens, tables, starts, pool.block_size)
        cpu_paged.paged_attention(out, queries, pool.cache, 0, rows, partition_size)
        return out

    whole = attend([length], [length], [table], q)
    chunk = attend([40], [length], [table], q[-40:])
    decodes = torch.cat([attend([1], [p + 1], [table], q[p:p + 1]) for p in range(length - 3, length)])
    beside = attend([3, 1], [length, length], [table, other], torch.cat([q[-3:], q[-1:]]))[:3]
    same = (torch.equal(whole[-40:], chunk) and torch.equal(whole[-3:], decodes) and torch.equal(decodes, beside))
    assert same == (partition_size > 0), f"partition_size {partition_size}: rows equal in every step: {same}"


@pytest.mark.parametrize("name", ["qwen2", "qwen2:Q8_0"])
def test_the_mode_is_part_of_the_kv_fingerprint(tiny_models, gguf_dir, name):
    """A tier's records of the default arithmetic are another engine's to an invariant one (and back); a GGUF file
    on the packed int8 kernel says so too."""
    engines = {flag: LLM(model_path(tiny_models, gguf_dir, name), dtype="float32", device="cpu", kv_cache_memory="1MiB",
                         kv_host_memory="1MiB", batch_invariant=flag).engine for flag in (False, True)}
    assert engines[False].tier_store.fingerprint != engines[True].tier_store.fingerprint
    assert engines[True].runner.model.runs_packed_products() == (":" in name and qpacked.available())


def test_by_default_the_mode_is_on_where_every_product_runs_packed(tiny_models, gguf_dir, monkeypatch):
    """batch_invariant unset: on for a q8_0 / q4_1 file on the packed int8 kernel (where the CPU runs it), off for a
    folder, a q5_0 file, and where something it does not cover is asked for (LoRA) or a product kernel is forced
    (as the rest of the suite forces plain F.linear, so its engines keep the default path); an explicit False keeps
    it off. The CLI flag's three states reach the config."""
    import argparse

    from kvreuse.engine_args import add_engine_arguments

    monkeypatch.delenv(plan_book.KERNEL_ENV, raising=False)  # the suite forces plain products (conftest.py)

    def resolved(name: str, **options) -> bool:
        llm = LLM(model_path(tiny_models, gguf_dir, name), device="cpu", dtype="float32", kv_cache_memory="1MiB",
                  **options)
        return llm.engine.config.batch_invariant

    assert resolved("qwen2:Q8_0") == resolved("llama-plain:Q4_1") == qpacked.available()
    assert resolved("qwen2:Q8_0", batch_invariant=False) is False
    assert resolved("qwen2") is False and resolved("qwen2:Q5_0") is False
    assert resolved("qwen2:Q8_0", enable_lora=True) is False
    monkeypatch.setenv(plan_book.KERNEL_ENV, "qdot")
    assert resolved("qwen2:Q8_0") is False
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for flags, expected in (([], None), (["--batch-invariant"], True), (["--no-batch-invariant"], False)):
        assert parser.parse_args(["--model", "m", *flags]).batch_invariant is expected, flags
