"""Server pieces that need no running server: request parsing and its 400s, the stop-string
hold-back of streams, API keys and tenant salts, error-to-param mapping, Prometheus exposition; and the
app in this process over a running engine, where a test reaches inside (a fault made deep in the engine)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from kvreuse.server.auth import ApiKeyAuth, load_api_keys, tenant_id_of
from kvreuse.server.errors import APIError
from kvreuse.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)


def chat_body(**fields) -> bytes:
    import json

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def api_error(callable_, *args) -> APIError:
    with pytest.raises(APIError) as caught:
        callable_(*args)
    return caught.value


# --- parsing ----------------------------------------------------------------------------------------


def test_benchmark_client_payloads_parse():
    """What vLLM's bench serve and SGLang's bench_serving send must be accepted as is."""
    chat = parse_request(ChatCompletionRequest, chat_body(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        temperature=0, max_completion_tokens=16, stream=True, stream_options={"include_usage": True},
        ignore_eos=True, best_of=1, top_p=1, top_k=-1, min_p=0.0, repetition_penalty=1.0,
    ))
    chat.check()
    assert chat.requested_max_tokens == (16, "max_completion_tokens")
    assert chat.include_usage_in_stream
    completion = parse_request(CompletionRequest, b'{"model": "m", "prompt": "x", "temperature": 0.0, '
                                                  b'"repetition_penalty": 1.0, "max_tokens": 8, "logprobs": 3, '
                                                  b'"best_of": 1, "ignore_eos": true, "stream": true}')
    completion.check()
    params = completion.sampling_params(max_tokens=8, logprobs=completion.logprobs, renames={})
    assert params.logprobs == 3 and params.ignore_eos and params.greedy


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"", None),
        (b'{"model": "m"}', "messages"),
        (chat_body(foo=1), "foo"),
        (chat_body(stream_options={"include_usage": True, "other": 1}), "stream_options.other"),
        (chat_body(temperature="hot"), "temperature"),
        (chat_body(n=True), "n"),
        (chat_body(max_tokens=2.5), "max_tokens"),
    ],
)
def test_malformed_bodies_name_the_param(body: bytes, param: str | None):
    error = api_error(parse_request, ChatCompletionRequest, body)
    assert error.status_code == 400 and error.param == param
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"store": True}, "store"),
    ],
)
def test_unhonourable_chat_parameters_are_refused(fields: dict, param: str):
    request = parse_request(ChatCompletionRequest, chat_body(**fields))
    error = api_error(request.check)
    assert error.status_code == 400 and error.param == param


def test_neutral_values_of_unsupported_fields_pass():
    request = parse_request(ChatCompletionRequest, chat_body(
        tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={}, n=2, best_of=2,
        parallel_tool_calls=True, store=False, user="u-1",
    ))
    request.check()


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_setup_reads_tool_choice_against_the_parser():
    from kvreuse.server.protocol import NO_TOOLS
    from kvreuse.tool_parsers import HermesToolParser

    parser = HermesToolParser()

    def setup(parser_=parser, **fields):
        request = parse_request(ChatCompletionRequest, chat_body(**fields))
        request.check()
        return request.tool_setup(parser_)

    assert setup() is NO_TOOLS and setup(tool_choice="none") is NO_TOOLS
    # none: the tools stay in the prompt (the route renders them), no call is read or forced.
    assert setup(tools=[WEATHER_TOOL], tool_choice="none") is NO_TOOLS
    plain_auto = setup(tools=[WEATHER_TOOL])
    assert plain_auto.parser is parser and plain_auto.constraint is None
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    assert setup(tools=[strict], tool_choice="auto").constraint is not None
    forced = setup(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False)
    assert forced.parser is parser and forced.constraint.grammar == parser.grammar(
        [WEATHER_TOOL], {"type": "function", "function": {"name": "get_weather"}}, False)
    assert forced.constraint.field == "tools"
    params = parse_request(ChatCompletionRequest, chat_body(tools=[WEATHER_TOOL], tool_choice="required"))\
        .sampling_params(max_tokens=8, logprobs=None, renames={}, tools=forced)
    assert params.structured_outputs is forced.constraint and params.skip_special_tokens
    # A format beside plain auto tools: the format is the constraint and no call is read.
    assert setup(tools=[WEATHER_TOOL], response_format={"type": "json_object"}) is NO_TOOLS


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "maybe"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL, {"type": "function", "function": {}}]}, "tools[1].function.name"),
    ],
)
def test_bad_tool_setups_name_the_field(fields: dict, param: str):
    from kvreuse.errors import InvalidRequestError
    from kvreuse.tool_parsers import HermesToolParser

    request = parse_request(ChatCompletionRequest, chat_body(**fields))
    with pytest.raises((APIError, InvalidRequestError)) as caught:
        request.tool_setup(HermesToolParser())
    assert caught.value.param == param


def test_tools_without_a_parser_are_refused_unless_tool_choice_is_none():
    request = parse_request(ChatCompletionRequest, chat_body(tools=[WEATHER_TOOL]))
    assert api_error(request.tool_setup, None).param == "tools"
    none = parse_request(ChatCompletionRequest, chat_body(tools=[WEATHER_TOOL], tool_choice="none"))
    assert none.tool_setup(None).parser is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_sampling_value_errors_become_400_with_param(fields: dict, param: str):
    request = parse_request(ChatCompletionRequest, chat_body(**fields))
    request.check()
    error = api_error(lambda: request.sampling_params(max_tokens=4, logprobs=request.num_logprobs,
                                                      renames={"logprobs": "top_logprobs"}))
    assert error.status_code == 400 and error.param == param


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    import json

    request = parse_request(CompletionRequest, json.dumps({"prompt": prompt}).encode())
    assert request.prompts() == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], []], [True, 2], {"a": 1}, 5])
def test_bad_completion_prompts(prompt):
    import json

    request = parse_request(CompletionRequest, json.dumps({"prompt": prompt}).encode())
    error = api_error(request.prompts)
    assert error.status_code == 400 and error.param == "prompt"


def test_auth_checks_bearer_keys():
    auth = ApiKeyAuth(["key-a", "key-b"], isolate_tenants=True)
    tenant_a = auth.authenticate("Bearer key-a")
    tenant_b = auth.authenticate("bearer key-b")
    assert tenant_a is not None and tenant_b is not None and tenant_a != tenant_b
    for header in (None, "", "Bearer", "Basic key-a", "Bearer key-c", "Bearer key-a2"):
        error = api_error(auth.authenticate, header)
        assert error.status_code == 401
    assert ApiKeyAuth([]).authenticate(None) is None


def test_admin_keys_act_on_every_tenant_and_tenant_keys_get_403():
    auth = ApiKeyAuth(["key-a"], isolate_tenants=True, admin_keys=["root"])
    tenant, admin = auth.authenticate("Bearer key-a"), auth.authenticate("Bearer root")
    assert tenant is not None and admin is not None and admin.is_admin and not tenant.is_admin
    assert auth.cache_salt(admin, None) not in (None, auth.cache_salt(tenant, None))  # its own namespace
    auth.require_admin(admin, "resetting the prefix cache")
    error = api_error(auth.require_admin, tenant, "resetting the prefix cache")
    assert error.status_code == 403 and error.error_type == "permission_error"
    assert "resetting the prefix cache needs an admin key" in error.message and "tenant key" in error.message
    ApiKeyAuth([]).require_admin(None, "resetting the prefix cache")  # no keys at all: open as before
    assert ApiKeyAuth([], isolate_tenants=True, admin_keys=["root"]).authenticate("Bearer root") == admin
    with pytest.raises(ValueError, match="both as api_key and admin_key"):
        ApiKeyAuth(["key-a"], admin_keys=["key-a"])


def test_tenant_salts_cannot_be_chosen_by_clients():
    auth = ApiKeyAuth(["key-a", "key-b"], isolate_tenants=True)
    tenant_a, tenant_b = auth.authenticate("Bearer key-a"), auth.authenticate("Bearer key-b")
    assert auth.cache_salt(tenant_a, None) != auth.cache_salt(tenant_b, None)
    assert auth.cache_salt(tenant_a, "s") != auth.cache_salt(tenant_b, "s")
    # A client that sends another tenant's final salt as its own still lands in its own namespace.
    forged = auth.cache_salt(tenant_b, "s")
    assert auth.cache_salt(tenant_a, forged) != forged
    assert auth.cache_salt(tenant_a, "public:sys") == auth.cache_salt(tenant_b, "public:sys") == "public:sys"
    assert "key-a" not in auth.cache_salt(tenant_a, None)
    assert auth.cache_salt(tenant_a, None) == f"tenant:{tenant_id_of('key-a')}|"
    # Without isolation the client's salt is used as is.
    assert ApiKeyAuth(["key-a"]).cache_salt(tenant_a, "s") == "s"


def test_isolation_needs_keys_and_key_files_load(tmp_path):
    with pytest.raises(ValueError, match="isolate_tenants"):
        ApiKeyAuth([], isolate_tenants=True)
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nkey-a\n\n  key-b  \nkey-a\n")
    assert load_api_keys(["key-c"], keys_file) == ["key-c", "key-a", "key-b"]
    with pytest.raises(ValueError, match="api_keys_file"):
        load_api_keys(None, tmp_path / "missing")


# --- admission ---------------------------------------------------------------------------------------------


def fake_state(num_waiting: int, max_waiting: int):
    from types import SimpleNamespace

    from kvreuse.server.state import ServerConfig, ServerState

    llm_engine = SimpleNamespace(tokenizer=None, max_model_len=64, model_config=SimpleNamespace(vocab_size=100))
    tokenizer = SimpleNamespace(chat_template=None, added_tokens={})  # no tool-call format
    engine = SimpleNamespace(engine=llm_engine, tokenizer=tokenizer, model_name="m", is_running=True,
                             num_pending_commands=0,
                             stats=SimpleNamespace(num_waiting=num_waiting))
    return ServerState(engine, ServerConfig(max_waiting_requests=max_waiting))  # type: ignore[arg-type]


def test_admission_refuses_when_overloaded_or_draining():
    state = fake_state(num_waiting=3, max_waiting=4)
    admission = state.admit()
    assert state.num_in_flight == 1
    admission.release()
    admission.release()  # idempotent
    assert state.num_in_flight == 0
    error = api_error(fake_state(num_waiting=4, max_waiting=4).admit)
    assert error.status_code == 503 and error.code == "overloaded" and "Retry-After" in error.headers
    state.draining = True
    error = api_error(state.admit)
    assert error.status_code == 503 and error.code == "draining"


def test_output_budget_and_stop_token_ids_are_checked():
    state = fake_state(num_waiting=0, max_waiting=4)
    assert state.max_tokens((None, "max_tokens"), 60) == 4  # all the room the context leaves
    assert state.max_tokens((4, "max_tokens"), 60) == 4
    error = api_error(state.max_tokens, (5, "max_completion_tokens"), 60)
    assert error.param == "max_completion_tokens" and error.code == "context_length_exceeded"
    error = api_error(state.check_stop_token_ids, [5, 100])
    assert error.param == "stop_token_ids" and "stop_token_ids[1]" in error.message


# --- the engine loop and /metrics -------------------------------------------------------------------------


def run_on_engine_thread(engine, main):
    """Start the AsyncEngine's thread, run the coroutine function ``main`` on an event loop, stop the engine."""
    import asyncio

    engine.start()
    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def test_running_gauge_is_published_before_each_output_reaches_the_event_loop(tiny_model):
    """A scrape made after a client read a request's first byte finds it running, and one made after the
    last byte finds it gone. The check runs on the engine thread at the very moment each output is
    handed to the event loop (its ``call_soon_threadsafe``): the earliest a handler, and so a client,
    can see it. The stats snapshot /metrics reads must already hold the step behind that output; posted
    first and snapshotted after, the first output met the snapshot from before the request was added
    (``kvreuse:num_requests_running`` 0, the flaky test_server.py::test_disconnect_aborts_and_frees_blocks)."""
    import asyncio
    import threading

    from kvreuse.llm import LLM
    from kvreuse.outputs import RequestOutput
    from kvreuse.sampling import SamplingParams
    from kvreuse.server.async_engine import AsyncEngine

    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    engine = AsyncEngine(llm.engine, stats_log_interval_s=0)

    def scraped_running() -> float:
        text = engine.metrics.render()[0].decode()
        return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                          if line.startswith("kvreuse:num_requests_running{")))

    posted: list[tuple[bool, float]] = []  # (the output is the last, what a scrape reads) per output posted

    async def run() -> list[RequestOutput]:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def spy(callback, *args, **kwargs):
            if threading.current_thread().name == "kvreuse-engine":
                for _, item in args[0]:
                    if isinstance(item, RequestOutput):
                        posted.append((item.finished, scraped_running()))
            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = spy  # type: ignore[method-assign]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        return [output async for output in engine.generate("r", "A very long story:", params)]

    outputs = run_on_engine_thread(engine, run)
    assert outputs[-1].finished and len(posted) >= 2
    assert posted[0] == (False, 1.0)  # the first token: running
    assert all(running == 1.0 for finished, running in posted[:-1])
    assert posted[-1] == (True, 0.0)  # the last: the engine has let it go
    assert scraped_running() == 0.0


def test_stream_interval_sends_an_output_every_n_tokens_and_changes_no_text(tiny_model):
    """--stream-interval N: a streamed request's outputs reach the event loop at its first token, then once N new
    tokens have come, and finished; a request answered whole gets its first and its finished output only; a request
    with stop strings gets every output (they are found on the event loop) and stops where the string ends. The
    tokens and text equal those of interval 1 in every case."""
    from kvreuse.llm import LLM
    from kvreuse.sampling import SamplingParams
    from kvreuse.server.async_engine import AsyncEngine

    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
            AsyncEngine(llm.engine, stats_log_interval_s=0, stream_interval=bad)
    greedy = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)

    def outputs_of(interval: int, params: SamplingParams, stream: bool = True):
        """(the output tokens of each output the engine thread sent, the last output the caller got). What is sent
        is counted, not what ``generate`` yields: a consumer that falls behind skips to the newest output."""
        import asyncio
        import threading

        from kvreuse.outputs import RequestOutput

        engine = AsyncEngine(llm.engine, stats_log_interval_s=0, stream_interval=interval)
        sent: list[int] = []

        async def run():
            loop = asyncio.get_running_loop()
            call_soon_threadsafe = loop.call_soon_threadsafe

            def spy(callback, *args, **kwargs):
                if threading.current_thread().name == "kvreuse-engine":
                    sent.extend(len(item.outputs[0].token_ids) for _, item in args[0] if isinstance(item, RequestOutput))
                return call_soon_threadsafe(callback, *args, **kwargs)

            loop.call_soon_threadsafe = spy  # type: ignore[method-assign]
            return [output async for output in engine.generate("r", "A very long story:", params, stream=stream)]

        outputs = run_on_engine_thread(engine, run)
        llm.engine.runner.step_threads = None  # the next engine measures its own
        return sent, outputs[-1].outputs[0]

    every, reference = outputs_of(1, greedy)
    assert every == list(range(1, 12))
    counts, final = outputs_of(4, greedy)
    assert counts == [1, 5, 9, 11] and final.token_ids == reference.token_ids and final.text == reference.text
    counts, final = outputs_of(4, greedy, stream=False)
    assert counts == [1, 11] and final.text == reference.text
    stop = reference.text[len(reference.text) // 2:][:3]
    assert stop.strip(), reference.text
    stopping = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, stop=[stop])
    counts_1, stopped_1 = outputs_of(1, stopping)
    counts_4, stopped_4 = outputs_of(4, stopping)
    # Every token's output sent, up to where the engine heard of the stop (when depends on the threads' timing).
    assert counts_4 == list(range(1, len(counts_4) + 1)) and len(counts_4) >= len(stopped_4.token_ids)
    assert stopped_4.text == stopped_1.text and stopped_4.finish_reason == "stop"
    assert stopped_4.text == reference.text[:reference.text.index(stop)]


def test_with_tools_the_role_chunk_goes_out_with_the_first_token() -> None:
    """A tool-call reply's first token decides nothing yet (it may be the start of a call, held back by the
    extractor), but the stream's first chunk, the role, goes out with it: a client timing its first chunk
    times the first token, as with a text reply, not the call's name tens of tokens later."""
    import json as json_module

    from kvreuse.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from kvreuse.sampling import SamplingParams
    from kvreuse.server.openai_routes import _Generation, _StreamWriter
    from kvreuse.tool_parsers import HermesToolParser

    generation = _Generation(chat=True, request_id="chatcmpl-1", model="m", created=0, prompts=[[1, 2]],
                             prompt_lengths=[2], params=[SamplingParams()], cache_salt=None, arrival_time=0.0,
                             stream=True, include_usage=False, num_logprobs=None, user=None,
                             tool_parser=HermesToolParser())
    writer = _StreamWriter(None, generation)  # type: ignore[arg-type]  # the state is read for logprobs only

    def step(text: str, finish_reason: str | None = None) -> list[dict]:
        completion = CompletionOutput(0, text=text, token_ids=[7], text_delta=text, finish_reason=finish_reason)
        output = RequestOutput("chatcmpl-1", None, [1, 2], [completion], finish_reason is not None,
                               num_cached_tokens=0, metrics=RequestMetrics(arrival_time=0.0))
        raw = writer.encode(0, output)
        return [json_module.loads(line[len("data: "):]) for line in raw.decode().splitlines() if line.startswith("data: ")]

    first = step("<tool")  # may be the start of <tool_call>: held back
    assert [event["choices"][0]["delta"] for event in first] == [{"role": "assistant", "content": None}]
    rest = step('_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "stop")
    deltas = [event["choices"][0]["delta"] for event in rest]
    assert all("role" not in delta for delta in deltas)
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_time"
    assert rest[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_small_steps_leave_a_core_to_the_event_loop(tiny_model):
    """On CPU, the server's engine thread runs steps of a few tokens (decode) on one thread fewer than
    prefill, so its event loop keeps a core; the event loop's own thread count is untouched."""
    import threading

    import torch

    from kvreuse.llm import LLM
    from kvreuse.sampling import SamplingParams
    from kvreuse.server.async_engine import AsyncEngine

    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one intra-op thread: there is no core to leave")
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    seen: list[tuple[str, int, int]] = []  # (thread name, intra-op threads, tokens) per forward

    def record(module, args):
        seen.append((threading.current_thread().name, torch.get_num_threads(), args[0].numel()))

    llm.engine.model.register_forward_pre_hook(record)
    engine = AsyncEngine(llm.engine, stats_log_interval_s=0)

    async def run() -> list:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        prompt = "A very long story about caches, the blocks they keep and the prompts that find them again:"
        return [output async for output in engine.generate("r", prompt, params)]

    outputs = run_on_engine_thread(engine, run)
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    assert [name for name, _, _ in seen] == ["kvreuse-engine"] * 4
    prefill, *decodes = seen
    # Small is up to 17 tokens (one stream verifying 16 drafted ones): this prefill is larger.
    assert prefill[2] > llm.engine.runner.step_threads.small_step_tokens and prefill[1] == threads
    assert [(count, tokens) for _, count, tokens in decodes] == [(threads - 1, 1)] * 3
    assert torch.get_num_threads() == threads


def test_the_thread_that_starts_the_loop_hands_back_its_openmp_team(tiny_model):
    """The thread that built the engine (a parallel op made its OpenMP team) runs on one thread while the
    loop runs, so the process keeps one team, the engine loop's (runner/thread_team.py: two teams make
    libgomp sleep the step's team between regions); the loop thread steps on the count the starter had,
    and the starter gets its count back at shutdown."""
    import asyncio

    import torch

    from kvreuse.llm import LLM
    from kvreuse.runner import thread_team
    from kvreuse.sampling import SamplingParams
    from kvreuse.server.async_engine import AsyncEngine

    threads = torch.get_num_threads()
    if threads < 2 or thread_team.libgomp() is None:
        pytest.skip("one intra-op thread, or an OpenMP runtime other than libgomp")
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    engine = AsyncEngine(llm.engine, stats_log_interval_s=0)

    async def run() -> tuple[int, int, bool]:
        on_loop = await engine.call(lambda _: torch.get_num_threads())  # before a step sets its own count
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        outputs = [output async for output in engine.generate("r", "A story:", params)]
        return torch.get_num_threads(), on_loop, outputs[-1].finished

    torch.randn(1 << 22).sin()  # this thread's team exists, as after a model load
    starter, on_loop, finished = run_on_engine_thread(engine, run)
    assert finished and starter == 1 and on_loop == threads
    assert torch.get_num_threads() == threads


# --- one error mapping for both APIs (issue 64) --------------------------------------------------------------------


def test_the_error_mapping_tells_the_clients_mistakes_from_the_servers_faults(caplog):
    """server/errors.py's api_error_of, which both APIs answer with: a request's mistake (InvalidRequestError, which
    validation raises with the field) is a 400 naming the field; a plain ValueError is not read as one (it is a 500,
    logged with its traceback, whose message the client does not see), nor is a pydantic ValidationError that
    escaped (also a ValueError); each shape names the field its own way."""
    import logging

    from pydantic import BaseModel, ValidationError

    from kvreuse.errors import InvalidRequestError
    from kvreuse.server.errors import api_error_of

    mistake = api_error_of(InvalidRequestError("top_p must be in (0, 1], got 2", "top_p", "some_code"))
    assert (mistake.status_code, mistake.param, mistake.code) == (400, "top_p", "some_code")
    assert mistake.body()["error"]["param"] == "top_p"
    anthropic = mistake.anthropic_body()
    assert anthropic["type"] == "error" and anthropic["error"]["type"] == "invalid_request_error"
    assert anthropic["error"]["param"] == "top_p" and anthropic["error"]["message"].startswith("top_p")
    passed_on = APIError(404, "gone", param="model")
    assert api_error_of(passed_on) is passed_on
    assert passed_on.anthropic_body()["error"] == {"type": "not_found_error", "message": "model: gone", "param": "model"}

    class Internal(BaseModel):
        size: int

    try:
        Internal.model_validate({"size": "many"})
    except ValidationError as error:
        escaped = error
    for fault in (ValueError("row 7 of the block table is stale"), escaped):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvreuse.server"):
            internal = api_error_of(fault)
        assert internal.status_code == 500 and internal.param is None
        assert "row 7" not in internal.message and "many" not in internal.message
        assert internal.anthropic_body()["error"]["type"] == "api_error"
        assert [record.exc_info[1] for record in caplog.records if record.exc_info] == [fault]


@pytest.fixture(scope="module")
def served(tiny_model):
    """The real app over a running engine on the tiny model, in this process (starlette's TestClient as the
    SDKs' transport): where a test reaches inside the server, which a server process would not let it."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from kvreuse.llm import LLM
    from kvreuse.server.app import build_app
    from kvreuse.server.async_engine import AsyncEngine
    from kvreuse.server.state import ServerConfig, ServerState

    llm = LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    engine = AsyncEngine(llm.engine, stats_log_interval_s=0)
    state = ServerState(engine, ServerConfig())
    app = build_app(state)
    engine.start()
    try:
        # A 500 is the answer here, not an exception in the test (starlette re-raises what reached its last handler).
        with TestClient(app, raise_server_exceptions=False) as http:
            yield SimpleNamespace(state=state, app=app, http=http)
    finally:
        engine.shutdown()


def openai_client(served):
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=served.http)


def anthropic_client(served):
    import anthropic

    return anthropic.Anthropic(base_url="http://testserver", api_key="unused", max_retries=0, http_client=served.http)


def ask(api: str, served, **fields):
    """One short request through the official SDK of ``api``."""
    fields = {"model": served.state.model_name, "max_tokens": 2,
              "messages": [{"role": "user", "content": "Where is the cache?"}], **fields}
    if api == "openai":
        return openai_client(served).chat.completions.create(**fields)
    return anthropic_client(served).messages.create(**fields)


@pytest.mark.parametrize("where", ["tokenizer", "engine"])
@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_an_internal_value_error_is_a_logged_500_in_each_apis_shape(served, api, where, monkeypatch, caplog):
    """A plain ValueError from inside (the event loop's tokenizer while the request is prepared, or the engine
    thread once it is queued) is the server's fault through either API: a 500 in that API's shape that does not
    pass the internal message on, logged with its traceback. It is no 400 (the Messages route answered any
    ValueError met while preparing with a 400, and logged nothing)."""
    import logging
    import traceback

    import anthropic
    import openai

    fault = ValueError(f"internal invariant broken in the {where}")

    def broken(*args, **kwargs):
        raise fault

    if where == "tokenizer":
        monkeypatch.setattr(served.state.engine.inputs.tokenizer, "encode", broken)
    else:
        monkeypatch.setattr(served.state.llm_engine, "add_request", broken)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kvreuse.server"):
        with pytest.raises((openai.InternalServerError, anthropic.InternalServerError)) as caught:
            ask(api, served)
    error = caught.value
    assert error.status_code == 500
    if api == "openai":
        assert isinstance(error, openai.InternalServerError)
        assert error.body["type"] == "server_error" and error.body["param"] is None
        message = error.body["message"]
    else:
        assert isinstance(error, anthropic.InternalServerError)
        assert error.body["type"] == "error" and error.body["error"]["type"] == "api_error"
        message = error.body["error"]["message"]
    assert "invariant" not in message and "ValueError" in message
    logged = [record for record in caplog.records if record.exc_info is not None]
    assert [record.exc_info[1] for record in logged] == [fault]
    assert any(frame.name == "broken" for frame in traceback.extract_tb(logged[0].exc_info[2]))
    # The server goes on serving through the same route.
    monkeypatch.undo()
    assert ask(api, served) is not None


class TypedSpec(BaseModel):
    """A typed body for a route added by a test (at module level: the annotations here are strings that FastAPI
    resolves in the module)."""

    size: int


def test_a_typed_routes_bad_parameter_is_a_400_naming_it(served):
    """FastAPI's own parsing of a route's typed parameters (RequestValidationError) answers as parse_request
    does: a 400 whose param is the field, counted from the top of where it was sent (the query, the body), not
    the whole validation error as text without a param."""
    from fastapi import Body

    @served.app.get("/test-only/typed")
    async def typed_query(limit: int) -> dict:
        return {"limit": limit}

    @served.app.post("/test-only/typed")
    async def typed_body(spec: TypedSpec = Body(embed=True)) -> dict:
        return {"size": spec.size}

    assert served.http.get("/test-only/typed", params={"limit": 3}).json() == {"limit": 3}
    # (response, param, what the message quotes): a bad value deep in a field is named by its top-level field, as
    # parse_request names it (a union's members add their type names to the location), the message quotes it all.
    for response, param, quoted in (
        (served.http.get("/test-only/typed", params={"limit": "many"}), "limit", "limit"),
        (served.http.get("/test-only/typed"), "limit", "limit"),
        (served.http.post("/test-only/typed", json={"spec": {"size": "big"}}), "spec", "spec.size"),
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert repr(quoted) in error["message"]
