"""kvreuse on Ray Serve, end to end: a real Ray cluster (one head, two worker nodes, started with ``ray start`` by
the suite's ``ray_address`` fixture, tests/ray_cluster.py), the documented ``kvreuse serve --ray-address auto
...`` command as typed, the official openai and anthropic SDKs as clients.

What is measured comes from the replicas themselves: which replica answered (its ``x-kvreuse-replica``
header) and the prompt tokens it reused (``cached_tokens``), never the router's belief. One deployment is
shared by the tests, in this order: prefix affinity, a hot prefix spilling to the second replica, SIGKILL
of one replica's process under load (nothing lost, Ray restarts it, routing by cache resumes).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ports
import pytest
import ray_cluster
from server_process import POLL

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")

from openai import APIError, AsyncOpenAI, OpenAI  # noqa: E402

BASE_URL = "http://127.0.0.1:8100"
MODEL = "./qwen05"  # the served name: the documented command names the model folder so
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def engine_replicas() -> dict[int, int]:
    """pid -> parent pid (its node's raylet) of every engine replica process."""
    listing = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    replicas = {}
    for line in listing.splitlines():
        pid, ppid, args = line.strip().split(None, 2)
        if args.startswith("ray::ServeReplica:kvreuse:kvreuse-engine"):
            replicas[int(pid)] = int(ppid)
    return replicas


@pytest.fixture(scope="module")
def deployment(ray_address: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """The documented command, as typed, in a folder where ./qwen05 is the tiny model; Ray Serve's port held
    (tests/ports.py) from before the deployment until its application is deleted, so no other deployment of
    the suite shares the proxy meanwhile."""
    folder = tmp_path_factory.mktemp("ray")
    (folder / "qwen05").symlink_to(tiny_model)
    log = folder / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_ADDRESS=ray_address)
    with ports.holding([ray_cluster.SERVE_PORT]):
        with open(log, "wb") as out:
            process = subprocess.Popen(["bash", "-c", ray_cluster.SERVE_COMMAND], cwd=folder, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                assert process.poll() is None, log.read_text()[-4000:]
                if "serving on" in log.read_text() and len(engine_replicas()) == 2:
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"the Ray deployment did not come up:\n{log.read_text()[-4000:]}")
            answer = POLL.post(f"{BASE_URL}/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 1})
            assert answer.status_code == 200, answer.text
            yield process
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    assert process.wait(120) == 0, log.read_text()[-4000:]
                finally:
                    if process.poll() is None:
                        ports.kill_tree(process.pid)


def document(i: int, words: int = 120) -> str:
    """A prompt of its own from the first token (so no two share a block)."""
    return f"{WORDS[i % len(WORDS)]}{i} " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] + str(j % 10) for j in range(words))


def ask(client: OpenAI, prompt: str, max_tokens: int = 2) -> tuple[str, int, int]:
    """(replica, cached tokens, prompt tokens) of one completion, from the replica's own answer."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
    body = raw.parse()
    return raw.headers["x-kvreuse-replica"], body.usage.prompt_tokens_details.cached_tokens, body.usage.prompt_tokens


def test_one_http_entry_and_no_second_deployment_under_its_name(deployment: subprocess.Popen, ray_address: str,
                                                                tiny_model: Path, tmp_path: Path):
    """One proxy listens on the port (HeadOnly: proxies of several nodes on one machine would share it through
    SO_REUSEPORT, and one still starting answers 404); the documented command run again while the first
    deployment serves is refused, naming the application, and the first one goes on serving."""
    listeners = ports.listeners(ray_cluster.SERVE_PORT)
    assert len({process.pid for process in listeners}) == 1, [ports.describe(process) for process in listeners]
    (tmp_path / "qwen05").symlink_to(tiny_model)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_ADDRESS=ray_address)
    second = subprocess.run(["bash", "-c", ray_cluster.SERVE_COMMAND], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=180)
    assert second.returncode != 0 and "already runs an application named 'kvreuse'" in second.stderr, (
        second.returncode, second.stdout[-2000:], second.stderr[-3000:])
    answer = POLL.post(f"{BASE_URL}/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 1})
    assert answer.status_code == 200, answer.text


def test_replicas_run_one_per_node_and_each_prefix_stays_where_it_is_cached(deployment: subprocess.Popen):
    replicas = engine_replicas()
    assert len(set(replicas.values())) == 2, f"two engine replicas on two nodes: {replicas}"
    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0)
    first = {i: ask(client, document(i) + " first question") for i in range(6)}
    # New prefixes spread over the replicas (ties go to the emptiest index) ...
    assert len({replica for replica, _, _ in first.values()}) == 2, first
    for round_ in range(2):
        for i in range(6):
            replica, cached, prompt_tokens = ask(client, document(i) + f" question {round_}")
            # ... and every later request of a prefix goes where it is cached, and is a hit there.
            assert replica == first[i][0], (i, replica, first[i])
            assert cached >= 0.8 * prompt_tokens, (i, cached, prompt_tokens)


@pytest.mark.alone  # its timing needs the CPU: the other xdist worker waits
def test_a_hot_prefix_spills_to_the_other_replica(deployment: subprocess.Popen):
    prefix = document(40, words=200)

    async def burst() -> list[tuple[str, int]]:
        client = AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> tuple[str, int]:
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt=f"{prefix} request {i}", max_tokens=48, extra_body={"ignore_eos": True})
            return raw.headers["x-kvreuse-replica"], raw.parse().usage.prompt_tokens_details.cached_tokens

        first = await one(0)  # the prefix is cached on one replica
        rest = await asyncio.gather(*(one(i) for i in range(1, 12)))
        await client.close()
        return [first, *rest]

    served = asyncio.run(burst())
    replicas = {replica for replica, _ in served}
    assert len(replicas) == 2, f"12 concurrent requests on one prefix stayed on one replica: {served}"
    hits = sum(1 for _, cached in served if cached > 100)
    assert hits >= 8, f"the spill computes the prefix once on the other replica, then hits there too: {served}"


@pytest.mark.alone  # its timing needs the CPU: the other xdist worker waits
def test_sigkill_of_a_replica_under_load_loses_nothing_and_ray_restarts_it(deployment: subprocess.Popen):
    before = engine_replicas()
    assert len(before) == 2

    async def load() -> list[tuple[str, object]]:
        client = AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0, timeout=120)

        async def whole(i: int) -> tuple[str, object]:
            answer = await client.completions.create(model=MODEL, prompt=document(60 + i, 40), max_tokens=400,
                                                     extra_body={"ignore_eos": True})
            return "whole", answer.choices[0].finish_reason

        async def streamed(i: int) -> tuple[str, object]:
            tokens = 0
            try:
                stream = await client.completions.create(model=MODEL, prompt=document(70 + i, 40), max_tokens=400,
                                                         stream=True, extra_body={"ignore_eos": True})
                finish = None
                async for chunk in stream:
                    tokens += 1
                    finish = chunk.choices[0].finish_reason if chunk.choices else finish
                return "streamed", finish
            except APIError as error:  # the error event a broken stream ends with
                return "stream-error", (tokens, str(error))

        async def kill_one() -> None:
            await asyncio.sleep(0.6)
            os.kill(next(iter(before)), signal.SIGKILL)

        results = await asyncio.gather(*(whole(i) for i in range(4)), *(streamed(i) for i in range(4)), kill_one())
        await client.close()
        return [r for r in results if r is not None]

    results = asyncio.run(asyncio.wait_for(load(), 180))  # nothing hangs
    whole = [finish for kind, finish in results if kind == "whole"]
    # A whole reply is sent once the request finished: a replica dying before that had sent nothing, so
    # the request went to the other replica and completed.
    assert whole == ["length"] * 4, results
    for kind, outcome in results:
        if kind == "stream-error":
            tokens, message = outcome
            assert tokens > 0 and "not retried" in message, outcome  # it had produced tokens: not sent again
        elif kind == "streamed":
            assert outcome == "length", outcome
    # Ray replaces the dead replica; the new one takes requests and builds its own cache.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (len(engine_replicas()) < 2 or set(engine_replicas()) == set(before)):
        time.sleep(0.5)
    after = engine_replicas()
    assert len(after) == 2 and set(after) != set(before), (before, after)
    # Once Ray reports it running, new prefixes reach it (the emptiest index) and stay where they are cached.
    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0)
    served: dict[int, str] = {}
    deadline = time.monotonic() + 60
    while len(set(served.values())) < 2 and time.monotonic() < deadline:
        i = 90 + len(served)
        served[i] = ask(client, document(i) + " q")[0]
        time.sleep(0.2)
    assert len(set(served.values())) == 2, f"no new prefix reached the restarted replica: {served}"
    for i, replica in served.items():
        again, cached, prompt_tokens = ask(client, document(i) + " again")
        assert again == replica and cached >= 0.8 * prompt_tokens, (i, replica, again, cached, prompt_tokens)


def test_anthropic_messages_and_streams_pass_through(deployment: subprocess.Popen):
    import anthropic

    client = anthropic.Anthropic(base_url=BASE_URL, api_key="unused", max_retries=0)
    system = document(120, words=100)
    usages = []
    for turn in range(2):
        message = client.messages.create(model=MODEL, max_tokens=4, system=system,
                                         messages=[{"role": "user", "content": f"question {turn}"}])
        usages.append(message.usage)
    assert usages[1].cache_read_input_tokens >= 0.8 * usages[1].input_tokens + 0, usages
    with client.messages.stream(model=MODEL, max_tokens=6, system=system,
                                messages=[{"role": "user", "content": "question 3"}]) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens == 6 and final.usage.cache_read_input_tokens > 0
    # An unknown path and a bad body are the server's own answers, not the ingress's.
    assert httpx.get(f"{BASE_URL}/v1/nothing-here").status_code == 404
    bad = httpx.post(f"{BASE_URL}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_the_config_file_entry_builds_the_same_application():
    from ray.serve import Application

    import kvreuse.ray
    from kvreuse.ray.options import options_from_mapping

    args, options = options_from_mapping({"model": "./qwen05", "max_model_len": 512, "enable_prefix_caching": False,
                                          "api_key": ["a", "b"], "num_replicas": 3,
                                          "kv_events_config": {"enable_kv_cache_events": True}})
    assert (args.model, args.max_model_len, args.enable_prefix_caching, args.api_key) == ("./qwen05", 512, False,
                                                                                           ["a", "b"])
    assert args.kv_events_config == '{"enable_kv_cache_events": true}' and options.num_replicas == 3
    assert isinstance(kvreuse.ray.app({"model": "./qwen05", "request_router": "pow2"}), Application)
    for bad, named in (({"model": "m", "max_num_seq": 4}, "max_num_seq"), ({"model": "m", "num_replicas": 0}, "num_replicas"),
                       ({"model": "m", "max_model_len": "many"}, "--max-model-len"),
                       ({"model": "m", "routing_policy": {"max_load_ratio": 0.5}}, "max_load_ratio")):
        with pytest.raises(ValueError, match=named):
            kvreuse.ray.app(bad)


def test_a_proxy_serve_replaces_while_starting_is_waited_for_not_a_failed_deployment(monkeypatch):
    """Serve's controller replaces a proxy slower than 5 s to report ready (a loaded 2-core machine: seen in a
    fresh-clone CI run), and ``serve.start`` then raises the first proxy's ActorDiedError though Serve is up.
    ``start_serve`` connects again and waits for the new proxy. Serve is faked here: a proxy that slow cannot be
    made on demand."""
    from ray.exceptions import ActorDiedError
    from ray.serve.schema import ProxyStatus, ServeStatus

    from kvreuse.ray import builder

    starts: list[tuple] = []
    statuses = iter([{"node": ProxyStatus.UNHEALTHY}, {"node": ProxyStatus.STARTING}, {"node": ProxyStatus.HEALTHY}])
    seen: list[dict] = []

    def start(proxy_location, http_options):
        starts.append((proxy_location, http_options.host, http_options.port))
        if len(starts) == 1:
            raise ActorDiedError()

    def status():
        seen.append(next(statuses))
        return ServeStatus(proxies=seen[-1])

    monkeypatch.setattr(builder.serve, "start", start)
    monkeypatch.setattr(builder.serve, "status", status)
    monkeypatch.setattr(builder.time, "sleep", lambda seconds: None)
    builder.start_serve("EveryNode", "127.0.0.1", 8100)
    assert starts == [("EveryNode", "127.0.0.1", 8100)] * 2 and len(seen) == 3  # returned once the proxy was healthy
    # A proxy that never becomes healthy is an error that says so, not a deployment that serves nothing.
    starts.clear()
    monkeypatch.setattr(builder.serve, "status", lambda: ServeStatus(proxies={"node": ProxyStatus.UNHEALTHY}))
    with pytest.raises(RuntimeError, match="proxies are not healthy after 0 s"):
        builder.start_serve("EveryNode", "127.0.0.1", 8100, proxy_deadline_s=0.0)
