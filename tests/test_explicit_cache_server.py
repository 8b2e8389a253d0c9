"""Explicit caching through a real server: saved system prompts, pins API, warm prompts, tenant
scoping of pins, and the Anthropic Messages API with cache_control breakpoints (official SDK)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from server_process import MODEL_NAME, RunningServer, start_server, stop_server

KEY_A, KEY_B, ADMIN = "pins-tenant-a", "pins-tenant-b", "pins-admin"
GREEDY = {"temperature": 0}  # current anthropic SDKs have no temperature argument; the API field still exists
SYSTEM = "You are a helpful Python programming assistant. Prefer the standard library. " * 8
WARM = "You review pull requests for a payments team. Be strict about money arithmetic. " * 8
TEAM = "You summarise incident reports for the on-call team. Lead with customer impact. " * 8


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("explicit")
    admin_file = folder / "admin-keys.txt"
    admin_file.write_text(f"# operators\n{ADMIN}\n")
    warm_file = folder / "warm.json"
    warm_file.write_text(json.dumps([WARM, {"messages": [{"role": "system", "content": TEAM}],
                                            "cache_salt": "public:team"}]))
    running = start_server(tiny_model, folder / "server.log", "--api-key", KEY_A, "--api-key", KEY_B,
                           "--admin-keys-file", str(admin_file), "--isolate-tenants", "--warm-prompts", str(warm_file), "--stats-log-interval", "0")
    yield running
    stop_server(running)


def openai_client(server: RunningServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def pins(server: RunningServer, key: str = KEY_A) -> list[dict]:
    response = httpx.get(f"{server.base_url}/v1/cache/pins", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    return response.json()["data"]


def ask(client: openai.OpenAI, system: str, question: str, **extra):
    return client.chat.completions.create(
        model=MODEL_NAME, max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        extra_body=extra or None,
    )


def test_warm_prompts_are_pinned_at_start_and_shared_only_by_public_salt(server: RunningServer):
    warm = [pin for pin in pins(server) if pin["kind"] == "warm"]
    assert len(warm) == 2 and all(pin["owner"] is None and pin["tokens"] > 100 for pin in warm)
    client = openai_client(server)
    shared = ask(client, TEAM, "Summarise INC-42.", cache_salt="public:team")
    assert shared.usage.prompt_tokens_details.cached_tokens >= min(pin["tokens"] for pin in warm)
    # Tenants are isolated: without the public salt, the tenant's own namespace has nothing cached.
    isolated = ask(client, WARM, "Is 0.1 + 0.2 safe?")
    assert isolated.usage.prompt_tokens_details.cached_tokens < 20


def test_save_system_prompt_then_reuse_without_flag(server: RunningServer):
    client = openai_client(server)
    first = ask(client, SYSTEM, "How do I read a CSV file?", save_system_prompt_kv_cache=True)
    saved = [pin for pin in pins(server) if pin["kind"] == "system_prompt"]
    assert len(saved) == 1 and saved[0]["tokens"] >= 100 and saved[0]["hits"] == 0
    assert first.usage.prompt_tokens_details.cached_tokens < 20
    second = ask(client, SYSTEM, "How do I write JSON?")
    assert second.usage.prompt_tokens_details.cached_tokens >= saved[0]["tokens"]
    assert [pin for pin in pins(server) if pin["id"] == saved[0]["id"]][0]["hits"] == 1

    # Tenant B neither sees nor deletes tenant A's pin; an admin key sees every tenant's pins.
    assert saved[0]["id"] not in {pin["id"] for pin in pins(server, KEY_B)}
    b_pin = ask(openai_client(server, KEY_B), SYSTEM + " (team B)", "Hi", save_system_prompt_kv_cache=True)
    assert b_pin.usage is not None
    b_ids = {pin["id"] for pin in pins(server, KEY_B) if pin["kind"] == "system_prompt"}
    assert len(b_ids) == 1 and not b_ids & {pin["id"] for pin in pins(server, KEY_A)}
    assert {saved[0]["id"], *b_ids} <= {pin["id"] for pin in pins(server, ADMIN)}
    denied = httpx.delete(f"{server.base_url}/v1/cache/pins/{saved[0]['id']}",
                          headers={"Authorization": f"Bearer {KEY_B}"})
    assert denied.status_code == 404 and denied.json()["error"]["param"] == "pin_id"
    deleted = httpx.delete(f"{server.base_url}/v1/cache/pins/{saved[0]['id']}",
                           headers={"Authorization": f"Bearer {KEY_A}"})
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert saved[0]["id"] not in {pin["id"] for pin in pins(server)}
    again = httpx.delete(f"{server.base_url}/v1/cache/pins/{saved[0]['id']}",
                         headers={"Authorization": f"Bearer {KEY_A}"})
    assert again.status_code == 404
    # An admin key may delete any tenant's pin.
    (b_id,) = b_ids
    by_admin = httpx.delete(f"{server.base_url}/v1/cache/pins/{b_id}", headers={"Authorization": f"Bearer {ADMIN}"})
    assert by_admin.status_code == 200 and by_admin.json()["pin"]["owner"] is not None
    assert b_id not in {pin["id"] for pin in pins(server, KEY_B)}


def test_save_flag_errors_are_400s_for_that_request_only(server: RunningServer):
    url, headers = f"{server.base_url}/v1/chat/completions", {"Authorization": f"Bearer {KEY_A}"}
    multimodal = httpx.post(url, headers=headers, json={
        "model": MODEL_NAME, "max_tokens": 1, "save_system_prompt_kv_cache": True,
        "messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM},
                                                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
                     {"role": "user", "content": "hi"}]})
    assert multimodal.status_code == 400
    assert "messages[0].content[1]" in multimodal.json()["error"]["message"]
    no_system = httpx.post(url, headers=headers, json={
        "model": MODEL_NAME, "max_tokens": 1, "save_system_prompt_kv_cache": True,
        "messages": [{"role": "user", "content": "hi"}]})
    assert no_system.status_code == 400 and "no system message" in no_system.json()["error"]["message"]
    fine = httpx.post(url, headers=headers, json={"model": MODEL_NAME, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert fine.status_code == 200
    assert httpx.get(f"{server.base_url}/v1/cache/pins").status_code == 401


def test_anthropic_sdk_round_trip_with_cache_usage(server: RunningServer):
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY_A, max_retries=0, timeout=60)
    system = [{"type": "text", "text": "You are a legal document analyst. Cite clause numbers. " * 10,
               "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model=MODEL_NAME, max_tokens=3, extra_body=GREEDY, system=system,
                                   messages=[{"role": "user", "content": "Analyze clause 4."}])
    usage = first.usage
    assert first.role == "assistant" and first.content[0].type == "text"
    assert usage.cache_read_input_tokens < 20 and usage.cache_creation_input_tokens > 100
    total = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    assert first.stop_reason == "max_tokens" and usage.output_tokens == 3

    second = client.messages.create(model=MODEL_NAME, max_tokens=3, extra_body=GREEDY, system=system,
                                    messages=[{"role": "user", "content": "Analyze clause 4."}])
    assert second.usage.cache_read_input_tokens >= usage.cache_creation_input_tokens - 16
    assert second.usage.input_tokens + second.usage.cache_creation_input_tokens \
        + second.usage.cache_read_input_tokens == total
    assert second.content[0].text == first.content[0].text  # greedy

    with client.messages.stream(model=MODEL_NAME, max_tokens=3, extra_body=GREEDY, system=system,
                                messages=[{"role": "user", "content": "Analyze clause 4."}]) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and "message_delta" in events
    assert final.content[0].text == first.content[0].text
    assert final.usage.cache_read_input_tokens >= usage.cache_creation_input_tokens - 16

    breakpoint_pins = [pin for pin in pins(server) if pin["kind"] == "breakpoint"]
    assert len(breakpoint_pins) == 1 and breakpoint_pins[0]["ttl"] == 300.0 and breakpoint_pins[0]["hits"] >= 2


def test_anthropic_errors(server: RunningServer):
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY_A, max_retries=0, timeout=60)
    block = {"type": "text", "text": "x " * 20, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    with pytest.raises(anthropic.BadRequestError, match="at most 4 blocks"):
        client.messages.create(model=MODEL_NAME, max_tokens=1, system=[block] * 5,
                               messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=MODEL_NAME, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    # The stop list cap of every API (64), under this API's field name; 64 are accepted.
    with pytest.raises(anthropic.BadRequestError, match=r"stop_sequences: .*at most 64"):
        client.messages.create(model=MODEL_NAME, max_tokens=1, stop_sequences=[f"s{i}" for i in range(65)],
                               messages=[{"role": "user", "content": "hi"}])
    capped = client.messages.create(model=MODEL_NAME, max_tokens=1, stop_sequences=[f"s{i}" for i in range(64)],
                                    messages=[{"role": "user", "content": "hi"}])
    assert capped.usage.output_tokens == 1
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other-model", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
