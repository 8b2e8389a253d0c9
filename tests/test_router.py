"""The router over real server processes: three tiny-model servers and one router, on loopback ports."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import (
    MODEL_NAME,
    POLL,
    RunningServer,
    free_port,
    start_server,
    stop_server,
)

from kvreuse.bench.compare import wait_healthy

SERVER_ARGS = ("--kv-cache-memory", "16MiB")
# 16 MiB / (2 layers x K,V x 2 kv heads x 16 dims x 4 bytes x 16 tokens) = 2048 blocks per backend.
CAPACITY_BLOCKS = "2048"


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    logs = tmp_path_factory.mktemp("router-servers")
    started: list[RunningServer] = []
    try:
        for index in range(3):
            started.append(start_server(tiny_model, logs / f"server{index}.log", *SERVER_ARGS))
        yield started
    finally:
        for server in started:
            stop_server(server)


def start_router(backends: list[str], tokenizer: Path, log_path: Path, *extra: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    command = [sys.executable, "-m", "kvreuse.router", "--port", str(port), "--tokenizer", str(tokenizer),
               "--backend-capacity-blocks", CAPACITY_BLOCKS, "--retry-backoff", "0.05", *extra]
    for url in backends:
        command += ["--backend", url]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, 60, log_path.read_text, interval_s=0.1)
    except RuntimeError:
        process.kill()
        raise
    return url, process


@pytest.fixture(scope="module")
def router(servers: list[RunningServer], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    url, process = start_router([s.base_url for s in servers], tiny_model, log_path)
    yield url
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert status == 0, f"the router exited with {status} after SIGTERM:\n{log_path.read_text()[-3000:]}"


def backends_state(router_url: str) -> dict[str, dict]:
    return {b["url"]: b for b in POLL.get(f"{router_url}/backends", timeout=5).json()["backends"]}


def routed_counts(router_url: str) -> dict[str, int]:
    return {url: b["routed_requests"] for url, b in backends_state(router_url).items()}


def completion(url: str, prompt: str, max_tokens: int = 2, stream: bool = False, timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def words(seed: str, count: int) -> str:
    return " ".join(f"{seed}{i % 17}x{i}" for i in range(count))


def test_shared_prefix_lands_on_one_backend_and_hits(router: str) -> None:
    before = routed_counts(router)
    prefix = words("shared", 120)
    cached = []
    for question in range(5):
        reply = completion(router, f"{prefix} question {question}?")
        assert reply.status_code == 200, reply.text
        cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    delta = {url: count - before[url] for url, count in routed_counts(router).items()}
    assert sorted(delta.values()) == [0, 0, 5], delta
    assert cached[0] == 0 and min(cached[1:]) >= 160, cached  # the prefix is well over 10 blocks
    warm = next(url for url, count in delta.items() if count == 5)
    state = backends_state(router)[warm]
    assert state["estimated_cached_blocks"] >= 10
    # The index share of each backend is bounded by the KV pool the backend reports.
    card = httpx.get(f"{warm}/v1/models", timeout=10).json()["data"][0]
    assert state["capacity_blocks"] == card["kv_cache_blocks"] > 0
    # The backend's KV events reach the router: a reset there empties the router's view of it.
    deadline = time.monotonic() + 10
    while backends_state(router)[warm]["kv_events_applied"] < 10:
        assert time.monotonic() < deadline, backends_state(router)[warm]
        time.sleep(0.1)
    assert backends_state(router)[warm]["kv_events"] == "live"
    assert httpx.post(f"{warm}/reset_prefix_cache", timeout=10).json()["freed_blocks"] >= 10
    while backends_state(router)[warm]["estimated_cached_blocks"] > 0:
        assert time.monotonic() < deadline, backends_state(router)[warm]
        time.sleep(0.1)
    assert completion(router, f"{prefix} question again?").json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert state["reported_cached_tokens"] >= sum(cached)
    # A chat request with the same system prompt twice: the router's tokenizer keys match the engine's.
    messages = [{"role": "system", "content": words("system", 100)}, {"role": "user", "content": "hello"}]
    replies = [httpx.post(f"{router}/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0}) for _ in range(2)]
    assert replies[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100


def test_streaming_passes_through(router: str, servers: list[RunningServer]) -> None:
    reply = completion(router, words("stream", 30), max_tokens=4, stream=True)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line for line in reply.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: {") for event in events[:-1])
    assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 4
    # Errors pass through unchanged too.
    bad = httpx.post(f"{router}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "bogus": 1}, timeout=10)
    direct = httpx.post(f"{servers[0].base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "bogus": 1},
                        timeout=10)
    assert bad.status_code == direct.status_code == 400 and bad.json() == direct.json()
    assert httpx.get(f"{router}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL_NAME
    metrics = httpx.get(f"{router}/metrics", timeout=10).text
    assert "kvreuse_router:requests_total" in metrics and "kvreuse_router:healthy" in metrics


def test_hot_prefix_spreads_once_the_guard_trips(router: str) -> None:
    before = routed_counts(router)
    hot = words("hot", 120)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda i: completion(router, f"{hot} q{i}", max_tokens=24), range(12)))
    assert all(reply.status_code == 200 for reply in replies)
    delta = sorted(count - before[url] for url, count in routed_counts(router).items())
    assert sum(delta) == 12
    assert delta[-1] <= 8 and delta[-2] >= 2, delta  # spilled onto a second backend, not all on one


def test_killing_a_backend_loses_no_request_and_it_rejoins(router: str, servers: list[RunningServer],
                                                           tiny_model: Path, tmp_path: Path) -> None:
    prompts = [f"{words('load', 60)} {i % 4} request {i}" for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(completion, router, prompt, 32) for prompt in prompts]
        # The victim is the backend with the most requests in flight (the policy decides where they go).
        deadline = time.monotonic() + 10
        while True:
            in_flight = {url: b["in_flight"] for url, b in backends_state(router).items()}
            if max(in_flight.values()) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        victim_index = next(i for i, s in enumerate(servers) if s.base_url == max(in_flight, key=in_flight.get))
        victim = servers[victim_index]
        victim.process.kill()  # no drain: requests in flight there see their connection drop
        replies = [future.result() for future in futures]
    assert [reply.status_code for reply in replies] == [200] * len(prompts), [r.text for r in replies if r.status_code != 200]
    metrics = httpx.get(f"{router}/metrics", timeout=10).text
    retried = sum(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith('kvreuse_router:retries_total{reason="connection"}'))
    assert retried >= 1, "no request was in flight on the killed backend: the test proved nothing"
    time.sleep(1.5)
    state = backends_state(router)[victim.base_url]
    assert state["healthy"] is False and state["estimated_cached_blocks"] == 0
    # It comes back on the same port and rejoins.
    port = int(victim.base_url.rsplit(":", 1)[1])
    restarted = start_server(tiny_model, tmp_path / "restarted.log", *SERVER_ARGS, port=port)
    servers[victim_index] = restarted
    deadline = time.monotonic() + 10
    while not backends_state(router)[victim.base_url]["healthy"]:
        assert time.monotonic() < deadline, "the restarted backend did not rejoin"
        time.sleep(0.2)
    reply = completion(router, words("after", 40))
    assert reply.status_code == 200
