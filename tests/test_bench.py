"""Benchmark suite: workload generators (exact lengths, sharing structure) and the load client's
statistics against a stub server with scripted delays, usage numbers and failures; the agent
workload's loop (tool calls fed back exactly as streamed) against a stub that streams tool calls."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvreuse.bench.agent import AgentReply, ToolCallDeltas, followup_messages
from kvreuse.bench.client import (
    BenchmarkRun,
    ClientConfig,
    LoadClient,
    RequestResult,
    arrival_offsets,
    compose_agent_messages,
    compose_text,
)
from kvreuse.bench.report import (
    Distribution,
    format_table,
    format_turns_comparison,
    percentile,
    summarize,
    turn_summaries,
)
from kvreuse.bench.workloads import (
    AgentOptions,
    BenchRequest,
    HotPrefixOptions,
    MultiTurnOptions,
    RagOptions,
    RandomOptions,
    SharedPrefixOptions,
    generate_workload,
    sample_zipf_without_replacement,
)
from kvreuse.inputs import common_prefix_length

# The stub's script: first token after TTFT_S, then a token every ITL_S.
TTFT_S = 0.20
ITL_S = 0.05
NUM_TOKENS = 5
STUB_PROMPT_TOKENS = 100
STUB_CACHED_TOKENS = 60
REPLY_WORDS = (" alpha", " beta", " gamma", " delta", " epsilon")
# Scheduling and loopback overhead allowed on top of the scripted delays (a loaded 2-core machine).
SLACK_S = 0.08


# --------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from kvreuse.tokenizer import Tokenizer

    return Tokenizer(tiny_model)


def _ids(tokenizer, request: BenchRequest, history=()) -> list[int]:
    return tokenizer.encode(compose_text(request, history))


@dataclass
class StubState:
    """What the stub saw: request bodies, arrival / finish times, the most requests in flight."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    in_flight: int = 0
    max_in_flight: int = 0


def _stub_app(state: StubState) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        state.bodies.append(body)
        chat = "messages" in body
        prompt = json.dumps(body["messages"]) if chat else str(body["prompt"])
        if "FAIL500" in prompt:
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error"}}, status_code=500)
        arrived = time.perf_counter()
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)

        def chunk(text: str, finish_reason: str | None = None, role: bool = False) -> bytes:
            if chat:
                choice = {"index": 0, "delta": {"role": "assistant", "content": ""} if role else {"content": text}}
            else:
                choice = {"index": 0, "text": text}
            choice["finish_reason"] = finish_reason
            return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"

        async def stream():
            try:
                await asyncio.sleep(TTFT_S)
                if chat:
                    yield chunk("", role=True)
                for index, word in enumerate(REPLY_WORDS):
                    if index:
                        await asyncio.sleep(ITL_S)
                    if "SILENT" not in prompt:  # SILENT: tokens without text send nothing
                        yield chunk("" if "EMPTYTEXT" in prompt else word)
                    if "DROP" in prompt and index == 1:
                        raise ConnectionResetError("scripted drop")  # uvicorn closes the connection
                yield chunk("", finish_reason="length")
                usage: dict[str, Any] = {"prompt_tokens": STUB_PROMPT_TOKENS, "completion_tokens": NUM_TOKENS,
                                         "total_tokens": STUB_PROMPT_TOKENS + NUM_TOKENS}
                if "NODETAILS" not in prompt:
                    usage["prompt_tokens_details"] = {"cached_tokens": STUB_CACHED_TOKENS}
                yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                state.in_flight -= 1
                state.spans[prompt] = (arrived, time.perf_counter())

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/reset_prefix_cache")
    async def reset() -> dict[str, int]:
        return {"freed_blocks": 0}

    return app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_in_thread(app) -> Iterator[str]:
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the stub server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture()
def stub() -> Iterator[tuple[str, StubState]]:
    state = StubState()
    for base_url in _serve_in_thread(_stub_app(state)):
        yield base_url, state


def _request(request_id: str, prompt: str, **extra: Any) -> BenchRequest:
    return BenchRequest(request_id=request_id, group=request_id, prefix_text="", user_text=prompt,
                        max_tokens=NUM_TOKENS,
                        prompt_tokens=None, designed_shared_tokens=0, **extra)


def _config(base_url: str, **overrides: Any) -> ClientConfig:
    return ClientConfig(**{"base_url": base_url, "model": "stub", "progress": False, **overrides})


# --------------------------------------------------------------------------------------------------
# Workloads


def test_shared_prefix_lengths_are_exact_and_groups_share_exactly_the_system_prompt(tokenizer) -> None:
    options = SharedPrefixOptions(num_groups=3, prompts_per_group=5, system_prompt_len=96, question_len=12,
                                  output_len=4)
    workload = generate_workload("shared-prefix", tokenizer, options, seed=3)
    assert len(workload.requests) == 15
    ids = {request.request_id: _ids(tokenizer, request) for request in workload.requests}
    for request in workload.requests:
        assert len(ids[request.request_id]) == 96 + 12 == request.prompt_tokens
    groups: dict[str, list[list[int]]] = {}
    for request in workload.requests:
        groups.setdefault(request.group, []).append(ids[request.request_id])
    assert len(groups) == 3
    for members in groups.values():
        # The group as a whole shares exactly the system prompt; each pair at least that.
        common = min(common_prefix_length(members[0], other) for other in members[1:])
        assert common == 96
        assert all(common_prefix_length(a, b) >= 96 for a in members for b in members if a is not b)
    heads = [members[0] for members in groups.values()]
    assert all(common_prefix_length(a, b) < 16 for a in heads for b in heads if a is not b)
    # Shuffled (not group after group), and only the first of each group in send order shares nothing.
    order = [request.group for request in workload.requests]
    assert order != sorted(order)
    seen: set[str] = set()
    for request in workload.requests:
        assert request.designed_shared_tokens == (96 if request.group in seen else 0)
        seen.add(request.group)


def test_workloads_are_pure_functions_of_tokenizer_options_and_seed(tokenizer) -> None:
    options = SharedPrefixOptions(num_groups=2, prompts_per_group=3, system_prompt_len=40, question_len=8, output_len=2)
    first = generate_workload("shared-prefix", tokenizer, options, seed=1)
    assert generate_workload("shared-prefix", tokenizer, options, seed=1) == first
    assert generate_workload("shared-prefix", tokenizer, options, seed=2).requests != first.requests
    # Another workload with the same seed shares no text: a server that ran one cannot hit on the other.
    other = generate_workload("random", tokenizer, RandomOptions(input_len=48, output_len=2, num_requests=4), seed=1)
    assert all(common_prefix_length(_ids(tokenizer, a), _ids(tokenizer, b)) < 8
               for a in first.requests for b in other.requests)


def test_random_prompts_share_nothing_beyond_chance(tokenizer) -> None:
    options = RandomOptions(input_len=64, output_len=4, num_requests=12)
    workload = generate_workload("random", tokenizer, options, seed=0)
    ids = [_ids(tokenizer, request) for request in workload.requests]
    assert all(len(prompt) == 64 == request.prompt_tokens for prompt, request in zip(ids, workload.requests))
    longest = max(common_prefix_length(a, b) for index, a in enumerate(ids) for b in ids[index + 1:])
    assert longest < 4  # a block of 16 never matches
    assert all(request.designed_shared_tokens == 0 for request in workload.requests)


def test_multi_turn_first_turns_share_the_system_prompt_and_histories_extend(tokenizer) -> None:
    options = MultiTurnOptions(num_conversations=3, num_turns=3, system_prompt_len=40, user_len=10, output_len=4)
    workload = generate_workload("multi-turn", tokenizer, options, seed=0)
    assert len(workload.requests) == 9
    # Turn-major order; every later turn depends on the previous turn of its own conversation.
    assert [request.turn for request in workload.requests] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for request in workload.requests:
        assert request.depends_on == (None if request.turn == 0 else (request.conversation, request.turn - 1))
    first_turns = [request for request in workload.requests if request.turn == 0]
    first_ids = [_ids(tokenizer, request) for request in first_turns]
    assert all(len(ids) == 50 == request.prompt_tokens for ids, request in zip(first_ids, first_turns))
    assert all(common_prefix_length(first_ids[0], ids) == 40 for ids in first_ids[1:])
    assert [request.designed_shared_tokens for request in first_turns] == [0, 40, 40]
    # Each turn's prompt is the previous prompt plus the reply plus the new message.
    conversation = [request for request in workload.requests if request.conversation == "c1"]
    history: list[tuple[str, str]] = []
    previous = ""
    for request in conversation:
        text = compose_text(request, history)
        assert text.startswith(previous)
        assert len(tokenizer.encode(request.user_text, add_special_tokens=False)) == 10
        history.append((request.user_text, " some reply"))
        previous = text + " some reply"


def test_zipf_sampler_follows_the_power_law() -> None:
    rng = random.Random(7)
    draws = 6000
    firsts = Counter(sample_zipf_without_replacement(rng, 20, 1, 1.2)[0] for _ in range(draws))
    harmonic = sum((rank + 1) ** -1.2 for rank in range(20))
    for rank in (0, 1, 3):
        expected = (rank + 1) ** -1.2 / harmonic
        assert abs(firsts[rank] / draws - expected) < 0.15 * expected + 0.005
    assert firsts[0] / firsts[1] == pytest.approx(2 ** 1.2, rel=0.15)
    picks = sample_zipf_without_replacement(random.Random(0), 5, 5, 2.0)
    assert sorted(picks) == list(range(5))  # without replacement
    with pytest.raises(ValueError, match="rag_top_k"):
        sample_zipf_without_replacement(rng, 3, 4, 1.0)


def test_rag_prompts_are_the_picked_chunks_in_order_then_a_question(tokenizer) -> None:
    options = RagOptions(num_chunks=8, chunk_len=20, top_k=3, zipf_a=1.5, question_len=6, output_len=2,
                         num_requests=40)
    workload = generate_workload("rag", tokenizer, options, seed=0)
    assert len(workload.requests) == 40
    firsts = Counter(request.group.split("-")[1] for request in workload.requests)
    assert firsts["0"] > firsts.get("7", 0)  # skewed towards low ranks
    for request in workload.requests:
        ids = _ids(tokenizer, request)
        assert len(ids) == 3 * 20 + 6 == request.prompt_tokens
    # Two requests whose first chunk is the same share exactly (at least) that chunk.
    by_first: dict[str, list[BenchRequest]] = {}
    for request in workload.requests:
        by_first.setdefault(request.group.split("-")[1], []).append(request)
    shared_pairs = [members[:2] for members in by_first.values() if len(members) > 1]
    assert shared_pairs
    for first, second in shared_pairs:
        assert common_prefix_length(_ids(tokenizer, first), _ids(tokenizer, second)) >= 20
    assert workload.requests[0].designed_shared_tokens == 0


def test_hot_prefix_takes_its_share_of_the_traffic(tokenizer) -> None:
    options = HotPrefixOptions(num_cold_prefixes=3, hot_fraction=0.8, prefix_len=32, question_len=4, output_len=2,
                               num_requests=50)
    workload = generate_workload("hot-prefix", tokenizer, options, seed=0)
    groups = Counter(request.group for request in workload.requests)
    assert groups["hot"] == 40
    assert set(groups) == {"hot", "cold0", "cold1", "cold2"}
    prefixes = {request.group: _ids(tokenizer, request)[:32] for request in workload.requests}
    assert len({tuple(prefix) for prefix in prefixes.values()}) == 4
    for request in workload.requests:
        ids = _ids(tokenizer, request)
        assert len(ids) == 36 and ids[:32] == prefixes[request.group]


def test_bad_options_name_the_field(tokenizer) -> None:
    with pytest.raises(ValueError, match="gsp_system_prompt_len"):
        generate_workload("shared-prefix", tokenizer, SharedPrefixOptions(system_prompt_len=0), seed=0)
    with pytest.raises(ValueError, match="hot_fraction"):
        generate_workload("hot-prefix", tokenizer, HotPrefixOptions(hot_fraction=1.5), seed=0)
    with pytest.raises(ValueError, match="num_requests must be at most 32"):
        generate_workload("shared-prefix", tokenizer, SharedPrefixOptions(system_prompt_len=8), seed=0, num_requests=33)
    with pytest.raises(ValueError, match="workload must be one of"):
        generate_workload("nope", tokenizer, RandomOptions(), seed=0)


# --------------------------------------------------------------------------------------------------
# Statistics


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(0)
    for size in (1, 2, 7, 100):
        values = [rng.random() for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_poisson_arrivals_are_seeded_with_the_requested_rate() -> None:
    offsets = arrival_offsets(4000, 10.0, seed=5)
    assert offsets == arrival_offsets(4000, 10.0, seed=5)
    assert offsets != arrival_offsets(4000, 10.0, seed=6)
    gaps = [later - earlier for earlier, later in zip(offsets, offsets[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.1)  # exponential: stdev = mean
    assert arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_summary_arithmetic_on_known_results() -> None:
    def ok(ttft: float, e2e: float, itl: list[float], prompt: int, cached: int, output: int) -> RequestResult:
        return RequestResult("r", "g", None, 0, success=True, ttft_s=ttft, e2e_s=e2e, itl_s=itl, prompt_tokens=prompt,
                             cached_tokens=cached, cached_tokens_reported=True, output_tokens=output,
                             usage_reported=True)

    results = [ok(0.1, 0.5, [0.1, 0.3], 100, 50, 5), ok(0.3, 0.6, [0.1], 300, 0, 4),
               RequestResult("x", "g", None, 0, error="HTTP 503: overloaded")]
    summary = summarize(BenchmarkRun(results, duration_s=2.0))
    assert (summary.completed, summary.failed, summary.errors) == (2, 1, {"HTTP 503": 1})
    assert summary.cache_hit_rate == pytest.approx(50 / 400)
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_throughput == pytest.approx(9 / 2.0)
    assert summary.total_token_throughput == pytest.approx(409 / 2.0)
    assert summary.ttft == Distribution(2, 0.2, 0.2, pytest.approx(0.28), pytest.approx(0.298), 0.1, 0.3)
    assert summary.tpot.mean == pytest.approx(((0.5 - 0.1) / 4 + (0.6 - 0.3) / 3) / 2)
    assert summary.itl.count == 3 and summary.itl.median == pytest.approx(0.1)


# --------------------------------------------------------------------------------------------------
# The client against the stub server


def test_client_measures_scripted_latencies_usage_and_errors(stub) -> None:
    base_url, _ = stub
    requests = [_request(f"ok{index}", f"ok {index}") for index in range(4)]
    requests += [_request("fail", "FAIL500 please"), _request("drop", "DROP please")]
    run = LoadClient(_config(base_url)).run(requests)
    results = {result.request_id: result for result in run.results}
    for index in range(4):
        result = results[f"ok{index}"]
        assert result.success, result.error
        assert TTFT_S - 0.01 <= result.ttft_s <= TTFT_S + SLACK_S
        assert len(result.itl_s) == NUM_TOKENS - 1
        assert all(ITL_S - 0.01 <= gap <= ITL_S + SLACK_S for gap in result.itl_s)
        assert result.tpot_s == pytest.approx(ITL_S, abs=SLACK_S / 2)
        assert result.e2e_s == pytest.approx(TTFT_S + (NUM_TOKENS - 1) * ITL_S, abs=SLACK_S * 2)
        assert (result.prompt_tokens, result.cached_tokens, result.output_tokens) == (100, 60, 5)
        assert result.cached_tokens_reported and result.generated_text == "".join(REPLY_WORDS)
    assert results["fail"].error.startswith("HTTP 500: scripted failure") and results["fail"].status_code == 500
    assert results["drop"].error.startswith("connection:") and not results["drop"].success

    summary = summarize(run)
    assert (summary.completed, summary.failed) == (4, 2)
    assert summary.errors == {"HTTP 500": 1, "connection: RemoteProtocolError": 1}
    assert summary.cache_hit_rate == pytest.approx(0.6)
    assert summary.ttft.median == pytest.approx(TTFT_S, abs=SLACK_S)
    assert summary.itl.median == pytest.approx(ITL_S, abs=SLACK_S / 2)
    # Everything went out at once: the run lasts about one request.
    expected_duration = TTFT_S + (NUM_TOKENS - 1) * ITL_S
    assert expected_duration <= run.duration_s <= expected_duration + 3 * SLACK_S
    assert summary.request_throughput == pytest.approx(4 / run.duration_s)
    assert summary.output_throughput == pytest.approx(20 / run.duration_s)


def test_tokens_without_text_still_time_the_first_token(stub) -> None:
    base_url, _ = stub
    run = LoadClient(_config(base_url)).run([_request("empty", "EMPTYTEXT"), _request("silent", "SILENT")])
    empty, silent = run.results
    # vLLM streams a chunk per token even when its text is empty: those chunks are the tokens.
    assert empty.success and empty.ttft_s == pytest.approx(TTFT_S, abs=SLACK_S)
    assert len(empty.itl_s) == NUM_TOKENS - 1 and not empty.output_arrived_at_end
    # A server that sends nothing for such tokens shows its first event at the end: flagged.
    assert silent.success and silent.output_arrived_at_end and silent.itl_s == []
    assert silent.ttft_s == pytest.approx(silent.e2e_s, abs=0.01)
    assert silent.output_tokens == NUM_TOKENS  # from usage, not from the (missing) chunks
    assert summarize(run).output_at_end == 1


def test_missing_cached_tokens_count_as_zero_and_are_flagged(stub) -> None:
    base_url, _ = stub
    run = LoadClient(_config(base_url)).run([_request("a", "NODETAILS a"), _request("b", "NODETAILS b")])
    assert all(result.success and not result.cached_tokens_reported and result.cached_tokens == 0
               for result in run.results)
    assert summarize(run).cache_hit_rate is None


def test_concurrency_limit_and_standard_request_fields(stub) -> None:
    base_url, state = stub
    requests = [_request(f"r{index}", f"prompt {index}") for index in range(5)]
    run = LoadClient(_config(base_url, max_concurrency=2)).run(requests)
    assert all(result.success for result in run.results)
    assert state.max_in_flight == 2
    one_request = TTFT_S + (NUM_TOKENS - 1) * ITL_S
    assert run.duration_s >= 3 * one_request - 0.01  # 5 requests, 2 at a time: three rounds
    body = state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert set(body) == {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos"}
    LoadClient(_config(base_url, ignore_eos=False, max_concurrency=1)).run(requests[:1])
    assert "ignore_eos" not in state.bodies[-1]


def test_poisson_rate_delays_sends(stub) -> None:
    base_url, _ = stub
    requests = [_request(f"r{index}", f"prompt {index}") for index in range(4)]
    run = LoadClient(_config(base_url, request_rate=8.0, seed=1)).run(requests)
    offsets = arrival_offsets(4, 8.0, seed=1)
    for result, offset in zip(run.results, offsets):
        assert result.scheduled_s == offset
        assert offset - 0.005 <= result.start_s <= offset + SLACK_S


def test_multi_turn_waits_for_the_previous_turn_and_carries_its_reply(stub, tokenizer) -> None:
    base_url, state = stub
    options = MultiTurnOptions(num_conversations=2, num_turns=3, system_prompt_len=16, user_len=4, output_len=5)
    workload = generate_workload("multi-turn", tokenizer, options, seed=0)
    run = LoadClient(_config(base_url), tokenizer).run(workload.requests)
    assert all(result.success for result in run.results)
    by_id = {result.request_id: result for result in run.results}
    reply = "".join(REPLY_WORDS)
    for conversation in ("c0", "c1"):
        turns = sorted((r for r in workload.requests if r.conversation == conversation), key=lambda r: r.turn)
        for previous, current in zip(turns, turns[1:]):
            done = by_id[previous.request_id].start_s + by_id[previous.request_id].e2e_s
            assert by_id[current.request_id].start_s >= done - 0.005
        expected = turns[0].prefix_text + "".join(turn.user_text + reply for turn in turns[:-1]) + turns[-1].user_text
        assert expected in [body["prompt"] for body in state.bodies]
    # The ideal hit rate sees each later turn share its whole history.
    later = [result for result in run.results if result.turn > 0]
    assert all(result.ideal_cached_tokens and result.ideal_cached_tokens >= 16 + 4 for result in later)

    state.bodies.clear()
    LoadClient(_config(base_url, endpoint="chat"), tokenizer).run(workload.requests[:4] + workload.requests[4:])
    last_turn = [body for body in state.bodies if len(body["messages"]) == 6]
    assert len(last_turn) == 2
    assert [message["role"] for message in last_turn[0]["messages"]] == \
        ["system", "user", "assistant", "user", "assistant", "user"]
    assert last_turn[0]["messages"][2]["content"] == reply


def test_cli_writes_json_and_a_small_png(stub, tiny_model: Path, tmp_path: Path) -> None:
    from kvreuse.cli import main

    base_url, _ = stub
    out, plot = tmp_path / "run.json", tmp_path / "run.png"
    code = main(["bench", "serve", "--base-url", base_url, "--model", "stub", "--tokenizer", str(tiny_model),
                 "--workload", "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2",
                 "--gsp-system-prompt-len", "32", "--gsp-question-len", "4", "--gsp-output-len", "5",
                 "--reset-prefix-cache", "--disable-tqdm", "--out", str(out), "--plot", str(plot)])
    assert code == 0
    document = json.loads(out.read_text())
    assert document["summary"]["completed"] == 4 and len(document["requests"]) == 4
    assert document["summary"]["cache_hit_rate"] == pytest.approx(0.6)
    assert document["workload"]["options"]["system_prompt_len"] == 32
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size < 150_000
    assert main(["bench", "serve", "--base-url", base_url, "--model", "stub", "--tokenizer", str(tiny_model),
                 "--workload", "random", "--random-input-len", "0", "--disable-tqdm"]) == 2


def test_reference_server_reuses_a_copied_prompt_cache(tiny_model: Path) -> None:
    from kvreuse.bench.reference_server import ReferenceRunner, build_app
    from kvreuse.tokenizer import Tokenizer

    runner = ReferenceRunner(str(tiny_model), dtype="float32", device="cpu")
    tokenizer = Tokenizer(tiny_model)
    options = SharedPrefixOptions(num_groups=1, prompts_per_group=3, system_prompt_len=48, question_len=6, output_len=3)
    workload = generate_workload("shared-prefix", tokenizer, options, seed=0)
    for base_url in _serve_in_thread(build_app(runner, "ref")):
        run = LoadClient(_config(base_url, model="ref", max_concurrency=1), tokenizer).run(workload.requests)
    results = run.results
    assert all(result.success for result in results), [result.error for result in results]
    assert [result.prompt_tokens for result in results] == [54, 54, 54]
    assert all(result.output_tokens == 3 for result in results)
    assert results[0].cached_tokens == 0
    assert all(48 <= result.cached_tokens <= 53 for result in results[1:])
    # Reusing the copied cache does not change the output (greedy).
    runner.entries.clear()
    fresh = runner.generate(tokenizer.encode(compose_text(workload.requests[2], ())), 3, ignore_eos=True)
    assert fresh.cached_tokens == 0
    assert tokenizer.decode(fresh.output_ids) == results[2].generated_text


# --------------------------------------------------------------------------------------------------
# The agent workload


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_agent_workload_tools_results_and_turn_order(tokenizer) -> None:
    options = AgentOptions(num_agents=3, num_turns=3, tools_len=1000, result_len=20, output_len=64,
                           system_prompt_len=12, task_len=6)
    workload = generate_workload("agent", tokenizer, options, seed=0)
    assert workload == generate_workload("agent", tokenizer, options, seed=0)
    assert len(workload.requests) == 9
    assert [request.turn for request in workload.requests] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for request in workload.requests:
        assert request.agent and request.conversation == request.request_id.split("-")[0]
        assert request.depends_on == (None if request.turn == 0 else (request.conversation, request.turn - 1))
        assert request.max_tokens == 64
        assert _tokens(tokenizer, request.tool_result_text) == (20 if request.turn else 0)
    # One tool list shared by every agent: realistic functions, every parameter bounded and required.
    tool_lists = {request.tools_json for request in workload.requests}
    assert len(tool_lists) == 1
    tools_json = tool_lists.pop()
    assert abs(_tokens(tokenizer, tools_json) - 1000) <= 30
    tools = json.loads(tools_json)
    assert len(tools) >= 2
    for tool in tools:
        assert tool["type"] == "function" and tool["function"]["description"]
        parameters = tool["function"]["parameters"]
        assert parameters["additionalProperties"] is False
        assert parameters["required"] == list(parameters["properties"])
        for schema in parameters["properties"].values():
            assert ("enum" in schema or schema["type"] == "boolean" or "maxLength" in schema
                    or {"minimum", "maximum"} <= set(schema))
    # Same system prompt for all agents, a task of its own each.
    assert len({request.prefix_text for request in workload.requests}) == 1
    assert len({request.user_text for request in workload.requests}) == 3
    assert all(_tokens(tokenizer, request.user_text) == 6 for request in workload.requests)

    # Tool sets per agent group: different lists; without tools the list is in the system prompt.
    grouped = generate_workload("agent", tokenizer, replace_options(options, num_tool_sets=3), seed=0)
    assert len({request.tools_json for request in grouped.requests}) == 3
    plain = generate_workload("agent", tokenizer, replace_options(options, no_tools=True), seed=0)
    names = [tool["function"]["name"] for tool in tools]
    assert all(request.tools_json is None and request.prefix_text.startswith(workload.requests[0].prefix_text)
               and all(f'"name": "{name}"' in request.prefix_text for name in names) for request in plain.requests)
    with pytest.raises(ValueError, match="agent_tools_len"):
        generate_workload("agent", tokenizer, replace_options(options, tools_len=0), seed=0)
    with pytest.raises(ValueError, match="agent_num_tool_sets"):
        generate_workload("agent", tokenizer, replace_options(options, num_tool_sets=4), seed=0)


def replace_options(options: AgentOptions, **changes: Any) -> AgentOptions:
    from dataclasses import replace

    return replace(options, **changes)


def test_agent_turns_grow_by_exactly_the_appended_messages(tokenizer) -> None:
    options = AgentOptions(num_agents=1, num_turns=4, tools_len=300, result_len=8, system_prompt_len=8, task_len=4)
    turns = generate_workload("agent", tokenizer, options, seed=1).requests
    calls = [{"id": f"call_{index}", "type": "function",
              "function": {"name": "read_file", "arguments": '{"path":"a.py" ,  "start_line": 7}'}}
             for index in range(3)]
    replies = [AgentReply("", [calls[0]]), AgentReply("no call, just text"), AgentReply("thinking", calls[1:])]
    messages = compose_agent_messages(turns[0], None, None)
    assert messages == [{"role": "system", "content": turns[0].prefix_text},
                        {"role": "user", "content": turns[0].user_text}]
    for request, reply in zip(turns[1:], replies):
        grown = compose_agent_messages(request, messages, reply)
        appended = grown[len(messages):]
        assert grown[:len(messages)] == messages
        assert appended == followup_messages(reply, request.tool_result_text)
        if reply.tool_calls:
            assert appended[0] == {"role": "assistant", "content": reply.content or None,
                                   "tool_calls": reply.tool_calls}
            assert [message["tool_call_id"] for message in appended[1:]] == [call["id"] for call in reply.tool_calls]
            assert all(message == {"role": "tool", "tool_call_id": message["tool_call_id"],
                                   "content": request.tool_result_text} for message in appended[1:])
        else:  # a server that ignored the tools: its text, then the result as a user message
            assert appended == [{"role": "assistant", "content": reply.content},
                                {"role": "user", "content": request.tool_result_text}]
        messages = grown
    # The fed-back calls are copies: changing what was sent does not change the reply kept.
    messages[2]["tool_calls"][0]["function"]["arguments"] = "changed"
    assert calls[0]["function"]["arguments"] == '{"path":"a.py" ,  "start_line": 7}'


def test_streamed_tool_call_deltas_join_into_the_calls() -> None:
    deltas = ToolCallDeltas()
    deltas.add([{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_", "arguments": ""}}])
    deltas.add([{"index": 0, "function": {"name": "weather", "arguments": '{"city": '}}])
    deltas.add([{"index": 1, "id": "call_b", "function": {"name": "set_reminder", "arguments": "{}"}}])
    deltas.add([{"index": 0, "function": {"arguments": '"Lisbon" }'}}])
    deltas.add(None)
    assert deltas.calls() == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lisbon" }'}},
        {"id": "call_b", "type": "function", "function": {"name": "set_reminder", "arguments": "{}"}},
    ]


# Arguments as a server might stream them: odd spacing and key order, which must come back untouched.
STUB_ARGUMENTS = ('{"query" :"a  b",', ' "top_k":3,"source": "wiki"}')
STUB_LLAMA_CACHED = 40


def _agent_stub_app(state: StubState) -> FastAPI:
    """Chat completions that stream one tool call per request when ``tools`` are sent (unless the
    system prompt says IGNORE), else text; LLAMA in the system prompt: usage without
    prompt_tokens_details, and llama-server's timings."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        state.bodies.append(body)
        system = body["messages"][0]["content"]
        number = len(state.bodies)

        def event(payload: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        def delta(content: dict[str, Any], finish_reason: str | None = None) -> bytes:
            return event({"choices": [{"index": 0, "delta": content, "finish_reason": finish_reason}]})

        async def stream():
            await asyncio.sleep(0.02)
            yield delta({"role": "assistant", "content": None})
            if body.get("tools") and "IGNORE" not in system:
                yield delta({"tool_calls": [{"index": 0, "id": f"call_{number}", "type": "function",
                                             "function": {"name": "search_documents", "arguments": ""}}]})
                for piece in STUB_ARGUMENTS:
                    yield delta({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                yield delta({}, "tool_calls")
            else:
                for word in REPLY_WORDS:
                    yield delta({"content": word})
                yield delta({}, "length")
            prompt = 100 * len(body["messages"])
            usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": NUM_TOKENS,
                                     "total_tokens": prompt + NUM_TOKENS}
            final: dict[str, Any] = {"choices": [], "usage": usage}
            if "LLAMA" in system:
                final["timings"] = {"cache_n": STUB_LLAMA_CACHED, "prompt_n": prompt - STUB_LLAMA_CACHED}
            else:
                usage["prompt_tokens_details"] = {"cached_tokens": prompt - 100}
            yield event(final)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture()
def agent_stub() -> Iterator[tuple[str, StubState]]:
    state = StubState()
    for base_url in _serve_in_thread(_agent_stub_app(state)):
        yield base_url, state


def _agent_workload(tokenizer, marker: str = "", **changes: Any) -> tuple[BenchRequest, ...]:
    from dataclasses import replace

    options = AgentOptions(num_agents=2, num_turns=3, tools_len=200, result_len=6, output_len=32,
                           system_prompt_len=6, task_len=3, **changes)
    return tuple(replace(request, prefix_text=marker + request.prefix_text)
                 for request in generate_workload("agent", tokenizer, options, seed=0).requests)


def test_agent_client_feeds_back_the_streamed_tool_calls_unchanged(agent_stub, tokenizer) -> None:
    base_url, state = agent_stub
    requests = _agent_workload(tokenizer)
    run = LoadClient(_config(base_url, max_concurrency=2, ignore_eos=True), tokenizer).run(requests)
    assert all(result.success for result in run.results), [result.error for result in run.results]
    for result in run.results:
        assert result.tool_call_returned and result.finish_reason == "tool_calls"
        assert result.tool_calls[0]["function"] == {"name": "search_documents", "arguments": "".join(STUB_ARGUMENTS)}
    # Every body: the tools, tool_choice required, one call at most, no ignore_eos (a call must end).
    for body in state.bodies:
        assert body["tools"] == json.loads(requests[0].tools_json)
        assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", False)
        assert "ignore_eos" not in body and body["stream"] is True
    # Each agent's turn t+1 is turn t's messages plus the call as streamed and the tool result.
    for agent in ("a0", "a1"):
        turns = sorted((request for request in requests if request.conversation == agent), key=lambda r: r.turn)
        bodies = [next(body for body in state.bodies if body["messages"][1]["content"] == turns[0].user_text
                       and len(body["messages"]) == 2 + 2 * turn) for turn in range(3)]
        results = {result.request_id: result for result in run.results}
        for turn in (1, 2):
            previous, current = bodies[turn - 1]["messages"], bodies[turn]["messages"]
            call = results[turns[turn - 1].request_id].tool_calls[0]
            assert current[:len(previous)] == previous
            assert current[len(previous):] == [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": turns[turn].tool_result_text}]
    summary = summarize(run)
    assert (summary.tool_calls_returned, summary.no_tool_call) == (6, 0)
    assert [turn.hit_rate for turn in summary.turns] == [pytest.approx(1 / 2), pytest.approx(3 / 4),
                                                          pytest.approx(5 / 6)]
    assert [turn.tool_calls_returned for turn in summary.turns] == [2, 2, 2]
    assert "Agent turns: tool call back / none" in format_table(summary, "agent")
    assert run.results[0].as_dict()["tool_calls"] == run.results[0].tool_calls


def test_agent_client_without_tool_calls_and_with_llama_server_timings(agent_stub, tokenizer) -> None:
    base_url, state = agent_stub
    # A server that ignores the tools: text replies go back as assistant content, the result as a user turn.
    requests = _agent_workload(tokenizer, "IGNORE LLAMA")
    run = LoadClient(_config(base_url, max_concurrency=2), tokenizer).run(requests)
    assert all(result.success and result.tool_calls == [] for result in run.results)
    last = [body for body in state.bodies if len(body["messages"]) == 6]
    assert len(last) == 2
    assert [message["role"] for message in last[0]["messages"]] == ["system", "user", "assistant", "user",
                                                                    "assistant", "user"]
    assert last[0]["messages"][2] == {"role": "assistant", "content": "".join(REPLY_WORDS)}
    # Cached tokens from timings.cache_n where usage has no prompt_tokens_details.
    assert all(result.cached_tokens == STUB_LLAMA_CACHED and result.cached_tokens_source == "timings"
               for result in run.results)
    summary = summarize(run)
    assert (summary.tool_calls_returned, summary.no_tool_call) == (0, 6)
    # No tools at all (the baseline): the list is in the system prompt, no tools field, ignore_eos as configured.
    state.bodies.clear()
    plain = _agent_workload(tokenizer, no_tools=True)
    LoadClient(_config(base_url, max_concurrency=2)).run(plain)
    assert all("tools" not in body and body["ignore_eos"] is True and "# Tools" in body["messages"][0]["content"]
               for body in state.bodies)


def test_turn_summaries_and_the_side_by_side_table() -> None:
    def result(conversation: str, turn: int, prompt: int, cached: int, ttft: float, calls: int) -> RequestResult:
        return RequestResult(f"{conversation}-t{turn}", "g", conversation, turn, success=True, ttft_s=ttft, e2e_s=ttft,
                             prompt_tokens=prompt, cached_tokens=cached, cached_tokens_reported=True, output_tokens=50,
                             tool_calls=[{"id": "c"}] * calls)

    results = [result("a0", 0, 1000, 0, 2.0, 1), result("a1", 0, 1000, 900, 0.4, 0),
               result("a0", 1, 1400, 1049, 0.3, 1), result("a1", 1, 1500, 1000, 0.5, 1),
               RequestResult("a2-t1", "g", "a2", 1, error="HTTP 500: boom")]
    results[2].ideal_cached_tokens, results[2].ideal_prompt_tokens = 1100, 1450
    turns = turn_summaries(results)
    assert [(turn.turn, turn.requests, turn.completed) for turn in turns] == [(0, 2, 2), (1, 3, 2)]
    assert turns[0].hit_rate == pytest.approx(900 / 2000) and turns[1].hit_rate == pytest.approx(2049 / 2900)
    # Turn 1 reused 2,049 of the 2 x (1,000 + 50) tokens its turn 0 left; turn 0 has no previous turn.
    assert turns[0].previous_turn_reuse is None and turns[1].previous_turn_reuse == pytest.approx(2049 / 2100)
    # The ideal figure divides by the prompt as the client tokenized it.
    assert turns[1].ideal_hit_rate == pytest.approx(1100 / 1450)
    assert turns[0].ttft_median_s == pytest.approx(1.2) and turns[1].ttft_median_s == pytest.approx(0.4)
    assert [turn.tool_calls_returned for turn in turns] == [1, 2]
    assert turn_summaries([RequestResult("r", "g", None, 0, success=True)]) == ()
    summaries = {"kvreuse": summarize(BenchmarkRun(results, 1.0)),
                 "llama-server": summarize(BenchmarkRun(results[:2], 1.0))}
    table = format_turns_comparison(summaries, "per turn")
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line[:1].isdigit()}
    assert rows["0"] == ["0", "45.0%", "-", "1200.0", "1/2", "45.0%", "-", "1200.0", "1/2"]
    assert rows["1"] == ["1", "70.7%", "97.6%", "400.0", "2/2", "-", "-", "-", "-"]


def test_compare_runs_llama_server_with_jinja_only_given_its_binary_and_gguf(tmp_path: Path, capsys) -> None:
    from kvreuse.bench.compare import LlamaServer
    from kvreuse.cli import main

    base = ["bench", "compare", "--workload", "agent", "--systems", "kvreuse,llama-server", "--disable-tqdm"]
    assert main(base) == 2
    assert "needs --llama-server BIN and --gguf FILE" in capsys.readouterr().err
    assert main(base + ["--llama-server", str(tmp_path / "nope"), "--gguf", str(tmp_path / "m.gguf")]) == 2
    assert "must be llama-server's binary" in capsys.readouterr().err
    command = LlamaServer("/bin/llama-server", "m.gguf", slots=3, ctx_size=8192, cache_ram_mib=512).command(8123)
    assert command[:3] == ["/bin/llama-server", "-m", "m.gguf"] and "--jinja" in command
    assert command[command.index("-np") + 1] == "3" and command[command.index("--port") + 1] == "8123"
    assert command[command.index("-c") + 1] == "8192" and command[command.index("--cache-ram") + 1] == "512"
