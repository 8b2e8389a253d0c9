"""KV cache events in vLLM's wire format over ZeroMQ, so routers written for vLLM follow a kvreuse server.

llm-d's KV-cache scorer and NVIDIA Dynamo's KV router learn which blocks each vLLM replica holds from
the replica's ZMQ event stream (vLLM's ``--kv-events-config``). ``kvreuse serve --kv-events-config JSON``
takes the same JSON and publishes the same messages, read from the engine's event log
(kvreuse.cache.events, the log ``GET /v1/cache/events`` serves as JSON):

- a PUB socket bound to ``endpoint``; each message is three frames: ``topic``, an 8-byte big-endian
  sequence number (0, 1, 2, ... per server start) and a msgpack ``KVEventBatch``: ``[ts, events]``, each
  event an array whose first element names its type (msgspec's tagged ``array_like`` structs):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``;
- with ``replay_endpoint``, a ROUTER socket: a reader that sees a gap in the sequence numbers sends the
  first number it missed (8 bytes, big-endian) and gets every batch still buffered from there on
  (``buffer_steps`` of them), one ``[seq, payload]`` reply each, then ``[-1 as 8 signed bytes, b""]``.

kvreuse's block hashes are its chained content keys (bytes), which already include the tenant's cache
salt and the LoRA adapter's digest, so blocks of different adapters never share a hash; ``lora_id`` is
therefore always None. ``medium`` is "GPU" for a CUDA pool and "CPU" for a CPU one. Tails (a finished
sequence's partly filled last block) are not published, as vLLM publishes full blocks only. If the
event log's ring overwrote events before this thread read them, the stream sends ``AllBlocksCleared``:
a follower then knows less than the server holds (misses, never a block it does not have).

Unlike ``/v1/cache/events``, ``BlockStored`` carries the blocks' token ids (vLLM's schema does), so the
sockets are for the operator's network: bind them to an address only routers reach.

A hybrid model's server (issue 66) adds two kvreuse events vLLM's schema has no word for: ``["StateStored",
block_hashes]`` (these blocks' nodes anchor a recurrent-state snapshot now) and ``["StateRemoved", block_hashes]``
(they anchor none any more). kvreuse's follower (router/kv_event_subscriber.py) credits a hybrid replica only up to
the deepest such block on a prompt's path; a follower written for vLLM would not know the tags, so only hybrid
servers send them (an attention-only model's stream is vLLM's exactly).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import zmq

from kvreuse.cache.events import KVEvent, KVEventLog
from kvreuse.config import reject_unknown_fields

logger = logging.getLogger(__name__)

END_OF_REPLAY = struct.pack(">q", -1)
POLL_INTERVAL_S = 0.005  # how often the publisher thread reads the event log
READ_LIMIT = 4096  # events read from the log at once (one batch at most)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (same field names and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "null" (no socket) or "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # vLLM's queue between engine and publisher (kvreuse reads its log instead)
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config``; a clear ValueError names a bad field."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"kv_events_config must be a JSON object: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(raw).__name__}")
        reject_unknown_fields(raw, (field.name for field in fields(cls)), "kv_events_config")
        config = cls(**raw)
        config.check()
        return config

    def check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'null' or 'zmq', got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv_events_config.replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer, got {value!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def encode_batch(events: list[KVEvent], block_size: int, medium: str, cleared: bool = False) -> bytes:
    """One vLLM ``KVEventBatch`` as msgpack: consecutive stored (removed) events become one BlockStored
    (BlockRemoved) while each stored block is the previous one's child, as vLLM groups a request's
    blocks; ``cleared`` puts AllBlocksCleared first."""
    encoded: list[list[Any]] = [["AllBlocksCleared"]] if cleared else []
    states = {"state_stored": "StateStored", "state_removed": "StateRemoved"}
    for event in events:
        last = encoded[-1] if encoded else None
        if event.type in states:
            tag = states[event.type]
            if last is not None and last[0] == tag:
                last[1].append(event.key)
            else:
                encoded.append([tag, [event.key]])
        elif event.type == "stored":
            if last is not None and last[0] == "BlockStored" and last[1][-1] == event.parent:
                last[1].append(event.key)
                last[3].extend(event.tokens)
            else:
                encoded.append(["BlockStored", [event.key], event.parent, list(event.tokens), block_size, None, medium])
        elif last is not None and last[0] == "BlockRemoved" and event.type == "removed":
            last[1].append(event.key)
        else:
            encoded.append(["BlockRemoved", [event.key], medium])
    return msgpack.packb([time.time(), encoded], use_bin_type=True)


class ZmqKVEventPublisher:
    """Follows an engine's KVEventLog on its own thread and publishes vLLM-format batches."""

    def __init__(self, config: KVEventsConfig, log: KVEventLog, block_size: int, medium: str) -> None:
        self.config = config
        self._log = log
        self._block_size = block_size
        self._medium = medium
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint!r} / {config.replay_endpoint!r}: "
                             f"{error}") from None
        # The addresses bound, a wildcard port ("tcp://127.0.0.1:*") resolved: what followers connect to.
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                            if self._replay is not None else None)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._after = 0  # the log from the engine's start (warm prompts included), as far as its ring holds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self.batches_sent = 0

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    self._publish_new()
                    if self._replay is None:
                        self._stop.wait(POLL_INTERVAL_S)
                    elif poller.poll(timeout=POLL_INTERVAL_S * 1000):  # replay requests between reads
                        self._serve_replay()
                except zmq.ZMQError:
                    if self._stop.is_set():
                        return
                    logger.exception("KV event publisher: socket error")
        except Exception:  # a bug here must not pass silently: followers would wait on a quiet stream
            logger.exception("KV event publisher stopped: no more KV events are published")

    def _publish_new(self) -> None:
        batch = self._log.read(self._after, READ_LIMIT)
        if not batch.events and not batch.lost:
            return
        if batch.lost:
            logger.warning("KV event publisher fell %d events behind the event log: sending AllBlocksCleared",
                           batch.lost)
        self._after = batch.next_after
        payload = encode_batch(batch.events, self._block_size, self._medium, cleared=batch.lost > 0)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self.config.topic.encode(), struct.pack(">q", seq), payload))
        self.batches_sent += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        identity, request = frames[0], frames[-1]  # a REQ client puts an empty delimiter frame between
        delimiter = [b""] if len(frames) > 2 else []
        if len(request) != 8:
            self._replay.send_multipart((identity, *delimiter, END_OF_REPLAY, b""))
            return
        start = struct.unpack(">q", request)[0]
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, *delimiter, struct.pack(">q", seq), payload))
        self._replay.send_multipart((identity, *delimiter, END_OF_REPLAY, b""))


def start_kv_event_publisher(config: KVEventsConfig, log: KVEventLog, block_size: int,
                             device_type: str) -> ZmqKVEventPublisher | None:
    """The publisher ``config`` asks for, started (None: events off or the null publisher)."""
    if not config.publishes:
        logger.info("KV events not published: kv_events_config needs enable_kv_cache_events true and publisher "
                    "'zmq' (got %s and %r)", config.enable_kv_cache_events, config.publisher)
        return None
    publisher = ZmqKVEventPublisher(config, log, block_size, "GPU" if device_type == "cuda" else "CPU")
    publisher.start()
    logger.info("KV events in vLLM's format on %s%s (topic %r)", publisher.endpoint,
                f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "", config.topic)
    return publisher
