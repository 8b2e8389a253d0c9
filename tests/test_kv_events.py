"""KV cache events: the log's paging and loss accounting, and that replaying an engine's events gives
exactly the blocks its prefix index holds, under the same keys a router computes from the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.cache.events import KVEventLog
from kvreuse.router.policy import prompt_block_keys


def replay(log: KVEventLog, after: int = 0, limit: int = 7) -> tuple[set[bytes], int]:
    """The set of keys the events say are cached, read in small pages; returns it and the last seq."""
    live: set[bytes] = set()
    while True:
        batch = log.read(after, limit)
        assert batch.lost == 0
        if not batch.events:
            return live, after
        assert [event.seq for event in batch.events] == list(range(after + 1, after + 1 + len(batch.events)))
        for event in batch.events:
            if event.type == "stored":
                assert event.key not in live
                live.add(event.key)
            else:
                live.remove(event.key)  # a removal is always of a stored key
        after = batch.next_after


def test_log_pages_in_order_and_counts_what_a_slow_reader_lost() -> None:
    log = KVEventLog(capacity=4)
    for i in range(3):
        log.stored(bytes([i]))
    batch = log.read(0, 2)
    assert [(e.seq, e.type, e.key) for e in batch.events] == [(1, "stored", b"\x00"), (2, "stored", b"\x01")]
    assert batch.next_after == 2 and batch.lost == 0
    assert [e.seq for e in log.read(2, 10).events] == [3]
    assert log.read(3, 10).events == [] and log.read(3, 10).next_after == 3
    for i in range(3):
        log.removed(bytes([i]))  # 6 events, the ring keeps 3..6
    slow = log.read(1, 10)
    assert slow.lost == 1 and [e.seq for e in slow.events] == [3, 4, 5, 6]
    assert log.read(0, 10).lost == 2
    assert log.read(99, 10).events == [] and log.read(99, 10).next_after == 6  # another epoch's reader
    assert log.read(0, 1).events[0].to_json() == {"seq": 3, "type": "stored", "key": "02"}
    with pytest.raises(ValueError, match="after"):
        log.read(-1, 1)
    with pytest.raises(ValueError, match="limit"):
        log.read(0, 0)


def indexed_keys(llm: LLM) -> set[bytes]:
    """The full blocks the index holds: the tails finished sequences leave (partly filled last blocks) make
    no events, since routers know full blocks only."""
    size = llm.engine.kv.block_size
    return {node.key for node in llm.engine.kv.index.iter_nodes() if not node.is_root and len(node.tokens) == size}


def test_events_replay_to_the_index_under_the_router_keys(tiny_model: Path) -> None:
    # A pool of a few dozen blocks of 4 tokens: the second wave of prompts evicts blocks of the first.
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", block_size=4, kv_cache_memory="64KiB",
              max_model_len=64)
    engine = llm.engine
    num_blocks = engine.kv_cache.num_blocks
    assert 20 <= num_blocks <= 200, num_blocks
    params = SamplingParams(max_tokens=3, temperature=0.0)
    prompts = [[5 + i] * 4 + list(range(20, 36)) for i in range(3)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    live, seq = replay(engine.kv_events)
    assert live == indexed_keys(llm) and live
    for prompt in prompts:  # the keys a router computes for the prompt are the engine's
        assert set(prompt_block_keys(prompt, 4, model=engine.model_name)) <= live
    flood = [[100 + i] * 40 for i in range(num_blocks // 8 + 2)]  # > the pool in blocks
    llm.generate([{"prompt_token_ids": p} for p in flood], params)
    more, seq = replay(engine.kv_events, after=0)
    assert more == indexed_keys(llm)
    assert any(e.type == "removed" for e in engine.kv_events.read(0, 10_000).events)  # eviction was seen
    llm.reset_prefix_cache()
    assert replay(engine.kv_events)[0] == indexed_keys(llm) == set()
