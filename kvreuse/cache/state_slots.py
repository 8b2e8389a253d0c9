"""StateSlots: who holds each slot of the recurrent-state pool (running requests, snapshots), and the copies between them.

A hybrid model whose recurrent layers keep a per-sequence state (Qwen3.5's Gated DeltaNet; cache/recurrent_state.py
holds the tensors) needs, for a prefix hit, the state exactly at the hit's last token. The pool has ``max_running``
slots' worth for running requests and the rest for snapshots (``StateSnapshots``, whose byte budget is that rest).
The running requests' slots that no request holds now are lent to the snapshots (as llama-server's idle slots keep
their last state): a chat of a few conversations keeps every conversation's end though the budget holds fewer, and
an admission that needs its slot back drops the snapshot the retention policy values least (``saved``: a request's
end nobody resumed from). A snapshot is made without copying where it can be:

- ``start``: a request admitted with a hit resumes from the deepest snapshot at or before it: its new slot is a
  copy of the snapshot's (a copy of zeros at token 0), or, where the slot must come back from the snapshots and the
  snapshot is a chat's latest end, the snapshot's own slot (handed over: the next turn goes on past it anyway);
- ``keep``: a request that finishes or is preempted hands its slot over as the snapshot of its last computed token
  (the next chat turn or agent step, or its own re-admission, resumes there);
- ``branch``: a request that left a cached path between two snapshots (a shared system prompt whose end nobody
  snapshotted) stops its first prefill chunk at the divergence, and its state there is copied into a new snapshot,
  so every request after it on that branch resumes at its last shared token; the same copy at the end of a
  request's prompt (reason "prompt") serves a next turn that matches the prompt but not the answer (a chat client
  that sends the answer's text, which a tokenizer need not split into the tokens generated);
- ``drop_node``: the prefix index evicted a node; the snapshots anchored there go, their slots back to the free list;
- ``load``: a state found in a KV tier (cache/tiers/) becomes a snapshot: its bytes are written into a free slot.

Torch-free: slots are integers; the copies (``StateCopy``) run on the tensors before the next forward, in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvreuse.cache.events import KVEventLog
from kvreuse.cache.prefix import CacheNode
from kvreuse.cache.state_snapshots import Snapshot, SnapshotHit, StateSnapshots


@dataclass(frozen=True)
class StateCopy:
    src: int | None  # None: zeros (a sequence that starts at token 0), or ``payload``
    dst: int
    payload: bytes | memoryview | None = None  # a state read from a KV tier, in the slot's layout


class StateSlots:
    def __init__(self, block_size: int, num_slots: int, max_running: int, slot_bytes: int,
                 policy: str = "saved", events: KVEventLog | None = None) -> None:
        if num_slots <= max_running:
            raise ValueError(f"the state pool needs more slots ({num_slots}) than running requests ({max_running}): "
                             "the rest hold snapshots")
        self.num_slots = num_slots
        self.max_running = max_running
        self.slot_bytes = slot_bytes
        self.snapshots = StateSnapshots(block_size, (num_slots - max_running) * slot_bytes, policy, events)
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_running = 0
        self.snapshots.lend(max_running * slot_bytes)  # no request runs yet: every running slot is lent
        self._copies: list[StateCopy] = []
        self.num_kept = 0  # snapshots made, by reason: a request's end, a branch, a prompt's end
        self.num_branches = 0
        self.num_prompts = 0
        self.num_loaded = 0  # snapshots read back from a KV tier
        self.num_handed_over = 0  # snapshots a resuming request took as its own slot

    @property
    def idle_bytes(self) -> int:
        """The bytes of the running requests' slots that no request holds now (what is lent to the snapshots)."""
        return (self.max_running - self.num_running) * self.slot_bytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, root: CacheNode, nodes: Sequence[CacheNode], token_ids: Sequence[int], matched: int
               ) -> SnapshotHit:
        """The deepest snapshot at or before token ``matched`` (a question: its use is counted by ``start``)."""
        return self.snapshots.lookup(root, nodes, token_ids, matched, count=False)

    def start(self, snapshot: Snapshot | None) -> int:
        """A slot for an admitted request: a copy of ``snapshot``'s state (None: zeros). The slot is called back from
        the snapshots if they hold it on loan: a chat's latest end that the request goes on from is handed over as
        its slot (no copy; ``StateSnapshots.hand_over``), else the policy's victim goes. ``snapshot`` counts as used
        first, so it is the last the policy drops (if it is dropped all the same, its copy is queued before any copy
        into its slot)."""
        if self.num_running >= self.max_running:
            raise RuntimeError(f"no free state slot: more running requests than the pool was sized for "
                               f"({self.max_running})")
        self.num_running += 1
        if snapshot is not None and self.snapshots.hand_over(snapshot, self.idle_bytes):
            self.num_handed_over += 1
            self._lend_idle()
            return snapshot.handle  # copies queued from it before run first; it is this request's state now
        if snapshot is not None:
            self.snapshots.record_use(snapshot)
        self._lend_idle()
        slot = self._free.pop()
        self._copies.append(StateCopy(None if snapshot is None else snapshot.handle, slot))
        return slot

    def keep(self, anchor: CacheNode, tail: Sequence[int], slot: int, reason: str) -> Snapshot | None:
        """``slot`` (a request's, at its last computed token) becomes a snapshot there, or goes back to the free list.
        Returns the snapshot kept (None: not kept)."""
        self.num_running -= 1
        self._lend_idle()
        kept, dropped = self.snapshots.add(anchor, tail, self.slot_bytes, slot, reason)
        self._release(dropped)
        if kept is None:
            self._free.append(slot)
        else:
            self.num_kept += 1
        return kept

    def branch(self, anchor: CacheNode, tail: Sequence[int], slot: int, reason: str = "branch") -> Snapshot | None:
        """Copy the state in ``slot`` (a running request's, at the end of ``anchor`` + ``tail``) into a new snapshot
        (``reason``: "branch", or "prompt" at the end of its prompt). Returns the snapshot kept (None: not kept)."""
        kept, dropped = self.snapshots.add(anchor, tail, self.slot_bytes, None, reason)
        self._release(dropped)
        if kept is not None:
            kept.handle = self._free.pop()
            self._copies.append(StateCopy(slot, kept.handle))
            self.num_branches += reason == "branch"
            self.num_prompts += reason == "prompt"
        return kept

    def load(self, anchor: CacheNode, tail: Sequence[int], payload: bytes | memoryview) -> Snapshot | None:
        """A state read from a KV tier, after ``anchor`` + ``tail``, becomes a snapshot (reason "tier"): its bytes go
        into a free slot before the next forward, in order with the other copies. None: the budget has no room for
        it (every snapshot protected) or the same one is kept already."""
        kept, dropped = self.snapshots.add(anchor, tail, self.slot_bytes, None, "tier")
        self._release(dropped)
        if kept is not None:
            kept.handle = self._free.pop()
            self._copies.append(StateCopy(None, kept.handle, payload))
            self.num_loaded += 1
        return kept

    def release(self, slot: int) -> None:
        """A running request's ``slot`` goes back to the free list (no snapshot kept from it)."""
        self.num_running -= 1
        self._free.append(slot)
        self._lend_idle()

    def _lend_idle(self) -> None:
        """Lend the snapshots the slots no running request holds; what no longer fits goes (its slots freed)."""
        self._release(self.snapshots.lend(self.idle_bytes))

    def drop_node(self, node: CacheNode) -> None:
        self._release(self.snapshots.drop_node(node))

    def clear(self) -> None:
        """Drop every snapshot (a cache reset)."""
        self._release(self.snapshots.snapshots())
        self.snapshots = StateSnapshots(self.snapshots.block_size, self.snapshots.budget_bytes, self.snapshots.policy,
                                        self.snapshots.events)
        self._lend_idle()

    def _release(self, dropped: Iterable[Snapshot]) -> None:
        self._free.extend(snapshot.handle for snapshot in dropped)

    def take_copies(self) -> list[StateCopy]:
        copies, self._copies = self._copies, []
        return copies

    def check_integrity(self, running: Iterable[int]) -> None:
        """Every slot is free, a running request's, or one snapshot's, exactly once."""
        self.snapshots.check_integrity()
        running = list(running)
        held = list(self._free) + running + [snapshot.handle for snapshot in self.snapshots.snapshots()]
        if sorted(held) != list(range(self.num_slots)):
            raise RuntimeError(f"state slots are lost or shared: {sorted(held)} of {self.num_slots}")
        if len(running) != self.num_running or self.snapshots.lent_bytes != self.idle_bytes:
            raise RuntimeError(f"{len(running)} requests hold a state slot, counted {self.num_running}; "
                               f"{self.snapshots.lent_bytes} bytes lent to the snapshots")
