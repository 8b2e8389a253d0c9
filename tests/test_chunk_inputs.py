"""Chunks, the first part of issue 39: parts marked ``cache_control: {"type": "ephemeral", "scope": "chunk"}`` are
parsed (OpenAI text parts, Anthropic text and document blocks, LLM.chat), tokenized so that a chunk's ids are the
same wherever it appears, and their token spans carried to the engine's requests, which run the prompt exactly as
one without marks (the chunk reuse itself is built on top of this).

In-process first (the tiny model's tokenizer: byte-level BPE with Qwen2's pre-tokenizer, which merges a
sentence's final "." with the newline after it, so a chunk that ends a sentence is spelled otherwise by plain
encoding), then the engine through LLM, then a real server for both HTTP APIs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import MODEL_NAME, RunningServer, start_server, stop_server

from kvreuse import LLM, SamplingParams
from kvreuse.errors import InvalidRequestError
from kvreuse.inputs import GenerationMemory, InputProcessor, validate_chunk_spans
from kvreuse.messages import validate_messages
from kvreuse.tokenizer import Tokenizer

CHUNK = {"type": "ephemeral", "scope": "chunk"}
# Each ends a sentence: plain encoding merges its "." with the "\n" the parts are joined with.
DOC_A = "Orders ship within two working days. Returns are accepted for thirty days."
DOC_B = "Gift cards never expire. The shop is closed on public holidays."
QUESTION = "How long do returns take?"


def chunk(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "cache_control": CHUNK}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def rag(*parts: dict[str, Any], system: str = "Answer from the documents.") -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": list(parts)}]


def unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation with every cache_control taken off its parts."""
    return [{**message, "content": [{key: value for key, value in part.items() if key != "cache_control"}
                                     for part in message["content"]]}
            if isinstance(message.get("content"), list) else message for message in messages]


def plain_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """What the inputs encoded before chunks existed: the rendered chat, encoded whole."""
    return tokenizer.encode(tokenizer.render_chat(validate_messages(messages)), add_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer(tiny_model)


@pytest.fixture()
def inputs(tokenizer: Tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, max_model_len=2048, vocab_size=tokenizer.vocab_size)


# --- tokenization --------------------------------------------------------------------------------------------


def test_a_chunk_has_the_same_ids_at_any_position_and_in_any_order(inputs: InputProcessor,
                                                                   tokenizer: Tokenizer) -> None:
    alone = {DOC_A: tokenizer.encode(DOC_A, add_special_tokens=False),
             DOC_B: tokenizer.encode(DOC_B, add_special_tokens=False)}
    layouts = {
        "a, b": (rag(chunk(DOC_A), chunk(DOC_B), text(QUESTION)), [DOC_A, DOC_B]),
        "b, a": (rag(chunk(DOC_B), chunk(DOC_A), text(QUESTION)), [DOC_B, DOC_A]),
        "after text": (rag(text("Context follows."), chunk(DOC_A), text(QUESTION)), [DOC_A]),
        "other system": (rag(text(QUESTION), chunk(DOC_B), chunk(DOC_A), system="Be brief."), [DOC_B, DOC_A]),
    }
    starts = set()
    for name, (messages, docs) in layouts.items():
        prompt = inputs.from_messages(messages)
        assert len(prompt.chunk_spans) == len(docs), name
        for (start, end), doc in zip(prompt.chunk_spans, docs):
            assert prompt.token_ids[start:end] == alone[doc], name
            assert tokenizer.decode(prompt.token_ids[start:end], skip_special_tokens=False) == doc, name
            starts.add((doc, start))
        # The prompt is the same text as the unmarked one: only its token boundaries may differ.
        assert prompt.text == tokenizer.render_chat(validate_messages(messages))
        assert tokenizer.decode(prompt.token_ids, skip_special_tokens=False) == prompt.text
    assert len({start for doc, start in starts if doc == DOC_A}) == 4  # really at four different positions
    # Why it matters: encoded whole, a chunk followed by "\n" ends in a ".\n" token, so its ids depend on what
    # follows it, and the chunked prompt is spelled otherwise at that edge.
    messages = layouts["a, b"][0]
    plain = plain_ids(tokenizer, messages)
    chunked = inputs.from_messages(messages)
    assert plain != chunked.token_ids
    start, end = chunked.chunk_spans[0]
    assert plain[start:end] != alone[DOC_A]


def test_a_prompt_without_chunk_marks_is_encoded_as_before(inputs: InputProcessor, tokenizer: Tokenizer) -> None:
    conversations = [
        [{"role": "user", "content": "Hello."}],
        rag(text(DOC_A), text(DOC_B), text(QUESTION)),
        # A cache_control without a scope, or scoped to the prefix, marks no chunk.
        rag(text(DOC_A), {**text(DOC_B), "cache_control": {"type": "ephemeral"}},
            {**text(QUESTION), "cache_control": {"type": "ephemeral", "scope": "prefix"}}),
        [{"role": "system", "content": None}, {"role": "user", "content": [text(DOC_A)]},
         {"role": "assistant", "content": "Two days."}, {"role": "user", "content": QUESTION}],
    ]
    for messages in conversations:
        prompt = inputs.from_messages(messages)
        assert prompt.token_ids == plain_ids(tokenizer, messages)
        assert prompt.chunk_spans == ()
        assert "chunk_spans" not in prompt.as_engine_prompt()
    assert (inputs.from_messages(conversations[2]).token_ids
            == inputs.from_messages(unmarked(conversations[2])).token_ids)


def test_chunk_spans_cover_each_chunk_where_the_template_writes_it(inputs: InputProcessor,
                                                                   tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": [text("Rules."), chunk(DOC_B)]},
                {"role": "user", "content": [chunk(DOC_A), text(QUESTION), chunk("x")]},
                {"role": "assistant", "content": "Two days."},
                {"role": "user", "content": [chunk(DOC_A)]}]
    prompt = inputs.from_messages(messages)
    decoded = [tokenizer.decode(prompt.token_ids[start:end], skip_special_tokens=False)
               for start, end in prompt.chunk_spans]
    assert decoded == [DOC_B, DOC_A, "x", DOC_A]
    assert prompt.token_ids[slice(*prompt.chunk_spans[1])] == prompt.token_ids[slice(*prompt.chunk_spans[3])]
    assert all(end <= next_start for (_, end), (next_start, _) in zip(prompt.chunk_spans, prompt.chunk_spans[1:]))
    # The engine's prompt carries them, and reading it back gives the same spans.
    assert inputs.from_prompt(prompt.as_engine_prompt()).chunk_spans == prompt.chunk_spans


def test_generated_turns_are_still_spliced_in_beside_chunks(tokenizer: Tokenizer) -> None:
    memory = GenerationMemory()
    inputs = InputProcessor(tokenizer, generation_memory=memory)
    reply = "Two working days."
    # Sampled a character at a time: a spelling plain encoding never gives.
    sampled = [token for character in reply for token in tokenizer.encode(character, add_special_tokens=False)]
    assert sampled != tokenizer.encode(reply, add_special_tokens=False)  # not how plain encoding spells it
    memory.record(reply, sampled)
    messages = [{"role": "user", "content": [chunk(DOC_A), text(QUESTION)]},
                {"role": "assistant", "content": reply},
                {"role": "user", "content": [chunk(DOC_B), text("And gift cards?")]}]
    prompt = inputs.from_messages(messages)
    marker = tokenizer.encode(inputs.assistant_marker() or "", add_special_tokens=False)
    at = next(index for index in range(len(prompt.token_ids))
              if prompt.token_ids[index:index + len(marker)] == marker) + len(marker)
    assert prompt.token_ids[at:at + len(sampled)] == sampled
    assert [tokenizer.decode(prompt.token_ids[start:end]) for start, end in prompt.chunk_spans] == [DOC_A, DOC_B]


def test_a_template_that_alters_the_placeholders_falls_back_to_unmarked(tiny_model: Path) -> None:
    lowering = Tokenizer(tiny_model)
    render = lowering.render_chat
    lowering.render_chat = lambda *args, **kwargs: render(*args, **kwargs).lower()  # type: ignore[method-assign]
    inputs = InputProcessor(lowering)
    messages = rag(chunk(DOC_A), text(QUESTION))
    prompt = inputs.from_messages(messages)
    assert prompt.chunk_spans == ()
    assert prompt.token_ids == plain_ids(lowering, messages)
    assert prompt.text is not None and DOC_A.lower() in prompt.text and "kvreusechunk" not in prompt.text


def test_a_tokenizer_whose_encodings_do_not_concatenate_gets_no_spans(inputs: InputProcessor,
                                                                      tokenizer: Tokenizer) -> None:
    assert inputs.encodings_concatenate()  # byte-level BPE
    inputs._encodings_concatenate = False  # as a SentencePiece tokenizer with its prefix space probes
    messages = rag(chunk(DOC_A), text(QUESTION))
    prompt = inputs.from_messages(messages)
    assert prompt.chunk_spans == () and prompt.token_ids == plain_ids(tokenizer, messages)


@pytest.mark.parametrize(("part", "param"), [
    ({**text("x"), "cache_control": {"type": "ephemeral", "scope": "document"}}, "messages[1].content[0].cache_control.scope"),
    ({**text("x"), "cache_control": {"type": "persistent", "scope": "chunk"}}, "messages[1].content[0].cache_control.type"),
    ({**text("x"), "cache_control": "chunk"}, "messages[1].content[0].cache_control"),
    (chunk(""), "messages[1].content[0].text"),
])
def test_bad_chunk_marks_are_refused_naming_the_field(inputs: InputProcessor, part: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        inputs.from_messages(rag(part))
    assert refused.value.param == param and param in refused.value.message


@pytest.mark.parametrize(("spans", "param"), [
    ([[0, 2], [1, 3]], "chunk_spans[1]"),  # overlapping
    ([[4, 6], [0, 2]], "chunk_spans[1]"),  # out of order
    ([[2, 2]], "chunk_spans[0]"),  # empty
    ([[3, 9]], "chunk_spans[0]"),  # past the prompt's end
    ([[-1, 2]], "chunk_spans[0]"),
    ([[0, True]], "chunk_spans[0]"),
    ([[0, 1, 2]], "chunk_spans[0]"),
    ("0-2", "chunk_spans"),
])
def test_bad_chunk_spans_are_refused_naming_the_span(spans: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        validate_chunk_spans(spans, 8)
    assert refused.value.param == param


def test_good_chunk_spans_pass_and_need_token_ids(inputs: InputProcessor) -> None:
    assert validate_chunk_spans([[0, 2], (2, 5), [7, 8]], 8) == ((0, 2), (2, 5), (7, 8))
    assert validate_chunk_spans(None, 8) == ()
    with pytest.raises(InvalidRequestError) as refused:
        inputs.from_prompt({"prompt": "Hello there", "chunk_spans": [[0, 1]]})
    assert refused.value.param == "chunk_spans"


# --- the engine, through LLM ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="32MiB")


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture()
def admitted(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list:
    """Every Request the engine hands its scheduler while the test runs."""
    requests: list = []
    add = llm.engine.scheduler.add

    def recording(request):
        requests.append(request)
        return add(request)

    monkeypatch.setattr(llm.engine.scheduler, "add", recording)
    return requests


def test_llm_chat_carries_the_spans_and_runs_as_the_unmarked_chat(llm: LLM, admitted: list) -> None:
    # No chunk ends a sentence here, so the chunked prompt happens to be the plain one token for token.
    messages = rag(chunk("Orders ship within two working days"), chunk("Gift cards never expire"), text(QUESTION))
    chunked = llm.inputs.from_messages(messages)
    assert chunked.token_ids == plain_ids(llm.get_tokenizer(), messages) and len(chunked.chunk_spans) == 2
    llm.reset_prefix_cache()
    marked = llm.chat(messages, greedy(), use_tqdm=False)[0]
    marked_again = llm.chat(messages, greedy(), use_tqdm=False)[0]
    assert [request.chunk_spans for request in admitted] == [chunked.chunk_spans] * 2
    llm.reset_prefix_cache()
    plain = llm.chat(unmarked(messages), greedy(), use_tqdm=False)[0]
    plain_again = llm.chat(unmarked(messages), greedy(), use_tqdm=False)[0]
    assert admitted[2].chunk_spans == ()
    assert marked.prompt_token_ids == plain.prompt_token_ids
    assert marked.outputs[0].token_ids == plain.outputs[0].token_ids == marked_again.outputs[0].token_ids
    # The same prefix-cache behaviour: nothing cached at first, the same hit on the second run.
    assert marked.num_cached_tokens == plain.num_cached_tokens == 0
    assert marked_again.num_cached_tokens == plain_again.num_cached_tokens > 0


def test_llm_chat_with_a_chunk_that_changes_the_spelling_runs_its_chunked_ids(llm: LLM, admitted: list) -> None:
    messages = rag(chunk(DOC_A), text(QUESTION))
    chunked = llm.inputs.from_messages(messages)
    output = llm.chat(messages, greedy(4), use_tqdm=False)[0]
    assert output.prompt_token_ids == chunked.token_ids != plain_ids(llm.get_tokenizer(), messages)
    assert admitted[-1].chunk_spans == chunked.chunk_spans and len(output.outputs[0].token_ids) == 4
    # Token ids with spans go through LLM.generate too; the same prompt without them gives the same tokens.
    by_ids = llm.generate(chunked.as_engine_prompt(), greedy(4), use_tqdm=False)[0]
    without_spans = llm.generate({"prompt_token_ids": chunked.token_ids}, greedy(4), use_tqdm=False)[0]
    assert admitted[-2].chunk_spans == chunked.chunk_spans and admitted[-1].chunk_spans == ()
    assert by_ids.outputs[0].token_ids == without_spans.outputs[0].token_ids == output.outputs[0].token_ids


def test_the_engine_refuses_bad_spans_before_any_state_changes(llm: LLM) -> None:
    ids = llm.inputs.from_messages(rag(text(QUESTION))).token_ids
    with pytest.raises(InvalidRequestError) as refused:
        llm.engine.add_request("bad-spans", {"prompt_token_ids": ids, "chunk_spans": [[0, 4], [len(ids), len(ids) + 1]]})
    assert refused.value.param == "chunk_spans[1]"
    assert not llm.engine.has_unfinished_requests()


# --- through a real server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("chunks") / "server.log", "--stats-log-interval", "0")
    yield running
    stop_server(running)


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_openai_chat_takes_chunk_parts(server: RunningServer, tokenizer: Tokenizer) -> None:
    messages = rag(chunk(DOC_A), chunk(DOC_B), text(QUESTION))
    tokenized = post(server, "/tokenize", {"model": MODEL_NAME, "messages": messages}).json()
    spans = tokenized["chunk_spans"]
    assert [tokenizer.decode(tokenized["tokens"][start:end]) for start, end in spans] == [DOC_A, DOC_B]
    assert tokenized["tokens"] != plain_ids(tokenizer, messages)  # the server's tokens are the chunked ones
    assert "chunk_spans" not in post(server, "/tokenize", {"model": MODEL_NAME,
                                                           "messages": unmarked(messages)}).json()
    reply = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 2,
                                                   "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == tokenized["count"]


def test_openai_chat_refuses_an_unknown_scope_naming_the_field(server: RunningServer) -> None:
    messages = rag(text("Context:"), {**text(DOC_A), "cache_control": {"type": "ephemeral", "scope": "anywhere"}})
    reply = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 2})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages[1].content[1].cache_control.scope" and "'anywhere'" in error["message"]


def anthropic_body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "messages": messages, **fields}


def document(data: str, **fields: Any) -> dict[str, Any]:
    return {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": data}, **fields}


def test_anthropic_text_and_document_chunks_are_no_breakpoints(server: RunningServer, tokenizer: Tokenizer) -> None:
    # Five chunk marks: past the 4 breakpoints a request may have, were they counted.
    content = [{**document(DOC_A, title="Shipping"), "cache_control": CHUNK}, chunk(DOC_B), chunk("one"),
               chunk("two"), {**text("three"), "cache_control": CHUNK}, text(QUESTION)]
    reply = post(server, "/v1/messages", anthropic_body([{"role": "user", "content": content}], system="Be brief."))
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["cache_creation_input_tokens"] == 0  # no breakpoint: nothing is written for one
    # The same conversation through the OpenAI shape, marks included, is the same prompt.
    openai_shaped = rag(chunk(f"Shipping\n\n{DOC_A}"), chunk(DOC_B), chunk("one"), chunk("two"), chunk("three"),
                        text(QUESTION), system="Be brief.")
    tokenized = post(server, "/tokenize", {"model": MODEL_NAME, "messages": openai_shaped}).json()
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == tokenized["count"]
    start, end = tokenized["chunk_spans"][0]
    assert tokenizer.decode(tokenized["tokens"][start:end]) == f"Shipping\n\n{DOC_A}"
    # A breakpoint beside the chunks still is one: what it covers past the cached part is written for it (another
    # system prompt, so little is cached).
    content[-1] = {**text(QUESTION), "cache_control": {"type": "ephemeral"}}
    pinned = post(server, "/v1/messages", anthropic_body([{"role": "user", "content": content}],
                                                         system="Be brief and kind."))
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["usage"]["cache_creation_input_tokens"] > tokenized["count"] // 2


@pytest.mark.parametrize(("body", "param"), [
    (anthropic_body([{"role": "user", "content": [
        {**text(DOC_A), "cache_control": {"type": "ephemeral", "scope": "everywhere"}}]}]),
     "messages[0].content[0].cache_control.scope"),
    (anthropic_body([{"role": "user", "content": [text(QUESTION)]}], cache_control=CHUNK), "cache_control.scope"),
    (anthropic_body([{"role": "user", "content": [{**document(DOC_A), "cache_control": CHUNK}]},
                     {"role": "assistant", "content": [{**document(DOC_B)}]}]), "messages[1].content[0].type"),
    (anthropic_body([{"role": "user", "content": [document(DOC_A, citations={"enabled": True})]}]),
     "messages[0].content[0].citations.enabled"),
])
def test_anthropic_refuses_bad_chunk_marks_naming_the_field(server: RunningServer, body: dict, param: str) -> None:
    reply = post(server, "/v1/messages", body)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith(param), reply.text


def test_anthropic_refuses_a_chunk_on_a_tool_result(server: RunningServer) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C",
                                      "cache_control": CHUNK}]},
    ]
    reply = post(server, "/v1/messages", anthropic_body(messages))
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("messages[2].content[0].cache_control.scope"), reply.text
