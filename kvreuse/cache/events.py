"""KV cache events: which block keys the prefix index stored and removed, in order.

A router that knows exactly which blocks each server holds routes on facts instead of guesses (its
own record of what it sent, bounded by the server's pool size). The prefix index appends an event
whenever a block enters it and whenever eviction (or a reset) takes one out; the server hands them
out by sequence number (``GET /v1/cache/events?after=N``), so any number of readers can follow the
log at their own pace. The log is a bounded ring: a reader that falls behind by more than its
capacity learns that it lost events (``lost``) and must treat its view as a guess again. Each log
has an ``epoch`` (random, per engine start): a reader that sees it change knows the server restarted
with an empty cache, drops its view and reads from ``after=0``.

Keys are the chained content keys of kvreuse.cache.hashing: a reader computes the same keys from a
prompt's token ids, cache_salt and model name, never sees tokens, and cannot invert a key into text.

A hybrid model (issue 66) resumes a hit from a recurrent-state snapshot, not from blocks alone: a server that holds
a prefix's blocks but no state on it recomputes the whole prefix. So its log also says where it keeps states:
``state_stored`` when a block's node anchors its first snapshot (a state at that block's end or within the next
block's tokens), ``state_removed`` when the node's last snapshot goes (a removed block takes its states with it). A
reader credits a hybrid server only with the blocks up to the deepest anchor on a prompt's path (docs/router.md).

Appends happen on the engine thread and reads on the server's event loop, hence the lock.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

EventType = Literal["stored", "removed", "state_stored", "state_removed"]
DEFAULT_CAPACITY = 65_536


@dataclass(frozen=True)
class KVEvent:
    seq: int  # 1, 2, 3, ... per engine, never reused
    type: EventType
    key: bytes
    # A stored block's parent block key (None: the first block of its namespace) and its token ids, for
    # the vLLM-format publisher (server/kv_event_publisher.py), whose BlockStored carries both. The JSON
    # view (/v1/cache/events) leaves them out: its readers need keys only, and see no text.
    parent: bytes | None = None
    tokens: Sequence[int] = ()  # the node's own token list (never mutated), not a copy

    def to_json(self) -> dict[str, object]:
        return {"seq": self.seq, "type": self.type, "key": self.key.hex()}


@dataclass(frozen=True)
class KVEventBatch:
    events: list[KVEvent]
    next_after: int  # pass as ``after`` to read on from here
    lost: int  # events the reader missed because the ring overwrote them (0: its view is exact)
    last_seq: int  # the newest event's seq when this batch was read


class KVEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._last_seq = 0
        self._lock = threading.Lock()
        self.epoch = uuid.uuid4().hex

    def stored(self, key: bytes, parent: bytes | None = None, tokens: Sequence[int] = ()) -> None:
        self._append("stored", key, parent, tokens)

    def removed(self, key: bytes) -> None:
        self._append("removed", key)

    def state_stored(self, key: bytes) -> None:
        """Block ``key``'s node anchors a recurrent-state snapshot now (its first)."""
        self._append("state_stored", key)

    def state_removed(self, key: bytes) -> None:
        """Block ``key``'s node anchors no snapshot any more (its block stays)."""
        self._append("state_removed", key)

    def _append(self, kind: EventType, key: bytes, parent: bytes | None = None, tokens: Sequence[int] = ()) -> None:
        with self._lock:
            self._last_seq += 1
            self._events.append(KVEvent(self._last_seq, kind, key, parent, tokens))

    def read(self, after: int, limit: int) -> KVEventBatch:
        """Up to ``limit`` events with ``seq > after``, oldest first."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        with self._lock:
            if after >= self._last_seq:
                # Nothing new; ``after`` beyond the end comes from a reader of another epoch.
                return KVEventBatch([], self._last_seq, 0, self._last_seq)
            oldest = self._events[0].seq
            lost = max(oldest - after - 1, 0)
            start = max(after + 1 - oldest, 0)
            events = list(itertools.islice(self._events, start, start + limit))
            return KVEventBatch(events, events[-1].seq, lost, self._last_seq)
