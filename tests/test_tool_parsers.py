"""Tool-call parsers: extraction (whole and streamed), choosing one, and their grammars checked with llguidance
on a made model's tokenizer: what the chat template writes is accepted, anything else is refused."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import InputProcessor
from kvreuse.model_tools.make_model import make_model
from kvreuse.tokenizer import Tokenizer
from kvreuse.tool_parsers import (
    PARSERS,
    HarmonyToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    StreamDelta,
    ToolCall,
    choose,
    resolve_tool_choice,
)

HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False},
}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, CLOCK]
STRICT_TOOLS = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}, CLOCK]


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def hermes() -> HermesToolParser:
    return HermesToolParser(id_factory=counting_ids())


def streamed(parser, pieces: list[str]) -> tuple[str, list[dict], list[StreamDelta]]:
    """Feed ``pieces`` to a stream; returns (content, calls rebuilt from the deltas, the deltas)."""
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content = "".join(delta.content for delta in deltas)
    calls: dict[int, dict] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index not in calls:
                # The first delta of a call names it; later ones only carry argument text.
                assert call.id is not None and call.name is not None, call
                calls[call.index] = {"id": call.id, "name": call.name, "arguments": call.arguments}
            else:
                assert call.id is None and call.name is None, call
                calls[call.index]["arguments"] += call.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[index] for index in sorted(calls)], deltas


def as_dicts(calls: list[ToolCall]) -> list[dict]:
    return [{"id": call.id, "name": call.name, "arguments": call.arguments} for call in calls]


# ----------------------------------------------------------------------------------------------
# Extraction

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zü\\"rich</tool_call>", '
             '"days": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_extracts_content_and_the_exact_argument_text() -> None:
    content, calls = hermes().extract(TWO_CALLS)
    # The one newline the template writes before <tool_call> is not content; a tag inside a JSON string is
    # not a tag; the arguments are the characters generated, not a re-serialisation.
    assert content == "Let me check."
    assert calls == [
        ToolCall("call_0", "get_weather", '{"city": "Zü\\"rich</tool_call>", "days": [1, {"a": "}"}]}'),
        ToolCall("call_1", "get_time", "{}"),
    ]
    assert hermes().extract("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\":\"UTC\" }}\n</tool_call>") \
        == (None, [ToolCall("call_0", "get_time", '{"tz":"UTC" }')])
    # Only one newline goes: a blank line before the call stays in the content.
    assert hermes().extract('Hi.\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')[0] == "Hi.\n"


def test_hermes_text_without_calls_is_all_content() -> None:
    for text in ["plain answer", "ends with a newline\n", "mentions <tool but no call", "", "a <tool_call"]:
        assert hermes().extract(text) == (text, [])


def test_hermes_skips_a_tag_that_does_not_open_a_call_and_reads_the_next() -> None:
    text = ('<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"a": 1}}\n'
            '</tool_call>')
    assert hermes().extract(text) == (None, [ToolCall("call_0", "get_time", '{"a": 1}')])


def test_hermes_call_cut_by_the_length_limit_keeps_what_was_generated() -> None:
    content, calls = hermes().extract('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert content is None and calls == [ToolCall("call_0", "get_weather", '{"city": "Pa')]


def test_llama3_json_extracts_calls_separated_by_semicolons_and_leaves_text_alone() -> None:
    parser = Llama3JsonToolParser(id_factory=counting_ids())
    assert parser.extract('{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                          '<not part of it>') == (None, [ToolCall("call_0", "get_weather", '{"city": "Oslo"}')])
    parser = Llama3JsonToolParser(id_factory=counting_ids())
    content, calls = parser.extract('<|python_tag|>{"name": "a", "arguments": {"x": [1]}}; {"name": "b", '
                                    '"parameters": 7}')
    assert content is None and calls == [ToolCall("call_0", "a", '{"x": [1]}'), ToolCall("call_1", "b", "7")]
    # Text, and JSON that is not a call, are content.
    for text in ["The answer is {x}.", '{"x": 1}', "{", "<|python"]:
        assert Llama3JsonToolParser().extract(text) == (text, [])


def test_mistral_reads_lists_and_the_v11_form_with_nine_character_ids() -> None:
    parser = MistralToolParser()
    content, calls = parser.extract('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                                    '{"name": "get_time", "arguments": {}}]')
    assert content == "Sure. "
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    assert all(len(call.id) == 9 and call.id.isalnum() for call in calls)
    assert parser.needs_special_tokens and not hermes().needs_special_tokens
    content, calls = parser.extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}')
    assert content is None
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]


# ----------------------------------------------------------------------------------------------
# Streaming equals the whole text

def harmony() -> HarmonyToolParser:
    return HarmonyToolParser(id_factory=counting_ids())


HARMONY_REPLY = ("<|channel|>analysis<|message|>The user wants <|end|> weather.<|end|><|start|>assistant<|channel|>final"
                 "<|message|>It is sunny in Zürich<|return|>")
HARMONY_CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Zü<|", "days": 3}'
                "<|call|>")

STREAM_CASES = {
    "harmony": (harmony, [
        HARMONY_REPLY, HARMONY_REPLY[:-len("<|return|>")], HARMONY_CALL, HARMONY_CALL[:-len("<|call|>")],
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}", "plain text <|chan",
        "<|channel|>final<|message|>partial <|re", "<|channel|>analysis<|message|>only thinking",
    ]),
    "hermes": (hermes, [
        TWO_CALLS, "just text", "text\n", "text\n\n", "x <tool_call", "a\n<tool_c",
        '<tool_call>\n{"name": "get_time", "arguments": 12}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": "s\\"}"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
    ]),
    "llama3_json": (lambda: Llama3JsonToolParser(id_factory=counting_ids()), [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "b", "parameters": [1, 2]}',
        "The answer is {x}.", '{"x": 1}', '<|python_tag|>{"name": "a", "arguments": true}',
    ]),
    "mistral": (lambda: MistralToolParser(id_factory=counting_ids()), [
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "t", "arguments": {}}]',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]t[ARGS]{}', "no calls [TOOL", "[TOOL_CALLS",
    ]),
}


@pytest.mark.parametrize("family", sorted(STREAM_CASES))
def test_stream_deltas_add_up_to_the_extraction_one_character_at_a_time(family: str) -> None:
    make, texts = STREAM_CASES[family]
    for text in texts:
        content, calls = make().extract(text)
        streamed_content, streamed_calls, _ = streamed(make(), list(text))
        assert streamed_content == (content or ""), text
        assert streamed_calls == as_dicts(calls), text


@HYPOTHESIS
@given(data=st.data())
def test_stream_deltas_add_up_for_any_split(data: st.DataObject) -> None:
    family = data.draw(st.sampled_from(sorted(STREAM_CASES)))
    make, texts = STREAM_CASES[family]
    text = data.draw(st.sampled_from(texts))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = make().extract(text)
    streamed_content, streamed_calls, _ = streamed(make(), pieces)
    assert streamed_content == (content or "") and streamed_calls == as_dicts(calls)


def test_stream_holds_back_only_what_may_open_a_call_and_streams_arguments_early() -> None:
    stream = hermes().stream()
    assert stream.feed("Hello <tool").content == "Hello "
    assert stream.feed("s are here\n").content == "<tools are here"  # not a tag after all; the newline waits
    delta = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert delta.content == "" and [(c.index, c.name, c.arguments) for c in delta.tool_calls] == \
        [(0, "get_weather", ""), (0, None, '{"ci')]
    assert [c.arguments for c in stream.feed('ty": "Oslo"}}\n</tool_call>').tool_calls] == ['ty": "Oslo"}']
    assert not stream.finish()


# ----------------------------------------------------------------------------------------------
# Choosing a parser, tool_choice


def test_choose_by_template_or_name() -> None:
    from kvreuse.model_tools.make_model import CHATML_TEMPLATE

    assert isinstance(choose(CHATML_TEMPLATE), HermesToolParser)
    assert choose("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert choose("{{- '<|python_tag|>' }}{{- '\"parameters\": ' }}").name == "llama3_json"
    assert choose("{% for m in messages %}{{ m.content }}{% endfor %}") is None and choose(None) is None
    assert choose(None, "llama3_json").name == "llama3_json"  # the flag wins over the template
    assert sorted(PARSERS) == ["harmony", "hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match="harmony, hermes, llama3_json, mistral"):
        choose(CHATML_TEMPLATE, "pythonic")


def test_tool_choice_errors_name_the_field() -> None:
    tools = [WEATHER]
    assert resolve_tool_choice(None, tools).mode == "auto"
    named = resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    assert (named.mode, named.function) == ("required", "get_weather")
    cases = [({"type": "function", "function": {"name": "nope"}}, tools, "tool_choice.function.name"),
             ("required", [], "tool_choice"), ("always", tools, "tool_choice"), ({"type": "x"}, tools, "tool_choice")]
    for choice, given_tools, param in cases:
        with pytest.raises(InvalidRequestError) as caught:
            hermes().grammar(given_tools, choice)
        assert caught.value.param == param, choice
    with pytest.raises(InvalidRequestError) as caught:
        hermes().grammar([WEATHER, {"type": "function", "function": {"description": "no name"}}], "required")
    assert caught.value.param == "tools[1].function.name"


def test_no_grammar_when_nothing_is_enforced() -> None:
    parser = hermes()
    assert parser.grammar(TOOLS, "none") is None and parser.grammar(TOOLS, "auto") is None
    assert parser.grammar([], "auto") is None and parser.grammar(None, None) is None
    assert parser.grammar(STRICT_TOOLS, "auto") is not None
    constraint = parser.structured_outputs(TOOLS, "required")
    assert constraint is not None and constraint.kind == "grammar" and constraint.grammar == parser.grammar(TOOLS,
                                                                                                           "required")
    assert parser.structured_outputs(TOOLS, "auto") is None


# ----------------------------------------------------------------------------------------------
# Grammars, checked with llguidance on a made model's tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tool-parsers") / "tiny", preset="tiny", write_weights=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer, n_vocab=tokenizer.vocab_size)


def accepts(ll_tokenizer: llguidance.LLTokenizer, tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` (as the tokenizer encodes it) and may end there."""
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def rendered_call(tokenizer: Tokenizer, name: str, arguments: dict) -> str:
    """The text our template writes for an assistant turn with this call (what a replay renders)."""
    processor = InputProcessor(tokenizer)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}]
    before = processor.render(messages[:1], add_generation_prompt=True)
    text = processor.render(messages, add_generation_prompt=False)
    assert text.startswith(before) and text.endswith("<|im_end|>\n")
    return text[len(before):-len("<|im_end|>\n")]


def test_required_grammar_accepts_calls_as_the_template_writes_them_and_nothing_else(
        tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer) -> None:
    grammar = hermes().grammar(TOOLS, "required")
    call = rendered_call(tokenizer, "get_weather", {"city": "Zürich", "days": 3})
    assert call == hermes_call("get_weather", '{"city": "Zürich", "days": 3}')
    assert accepts(ll_tokenizer, tokenizer, grammar, call)
    assert accepts(ll_tokenizer, tokenizer, grammar, call + "\n" + hermes_call("get_time", '{"tz": ["UTC", null]}'))
    refused = {
        "free text": "It is sunny.",
        "text before the call": "Sure.\n" + call,
        "an unknown tool": hermes_call("get_stock", "{}"),
        "a required argument missing": hermes_call("get_weather", '{"days": 3}'),
        "a wrong type": hermes_call("get_weather", '{"city": 5}'),
        "an extra argument": hermes_call("get_weather", '{"city": "x", "unit": "C"}'),
        "compact separators": hermes_call("get_weather", '{"city":"x"}'),
        "an escaped slash": hermes_call("get_weather", '{"city": "a\\/b"}'),
        "an escaped printable character": hermes_call("get_weather", '{"city": "\\u00fc"}'),
        "no newline after the tag": '<tool_call>{"name": "get_time", "arguments": {}}\n</tool_call>',
        "an unclosed call": '<tool_call>\n{"name": "get_time", "arguments": {}}',
    }
    for what, text in refused.items():
        assert not accepts(ll_tokenizer, tokenizer, grammar, text), what


def test_parallel_tool_calls_false_allows_exactly_one(tokenizer: Tokenizer,
                                                     ll_tokenizer: llguidance.LLTokenizer) -> None:
    one = hermes_call("get_time", "{}")
    grammar = hermes().grammar(TOOLS, "required", parallel_tool_calls=False)
    assert accepts(ll_tokenizer, tokenizer, grammar, one)
    assert not accepts(ll_tokenizer, tokenizer, grammar, one + "\n" + one)


def test_named_function_grammar_calls_that_function_only(tokenizer: Tokenizer,
                                                        ll_tokenizer: llguidance.LLTokenizer) -> None:
    grammar = hermes().grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert accepts(ll_tokenizer, tokenizer, grammar, hermes_call("get_time", '{"tz": "UTC"}'))
    assert not accepts(ll_tokenizer, tokenizer, grammar, hermes_call("get_weather", '{"city": "x"}'))


def test_auto_with_strict_tools_allows_text_then_enforces_calls(tokenizer: Tokenizer,
                                                               ll_tokenizer: llguidance.LLTokenizer) -> None:
    grammar = hermes().grammar(STRICT_TOOLS, "auto")
    call = hermes_call("get_weather", '{"city": "Oslo"}')
    for text in ["Just an answer.", "", call, "Let me look.\n" + call, "Two lines\n\n" + call]:
        assert accepts(ll_tokenizer, tokenizer, grammar, text), text
    for text in ["Look:" + call,  # the template writes a newline before the call
                 "Look.\n" + hermes_call("get_weather", '{"city": 1}'),
                 "Look.\n" + call + " and after",
                 "x <tool_call> y"]:
        assert not accepts(ll_tokenizer, tokenizer, grammar, text), text


# Any character but DEL: json.dumps writes U+007F raw, which llguidance's JSON strings refuse (a model
# would have to write \u007f, which a replay turns back into DEL: the one character a replay cannot match).
# Valid Unicode text (codec utf-8: no lone surrogates, which no tokenizer encodes; see the note of issue 29).
JSON_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x7f"), max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | JSON_TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(JSON_TEXT, children, max_size=3),
    max_leaves=8,
)


@HYPOTHESIS
@given(arguments=st.dictionaries(JSON_TEXT, JSON_VALUES, max_size=4))
def test_grammar_accepts_whatever_the_template_writes_and_extraction_gives_it_back(
        tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer, arguments: dict) -> None:
    """The serialisation the grammar allows is the template's own: any arguments rendered by the template
    (json.dumps, ensure_ascii=False) are accepted, and extracting them gives back the exact text."""
    written = json.dumps(arguments, ensure_ascii=False)
    # Text that spells an added token encodes as that token, not as JSON text (a replay of a model that
    # spelled it out piece by piece is the generation memory's case, tests/test_agent_turns.py).
    assume(not any(token in written for token in tokenizer.added_tokens))
    grammar = hermes().grammar(TOOLS, "required")
    call = rendered_call(tokenizer, "get_time", arguments)
    assert call == hermes_call("get_time", written)
    assert accepts(ll_tokenizer, tokenizer, grammar, call)
    assert hermes().extract(call) == (None, [ToolCall("call_0", "get_time",
                                                      json.dumps(arguments, ensure_ascii=False))])


def test_llama3_json_grammar(tokenizer: Tokenizer, ll_tokenizer: llguidance.LLTokenizer) -> None:
    parser = Llama3JsonToolParser()
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    required = parser.grammar(TOOLS, "required")
    assert accepts(ll_tokenizer, tokenizer, required, call)
    assert accepts(ll_tokenizer, tokenizer, required, call + '; {"name": "get_time", "parameters": {}}')
    assert not accepts(ll_tokenizer, tokenizer, required, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert not accepts(ll_tokenizer, tokenizer, required, "Hello")
    auto = parser.grammar(STRICT_TOOLS, "auto")
    assert accepts(ll_tokenizer, tokenizer, auto, "Hello {there}") and accepts(ll_tokenizer, tokenizer, auto, call)
    assert not accepts(ll_tokenizer, tokenizer, auto, '{"city": "Oslo"}')


def test_mistral_grammar_names_its_special_token_by_id(model_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    hf_tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    token_id = hf_tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer))
    parser = MistralToolParser(added_tokens={"[TOOL_CALLS]": token_id})

    def take(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        return matcher.consume_tokens(hf_tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    call = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert f"<[{token_id}]>" in parser.grammar(TOOLS, "required")
    assert take(parser.grammar(TOOLS, "required"), call)
    assert not take(parser.grammar(TOOLS, "required"), "Hello")
    assert take(parser.grammar(STRICT_TOOLS, "auto"), "Hello") and take(parser.grammar(STRICT_TOOLS, "auto"), call)
    assert not take(parser.grammar(TOOLS, "required"), '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]')


# ----------------------------------------------------------------------------------------------
# harmony (gpt-oss)


def test_harmony_content_is_the_final_channel_and_calls_go_to_functions() -> None:
    # The analysis channel is dropped, a <|end|> inside a message body ends it (it is a special token: the
    # model cannot write it as text), the final channel is the content.
    assert harmony().extract(HARMONY_REPLY) == ("It is sunny in Zürich", [])
    content, calls = harmony().extract(HARMONY_CALL[:-len("<|call|>")])  # <|call|> stops generation
    assert content is None and as_dicts(calls) == [
        {"id": "call_0", "name": "get_weather", "arguments": '{"city": "Zü<|", "days": 3}'}]
    # The recipient before the channel, as gpt-oss also writes it.
    assert as_dicts(harmony().extract("<|start|>assistant to=functions.get_time<|channel|>commentary json"
                                      "<|message|>{}")[1]) == [{"id": "call_0", "name": "get_time", "arguments": "{}"}]
    assert harmony().extract("no markers at all") == ("no markers at all", [])
    assert harmony().extract("<|channel|>analysis<|message|>thinking, cut by the length limit") == ("", [])
    stream = harmony().stream()
    assert stream.feed("<|channel|>final<|message|>Hel").content == "Hel"
    assert stream.feed("lo <|e").content == "lo "  # may open <|end|>: held back
    assert stream.feed("nd|>").content == "" and not stream.finish()


def test_harmony_is_chosen_from_the_template_and_applied_to_every_reply(tmp_path: Path) -> None:
    from kvreuse.server.protocol import ChatCompletionRequest

    folder = make_model(tmp_path / "gpt-oss", preset="tiny-gpt-oss", write_weights=False)
    parser = choose(Tokenizer(folder).chat_template)
    assert isinstance(parser, HarmonyToolParser) and parser.needs_special_tokens
    # Without tools, or with tool_choice none, the reply is still read for its final channel.
    for body in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body)
        setup = request.tool_setup(parser)
        assert setup.parser is parser and setup.constraint is None
        assert not request.sampling_params(max_tokens=4, logprobs=None, renames={}, tools=setup).skip_special_tokens


def test_harmony_forced_call_grammar_and_auto_strict_refused(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "gpt-oss", preset="tiny-gpt-oss", write_weights=False)
    tokenizer = Tokenizer(folder)
    ll = llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer, n_vocab=tokenizer.vocab_size)
    parser = HarmonyToolParser(tokenizer.hf_tokenizer.get_added_vocab(), counting_ids())
    grammar = parser.grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    assert accepts(ll, tokenizer, grammar, call)
    assert parser.extract(call)[1][0].name == "get_weather"
    for refused in (call.replace("get_weather", "get_time").replace('{"city": "Oslo"}', "{}"),
                    "<|channel|>final<|message|>No.", call.replace('"Oslo"', "5")):
        assert not accepts(ll, tokenizer, grammar, refused), refused
    assert accepts(ll, tokenizer, parser.grammar(TOOLS, "required"),
                   "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}")
    with pytest.raises(InvalidRequestError, match="strict tools with tool_choice 'auto'") as refused_auto:
        parser.grammar(STRICT_TOOLS, "auto")
    assert refused_auto.value.param == "tools"
