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
- states (issue 66): a hybrid's recurrent state snapshot, with the K/V of its tail (the tokens after its anchor
  block, which no full-block record holds), is queued for every tier, host included, when the engine keeps it
  (``store_state``; encoded by the writer thread: a state is megabytes); ``lookup_state`` asks each tier which of
  the positions a request asks for it holds (``has_many``), then reads the deepest only, verified.

Plain Python, no torch: payloads are bytes; the engine turns them into tensors.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
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
    def has_many(self, keys: Sequence[bytes]) -> list[bool]: ...
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
    state_lookups: int = 0  # a hybrid's state lookups that asked this tier (issue 66)
    state_hits: int = 0  # states served from it
    state_stores: int = 0  # states written to it (counted in stores and store_bytes too)

    def as_dict(self) -> dict[str, Any]:
        return {"queries": self.queries, "hits": self.hits, "hit_bytes": self.hit_bytes, "stores": self.stores,
                "store_bytes": self.store_bytes, "load_seconds": self.load_seconds,
                "store_seconds": self.store_seconds, "verify_failures": dict(self.verify_failures),
                "write_errors": self.write_errors, "write_drops": self.write_drops,
                "state_lookups": self.state_lookups, "state_hits": self.state_hits, "state_stores": self.state_stores}


@dataclass(frozen=True)
class BlockRef:
    """A block a lookup asks for: its key, namespace and token ids."""

    key: bytes
    namespace: bytes
    tokens: Sequence[int]


@dataclass(frozen=True)
class StateRef:
    """A hybrid's recurrent state a lookup asks for (issue 66): its key (``hashing.state_key``: the anchor block's
    chained key and the tail), its namespace, and its tail (the tokens after the anchor block, fewer than a block,
    whose K/V the record carries beside the state)."""

    key: bytes
    namespace: bytes
    tail: Sequence[int]


@dataclass(frozen=True)
class StateFound:
    tier: str
    index: int  # which of the refs asked for
    state: memoryview  # the state's bytes (the pool's slot layout)
    tail_block: memoryview | None  # the block holding the tail's K/V (None: an empty tail)


def state_layout(state: BlockLayout, block: BlockLayout, tail: int) -> BlockLayout:
    """A state record's payload: the state, then (a non-empty tail) the block that holds the tail's K/V."""
    if not tail:
        return state
    return BlockLayout(shape=(*state.shape, *block.shape), dtype=f"{state.dtype}+{block.dtype}",
                       num_bytes=state.num_bytes + block.num_bytes)


class TieredStore:
    def __init__(self, fingerprint: str, layout: BlockLayout, tiers: Sequence[Tier],
                 max_queue_bytes: int = DEFAULT_WRITE_QUEUE_BYTES, state: BlockLayout | None = None) -> None:
        if max_queue_bytes < 1:
            raise ValueError(f"kv_write_queue_size must be positive, got {max_queue_bytes}")
        self.fingerprint = fingerprint
        self.layout = layout
        self.state = state  # a hybrid's recurrent state slot (None: the model keeps none)
        self.tiers = sorted(tiers, key=lambda tier: TIER_ORDER.index(tier.name))
        self.stats = {tier.name: TierStats() for tier in self.tiers}
        self.max_queue_bytes = max_queue_bytes
        # (key, the record or what encodes it, its size, the tiers it goes to, whether it is a state)
        self._queue: queue.SimpleQueue[tuple[bytes, bytes | Callable[[], bytes], int, list[Tier], bool]] = (
            queue.SimpleQueue())
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

    def lookup_state(self, refs: Sequence[StateRef]) -> StateFound | None:
        """The deepest of ``refs`` (in the order of their positions) that a tier holds and whose record verifies:
        the fingerprint, the state's key, its tail's tokens, the layout and the checksum, as for a block. A record
        that fails is counted, dropped from its tier, and the next deepest is tried."""
        if self.state is None or not refs:
            return None
        keys = [ref.key for ref in refs]
        held: list[tuple[int, int, Tier]] = []  # (-index, tier order, tier): which tier has which position
        for order, tier in enumerate(self.tiers):
            started = time.perf_counter()
            present = tier.has_many(keys)
            with self._lock:
                self.stats[tier.name].state_lookups += 1
                self.stats[tier.name].load_seconds += time.perf_counter() - started
            held.extend((-index, order, tier) for index, found in enumerate(present) if found)
        for negative, _, tier in sorted(held, key=lambda entry: entry[:2]):  # only the deepest is read (megabytes)
            ref = refs[-negative]
            started = time.perf_counter()
            (data,) = tier.get_many([ref.key])
            with self._lock:
                self.stats[tier.name].load_seconds += time.perf_counter() - started
            if data is None:  # gone since (another server's eviction): the next deepest
                continue
            layout = state_layout(self.state, self.layout, len(ref.tail))
            try:
                payload = record.decode(data, self.fingerprint, ref.key, ref.tail, layout)
            except RecordMismatch as mismatch:
                with self._lock:
                    self.stats[tier.name].verify_failures[mismatch.reason] += 1
                tier.delete(ref.key)
                continue
            with self._lock:
                self.stats[tier.name].state_hits += 1
                self.stats[tier.name].hit_bytes += layout.num_bytes
            size = self.state.num_bytes
            return StateFound(tier.name, -negative, payload[:size], payload[size:] if ref.tail else None)
        return None

    # --- writes -------------------------------------------------------------------------------------
    def store(self, block: BlockRef, payload: bytes) -> None:
        """Queue a computed block for the write-through tiers (disk, remote); never waits: a block that
        does not fit in the queue (``max_queue_bytes``, one record always fits an empty queue) is dropped
        and counted in ``write_drops``."""
        if not self._write_through:
            return
        data = record.encode(self.fingerprint, block.key, block.namespace, block.tokens, self.layout, payload)
        self._enqueue(block.key, data, len(data), self._write_through, False)

    def _enqueue(self, key: bytes, data: bytes | Callable[[], bytes], size: int, tiers: list[Tier],
                 state: bool) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kvreuse-tier-writer", daemon=True)
            self._writer.start()
            # The writer is a daemon (it must never keep a process alive); a normal exit waits for it, boundedly.
            atexit.register(self.flush, EXIT_FLUSH_TIMEOUT_S)
        with self._lock:
            ended = self._writer_ended
            dropped = ended or (self._pending > 0 and self._pending_bytes + size > self.max_queue_bytes)
            if dropped:
                for tier in tiers:
                    self.stats[tier.name].write_drops += 1
                why = "the writer thread has ended" if ended else (
                    f"the write queue is full ({self.max_queue_bytes} bytes, kv_write_queue_size)")
                first = why not in self._logged_drops
                self._logged_drops.add(why)
            else:
                self._pending += 1
                self._pending_bytes += size
        if not dropped:
            self._queue.put((key, data, size, tiers, state))
        elif first:
            logger.warning("KV tiers: a %s was not written to %s: %s; further drops are counted in write_drops",
                           "state" if state else "block", ", ".join(tier.name for tier in tiers), why)

    def store_state(self, ref: StateRef, state: bytes, tail_block: bytes | None) -> None:
        """Queue a kept snapshot's state (and the block holding its tail's K/V) for every tier, host included: the
        device pool keeps few states, and a chat's next turn or another replica resumes from one. Encoded by the
        writer thread (a state is megabytes: its checksum stays off the engine step); dropped, never waited for, when
        the queue is full, as a block is."""
        if self.state is None or not self.tiers:
            return
        layout = state_layout(self.state, self.layout, len(ref.tail))

        def encode() -> bytes:  # the state and its tail block joined here too, off the engine step
            payload = state if tail_block is None else state + tail_block
            return record.encode(self.fingerprint, ref.key, ref.namespace, ref.tail, layout, payload)

        self._enqueue(ref.key, encode, layout.num_bytes, list(self.tiers), True)

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
                key, data, size, tiers, state = self._queue.get()
                try:
                    encoded = data() if callable(data) else data
                except Exception:  # a bug: this record is not written; the writer goes on
                    logger.exception("KV tiers: a record could not be encoded")
                    encoded = None
                for tier in tiers if encoded is not None else ():
                    self._write(tier, key, encoded, state)
                with self._lock:
                    self._pending -= 1
                    self._pending_bytes -= size
                    self._written.notify_all()
        finally:  # only a BaseException gets here (_write catches the rest): flush stops waiting for it
            with self._lock:
                self._writer_ended = True
                self._written.notify_all()

    def _write(self, tier: Tier, key: bytes, data: bytes, state: bool = False) -> None:
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
            stats.state_stores += state

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
