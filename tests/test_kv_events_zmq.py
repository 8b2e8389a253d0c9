"""KV events in vLLM's format (``--kv-events-config``): an independent subscriber, written from vLLM's
documented schema with pyzmq and msgpack only (no kvreuse code), follows a real server and rebuilds
exactly the set of blocks the server's own event log says it holds: across evictions, a cache reset and
a dropped connection recovered through the replay socket. Its blocks carry their token ids and their
chain (each block's parent)."""

from __future__ import annotations

import json
import random
import re
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from server_process import (
    MODEL_NAME,
    RunningServer,
    free_port,
    start_server,
    stop_server,
)

ADMIN = "events-admin"
TOPIC = "kv-events"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, tuple[int, int]]]:
    """A server publishing KV events, and its (event, replay) ports."""
    ports = (free_port(), free_port())
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ports[0]}",
              "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}", "topic": TOPIC}
    # 1 MiB holds 128 blocks of the tiny model: the prompts below overflow it, so blocks are evicted.
    running = start_server(tiny_model, tmp_path_factory.mktemp("events") / "server.log", "--kv-cache-memory", "1MiB",
                           "--admin-key", ADMIN, "--kv-events-config", json.dumps(config))
    yield running, ports
    stop_server(running)


class Follower:
    """What a vLLM KV-event consumer does: subscribe, apply batches in order, replay missed ones."""

    def __init__(self, ports: tuple[int, int]) -> None:
        self.context = zmq.Context()
        self.ports = ports
        self.sub = self._subscribe()
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{ports[1]}")
        self.blocks: dict[bytes, tuple[bytes | None, list[int]]] = {}  # hash -> (parent hash, token ids)
        self.last_seq = -1
        self.replayed = 0

    def _subscribe(self) -> zmq.Socket:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        sub.connect(f"tcp://127.0.0.1:{self.ports[0]}")
        return sub

    def reconnect(self) -> None:
        self.sub.close(linger=0)
        self.sub = self._subscribe()

    def apply(self, payload: bytes) -> None:
        timestamp, events = msgpack.unpackb(payload, raw=False)
        assert isinstance(timestamp, float)
        for event in events:
            if event[0] == "BlockStored":
                hashes, parent, token_ids, block_size, lora_id, medium = event[1:]
                assert block_size == BLOCK_SIZE and lora_id is None and medium == "CPU"
                assert len(token_ids) == block_size * len(hashes)
                for index, block_hash in enumerate(hashes):
                    self.blocks[block_hash] = (parent, token_ids[index * block_size:(index + 1) * block_size])
                    parent = block_hash
            elif event[0] == "BlockRemoved":
                hashes, medium = event[1:]
                for block_hash in hashes:
                    del self.blocks[block_hash]  # a block it never stored would be a broken stream
            else:
                assert event == ["AllBlocksCleared"]
                self.blocks.clear()

    def _replay_from(self, start: int) -> None:
        self.replay.send_multipart((b"", struct.pack(">q", start)))
        while True:
            assert self.replay.poll(5000), "no replay answer"
            _, seq_bytes, payload = self.replay.recv_multipart()
            if not payload:  # the end of the replay
                return
            seq = struct.unpack(">q", seq_bytes)[0]
            if seq > self.last_seq:
                assert seq == self.last_seq + 1, "replay skipped a batch"
                self.apply(payload)
                self.last_seq = seq
                self.replayed += 1

    def drain(self, quiet_s: float = 0.5) -> None:
        """Read until the stream has been quiet for ``quiet_s``, replaying any gap."""
        while self.sub.poll(quiet_s * 1000):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode()
            seq = struct.unpack(">q", seq_bytes)[0]
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                self._replay_from(self.last_seq + 1)
            if seq == self.last_seq + 1:
                self.apply(payload)
                self.last_seq = seq

    def close(self) -> None:
        self.context.destroy(linger=0)


def held_by_server(server: RunningServer) -> set[bytes]:
    """The blocks the server's own event log (GET /v1/cache/events, JSON) says its index holds."""
    held: set[bytes] = set()
    after = 0
    while True:
        page = httpx.get(f"{server.base_url}/v1/cache/events", params={"after": after},
                         headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
        assert page["lost"] == 0
        for event in page["events"]:
            key = bytes.fromhex(event["key"])
            if event["type"] == "stored":
                held.add(key)
            else:
                held.discard(key)
        if not page["events"]:
            return held
        after = page["next_after"]


def send(server: RunningServer, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                              headers={"Authorization": f"Bearer {ADMIN}"},
                              json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                    "ignore_eos": True})
        assert response.status_code == 200, response.text


def settle(server: RunningServer, follower: Follower) -> None:
    """Wait until no request runs, then read what the stream has for the finished ones."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        if f'vllm:num_requests_running{{engine="0",model_name="{MODEL_NAME}"}} 0.0' in text:
            break
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    follower.drain()


def test_a_vllm_subscriber_rebuilds_the_servers_blocks(server: tuple[RunningServer, tuple[int, int]]):
    server, ports = server
    rng = random.Random(0)
    follower = Follower(ports)
    try:
        time.sleep(0.3)  # a SUB socket gets messages from when its connection is up (ZMQ's slow joiner)
        follower.drain()
        prompts = [[rng.randrange(10, 400) for _ in range(100)] for _ in range(30)]  # 210 blocks > 128
        send(server, prompts)
        settle(server, follower)
        held = held_by_server(server)
        assert set(follower.blocks) == held and len(held) > 20
        evicted_any = any(prompt[:BLOCK_SIZE] not in [tokens for _, tokens in follower.blocks.values()]
                          for prompt in prompts[:5])
        assert evicted_any, "the pool did not overflow: nothing was evicted"
        # The newest prompt's blocks are there with their tokens, chained parent to child.
        last = prompts[-1]
        by_tokens = {tuple(tokens): (block_hash, parent) for block_hash, (parent, tokens) in follower.blocks.items()}
        first_hash, first_parent = by_tokens[tuple(last[:BLOCK_SIZE])]
        second_hash, second_parent = by_tokens[tuple(last[BLOCK_SIZE:2 * BLOCK_SIZE])]
        assert first_parent is None and second_parent == first_hash

        # A reset empties both.
        reset = httpx.post(f"{server.base_url}/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN}"},
                           timeout=30)
        assert reset.status_code == 200, reset.text
        settle(server, follower)
        assert follower.blocks == {} and held_by_server(server) == set()

        # A dropped connection: batches published meanwhile come back through the replay socket.
        follower.sub.close(linger=0)
        send(server, prompts[:3])
        follower.sub = follower._subscribe()
        time.sleep(0.3)
        send(server, [[rng.randrange(10, 400) for _ in range(40)]])  # a batch after the gap shows it
        settle(server, follower)
        assert follower.replayed > 0
        assert set(follower.blocks) == held_by_server(server) and follower.blocks
    finally:
        follower.close()


def test_bad_kv_events_config_names_the_field(tiny_model: Path):
    for config, message in (('{"publisher": "kafka"}', "kv_events_config.publisher must be 'null' or 'zmq'"),
                            ('{"buffer_steps": 0}', "kv_events_config.buffer_steps must be a positive integer"),
                            ('{"endpoints": "x"}', "kv_events_config has unknown field(s) endpoints"),
                            ("[1]", "kv_events_config must be a JSON object")):
        result = subprocess.run([sys.executable, "-m", "kvreuse.cli", "serve", "--model", str(tiny_model),
                                 "--device", "cpu", "--kv-events-config", config],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and message in result.stderr, (config, result.stderr[-2000:])
    # The server's own options are checked before torch is imported (the error comes in a fraction of a second).
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvreuse.cli", "serve", "--model",
                             str(tiny_model), "--kv-events-config", "[1]"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "kv_events_config must be a JSON object" in result.stderr
    assert not re.search(r"\|\s+torch$", result.stderr, re.MULTILINE), result.stderr[-2000:]
