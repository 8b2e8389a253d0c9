"""The cache core (BlockPool, PrefixIndex, KVCacheManager) without a model.

Unit tests pin down each guarantee; a hypothesis state machine drives random admit / decode /
finish / evict / pin sequences and checks every invariant after each operation, and checks every
match against a brute-force reference built from what was inserted and what eviction removed.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvreuse.cache.blocks import BlockPool, BlockPoolError
from kvreuse.cache.events import KVEventLog
from kvreuse.cache.hashing import block_key, extend_block_keys, namespace_key
from kvreuse.cache.manager import KVCacheManager
from kvreuse.cache.prefix import PrefixIndex
from kvreuse.request import Request
from kvreuse.sampling import SamplingParams

NS = namespace_key(None, None, "m")
_ids = itertools.count()


def make_request(tokens: list[int], namespace: bytes = NS) -> Request:
    return Request(
        request_id=f"r{next(_ids)}", prompt_token_ids=list(tokens), sampling_params=SamplingParams(),
        namespace=namespace, arrival_time=0.0,
    )


def run_prefill(kv: KVCacheManager, request: Request) -> int:
    """Admit and 'compute' the whole prompt; returns the hit length."""
    match = kv.match(request)
    assert kv.admit(request, match, request.num_tokens - match.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    kv.end_step()
    return match.num_tokens


# --- hashing -----------------------------------------------------------------------------------------
def test_keys_are_stable_and_chain_dependent():
    assert namespace_key("a", None, "m") == namespace_key("a", None, "m")
    assert namespace_key("a", None, "m") != namespace_key("b", None, "m")
    assert namespace_key(None, "lora1", "m") != namespace_key(None, None, "m")
    k1 = block_key(NS, [1, 2, 3, 4])
    assert k1 == block_key(NS, [1, 2, 3, 4])
    assert block_key(k1, [5, 6, 7, 8]) != block_key(NS, [5, 6, 7, 8])  # the parent is part of the key
    keys: list[bytes] = []
    extend_block_keys(keys, NS, list(range(10)), 4)
    assert keys == [block_key(NS, [0, 1, 2, 3]), block_key(keys[0], [4, 5, 6, 7])]
    extend_block_keys(keys, NS, list(range(12)), 4)  # incremental: only the new full block is added
    assert len(keys) == 3 and keys[2] == block_key(keys[1], [8, 9, 10, 11])


# --- block pool --------------------------------------------------------------------------------------
def test_pool_transitions_and_errors():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free == 1 and pool.num_in_use == 3
    pool.mark_cached(blocks[0])
    pool.release(blocks[0])  # cached, no user -> idle
    pool.release(blocks[1])  # uncached, no user -> free
    assert (pool.num_free, pool.num_idle, pool.num_in_use) == (2, 1, 1)
    pool.check_integrity()
    with pytest.raises(BlockPoolError):
        pool.release(blocks[1])
    with pytest.raises(BlockPoolError):
        pool.allocate(3)
    with pytest.raises(BlockPoolError):
        pool.acquire(blocks[1])  # a free block has no content to share
    pool.acquire(blocks[0])  # an idle cached block can be reused
    assert pool.num_idle == 0
    pool.release(blocks[0])
    pool.mark_evicted(blocks[0])
    assert pool.num_free == 3
    pool.check_integrity()


# --- prefix index ------------------------------------------------------------------------------------
def test_hit_never_covers_last_token_and_partial_block_is_reused():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request(list(range(12)))
    assert run_prefill(kv, first) == 0
    first_blocks = list(first.block_ids)
    kv.free(first)
    # Same 12 tokens: 2 full blocks + 3 tokens of the third (never the last prompt token).
    same = make_request(list(range(12)))
    match = kv.match(same)
    assert match.num_tokens == 11 and match.num_blocks == 2 and match.partial.num_tokens == 3
    # Diverges inside block 2 at position 9: token-granular hit of 9.
    diverged = make_request(list(range(9)) + [99, 98, 97])
    match = kv.match(diverged)
    assert match.num_tokens == 9 and match.partial.num_tokens == 1
    assert kv.admit(diverged, match, 3)
    copies = kv.take_copies()
    assert len(copies) == 1 and copies[0].num_tokens == 1
    assert copies[0].src_block == first_blocks[2] and copies[0].dst_block == diverged.block_ids[2]
    kv.check_integrity([diverged])  # the copy source is held until end_step
    kv.end_step()
    kv.check_integrity([diverged])


def test_a_finished_sequence_leaves_its_partly_filled_last_block_as_a_tail():
    """The next turn of a chat extends a finished sequence: its last, partly filled block stays cached as a
    tail, a leaf served as a partial match (copied), with no KV event and no tier copy (full blocks only)."""
    events = KVEventLog()
    kv = KVCacheManager(num_blocks=16, block_size=4, events=events)
    evicted: list = []
    kv.tiers = type("Tiers", (), {"lookup": lambda self, refs: [], "load": lambda self, ids, payloads: None,
                                  "evicted": lambda self, node: evicted.append(node)})()
    first = make_request(list(range(10)))  # two full blocks and 2 tokens of a third
    run_prefill(kv, first)
    tail_block = first.block_ids[2]
    stored = events.read(0, 1000).last_seq
    kv.free(first)
    kv.check_integrity([])
    next_turn = make_request(list(range(10)) + [50, 51, 52])
    match = kv.match(next_turn)
    assert match.num_tokens == 10 and match.partial.num_tokens == 2 and match.partial.node.block_id == tail_block
    assert kv.admit(next_turn, match, 3)
    assert kv.take_copies()[0].src_block == tail_block
    kv.end_step()
    assert events.read(0, 1000).last_seq == stored  # the tail made no KV event
    kv.free(next_turn)
    assert kv.reset_prefix_cache() > 0 and all(len(node.tokens) == 4 for node in evicted)
    assert kv.pool.num_free == 16
    # A sequence whose computed tokens fill its blocks exactly leaves no tail.
    exact = make_request(list(range(8)))
    run_prefill(kv, exact)
    kv.free(exact)
    assert all(len(node.tokens) == 4 for node in kv.index.iter_nodes())


def test_token_verification_defeats_a_forged_key():
    pool = BlockPool(4)
    index = PrefixIndex(pool, 2)
    block = pool.allocate(1)[0]
    key = block_key(NS, [1, 2])
    index.insert(NS, None, key, [1, 2], block)
    # A request whose key list claims the same key but whose tokens differ gets no hit.
    match = index.match(NS, [7, 8, 9], [key], max_tokens=2)
    assert match.num_tokens == 0


def test_namespaces_do_not_share():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tenant_a = make_request(list(range(9)), namespace_key("a", None, "m"))
    run_prefill(kv, tenant_a)
    kv.free(tenant_a)
    assert kv.match(make_request(list(range(9)), namespace_key("b", None, "m"))).num_tokens == 0
    assert kv.match(make_request(list(range(9)), namespace_key("a", None, "m"))).num_tokens == 8


def test_eviction_is_leaf_first_lru_and_respects_pins():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    old = make_request([1, 2, 3, 4, 5])  # blocks [1,2] [3,4] and the tail [5]
    new = make_request([9, 9, 8, 8, 7])  # blocks [9,9] [8,8] and the tail [7]
    for request in (old, new):
        run_prefill(kv, request)
        kv.free(request)
    index = kv.index
    assert index.evict(2) == 2
    # The end of the least recently used chain goes first (its tail, then [3,4]), never its head.
    assert kv.match(make_request([1, 2, 3, 4, 5])).num_tokens == 2
    assert kv.match(make_request([9, 9, 8, 8, 7, 6])).num_tokens == 5
    pinned_chain = kv.match(make_request([9, 9, 8, 8, 7])).nodes
    index.pin(pinned_chain)
    assert index.evict(10) == 2  # only the unpinned [1,2] and the tail [7] could go
    assert kv.match(make_request([9, 9, 8, 8, 7, 6])).num_tokens == 4
    assert kv.match(make_request([1, 2, 3])).num_tokens == 0
    index.unpin(pinned_chain)
    assert kv.reset_prefix_cache() == 2
    kv.check_integrity([])
    assert kv.pool.num_free == 8


def test_blocks_in_use_are_never_evicted_and_duplicates_are_shared():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request([1, 2, 3, 4, 5])
    b = make_request([1, 2, 3, 4, 6])
    # Both admitted before either computed: both miss and both compute [1,2] [3,4].
    ma, mb = kv.match(a), kv.match(b)
    assert kv.admit(a, ma, 5) and kv.admit(b, mb, 5)
    for request in (a, b):
        request.num_computed_tokens = 5
        kv.cache_computed_blocks(request)
    kv.end_step()
    # The second request switched to the first one's cached blocks and freed its own copies.
    assert a.block_ids[:2] == b.block_ids[:2]
    kv.check_integrity([a, b])
    assert kv.pool.num_free == 6 - 4
    assert kv.index.evict(10) == 0  # everything cached is in use
    assert not kv.grow(make_request([0]), 6)


# --- property-based: random operation sequences against a reference ---------------------------------
BLOCK = 3
BASES = [(0, 1, 2, 0, 1, 2, 0), (0, 1, 2, 1, 1), (2, 2, 2, 2, 2, 2, 2, 2), (1,)]


def reference_hit(cached: set[tuple[int, ...]], tokens: list[int]) -> int:
    """Longest reusable prefix from the set of cached block-aligned prefixes, brute force."""
    limit = len(tokens) - 1
    full = 0
    while (full + 1) * BLOCK <= limit and tuple(tokens[: (full + 1) * BLOCK]) in cached:
        full += 1
    start = full * BLOCK
    best = 0
    for prefix in cached:  # full blocks and the tails of finished sequences after the matched chain
        if start < len(prefix) <= start + BLOCK and list(prefix[:start]) == tokens[:start]:
            common = 0
            for cached_token, token in zip(prefix[start:], tokens[start:limit]):
                if cached_token != token:
                    break
                common += 1
            best = max(best, common)
    return start + best


def tree_prefixes(index: PrefixIndex) -> set[tuple[int, ...]]:
    result = set()
    for node in index.iter_nodes():
        tokens: list[int] = []
        walker = node
        while walker.parent is not None:
            tokens[:0] = walker.tokens
            walker = walker.parent
        result.add(tuple(tokens))
    return result


class CacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 14))
    def setup(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK)
        self.live: list[Request] = []
        self.cached: set[tuple[int, ...]] = set()
        self.pins: list[tuple[list, set[tuple[int, ...]]]] = []  # (nodes, their prefixes)

    def _sync_evictions(self, before: set[tuple[int, ...]]) -> None:
        after = tree_prefixes(self.kv.index)
        evicted = before - after
        used = {tuple(r.all_token_ids[: (i + 1) * BLOCK]) for r in self.live for i in range(len(r.cached_nodes))}
        pinned = set().union(*(prefixes for _, prefixes in self.pins))
        for prefix in evicted:
            assert prefix not in used, "a block in use was evicted"
            assert prefix not in pinned, "a pinned block was evicted"
            if len(prefix) % BLOCK == 0:  # a tail is a leaf: a longer prefix starting with its tokens is a sibling's
                assert not any(len(q) > len(prefix) and q[: len(prefix)] == prefix for q in after), "head before tail"
        self.cached -= evicted
        assert self.cached == after

    @rule(base=st.sampled_from(BASES), suffix=st.lists(st.integers(0, 2), max_size=5))
    def start(self, base, suffix) -> None:
        request = make_request(list(base) + suffix)
        before = tree_prefixes(self.kv.index)
        match = self.kv.match(request)
        assert match.num_tokens == reference_hit(self.cached, request.all_token_ids)
        assert match.num_tokens <= request.num_tokens - 1
        if not self.kv.admit(request, match, request.num_tokens - match.num_tokens):
            self._sync_evictions(before)
            return
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_computed_blocks(request)
        self.kv.end_step()
        self.live.append(request)
        for i in range(request.num_tokens // BLOCK):
            self.cached.add(tuple(request.all_token_ids[: (i + 1) * BLOCK]))
        self._sync_evictions(before)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, pick: int, token: int) -> None:
        request = self.live[pick % len(self.live)]
        before = tree_prefixes(self.kv.index)
        request.append_token(token)
        if not self.kv.grow(request, 1):
            self._sync_evictions(before)
            request.all_token_ids.pop()
            return
        request.num_computed_tokens += 1
        self.kv.cache_computed_blocks(request)
        self.kv.end_step()
        if request.num_tokens % BLOCK == 0:
            self.cached.add(tuple(request.all_token_ids))
        self._sync_evictions(before)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick: int) -> None:
        request = self.live.pop(pick % len(self.live))
        self.kv.free(request)
        if request.num_computed_tokens % BLOCK:  # its partly filled last block stays, as a tail
            self.cached.add(tuple(request.all_token_ids[: request.num_computed_tokens]))
        assert self.cached == tree_prefixes(self.kv.index)

    @rule(count=st.integers(1, 5))
    def evict(self, count: int) -> None:
        before = tree_prefixes(self.kv.index)
        freed = self.kv.index.evict(count)
        assert freed <= count
        self._sync_evictions(before)
        assert len(before) - len(self.cached) == freed

    @rule(base=st.sampled_from(BASES))
    def pin(self, base) -> None:
        request = make_request(list(base))
        match = self.kv.match(request)
        if match.nodes:
            self.kv.index.pin(match.nodes)
            prefixes = {tuple(base[: (i + 1) * BLOCK]) for i in range(match.num_blocks)}
            self.pins.append((match.nodes, prefixes))

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self) -> None:
        nodes, _ = self.pins.pop()
        self.kv.index.unpin(nodes)

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity(self.live)
        pool = self.kv.pool
        assert pool.num_free + pool.num_idle + pool.num_in_use == pool.num_blocks

    def teardown(self) -> None:
        for request in self.live:
            self.kv.free(request)
        for nodes, _ in self.pins:
            self.kv.index.unpin(nodes)
        self.kv.reset_prefix_cache()
        self.kv.check_integrity([])
        assert self.kv.pool.num_free == self.kv.pool.num_blocks  # nothing leaked


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
