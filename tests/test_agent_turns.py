"""Agent turns: tools in the made models' template, tool history checked and rendered, and every turn of a tool
loop starting with the previous turn's prompt and generated ids (the generation memory), measured through LLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import GenerationMemory, InputProcessor
from kvreuse.model_tools.make_model import CHATML_TEMPLATE, TOOL_TOKENS
from kvreuse.output_processor import OutputProcessor
from kvreuse.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvreuse.sampling import SamplingParams
from kvreuse.tokenizer import Tokenizer
from kvreuse.tool_parsers import choose

# The made models' template before it took tools: chats without tools must still render exactly like this.
PLAIN_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{{- message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city for some days",
    "parameters": {"type": "object", "properties": {
        # Letters only and a small integer: every value the grammar allows is written back identically
        # (see the report on numbers and escapes in kvreuse.messages).
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    }, "required": ["city", "days"], "additionalProperties": False},
}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", '{"city":"Zürich","days":2}'),
                                                          call("c2", "get_time", '{"zone": "CET"}')]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "12:00"}]},
    {"role": "assistant", "content": "Sunny, noon.", "tool_calls": [call("c3", "get_time", "")]},
    {"role": "tool", "tool_call_id": "c3", "content": "12:01"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer(tiny_model)


# ----------------------------------------------------------------------------------------------
# The made models' tokenizer and template


def test_tool_tags_are_single_tokens_that_decoding_keeps(tiny_model: Path, tokenizer: Tokenizer) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    ids = [tokenizer.hf_tokenizer.convert_tokens_to_ids(tag) for tag in TOOL_TOKENS]
    # The last ids of the vocabulary (the trained ones keep theirs), inside the model's vocabulary.
    assert ids == list(range(tokenizer.vocab_size - len(TOOL_TOKENS), tokenizer.vocab_size))
    assert tokenizer.vocab_size == config["vocab_size"]
    text = "<tool_call>\n{}\n</tool_call> <tool_response>x</tool_response>"
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert [token for token in encoded if token in ids] == [ids[0], ids[1], ids[2], ids[3]]
    # Not special: a parser reading decoded text (special tokens skipped) still sees the tags.
    assert tokenizer.decode(encoded, skip_special_tokens=True) == text
    assert not set(ids) & set(tokenizer.hf_tokenizer.all_special_ids)


def test_chats_without_tools_render_exactly_as_before(tokenizer: Tokenizer) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    old = ImmutableSandboxedEnvironment().from_string(PLAIN_CHATML)
    chats = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "developer", "content": "d"},
         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
         {"role": "assistant", "content": None}],
    ]
    for messages in chats:
        for add_generation_prompt in (True, False):
            ours = tokenizer.hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                              add_generation_prompt=add_generation_prompt)
            assert ours == old.render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_tools_and_tool_history_render_in_qwen_shape_as_transformers_renders_them(tiny_model: Path,
                                                                                  tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    processor = InputProcessor(tokenizer)
    ours = processor.render(HISTORY, tools=TOOLS)
    # transformers, given the same conversation with the arguments as objects, renders the same text.
    parsed = [dict(message) for message in HISTORY]
    for message in parsed:
        if message.get("tool_calls"):
            message["tool_calls"] = [{**item, "function": {**item["function"], "arguments": json.loads(
                item["function"]["arguments"] or "{}")}} for item in message["tool_calls"]]
    parsed[4]["content"] = "12:00"
    hf = AutoTokenizer.from_pretrained(tiny_model)
    assert ours == hf.apply_chat_template(parsed, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    system, rest = ours.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" + json.dumps(CLOCK) + "\n</tools>\n" in system
    # The arguments, sent back as compact text, are written with tojson: ", " and ": ", no ASCII escapes.
    assert rest == (
        "<|im_start|>user\nWeather in Zürich, and the time?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", "
        "\"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\nSunny, noon.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12:01\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Without a system message the tools turn stands alone.
    assert processor.render(HISTORY[1:2], tools=TOOLS).startswith("<|im_start|>system\n# Tools\n")


BAD_INPUT = [
    ([HISTORY[1], {"role": "tool", "tool_call_id": "c1", "content": "x"}], None, "messages[1].tool_call_id"),
    (HISTORY[:3] + [{"role": "tool", "tool_call_id": "c9", "content": "x"}], None, "messages[3].tool_call_id"),
    (HISTORY[:3] + [{"role": "tool", "content": "x"}], None, "messages[3].tool_call_id"),
    (HISTORY[:3] + [{"role": "user", "content": "u"}, {"role": "tool", "tool_call_id": "c1", "content": "x"}], None,
     "messages[4].tool_call_id"),
    ([HISTORY[1], {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"arguments": "{}"}}]}], None,
     "messages[1].tool_calls[0].function.name"),
    ([HISTORY[1], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}], None,
     "messages[1].tool_calls[0].id"),
    ([{"role": "user", "content": "x", "tool_calls": [call("c1", "f", "{}")]}], None, "messages[0].tool_calls"),
    (HISTORY[1:2], [WEATHER, {"type": "function", "function": {"description": "no name"}}], "tools[1].function.name"),
    (HISTORY[1:2], [WEATHER, {"type": "function", "function": {"name": "get weather!"}}], "tools[1].function.name"),
    (HISTORY[1:2], [WEATHER, WEATHER], "tools[1].function.name"),
    (HISTORY[1:2], [{"type": "retrieval"}], "tools[0].type"),
    (HISTORY[1:2], [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], "tools[0].function.parameters.properties.x.type"),
    (HISTORY[1:2], "get_weather", "tools"),
]


def test_a_call_cut_off_by_max_tokens_is_replayed_as_its_text(tokenizer: Tokenizer) -> None:
    """Arguments that are not JSON (the reply hit max_tokens inside them) are not refused: the agent loop
    goes on, and the template writes the text as it came back."""
    cut = '{"city": "Zür'
    prompt = InputProcessor(tokenizer).from_messages(
        [HISTORY[1], {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", cut)]},
         {"role": "tool", "tool_call_id": "c1", "content": "x"}], tools=[WEATHER])
    assert '"arguments": ' + cut + "}" in prompt.text


@pytest.mark.parametrize(("messages", "tools", "param"), BAD_INPUT, ids=[case[2] + f"-{i}" for i, case in
                                                                        enumerate(BAD_INPUT)])
def test_bad_tools_and_tool_history_name_the_field(tokenizer: Tokenizer, messages, tools, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        InputProcessor(tokenizer).from_messages(messages, tools=tools)
    assert caught.value.param == param


# ----------------------------------------------------------------------------------------------
# The generation memory


def test_generation_memory_is_a_bounded_lru_matching_the_longest_text() -> None:
    memory = GenerationMemory(max_entries=3, max_chars=40)
    memory.record("Hello", [1, 2])
    memory.record("Hello there, friend", [3, 4, 5])
    memory.record("", [9])  # nothing to remember
    memory.record("x", [])
    assert len(memory) == 2
    prompt = "<s>Hello there, friend!"
    assert memory.longest_at(prompt, 3) == ("Hello there, friend", (3, 4, 5))
    assert memory.longest_at("<s>Hello world", 3) == ("Hello", (1, 2))
    assert memory.longest_at(prompt, 4) is None and memory.longest_at("Hell", 0) is None
    memory.longest_at("Hello", 0)  # used: now the most recent
    memory.record("a" * 20, [6])  # 5 + 19 + 20 characters > 40: the least recently used goes
    assert "Hello there, friend" not in memory and "Hello" in memory and "a" * 20 in memory
    memory.record("b", [7])
    memory.record("c", [8])  # four entries > 3
    assert "Hello" not in memory and len(memory) == 3
    memory.record("b", [70, 71])  # the same text generated again: the newest ids
    assert memory.longest_at("b", 0) == ("b", (70, 71))
    with pytest.raises(ValueError):
        GenerationMemory(max_entries=0)


def test_generation_memory_is_scoped_by_cache_salt() -> None:
    """A tenant's prompt is encoded only with ids its own tenant generated: shared, the prompt's token count
    would tell one tenant that another generated a text."""
    memory = GenerationMemory()
    memory.record("secret plan", [5, 6, 7], scope="tenant-a")
    assert memory.longest_at("secret plan", 0, scope="tenant-a") == ("secret plan", (5, 6, 7))
    assert memory.longest_at("secret plan", 0, scope="tenant-b") is None
    assert memory.longest_at("secret plan", 0) is None
    memory.record("secret plan", [8], scope="tenant-b")
    assert memory.longest_at("secret plan", 0, scope="tenant-a") == ("secret plan", (5, 6, 7))
    assert memory.longest_at("secret plan", 0, scope="tenant-b") == ("secret plan", (8,))


def finished_output(request_id: str, prompt_ids: list[int], token_ids: list[int], finish_reason: str,
                    stop_reason: int | str | None) -> RequestOutput:
    return RequestOutput(request_id, None, prompt_ids, [CompletionOutput(0, token_ids=token_ids,
                                                                         finish_reason=finish_reason,
                                                                         stop_reason=stop_reason)],
                         True, 0, RequestMetrics(0.0))


def test_a_replayed_turn_is_encoded_as_the_ids_the_model_generated(tokenizer: Tokenizer) -> None:
    """A tool call sampled piece by piece (``<tool_call>`` spelled out, one token per character) comes back as
    text that encodes to other ids; with the memory, the next prompt holds the sampled ids exactly."""
    memory = GenerationMemory()
    inputs, outputs = InputProcessor(tokenizer, generation_memory=memory), OutputProcessor(tokenizer, memory)
    plain = InputProcessor(tokenizer)
    eos = tokenizer.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "What time is it?"}]
    first = inputs.from_messages(messages, tools=TOOLS)
    assert first.token_ids == plain.from_messages(messages, tools=TOOLS).token_ids  # nothing remembered yet
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    sampled = [piece for character in text for piece in tokenizer.encode(character, add_special_tokens=False)]
    assert tokenizer.decode(sampled) == text and sampled != tokenizer.encode(text, add_special_tokens=False)
    outputs.add_request("r1", first.token_ids, SamplingParams(max_tokens=200))
    processed = outputs.process(finished_output("r1", first.token_ids, sampled + [eos], "stop", eos))
    assert processed.output.outputs[0].text == text
    assert memory.longest_at(text, 0) == (text, tuple(sampled))  # recorded without the eos

    content, calls = choose(tokenizer.chat_template).extract(text)
    messages += [{"role": "assistant", "content": content, "tool_calls": [
        call(calls[0].id, calls[0].name, calls[0].arguments)]}, {"role": "tool", "tool_call_id": calls[0].id,
                                                                 "content": "09:30"}]
    second = inputs.from_messages(messages, tools=TOOLS)
    assert second.token_ids[:len(first.token_ids) + len(sampled)] == first.token_ids + sampled
    assert tokenizer.decode(second.token_ids, skip_special_tokens=False) == second.text
    # The text around the turn is encoded as usual; without the memory the prompt leaves the cache where
    # the turn began.
    without = plain.from_messages(messages, tools=TOOLS).token_ids
    assert without[:len(first.token_ids)] == first.token_ids
    assert without[:len(first.token_ids) + len(sampled)] != first.token_ids + sampled
    assert second.token_ids[len(first.token_ids) + len(sampled):] == \
        tokenizer.encode(second.text[len(first.text) + len(text):], add_special_tokens=False)


def test_only_ids_that_spell_the_text_are_remembered(tokenizer: Tokenizer) -> None:
    memory = GenerationMemory()
    outputs = OutputProcessor(tokenizer, memory)
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    # A stop string cut the text: the ids go past it, so they are not the text's.
    outputs.add_request("stop", [5], SamplingParams(max_tokens=50, stop=[" two"]))
    outputs.process(finished_output("stop", [5], ids, "length", None))
    assert len(memory) == 0
    # A special token skipped from the text is not in what the client sends back.
    start = tokenizer.hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    outputs.add_request("special", [5], SamplingParams(max_tokens=50))
    outputs.process(finished_output("special", [5], [start, *ids], "length", None))
    assert len(memory) == 0
    # Ended by the length limit: every id is the text's.
    outputs.add_request("length", [5], SamplingParams(max_tokens=50))
    outputs.process(finished_output("length", [5], ids, "length", None))
    assert memory.longest_at("one two three", 0) == ("one two three", tuple(ids))


# ----------------------------------------------------------------------------------------------
# A tool loop through LLM


def test_every_agent_turn_starts_with_the_previous_prompt_and_generation(tiny_model: Path) -> None:
    """Four turns: a forced call (the hermes grammar, one call), an answer after the tool result, another
    call, another answer. Each prompt starts with the previous prompt and every generated id (less the
    eos), and the cache serves every token of it that was computed (all but the last sampled one)."""
    from kvreuse import LLM

    block_size = 16
    llm = LLM(str(tiny_model), dtype="float32", kv_cache_memory="32MiB", block_size=block_size)
    tokenizer = llm.get_tokenizer()
    parser = choose(tokenizer.chat_template, added_tokens=tokenizer.added_tokens)
    assert parser is not None and parser.name == "hermes"
    messages: list[dict] = [{"role": "system", "content": "You answer questions about the weather."},
                            {"role": "user", "content": "Weather in Oslo, and the time?"}]
    previous: list[int] | None = None
    reencoded_differently = 0
    calls_made = 0
    for choice in ["required", "none", {"type": "function", "function": {"name": "get_time"}}, "none"]:
        params = SamplingParams(temperature=0, max_tokens=120,
                                structured_outputs=parser.structured_outputs(TOOLS, choice, False))
        output = llm.chat(messages, params, tools=TOOLS, use_tqdm=False)[0]
        completion = output.outputs[0]
        if previous is not None:
            assert output.prompt_token_ids[:len(previous)] == previous
            # Everything the previous turn computed is served: its prompt and generation, the partly filled
            # last block included (a finished sequence's tail), less a last token that was never fed.
            assert output.num_cached_tokens == previous_computed
            unspliced = InputProcessor(tokenizer).from_messages(messages, tools=TOOLS).token_ids
            reencoded_differently += unspliced[:len(previous)] != previous
        generated = list(completion.token_ids)
        if completion.finish_reason == "stop" and isinstance(completion.stop_reason, int):
            generated.pop()
        previous = list(output.prompt_token_ids) + generated
        previous_computed = len(output.prompt_token_ids) + len(completion.token_ids) - 1  # the last sampled: no KV
        if choice == "none":
            messages += [{"role": "assistant", "content": completion.text},
                         {"role": "user", "content": "And tomorrow?"}]
            continue
        content, calls = parser.extract(completion.text)
        assert content is None and len(calls) == 1  # the grammar forced exactly one call
        if isinstance(choice, dict):
            assert calls[0].name == "get_time"
        assert isinstance(json.loads(calls[0].arguments), dict)
        calls_made += 1
        messages += [{"role": "assistant", "content": content,
                      "tool_calls": [call(calls[0].id, calls[0].name, calls[0].arguments)]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": '{"ok": true}'}]
    assert calls_made == 2
    # The random model's free text does not re-encode to its sampled ids: the memory is what kept the hits.
    assert reencoded_differently >= 1
