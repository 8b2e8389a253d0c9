"""Tool calling through the server, with the official clients: the openai SDK (``pydantic_function_tool`` with
``.parse()``, streamed tool calls, a tool loop fed back unchanged), LangChain's ``ChatOpenAI`` (``bind_tools``,
``with_structured_output(method="function_calling")``); the prompt is the same whatever ``tool_choice`` says;
every turn of a tool loop is served from the cache through the previous turn's prompt and generated tokens;
bad tools, tool choices and tool history are 400s naming the field.

The tiny qwen2 model (``kvreuse make-model``) has Qwen2.5's tool-aware template and ``<tool_call>`` tokens, so
the server chooses the hermes parser from its template. Its weights are random: calls are well formed because
the grammar forces them (``tool_choice`` required or a named function), and arguments are kept to enums, short
patterns and small integers so that every call ends well inside ``max_tokens``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_process import (
    MODEL_NAME,
    SERVER_OPTIONS,
    RunningServer,
    start_server,
    stop_server,
)

BLOCK_SIZE = 16  # the server's default --block-size


class GetWeather(BaseModel):
    """The weather forecast for a city, for one to nine days ahead."""

    city: Literal["Oslo", "Paris", "Lima", "Kyiv"]
    days: int = Field(ge=1, le=9)


class GetTime(BaseModel):
    """The current time in a time zone."""

    zone: Literal["UTC", "CET", "PST"]


def function_tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


# An agent's tool list: several hundred tokens of definitions that every turn resends (the tiny model's
# tokenizer spends about one token per two characters of JSON).
AGENT_TOOLS = [
    function_tool(
        "search_orders",
        "Search the customer's orders, newest first. Use it before promising anything about shipping.",
        {"status": {"type": "string", "enum": ["open", "shipped", "returned"]},
         "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
        ["status", "limit"]),
    function_tool(
        "lookup_book",
        "Look a book up in the catalogue by one lowercase word of its title: price and copies in stock.",
        {"keyword": {"type": "string", "pattern": "^[a-z]{2,8}$"}},
        ["keyword"]),
    function_tool(
        "open_ticket",
        "Open a ticket for the human team (damaged parcels, payment disputes, account deletion).",
        {"category": {"type": "string", "enum": ["damage", "payment", "account", "other"]},
         "urgent": {"type": "boolean"}},
        ["category", "urgent"]),
]
AGENT_SYSTEM = ("You are the support agent of an online bookshop. Answer with a tool call whenever a tool can "
                "help; keep answers short and friendly.")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("tools-server") / "server.log",
                           "--enable-auto-tool-choice")  # vLLM's flag: accepted, changes nothing
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "system", "content": "You call tools to answer."},
            {"role": "user", "content": "What is the weather in Oslo, and what time is it?"}]
PYDANTIC_TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]


def test_the_parser_is_chosen_from_the_template_and_an_unknown_one_fails_at_start(server: RunningServer,
                                                                                 tiny_model: Path) -> None:
    assert "tool calls: hermes parser (chosen from the chat template)" in server.log_tail(20_000)
    run = subprocess.run([sys.executable, "-m", "kvreuse.cli", "serve", "--model", str(tiny_model), *SERVER_OPTIONS,
                          "--tool-call-parser", "qwen"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "--tool-call-parser" in run.stderr and "hermes" in run.stderr and "llama3_json" in run.stderr \
        and "mistral" in run.stderr


def test_sdk_pydantic_function_tool_required_and_named(client: openai.OpenAI) -> None:
    """``.parse()`` with ``pydantic_function_tool`` (strict tools): a forced call's arguments validate against
    the model, for tool_choice required and for a named function."""
    named = {"type": "function", "function": {"name": "GetTime"}}
    for seed, tool_choice in enumerate(["required", named, "required", named]):
        completion = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, tools=PYDANTIC_TOOLS,
                                                   tool_choice=tool_choice, parallel_tool_calls=False,
                                                   temperature=1.0, seed=seed, max_tokens=120)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        parsed = call.function.parsed_arguments
        assert isinstance(parsed, {"GetWeather": GetWeather, "GetTime": GetTime}[call.function.name])
        assert parsed == type(parsed).model_validate_json(call.function.arguments)
        if tool_choice is named:
            assert call.function.name == "GetTime"


def collect_stream(stream) -> dict[int, dict]:
    """Per choice: the content, the calls (id, name, arguments) as the deltas add them up, the finish reason,
    and the number of chunks that carried the start of a call."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for choice in chunk.choices:
            state = choices.setdefault(choice.index, {"content": None, "calls": {}, "finish_reason": None})
            delta = choice.delta
            if delta.content:
                state["content"] = (state["content"] or "") + delta.content
            for piece in delta.tool_calls or []:
                if piece.index not in state["calls"]:
                    # The first delta of a call names it: id, type and function name.
                    assert piece.id and piece.type == "function" and piece.function.name
                    state["calls"][piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                state["calls"][piece.index]["arguments"] += piece.function.arguments or ""
            if choice.finish_reason is not None:
                assert state["finish_reason"] is None
                state["finish_reason"] = choice.finish_reason
    return choices


def test_streamed_tool_calls_add_up_to_the_non_streamed_call(client: openai.OpenAI) -> None:
    """The same seed streamed and not: the deltas (keyed by index, one extractor per sample, n=2) add up to the
    non-streamed message; parallel calls allowed, so a sample may make several (or be cut by max_tokens)."""
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=PYDANTIC_TOOLS, tool_choice="required", n=2,
                   temperature=1.0, seed=21, max_tokens=100)
    whole = client.chat.completions.create(**request)
    streamed = collect_stream(client.chat.completions.create(**request, stream=True))
    assert sorted(streamed) == [0, 1]
    for choice in whole.choices:
        pieces = streamed[choice.index]
        assert pieces["content"] == choice.message.content
        assert [(call["name"], call["arguments"]) for call in pieces["calls"].values()] == \
            [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
        assert list(pieces["calls"]) == list(range(len(choice.message.tool_calls)))
        assert pieces["finish_reason"] == choice.finish_reason
        # Calls, or calls cut by max_tokens (the random model may keep calling while parallel calls are allowed).
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
    # One call, ended by the grammar: the last chunk of the choice says tool_calls.
    one = dict(request, n=1, parallel_tool_calls=False, seed=5)
    single = client.chat.completions.create(**one)
    pieces = collect_stream(client.chat.completions.create(**one, stream=True))[0]
    assert single.choices[0].finish_reason == pieces["finish_reason"] == "tool_calls"
    assert [(call["name"], call["arguments"]) for call in pieces["calls"].values()] == \
        [(call.function.name, call.function.arguments) for call in single.choices[0].message.tool_calls]


def test_parallel_tool_calls_false_makes_exactly_one_call(client: openai.OpenAI) -> None:
    for seed in range(4):
        completion = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=PYDANTIC_TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        json.loads(choice.message.tool_calls[0].function.arguments)


def test_the_prompt_is_the_same_whatever_tool_choice_says(client: openai.OpenAI) -> None:
    """Constraints act on the logits only: none, auto, required and a named function send the same prompt
    (the tools are in it every time), so each later request hits all of it but the last token."""
    salt = f"choice-{uuid.uuid4().hex}"
    usages = []
    replies = []
    for tool_choice in ["none", "auto", "required", {"type": "function", "function": {"name": "GetWeather"}}]:
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=PYDANTIC_TOOLS, tool_choice=tool_choice, temperature=0,
            parallel_tool_calls=False, max_tokens=60, extra_body={"cache_salt": salt})
        usages.append(reply.usage)
        replies.append(reply.choices[0])
    prompt_tokens = {usage.prompt_tokens for usage in usages}
    assert len(prompt_tokens) == 1
    assert [usage.prompt_tokens_details.cached_tokens for usage in usages[1:]] == [prompt_tokens.pop() - 1] * 3
    assert replies[0].message.tool_calls is None and replies[0].finish_reason in ("stop", "length")
    assert replies[3].message.tool_calls[0].function.name == "GetWeather"


def test_langchain_bind_tools_and_structured_output_by_function_calling(server: RunningServer) -> None:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL_NAME, base_url=f"{server.base_url}/v1", api_key="unused", temperature=1.0,
                      max_tokens=120, seed=3, max_retries=0)
    prompt = [("system", MESSAGES[0]["content"]), ("user", MESSAGES[1]["content"])]
    for tool_choice, names in [("any", {"GetWeather", "GetTime"}), ("GetWeather", {"GetWeather"})]:
        reply = chat.bind_tools([GetWeather, GetTime], tool_choice=tool_choice, parallel_tool_calls=False)\
            .invoke(prompt)
        assert isinstance(reply, AIMessage) and len(reply.tool_calls) == 1
        call = reply.tool_calls[0]
        assert call["name"] in names
        {"GetWeather": GetWeather, "GetTime": GetTime}[call["name"]].model_validate(call["args"])
        assert reply.response_metadata["finish_reason"] == "tool_calls"
    weather = chat.with_structured_output(GetWeather, method="function_calling").invoke(prompt)
    assert isinstance(weather, GetWeather)


def test_a_tool_loop_reuses_every_previous_prompt_and_generation(client: openai.OpenAI, capsys) -> None:
    """Four turns driven by the SDK: tool_choice required (one call per turn), each reply's message appended
    unchanged, a tool result after it. Every turn after the first is served from the cache through the previous
    turn's whole prompt and generated tokens: all the KV that turn computed (its prompt and every generated
    token but the last, which ended it without being fed back), its partly filled last block included."""
    salt = f"agent-{uuid.uuid4().hex}"  # a namespace of its own: no other request can add to a hit
    messages: list = [{"role": "system", "content": AGENT_SYSTEM},
                      {"role": "user", "content": "Where is my parcel? And is 'dune' in stock?"}]
    turns = []
    for turn in range(4):
        completion = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=AGENT_TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=100 + turn, max_tokens=150, extra_body={"cache_salt": salt})
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        json.loads(call.function.arguments)
        usage = completion.usage
        turns.append((usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens))
        messages.append(choice.message)  # the reply as the SDK returned it, tool calls unchanged
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"result": f"turn {turn}: done", "items": [turn, turn + 1]})})
    with capsys.disabled():
        print(f"\ntool loop, block size {BLOCK_SIZE}: computed = the previous turn's prompt + generated - 1")
        for number, (prompt, generated, cached) in enumerate(turns):
            computed = turns[number - 1][0] + turns[number - 1][1] - 1 if number else 0
            print(f"  turn {number + 1}: prompt_tokens {prompt}, completion_tokens {generated}, cached_tokens {cached}"
                  f" (computed {computed}, in full blocks {computed // BLOCK_SIZE * BLOCK_SIZE})")
    assert turns[0][0] > 500  # the tools and the system prompt are several hundred tokens
    for (prompt, generated, _), (next_prompt, _, cached) in zip(turns, turns[1:]):
        computed = prompt + generated - 1  # the call's last token ended the sample without being fed back
        assert next_prompt > prompt + generated
        # Every computed token: the full blocks and the partly filled last block (a finished sequence's tail).
        assert cached == computed


BAD_TOOL_REQUESTS = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [PYDANTIC_TOOLS[0], {"type": "function", "function": {"description": "no name"}}]},
     "tools[1].function.name"),
    ({"tools": [PYDANTIC_TOOLS[0], PYDANTIC_TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]}, "tools[0].function.parameters.properties.x.type"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "GetTime", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"}]}, "messages[3].tool_call_id"),
    ({"messages": MESSAGES + [{"role": "tool", "tool_call_id": "c1", "content": "12:00"}]},
     "messages[2].tool_call_id"),
    ({"messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "GetTime", "arguments": ["not", "text"]}}]}]},
     "messages[2].tool_calls[0].function.arguments"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOL_REQUESTS,
                         ids=[f"{param}-{index}" for index, (_, param) in enumerate(BAD_TOOL_REQUESTS)])
def test_bad_tool_requests_are_400s_naming_the_field(server: RunningServer, fields: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": PYDANTIC_TOOLS, "tool_choice": "required",
            "max_tokens": 5, **fields}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_server_keeps_serving_after_bad_tool_requests(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tool_choice.function.name"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=PYDANTIC_TOOLS, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=PYDANTIC_TOOLS, max_tokens=120,
                                           tool_choice="required", parallel_tool_calls=False, seed=1)
    assert reply.choices[0].finish_reason == "tool_calls"
