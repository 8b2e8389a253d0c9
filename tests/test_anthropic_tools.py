"""Anthropic Messages tool use: tools, tool_choice, tool_use / tool_result blocks, streamed input_json_delta,
and cache_control on the tools, through a real server driven by the official ``anthropic`` SDK.

The pieces are checked in-process first: the conversation as the chat template gets it, Anthropic's rules
for tool blocks and the 400s naming the field, and the content blocks a reply's text makes (streamed piece
by piece or whole: the same blocks). Then the server: a tool loop of three turns with the results fed back,
each turn reading the whole previous prompt and generation from the cache; streamed tool use equal to the
non-streamed reply; tool_choice any / tool / none; a breakpoint on the last tool pinning the system prompt
and the tools, read back by the next request. The tiny model's weights are random: calls are forced by
tool_choice (the hermes grammar in the model's own format), so what is checked is the shape and the cache,
never what the model chose to say.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from server_process import MODEL_NAME, RunningServer, start_server, stop_server

from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import InputProcessor
from kvreuse.server.anthropic_protocol import (
    AnthropicMessage,
    ContentBlocks,
    MessagesRequest,
    ToolSetup,
    blocks_of,
    check_tool_history,
    field_path,
    openai_messages,
    tool_setup,
)
from kvreuse.server.errors import APIError
from kvreuse.tokenizer import Tokenizer
from kvreuse.tool_parsers import HermesToolParser

GREEDY = {"temperature": 0}  # current anthropic SDKs have no temperature argument; the API field still exists
WEATHER = {"name": "get_weather", "description": "The weather in a city, now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "description": "The local time in a city.",
         "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
TOOLS = [WEATHER, CLOCK]
SYSTEM = "You are a travel agent. Use the tools to answer; say which tool told you what."


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": MODEL_NAME, "max_tokens": 8, **fields})


# --- in-process: the conversation, the rules, the content blocks -------------------------------------------------


def test_tool_blocks_become_the_templates_tool_calls_and_tool_messages() -> None:
    body = request(system=SYSTEM, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no clock"}],
             "is_error": True},
            {"type": "text", "text": "Thanks."}]},
    ])
    check_tool_history(body.messages)
    converted = openai_messages(blocks_of(body.system), [blocks_of(m.content) for m in body.messages],
                                [m.role for m in body.messages])
    assert converted == [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather and time in Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no clock"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ]
    setup = tool_setup(body, HermesToolParser())
    assert [tool["function"]["parameters"] for tool in setup.tools] == [WEATHER["input_schema"], CLOCK["input_schema"]]
    assert setup.parser is not None and setup.constraint is None  # auto without strict tools: nothing enforced


def test_the_rules_for_tool_blocks_and_tools_name_the_field() -> None:
    def history_error(messages: list[dict]) -> str | None:
        with pytest.raises(APIError) as caught:
            check_tool_history([AnthropicMessage.model_validate(message) for message in messages])
        assert caught.value.status_code == 400 and caught.value.message.startswith(caught.value.param)
        return caught.value.param

    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    assert history_error([{"role": "user", "content": [result]}]) == "messages[0].content[0].tool_use_id"
    assert history_error([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [call]},
                          {"role": "user", "content": [dict(result, tool_use_id="toolu_9")]}]) \
        == "messages[2].content[0].tool_use_id"
    assert history_error([{"role": "assistant", "content": [call]},
                          {"role": "user", "content": [{"type": "text", "text": "x"}, result]}]) == "messages[1].content[1]"
    assert history_error([{"role": "user", "content": [call]}]) == "messages[0].content[0].type"

    def setup_error(**fields) -> str | None:
        with pytest.raises(APIError) as caught:
            tool_setup(request(messages=[{"role": "user", "content": "hi"}], **fields), HermesToolParser())
        assert caught.value.message.startswith(caught.value.param), caught.value.message
        return caught.value.param

    assert setup_error(tools=TOOLS, tool_choice={"type": "tool", "name": "get_news"}) == "tool_choice.name"
    assert setup_error(tools=TOOLS, tool_choice={"type": "any", "name": "get_time"}) == "tool_choice.name"
    assert setup_error(tool_choice={"type": "any"}) == "tool_choice"
    assert setup_error(tools=[WEATHER, WEATHER]) == "tools[1].name"
    assert setup_error(tools=[dict(WEATHER, input_schema={"type": "objekt"})]).startswith("tools[0].input_schema")
    assert setup_error(tools=[dict(WEATHER, name="get weather")]) == "tools[0].name"
    with pytest.raises(APIError, match="^tools: this model's chat template"):
        tool_setup(request(messages=[{"role": "user", "content": "hi"}], tools=TOOLS), None)
    # tool_choice none keeps the tools in the prompt and reads no calls; without a parser too.
    none = tool_setup(request(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice={"type": "none"}),
                      None)
    assert none.parser is None and none.constraint is None and len(none.tools) == 2
    forced = tool_setup(request(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}),
                        HermesToolParser())
    assert forced.constraint is not None and forced.constraint.field == "tools"
    assert "get_time" in forced.constraint.grammar and "get_weather" not in forced.constraint.grammar
    assert field_path(("messages", 0, "content", "list[tagged-union[TextBlock,ToolUseBlock]]", 1, "tool_use",
                       "input")) == "messages[0].content[1].input"
    assert field_path(("messages", 0, "content", "list[...]", 0, "text", "text")) == "messages[0].content[0].text"
    assert isinstance(ToolSetup().tools, list) and not InvalidRequestError("x").param


def test_content_blocks_streamed_piece_by_piece_add_up_to_the_whole_reply() -> None:
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>')
    whole = ContentBlocks(HermesToolParser().stream())
    whole.feed(text, finished=True)
    pieces = ContentBlocks(HermesToolParser().stream())
    events = [event for index in range(len(text)) for event in pieces.feed(text[index], finished=False)]
    events += pieces.feed("", finished=True)
    strip = [{key: value for key, value in block.items() if key != "id"} for block in whole.content()]
    assert strip == [{"type": "text", "text": "Checking."},
                     {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}},
                     {"type": "tool_use", "name": "get_time", "input": {"city": "Oslo"}}]
    assert [{key: value for key, value in block.items() if key != "id"} for block in pieces.content()] == strip
    assert whole.made_calls and pieces.made_calls
    # Events: each block opened, extended and closed in order; the JSON pieces spell each call's input.
    kinds = [(name, data.get("index"), data.get("content_block", data.get("delta", {})).get("type"))
             for name, data in events if name != "content_block_delta"]
    assert kinds == [("content_block_start", 0, "text"), ("content_block_stop", 0, None),
                     ("content_block_start", 1, "tool_use"), ("content_block_stop", 1, None),
                     ("content_block_start", 2, "tool_use"), ("content_block_stop", 2, None)]
    for index, block in ((1, strip[1]), (2, strip[2])):
        partial = "".join(data["delta"]["partial_json"] for name, data in events
                          if name == "content_block_delta" and data["index"] == index)
        assert json.loads(partial) == block["input"]
    # No parser: all text is one text block; an empty reply is one empty text block.
    plain = ContentBlocks(None)
    plain.feed("<tool_call>", finished=False)
    plain.feed("", finished=True)
    assert plain.content() == [{"type": "text", "text": "<tool_call>"}] and not plain.made_calls
    empty = ContentBlocks(HermesToolParser().stream())
    assert [name for name, _ in empty.feed("", finished=True)] == ["content_block_start", "content_block_stop"]
    assert empty.content() == [{"type": "text", "text": ""}]
    # A call max_tokens cut: its input is what can be read of it, {} when nothing.
    cut = ContentBlocks(HermesToolParser().stream())
    cut.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', finished=True)
    assert [block["input"] for block in cut.content() if block["type"] == "tool_use"] in ([{}], [])


# --- a real server, the official SDK ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("anthropic-tools") / "server.log",
                           "--stats-log-interval", "0")
    yield running
    stop_server(running)


@pytest.fixture
def client(server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def check_input(name: str, value: dict) -> None:
    """The input follows the tool's schema (the grammar enforced it)."""
    city = value["city"]
    assert set(value) == {"city"} and isinstance(city, str)
    assert len(city) <= 12 if name == "get_weather" else city in ("Paris", "Oslo")


def test_a_tool_loop_of_three_turns_served_from_the_cache(client: anthropic.Anthropic) -> None:
    """A named tool, then any tool (one call each), the results fed back as tool_result blocks, then an answer
    without tools. Each turn reads the previous turn's whole prompt and generation from the cache: the call
    comes back as a tool_use input object, which the template writes as the model generated it."""
    messages: list[dict] = [{"role": "user", "content": "Is it warm in Paris now, and what time is it there?"}]
    choices = [{"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
               {"type": "any", "disable_parallel_tool_use": True}, {"type": "none"}]
    previous = None
    for turn, choice in enumerate(choices):
        reply = client.messages.create(model=MODEL_NAME, max_tokens=40, system=SYSTEM, tools=TOOLS,
                                       tool_choice=choice, messages=messages, extra_body=GREEDY)
        if previous is not None:
            # Everything the previous turn computed (its prompt and all but its last generated token, whose
            # K/V is never computed) is read back.
            assert reply.usage.cache_read_input_tokens >= previous - 1, (turn, reply.usage, previous)
        previous = prompt_tokens(reply.usage) + reply.usage.output_tokens
        if turn < 2:
            assert reply.stop_reason == "tool_use", reply
            (call,) = reply.content
            assert call.type == "tool_use" and call.id.startswith("toolu_")
            assert call.name == "get_weather" if turn == 0 else call.name in ("get_weather", "get_time")
            check_input(call.name, call.input)
            messages += [{"role": "assistant", "content": reply.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                       "content": "18 C, sunny" if turn == 0 else "14:05"}]}]
        else:
            assert [block.type for block in reply.content] == ["text"]
            assert reply.stop_reason in ("end_turn", "max_tokens")


def test_streamed_tool_use_adds_up_to_the_reply(client: anthropic.Anthropic) -> None:
    fields = dict(model=MODEL_NAME, max_tokens=40, system=SYSTEM, tools=TOOLS, extra_body=GREEDY,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": "What time is it in Oslo?"}])
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    names = [event.type for event in events if event.type.startswith(("message", "content_block"))]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [event.content_block for event in events if event.type == "content_block_start"]
    assert [block.type for block in starts] == ["tool_use"] and starts[0].input == {}
    partial = "".join(event.delta.partial_json for event in events
                      if event.type == "content_block_delta" and event.delta.type == "input_json_delta")
    (call,) = whole.content
    assert json.loads(partial) == call.input and starts[0].name == call.name
    assert [(block.type, block.name, block.input) for block in final.content] == [("tool_use", call.name, call.input)]
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_choice_any_tool_and_none(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo, please."}]
    named = client.messages.create(model=MODEL_NAME, max_tokens=40, tools=TOOLS, messages=messages,
                                   tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
                                   extra_body=GREEDY)
    assert named.stop_reason == "tool_use" and [(b.type, b.name) for b in named.content] == [("tool_use", "get_time")]
    check_input("get_time", named.content[0].input)
    # Parallel calls allowed: one or more calls of the given tools (max_tokens may cut a later one short).
    several = client.messages.create(model=MODEL_NAME, max_tokens=60, tools=TOOLS, messages=messages,
                                     tool_choice={"type": "any"}, extra_body={"temperature": 1, "top_k": 5})
    calls = [block for block in several.content if block.type == "tool_use"]
    assert calls and all(call.name in ("get_weather", "get_time") for call in calls)
    assert several.stop_reason in ("tool_use", "max_tokens")
    assert len({call.id for call in calls}) == len(calls)
    # none: the same prompt (the tools stay in it), no call read out of the text.
    plain = client.messages.create(model=MODEL_NAME, max_tokens=8, tools=TOOLS, messages=messages,
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [block.type for block in plain.content] == ["text"] and plain.stop_reason != "tool_use"
    assert prompt_tokens(plain.usage) == prompt_tokens(named.usage)


def test_cache_control_on_the_last_tool_pins_the_tools_and_the_system_prompt(
        client: anthropic.Anthropic, server: RunningServer, tiny_model: Path) -> None:
    system = "You plan train journeys across Europe. Prefer night trains; mention every change of train."
    tools = [WEATHER, dict(CLOCK, cache_control={"type": "ephemeral", "ttl": "1h"})]
    # The prefix the breakpoint holds: the system turn, where the template lists the tools.
    inputs = InputProcessor(Tokenizer(tiny_model))
    openai_tools = [{"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                                      "parameters": tool["input_schema"]}} for tool in TOOLS]
    system_turn = inputs.from_messages([{"role": "system", "content": system}], tools=openai_tools,
                                       add_generation_prompt=False)
    assert system_turn.text.rstrip().endswith("<|im_end|>") and '"name": "get_time"' in system_turn.text
    length = len(system_turn.token_ids)

    first = client.messages.create(model=MODEL_NAME, max_tokens=4, system=system, tools=tools, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Paris to Vienna tonight?"}])
    # Up to the breakpoint: read (the template's opening other prompts share) or written now.
    assert first.usage.cache_read_input_tokens < 16, first.usage
    assert first.usage.cache_read_input_tokens + first.usage.cache_creation_input_tokens == length
    pins = client.get("/v1/cache/pins", cast_to=object)["data"]
    pinned = [pin for pin in pins if pin["kind"] == "breakpoint" and pin["ttl"] == 3600.0]
    assert [pin["tokens"] for pin in pinned] == [length // 16 * 16], pins  # the full blocks of that prefix

    second = client.messages.create(model=MODEL_NAME, max_tokens=4, system=system, tools=tools, extra_body=GREEDY,
                                    messages=[{"role": "user", "content": "Oslo to Rome by Friday?"}])
    assert second.usage.cache_read_input_tokens >= length, second.usage
    assert second.usage.cache_creation_input_tokens == 0


def test_bad_tool_input_is_a_400_naming_the_field(client: anthropic.Anthropic) -> None:
    """Each mistake is a 400 in Anthropic's shape whose message starts with the field, which ``param`` holds too
    (kvreuse's extension), whichever check found it: the body's validation, the tool rules, SamplingParams (under
    this API's name for the field)."""
    def refused(param: str, match: str, **fields) -> None:
        fields.setdefault("messages", [{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.BadRequestError, match=match) as caught:
            client.messages.create(model=MODEL_NAME, max_tokens=4, **fields)
        body = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"] == param and body["error"]["message"].startswith(param), body

    refused("tool_choice.name", r"tool_choice\.name: 'get_news' is not one of the tools", tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_news"})
    refused("messages[0].content[0].tool_use_id", r"messages\[0\]\.content\[0\]\.tool_use_id", messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "18 C"}]}])
    refused("tools[0].input_schema.type", r"tools\[0\]\.input_schema\.type",
            tools=[dict(WEATHER, input_schema={"type": "objekt"})])
    refused("tools[1].name", r"tools\[1\]\.name", tools=[WEATHER, WEATHER])
    refused("tool_choice", r"tool_choice: 'any' needs at least one tool", tool_choice={"type": "any"})
    refused("messages[1].content[0].input", r"messages\[1\]\.content\[0\]\.input", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather"}]}])
    refused("messages[0].content[0]", r"messages\[0\]\.content\[0\]", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    refused("temperature", r"temperature: ", extra_body={"temperature": 2})
    refused("stop_sequences", r"stop_sequences: .*non-empty", stop_sequences=["END", ""])
