"""Many concurrent streams with stop strings, through both HTTP APIs, while other requests are being
tokenized on the same event loop: no tokenizer error ("Already borrowed"), every stream's text equals
the non-streamed text, and no stop string (nor the start of one) leaks into a stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from server_process import MODEL_NAME, RunningServer, start_server, stop_server

GREEDY = {"temperature": 0}
QUESTIONS = [f"Question {i}: how do I {topic}?" for i, topic in enumerate(
    ["sort a list", "read a file", "parse JSON", "format a date", "join strings", "count words",
     "reverse a dict", "merge two lists", "sum numbers", "find a key", "strip spaces", "split lines"])]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("stress") / "server.log", "--stats-log-interval", "0")
    yield running
    stop_server(running)


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You answer programming questions briefly."},
            {"role": "user", "content": question}]


def stop_across_tokens(tokens: list[str]) -> str:
    """A stop string that starts at the last character of one output token and runs into the next,
    near the middle of the output: a stream must hold that character back until the next token shows
    the stop string (and then never send it)."""
    middle = len(tokens) // 2
    for k in sorted(range(len(tokens) - 1), key=lambda k: abs(k - middle)):
        if tokens[k] and len(tokens[k + 1]) >= 2:
            return tokens[k][-1] + tokens[k + 1][:2]
    raise AssertionError(f"no two adjacent tokens to build a stop string from: {tokens}")


def test_concurrent_streams_with_stop_strings_match_the_full_responses(server: RunningServer):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    # Free-running outputs first, with their tokens, to pick stop strings that really occur in each one.
    free_choices = [client.chat.completions.create(model=MODEL_NAME, messages=messages(q), max_tokens=MAX_TOKENS,
                                                   temperature=0, logprobs=True).choices[0] for q in QUESTIONS]
    free = [choice.message.content for choice in free_choices]
    stops = [stop_across_tokens([entry.token for entry in choice.logprobs.content]) for choice in free_choices]
    # Reference: the same requests with their stop string, not streamed.
    expected_chat = [client.chat.completions.create(model=MODEL_NAME, messages=messages(q), max_tokens=MAX_TOKENS,
                                                    temperature=0, stop=[stop]).choices[0].message.content
                     for q, stop in zip(QUESTIONS, stops)]
    expected_completion = [client.completions.create(model=MODEL_NAME, prompt=q, max_tokens=MAX_TOKENS,
                                                     temperature=0, stop=[stop]).choices[0].text
                           for q, stop in zip(QUESTIONS, stops)]
    assert all(len(text) < len(full) for text, full in zip(expected_chat, free)), "a stop string cut nothing"
    messages_client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    expected_anthropic = [
        messages_client.messages.create(model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                        system=messages(q)[0]["content"], messages=messages(q)[1:],
                                        stop_sequences=[stop]).content
        for q, stop in zip(QUESTIONS, stops)
    ]
    expected_anthropic_text = [blocks[0].text if blocks else "" for blocks in expected_anthropic]
    assert expected_anthropic_text == expected_chat  # the same conversation through the other API

    async def run_all() -> tuple[list[str], list[str], list[str], list[int]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        aanthropic = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        http = httpx.AsyncClient(base_url=server.base_url, timeout=120)

        async def chat_stream(question: str, stop: str) -> str:
            stream = await aclient.chat.completions.create(model=MODEL_NAME, messages=messages(question),
                                                           max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
                                                           stream=True)
            return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

        async def completion_stream(question: str, stop: str) -> str:
            stream = await aclient.completions.create(model=MODEL_NAME, prompt=question, max_tokens=MAX_TOKENS,
                                                      temperature=0, stop=[stop], stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async def anthropic_stream(question: str, stop: str) -> str:
            parts: list[str] = []
            async with aanthropic.messages.stream(model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                                  system=messages(question)[0]["content"],
                                                  messages=messages(question)[1:], stop_sequences=[stop]) as stream:
                async for text in stream.text_stream:
                    parts.append(text)
            return "".join(parts)

        async def tokenize(index: int) -> int:
            # Encoding on the event loop while other streams are being detokenized there.
            body = {"model": MODEL_NAME, "prompt": QUESTIONS[index % len(QUESTIONS)] * 40}
            response = await http.post("/tokenize", json=body)
            return response.status_code

        try:
            results = await asyncio.gather(
                asyncio.gather(*[chat_stream(q, s) for q, s in zip(QUESTIONS, stops)]),
                asyncio.gather(*[completion_stream(q, s) for q, s in zip(QUESTIONS, stops)]),
                asyncio.gather(*[anthropic_stream(q, s) for q, s in zip(QUESTIONS, stops)]),
                asyncio.gather(*[tokenize(i) for i in range(48)]),
            )
        finally:
            await http.aclose()
        return results  # type: ignore[return-value]

    chat, completions, anthropic_texts, statuses = asyncio.run(run_all())
    assert statuses == [200] * 48
    assert chat == expected_chat
    assert completions == expected_completion
    assert anthropic_texts == expected_anthropic_text
    for texts in (chat, completions, anthropic_texts):
        for text, stop in zip(texts, stops):
            assert stop not in text
    log = server.log_tail(200_000)
    assert "Already borrowed" not in log and "Traceback" not in log
