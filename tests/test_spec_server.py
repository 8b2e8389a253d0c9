"""Speculative decoding through the commands: ``kvreuse serve --speculative-config`` with the official
openai SDK (greedy text as without speculation, streaming, /metrics spec counters, the draft digest in
/v1/models), the router keying blocks as a speculative engine does, the batch summary and the demo.

The server runs a tiny made model with a made EAGLE draft that agrees with it on part of its tokens
(the demo test uses a random one): a random draft accepts (almost) nothing, so it would never send
several tokens per step through the server's streams, nor fill the per-position counters. The target's attention and MLP add nothing
(o_proj = down_proj = 0), so its next token is argmax(lm_head(norm(embed(token)))); the draft computes
argmax(lm_head(embed(token) @ (I + noise))): it agrees where the noise does not move the argmax.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import MODEL_NAME, RunningServer, start_server, stop_server
from test_spec import make_agreeing_pair

from kvreuse import LLM, SamplingParams
from kvreuse.batch import BatchFile, run_batch
from kvreuse.cli import build_parser
from kvreuse.inputs import InputProcessor
from kvreuse.model_tools.make_draft import make_random_draft
from kvreuse.router.app import RouterConfig, RouterState
from kvreuse.router.policy import PolicyConfig, Router, prompt_block_keys
from kvreuse.server.metrics import PeriodicStatsLogger, ServerMetrics
from kvreuse.tokenizer import Tokenizer

K = 3  # num_speculative_tokens
MAX_TOKENS = 24
ENGINE_OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory="32MiB", served_model_name=MODEL_NAME)
MESSAGES = [{"role": "system", "content": "You are a terse assistant of a bookshop. " * 6},
            {"role": "user", "content": "hi there, what is up"}]
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-server")
    target, draft = make_agreeing_pair(root, noise=0.3)
    return {"target": target, "draft": draft,
            "random_draft": make_random_draft(target, root / "random-draft", seed=5), "root": root}


def spec_json(draft: Path) -> str:
    return json.dumps({"method": "eagle", "model": str(draft), "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def server(made: dict[str, Path]) -> Iterator[RunningServer]:
    running = start_server(made["target"], made["root"] / "server.log", "--speculative-config",
                           spec_json(made["draft"]), "--stats-log-interval", "0")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def reference(made: dict[str, Path]) -> LLM:
    """The same model without speculation: the greedy text every speculative path must give."""
    return LLM(str(made["target"]), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def spec_llm(made: dict[str, Path]) -> LLM:
    """The server's engine, offline: same model, same draft."""
    return LLM(str(made["target"]), speculative_config=spec_json(made["draft"]), **ENGINE_OPTIONS)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def chat(server: RunningServer, messages: list[dict], **kwargs):
    return client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body={"ignore_eos": True}, **kwargs)


def scrape(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


# --- the server --------------------------------------------------------------------------------------

def test_chat_and_completions_give_the_greedy_text_of_no_speculation(server: RunningServer, reference: LLM):
    expected_chat = reference.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].text
    first = chat(server, MESSAGES)
    assert first.choices[0].message.content == expected_chat
    assert first.usage.completion_tokens == MAX_TOKENS
    again = chat(server, MESSAGES)  # served from the prefix cache (target and draft K/V), same text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == expected_chat

    completion = client(server).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == reference.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert completion.usage.completion_tokens == MAX_TOKENS


def test_streams_carry_every_token_of_multi_token_steps(server: RunningServer, reference: LLM):
    messages = [MESSAGES[0], {"role": "user", "content": "and where is my order?"}]
    expected = reference.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0]
    chunks = list(chat(server, messages, stream=True, stream_options={"include_usage": True}))
    contents = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(contents) == expected.text
    assert len(contents) < MAX_TOKENS  # accepted drafts: some steps sent several tokens in one chunk
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"

    stream = client(server).completions.create(model=MODEL_NAME, prompt=PROMPT + " again", max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
    expected_text = reference.generate(PROMPT + " again", GREEDY, use_tqdm=False)[0].outputs[0].text
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected_text


def test_metrics_export_the_spec_decode_counters(server: RunningServer, reference: LLM):
    chat(server, [MESSAGES[0], {"role": "user", "content": "do gift cards expire?"}])
    metrics = scrape(server)
    drafts = metrics[("kvreuse:spec_decode_num_drafts_total", ())]
    draft_tokens = metrics[("kvreuse:spec_decode_num_draft_tokens_total", ())]
    accepted = metrics[("kvreuse:spec_decode_num_accepted_tokens_total", ())]
    per_position = [metrics[("kvreuse:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
                    for i in range(K)]
    assert ("kvreuse:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(K)),)) not in metrics
    assert 0 < drafts and drafts <= draft_tokens <= K * drafts
    assert 0 < accepted <= draft_tokens  # this draft agrees with its target on part of the tokens
    assert sum(per_position) == accepted
    assert all(later <= earlier for earlier, later in zip(per_position, per_position[1:]))
    # Without speculation the family is absent, not zero.
    plain = ServerMetrics("m", reference.engine.stats).render()[0].decode()
    assert "spec_decode" not in plain and "kvreuse:prefix_cache_queries_total" in plain


def test_models_card_reports_the_draft_digest(server: RunningServer, spec_llm: LLM, reference: LLM):
    cards = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    assert cards[0]["id"] == MODEL_NAME
    assert cards[0]["draft_digest"] == spec_llm.engine.draft_digest
    assert len(spec_llm.engine.draft_digest) == 32 and reference.engine.draft_digest is None


# --- the router ----------------------------------------------------------------------------------------

def test_router_reads_the_digest_and_its_keys_are_the_servers_kv_events(server: RunningServer,
                                                                        made: dict[str, Path]):
    messages = [{"role": "system", "content": "You route parcels across Europe quickly. " * 6},
                {"role": "user", "content": "where is parcel 7?"}]
    chat(server, messages)

    async def probe_and_route():
        state = RouterState(RouterConfig(backends=(server.base_url,), tokenizer=str(made["target"]),
                                         kv_events=False))
        try:
            await state.pool.probe_all()
            return state.pool.backends[server.base_url], state.route_request(
                {"model": MODEL_NAME, "messages": messages}, chat=True, session_id=None)
        finally:
            await state.client.aclose()

    backend, route = asyncio.run(probe_and_route())
    card = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]
    assert backend.draft_digest == card["draft_digest"] and backend.model_name == MODEL_NAME
    assert backend.describe(0)["draft_digest"] == card["draft_digest"]
    events = httpx.get(f"{server.base_url}/v1/cache/events", params={"after": 0}, timeout=10).json()["events"]
    stored = {bytes.fromhex(event["key"]) for event in events if event["type"] == "stored"}
    assert len(route.block_keys) >= 2 and set(route.block_keys) <= stored
    token_ids = InputProcessor(Tokenizer(str(made["target"]))).from_messages(messages).token_ids
    draftless = prompt_block_keys(token_ids, 16, model=MODEL_NAME)  # a router that ignored the draft
    assert not set(draftless) & stored


def test_prompt_block_keys_with_the_draft_equal_the_engines_and_backends_key_per_draft(spec_llm: LLM,
                                                                                       made: dict[str, Path]):
    engine = spec_llm.engine
    tokenized = spec_llm.inputs.from_messages(MESSAGES)
    engine.add_request("keys", tokenized.as_engine_prompt(), SamplingParams(temperature=0.0, max_tokens=2))
    engine.step()
    engine_keys = list(engine.scheduler.running[0].block_keys)
    while engine.has_unfinished_requests():
        engine.step()
    router_keys = prompt_block_keys(tokenized.token_ids, 16, model=MODEL_NAME, draft=engine.draft_digest)
    assert len(router_keys) >= 2 and engine_keys[: len(router_keys)] == router_keys
    assert prompt_block_keys(tokenized.token_ids, 16, model=MODEL_NAME)[0] != router_keys[0]

    # Two backends behind one model name, one with this draft and one with another: keys per backend.
    state = RouterState(RouterConfig(backends=("http://a", "http://b"), tokenizer=str(made["target"])))
    a, b = state.pool.backends["http://a"], state.pool.backends["http://b"]
    a.model_name = b.model_name = MODEL_NAME
    a.draft_digest, b.draft_digest = engine.draft_digest, "0" * 32
    route = state.route_request({"model": MODEL_NAME, "messages": MESSAGES}, chat=True, session_id=None)
    assert list(route.keys_for("http://a")) == router_keys
    assert list(route.keys_for("http://b")) == prompt_block_keys(tokenized.token_ids, 16, model=MODEL_NAME,
                                                                 draft="0" * 32)
    router = Router(PolicyConfig())
    for name in ("http://a", "http://b"):
        router.index.add_backend(name, 1000)
    loads = state.pool.loads
    router.record_sent("http://b", route)
    router.record_finished("http://b", route)
    decision = router.choose(route, loads, now=0.0)
    assert (decision.backend, decision.reason) == ("http://b", "cache")
    assert decision.matched_blocks == len(router_keys)
    assert router.index.matched_blocks("http://a", route.keys_for("http://a")) == 0
    # Same draft everywhere: one set of keys, no per-backend copies.
    b.draft_digest = engine.draft_digest
    same = state.route_request({"model": MODEL_NAME, "messages": MESSAGES}, chat=True, session_id=None)
    assert same.backend_keys == {} and list(same.block_keys) == router_keys


def test_the_periodic_stats_log_has_the_interval_acceptance_rate(spec_llm: LLM, caplog: pytest.LogCaptureFixture):
    logger = logging.getLogger("kvreuse.test_spec_server")
    stats_logger = PeriodicStatsLogger(1.0, logger, spec_llm.engine.stats())
    before = spec_llm.stats()
    spec_llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    after = spec_llm.stats()
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    with caplog.at_level(logging.INFO, logger=logger.name):
        stats_logger.maybe_log(spec_llm.engine.stats(), time.monotonic() + 2.0)
    line = next(record.getMessage() for record in caplog.records if "speculative decoding" in record.getMessage())
    assert f"{accepted} of {drafted} draft tokens accepted" in line and drafted > 0


# --- batch runner, demo, command line ------------------------------------------------------------------

def test_batch_summary_has_the_acceptance_figures(spec_llm: LLM, reference: LLM):
    batch = BatchFile.model_validate({"requests": [
        {"messages": MESSAGES, "max_tokens": 8, "ignore_eos": True},
        {"messages": [MESSAGES[0], {"role": "user", "content": "opening hours?"}], "max_tokens": 8,
         "ignore_eos": True}]})
    summary = run_batch(spec_llm.engine, batch)["summary"]
    per_position = summary["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_position) == K and sum(per_position) == summary["spec_decode_num_accepted_tokens"] > 0
    assert 0 < summary["spec_decode_acceptance_rate"] <= 1
    assert summary["spec_decode_num_draft_tokens"] <= K * summary["spec_decode_num_drafts"]
    # The batch's own share of the engine's counters: the same batch again counts the same.
    again = run_batch(spec_llm.engine, batch)["summary"]
    assert {k: v for k, v in again.items() if k.startswith("spec_decode")} == \
        {k: v for k, v in summary.items() if k.startswith("spec_decode")}
    assert not any(key.startswith("spec_decode") for key in run_batch(reference.engine, batch)["summary"])


def test_demo_prints_the_acceptance_rate(made: dict[str, Path], capsys: pytest.CaptureFixture[str]):
    """With a random draft: it accepts (almost) nothing, and the demo says so."""
    parser, commands = build_parser()
    args = parser.parse_args(["demo", "--model", str(made["target"]),
                              "--speculative-config", spec_json(made["random_draft"]),
                              "--num-requests", "2", "--max-tokens", "8", "--dtype", "float32", "--device", "cpu",
                              "--kv-cache-memory", "32MiB"])
    assert commands["demo"].run(args) == 0
    out = capsys.readouterr().out
    assert "prefix cache hit rate" in out and "speculative decoding acceptance rate" in out


@pytest.mark.parametrize("value, field", [
    ('{"method": "eagle", "model": "d"}', "num_speculative_tokens"),
    ('{"method": "eagle", "model": "d", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "eagle", "model": "d", "num_speculative_tokens": 2, "draft": 1}', "draft"),
    ('{"method": eagle}', "JSON"),
    ('[1]', "object"),
])
def test_bad_speculative_configs_stop_the_parse_naming_the_field(value: str, field: str,
                                                                 capsys: pytest.CaptureFixture[str]):
    parser, _ = build_parser()
    for command in ("serve", "run", "demo"):
        extra = ["batch.json"] if command == "run" else []
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([command, *extra, "--model", "m", "--speculative-config", value])
        assert exit_info.value.code != 0
        error = capsys.readouterr().err
        assert f"kvreuse {command}: error: argument --speculative-config" in error and field in error, error


@pytest.mark.parametrize("config, field", [
    ('{"method": "medusa", "model": "d", "num_speculative_tokens": 2}', "speculative_config.method"),
    (None, "speculative_config.model"),  # a draft folder that is not there: found when the engine loads
])
def test_kvreuse_serve_exits_non_zero_on_a_malformed_speculative_config(made: dict[str, Path], config: str | None,
                                                                         field: str):
    config = config or spec_json(made["root"] / "no-such-draft")
    result = subprocess.run([sys.executable, "-m", "kvreuse.cli", "serve", "--model", str(made["target"]),
                             "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "8MiB",
                             "--speculative-config", config], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "kvreuse serve: error:" in result.stderr and field in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
