"""KV tiers through real servers: two kvreuse servers share prefixes through one real redis-server
(the usage extension shows the remote tokens, other tenants get none, a Redis that goes away turns
lookups into misses and requests still succeed), a server restarted on the same --kv-disk-dir hits
what the last one computed with the same greedy output, the per-tier /metrics counters, the reset
with tiers, the /v1/models remote card and the router's remote groups and cost."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import (
    MODEL_NAME,
    RunningServer,
    free_port,
    start_server,
    stop_server,
)

from kvreuse.cache.tiers.store import DEFAULT_WRITE_QUEUE_BYTES
from kvreuse.router.app import RouterConfig, RouterState
from kvreuse.router.backends import remote_group_of
from kvreuse.router.policy import (
    BackendLoad,
    PolicyConfig,
    Router,
    RouteRequest,
    prompt_block_keys,
)

REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").is_file()
                                                else None)
BY_TIER = "kvreuse_cached_tokens_by_tier"
SYSTEM = "You are a careful assistant for a shipping company. Answer in one short sentence. " * 4
OPTIONS = ("--stats-log-interval", "0")


# --- fixtures ---------------------------------------------------------------------------------------
class RedisProcess:
    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis

        self.client = redis.Redis.from_url(self.url, socket_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client.ping():
                    return
            except redis.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start (exit status {self.process.returncode})")
            time.sleep(0.05)

    def num_keys(self) -> int:
        return self.client.dbsize()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): the remote tier needs a real one")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install redis): the remote tier needs it")
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def remote_pair(tiny_model: Path, redis_server: RedisProcess,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, RunningServer]]:
    """Two servers on one Redis database, started side by side."""
    folder = tmp_path_factory.mktemp("remote-servers")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_server, tiny_model, folder / f"{name}.log", "--kv-remote-url", redis_server.url,
                               *OPTIONS) for name in ("a", "b")]
        servers = []
        try:
            for future in futures:
                servers.append(future.result())
        finally:
            if len(servers) < 2:
                for future in futures:
                    if future.exception() is None:
                        stop_server(future.result())
    yield servers[0], servers[1]
    for server in servers:
        stop_server(server)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(server: RunningServer, question: str, system: str = SYSTEM, **extra):
    return client(server).chat.completions.create(
        model=MODEL_NAME, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, **extra},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])


def by_tier(usage) -> dict[str, int]:
    return usage.prompt_tokens_details.model_dump()[BY_TIER]


def metrics(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels without model_name) -> value."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def tier_counter(server: RunningServer, name: str, tier: str) -> float:
    return metrics(server).get((f"kvreuse:kv_tier_{name}_total", (("tier", tier),)), 0.0)


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# --- remote tier: two servers, one Redis ------------------------------------------------------------
def test_model_cards_name_the_shared_remote_without_the_url(remote_pair, redis_server: RedisProcess):
    a, b = remote_pair
    cards = [client(server).models.list().data[0].model_dump() for server in (a, b)]
    assert cards[0]["kv_remote"] == cards[1]["kv_remote"]
    remote = cards[0]["kv_remote"]
    assert remote["url_digest"] == hashlib.blake2b(redis_server.url.encode(), digest_size=16).hexdigest()
    assert len(remote["fingerprint"]) == 32
    listing = httpx.get(f"{a.base_url}/v1/models").text
    assert "redis://" not in listing and "127.0.0.1" not in listing  # a digest, never the URL itself
    assert remote_group_of(cards[0]) == f"{remote['url_digest']}/{remote['fingerprint']}"


def test_second_server_serves_a_prefix_the_first_computed(remote_pair, redis_server: RedisProcess):
    a, b = remote_pair
    first = chat(a, "Where is my parcel?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert by_tier(first.usage) == {"device": 0, "remote": 0}
    full_blocks = first.usage.prompt_tokens // 16
    # Written through in the background: wait until A's writer has stored every full block.
    wait_for(lambda: tier_counter(a, "stores", "remote") >= full_blocks, "A's remote writes")
    assert redis_server.num_keys() >= full_blocks

    second = chat(b, "Where is my parcel?")
    split = by_tier(second.usage)
    # Every full block of the prompt (the last one too unless the prompt ends on a block boundary: one
    # token is always computed) came from the remote.
    assert split["device"] == 0 and (full_blocks - 1) * 16 <= split["remote"] <= full_blocks * 16
    assert second.usage.prompt_tokens_details.cached_tokens == sum(split.values())
    assert second.choices[0].message.content == first.choices[0].message.content  # the same greedy output

    # Streaming usage carries the split too (B now holds the system prompt in its own pool).
    stream = client(b).chat.completions.create(
        model=MODEL_NAME, max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And my invoice?"}])
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    split = by_tier(usage)
    assert set(split) == {"device", "remote"} and split["device"] > 0
    assert usage.prompt_tokens_details.cached_tokens == sum(split.values())

    # The Messages route reports the same split beside cache_read_input_tokens.
    reply = httpx.post(f"{b.base_url}/v1/messages", timeout=60, json={
        "model": MODEL_NAME, "max_tokens": 3, "system": SYSTEM, "temperature": 0,
        "messages": [{"role": "user", "content": "Where is my parcel?"}]}).json()
    assert sum(reply["usage"]["kvreuse_cache_read_input_tokens_by_tier"].values()) == \
        reply["usage"]["cache_read_input_tokens"] > 0

    assert tier_counter(b, "hits", "remote") >= full_blocks
    assert tier_counter(b, "hit_bytes", "remote") > 0 and tier_counter(b, "load_seconds", "remote") > 0
    assert tier_counter(a, "store_bytes", "remote") > 0 and tier_counter(a, "store_seconds", "remote") > 0
    assert tier_counter(b, "queries", "remote") >= tier_counter(b, "hits", "remote")
    failures = metrics(b)
    assert failures[("kvreuse:kv_tier_verify_failures_total", (("reason", "checksum"), ("tier", "remote")))] == 0


def test_another_tenant_gets_no_remote_hit(remote_pair):
    a, b = remote_pair
    salted = chat(b, "Where is my parcel?", cache_salt="tenant-two")
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert by_tier(salted.usage) == {"device": 0, "remote": 0}


def test_reset_clears_the_named_tiers(remote_pair, redis_server: RedisProcess):
    a, b = remote_pair
    bad = httpx.post(f"{b.base_url}/reset_prefix_cache", params={"tiers": "device,attic"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tiers"
    assert "attic" in bad.json()["error"]["message"]
    bad_body = httpx.post(f"{b.base_url}/reset_prefix_cache", json={"tiers": 3}, timeout=10)
    assert bad_body.status_code == 400 and bad_body.json()["error"]["param"] == "tiers"
    device_only = httpx.post(f"{b.base_url}/reset_prefix_cache", timeout=10)
    assert device_only.status_code == 200 and device_only.json()["tiers"] == ["device"]
    assert redis_server.num_keys() > 0  # the default leaves the shared remote alone

    reset = httpx.post(f"{b.base_url}/reset_prefix_cache", json={"tiers": ["device", "remote"]}, timeout=10)
    assert reset.status_code == 200, reset.text
    assert reset.json()["tiers"] == ["device", "remote"] and reset.json()["freed_blocks"] > 0
    assert redis_server.num_keys() == 0
    again = chat(b, "Where is my parcel?")  # gone from B's pool and from the remote
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    query = httpx.post(f"{a.base_url}/reset_prefix_cache?tiers=device", timeout=10)
    assert query.status_code == 200 and query.json()["tiers"] == ["device"]


def test_router_groups_backends_that_share_a_remote(remote_pair):
    a, b = remote_pair

    async def probe() -> tuple[str | None, str | None, dict]:
        state = RouterState(RouterConfig(backends=(a.base_url, b.base_url)))
        try:
            await state.start()
            return (state.router.remote_group(a.base_url), state.router.remote_group(b.base_url),
                    state.describe_remote_groups())
        finally:
            await state.client.aclose()

    group_a, group_b, groups = asyncio.run(probe())
    assert group_a is not None and group_a == group_b
    assert groups[group_a]["backends"] == [a.base_url, b.base_url]


def test_requests_succeed_as_misses_when_redis_goes_away(remote_pair, redis_server: RedisProcess):
    a, b = remote_pair
    system = SYSTEM + "Always be polite. " * 8
    warm = chat(a, "Can I change the address?", system=system)
    wait_for(lambda: redis_server.num_keys() >= warm.usage.prompt_tokens // 16, "A's remote writes")
    # A Redis that hangs (stopped, its socket still accepting): B's lookup times out and is a miss.
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        stalled = chat(b, "Can I change the address?", system=system)
        assert stalled.choices[0].finish_reason == "length" and by_tier(stalled.usage)["remote"] == 0
        assert time.monotonic() - started < 10  # 0.25 s socket timeouts, then misses without the network
    finally:
        redis_server.stop()  # and then gone altogether
    for server in (a, b, a):
        started = time.monotonic()
        reply = chat(server, "Can I change the address?", system=system + "Thank you. ")
        assert reply.choices[0].finish_reason == "length"
        assert by_tier(reply.usage)["remote"] == 0
        assert time.monotonic() - started < 10
    assert all(httpx.get(f"{s.base_url}/health", timeout=5).status_code == 200 for s in (a, b))
    assert metrics(b)[("kvreuse:kv_tier_queries_total", (("tier", "remote"),))] > 0


# --- disk tier: a restart on the same folder --------------------------------------------------------
def test_a_restarted_server_hits_its_disk_tier(tiny_model: Path, tmp_path: Path):
    disk = tmp_path / "kv-disk"
    prompt = "The warehouse in Rotterdam ships parcels to every port of the North Sea. " * 5
    server = start_server(tiny_model, tmp_path / "first.log", "--kv-disk-dir", str(disk), "--kv-disk-size",
                          "64MiB", *OPTIONS)
    try:
        first = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True})
        assert by_tier(first.usage) == {"device": 0, "disk": 0}
    finally:
        stop_server(server)  # SIGTERM: drain, then flush the queued disk writes
    assert server.process.returncode == 0
    assert "KV tiers flushed" in server.log_tail()
    full_blocks = first.usage.prompt_tokens // 16
    assert len(list(disk.rglob("*.kvb"))) >= full_blocks  # (a block of generated tokens may be there too)

    restarted = start_server(tiny_model, tmp_path / "second.log", "--kv-disk-dir", str(disk), *OPTIONS)
    try:
        again = client(restarted).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                                     extra_body={"ignore_eos": True})
        split = by_tier(again.usage)
        assert split["device"] == 0 and (full_blocks - 1) * 16 <= split["disk"] <= full_blocks * 16
        assert split["disk"] > 0 and again.usage.prompt_tokens_details.cached_tokens == split["disk"]
        assert again.choices[0].text == first.choices[0].text  # the same greedy output
        assert tier_counter(restarted, "hits", "disk") == split["disk"] // 16
        assert ("kvreuse:kv_tier_hits_total", (("tier", "remote"),)) not in metrics(restarted)
        reset = httpx.post(f"{restarted.base_url}/reset_prefix_cache?tiers=disk", timeout=10)
        assert reset.status_code == 200 and reset.json()["freed_blocks"] >= full_blocks
        assert not list(disk.rglob("*.kvb"))
    finally:
        stop_server(restarted)


def test_no_tiers_no_extension_and_no_tier_metrics(tiny_model: Path, tmp_path: Path):
    """Without tiers the usage object and /metrics are as before (checked in-process, no server)."""
    from kvreuse.server.metrics import ServerMetrics
    from kvreuse.server.protocol import usage

    assert usage(10, 2, 4) == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                               "prompt_tokens_details": {"cached_tokens": 4}}
    assert usage(10, 2, 4, {"device": 4, "disk": 0})["prompt_tokens_details"][BY_TIER] == {"device": 4, "disk": 0}

    class Stats:
        cache = type("Cache", (), {"query_tokens": 0, "hit_tokens": 0, "evicted_blocks": 0, "usage": 0.0,
                                   "state_snapshot_budget_bytes": 0})()  # no recurrent state: no snapshot gauges
        prompt_tokens = generation_tokens = num_preemptions = num_running = num_waiting = 0
        num_loras_resident = max_loras = 0
        running_adapters = waiting_adapters = ()
        spec_decode = None
        tiers = None

    plain = ServerMetrics("m", lambda: Stats()).render()[0].decode()
    assert "kv_tier" not in plain and "state_snapshot" not in plain
    Stats.tiers = {"disk": {"queries": 3, "hits": 2, "hit_bytes": 64, "stores": 5, "store_bytes": 90,
                            "load_seconds": 0.5, "store_seconds": 0.25, "write_errors": 4, "write_drops": 6,
                            "verify_failures": {"checksum": 1}}}
    text = ServerMetrics("m", lambda: Stats()).render()[0].decode()
    assert 'kvreuse:kv_tier_hits_total{model_name="m",tier="disk"} 2.0' in text
    assert 'kvreuse:kv_tier_verify_failures_total{model_name="m",reason="checksum",tier="disk"} 1.0' in text
    assert 'kvreuse:kv_tier_verify_failures_total{model_name="m",reason="key",tier="disk"} 0.0' in text
    # A truncated record is its own reason, at 0 from the first scrape; failed and dropped writes are counted.
    assert 'kvreuse:kv_tier_verify_failures_total{model_name="m",reason="truncated",tier="disk"} 0.0' in text
    assert 'kvreuse:kv_tier_write_errors_total{model_name="m",tier="disk"} 4.0' in text
    assert 'kvreuse:kv_tier_write_drops_total{model_name="m",tier="disk"} 6.0' in text


# --- flags -------------------------------------------------------------------------------------------
def test_tier_flags_reach_the_llm(monkeypatch: pytest.MonkeyPatch):
    import kvreuse.llm
    from kvreuse.engine_args import add_engine_arguments, llm_from_args, redact_url

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, default_model="m")
    args = parser.parse_args(["--kv-host-memory", "4GiB", "--kv-disk-dir", "/tmp/kv", "--kv-disk-size", "2GiB",
                              "--kv-remote-url", "redis://:secret@cache:6379/0", "--kv-write-queue-size", "64MiB"])
    seen = {}
    monkeypatch.setattr(kvreuse.llm, "LLM", lambda *a, **kw: seen.update(kw))
    llm_from_args(args)
    assert (seen["kv_host_memory"], seen["kv_disk_dir"], seen["kv_disk_size"], seen["kv_remote_url"]) == (
        4 << 30, "/tmp/kv", 2 << 30, "redis://:secret@cache:6379/0")
    assert seen["kv_write_queue_size"] == 64 << 20
    defaults = parser.parse_args([])
    assert (defaults.kv_host_memory, defaults.kv_disk_dir, defaults.kv_disk_size, defaults.kv_remote_url,
            defaults.kv_write_queue_size) == (0, None, 20 << 30, None, DEFAULT_WRITE_QUEUE_BYTES)
    for bad in (["--kv-remote-url", "http://cache:6379"], ["--kv-disk-size", "lots"], ["--kv-host-memory", "-1"],
                ["--kv-write-queue-size", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert redact_url("redis://user:secret@cache:6379/0") == "redis://user:***@cache:6379/0"
    assert "secret" not in redact_url("unix:///run/redis.sock?db=0&password=secret", mask="")


# --- router: remote groups in the cost model (pure) ---------------------------------------------------
BLOCK = 4


def _request(tokens: list[int]) -> RouteRequest:
    return RouteRequest(tuple(prompt_block_keys(tokens, BLOCK, model="m")), len(tokens))


def _fleet(config: PolicyConfig, *names: str) -> tuple[Router, dict[str, BackendLoad]]:
    router = Router(config)
    for name in names:
        router.index.add_backend(name, capacity_blocks=1000)
    return router, {name: BackendLoad() for name in names}


def test_router_counts_a_remote_hit_between_a_device_hit_and_a_miss():
    router, loads = _fleet(PolicyConfig(block_size=BLOCK), "a", "b", "c")
    router.set_remote_group("a", "redis-1/fp")
    router.set_remote_group("b", "redis-1/fp")
    prefix = list(range(100, 164))  # 16 blocks
    request = _request(prefix + [1, 2])
    router.record_sent("a", request)  # a computed it: in a's pool and in the group's remote
    # Costs: a device hit < a remote hit (b) < a miss (c).
    costs = {name: router._cost(request, name, BackendLoad()) for name in loads}
    miss = PolicyConfig().miss_cost_weight
    # The 2-token tail is a miss everywhere; the 64-token prefix is free on a, a quarter of a miss on b.
    assert costs == pytest.approx({"a": miss * 2, "b": miss * (2 + 0.25 * 64), "c": miss * 66})

    # a is busy: the request goes to b, which loads the prefix from the remote, not to the idle c.
    loads["a"].queued_prefill_tokens = 10_000
    decision = router.choose(request, loads, 0.0)
    assert decision.backend == "b" and decision.reason == "remote"
    assert decision.matched_blocks == 0 and decision.remote_blocks == 16 and decision.uncached_tokens == 2
    # Enough queued work on b as well makes the miss on c the cheaper choice.
    loads["b"].queued_prefill_tokens = 10_000
    assert router.choose(request, loads, 0.0).backend == "c"

    # A backend that fails loses its own entries, not its group's: the remote still holds the blocks.
    router.backend_failed("a")
    loads["b"].queued_prefill_tokens = 0
    assert router.choose(request, loads, 0.0, exclude=("a",)).remote_blocks == 16
    # The remote run starts where the backend's own blocks end.
    router.record_sent("b", _request(prefix[:16]))
    decision = router.choose(request, {"b": BackendLoad()}, 0.0)
    assert (decision.matched_blocks, decision.remote_blocks) == (4, 12)
    # Another remote (or none) shares nothing.
    router.set_remote_group("c", "redis-2/fp")
    assert router.choose(request, {"c": BackendLoad()}, 0.0).remote_blocks == 0
    router.set_remote_group("b", None)
    assert router.choose(request, {"b": BackendLoad()}, 0.0).remote_blocks == 0


def test_remote_hit_cost_weight_bounds_and_extremes():
    with pytest.raises(ValueError, match="remote_hit_cost_weight"):
        PolicyConfig(remote_hit_cost_weight=1.5)
    with pytest.raises(ValueError, match="remote_capacity_blocks"):
        PolicyConfig(remote_capacity_blocks=0)
    request = _request(list(range(32)))
    for weight, expected in ((0.0, "equal to a device hit"), (1.0, "equal to a miss")):
        router, _ = _fleet(PolicyConfig(block_size=BLOCK, remote_hit_cost_weight=weight), "a", "b", "c")
        router.set_remote_group("a", "g")
        router.set_remote_group("b", "g")
        router.record_sent("a", request)
        a, b, c = (router._cost(request, name, BackendLoad()) for name in ("a", "b", "c"))
        assert (b == a) if weight == 0.0 else (b == c), expected
    # Stored KV events of a group member count for the group.
    router, _ = _fleet(PolicyConfig(block_size=BLOCK), "a", "b")
    router.set_remote_group("a", "g")
    router.set_remote_group("b", "g")
    router.record_remote("a", request.block_keys[:3])
    assert router.choose(request, {"b": BackendLoad()}, 0.0).remote_blocks == 3


def test_the_router_applies_a_hybrid_groups_state_events_to_its_remote_index():
    """Issue 66, the proxy's side: a hybrid card puts its remote group in state mode, a member's state_stored
    event marks the state in the group as well, and its state_removed (the device pool's) leaves the group's copy."""
    a, b = "http://a:1", "http://b:2"
    state = RouterState(RouterConfig(backends=(a, b), policy=PolicyConfig(block_size=BLOCK)))
    request = _request(list(range(40)) + [7])
    keys = request.block_keys
    for name in (a, b):
        backend = state.pool.backends[name]
        backend.kv_remote, backend.recurrent_state = "redis/fp", True
        state._card_read(backend)
    state._apply_kv_events(state.pool.backends[a], [("stored", key) for key in keys])
    assert state.router.choose(request, {b: BackendLoad()}, 0.0).remote_blocks == 0
    state._apply_kv_events(state.pool.backends[a], [("state_stored", keys[5]), ("state_removed", keys[5])])
    assert state.router.index.matched_blocks(a, keys) == 0
    assert state.router.choose(request, {b: BackendLoad()}, 0.0).remote_blocks == 6


def test_remote_group_of_a_card():
    assert remote_group_of({"id": "m"}) is None
    assert remote_group_of({"kv_remote": {"url_digest": "d"}}) is None
    assert remote_group_of({"kv_remote": {"url_digest": "d", "fingerprint": "f"}}) == "d/f"
