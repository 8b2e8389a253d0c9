"""TierGlue: the one place where the KV tiers meet the device pool's tensors.

The cache manager asks it for blocks beyond the device match (``lookup``) and hands it loaded
payloads to write into fresh blocks (``load``); the prefix index tells it about blocks it evicts
(``evicted``: the host tier keeps a copy); the engine hands it the blocks each step cached
(``store_computed``: queued for disk and Redis); a hybrid's kept states go to every tier (``store_state``) and come
back through ``lookup_state``. Bytes only cross here: the KV cache turns blocks into
bytes and back (``read_block`` / ``write_block``), so this module, like the rest of ``cache/tiers``,
imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvreuse.cache.prefix import CacheNode
from kvreuse.cache.tiers.store import BlockRef, StateFound, StateRef, TieredStore


class BlockBytes(Protocol):
    """The device pool's blocks as bytes (``kvreuse.cache.kv.KVCache``)."""

    def read_block(self, block_id: int) -> bytes: ...
    def write_block(self, block_id: int, payload: bytes | memoryview) -> None: ...


class SlotBytes(Protocol):
    """A hybrid's recurrent-state slots as bytes (``kvreuse.cache.recurrent_state.RecurrentStatePool``)."""

    def read_slot(self, slot: int) -> bytes: ...


class TierGlue:
    def __init__(self, store: TieredStore, kv_cache: BlockBytes, states: SlotBytes | None = None) -> None:
        self.store = store
        self.kv_cache = kv_cache
        self.states = states

    def lookup(self, blocks: Sequence[BlockRef]) -> list[tuple[str, memoryview]]:
        return self.store.lookup(blocks)

    def load(self, block_ids: list[int], payloads: list[memoryview]) -> None:
        for block_id, payload in zip(block_ids, payloads):
            self.kv_cache.write_block(block_id, payload)

    def evicted(self, node: CacheNode) -> None:
        """A block the device pool evicts (its KV still in place): the host tier keeps a copy."""
        if self.store.tier("host") is None:
            return
        root = node
        while root.parent is not None:  # the namespace is the key of the chain's root
            root = root.parent
        self.store.evicted(BlockRef(node.key, root.key, node.tokens), self.kv_cache.read_block(node.block_id))

    def store_computed(self, blocks: Iterable[tuple[CacheNode, bytes]]) -> None:
        """Queue the blocks a step cached, (node, namespace) each, for the write-through tiers. Called after
        the step's draft K/V are written, so a stored block is complete; one evicted since is skipped."""
        for node, namespace in blocks:
            if not node.evicted:
                self.store.store(BlockRef(node.key, namespace, node.tokens), self.kv_cache.read_block(node.block_id))

    def store_state(self, ref: StateRef, slot: int, tail_block: int | None) -> None:
        """A snapshot the device keeps (issue 66), read now from its slot and the block holding its tail's K/V, queued
        for every tier (the states are written back into a slot by ``StateSlots.load``'s copy)."""
        if self.states is not None:
            self.store.store_state(ref, self.states.read_slot(slot),
                                   None if tail_block is None else self.kv_cache.read_block(tail_block))

    def lookup_state(self, refs: Sequence[StateRef]) -> StateFound | None:
        return self.store.lookup_state(refs)

    def cached_by_tier(self, num_cached: int, tier_tokens: dict[str, int]) -> dict[str, int]:
        """A request's cached prompt tokens split by where they came from: each tier it loaded blocks from,
        and the device pool for the rest."""
        loaded: dict[str, int] = {}
        left = num_cached  # a hybrid's tier tokens (blocks and the state that makes them usable) add up to at most that
        for tier, tokens in tier_tokens.items():
            loaded[tier] = min(tokens, left)
            left -= loaded[tier]
        return {"device": max(num_cached - sum(loaded.values()), 0)} | {
            tier.name: loaded.get(tier.name, 0) for tier in self.store.tiers}
