"""KVCacheManager: the bookkeeping between requests and KV blocks.

It owns the BlockPool and the PrefixIndex and is the only code that changes them during serving:
admission (reuse matched blocks, copy a partial match, allocate the rest, evicting idle leaves when
the pool is short), growth of running requests, caching of blocks as they fill, and release.
It also remembers which block keys running prefills are about to compute, so the scheduler can hold
back a request that would otherwise compute the same prefix a second time in the same batch.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvreuse.cache.blocks import BlockCopy, BlockPool
from kvreuse.cache.events import KVEventLog
from kvreuse.cache.hashing import block_key, extend_block_keys
from kvreuse.cache.prefix import EMPTY_MATCH, CacheNode, Divergence, PrefixIndex, PrefixMatch
from kvreuse.cache.tiers.store import BlockRef


class CacheSequence(Protocol):
    """A sequence as the cache sees it (``kvreuse.request.Request`` is the one kind): its tokens, how far
    its KV is computed, and the blocks it holds. A protocol, so the cache core stays below the request
    and sampling code and imports no torch."""

    request_id: str
    namespace: bytes  # the cache namespace of its first block (tenant, adapter, model, draft)
    all_token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]  # block_ids[i] holds tokens [i * block_size, (i + 1) * block_size)
    cached_nodes: list[CacheNode]  # the first len(cached_nodes) blocks, as entries of the prefix index
    block_keys: list[bytes]  # chained keys of the full blocks
    tier_checked_blocks: int  # blocks below this index were already looked up in the KV tiers
    tier_tokens: dict[str, int]  # tokens loaded from each tier

    @property
    def num_tokens(self) -> int: ...


@dataclass
class CacheStats:
    num_blocks: int
    block_size: int
    blocks_in_use: int
    blocks_idle: int
    blocks_free: int
    query_tokens: int  # prompt tokens looked up at admission
    hit_tokens: int  # of which served from the cache
    evicted_blocks: int
    cached_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def usage(self) -> float:
        return self.blocks_in_use / self.num_blocks


class TierSource(Protocol):
    """The KV tiers as the manager sees them (the engine's glue: kvreuse.cache.tiers.glue)."""

    def lookup(self, blocks: Sequence[BlockRef]) -> list[tuple[str, memoryview]]: ...
    def load(self, block_ids: list[int], payloads: list[memoryview]) -> None: ...
    def evicted(self, node: CacheNode) -> None: ...  # called before the block can be reused


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.index = PrefixIndex(self.pool, block_size, events)
        self.index.on_evict = self._evicted
        self.query_tokens = 0
        self.hit_tokens = 0
        self._copies: list[BlockCopy] = []
        self._copy_sources: list[int] = []  # blocks held until their copy has run
        self._pending: Counter[bytes] = Counter()  # block keys running prefills will compute
        self._pending_of: dict[int, deque[bytes]] = {}  # id(request) -> its pending keys, in order
        # KV tiers behind the pool (None: the pool is all there is). Blocks computed since the engine
        # last took them, for the write-through tiers: (node, namespace).
        self.tiers: TierSource | None = None
        self._new_blocks: list[tuple[CacheNode, bytes]] = []

    # --- lookup -----------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_keys(self, request: CacheSequence) -> None:
        if self.enable_prefix_caching:
            extend_block_keys(request.block_keys, request.namespace, request.all_token_ids, self.block_size)

    def match(self, request: CacheSequence) -> PrefixMatch:
        """Longest reusable prefix; never covers the last token (its logits are needed)."""
        if not self.enable_prefix_caching:
            return EMPTY_MATCH
        self.update_block_keys(request)
        match = self.index.match(request.namespace, request.all_token_ids, request.block_keys, request.num_tokens - 1)
        if self.tiers is not None:
            match = self._extend_from_tiers(request, match)
        return match

    def _extend_from_tiers(self, request: CacheSequence, match: PrefixMatch) -> PrefixMatch:
        """Load the blocks that follow the device match from the tiers (the longest contiguous run they
        hold, each record verified) into fresh device blocks, cached as idle; then match again."""
        assert self.tiers is not None
        size = self.block_size
        limit = min((request.num_tokens - 1) // size, len(request.block_keys))  # never the last token
        start = match.num_blocks
        if start >= limit or limit <= request.tier_checked_blocks:
            return match
        request.tier_checked_blocks = limit
        tokens = request.all_token_ids
        refs = [BlockRef(request.block_keys[i], request.namespace, tokens[i * size:(i + 1) * size])
                for i in range(start, limit)]
        found = self.tiers.lookup(refs)
        if not found:
            return match
        held = [node.block_id for node in match.nodes] + ([match.partial.node.block_id] if match.partial else [])
        for block in held:  # making room must not evict the chain the loaded blocks hang under
            self.pool.acquire(block)
        self._ensure_free(len(found))
        count = min(len(found), self.pool.num_free)
        if count:
            blocks = self.pool.allocate(count)
            self.tiers.load(blocks, [payload for _, payload in found[:count]])
            parent = match.nodes[-1] if match.nodes else None
            loaded: list[CacheNode] = []
            for offset, block in enumerate(blocks):
                i = start + offset
                parent = self.index.insert(request.namespace, parent, request.block_keys[i],
                                           tokens[i * size:(i + 1) * size], block)
                loaded.append(parent)
                self.pool.release(block)
            self.index.release(loaded)
            for tier, _ in found[:count]:
                request.tier_tokens[tier] = request.tier_tokens.get(tier, 0) + size
        for block in held:
            self.pool.release(block)
        self.index.release(list(match.nodes) + ([match.partial.node] if match.partial else []))
        return self.index.match(request.namespace, tokens, request.block_keys, request.num_tokens - 1)

    def _evicted(self, node: CacheNode) -> None:
        if self.tiers is not None:
            self.tiers.evicted(node)

    def take_new_blocks(self) -> list[tuple[CacheNode, bytes]]:
        """Blocks computed (and cached) since the last call, with their namespace: for write-through."""
        blocks, self._new_blocks = self._new_blocks, []
        return blocks

    def divergence(self, request: CacheSequence, match: PrefixMatch) -> Divergence:
        return self.index.divergence(request.namespace, request.all_token_ids, match)

    def is_next_block_pending(self, request: CacheSequence, match: PrefixMatch) -> bool:
        """Is the first block this request would compute already being computed by another one?"""
        next_block = match.num_blocks
        return next_block < len(request.block_keys) and request.block_keys[next_block] in self._pending

    # --- allocation -------------------------------------------------------------------------------
    def _ensure_free(self, num_blocks: int) -> bool:
        shortfall = num_blocks - self.pool.num_free
        if shortfall > 0:
            self.index.evict(shortfall)
        return self.pool.num_free >= num_blocks

    def admit(self, request: CacheSequence, match: PrefixMatch, num_new_tokens: int) -> bool:
        """Give a waiting request its matched blocks plus room for ``num_new_tokens``.

        On failure nothing changes (apart from idle leaves evicted on the way) and False is returned.
        """
        assert not request.block_ids, "admit() is for requests that hold no blocks"
        # Hold what we reuse first, so making room cannot evict it.
        for node in match.nodes:
            self.pool.acquire(node.block_id)
        partial = match.partial
        if partial is not None:
            self.pool.acquire(partial.node.block_id)
        num_needed = self.blocks_for(match.num_tokens + num_new_tokens) - match.num_blocks
        if not self._ensure_free(num_needed):
            for node in match.nodes:
                self.pool.release(node.block_id)
            if partial is not None:
                self.pool.release(partial.node.block_id)
            self.index.release(match.nodes + ([partial.node] if partial else []))
            return False
        new_blocks = self.pool.allocate(num_needed)
        request.block_ids = [node.block_id for node in match.nodes] + new_blocks
        request.cached_nodes = list(match.nodes)
        if partial is not None:
            self._copies.append(BlockCopy(partial.node.block_id, new_blocks[0], partial.num_tokens))
            self._copy_sources.append(partial.node.block_id)
        self.index.touch(match.nodes)
        request.num_computed_tokens = match.num_tokens
        self.query_tokens += request.num_tokens
        self.hit_tokens += match.num_tokens
        if self.enable_prefix_caching:
            keys = deque(request.block_keys[match.num_blocks :])
            self._pending_of[id(request)] = keys
            self._pending.update(keys)
        return True

    def grow(self, request: CacheSequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of a running request."""
        num_needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if num_needed <= 0:
            return True
        if not self._ensure_free(num_needed):
            return False
        request.block_ids.extend(self.pool.allocate(num_needed))
        return True

    def take_copies(self) -> list[BlockCopy]:
        copies, self._copies = self._copies, []
        return copies

    def end_step(self) -> None:
        """The step's forward ran: copy sources may be evicted again."""
        for block in self._copy_sources:
            self.pool.release(block)
            node = self.index.node_of_block(block)
            if node is not None:
                self.index.release([node])
        self._copy_sources.clear()

    # --- caching ----------------------------------------------------------------------------------
    def cache_computed_blocks(self, request: CacheSequence) -> None:
        """Insert every full block whose KV is now computed (prompt and generated tokens alike)."""
        if not self.enable_prefix_caching:
            return
        self.update_block_keys(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_keys))
        size = self.block_size
        pending = self._pending_of.get(id(request))
        for i in range(len(request.cached_nodes), num_full):
            parent = request.cached_nodes[-1] if request.cached_nodes else None
            own_block = request.block_ids[i]
            key = request.block_keys[i]
            node = self.index.insert(
                request.namespace, parent, key, request.all_token_ids[i * size : (i + 1) * size], own_block
            )
            if node.block_id != own_block:
                # Another request cached the same block first: share its block, free ours.
                self.pool.acquire(node.block_id)
                self.pool.release(own_block)
                request.block_ids[i] = node.block_id
            elif self.tiers is not None:
                self._new_blocks.append((node, request.namespace))
            request.cached_nodes.append(node)
            if pending and pending[0] == key:
                pending.popleft()
                self._drop_pending(key)

    def _cache_tail(self, request: CacheSequence) -> None:
        size = self.block_size
        num_full, tail_len = divmod(request.num_computed_tokens, size)
        if (not self.enable_prefix_caching or tail_len == 0 or len(request.cached_nodes) != num_full
                or len(request.block_ids) <= num_full):
            return
        parent = request.cached_nodes[-1] if request.cached_nodes else None
        tokens = request.all_token_ids[num_full * size : num_full * size + tail_len]
        key = block_key(parent.key if parent is not None else request.namespace, tokens)
        block = request.block_ids[num_full]
        node = self.index.insert(request.namespace, parent, key, tokens, block, tail=True)
        if node.block_id == block:  # else the same tail was cached before: ours is freed below
            request.cached_nodes.append(node)  # released with the others, so it becomes idle

    def _drop_pending(self, key: bytes) -> None:
        self._pending[key] -= 1
        if self._pending[key] <= 0:
            del self._pending[key]

    # --- release ----------------------------------------------------------------------------------
    def free(self, request: CacheSequence) -> None:
        """Drop the request's hold on its blocks; cached ones stay in the index as idle, and so does the last,
        partly filled block of computed tokens (a tail): the next turn of a chat or an agent loop extends
        this sequence, and its partial match then covers every computed token, not only the full blocks."""
        for key in self._pending_of.pop(id(request), ()):
            self._drop_pending(key)
        self._cache_tail(request)
        for block in reversed(request.block_ids):
            self.pool.release(block)
        self.index.release(request.cached_nodes)
        request.block_ids = []
        request.cached_nodes = []

    def reset_prefix_cache(self) -> int:
        """Evict every idle, unpinned cached block; returns how many were freed."""
        total = 0
        while True:
            freed = self.index.evict(self.index.num_cached_blocks or 1)
            total += freed
            if freed == 0:
                return total

    # --- reporting --------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        return CacheStats(
            num_blocks=self.pool.num_blocks,
            block_size=self.block_size,
            blocks_in_use=self.pool.num_in_use,
            blocks_idle=self.pool.num_idle,
            blocks_free=self.pool.num_free,
            query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens,
            evicted_blocks=self.index.num_evicted_blocks,
            cached_blocks=self.index.num_cached_blocks,
        )

    def check_integrity(self, requests: Iterable[CacheSequence]) -> None:
        """Every block accounted for: ref counts equal the holders, nodes match block tables."""
        self.pool.check_integrity()
        self.index.check_integrity()
        holders = Counter(self._copy_sources)
        for request in requests:
            holders.update(request.block_ids)
            if len(request.cached_nodes) > len(request.block_ids):
                raise RuntimeError(f"request {request.request_id} caches more blocks than it holds")
            for node, block in zip(request.cached_nodes, request.block_ids):
                if node.block_id != block or node.evicted:
                    raise RuntimeError(f"request {request.request_id}: block table disagrees with the index")
            if len(request.block_ids) * self.block_size < request.num_computed_tokens:
                raise RuntimeError(f"request {request.request_id} computed tokens it has no block for")
        for block in range(self.pool.num_blocks):
            if self.pool.ref_counts[block] != holders.get(block, 0):
                raise RuntimeError(
                    f"block {block}: ref count {self.pool.ref_counts[block]} but {holders.get(block, 0)} holders"
                )
