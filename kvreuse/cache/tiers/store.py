"""TieredStore: the tiers behind the device pool, walked in order, with verified reads.

- lookup: for a request's next full blocks (after what the device pool holds), find the longest
  contiguous run in host, then disk, then remote; every record is decoded against the block's
  expected key, tokens, fingerprint and layout (``record.decode``), and a record that fails is a
  miss, counted by tier and reason, and dropped from its tier.
- store: disk and remote are written through as blocks are computed, by one background thread (off
  the engine step). Its queue holds at most ``max_queue_bytes`` of records: a block that does not fit
  is not written (counted in ``write_drops``; it is still in the device pool, and a tier is a cache),
  so the engine step never waits on a slow disk or Redis. A write that raises (a full disk, any
  error) is logged and counted in ``write_errors``, and the writer goes on with the next record.
  ``flush`` waits for what is queued while the writer lives (a clean exit calls it, for at most
  ``EXIT_FLUSH_TIMEOUT_S``) and says what was not written. The host tier is filled with blocks the
  device pool evicts.

Plain Python, no torch: payloads are bytes; the engine turns them into tensors.
"""

from __future__ import annotations

import atexit
import logging
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
# Most bytes of records waiting for the writer thread (--kv-write-queue-size): a burst of long prompts
# in front of a slow disk or Redis; beyond it new blocks are dropped, never waited for.
DEFAULT_WRITE_QUEUE_BYTES = 1 << 30
EXIT_FLUSH_TIMEOUT_S = 60.0  # the longest a clean exit waits for queued writes

logger = logging.getLogger("kvreuse")


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
    write_errors: int = 0  # writes that raised (a full or read-only disk, any error): the block is not there
    write_drops: int = 0  # blocks not written: the write queue was full, or its writer thread had ended

    def as_dict(self) -> dict[str, Any]:
        return {"queries": self.queries, "hits": self.hits, "hit_bytes": self.hit_bytes, "stores": self.stores,
                "store_bytes": self.store_bytes, "load_seconds": self.load_seconds,
                "store_seconds": self.store_seconds, "verify_failures": dict(self.verify_failures),
                "write_errors": self.write_errors, "write_drops": self.write_drops}


@dataclass(frozen=True)
class BlockRef:
    """A block a lookup asks for: its key, namespace and token ids."""

    key: bytes
    namespace: bytes
    tokens: Sequence[int]


class TieredStore:
    def __init__(self, fingerprint: str, layout: BlockLayout, tiers: Sequence[Tier],
                 max_queue_bytes: int = DEFAULT_WRITE_QUEUE_BYTES) -> None:
        if max_queue_bytes < 1:
            raise ValueError(f"kv_write_queue_size must be positive, got {max_queue_bytes}")
        self.fingerprint = fingerprint
        self.layout = layout
        self.tiers = sorted(tiers, key=lambda tier: TIER_ORDER.index(tier.name))
        self.stats = {tier.name: TierStats() for tier in self.tiers}
        self.max_queue_bytes = max_queue_bytes
        self._queue: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._writer_ended = False
        self._write_through = [tier for tier in self.tiers if tier.name != "host"]
        self._lock = threading.Lock()  # stats and the queue's counts are updated by the writer thread too
        self._written = threading.Condition(self._lock)  # notified as each queued record is done with
        self._pending = 0  # records queued or being written
        self._pending_bytes = 0
        self._logged: set[tuple[str, str]] = set()  # (tier, error type) already logged with its details
        self._logged_drops: set[str] = set()  # why blocks were dropped, already logged

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
        """Queue a computed block for the write-through tiers (disk, remote); never waits: a block that
        does not fit in the queue (``max_queue_bytes``, one record always fits an empty queue) is dropped
        and counted in ``write_drops``."""
        if not self._write_through:
            return
        data = record.encode(self.fingerprint, block.key, block.namespace, block.tokens, self.layout, payload)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kvreuse-tier-writer", daemon=True)
            self._writer.start()
            # The writer is a daemon (it must never keep a process alive); a normal exit waits for it, boundedly.
            atexit.register(self.flush, EXIT_FLUSH_TIMEOUT_S)
        with self._lock:
            ended = self._writer_ended
            dropped = ended or (self._pending > 0 and self._pending_bytes + len(data) > self.max_queue_bytes)
            if dropped:
                for tier in self._write_through:
                    self.stats[tier.name].write_drops += 1
                why = "the writer thread has ended" if ended else (
                    f"the write queue is full ({self.max_queue_bytes} bytes, kv_write_queue_size)")
                first = why not in self._logged_drops
                self._logged_drops.add(why)
            else:
                self._pending += 1
                self._pending_bytes += len(data)
        if not dropped:
            self._queue.put((block.key, data))
        elif first:
            logger.warning("KV tiers: a block was not written to %s: %s; further drops are counted in write_drops",
                           ", ".join(tier.name for tier in self._write_through), why)

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
        try:
            while True:
                key, data = self._queue.get()
                for tier in self._write_through:
                    self._write(tier, key, data)
                with self._lock:
                    self._pending -= 1
                    self._pending_bytes -= len(data)
                    self._written.notify_all()
        finally:  # only a BaseException gets here (_write catches the rest): flush stops waiting for it
            with self._lock:
                self._writer_ended = True
                self._written.notify_all()

    def _write(self, tier: Tier, key: bytes, data: bytes) -> None:
        """One record to one tier; an error is logged and counted, never raised (the writer goes on)."""
        started = time.perf_counter()
        try:
            stored = tier.put(key, data)
        except Exception as error:  # a full or read-only disk (OSError), or any bug: this block is not there
            with self._lock:
                self.stats[tier.name].write_errors += 1
                kind = (tier.name, type(error).__name__)
                first = kind not in self._logged
                self._logged.add(kind)
            if first:
                logger.warning("KV %s tier: a block was not written (%s: %s); the writer goes on, further "
                               "%s errors are counted in write_errors", tier.name, type(error).__name__, error,
                               type(error).__name__, exc_info=not isinstance(error, OSError))
            else:
                logger.debug("KV %s tier: a block was not written (%s: %s)", tier.name, type(error).__name__, error)
            return
        if not stored:
            return
        with self._lock:
            stats = self.stats[tier.name]
            stats.stores += 1
            stats.store_bytes += len(data)
            stats.store_seconds += time.perf_counter() - started

    def flush(self, timeout_s: float | None = None) -> int:
        """Wait until every queued write has reached its tiers, while the writer thread lives, for at most
        ``timeout_s`` seconds (None: no bound; a clean exit runs it with ``EXIT_FLUSH_TIMEOUT_S``). Returns
        how many queued blocks were not written (0: all were), and logs them."""
        if self._writer is None:
            return 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._pending and not self._writer_ended:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._written.wait(remaining)
            left, left_bytes, ended = self._pending, self._pending_bytes, self._writer_ended
        if left:
            logger.warning("KV tiers: %d queued block(s) (%d bytes) not written to %s: %s", left, left_bytes,
                           ", ".join(tier.name for tier in self._write_through),
                           "the writer thread has ended" if ended else f"still writing after {timeout_s} s")
        return left

    def clear(self, names: Sequence[str]) -> dict[str, int]:
        self.flush()
        return {tier.name: tier.clear() for tier in self.tiers if tier.name in names}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: stats.as_dict() for name, stats in self.stats.items()}
