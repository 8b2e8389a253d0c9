"""End to end through the engine on tiny models, float32, CPU.

Greedy output must equal transformers' greedy generation token for token, whatever the cache did:
cold, warm (full hit, hit ending mid-block, hit over many blocks), chunked prefill, mixed batches,
preemption under a tiny pool, caching on and off. The cache core's invariants are checked after
every engine step, and after every workload every block is free or idle-cached.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.engine import LLMEngine
from kvreuse.errors import InvalidRequestError

MAX_NEW = 12
_reference_models: dict[Path, object] = {}


def reference_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int = MAX_NEW) -> list[int]:
    """transformers' greedy decoding on the same folder: prefill, then one token at a time with its
    own KV cache (what generate(do_sample=False) does, written out so EOS never stops it early)."""
    from transformers import AutoModelForCausalLM

    model = _reference_models.get(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _reference_models[model_dir] = model
    generated: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def make_llm(model_dir: Path, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=4)
    options.update(kwargs)
    return LLM(str(model_dir), **options)


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Drive the engine step by step, checking the cache invariants after every step."""
    ids = []
    for i, prompt in enumerate(prompts):
        request_id = f"req-{id(prompts)}-{i}"
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        ids.append(request_id)
    done: dict[str, list[int]] = {}
    for _ in range(10_000):
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    assert_no_leaks(engine)
    return [done[request_id] for request_id in ids]


def assert_no_leaks(engine: LLMEngine) -> None:
    stats = engine.stats().cache
    assert stats.blocks_in_use == 0, "a finished workload left blocks in use"
    assert stats.blocks_free + stats.blocks_idle == stats.num_blocks
    engine.check_integrity()


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def prompt_ids(seed: int, length: int, vocab: int = 300) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gpt_oss"])
def test_greedy_matches_transformers_cold_and_warm(tiny_models, arch):
    model_dir = tiny_models[arch]
    llm = make_llm(model_dir)
    engine = llm.engine
    shared = prompt_ids(1, 37)  # 9 full blocks of 4 and one token
    cold = shared + prompt_ids(2, 5)
    expected_cold = reference_greedy(model_dir, cold)
    assert run_checked(engine, [cold], GREEDY) == [expected_cold]

    # Full hit: the same prompt again reuses everything but the last token.
    before = engine.stats().cache.hit_tokens
    assert run_checked(engine, [cold], GREEDY) == [expected_cold]
    assert engine.stats().cache.hit_tokens - before == len(cold) - 1

    # Hit ending mid-block: diverges at position 38 (block 9, offset 2) -> token-granular reuse.
    mid = cold[:38] + prompt_ids(3, 6)
    before = engine.stats().cache.hit_tokens
    assert run_checked(engine, [mid], GREEDY) == [reference_greedy(model_dir, mid)]
    assert engine.stats().cache.hit_tokens - before == 38

    # Hit over many blocks, continuing into generated tokens of the first request (multi-turn).
    turn2 = cold + expected_cold + prompt_ids(4, 7)
    before = engine.stats().cache.hit_tokens
    assert run_checked(engine, [turn2], GREEDY) == [reference_greedy(model_dir, turn2)]
    # Every token computed before is reused: prompt and generated tokens alike, the partly filled last block
    # included (a finished sequence leaves it as a tail); only the last generated token has no KV.
    computed = len(cold) + len(expected_cold) - 1
    assert engine.stats().cache.hit_tokens - before == computed


def test_chunked_prefill_mixed_batch_and_caching_off(tiny_models):
    model_dir = tiny_models["llama"]
    prompts = [prompt_ids(10 + i, n) for i, n in enumerate([3, 17, 40, 9, 64, 1])]
    expected = [reference_greedy(model_dir, p) for p in prompts]
    # A budget of 8 tokens per step: long prompts are prefilled in chunks while others decode.
    chunked = make_llm(model_dir, max_num_batched_tokens=8)
    assert run_checked(chunked.engine, prompts, GREEDY) == expected
    no_cache = make_llm(model_dir, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert run_checked(no_cache.engine, prompts + prompts[:2], GREEDY) == expected + expected[:2]
    assert no_cache.stats()["prefix_cache_hits_tokens"] == 0
    assert no_cache.stats()["blocks_idle_cached"] == 0


def test_preemption_under_a_tiny_pool_keeps_outputs_exact(tiny_models):
    model_dir = tiny_models["qwen3"]
    # 16 blocks of 4 tokens = 64 slots for 6 requests of ~30 tokens each: preemption is forced.
    config = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, max_model_len=64,
                 kv_cache_memory=_bytes_for_blocks(model_dir, 16, 4))
    engine = config.engine
    assert engine.kv.pool.num_blocks == 16
    prompts = [prompt_ids(20 + i, 18 + i) for i in range(6)]
    expected = [reference_greedy(model_dir, p) for p in prompts]
    assert run_checked(engine, prompts, GREEDY) == expected
    assert engine.stats().num_preemptions > 0


def _bytes_for_blocks(model_dir: Path, num_blocks: int, block_size: int) -> int:
    from kvreuse.models.config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir)
    return config.kv_bytes_per_token(torch.float32) * block_size * num_blocks


def test_in_batch_sharing_computes_a_common_prefix_once(tiny_model):
    llm = make_llm(tiny_model)
    shared = prompt_ids(30, 40)
    prompts = [shared + prompt_ids(31 + i, 3) for i in range(4)]
    expected = [reference_greedy(tiny_model, p) for p in prompts]
    assert run_checked(llm.engine, prompts, GREEDY) == expected
    stats = llm.stats()
    # The first computes the 40 shared tokens; the other three reuse all 40.
    assert stats["prefix_cache_hits_tokens"] == 3 * 40


def test_n_samples_share_the_prompt_and_seeds_reproduce(tiny_model):
    llm = make_llm(tiny_model)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": prompt_ids(40, 21)}
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1  # the n samples differ
    assert second.num_cached_tokens == 20


def test_generate_api_text_stops_and_metrics(tiny_model):
    llm = make_llm(tiny_model)
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(["Hello world, this is a test.", "Another prompt"],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["Hello world, this is a test.", "Another prompt"]
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 6
        assert completion.text == tokenizer.decode(completion.token_ids)
        assert output.metrics.time_to_first_token is not None and output.metrics.time_to_first_token >= 0
        assert output.metrics.e2e_latency >= output.metrics.time_to_first_token

    # A stop token id ends generation at that token.
    free_run = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    stop_at = free_run.outputs[0].token_ids[3]
    stopped = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                   stop_token_ids=[stop_at]), use_tqdm=False)[0]
    first_index = free_run.outputs[0].token_ids.index(stop_at)
    assert stopped.outputs[0].token_ids == free_run.outputs[0].token_ids[: first_index + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_at

    # A stop string truncates the text before it.
    text = free_run.outputs[0].text
    if len(text.strip()) >= 4:
        stop = text.strip()[2:4]
        cut = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == text[: text.index(stop)]


def test_chat_applies_the_template_and_multi_turn_hits(tiny_model):
    llm = make_llm(tiny_model)
    system = {"role": "system", "content": "You are a careful assistant. " * 6}
    first = llm.chat([system, {"role": "user", "content": "What is a KV cache?"}],
                     SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert "<|im_start|>system" in first.prompt and first.prompt.endswith("<|im_start|>assistant\n")
    second = llm.chat([system, {"role": "user", "content": "And prefix caching?"}],
                      SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    system_tokens = len(llm.get_tokenizer().encode(
        llm.get_tokenizer().apply_chat_template([system], add_generation_prompt=False)))
    assert second.num_cached_tokens >= system_tokens


def test_stats_and_reset(tiny_model):
    llm = make_llm(tiny_model)
    prompt = {"prompt_token_ids": prompt_ids(50, 30)}
    llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    stats = llm.stats()
    assert stats["prefix_cache_queries_tokens"] == 60
    # The second waits for the first one's prefill and reuses its 7 full blocks of 4.
    assert stats["prefix_cache_hits_tokens"] == 28
    assert stats["blocks_idle_cached"] > 0 and stats["blocks_in_use"] == 0
    assert stats["prefix_cache_hit_rate"] == pytest.approx(28 / 60)
    freed = llm.reset_prefix_cache()
    assert freed == stats["blocks_idle_cached"]
    assert llm.stats()["blocks_free"] == stats["blocks_total"]


# --- bad input: a clear error, nothing else lost ------------------------------------------------------
def test_bad_requests_fail_alone(tiny_model):
    llm = make_llm(tiny_model, max_model_len=64)
    engine = llm.engine
    good = prompt_ids(60, 20)
    engine.add_request("good", {"prompt_token_ids": good}, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=r"70 tokens.*max_model_len=64"):
        engine.add_request("long", {"prompt_token_ids": prompt_ids(61, 70)}, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", GREEDY)
    with pytest.raises(InvalidRequestError, match=r"prompt_token_ids\[1\].*outside the vocabulary") as refused:
        engine.add_request("oov", {"prompt_token_ids": [5, 10**7]}, GREEDY)
    assert refused.value.param == "prompt_token_ids"  # the field that held the id, named in the message too
    with pytest.raises(InvalidRequestError, match=r"^prompt\[1\].*outside the vocabulary") as refused:
        engine.add_request("oov list", [5, 10**7], GREEDY)
    assert refused.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="lone surrogate") as refused:
        engine.add_request("surrogate", "hello \ud800", GREEDY)
    assert refused.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="lone surrogate") as refused:
        llm.chat([{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "hi \udfff"}]}], GREEDY)
    assert refused.value.param == "messages[1].content[0].text"
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("good", {"prompt_token_ids": good}, GREEDY)
    result = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            result = output
        engine.check_integrity()
    assert result.request_id == "good" and result.outputs[0].token_ids == reference_greedy(tiny_model, good)
    assert_no_leaks(engine)


def test_configuration_errors_name_the_fix(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"raise kv_cache_memory to at least \d+ bytes"):
        LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="64KiB", max_model_len=1024)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="lots")
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(str(tiny_model), dtype="float32", device="cpu", scheduling_policy="random")
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(bad), dtype="float32", device="cpu")


def test_debug_log_explains_a_miss(tiny_model, caplog):
    llm = make_llm(tiny_model)
    tokenizer = llm.get_tokenizer()
    base = "You are a helpful assistant for the billing team. Today is Monday and the queue is long."
    llm.generate(base, SamplingParams(max_tokens=1), use_tqdm=False)
    changed = base.replace("Monday", "Friday")
    position = len(tokenizer.encode(base[: base.index("Monday")]))
    with caplog.at_level(logging.DEBUG, logger="kvreuse"):
        llm.generate(changed, SamplingParams(max_tokens=1), use_tqdm=False)
    text = caplog.text
    assert "reused" in text and "cache miss at token position" in text
    reported = int(text.split("cache miss at token position ")[1].split(":")[0])
    assert abs(reported - position) <= 1  # the divergence is where the day changed
    assert "Friday" in text or "Fri" in text


def test_step_timings_split_each_step_into_forward_and_the_rest(tiny_model):
    """One StepTiming per step: the tokens the model ran, a forward inside the step's time, and the output
    processing that step_and_process adds (what bench_engine's overhead share is computed from)."""
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": list(range(30, 42))}], params,
                 use_tqdm=False)
    timings = list(llm.engine.step_timings)
    assert len(timings) == llm.engine.stats().steps
    # A prefill step of both prompts (32 tokens), then one decode row per sequence per step.
    assert timings[0].num_tokens == 32 and timings[0].num_seqs == 2
    assert [t.num_tokens for t in timings[1:]] == [2] * 4
    assert sum(t.num_tokens for t in timings) == 32 + 2 * 4
    for timing in timings:
        assert 0 < timing.forward_s <= timing.step_s
        assert timing.output_s > 0  # every step produced outputs that were detokenized
        assert timing.overhead_s == pytest.approx(timing.step_s - timing.forward_s + timing.output_s)
