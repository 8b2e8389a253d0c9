"""BlockPool: which KV blocks exist, who uses them, which are empty.

A block is exactly one of:
  free   - no content, on the free list, ref count 0;
  idle   - holds content that the prefix index knows (``cached``), ref count 0, evictable;
  in use - ref count > 0 (held by running requests, or by a pending block copy).
free + idle + in use == num_blocks always. The pool knows nothing about tokens or hashes; the prefix
index tells it which blocks are cached, and eviction (which idle block to give up) is the index's
decision because only it knows which blocks are leaves.
Plain Python, no torch: cheap to test exhaustively.
"""

from __future__ import annotations

from typing import NamedTuple


class BlockCopy(NamedTuple):
    """Copy the KV of the first ``num_tokens`` slots of ``src_block`` into ``dst_block``.

    This is how a prefix hit that ends inside a cached block is reused token by token: the shared
    block cannot be written by the new request, so the matching tokens are copied into its own block.
    """

    src_block: int
    dst_block: int
    num_tokens: int


class BlockPoolError(RuntimeError):
    """An internal bookkeeping error: a double free, a release of an unused block, etc."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cached = [False] * num_blocks
        # A stack: which empty block is handed out next does not matter, O(1) both ways.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks
        self.num_in_use = 0

    # --- counts -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_idle(self) -> int:
        return self.num_blocks - self.num_free - self.num_in_use

    def usage(self) -> float:
        """Fraction of blocks held by requests (idle cached blocks count as reclaimable)."""
        return self.num_in_use / self.num_blocks

    # --- transitions --------------------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """Take ``count`` empty blocks, each with ref count 1."""
        if count > len(self._free):
            raise BlockPoolError(f"asked for {count} blocks but only {len(self._free)} are free")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._is_free[block] = False
            self.ref_counts[block] = 1
        self.num_in_use += count
        return blocks

    def acquire(self, block: int) -> None:
        """Add a user to a block that has content (in use or idle cached)."""
        if self._is_free[block]:
            raise BlockPoolError(f"block {block} is free; it has no content to share")
        if self.ref_counts[block] == 0:
            self.num_in_use += 1
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """Drop a user. An uncached block with no user goes back to the free list."""
        if self.ref_counts[block] <= 0:
            raise BlockPoolError(f"block {block} released with ref count {self.ref_counts[block]}")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.num_in_use -= 1
            if not self.cached[block]:
                self._push_free(block)

    def mark_cached(self, block: int) -> None:
        if self._is_free[block] or self.cached[block]:
            raise BlockPoolError(f"block {block} cannot be cached (free={self._is_free[block]})")
        self.cached[block] = True

    def mark_evicted(self, block: int) -> None:
        """The index forgot this block's content; an unused block becomes free."""
        if not self.cached[block]:
            raise BlockPoolError(f"block {block} is not cached")
        self.cached[block] = False
        if self.ref_counts[block] == 0:
            self._push_free(block)

    def _push_free(self, block: int) -> None:
        if self._is_free[block]:
            raise BlockPoolError(f"block {block} freed twice")
        self._is_free[block] = True
        self._free.append(block)

    # --- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise BlockPoolError("a block is on the free list twice")
        in_use = idle = 0
        for block in range(self.num_blocks):
            is_free = block in free_set
            if is_free != self._is_free[block]:
                raise BlockPoolError(f"block {block}: free flag disagrees with the free list")
            ref = self.ref_counts[block]
            if ref < 0:
                raise BlockPoolError(f"block {block} has negative ref count {ref}")
            if is_free and (ref or self.cached[block]):
                raise BlockPoolError(f"free block {block} has ref {ref} / cached {self.cached[block]}")
            if not is_free and ref == 0 and not self.cached[block]:
                raise BlockPoolError(f"block {block} is lost: not free, not cached, no user")
            in_use += ref > 0
            idle += (ref == 0 and self.cached[block])
        if in_use != self.num_in_use:
            raise BlockPoolError(f"in-use counter {self.num_in_use} != actual {in_use}")
        if len(free_set) + idle + in_use != self.num_blocks:
            raise BlockPoolError("free + idle + in use != total")
