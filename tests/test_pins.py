"""Pins: kept on purpose, never evicted by LRU, TTLs refreshed on use, a budget that demotes LRU pins."""

from __future__ import annotations

import time

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.cache.hashing import namespace_key
from kvreuse.cache.manager import KVCacheManager
from kvreuse.cache.pins import PinBudgetError, PinRegistry
from kvreuse.request import Request

NS = namespace_key(None, None, "m")


def cached_chain(kv: KVCacheManager, tokens: list[int]):
    request = Request("r", tokens, SamplingParams(), NS, 0.0)
    match = kv.match(request)
    assert kv.admit(request, match, len(tokens) - match.num_tokens)
    request.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(request)
    kv.end_step()
    nodes = list(request.cached_nodes)
    kv.free(request)
    return nodes


def test_budget_demotes_the_least_recently_used_pin():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    registry = PinRegistry(kv.index, max_pinned_blocks=5)
    a = registry.pin("a", cached_chain(kv, list(range(100, 108))), kind="api", now=1.0)  # 2 blocks
    b = registry.pin("b", cached_chain(kv, list(range(200, 208))), kind="api", now=2.0)  # 2 blocks
    registry.record_use(a.nodes, now=3.0)  # a is now the more recently used
    c = registry.pin("c", cached_chain(kv, list(range(300, 308))), kind="api", now=4.0)  # over budget by 1
    assert set(registry.pins) == {a.pin_id, c.pin_id} and registry.num_demoted == 1
    assert registry.pinned_blocks() == 4
    # The demoted pin's blocks are ordinary cache again: evictable; the pinned ones are not.
    assert kv.index.evict(100) == 2
    kv.check_integrity([])
    with pytest.raises(PinBudgetError, match="pinned budget is 5 blocks"):
        registry.pin("big", cached_chain(kv, list(range(400, 424))), kind="api", now=5.0)


def test_shared_prefixes_count_once_and_same_key_refreshes():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    registry = PinRegistry(kv.index, max_pinned_blocks=4)
    base = list(range(100, 108))
    first = registry.pin("x", cached_chain(kv, base + [1, 2, 3, 4]), kind="api", now=1.0)
    second = registry.pin("y", cached_chain(kv, base + [5, 6, 7, 8]), kind="api", now=1.0)
    assert registry.pinned_blocks() == 4  # 2 shared + 1 + 1
    again = registry.pin("x", first.nodes, kind="api", now=9.0)
    assert again is first and first.last_used == 9.0 and len(registry.pins) == 2
    registry.unpin(second.pin_id)
    registry.unpin(first.pin_id)
    assert kv.reset_prefix_cache() == 4


def test_ttl_expires_unless_used():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    registry = PinRegistry(kv.index, max_pinned_blocks=8)
    pin = registry.pin("t", cached_chain(kv, list(range(10, 18))), kind="breakpoint", now=100.0, ttl=300.0)
    assert pin.expires == 400.0
    assert registry.expire(now=399.0) == []
    registry.record_use(pin.nodes, now=399.0)  # a hit refreshes the TTL
    assert pin.hits == 1 and pin.expires == 699.0
    assert registry.expire(now=700.0) == [pin] and not registry.pins
    assert kv.index.evict(10) == 2  # back to ordinary cache


def test_pin_survives_a_flood_that_evicts_everything_else(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", block_size=4, max_model_len=128,
              kv_cache_memory=_bytes_for(tiny_model, blocks=40, block_size=4))
    system = [{"role": "system", "content": "You answer questions about the billing system. " * 3}]
    pin = llm.pin(system)
    assert pin["kind"] == "system_prompt" and pin["tokens"] >= 16 and pin["hits"] == 0
    other = [{"role": "system", "content": "Unpinned instructions that nobody keeps around. " * 3}]
    llm.chat(other + [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)
    # A flood of unrelated prompts: 10x the pool.
    flood = [{"prompt_token_ids": [7 + (i * 13 + j) % 900 for j in range(40)]} for i in range(40)]
    llm.generate(flood, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.stats()["prefix_cache_evicted_blocks"] > 40
    pinned_hit = llm.chat(system + [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert pinned_hit.num_cached_tokens >= pin["tokens"]
    assert pinned_hit.pins_hit == [pin["id"]]
    unpinned = llm.chat(other + [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    # Without a pin the flood evicted it: only the chat-template header it shares with the pinned
    # prompt is reused (token by token, from the pinned chain).
    shared_header = next(i for i, (a, b) in enumerate(zip(unpinned.prompt_token_ids, pinned_hit.prompt_token_ids))
                         if a != b)
    assert unpinned.num_cached_tokens == shared_header < 10
    assert llm.pins()[0]["hits"] == 1
    llm.unpin(pin["id"])
    assert llm.pins() == []
    with pytest.raises(ValueError, match="no pin with id"):
        llm.unpin(pin["id"])


def test_pin_ttl_in_the_engine_and_bad_pins(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", block_size=4, kv_cache_memory="4MiB")
    # A TTL long enough that a loaded 2-core machine still lists the pin right after making it.
    pin = llm.pin("A stable preamble that we want to keep warm for a short while.", ttl=1.0)
    assert pin["ttl"] == 1.0 and llm.pins()
    time.sleep(1.1)
    assert llm.pins() == []
    with pytest.raises(ValueError, match="shorter than one KV block"):
        llm.pin("hi")
    with pytest.raises(ValueError, match="no system message"):
        llm.pin([{"role": "user", "content": "no system prompt here"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\].*'image_url'"):
        llm.pin([{"role": "system", "content": [{"type": "text", "text": "x"},
                                                 {"type": "image_url", "image_url": {"url": "http://x"}}]}])


def _bytes_for(model_dir, blocks: int, block_size: int) -> int:
    import torch

    from kvreuse.models.config import ModelConfig

    return ModelConfig.from_pretrained(model_dir).kv_bytes_per_token(torch.float32) * blocks * block_size
