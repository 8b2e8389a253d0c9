"""ChunkIndex: where a chunk's K/V lies in the pool, found by the chunk's tokens, not its position (issue 39).

A prefix hit needs the prompt to equal a cached sequence from its first token. A chunk (a RAG document, a
tool result: a content part marked ``"scope": "chunk"``) comes back at other positions and after other
text. This index remembers, for each chunk the engine computed, the cached blocks that hold its K/V and the
position its first token had there. A later prompt that holds the same tokens anywhere reads that K/V,
turned to its new position (``kvreuse.attention.rope_shift``) and partly recomputed (the runner's blend).

What it holds and why:

- **No K/V of its own.** An entry points at prefix-index nodes (``CacheNode``): the blocks the first prompt
  cached anyway. So chunks live in the paged pool and leave it by the same LRU as every block; a hit touches
  its blocks. An entry whose blocks were evicted is dead and dropped when next looked at.
- **The key:** the chunk's tokens under the request's namespace, which already holds everything that decides
  a block's bytes (tenant salt, adapter, model file and weight format, draft). The pool has one KV dtype, so
  the dtype needs no place in an in-pool key. Positions are not in the key: that is the point.
- **Token-verified.** A key only finds a candidate: a hit compares the chunk's tokens with the entry's and
  with each source block's own tokens, and checks that no source block was evicted. A collision, or a block
  reused for something else, is a miss.
- **Only exact K/V is recorded:** blocks the prefix index caches under exact keys, computed in full. K/V produced
  by a blend (moved and partly recomputed) is cached under blend keys and never recorded, so a chunk is never
  copied from a copy.

The index is torch-free, as the rest of the cache core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvreuse.cache.hashing import block_key
from kvreuse.cache.prefix import CacheNode

CHUNK_KEY_TAG = b"kvreuse-chunk"  # keeps a chunk's key apart from the block keys of the same tokens

# Why a marked chunk of a prompt was computed rather than moved (issue 64; the debug log and the drift report):
ChunkMissReason = Literal["not_indexed", "evicted", "step_budget"]
CHUNK_MISS_REASONS: dict[str, str] = {
    "not_indexed": "not in the chunk index (never computed in full for this tenant, adapter and model, or first "
                   "seen after a moved chunk)",
    "evicted": "its source blocks were evicted since it was computed (a pool too small for the documents in "
               "rotation: --kv-cache-memory)",
    "step_budget": "a blend runs the rest of the prompt in one step, and that rest is over the step's budget "
                   "(--max-num-batched-tokens)",
}


@dataclass(frozen=True)
class ChunkSource:
    """A chunk's K/V as computed once: ``tokens`` at positions ``start``.., held by ``nodes`` (the cached
    blocks covering those positions, in order)."""

    tokens: tuple[int, ...]
    start: int
    nodes: tuple[CacheNode, ...]

    def slots(self, block_size: int, offset: int = 0, count: int | None = None) -> list[int]:
        """Pool slots of the chunk's tokens ``offset .. offset + count``."""
        end = len(self.tokens) if count is None else offset + count
        first_block = self.start // block_size
        slots = []
        for position in range(self.start + offset, self.start + end):
            node = self.nodes[position // block_size - first_block]
            slots.append(node.block_id * block_size + position % block_size)
        return slots

    def nodes_for(self, block_size: int, offset: int, count: int) -> tuple[CacheNode, ...]:
        """The source blocks that hold the chunk's tokens ``offset .. offset + count``."""
        first_block = self.start // block_size
        low = (self.start + offset) // block_size - first_block
        high = (self.start + offset + count - 1) // block_size - first_block
        return self.nodes[low:high + 1]

    def holds(self, tokens: Sequence[int], block_size: int) -> bool:
        """Whether this source still holds exactly ``tokens``: the same ids, every block alive and holding them."""
        if tuple(tokens) != self.tokens:
            return False
        first_block = self.start // block_size
        for index, node in enumerate(self.nodes):
            if node.evicted:
                return False
            block_start = (first_block + index) * block_size
            low, high = max(self.start, block_start), min(self.start + len(self.tokens), block_start + block_size)
            if node.tokens[low - block_start:high - block_start] != list(self.tokens[low - self.start:high - self.start]):
                return False
        return True


@dataclass(frozen=True)
class MovedSpan:
    """Prompt tokens ``[start, end)`` whose K/V is read from ``source_slots``, computed at positions
    ``source_start``..: a chunk hit ("chunk") or a turn's tokens moved earlier ("turn": a template dropped
    text before them). ``nodes`` are the source blocks, held until the step that moves them has run."""

    start: int
    end: int
    source_start: int
    source_slots: tuple[int, ...]
    nodes: tuple[CacheNode, ...]
    kind: Literal["chunk", "turn"] = "chunk"

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def delta(self) -> int:
        return self.start - self.source_start


def chunk_key(namespace: bytes, tokens: Sequence[int]) -> bytes:
    return block_key(block_key(namespace, ()) + CHUNK_KEY_TAG, tokens)


class ChunkIndex:
    """Chunk key -> the latest ``ChunkSource`` of those tokens in that namespace."""

    def __init__(self, block_size: int, max_entries: int = 65536) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self._entries: dict[bytes, ChunkSource] = {}
        self.num_recorded = 0
        self.num_hits = 0
        self.num_dead = 0  # lookups that found an entry whose blocks were evicted (or reused)

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, namespace: bytes, tokens: Sequence[int], start: int, nodes: Sequence[CacheNode]) -> None:
        """Remember that cached ``nodes`` hold ``tokens`` computed at positions ``start``.."""
        if not tokens:
            return
        source = ChunkSource(tuple(tokens), start, tuple(nodes))
        expected = (start + len(tokens) - 1) // self.block_size - start // self.block_size + 1
        if len(nodes) != expected or not source.holds(tokens, self.block_size):
            raise ValueError(f"a chunk of {len(tokens)} tokens at {start} needs {expected} cached blocks holding "
                             f"its tokens, got {len(nodes)}")
        if len(self._entries) >= self.max_entries:
            self.prune()
            if len(self._entries) >= self.max_entries:  # all alive: forget the oldest recorded
                del self._entries[next(iter(self._entries))]
        key = chunk_key(namespace, tokens)
        self._entries.pop(key, None)  # re-inserted last: the dict's order is the recording order
        self._entries[key] = source
        self.num_recorded += 1

    def lookup(self, namespace: bytes, tokens: Sequence[int]) -> ChunkSource | None:
        """The chunk's source, token-verified; None on a miss (a dead entry is dropped)."""
        return self.find(namespace, tokens)[0]

    def find(self, namespace: bytes, tokens: Sequence[int]) -> tuple[ChunkSource | None, ChunkMissReason | None]:
        """``lookup``, with the reason of a miss: no entry holds these tokens, or the one that did lost a block."""
        key = chunk_key(namespace, tokens)
        source = self._entries.get(key)
        if source is None:
            return None, "not_indexed"
        if not source.holds(tokens, self.block_size):
            if any(node.evicted for node in source.nodes):
                del self._entries[key]
                self.num_dead += 1
                return None, "evicted"
            return None, "not_indexed"  # a key collision: the entry holds other tokens
        self.num_hits += 1
        return source, None

    def prune(self) -> int:
        """Drop entries whose blocks were evicted; returns how many."""
        dead = [key for key, source in self._entries.items() if any(node.evicted for node in source.nodes)]
        for key in dead:
            del self._entries[key]
        return len(dead)

    def check_integrity(self) -> None:
        """Every entry whose blocks are all alive still holds its tokens there."""
        for source in self._entries.values():
            if all(not node.evicted for node in source.nodes) and not source.holds(source.tokens, self.block_size):
                raise RuntimeError(f"chunk at {source.start} of {len(source.tokens)} tokens: its blocks hold other tokens")
