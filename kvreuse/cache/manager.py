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
from kvreuse.cache.chunks import ChunkIndex, ChunkMissReason, ChunkSource, MovedSpan
from kvreuse.cache.events import KVEventLog
from kvreuse.cache.hashing import blend_key, block_key, extend_block_keys, state_key, state_keys
from kvreuse.cache.prefix import (
    EMPTY_MATCH,
    CacheNode,
    Divergence,
    PartialMatch,
    PrefixIndex,
    PrefixMatch,
)
from kvreuse.cache.state_slots import StateCopy, StateSlots
from kvreuse.cache.state_snapshots import Snapshot, SnapshotHit
from kvreuse.cache.tiers.store import BlockRef, StateFound, StateRef


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
    # Issue 39: the prompt's chunk spans, how many of them were looked at for recording, and where its K/V
    # stops being exact (from there on its blocks are cached under blend keys only; None: all exact).
    chunk_spans: tuple[tuple[int, int], ...]
    chunks_recorded: int
    exact_tokens: int | None
    chunk_misses: list[tuple[int, int, ChunkMissReason]]  # issue 64: chunk tokens admission left to compute, and why
    # Issue 66: a hybrid's state slot while it runs, its last snapshot lookup, and where its branch snapshot goes.
    state_slot: int | None
    state_hit: SnapshotHit | None
    branch_at: int | None
    state_marks: list[int]  # where its pinned prefixes end: a pin snapshot is kept at each
    tier_checked_state: int  # positions up to this one were already looked up for a state in the KV tiers

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


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
    moved_tokens: int = 0  # prompt tokens whose K/V was moved in from other positions (issue 39), not in hit_tokens
    chunk_entries: int = 0  # chunks the chunk index holds
    # A hybrid model's recurrent-state snapshots (issue 66; all 0 without recurrent state): how many, their bytes, the
    # budget (state_snapshot_fraction of the pool) and the idle running-request slots lent to them beyond it.
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0
    state_snapshot_budget_bytes: int = 0
    state_snapshot_lent_bytes: int = 0

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
    def store_state(self, ref: StateRef, slot: int, tail_block: int | None) -> None: ...
    def lookup_state(self, refs: Sequence[StateRef]) -> StateFound | None: ...


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None, chunk_reuse: bool = False, states: StateSlots | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.index = PrefixIndex(self.pool, block_size, events)
        self.index.on_evict = self._evicted
        self.index.on_root_removed = self._root_removed
        self.query_tokens = 0
        self.hit_tokens = 0
        self.moved_tokens = 0
        self._copies: list[BlockCopy] = []
        self._copy_sources: list[int] = []  # blocks held until their copy has run
        self._pending: Counter[bytes] = Counter()  # block keys running prefills will compute
        self._pending_of: dict[int, deque[bytes]] = {}  # id(request) -> its pending keys, in order
        # KV tiers behind the pool (None: the pool is all there is). Blocks computed since the engine
        # last took them, for the write-through tiers: (node, namespace).
        self.tiers: TierSource | None = None
        self._new_blocks: list[tuple[CacheNode, bytes]] = []
        # Reuse beyond the prefix (issue 39): marked chunks found at any position, and the tokens of an
        # earlier turn found moved earlier. Both need the prefix index (their sources are its blocks).
        self.chunk_reuse = chunk_reuse and enable_prefix_caching
        self.chunks = ChunkIndex(block_size)
        self.min_turn_tokens = 8  # a moved turn must match at least this many tokens
        self.max_turn_blocks = 512  # how far past the divergence a moved turn is looked for
        # A hybrid whose recurrent layers keep a state per sequence (Qwen3.5): the state pool's slots and snapshots.
        # A hit then resumes from the deepest snapshot at or before the blocks' match (cache/state_slots.py).
        self.states = states

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
        if self.states is not None:
            match = self._resume_point(request, match)
        return match

    def _resume_point(self, request: CacheSequence, match: PrefixMatch) -> PrefixMatch:
        """A hybrid with per-sequence state reuses the blocks only up to the deepest snapshot at or before their match:
        the tokens after it are recomputed (their K/V as well: the state must run through them; a block they fill is
        shared with the cached one again when it is cached). The lookup, with why fewer tokens are reused than
        matched, stays on the request."""
        assert self.states is not None
        root = self.index.roots.get(request.namespace)
        if root is None or match.num_tokens == 0:
            request.state_hit = None
            return EMPTY_MATCH
        hit = self.states.lookup(root, match.nodes, request.all_token_ids, match.num_tokens)
        if self.tiers is not None:
            match, hit = self._state_from_tiers(request, match, hit, root)
        request.state_hit = hit
        if hit.resume == match.num_tokens:
            return match
        full, rest = divmod(hit.resume, self.block_size)
        partial = None
        if rest:
            node = match.nodes[full] if full < len(match.nodes) else match.partial.node  # type: ignore[union-attr]
            partial = PartialMatch(node, rest)
        return PrefixMatch(match.nodes[:full], partial, hit.resume)

    def _state_from_tiers(self, request: CacheSequence, match: PrefixMatch, hit: SnapshotHit, root: CacheNode
                          ) -> tuple[PrefixMatch, SnapshotHit]:
        """A state deeper than the device's snapshot, from the KV tiers: every position past it up to one block past
        the full blocks matched is asked for at once (a state record carries its tail's K/V, which no block record
        holds), and the deepest verified one becomes a device snapshot; a tail past the match is cached as a tail
        block. Returns the match and the snapshot lookup again, the tier credited with the tokens it saved."""
        assert self.states is not None and self.tiers is not None
        size, tokens = self.block_size, request.all_token_ids
        upper = min(request.num_tokens - 1, (len(match.nodes) + 1) * size - 1)  # never the last token
        start = max(hit.resume, request.tier_checked_state, size - 1) + 1  # the tiers keep none in the first block
        if start > upper:
            return match, hit
        request.tier_checked_state = upper
        refs: list[StateRef] = []
        places: list[tuple[CacheNode, int, int]] = []  # (anchor, its end, tail length)
        for anchor_index in range(start // size, upper // size + 1):
            anchor, base = match.nodes[anchor_index - 1], anchor_index * size
            first, last = max(start, base) - base, min(upper, base + size - 1) - base
            keys = state_keys(anchor.key, tokens[base:base + last])
            for length in range(first, last + 1):
                refs.append(StateRef(keys[length], request.namespace, tokens[base:base + length]))
                places.append((anchor, base, length))
        found = self.tiers.lookup_state(refs)
        if found is None:
            return match, hit
        anchor, base, length = places[found.index]
        tail, position = tokens[base:base + length], base + length
        if self.states.snapshots.find(anchor, tail) is None and self.states.load(anchor, tail, found.state) is None:
            return match, hit  # no room in the snapshot budget
        if position > match.num_tokens:  # its tail's K/V is not on the device: cached from the record as a tail block
            assert found.tail_block is not None
            held = [node.block_id for node in match.nodes] + ([match.partial.node.block_id] if match.partial else [])
            for block in held:  # making room must not evict the chain the tail hangs under
                self.pool.acquire(block)
            if self._ensure_free(1):
                block = self.pool.allocate(1)[0]
                self.tiers.load([block], [found.tail_block])
                node = self.index.insert(request.namespace, anchor, block_key(anchor.key, tail), tail, block, tail=True)
                self.pool.release(block)
                self.index.release([node])
            for block in held:
                self.pool.release(block)
            self.index.release(list(match.nodes) + ([match.partial.node] if match.partial else []))
            match = self.index.match(request.namespace, tokens, request.block_keys, request.num_tokens - 1)
        resumed = self.states.lookup(root, match.nodes, tokens, match.num_tokens)
        if resumed.resume > hit.resume:
            request.tier_tokens[found.tier] = request.tier_tokens.get(found.tier, 0) + resumed.resume - hit.resume
        return match, resumed

    def _store_state(self, request: CacheSequence, snapshot: Snapshot | None, slot: int) -> None:
        """A snapshot kept from ``request``'s state in ``slot`` goes to the KV tiers with the block that holds its
        tail's K/V (read now: the request still holds that block, and the slot that state)."""
        if snapshot is None or self.tiers is None or snapshot.anchor.is_root:
            # A state within the first block stays on the device: a tier lookup starts past the first block (a new
            # request with no block cached would otherwise ask the tiers at every token of it).
            return
        tail_block = request.block_ids[snapshot.position // self.block_size] if snapshot.tail else None
        self.tiers.store_state(StateRef(state_key(snapshot.anchor.key, snapshot.tail), request.namespace,
                                        snapshot.tail), slot, tail_block)

    def take_state_copies(self) -> list[StateCopy]:
        """The state copies admissions and branch snapshots asked for, to run before the next forward (in order)."""
        return self.states.take_copies() if self.states is not None else []

    def branch_point(self, request: CacheSequence, match: PrefixMatch) -> int | None:
        """Where an admission with ``match`` keeps a branch snapshot: the blocks matched past the request's snapshot
        (another request's prefix went on elsewhere from there), and nobody kept the state at the divergence. Not
        within the first block: a shared start that short (a chat template's header) costs less to recompute than a
        state copy and a prefill chunk cut there."""
        hit = request.state_hit
        if self.states is None or hit is None or hit.matched <= match.num_tokens or hit.matched < self.block_size:
            return None
        return hit.matched

    def next_state_mark(self, request: CacheSequence, start: int) -> int | None:
        """The end of a prefix ``request`` pins past token ``start``, where a hybrid keeps its state (None: none)."""
        if self.states is None:
            return None
        return min((mark for mark in request.state_marks if mark > start), default=None)

    def step_limit(self, request: CacheSequence) -> int | None:
        """At most this many tokens of ``request`` this step (None: no limit): a branch snapshot's prefill chunk stops
        at the divergence, and a pinned prefix's at its end, so the state there can be kept."""
        computed = request.num_computed_tokens
        stops = [stop for stop in (request.branch_at, self.next_state_mark(request, computed))
                 if stop is not None and stop > computed]
        return min(stops) - computed if stops else None

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
        if self.states is not None:  # no hit can end past an evicted block: the snapshots anchored there go
            self.states.drop_node(node)

    def _root_removed(self, root: CacheNode) -> None:
        """The index dropped a namespace's empty root: the states within its first block go with it (no block)."""
        if self.states is not None:
            self.states.drop_node(root)

    def take_new_blocks(self) -> list[tuple[CacheNode, bytes]]:
        """Blocks computed (and cached) since the last call, with their namespace: for write-through."""
        blocks, self._new_blocks = self._new_blocks, []
        return blocks

    def divergence(self, request: CacheSequence, match: PrefixMatch) -> Divergence:
        return self.index.divergence(request.namespace, request.all_token_ids, match)

    # --- reuse beyond the prefix (issue 39) ---------------------------------------------------------
    def match_blended(self, request: CacheSequence, match: PrefixMatch) -> tuple[PrefixMatch, int]:
        """``match`` extended by the blended blocks an earlier blend cached after it, and how many of its tokens
        they hold.

        A blend's K/V from its first moved token on is approximate, so it is cached under keys of its own
        (``blend_key``): exact matching never reaches it, and only a request on an engine with chunk reuse on
        (which accepts blended K/V anyway) continues into it, token-verified, after its exact hit. That is what
        lets turn N+2 of an agent loop reuse turn N+1, whose own prompt was a blend. After its full blocks, a
        blended block's first tokens are a partial match as an exact one's are (copied); the exact partial match,
        if any, gives way to them."""
        if not self.chunk_reuse:
            return match, 0
        node = match.nodes[-1] if match.nodes else self.index.roots.get(request.namespace)
        if node is None:
            return match, 0
        size, tokens = self.block_size, request.all_token_ids
        nodes = list(match.nodes)
        for i in range(len(nodes), (request.num_tokens - 1) // size):
            block = tokens[i * size:(i + 1) * size]
            child = node.children.get(blend_key(node.key, block))
            if child is None or child.tokens != block:
                break
            nodes.append(child)
            node = child
        start = len(nodes) * size
        partial = self.index.best_partial(node, tokens, start, min(size, request.num_tokens - 1 - start), blended=True)
        if partial is not None and partial.num_tokens == 0:
            partial = None
        reached = start + (partial.num_tokens if partial is not None else 0)
        if reached <= match.num_tokens:
            return match, 0  # the exact match reaches as far
        # The tokens reused from blended blocks (the exact partial match, if any, gave way to them).
        return PrefixMatch(nodes, partial, reached), reached - match.num_blocks * size

    def match_moved(self, request: CacheSequence, match: PrefixMatch) -> list[MovedSpan]:
        """The prompt's tokens after ``match`` whose K/V the pool holds at other positions, in prompt order:
        first an earlier turn's tokens moved earlier (right after the prefix hit: a template that dropped a
        turn's thinking), then each marked chunk found in the chunk index. Never the last prompt token.
        ``request.chunk_misses`` is set to the marked chunks (or their rests) left to compute, and why.

        A hit may end inside a chunk: documents that begin alike ("Section: ...", "The ...") after the same
        text ("Document 1:") share their first tokens, so a prefix hit from another document runs a few tokens
        into this one (issue 64). The rest of that chunk is read from the chunk's source at the same offset, as
        is the rest of a chunk that a moved turn stops inside."""
        request.chunk_misses = []
        if not self.chunk_reuse:
            return []
        limit = request.num_tokens - 1
        tokens = request.all_token_ids
        spans: list[MovedSpan] = []
        covered = match.num_tokens
        # The chunk the hit ends inside, when the chunk index holds it, goes first: its source is K/V computed
        # in full, and a moved turn's may be a blend's.
        inside = next(((start, end) for start, end in request.chunk_spans if start < covered < end), None)
        found: dict[tuple[int, int], tuple[ChunkSource | None, ChunkMissReason | None]] = {}
        if inside is not None:
            found[inside] = self.chunks.find(request.namespace, tokens[inside[0]:inside[1]])
        if inside is None or found[inside][0] is None:
            # A moved turn stops where the next marked chunk begins: chunks are looked up by their own spans.
            next_chunk = min((start for start, _ in request.chunk_spans if start >= covered), default=limit)
            turn = self._moved_turn(request, match, min(limit, next_chunk))
            if turn is not None:
                spans.append(turn)
                covered = turn.end
        for start, end in request.chunk_spans:
            if end <= covered or start >= limit:
                continue
            offset = max(0, covered - start)  # its first tokens, when the hit or a moved turn holds them
            count = min(end, limit) - start - offset
            if count <= 0:
                continue
            source, reason = found.get((start, end)) or self.chunks.find(request.namespace, tokens[start:end])
            if source is None:
                assert reason is not None
                request.chunk_misses.append((start + offset, start + offset + count, reason))
                continue
            spans.append(MovedSpan(start + offset, start + offset + count, source.start + offset,
                                   tuple(source.slots(self.block_size, offset, count)),
                                   source.nodes_for(self.block_size, offset, count), "chunk"))
            covered = end
        return spans

    def _moved_turn(self, request: CacheSequence, match: PrefixMatch, limit: int) -> MovedSpan | None:
        """The prompt's tokens right after the prefix hit, found further along a cached sequence the hit
        followed (its continuations tried most recently used first): what a template leaves when it drops the text between
        (a reasoning turn's thinking). At least ``min_turn_tokens`` must match; the match runs as far as the
        tokens agree."""
        start = match.num_tokens
        want = request.all_token_ids
        width = self.min_turn_tokens
        if limit - start < width:
            return None
        size = self.block_size
        parent = match.nodes[-1] if match.nodes else self.index.roots.get(request.namespace)
        # Every cached block that agrees with the partial hit, most recently used first: the index's partial match
        # is only one of them, and may be a dead end (a prompt-only tail an earlier request left ties with the block
        # that goes on into the turn, and a request that copies that tail makes it the most recently used).
        base = (start // size) * size  # the position of the chain's first token
        agreeing = sorted((child for child in parent.children.values() if child.tokens[:start - base] == want[base:start]),
                          key=lambda child: child.last_access, reverse=True) if parent is not None else []
        probe = want[start:start + width]
        first = probe[0]
        for node in agreeing:
            chain: list[CacheNode] = []
            while node is not None and len(chain) < self.max_turn_blocks:
                chain.append(node)
                node = max(node.children.values(), key=lambda child: child.last_access) if node.children else None
            held = [token for node in chain for token in node.tokens]
            for offset in range(start - base + 1, len(held) - width + 1):
                if held[offset] != first or held[offset:offset + width] != probe:
                    continue
                count = width
                while (start + count < limit and offset + count < len(held)
                       and held[offset + count] == want[start + count]):
                    count += 1
                first_block, last_block = offset // size, (offset + count - 1) // size
                slots = tuple(chain[(offset + i) // size].block_id * size + (offset + i) % size for i in range(count))
                return MovedSpan(start, start + count, base + offset, slots, tuple(chain[first_block:last_block + 1]),
                                 "turn")
        return None

    def _record_chunks(self, request: CacheSequence) -> None:
        """Put the request's chunks whose blocks are now cached (and exact) in the chunk index."""
        size = self.block_size
        nodes = request.cached_nodes
        covered = (len(nodes) - 1) * size + len(nodes[-1].tokens) if nodes else 0  # the last may be a tail
        spans = request.chunk_spans
        while request.chunks_recorded < len(spans):
            start, end = spans[request.chunks_recorded]
            if request.exact_tokens is not None and end > request.exact_tokens:
                request.chunks_recorded = len(spans)  # from here on its K/V is a blend's: never a source
                return
            if end > covered:
                return  # its last block is not cached yet
            nodes = request.cached_nodes[start // size:(end - 1) // size + 1]
            self.chunks.record(request.namespace, request.all_token_ids[start:end], start, nodes)
            request.chunks_recorded += 1

    def is_current(self, match: PrefixMatch) -> bool:
        """Every block of ``match`` is still cached (none was evicted since the match was taken)."""
        return not any(node.evicted for node in match.nodes) and not (
            match.partial is not None and match.partial.node.evicted)

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

    def admit(self, request: CacheSequence, match: PrefixMatch, num_new_tokens: int,
              moved: Sequence[MovedSpan] = ()) -> bool:
        """Give a waiting request its matched blocks plus room for ``num_new_tokens``. ``moved``: spans whose
        K/V this step reads from other blocks (``match_moved``); their sources are held until the step ran,
        and the request's K/V from the first of them on is cached under blend keys only (it is a blend, not exact).

        On failure nothing changes (apart from idle leaves evicted on the way) and False is returned.
        """
        assert not request.block_ids, "admit() is for requests that hold no blocks"
        # Hold what we reuse first, so making room cannot evict it.
        sources = [node for span in moved for node in span.nodes]
        held = list(match.nodes) + ([match.partial.node] if match.partial is not None else []) + sources
        for node in held:
            self.pool.acquire(node.block_id)
        partial = match.partial
        num_needed = self.blocks_for(match.num_tokens + num_new_tokens) - match.num_blocks
        if not self._ensure_free(num_needed):
            for node in held:
                self.pool.release(node.block_id)
            self.index.release(held)
            return False
        new_blocks = self.pool.allocate(num_needed)
        request.block_ids = [node.block_id for node in match.nodes] + new_blocks
        request.cached_nodes = list(match.nodes)
        if partial is not None:
            self._copies.append(BlockCopy(partial.node.block_id, new_blocks[0], partial.num_tokens))
            self._copy_sources.append(partial.node.block_id)
        self._copy_sources.extend(node.block_id for node in sources)
        self.index.touch(list(match.nodes) + sources)
        request.num_computed_tokens = match.num_tokens
        # Where its K/V stops being exact: the first blended block it reuses, or the first moved token.
        inexact = [span.start for span in moved]
        blended = [i for i, node in enumerate(match.nodes) if node.blended]
        if blended:
            inexact.append(blended[0] * self.block_size)
        request.exact_tokens = min(inexact) if inexact else None
        self.query_tokens += request.num_tokens
        inexact_hit = sum(self.block_size for node in match.nodes if node.blended)
        if partial is not None and partial.node.blended:
            inexact_hit += partial.num_tokens
        self.hit_tokens += match.num_tokens - inexact_hit  # exact hits; blended ones count with the moved tokens
        self.moved_tokens += inexact_hit + sum(span.num_tokens for span in moved)
        if self.enable_prefix_caching:
            exact_blocks = (len(request.block_keys) if request.exact_tokens is None
                            else request.exact_tokens // self.block_size)
            keys = deque(request.block_keys[match.num_blocks:exact_blocks])
            self._pending_of[id(request)] = keys
            self._pending.update(keys)
        if self.states is not None:
            hit = request.state_hit if match.num_tokens else None
            request.state_slot = self.states.start(hit.snapshot if hit is not None else None)
            # Matched past its snapshot (another request's prefix continued elsewhere): keep the state where it leaves
            # the cached path, so the next request on this branch resumes there.
            request.branch_at = self.branch_point(request, match)
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
        computed = request.num_computed_tokens
        num_full = min(computed // self.block_size, len(request.block_keys))
        # A blend's K/V from its first inexact block on is cached under blend keys (match_blended).
        exact_blocks = num_full if request.exact_tokens is None else min(num_full, request.exact_tokens // self.block_size)
        size = self.block_size
        pending = self._pending_of.get(id(request))
        for i in range(len(request.cached_nodes), num_full):
            parent = request.cached_nodes[-1] if request.cached_nodes else None
            own_block = request.block_ids[i]
            blended = i >= exact_blocks
            if blended:
                parent_key = parent.key if parent is not None else request.namespace
                key = blend_key(parent_key, request.all_token_ids[i * size:(i + 1) * size])
            else:
                key = request.block_keys[i]
            node = self.index.insert(
                request.namespace, parent, key, request.all_token_ids[i * size : (i + 1) * size], own_block,
                blended=blended,
            )
            if node.block_id != own_block:
                # Another request cached the same block first: share its block, free ours.
                self.pool.acquire(node.block_id)
                self.pool.release(own_block)
                request.block_ids[i] = node.block_id
            elif self.tiers is not None and not blended:
                self._new_blocks.append((node, request.namespace))
            request.cached_nodes.append(node)
            if pending and pending[0] == key:
                pending.popleft()
                self._drop_pending(key)
        if self.chunk_reuse and request.chunk_spans:
            self._record_chunks(request)
        if self.states is not None and request.state_slot is not None:
            # A hybrid's state copied where it will be resumed from: where the request left a cached path (a branch),
            # where a prefix it pins ends (kept while the pin holds), and where its prompt ends (the next turn resumes
            # there when it matches the prompt but not the answer's tokens).
            for reason, due in (("branch", computed == request.branch_at), ("pin", computed in request.state_marks),
                                ("prompt", computed == request.num_prompt_tokens)):
                anchor, tail = self._snapshot_place(request, computed) if due else (None, [])
                if anchor is not None:
                    self._store_state(request, self.states.branch(anchor, tail, request.state_slot, reason),
                                      request.state_slot)
            if computed == request.branch_at:
                request.branch_at = None

    def _snapshot_place(self, request: CacheSequence, position: int) -> tuple[CacheNode | None, list[int]]:
        """Where a snapshot of ``request``'s state after ``position`` tokens is anchored: the cached node of the last
        full block before it, or within the first block its namespace's root, and the tokens after that block (None:
        that block is not cached as exact K/V, or no block of the namespace is cached, so it has no root yet)."""
        full = position // self.block_size
        if position == 0 or len(request.cached_nodes) < full or (
                request.exact_tokens is not None and request.exact_tokens < position):
            return None, []
        anchor = request.cached_nodes[full - 1] if full else self.index.roots.get(request.namespace)
        return anchor, request.all_token_ids[full * self.block_size:position]

    def _cache_tail(self, request: CacheSequence) -> None:
        size = self.block_size
        num_full, tail_len = divmod(request.num_computed_tokens, size)
        if (not self.enable_prefix_caching or tail_len == 0 or len(request.cached_nodes) != num_full
                or len(request.block_ids) <= num_full or request.exact_tokens is not None):
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
        self._cache_tail(request)  # first: a state within the first block hangs on the root its tail may make
        if self.states is not None and request.state_slot is not None:
            # Its state at its last computed token stays as a snapshot there (the next turn resumes at it).
            anchor, tail = (self._snapshot_place(request, request.num_computed_tokens) if self.enable_prefix_caching
                            else (None, []))
            if anchor is not None:
                self._store_state(request, self.states.keep(anchor, tail, request.state_slot, "finish"),
                                  request.state_slot)
            else:
                self.states.release(request.state_slot)
            request.state_slot = None
            request.branch_at = None
        if self.chunk_reuse and request.chunk_spans:  # a chunk that ends in the tail is complete now
            self._record_chunks(request)
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
                return total  # the snapshots went with their anchors (_evicted)

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
            moved_tokens=self.moved_tokens,
            chunk_entries=len(self.chunks),
            evicted_blocks=self.index.num_evicted_blocks,
            cached_blocks=self.index.num_cached_blocks,
            **({} if self.states is None else {
                "state_snapshots": len(self.states.snapshots),
                "state_snapshot_bytes": self.states.snapshots.num_bytes,
                "state_snapshot_budget_bytes": self.states.snapshots.budget_bytes,
                "state_snapshot_lent_bytes": self.states.snapshots.lent_bytes}),
        )

    def check_integrity(self, requests: Iterable[CacheSequence]) -> None:
        """Every block accounted for: ref counts equal the holders, nodes match block tables."""
        self.pool.check_integrity()
        self.index.check_integrity()
        self.chunks.check_integrity()
        requests = list(requests)
        if self.states is not None:
            self.states.check_integrity(request.state_slot for request in requests if request.state_slot is not None)
            for snapshot in self.states.snapshots.snapshots():
                anchor = snapshot.anchor
                if anchor.is_root and self.index.roots.get(anchor.key) is not anchor:
                    raise RuntimeError("a state within the first block hangs on a namespace root the index dropped")
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
