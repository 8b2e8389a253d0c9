"""PrefixIndex: a radix tree over full KV blocks, one root per cache namespace.

Each node is one full block: its chained key, its tokens and the block id holding its KV. A path
from a root spells a token sequence whose KV is cached. Operations:

- ``match``: longest cached prefix of a request, verified token by token, plus the longest partial
  match inside the next block (token-granular reuse: the caller copies those tokens' KV);
- ``insert``: record a newly computed full block under its parent;
- ``evict``: give up idle leaves, least recently used first, so a chain never loses its head before
  its tail; pinned nodes are never evicted;
- ``pin`` / ``unpin``: keep a chain regardless of LRU (explicit caching builds on this).

Ref counts live in the BlockPool: a node is evictable when its block has no user, it has no
children and it is not pinned. The LRU is a heap of candidate leaves with lazy invalidation: a
stale entry (node touched again, gone, or grown children) is skipped when popped.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvreuse.cache.blocks import BlockPool
from kvreuse.cache.events import KVEventLog


@dataclass(eq=False)
class CacheNode:
    key: bytes
    tokens: list[int]  # never mutated; a list because comparing it with a slice is fastest
    block_id: int  # -1 for a namespace root
    parent: CacheNode | None
    depth: int  # blocks from the root; the root is 0
    children: dict[bytes, CacheNode] = field(default_factory=dict)
    # Children grouped by their first token, so a partial match looks only at plausible siblings.
    children_by_first_token: dict[int, list[CacheNode]] = field(default_factory=dict)
    last_access: int = 0
    pin_count: int = 0
    evicted: bool = False
    # Blended K/V (issue 39): keyed under its own chain (``blend_key``), so exact matching never reaches it; no
    # KV event, no tier copy (their readers look blocks up by exact keys).
    blended: bool = False

    @property
    def is_root(self) -> bool:
        return self.parent is None


class PartialMatch(NamedTuple):
    """The first ``num_tokens`` tokens of ``node``'s block equal the request's next tokens."""

    node: CacheNode
    num_tokens: int


class PrefixMatch(NamedTuple):
    nodes: list[CacheNode]  # fully matched blocks, in order
    partial: PartialMatch | None
    num_tokens: int  # tokens reused: len(nodes) * block_size + partial tokens

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)


class Divergence(NamedTuple):
    """Where a prompt stopped matching the cache, for miss explanations."""

    position: int  # first token position not served from the cache
    cached_token: int | None  # what the cache held at that position (None: nothing cached there)


EMPTY_MATCH = PrefixMatch([], None, 0)


class PrefixIndex:
    def __init__(self, pool: BlockPool, block_size: int, events: KVEventLog | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.events = events  # told of every block stored and removed (for routers); None: nobody listens
        # Called with each node eviction is about to remove, while its block's KV is still intact
        # (the host tier keeps a copy); None: nobody listens.
        self.on_evict: Callable[[CacheNode], None] | None = None
        # An empty namespace root is dropped (a new one is made when a block is cached there again): what hangs on it
        # outside the tree (a hybrid's states within the first block) goes with it.
        self.on_root_removed: Callable[[CacheNode], None] | None = None
        self.roots: dict[bytes, CacheNode] = {}
        self.num_cached_blocks = 0
        self.num_evicted_blocks = 0
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, CacheNode]] = []
        self._tiebreak = itertools.count()
        self._node_of_block: dict[int, CacheNode] = {}

    # --- lookup -----------------------------------------------------------------------------------
    def node_of_block(self, block_id: int) -> CacheNode | None:
        return self._node_of_block.get(block_id)

    def match(
        self, namespace: bytes, token_ids: Sequence[int], block_keys: Sequence[bytes], max_tokens: int
    ) -> PrefixMatch:
        """Longest cached prefix of ``token_ids`` covering at most ``max_tokens`` tokens.

        ``block_keys`` are the chained keys of the full blocks of ``token_ids`` (computed once per
        request). The caller passes ``max_tokens = len(prompt) - 1`` so the last prompt token is
        always computed (its logits are needed).
        """
        node = self.roots.get(namespace)
        if node is None or max_tokens <= 0:
            return EMPTY_MATCH
        size = self.block_size
        nodes: list[CacheNode] = []
        for i in range(min(max_tokens // size, len(block_keys))):
            child = node.children.get(block_keys[i])
            if child is None or child.tokens != token_ids[i * size : (i + 1) * size]:
                break
            nodes.append(child)
            node = child
        start = len(nodes) * size
        partial = self.best_partial(node, token_ids, start, min(size, max_tokens - start))
        return PrefixMatch(nodes, partial, start + (partial.num_tokens if partial else 0))

    def best_partial(
        self, node: CacheNode, token_ids: Sequence[int], start: int, limit: int, blended: bool = False
    ) -> PartialMatch | None:
        """The child of ``node`` whose block agrees longest with ``token_ids[start:]`` (at most ``limit`` tokens),
        among its exact children (``blended``: among its blended ones; an exact match never copies blended K/V)."""
        if limit <= 0 or start >= len(token_ids):
            return None
        best: PartialMatch | None = None
        for child in node.children_by_first_token.get(token_ids[start], ()):
            if child.blended != blended:
                continue
            common = 0
            for cached, wanted in zip(child.tokens[:limit], token_ids[start : start + limit]):
                if cached != wanted:
                    break
                common += 1
            if best is None or common > best.num_tokens:
                best = PartialMatch(child, common)
        return best

    def divergence(self, namespace: bytes, token_ids: Sequence[int], match: PrefixMatch) -> Divergence:
        """Explain a miss: the position after the match and what the cache held there, if anything."""
        position = match.num_tokens
        if match.partial is not None:
            tokens = match.partial.node.tokens
            held = tokens[match.partial.num_tokens] if match.partial.num_tokens < len(tokens) else None
            return Divergence(position, held)
        parent = match.nodes[-1] if match.nodes else self.roots.get(namespace)
        if parent is None or not parent.children:
            return Divergence(position, None)
        # Several continuations may be cached; report the most recently used one.
        latest = max(parent.children.values(), key=lambda child: child.last_access)
        return Divergence(position, latest.tokens[0])

    # --- updates ----------------------------------------------------------------------------------
    def touch(self, nodes: Sequence[CacheNode]) -> None:
        """Mark nodes as just used; idle leaves among them get a fresh place in the LRU."""
        now = next(self._clock)
        for node in nodes:
            node.last_access = now
            self._maybe_push_candidate(node)

    def insert(self, namespace: bytes, parent: CacheNode | None, key: bytes, tokens: Sequence[int], block_id: int,
               tail: bool = False, blended: bool = False) -> CacheNode:
        """Cache ``block_id`` as the child ``key`` of ``parent`` (None: the namespace root).

        If that child already exists (another request computed the same block), the existing node
        is returned and ``block_id`` stays uncached: the caller should switch to the existing block.

        ``tail``: the last, partly filled block of a sequence that ended (1 .. block_size - 1 tokens). It
        is a leaf for good (only full blocks have children), serves as a partial match (its tokens are
        copied, as any partial hit's), and stays in this pool: no KV event and no tier record, whose
        readers know full blocks only.
        """
        if parent is None:
            parent = self.roots.get(namespace)
            if parent is None:
                parent = CacheNode(key=namespace, tokens=[], block_id=-1, parent=None, depth=0)
                self.roots[namespace] = parent
        if parent.evicted:
            raise RuntimeError("insert under an evicted node: the caller must hold its chain")
        existing = parent.children.get(key)
        if existing is not None:
            if existing.tokens != list(tokens):
                raise RuntimeError("block key collision with different tokens")
            return existing
        if not (0 < len(tokens) < self.block_size if tail else len(tokens) == self.block_size):
            raise ValueError(f"a cached block holds {self.block_size} tokens (a tail 1..{self.block_size - 1}), "
                             f"got {len(tokens)}")
        node = CacheNode(
            key=key, tokens=list(tokens), block_id=block_id, parent=parent, depth=parent.depth + 1,
            last_access=next(self._clock), blended=blended,
        )
        parent.children[key] = node
        parent.children_by_first_token.setdefault(node.tokens[0], []).append(node)
        self.pool.mark_cached(block_id)
        self._node_of_block[block_id] = node
        self.num_cached_blocks += 1
        self._maybe_push_candidate(node)
        if self.events is not None and not tail and not blended:
            self.events.stored(key, None if parent.is_root else parent.key, node.tokens)  # shared, never mutated
        return node

    def release(self, nodes: Sequence[CacheNode]) -> None:
        """Called after the pool released these nodes' blocks: idle leaves become LRU candidates."""
        self.touch(nodes)

    # --- pins -------------------------------------------------------------------------------------
    def pin(self, nodes: Sequence[CacheNode]) -> None:
        for node in nodes:
            if node.evicted:
                raise RuntimeError("cannot pin an evicted node")
            node.pin_count += 1

    def unpin(self, nodes: Sequence[CacheNode]) -> None:
        for node in nodes:
            if node.pin_count <= 0:
                raise RuntimeError("unpin of a node that is not pinned")
            node.pin_count -= 1
        self.touch(nodes)

    # --- eviction ---------------------------------------------------------------------------------
    def is_evictable(self, node: CacheNode) -> bool:
        return (
            not node.evicted
            and not node.is_root
            and not node.children
            and node.pin_count == 0
            and self.pool.ref_counts[node.block_id] == 0
        )

    def _maybe_push_candidate(self, node: CacheNode) -> None:
        if self.is_evictable(node):
            heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` idle leaves, least recently used first; returns how many."""
        freed = 0
        while freed < num_blocks and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if stamp != node.last_access or not self.is_evictable(node):
                continue  # stale entry
            if self.on_evict is not None and len(node.tokens) == self.block_size and not node.blended:  # tails stay
                self.on_evict(node)
            self._remove(node)
            freed += 1
        if len(self._heap) > 2 * self.num_cached_blocks + 1024:
            self._rebuild_heap()
        return freed

    def _remove(self, node: CacheNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        siblings = parent.children_by_first_token[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del parent.children_by_first_token[node.tokens[0]]
        node.evicted = True
        del self._node_of_block[node.block_id]
        self.pool.mark_evicted(node.block_id)
        self.num_cached_blocks -= 1
        self.num_evicted_blocks += 1
        if self.events is not None and len(node.tokens) == self.block_size and not node.blended:
            self.events.removed(node.key)
        if parent.is_root:
            if not parent.children:
                del self.roots[parent.key]
                if self.on_root_removed is not None:
                    self.on_root_removed(parent)
        else:
            self._maybe_push_candidate(parent)

    def _rebuild_heap(self) -> None:
        self._heap = [
            (node.last_access, next(self._tiebreak), node) for node in self.iter_nodes() if self.is_evictable(node)
        ]
        heapq.heapify(self._heap)

    def iter_nodes(self):
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # --- checks -----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        seen_blocks: set[int] = set()
        count = 0
        for root in self.roots.values():
            if not root.children:
                raise RuntimeError("an empty namespace root was kept")
        for node in self.iter_nodes():
            count += 1
            if node.evicted:
                raise RuntimeError("an evicted node is still in the tree")
            if node.block_id in seen_blocks:
                raise RuntimeError(f"block {node.block_id} is owned by two nodes")
            seen_blocks.add(node.block_id)
            if not self.pool.cached[node.block_id]:
                raise RuntimeError(f"node block {node.block_id} is not marked cached in the pool")
            if self._node_of_block.get(node.block_id) is not node:
                raise RuntimeError(f"block map disagrees for block {node.block_id}")
            assert node.parent is not None
            if node.parent.children.get(node.key) is not node:
                raise RuntimeError("parent does not list its child")
            if node not in node.parent.children_by_first_token.get(node.tokens[0], ()):
                raise RuntimeError("first-token index misses a child")
            if node.depth != node.parent.depth + 1 or not 0 < len(node.tokens) <= self.block_size:
                raise RuntimeError("bad depth or block length")
            if len(node.tokens) < self.block_size and node.children:
                raise RuntimeError("a tail (partly filled block) has children")
            if node.pin_count < 0:
                raise RuntimeError("negative pin count")
            # A chain never loses its head before its tail: a used block's ancestors are present.
            if self.pool.ref_counts[node.block_id] and node.parent.evicted:
                raise RuntimeError("a used block hangs under an evicted parent")
        if count != self.num_cached_blocks:
            raise RuntimeError(f"index counts {self.num_cached_blocks} blocks, tree holds {count}")
        cached_in_pool = sum(self.pool.cached)
        if cached_in_pool != count:
            raise RuntimeError(f"pool marks {cached_in_pool} blocks cached, index holds {count}")
