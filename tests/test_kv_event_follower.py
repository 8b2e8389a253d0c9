"""The router's follower of vLLM-format KV event streams (kvreuse.router.kv_event_subscriber) against kvreuse's
real publisher (ZMQ sockets on the loopback, the publisher's own thread): it learns what was published before
it joined, fills gaps from the replay socket, and asks for a resync when a gap cannot be filled."""

from __future__ import annotations

import struct
import threading
import time

import msgpack
import zmq

from kvreuse.cache.events import KVEventLog
from kvreuse.router.kv_event_subscriber import (
    BlockUpdate,
    KVEventFollower,
    KVEventSource,
    decode_batch,
)
from kvreuse.server.kv_event_publisher import KVEventsConfig, ZmqKVEventPublisher, encode_batch


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def held(updates: list[BlockUpdate], name: str) -> set[bytes]:
    """The blocks a router following these updates believes ``name`` holds."""
    blocks: set[bytes] = set()
    for update in updates:
        if update.source != name:
            continue
        if update.kind == "stored":
            blocks.update(update.keys)
        elif update.kind == "removed":
            blocks.difference_update(update.keys)
        elif update.kind in ("cleared", "resync"):
            blocks.clear()
    return blocks


def wait_for(follower: KVEventFollower, updates: list[BlockUpdate], name: str, expected: set[bytes]) -> set[bytes]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        updates.extend(follower.drain())
        if held(updates, name) == expected:
            break
        time.sleep(0.02)
    return held(updates, name)


def publisher(log: KVEventLog, buffer_steps: int = 10_000, replay: bool = True) -> ZmqKVEventPublisher:
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*" if replay else None, buffer_steps=buffer_steps,
                            topic="kv")
    started = ZmqKVEventPublisher(config, log, block_size=4, medium="CPU")
    started.start()
    return started


def test_a_late_follower_learns_what_was_published_and_follows_live_events():
    log = KVEventLog()
    pub = publisher(log)
    follower = KVEventFollower()
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        for i in range(6):  # published before the follower joins: only the replay socket has them
            log.stored(key(i), key(i - 1) if i else None, tokens=[i] * 4)
        time.sleep(0.2)
        follower.follow(KVEventSource("a", pub.endpoint, pub.replay_endpoint, topic="kv"))
        updates: list[BlockUpdate] = []
        assert wait_for(follower, updates, "a", {key(i) for i in range(6)}) == {key(i) for i in range(6)}
        log.removed(key(5))
        log.removed(key(4))
        log.stored(key(9))
        expected = {key(i) for i in range(4)} | {key(9)}
        assert wait_for(follower, updates, "a", expected) == expected
        assert not [u for u in updates if u.kind == "resync"]
        # Each batch once: replayed batches that also came live are not applied twice.
        stored = [k for u in updates if u.kind == "stored" for k in u.keys]
        assert len(stored) == len(set(stored)) == 7
    finally:
        follower.close()
        pub.shutdown()


class ScriptedPublisher:
    """A vLLM-format publisher whose sequence numbers the test controls: a batch can be buffered for replay
    without being sent live (as a PUB socket drops messages past its high-water mark), or lost entirely."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.replay = self.context.socket(zmq.ROUTER)
        self.replay.bind("tcp://127.0.0.1:*")
        self.buffer: list[tuple[int, bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def source(self) -> KVEventSource:
        return KVEventSource("a", self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                             self.replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def batch(self, seq: int, stored: list[bytes] = (), removed: list[bytes] = (), live: bool = True,
              buffered: bool = True) -> None:
        events = ([["BlockStored", list(stored), None, [0] * 4 * len(stored), 4, None, "CPU"]] if stored else []) + (
            [["BlockRemoved", list(removed), "CPU"]] if removed else [])
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        if buffered:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart((b"", struct.pack(">q", seq), payload))

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while not self.stop.is_set():
            if poller.poll(20):
                identity, request = self.replay.recv_multipart()
                start = struct.unpack(">q", request)[0]
                for seq, payload in list(self.buffer):
                    if seq >= start:
                        self.replay.send_multipart((identity, struct.pack(">q", seq), payload))
                self.replay.send_multipart((identity, struct.pack(">q", -1), b""))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(linger=0)
        self.replay.close(linger=0)
        self.context.term()


def test_a_gap_is_filled_from_the_replay_socket():
    pub, follower = ScriptedPublisher(), KVEventFollower()
    try:
        follower.follow(pub.source())
        time.sleep(0.3)  # subscribed (a PUB socket drops what it sends before the SUB has connected)
        updates: list[BlockUpdate] = []
        pub.batch(0, stored=[key(0), key(1)])
        assert wait_for(follower, updates, "a", {key(0), key(1)}) == {key(0), key(1)}
        pub.batch(1, removed=[key(1)], live=False)  # dropped on the way: only the replay buffer has it
        pub.batch(2, stored=[key(2)])
        assert wait_for(follower, updates, "a", {key(0), key(2)}) == {key(0), key(2)}
        assert follower.stats()["a"]["resyncs"] == 0 and follower.stats()["a"]["replayed"] >= 1
    finally:
        follower.close()
        pub.close()


def test_a_gap_the_replay_buffer_no_longer_holds_forgets_the_source_and_learns_again():
    """The missed batch removed key(1): a router that kept its entries would believe a block the replica
    no longer has. It drops them (``resync``) and applies what comes next."""
    pub, follower = ScriptedPublisher(), KVEventFollower()
    try:
        follower.follow(pub.source())
        time.sleep(0.3)
        updates: list[BlockUpdate] = []
        pub.batch(0, stored=[key(0), key(1)])
        assert wait_for(follower, updates, "a", {key(0), key(1)}) == {key(0), key(1)}
        pub.batch(1, removed=[key(1)], live=False, buffered=False)  # lost everywhere
        pub.buffer.clear()
        pub.batch(2, stored=[key(2)])
        assert wait_for(follower, updates, "a", {key(2)}) == {key(2)}
        assert [u.kind for u in updates].count("resync") == 1 and follower.stats()["a"]["resyncs"] == 1
    finally:
        follower.close()
        pub.close()


def test_decode_batch_reads_vllms_tagged_arrays_and_refuses_others():
    payload = msgpack.packb([1.0, [["BlockStored", [b"k1", b"k2"], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"],
                                  ["BlockRemoved", [b"k1"], "GPU"], ["AllBlocksCleared"]]], use_bin_type=True)
    assert decode_batch(payload) == [("stored", (b"k1", b"k2")), ("removed", (b"k1",)), ("cleared", ())]
    # A hybrid model's server adds its states (kvreuse's tags, server/kv_event_publisher.py), grouped as blocks are.
    log = KVEventLog()
    log.stored(b"k1", None, [1, 2, 3, 4])
    log.state_stored(b"k1")
    log.state_stored(b"k2")
    log.state_removed(b"k1")
    log.removed(b"k1")
    encoded = encode_batch(log.read(0, 10).events, 4, "CPU")
    assert msgpack.unpackb(encoded)[1][1:] == [["StateStored", [b"k1", b"k2"]], ["StateRemoved", [b"k1"]],
                                               ["BlockRemoved", [b"k1"], "CPU"]]
    assert decode_batch(encoded)[1:] == [("state_stored", (b"k1", b"k2")), ("state_removed", (b"k1",)),
                                         ("removed", (b"k1",))]
    for bad in (b"\xc1", msgpack.packb([1.0, [["Mystery", []]]]), struct.pack(">q", 3)):
        try:
            decode_batch(bad)
        except ValueError:
            continue
        raise AssertionError(f"decoded {bad!r}")
