"""The router's readers without servers: a backend's /metrics, the usage in replies, prompts to block keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvreuse.inputs import InputProcessor
from kvreuse.router.app import RouterConfig, RouterState, UsageReader
from kvreuse.router.backends import parse_metrics
from kvreuse.router.policy import prompt_block_keys
from kvreuse.tokenizer import Tokenizer


def test_parse_metrics_reads_the_scraped_samples_of_a_real_exposition() -> None:
    registry = CollectorRegistry()
    Gauge("kvreuse:kv_cache_usage_perc", "KV usage", ["model_name"], registry=registry).labels("m").set(0.25)
    Gauge("kvreuse:num_requests_waiting", "waiting", ["model_name"], registry=registry).labels("m").set(3)
    Counter("kvreuse:prefix_cache_hits", "hits", ["model_name"], registry=registry).labels("m").inc(30)
    Counter("kvreuse:prefix_cache_queries", "queries", ["model_name"], registry=registry).labels("m").inc(120)
    Gauge("kvreuse:other", "not read", registry=registry).set(7)
    values = parse_metrics(generate_latest(registry).decode())
    assert values == {"kvreuse:kv_cache_usage_perc": 0.25, "kvreuse:num_requests_waiting": 3.0,
                      "kvreuse:prefix_cache_hits_total": 30.0, "kvreuse:prefix_cache_queries_total": 120.0}


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"


USAGE = {"prompt_tokens": 40, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 32}}


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
def test_usage_is_read_from_the_last_sse_usage_chunk_whatever_the_chunking(chunk_size: int) -> None:
    stream = sse({"choices": [{"text": "a \"usage\": {\"prompt_tokens\": 9}"}], "usage": None},
                 {"choices": [], "usage": USAGE})
    reader = UsageReader("text/event-stream; charset=utf-8")
    for start in range(0, len(stream), chunk_size):
        reader.feed(stream[start:start + chunk_size])
    assert reader.usage() == USAGE


def test_usage_of_json_replies_and_of_replies_without_one() -> None:
    body = json.dumps({"choices": [], "usage": USAGE}).encode()
    reader = UsageReader("application/json")
    reader.feed(body[:10])
    reader.feed(body[10:])
    assert reader.usage() == USAGE
    cut = UsageReader("application/json")
    cut.feed(body[:-5])  # the backend died mid-reply
    assert cut.usage() is None
    no_usage = UsageReader("text/event-stream")
    no_usage.feed(sse({"choices": [], "usage": None}))
    assert no_usage.usage() is None
    other = UsageReader("text/plain")
    other.feed(b'{"usage": {"prompt_tokens": 1}}')
    assert other.usage() is None


def test_bad_requests_route_anywhere_and_good_ones_by_the_servers_tokens(tiny_model: Path) -> None:
    state = RouterState(RouterConfig(backends=("http://a",), tokenizer=str(tiny_model)))
    bad_bodies = [{"messages": "hello"}, {"messages": [{"role": "robot", "content": "x"}]},
                  {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}]
    for body in bad_bodies:  # the backend answers these with its 400
        assert state.route_request(body, chat=True, session_id=None).block_keys == ()
    assert state.route_request({"prompt": 5}, chat=False, session_id=None).block_keys == ()
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hi"}]
    server_inputs = InputProcessor(Tokenizer(str(tiny_model)))
    token_ids = server_inputs.from_messages(messages).token_ids
    route = state.route_request({"model": "m", "messages": messages}, chat=True, session_id=None)
    block_size = state.config.policy.block_size
    assert route.num_prompt_tokens == len(token_ids) >= block_size
    assert list(route.block_keys) == prompt_block_keys(token_ids, block_size, model="m")


def test_isolated_tenants_are_keyed_as_the_servers_key_them(tiny_model: Path) -> None:
    """With --isolate-tenants the router derives each request's salt from its API key by the servers'
    own rule, so tenant A's cached prefix never draws tenant B's requests, and a public: salt is shared."""
    from kvreuse.server.auth import ApiKeyAuth

    state = RouterState(RouterConfig(backends=("http://a",), tokenizer=str(tiny_model), isolate_tenants=True))
    server_auth = ApiKeyAuth(["key-a", "key-b"], isolate_tenants=True)
    body = {"model": "m", "messages": [{"role": "system", "content": "You are terse. " * 20},
                                       {"role": "user", "content": "hi"}]}
    token_ids = InputProcessor(Tokenizer(str(tiny_model))).from_messages(body["messages"]).token_ids
    block_size = state.config.policy.block_size
    for key in ("key-a", "key-b"):
        route = state.route_request(body, chat=True, session_id=None, authorization=f"Bearer {key}")
        salt = server_auth.cache_salt(server_auth.authenticate(f"Bearer {key}"), None)
        assert list(route.block_keys) == prompt_block_keys(token_ids, block_size, cache_salt=salt, model="m")
    a = state.route_request(body, chat=True, session_id=None, authorization="Bearer key-a").block_keys
    b = state.route_request(body, chat=True, session_id=None, authorization="Bearer key-b").block_keys
    assert not set(a) & set(b)
    shared = dict(body, cache_salt="public:team")
    assert state.route_request(shared, chat=True, session_id=None, authorization="Bearer key-a").block_keys == \
        state.route_request(shared, chat=True, session_id=None, authorization="Bearer key-b").block_keys


def test_a_backend_dying_while_its_connection_is_made_is_retried_elsewhere_not_a_500(tiny_model: Path) -> None:
    """httpcore over anyio can raise AttributeError, not a transport error, when the backend's socket closes while the
    connection is being made (``getpeername`` on the socket anyio dropped: seen when test_router's backend was killed
    under load). The router takes it as that backend failing: it retries the request on another backend and takes
    the first out of rotation. The backends here are an httpx transport that fails that way once (the real race
    cannot be timed from a test)."""
    import asyncio

    import httpx

    from kvreuse.router.app import build_router_app

    sent: list[str] = []

    def backend(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return httpx.Response(200, json={})  # /health, /metrics
        sent.append(request.url.host)
        if len(sent) == 1:
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        body = json.dumps({"choices": [{"index": 0, "text": "ok"}], "usage": {"prompt_tokens": 3}}).encode()
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(body))

    async def run() -> httpx.Response:
        client = httpx.AsyncClient(transport=httpx.MockTransport(backend))
        state = RouterState(RouterConfig(backends=("http://a", "http://b"), tokenizer=str(tiny_model)), client)
        await state.pool.probe_all()
        app = build_router_app(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as router:
            reply = await router.post("/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 1})
        assert not state.pool.backends[f"http://{sent[0]}"].load.healthy
        await client.aclose()
        return reply

    reply = asyncio.run(run())
    assert reply.status_code == 200, reply.text
    assert len(sent) == 2 and sent[0] != sent[1]
