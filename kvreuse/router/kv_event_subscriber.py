"""A follower of several vLLM-format KV event streams (ZMQ + msgpack), for a router's block index.

Each source is a publisher as ``kvreuse serve --kv-events-config`` (kvreuse/server/kv_event_publisher.py)
or vLLM runs one: a PUB socket sending ``topic``, an 8-byte big-endian sequence number and a msgpack
``KVEventBatch`` (``[ts, events]``), and a ROUTER replay socket that answers a sequence number with every
batch it still buffers from there on. One thread owns every socket (ZMQ sockets are not thread-safe);
the router reads what arrived with `KVEventFollower.drain`, on its own thread, so nothing on the routing
path waits for the network.

Keeping the index exact:
- on `follow` the thread subscribes first and then asks the replay socket for everything from sequence
  0, so a router that starts after its replicas learns what they already hold (as far back as their
  replay buffer reaches); batches that also arrive live are applied once (by sequence number);
- a gap in the sequence numbers (the PUB socket dropped messages at its high-water mark, a reconnect)
  is filled from the replay socket; when the replay cannot fill it (the buffer moved on, no replay
  socket, no answer), the follower reports ``resync``: the router drops that source's entries, which
  may hold blocks whose removal it missed, and learns them again from new events;
- ``AllBlocksCleared`` arrives as ``cleared``.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

logger = logging.getLogger("kvreuse.router")

END_OF_REPLAY = -1
POLL_TIMEOUT_MS = 20  # how long the thread waits for messages before it looks at follow / unfollow requests
REPLAY_TIMEOUT_MS = 2000  # a replay socket that does not answer within this is taken as gone


@dataclass(frozen=True)
class KVEventSource:
    """One publisher: ``name`` is what the router calls the backend or replica."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass(frozen=True)
class BlockUpdate:
    """What one source did: ``stored`` / ``removed`` these block keys, ``state_stored`` / ``state_removed`` a
    recurrent-state snapshot on them (a hybrid model's), ``cleared`` everything, or ``resync`` (events were lost:
    forget what the source was believed to hold)."""

    source: str
    kind: str
    keys: tuple[bytes, ...] = ()


@dataclass
class SourceState:
    source: KVEventSource
    socket: zmq.Socket
    next_seq: int = 0  # the first sequence number not applied yet
    batches: int = 0
    replayed: int = 0
    resyncs: int = 0


def decode_batch(payload: bytes) -> list[tuple[str, tuple[bytes, ...]]]:
    """A msgpack ``KVEventBatch`` as (kind, keys) pairs; block hashes are kept as sent (kvreuse's are
    bytes). Raises ValueError on a payload that is not one."""
    try:
        _, events = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise ValueError(f"not a KVEventBatch: {error}") from None
    decoded: list[tuple[str, tuple[bytes, ...]]] = []
    for event in events:
        tag = event[0] if isinstance(event, list) and event else None
        if tag == "BlockStored":
            decoded.append(("stored", tuple(event[1])))
        elif tag == "BlockRemoved":
            decoded.append(("removed", tuple(event[1])))
        elif tag == "AllBlocksCleared":
            decoded.append(("cleared", ()))
        elif tag in ("StateStored", "StateRemoved"):  # a hybrid server's states (server/kv_event_publisher.py)
            decoded.append(("state_stored" if tag == "StateStored" else "state_removed", tuple(event[1])))
        else:
            raise ValueError(f"unknown KV event {tag!r}")
    return decoded


class KVEventFollower:
    """Follows any number of sources on one daemon thread; `drain` returns their updates in order."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._updates: queue.SimpleQueue[BlockUpdate] = queue.SimpleQueue()
        self._requests: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sources: dict[str, SourceState] = {}  # owned by the thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-follower", daemon=True)
        self._thread.start()

    def follow(self, source: KVEventSource) -> None:
        self._requests.put(("follow", source))

    def unfollow(self, name: str) -> None:
        self._requests.put(("unfollow", name))

    def drain(self) -> list[BlockUpdate]:
        updates = []
        while True:
            try:
                updates.append(self._updates.get_nowait())
            except queue.Empty:
                return updates

    def stats(self) -> dict[str, dict[str, int]]:
        """Per source: batches applied, batches replayed, resyncs (a snapshot; the thread keeps going)."""
        return {name: {"batches": state.batches, "replayed": state.replayed, "resyncs": state.resyncs,
                       "next_seq": state.next_seq}
                for name, state in list(self._sources.items())}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._handle_requests(poller)
                for socket, _ in poller.poll(POLL_TIMEOUT_MS):
                    state = next((s for s in self._sources.values() if s.socket is socket), None)
                    if state is not None:
                        self._receive(state)
        except Exception:  # the index would silently go stale: say so loudly
            logger.exception("KV event follower stopped: the block index no longer follows the replicas")
        finally:
            for state in self._sources.values():
                state.socket.close(linger=0)
            self._context.term()

    def _handle_requests(self, poller: zmq.Poller) -> None:
        while True:
            try:
                action, argument = self._requests.get_nowait()
            except queue.Empty:
                return
            if action == "unfollow":
                state = self._sources.pop(argument, None)
                if state is not None:
                    poller.unregister(state.socket)
                    state.socket.close(linger=0)
                continue
            source: KVEventSource = argument
            if source.name in self._sources:
                continue
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            socket.connect(source.endpoint)
            state = SourceState(source, socket)
            self._sources[source.name] = state
            poller.register(socket, zmq.POLLIN)
            # Subscribed first, then what was published before: live batches that overlap are skipped.
            self._replay(state, 0, joining=True)

    def _receive(self, state: SourceState) -> None:
        while True:
            try:
                frames = state.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                logger.warning("KV events from %s: a message of %d frames is not vLLM's format", state.source.name,
                               len(frames))
                continue
            seq = struct.unpack(">q", frames[1])[0]
            if seq > state.next_seq and not self._replay(state, state.next_seq, joining=False):
                self._resync(state, f"batches {state.next_seq}..{seq - 1} were lost and could not be replayed")
                state.next_seq = seq
            self._apply(state, seq, frames[2])

    def _replay(self, state: SourceState, start: int, joining: bool) -> bool:
        """Ask the source's replay socket for every batch from ``start`` and apply them. Filling a gap, False
        when that cannot cover ``start`` (no replay socket, no answer, the buffer no longer holds it); a
        joiner (``joining``) takes whatever is still buffered."""
        endpoint = state.source.replay_endpoint
        if endpoint is None:
            return joining  # nothing to ask; a joiner simply starts from what comes next
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.connect(endpoint)
            dealer.send(struct.pack(">q", start))
            while True:
                seq_frame, payload = dealer.recv_multipart()
                seq = struct.unpack(">q", seq_frame)[0]
                if seq == END_OF_REPLAY:
                    break
                batches.append((seq, payload))
        except (zmq.Again, ValueError):
            logger.warning("KV events of %s: the replay socket %s did not answer", state.source.name, endpoint)
            return False
        finally:
            dealer.close(linger=0)
        if not joining and (not batches or batches[0][0] > start):
            return False
        if batches and batches[0][0] > start:
            logger.info("KV events of %s: its replay buffer starts at batch %d; blocks stored before it are unknown "
                        "to this router until used again", state.source.name, batches[0][0])
            state.next_seq = max(state.next_seq, batches[0][0])
        for seq, payload in batches:
            state.replayed += 1
            self._apply(state, seq, payload)
        return True

    def _apply(self, state: SourceState, seq: int, payload: bytes) -> None:
        if seq < state.next_seq:
            return  # already applied (replayed, then seen live)
        try:
            decoded = decode_batch(payload)
        except ValueError as error:
            self._resync(state, f"batch {seq} unreadable ({error})")
            state.next_seq = seq + 1
            return
        for kind, keys in decoded:
            self._updates.put(BlockUpdate(state.source.name, kind, keys))
        state.batches += 1
        state.next_seq = seq + 1

    def _resync(self, state: SourceState, why: str) -> None:
        state.resyncs += 1
        logger.warning("KV events of %s: %s; its index entries are dropped and learnt again", state.source.name, why)
        self._updates.put(BlockUpdate(state.source.name, "resync"))
