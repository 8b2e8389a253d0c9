"""Structured outputs through the server, with the official clients: the openai SDK's ``.parse()`` with a
pydantic model (what it sends: $defs/$ref, anyOf with null, enums, additionalProperties false, strict),
streamed JSON, vLLM's ``structured_outputs`` on /v1/completions, LangChain's ``with_structured_output``
(json_schema), constraints that leave the prompt and its cache hits unchanged, and 400s naming the field."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_process import MODEL_NAME, RunningServer, start_server, stop_server


class Role(str, enum.Enum):
    admin = "admin"
    user = "user"


class Address(BaseModel):
    city: str = Field(max_length=5)
    zip: int = Field(ge=0, le=999)


class Person(BaseModel):
    name: str = Field(max_length=6)
    role: Role
    address: Address
    nickname: str | None = Field(max_length=4)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("so-server") / "server.log")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "system", "content": "You extract people as JSON."},
            {"role": "user", "content": "Ann is an admin in Paris, zip 75."}]


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, response_format=Person,
                                                   temperature=1.0, seed=seed, max_tokens=300)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person), choice.message.content


def test_streamed_json_matches_the_schema(client: openai.OpenAI) -> None:
    """The schema as the SDK sends it in strict mode (every object closed), streamed."""
    schema = openai.lib._pydantic.to_strict_json_schema(Person)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, stream=True, temperature=1.0, seed=11, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Person.model_validate_json(text)


def test_a_constraint_leaves_the_prompt_and_its_cache_hits_unchanged(client: openai.OpenAI) -> None:
    """The same messages with and without a response_format: the same prompt tokens, and the same hit (the
    whole prompt but its last token, once a first request has filled the prompt's last block)."""
    messages = [{"role": "system", "content": "Shared instructions for the cache test. " * 8},
                {"role": "user", "content": "Who is Ann?"}]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
    constrained = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0,
                                                 response_format={"type": "json_object"})
    again = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert plain.usage.prompt_tokens == constrained.usage.prompt_tokens == again.usage.prompt_tokens
    cached = constrained.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens_details.cached_tokens == constrained.usage.prompt_tokens - 1


def test_vllm_structured_outputs_on_completions(client: openai.OpenAI) -> None:
    choice = client.completions.create(model=MODEL_NAME, prompt="Pick one:", max_tokens=20, temperature=1.0, seed=4,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta") and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(model=MODEL_NAME, prompt="A code:", max_tokens=20, temperature=1.0, seed=5,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex.choices[0].text)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=1.0,
                                          extra_body={"structured_outputs": {"grammar": 'start: "yes" | "no"'}})
    assert chat.choices[0].message.content in ("yes", "no")


def test_langchain_with_structured_output_json_schema(server: RunningServer) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL_NAME, base_url=f"{server.base_url}/v1", api_key="unused", temperature=1.0,
                      max_tokens=300, seed=3, max_retries=0)
    person = chat.with_structured_output(Person, method="json_schema").invoke(
        [("system", MESSAGES[0]["content"]), ("user", MESSAGES[1]["content"])])
    assert isinstance(person, Person)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}}, "response_format.json_schema.schema.properties.x.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"structured_outputs": {"json": {"type": "object"}, "choice": ["a"]}}, "structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_field(server: RunningServer, body: dict, param: str) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    # The server goes on serving.
    ok = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                    json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    # ignore_eos: a sampled end-of-sequence token would end it early and say nothing about the server.
    assert ok.status_code == 200 and json.loads(ok.text)["choices"][0]["finish_reason"] == "length"
