"""StateSnapshots: a hybrid model's recurrent state at chosen token positions, anchored in the prefix index (issue 66).

A recurrent layer (a gated delta rule, a short convolution, a Mamba-2 scan) keeps no per-token K/V: its whole past
is one fixed-size state. A prefix hit on a hybrid model therefore needs, besides the attention layers' cached
blocks, the recurrent state exactly at some token of the match; the request resumes there and recomputes the
tokens from that snapshot to the end of the match. Every other engine keys these states by coarse blocks (vLLM:
block boundaries of 528-2,144 tokens) or a few checkpoints (llama.cpp); here a snapshot sits at any token:

- it is anchored at the prefix index's node of the last full block before its position (a namespace's root for a
  position inside the first block) and holds the tokens from that block's end to its position (its ``tail``, fewer
  than a block). The anchor's chained key holds the namespace (tenant, adapter, model file and weight format, KV
  dtype, draft) and every token before the block; the tail is compared token by token. So a snapshot is keyed by
  everything that decides its bytes, as the blocks are, and is never served to a prefix it does not end;
- ``lookup`` returns the deepest snapshot at or before the end of a request's match, and says what it costs when
  that is short of the match ("state not kept at token 412: nearest snapshot at 384, 28 tokens recomputed");
- snapshots live within a byte budget; the caller drops a node's snapshots when the prefix index evicts the node
  (its blocks are gone, so no hit can end there), and frees each dropped snapshot's ``handle``;
- the caller may lend it more bytes for a while (``lend``: the slots of requests not running now, which
  llama-server's idle slots also keep their last state in) and call them back; a pinned prefix's snapshot stays
  within the budget itself, so calling the loan back never needs it.

A pinned prefix's snapshot (reason "pin", anchored at the pin's last block) is not a candidate while its anchor is
pinned: a hybrid's pinned blocks are worth nothing without the state at their end. Which other snapshot goes when
the budget is full is the retention policy: ``lru`` (least recently used first, the
baseline) or ``saved`` (the least compute saved per byte first, Marconi's idea: a snapshot is worth the tokens it
saves beyond the next snapshot up its own path, times its hits, decayed with age, over its bytes; a system prompt's
end that every request hits stays, a finished request's end that nobody continues goes; a request's own new end worth
less than the one it would displace is not kept). Torch-free: a snapshot's
state is the caller's ``handle`` (a slot in a state pool, a tier record); this module keeps metadata.

Wired to the engine through cache/state_slots.py (``StateSlots``: the slots behind the handles) for Qwen3.5's
Gated DeltaNet; benchmarks/simulate_state_snapshots.py measures the placements and policies on traces of the issue's
workloads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvreuse.cache.events import KVEventLog
from kvreuse.cache.prefix import CacheNode

POLICIES = ("lru", "saved")
# Snapshots no other request has shown a use for yet: ``saved`` keeps one only where it is worth more than what it
# would displace (a branch, a prompt's end and a pin always enter).
UNPROVEN = ("finish", "chunk")
# The ``saved`` policy's clock ticks once a use or a new snapshot (not on a lookup that only asks: a scheduler asks for
# every waiting request at every step). Hits halve in weight after this many ticks without a use: a prompt that
# stopped coming back loses its claim on the budget.
HIT_HALF_LIFE = 256
# A new snapshot's claim of a first use halves after this many ticks without one: what nobody resumed from soon after
# it was kept (a question's end, an old phase's long prompt) gives way to what was kept since (a chat's latest turn,
# which its next turn resumes from a few requests later). Measured in the engine: docs/benchmarks.md.
PRIOR_HALF_LIFE = 16


@dataclass(eq=False)
class Snapshot:
    anchor: CacheNode  # the node of the last full block before ``position`` (a root: inside the first block)
    tail: tuple[int, ...]  # the tokens from the anchor's end to ``position``
    position: int  # the prefix's length: the state is the one after token position - 1
    num_bytes: int
    handle: object  # the caller's: where the state's tensors are
    reason: str  # why it was taken: "chunk", "finish", "branch", "prompt" (a prompt's end), "pin", "tier" (read back)
    last_used: int
    hits: float = 0.0  # decayed count (HIT_HALF_LIFE)
    below: int = 0  # snapshots added below it on its path with it as their nearest (2 or more: a branch point)
    continued: bool = False  # a request resumed from a snapshot below it, its nearest: its path goes on past it


class SnapshotHit(NamedTuple):
    snapshot: Snapshot | None  # the deepest snapshot at or before the match's end; None: none on this path
    resume: int  # tokens the request need not recompute: the snapshot's position (0 without one)
    matched: int  # tokens the blocks matched
    explanation: str | None  # why fewer tokens are reused than matched (None: the snapshot ends the match)


class StateSnapshots:
    def __init__(self, block_size: int, budget_bytes: int, policy: str = "saved", events: KVEventLog | None = None
                 ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"snapshot policy {policy!r} is not one of {', '.join(POLICIES)}")
        if budget_bytes < 0:
            raise ValueError(f"snapshot budget_bytes must be >= 0, got {budget_bytes}")
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.lent_bytes = 0  # bytes lent beyond the budget until called back (``lend``)
        self.policy = policy
        self.num_bytes = 0
        # Where a router learns which blocks end in a resumable state (cache/events.py): an anchor's first snapshot
        # and its last one's going. A namespace root anchors states within the first block, which no block key names.
        self.events = events
        self._at: dict[CacheNode, dict[tuple[int, ...], Snapshot]] = {}  # anchor -> tail -> snapshot
        self._clock = itertools.count(1)
        self._now = 0

    def __len__(self) -> int:
        return sum(len(by_tail) for by_tail in self._at.values())

    @property
    def capacity_bytes(self) -> int:
        return self.budget_bytes + self.lent_bytes

    def find(self, anchor: CacheNode, tail: Sequence[int]) -> Snapshot | None:
        """The snapshot kept after ``anchor`` and exactly ``tail`` (None: none)."""
        return self._at.get(anchor, {}).get(tuple(tail))

    def snapshots(self) -> list[Snapshot]:
        return [snapshot for by_tail in self._at.values() for snapshot in by_tail.values()]

    # --- lookup --------------------------------------------------------------------------------------------------
    def lookup(self, root: CacheNode, nodes: Sequence[CacheNode], token_ids: Sequence[int], matched: int,
               count: bool = True) -> SnapshotHit:
        """The deepest snapshot at or before token ``matched`` on the path ``root``, ``nodes`` (the request's fully
        matched blocks in order) spelled by ``token_ids``. ``count``: this is a real lookup (the snapshot's hits and
        recency grow); False for a question (the observatory's)."""
        if count:
            self._now = next(self._clock)
        size = self.block_size
        for index in range(min(len(nodes), matched // size), -1, -1):
            anchor = nodes[index - 1] if index else root
            by_tail = self._at.get(anchor)
            if not by_tail:
                continue
            start = index * size
            best: Snapshot | None = None
            for tail, snapshot in by_tail.items():
                if start + len(tail) <= matched and (best is None or len(tail) > len(best.tail)) \
                        and tuple(token_ids[start:start + len(tail)]) == tail:
                    best = snapshot
            if best is not None:
                if count:
                    self._use(best)
                why = None if best.position == matched else (
                    f"state not kept at token {matched}: nearest snapshot at {best.position}, "
                    f"{matched - best.position} tokens recomputed")
                return SnapshotHit(best, best.position, matched, why)
        why = f"no state kept on this prefix: {matched} matched tokens recomputed" if matched else None
        return SnapshotHit(None, 0, matched, why)

    def record_use(self, snapshot: Snapshot) -> None:
        """A request resumes from ``snapshot``: its hits and recency grow (what a counted ``lookup`` does)."""
        self._now = next(self._clock)
        self._use(snapshot)

    def _use(self, snapshot: Snapshot) -> None:
        snapshot.hits = self._decayed_hits(snapshot) + 1
        snapshot.last_used = self._now
        above = self._above(snapshot)
        if above is not None and above.reason == "prompt" and not above.continued:
            # The path went on past the prompt's end above: whose request's end a chat's next turn resumed from, it
            # serves a retry of that turn only now (``_superseded``).
            above.continued = True
            if self._superseded(above):
                above.hits = 0.0

    # --- adding and dropping -------------------------------------------------------------------------------------
    def add(self, anchor: CacheNode, tail: Sequence[int], num_bytes: int, handle: object,
            reason: str) -> tuple[Snapshot | None, list[Snapshot]]:
        """Keep the state after ``anchor``'s tokens and ``tail`` (fewer than a block). Returns the snapshot kept
        (None when it exceeds the whole budget, or the same one was kept: then ``handle`` is the caller's to free)
        and the snapshots dropped to make room, whose handles the caller frees."""
        tail = tuple(tail)
        if len(tail) >= self.block_size:
            raise ValueError(f"a snapshot's tail is shorter than a block ({self.block_size}), got {len(tail)}")
        if anchor.evicted:
            raise RuntimeError("a snapshot anchored at an evicted node")
        # A pinned prefix's snapshot fits in the budget beside the others taken for a pin (each protected while its pin
        # holds, which may start after it was kept), so calling a loan back never meets only protected ones; any other
        # fits in what is lent besides.
        if reason == "pin":
            room = self.budget_bytes - sum(other.num_bytes for other in self.snapshots() if other.reason == "pin")
        else:
            room = self.capacity_bytes - self._protected_bytes()
        if tail in self._at.get(anchor, {}) or num_bytes > room:
            return None, []
        self._now = next(self._clock)
        snapshot = Snapshot(anchor, tail, anchor.depth * self.block_size + len(tail), num_bytes, handle, reason,
                            self._now)
        if (self.policy == "saved" and reason in UNPROVEN and self.num_bytes + num_bytes > self.capacity_bytes
                and self.saved_per_byte(snapshot) < self.saved_per_byte(self._victim())):
            # Admission: a request's own end (or a chunk's) worth less than the snapshot it would displace is not
            # kept: a finished answer's end a few tokens past its prompt's would otherwise push out the prompt end the
            # next turn resumes from. A branch, a prompt's end and a pin are kept: another request is on their path.
            return None, []
        dropped = self._make_room(num_bytes)
        by_tail = self._at.setdefault(anchor, {})  # after the evictions, which may have emptied the anchor
        by_tail[tail] = snapshot
        if len(by_tail) == 1 and self.events is not None and not anchor.is_root:
            self.events.state_stored(anchor.key)
        self.num_bytes += num_bytes
        above = self._above(snapshot)
        if above is not None and not above.continued:  # (a continued prompt end's path went on: no branch below it)
            above.below += 1
            if self._superseded(above):  # what goes on along this path resumes below it now: its hits were that path's
                above.hits = 0.0
        return snapshot, dropped

    def hand_over(self, snapshot: Snapshot, lent_bytes: int) -> bool:
        """Whether a request resuming from ``snapshot`` takes its handle as its own, when the loan falls to
        ``lent_bytes`` and something must go to fit: a finished request's end that nothing was kept below yet (a
        chat's latest turn, which its next turn goes on past) leaves the index instead of the policy's victim,
        another conversation's end. A shared prefix's snapshot (a branch, a prompt's end, a pin, a branch point)
        stays for the requests after. True: it left (the caller owns its handle now)."""
        if (snapshot.reason != "finish" or snapshot.below or self.protected(snapshot)
                or self.num_bytes <= self.budget_bytes + lent_bytes):
            return False
        self._now = next(self._clock)
        self._use(snapshot)  # a use all the same: the snapshot above learns its path went on
        self._remove(snapshot)
        return True

    def lend(self, lent_bytes: int) -> list[Snapshot]:
        """Hold up to ``lent_bytes`` beyond the budget from now on (0: call the loan back). Returns the snapshots
        dropped to fit (the retention policy's victims), whose handles the caller frees."""
        if lent_bytes < 0:
            raise ValueError(f"lent_bytes must be >= 0, got {lent_bytes}")
        self.lent_bytes = lent_bytes
        return self._make_room(0)

    def _make_room(self, num_bytes: int) -> list[Snapshot]:
        """Drop the policy's victims until ``num_bytes`` more fit in the budget and the loan."""
        dropped: list[Snapshot] = []
        while self.num_bytes + num_bytes > self.capacity_bytes:
            dropped.append(self._remove(self._victim()))
        return dropped

    def drop_node(self, node: CacheNode) -> list[Snapshot]:
        """``node`` leaves the prefix index: the snapshots anchored at it go (their handles are the caller's; the
        block's removal event says the states went with it)."""
        by_tail = self._at.pop(node, {})
        self.num_bytes -= sum(snapshot.num_bytes for snapshot in by_tail.values())
        return list(by_tail.values())

    def _remove(self, snapshot: Snapshot) -> Snapshot:
        by_tail = self._at[snapshot.anchor]
        del by_tail[snapshot.tail]
        if not by_tail:
            del self._at[snapshot.anchor]
            if self.events is not None and not snapshot.anchor.is_root:
                self.events.state_removed(snapshot.anchor.key)
        self.num_bytes -= snapshot.num_bytes
        return snapshot

    # --- retention -----------------------------------------------------------------------------------------------
    @staticmethod
    def protected(snapshot: Snapshot) -> bool:
        """A pinned prefix's snapshot while its pin holds (its anchor, the pin's last block, is pinned): retention
        never drops it. The pin's owner chose to keep that prefix; for a hybrid its blocks are worth nothing without
        the state at their end."""
        return snapshot.reason == "pin" and snapshot.anchor.pin_count > 0

    def _protected_bytes(self) -> int:
        return sum(snapshot.num_bytes for snapshot in self.snapshots() if self.protected(snapshot))

    def _victim(self) -> Snapshot:
        candidates = [snapshot for snapshot in self.snapshots() if not self.protected(snapshot)]
        if self.policy == "lru":
            return min(candidates, key=lambda snapshot: snapshot.last_used)
        return min(candidates, key=lambda snapshot: (self.saved_per_byte(snapshot), snapshot.last_used))

    def saved_per_byte(self, snapshot: Snapshot) -> float:
        """Tokens of compute the snapshot saves beyond the next snapshot up its own path, times its decayed hits
        plus one, over its bytes. The one is a new snapshot's first use; a snapshot with exactly one kept below it
        lost it, and its hits, when that one was kept (``_superseded``): a chat's earlier turn, which the next turn
        continued past, serves only a branch from it now. A branch point (two or more below it: a system prompt's
        end that several questions went on from; or taken at a branch or a pin) keeps both."""
        above = self._above(snapshot)
        saved = snapshot.position - (above.position if above is not None else 0)
        prior = 0.0 if self._superseded(snapshot) else 0.5 ** ((self._now - snapshot.last_used) / PRIOR_HALF_LIFE)
        return saved * (self._decayed_hits(snapshot) + prior) / max(1, snapshot.num_bytes)

    @staticmethod
    def _superseded(snapshot: Snapshot) -> bool:
        """One snapshot was kept below it, and it was not taken for others: a branch's snapshot (where a request left
        a cached path) and a pinned prefix's are there for the requests that come after, while their own request
        always goes on past them. A prompt's end is kept for a next turn that matches the prompt but not the
        answer's tokens (a client that sends the answer as text a tokenizer splits otherwise); once a request resumed
        from the one below it instead (``continued``: the answer's end), it serves a retry of its turn only."""
        if snapshot.below != 1:
            return False
        if snapshot.reason == "prompt":
            return snapshot.continued
        return snapshot.reason not in ("branch", "pin")

    def _decayed_hits(self, snapshot: Snapshot) -> float:
        return snapshot.hits * 0.5 ** ((self._now - snapshot.last_used) / HIT_HALF_LIFE)

    def _above(self, snapshot: Snapshot) -> Snapshot | None:
        """The deepest other snapshot on ``snapshot``'s path before it: at its own anchor with a shorter tail it
        starts with, else at the nearest ancestor with a tail the path's next block starts with."""
        tail = snapshot.tail
        found = [other for shorter, other in self._at.get(snapshot.anchor, {}).items()
                 if len(shorter) < len(tail) and tail[:len(shorter)] == shorter]
        child = snapshot.anchor
        while not found and child.parent is not None:
            found = [other for shorter, other in self._at.get(child.parent, {}).items()
                     if tuple(child.tokens[:len(shorter)]) == shorter]
            child = child.parent
        return max(found, key=lambda other: other.position, default=None)

    # --- invariants ----------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        total = 0
        for anchor, by_tail in self._at.items():
            if not by_tail:
                raise RuntimeError("an anchor with no snapshots is kept")
            if anchor.evicted:
                raise RuntimeError(f"snapshots anchored at an evicted node (depth {anchor.depth})")
            for tail, snapshot in by_tail.items():
                if snapshot.anchor is not anchor or snapshot.tail != tail:
                    raise RuntimeError("a snapshot is filed under another anchor or tail")
                if snapshot.position != anchor.depth * self.block_size + len(tail) or len(tail) >= self.block_size:
                    raise RuntimeError(f"a snapshot's position {snapshot.position} does not match its anchor and tail")
                total += snapshot.num_bytes
        if total != self.num_bytes or total > self.capacity_bytes:
            raise RuntimeError(f"snapshot bytes {total} (counted {self.num_bytes}) against a budget of "
                               f"{self.budget_bytes} and {self.lent_bytes} lent")
        if self._protected_bytes() > self.budget_bytes:
            raise RuntimeError(f"pinned prefixes' snapshots take {self._protected_bytes()} bytes, past the budget of "
                               f"{self.budget_bytes}")
