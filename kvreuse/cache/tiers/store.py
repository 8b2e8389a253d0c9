"""TieredStore: the tiers behind the device pool, walked in order, with verified reads.

- lookup: for a request's next full blocks (after what the device pool holds), find the longest
  contiguous run in host, then disk, then remote; every record is decoded against the block's
  expected key, tokens, fingerprint and layout (``record.decode``), and a record that fails is a
  miss, counted by tier and reason, and dropped from its tier.
- store: disk and remote are written through as blocks are computed, by one background thread (off
  the engine step); ``flush`` waits for what is queued (a clean exit calls it). The host tier is
  filled with blocks the device pool evicts.

Plain Python, no torch: payloads are bytes; the engine turns them into tensors.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvreuse.cache.tiers import record
from kvreuse.cache.tiers.record import BlockLayout, RecordMismatch

TIER_ORDER = ("host", "disk", "remote")


class Tier(Protocol):
    name: str

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...
    def put(self, key: bytes, record: bytes) -> bool: ...
    def delete(self, key: bytes) -> None: ...
    def clear(self) -> int: ...


@dataclass
class TierStats:
    queries: int = 0  # blocks looked up in this tier
    hits: int = 0  # blocks served from it
    hit_bytes: int = 0
    stores: int = 0  # blocks written to it
    store_bytes: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    verify_failures: Counter[str] = field(default_factory=Counter)  # reason -> count

    def as_dict(self) -> dict[str, Any]:
        return {"queries": self.queries, "hits": self.hits, "hit_bytes": self.hit_bytes, "stores": self.stores,
                "store_bytes": self.store_bytes, "load_seconds": self.load_seconds,
                "store_seconds": self.store_seconds, "verify_failures": dict(self.verify_failures)}


@dataclass(frozen=True)
class BlockRef:
    """A block a lookup asks for: its key, namespace and token ids."""

    key: bytes
    namespace: bytes
    tokens: Sequence[int]


class TieredStore:
    def __init__(self, fingerprint: str, layout: BlockLayout, tiers: Sequence[Tier]) -> None:
        self.fingerprint = fingerprint
        self.layout = layout
        self.tiers = sorted(tiers, key=lambda tier: TIER_ORDER.index(tier.name))
        self.stats = {tier.name: TierStats() for tier in self.tiers}
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._write_through = [tier for tier in self.tiers if tier.name != "host"]
        self._lock = threading.Lock()  # stats are updated by the writer thread too

    def tier(self, name: str) -> Tier | None:
        return next((tier for tier in self.tiers if tier.name == name), None)

    # --- reads --------------------------------------------------------------------------------------
    def lookup(self, blocks: Sequence[BlockRef]) -> list[tuple[str, memoryview]]:
        """(tier, payload) for the longest contiguous run of ``blocks`` found in the tiers, in order."""
        found: list[tuple[str, memoryview]] = []
        remaining = list(blocks)
        for tier in self.tiers:
            if not remaining:
                break
            started = time.perf_counter()
            records = tier.get_many([block.key for block in remaining])
            elapsed = time.perf_counter() - started
            run = 0
            for block, data in zip(remaining, records):
                if data is None:
                    break
                try:
                    payload = record.decode(data, self.fingerprint, block.key, block.tokens, self.layout)
                except RecordMismatch as mismatch:
                    with self._lock:
                        self.stats[tier.name].verify_failures[mismatch.reason] += 1
                    tier.delete(block.key)
                    break
                found.append((tier.name, payload))
                run += 1
            with self._lock:
                stats = self.stats[tier.name]
                stats.queries += run + (1 if run < len(remaining) else 0)
                stats.hits += run
                stats.hit_bytes += run * self.layout.num_bytes
                stats.load_seconds += elapsed
            remaining = remaining[run:]  # a later tier may continue the run where this one stopped
        return found

    # --- writes -------------------------------------------------------------------------------------
    def store(self, block: BlockRef, payload: bytes) -> None:
        """Queue a computed block for the write-through tiers (disk, remote)."""
        if not self._write_through:
            return
        data = record.encode(self.fingerprint, block.key, block.namespace, block.tokens, self.layout, payload)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kvreuse-tier-writer", daemon=True)
            self._writer.start()
            # The writer is a daemon (it must never keep a process alive); a normal exit waits for it.
            atexit.register(self.flush)
        self._queue.put((block.key, data))

    def evicted(self, block: BlockRef, payload: bytes) -> None:
        """A block the device pool gave up: keep it in the host tier (if there is one)."""
        host = self.tier("host")
        if host is None:
            return
        data = record.encode(self.fingerprint, block.key, block.namespace, block.tokens, self.layout, payload)
        if host.put(block.key, data):
            with self._lock:
                self.stats["host"].stores += 1
                self.stats["host"].store_bytes += len(data)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, data = item
                for tier in self._write_through:
                    started = time.perf_counter()
                    try:
                        stored = tier.put(key, data)
                    except OSError:
                        stored = False  # a full or read-only disk: the block is simply not stored there
                    if not stored:
                        continue
                    with self._lock:
                        stats = self.stats[tier.name]
                        stats.stores += 1
                        stats.store_bytes += len(data)
                        stats.store_seconds += time.perf_counter() - started
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write has reached its tiers (also run at interpreter exit)."""
        if self._writer is not None:
            self._queue.join()

    def clear(self, names: Sequence[str]) -> dict[str, int]:
        self.flush()
        return {tier.name: tier.clear() for tier in self.tiers if tier.name in names}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: stats.as_dict() for name, stats in self.stats.items()}
