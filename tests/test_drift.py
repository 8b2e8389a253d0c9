"""Drift diagnostics: volatile spans, the drift report on crafted workloads (offline API and server), the
tenant rule (a tenant never sees another tenant's prompt text), the cache tree and per-owner hit counters.

The crafted workloads are the ways caching silently breaks: a timestamp in the system prompt that changes
per request, a reordered few-shot block, a trailing space, an agent's tool list with a description edited,
two tools swapped or a tool added. Each report must name the token position where the prompt left the cache
(checked against the tokenizer's own ids), the span that changed and its kind, and in a tool list the tool
and the JSON path.
"""

from __future__ import annotations

import json
import random
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_process import MODEL_NAME, RunningServer, start_server, stop_server

from kvreuse import LLM, SamplingParams
from kvreuse.cache.hashing import namespace_key
from kvreuse.inputs import common_prefix_length
from kvreuse.observatory.diagnose import simulate
from kvreuse.observatory.drift import namespace_label, realign
from kvreuse.observatory.scope import ALL, NamespaceOwners, Scope
from kvreuse.observatory.tools import (
    find_tools,
    first_difference,
    format_path,
    tool_drift,
)
from kvreuse.observatory.volatile import (
    find_volatile_spans,
    reordered_items,
    whitespace_only,
)

RULES = ("Answer in one short paragraph. Be polite and precise. Refer to the order number when one is given. "
         "Never invent tracking data; say when you do not know. ")
FEW_SHOT = ["Q: Where is my parcel?\nA: Let me check the tracking page.", "Q: Can I pay by card?\nA: Yes, every card."]


# --- volatile spans (pure text) -------------------------------------------------------------------------


@pytest.mark.parametrize("text, kinds", [
    ("Today is Friday 2026-11-20.", [("date", "Friday 2026-11-20")]),
    ("Sent Nov 20, 2026 at 12:34:56 pm", [("date", "Nov 20, 2026"), ("time", "12:34:56 pm")]),
    ("at 2026-11-20T12:34:56Z for Monday", [("datetime", "2026-11-20T12:34:56Z"), ("weekday", "Monday")]),
    ("trace 3f2a9c1e-1234-4abc-9def-0123456789ab", [("uuid", "3f2a9c1e-1234-4abc-9def-0123456789ab")]),
    ("session sess-12ab34 request req_8f3k2l9", [("id", "sess-12ab34"), ("id", "req_8f3k2l9")]),
    ("blob deadbeef12 at 1732101234, 42 items", [("hex-id", "deadbeef12"), ("epoch", "1732101234"), ("number", "42")]),
    ("model gpt4 is fine", []),  # a short letter+digit name is not an id
])
def test_volatile_span_kinds(text: str, kinds: list[tuple[str, str]]) -> None:
    spans = find_volatile_spans(text)
    assert [(span.kind, span.text) for span in spans] == kinds
    assert all(text[span.start:span.end] == span.text for span in spans)


def test_whitespace_and_reordered_blocks() -> None:
    assert whitespace_only("polite. \nAnswer", "polite.\nAnswer briefly")
    assert not whitespace_only("polite.\nAnswer", "polite!\nAnswer")
    reordering = reordered_items("B1\nB2\nA1\nA2\nnew question", "A1\nA2\nB1\nB2\nold question")
    assert reordering is not None and reordering.items == ("B1", "B2", "A1", "A2") and reordering.unit == "lines"
    fields = reordered_items('{"plan": "pro", "user": 7} tail', '{"user": 7, "plan": "pro"} tail')
    assert fields is not None and fields.unit == "items"
    assert reordered_items("A\nB\nC\n", "A\nX\nC\n") is None


def brute_force_runs(request: list[int], cached: list[int], min_run: int = 8) -> list[tuple[int, int, int]]:
    runs, i = [], 0
    while i < len(request):
        best = None
        for j in range(len(cached)):
            length = common_prefix_length(request[i:], cached[j:])
            if length >= min_run and (best is None or length > best[2]):
                best = (i, j, length)
        if best is None:
            i += 1
        else:
            runs.append(best)
            i += best[2]
    return runs


def test_realign_finds_what_a_brute_force_search_finds() -> None:
    """Tokens lost (the end of the last re-aligned run) as an exhaustive search, on spliced random sequences."""
    generator = random.Random(7)
    for _ in range(150):
        alphabet = generator.choice([3, 6, 50])
        cached = [generator.randrange(alphabet) for _ in range(generator.randrange(5, 70))]
        request = [generator.randrange(alphabet) for _ in range(generator.randrange(0, 12))]
        for _ in range(generator.randrange(0, 4)):  # pieces of the cached side, in any order, with noise between
            start = generator.randrange(len(cached))
            request += cached[start:start + generator.randrange(5, 30)] + [generator.randrange(alphabet)] * 2
        found, expected = realign(array("I", request), array("I", cached)), brute_force_runs(request, cached)
        assert (found[-1].i + found[-1].length if found else 0) == (expected[-1][0] + expected[-1][2] if expected else 0)
        for run in found:
            assert run.length >= 8 and request[run.i:run.i + run.length] == cached[run.j:run.j + run.length]


# --- tool lists: which tool changed, came, went or moved (pure text) ----------------------------------------


def function_tool(name: str, description: str, **properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)}}}


SEARCH = function_tool("search", "Search the web for pages.", q={"type": "string", "description": "the query"},
                       limit={"type": "integer", "description": "at most this many results"})
FETCH = function_tool("fetch", "Fetch one page as text.", url={"type": "string", "description": "an http(s) URL"})
WEATHER = function_tool("weather", "The weather at a place, today.", city={"type": "string"})
TOOLS = [SEARCH, FETCH, WEATHER]


def edited(tool: dict, change) -> dict:
    copy = json.loads(json.dumps(tool))
    change(copy["function"])
    return copy


def qwen_prompt(tools: list[dict], question: str = "Find me a recipe.") -> str:
    """A chat with tools as Qwen2.5's template renders it: one JSON object per tool and line in <tools>."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (f"<|im_start|>system\nYou are a research agent.\n\n# Tools\n\nYou may call one or more functions to "
            f"assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
            f"tags:\n<tools>{listed}\n</tools>\n\nFor each function call, return a json object with function name "
            f"and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n<|im_start|>user\n{question}"
            f"<|im_end|>\n<|im_start|>assistant\n")


def description_of_q(function: dict) -> None:
    function["parameters"]["properties"]["q"]["description"] = "the search query, in English"


@pytest.mark.parametrize("request_tools, summary, fields", [
    ([edited(SEARCH, description_of_q), FETCH, WEATHER],
     ["tool `search`: parameters.properties.q.description changed"],
     {"changed": [{"name": "search", "path": "parameters.properties.q.description", "change": "changed"}]}),
    ([SEARCH, edited(FETCH, lambda f: f.update(description="Fetch a page.")), WEATHER],
     ["tool `fetch`: description changed"], {"changed": [{"name": "fetch", "path": "description", "change": "changed"}]}),
    ([SEARCH, edited(FETCH, lambda f: f["parameters"]["required"].append("url")), WEATHER],
     ["tool `fetch`: parameters.required[1] added"], {}),
    ([edited(SEARCH, lambda f: f["parameters"]["properties"].pop("limit")), FETCH, WEATHER],
     ["tool `search`: parameters.properties.limit removed"], {}),
    ([FETCH, SEARCH, WEATHER], ["tools `search` and `fetch` swapped"],
     {"moved": ["search", "fetch"], "swapped": True, "changed": []}),
    ([WEATHER, SEARCH, FETCH], ["tool `weather` moved"], {"moved": ["weather"], "swapped": False}),
    ([SEARCH, FETCH, function_tool("calc", "Compute."), WEATHER], ["tool `calc` added"],
     {"added": ["calc"], "removed": [], "moved": []}),
    ([SEARCH, WEATHER], ["tool `fetch` removed"], {"removed": ["fetch"], "added": []}),
    ([edited(SEARCH, lambda f: f.update(parameters=dict(reversed(list(f["parameters"].items()))))), FETCH, WEATHER],
     ["tool `search`: the keys of parameters in another order"], {}),
])
def test_tool_drift_names_the_tool_and_the_path(request_tools: list[dict], summary: list[str], fields: dict) -> None:
    drift = tool_drift(qwen_prompt(request_tools), qwen_prompt(TOOLS))
    assert drift is not None and drift.summary == summary, drift
    found = drift.as_dict()
    assert {key: found[key] for key in fields} == fields
    assert found["cached_tools"] == ["search", "fetch", "weather"] and found["complete"]
    assert drift.advice


def test_tool_drift_in_other_formats_and_cut_windows() -> None:
    changed = [edited(SEARCH, description_of_q), FETCH]
    # Llama 3.1's template: each tool as indented JSON, a blank line after each, in the first user turn.
    def llama(tools: list[dict]) -> str:
        return ("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON "
                "for a function call.\n\n" + "".join(json.dumps(tool, indent=4) + "\n\n" for tool in tools)
                + "Question: what is new?<|eot_id|>")
    assert tool_drift(llama(changed), llama(TOOLS[:2])).summary == ["tool `search`: parameters.properties.q.description changed"]
    # Mistral's: one JSON array; Anthropic-style definitions (input_schema, no wrapper) are tools too.
    def mistral(tools: list[dict]) -> str:
        return f"[AVAILABLE_TOOLS]{json.dumps(tools)}[/AVAILABLE_TOOLS][INST]What is new?[/INST]"
    assert tool_drift(mistral([FETCH, SEARCH]), mistral([SEARCH, FETCH])).summary == ["tools `search` and `fetch` swapped"]
    anthropic = [{"name": "search", "description": "Search.", "input_schema": {"type": "object"}},
                 {"name": "fetch", "description": "Fetch.", "input_schema": {"type": "object"}}]
    assert tool_drift(mistral(anthropic[::-1]), mistral(anthropic)).moved == ("search", "fetch")
    # The same definition serialised another way (no spaces after separators).
    compact = qwen_prompt(TOOLS).replace(json.dumps(FETCH), json.dumps(FETCH, separators=(",", ":")))
    assert tool_drift(compact, qwen_prompt(TOOLS)).summary == [
        "tool `fetch`: the same definition, serialised differently (whitespace or escapes)"]
    # Windows cut the list: the object a window's end cuts is ignored, and a tool past it is not "removed".
    request, cached = qwen_prompt([edited(SEARCH, description_of_q), FETCH, WEATHER]), qwen_prompt(TOOLS)
    cut_request = request[:request.index('"weather"') + 20]  # ends inside the weather tool
    drift = tool_drift(cut_request, cached)
    assert drift is not None and drift.request_tools == ("search", "fetch") and not drift.complete
    assert drift.removed == () and drift.summary == ["tool `search`: parameters.properties.q.description changed"]
    # The text before the divergence may start inside a tool (the lead kept is bounded): that one is skipped.
    start = cached.index('"fetch"') - 10
    assert tool_drift(request[start:], cached[start:]) is None  # search is cut: nothing named, nothing invented
    assert find_tools(cached[start:])[0].name == "fetch"
    # Not in a tool list: no tool finding; a tool call in the history is no tool definition.
    assert tool_drift("Today is Monday. {\"name\": \"x\", \"arguments\": {}}", "Today is Friday.") is None
    assert find_tools('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>') == []


def test_first_difference_walks_in_text_order() -> None:
    assert first_difference({"a": 1, "b": {"c": [1, 2]}}, {"a": 1, "b": {"c": [1, 3]}}) == (("b", "c", 1), "changed")
    assert first_difference({"a": 1}, {"a": True}) == (("a",), "changed")  # true is other text than 1
    assert first_difference({"a": 1, "b": 2}, {"b": 2, "a": 1}) == ((), "key order")
    assert first_difference({"a": 1}, {"a": 1, "new": 0}) == (("new",), "added")
    assert first_difference({"a": [1]}, {"a": [1]}) is None
    assert format_path(("parameters", "properties", "max results", "enum", 2)) == 'parameters.properties["max results"].enum[2]'


def test_char_level_report_names_the_tool_that_changed_and_the_one_that_moved() -> None:
    report = char_report([qwen_prompt(TOOLS, "Find a recipe."), qwen_prompt([edited(SEARCH, description_of_q), FETCH, WEATHER],
                                                                         "Find a recipe.")])
    group = report["groups"][0]
    assert group["kinds"] == ["tools"] and group["tools"]["changed"] == [
        {"name": "search", "path": "parameters.properties.q.description", "change": "changed"}]
    assert group["sentence"].endswith("(tools); tool `search`: parameters.properties.q.description changed"), group
    assert group["advice"][0].startswith("send each tool's definition byte-identical") and "`search` changed" in group["advice"][0]
    assert group["tokens_lost_per_request"] > 0

    report = char_report([qwen_prompt(TOOLS), qwen_prompt([FETCH, SEARCH, WEATHER])])
    group = report["groups"][0]
    # One tool per line reads as reordered lines too; the tool analysis says it by name instead.
    assert group["kinds"] == ["tools"] and group["reordered_lines"] is None, group
    assert group["sentence"].endswith("(tools); tools `search` and `fetch` swapped")
    assert (group["cached_text"], group["request_text"]) == ("search", "fetch")
    assert group["tools"]["at_divergence"] == {"request": "fetch", "cached": "search"}
    assert group["advice"] == ["keep the tool list in a fixed order (build it once, or sort it by name): the same "
                               "tools come in another order"]
    # Outside tool lists nothing changes: the date group of a plain prompt has no tools.
    assert char_report(["Now: 2026-11-16. " + RULES, "Now: 2026-11-17. " + RULES])["groups"][0]["tools"] is None


# --- the tenant rule --------------------------------------------------------------------------------------


def test_scope_rule() -> None:
    alice, bob = Scope("alice", False), Scope("bob", False)
    assert ALL.may_see(frozenset({"alice", "bob"})) and ALL.may_see(frozenset())
    assert alice.may_see(frozenset({"alice"})) and not bob.may_see(frozenset({"alice"}))
    assert not alice.may_see(frozenset({"alice", "bob"}))  # a namespace two tenants used: hidden from both
    assert not alice.may_see(frozenset({"alice", None}))  # ... and one a keyless request used too
    assert not alice.may_see(frozenset())  # never seen: only an all-seeing caller
    assert alice.may_see_owner("alice") and not alice.may_see_owner(None) and ALL.may_see_owner("bob")
    owners = NamespaceOwners()
    owners.add(b"n", "alice")
    owners.add(b"n", "alice")
    assert owners.of(b"n") == frozenset({"alice"}) and owners.single_owner(b"n") == "alice"
    owners.add(b"n", "bob")
    assert owners.single_owner(b"n") is None
    assert owners.prune(lambda namespace: False) == 1 and owners.of(b"n") == frozenset()


# --- the report on a character-level cache (positions are character offsets) ----------------------------------


def char_report(texts: list[str], block_size: int = 4) -> dict:
    simulation = simulate([[ord(char) for char in text] for text in texts], block_size)
    owners = NamespaceOwners()
    for record in simulation.drift.records:
        owners.add(record.namespace, None)
    return simulation.drift.report(ALL, 5, lambda ids: "".join(map(chr, ids)), owners)


def test_char_level_report_names_position_span_and_tokens_lost() -> None:
    prompts = [f"You are the billing assistant. Now: 2026-11-{day} 09:00. {RULES}Question {day}?"
               for day in (16, 17, 18)]
    report = char_report(prompts)
    group = report["groups"][0]
    assert group["requests"] == 2 and group["position"] == prompts[0].index("-16") + 2
    assert group["request_text"] == "2026-11-18 09:00"
    assert group["cached_text"] in ("2026-11-16 09:00", "2026-11-17 09:00")
    assert group["kinds"] == ["datetime"] and "move the date" in group["advice"][0]
    # Recomputed only because of the date: the rest of the system prompt, up to where the questions differ.
    assert group["tokens_lost_per_request"] == prompts[0].index("16?") - group["position"]
    # The template is named by the prompt's first 32 tokens (here characters), less the word they cut.
    assert group["sentence"] == (
        f"2 requests of the prefix starting 'You are the billing assistant.' diverge at token {group['position']}, "
        f"where the text changes ({group['cached_text']!r} / '2026-11-18 09:00'): {group['tokens_lost_per_request']} "
        "tokens per request recomputed (datetime)")


def test_char_level_report_at_the_first_token_and_cold_misses() -> None:
    report = char_report(["Alpha beta gamma delta epsilon", "Blpha beta gamma delta epsilon"])
    (group,) = report["groups"]
    assert group["position"] == 0 and group["request_text"] == "Blpha" and group["tokens_lost_per_request"] == 28  # 7 blocks cached
    assert group["sentence"].startswith("1 request of this namespace diverges at token 0, where the text changes "
                                        "('Alpha' / 'Blpha')")
    assert report["cold_misses"] == 1 and report["total_misses"] == 1  # the first prompt found nothing cached


# --- the engine (offline API): crafted chat workloads ----------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="8MiB", max_num_seqs=4)


def system_chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def run_workload(llm: LLM, salt: str, conversations: list[list[dict[str, str]]]) -> tuple[dict, int]:
    """Send the conversations one by one in their own namespace; the report's group of that namespace and
    the expected divergence of the last one (its common prefix with the one before, in the tokenizer's ids)."""
    for conversation in conversations:
        llm.chat(conversation, SamplingParams(temperature=0, max_tokens=1), cache_salt=salt, use_tqdm=False)
    ids = [llm.inputs.from_messages(conversation).token_ids for conversation in conversations]
    label = namespace_label(namespace_key(salt, None, llm.engine.model_name))
    groups = [group for group in llm.drift_report(top=20)["groups"] if group["namespace"] == label]
    assert groups, llm.drift_report(top=20)
    return groups[0], common_prefix_length(ids[-1], ids[-2])


def test_engine_report_on_a_timestamped_system_prompt(llm: LLM) -> None:
    times = ["08:15:02", "08:15:09", "08:15:41"]
    group, expected = run_workload(llm, "timestamp", [
        system_chat(f"You are the support assistant. Current time: 2026-11-20 {time}. {RULES}", question)
        for time, question in zip(times, ["Where is my order?", "Do gift cards expire?", "Can I return a book?"])])
    # The seconds' units changed first, then their tens: nearby positions of one field are one group.
    assert group["position"] == expected and group["positions"] == [expected, expected + 1], group
    assert group["requests"] == 2 and group["sentence"].startswith("2 requests") and "at tokens " in group["sentence"]
    assert group["request_text"] == f"2026-11-20 {times[-1]}", group
    assert "datetime" in group["kinds"] and group["tokens_lost_per_request"] > 20
    assert any(span["side"] == "request" and span["text"] == f"2026-11-20 {times[-1]}" for span in group["volatile"])


def test_engine_report_on_a_reordered_few_shot_block(llm: LLM) -> None:
    group, expected = run_workload(llm, "few-shot", [
        system_chat(f"{RULES}Examples:\n" + "\n".join(order), "Where is my order?")
        for order in (FEW_SHOT, FEW_SHOT[::-1])])
    assert group["position"] == expected
    assert "reordered" in group["kinds"] and group["reordered_items"] == 4, group
    assert group["request_text"] == FEW_SHOT[1].split("\n")[0] and group["cached_text"] == FEW_SHOT[0].split("\n")[0]
    assert any("fixed order" in advice for advice in group["advice"])


def test_engine_report_on_a_trailing_space(llm: LLM) -> None:
    group, expected = run_workload(llm, "whitespace", [
        system_chat(f"You are the support assistant.{space}\n{RULES}", "Where is my order?") for space in ("", " ")])
    assert group["position"] == expected
    assert group["kinds"] == ["whitespace"] and group["whitespace_only"], group
    assert any("trailing whitespace" in advice for advice in group["advice"])


@pytest.mark.parametrize("salt, request_tools, summary", [
    ("tool-description", [edited(SEARCH, description_of_q), FETCH, WEATHER],
     "tool `search`: parameters.properties.q.description changed"),
    ("tool-order", [FETCH, SEARCH, WEATHER], "tools `search` and `fetch` swapped"),
    ("tool-added", [SEARCH, FETCH, function_tool("calc", "Compute an expression.", expr={"type": "string"}), WEATHER],
     "tool `calc` added"),
])
def test_engine_report_names_the_tool_on_rendered_prompts(llm: LLM, salt: str, request_tools: list[dict],
                                                           summary: str) -> None:
    """Real prompts: the made model's chat template lists the tools (Qwen2.5's shape), the engine records the
    miss, the report names the tool."""
    chat = system_chat(f"You are a research agent. {RULES}", "Find me a recipe for bread.")
    for tools in (TOOLS, request_tools):
        llm.chat(chat, SamplingParams(temperature=0, max_tokens=1), cache_salt=salt, use_tqdm=False, tools=tools)
    ids = [llm.inputs.from_messages(chat, tools=tools).token_ids for tools in (TOOLS, request_tools)]
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in llm.inputs.render(chat, tools=TOOLS)
    label = namespace_label(namespace_key(salt, None, llm.engine.model_name))
    (group,) = [group for group in llm.drift_report(top=50)["groups"] if group["namespace"] == label]
    assert group["position"] == common_prefix_length(ids[1], ids[0]), group
    assert "tools" in group["kinds"] and group["tools"]["summary"] == [summary], group
    assert group["sentence"].endswith(f"(tools); {summary}") and group["tokens_lost_per_request"] > 0
    assert group["tools"]["cached_tools"] == ["search", "fetch", "weather"] and group["tools"]["complete"]


def test_cache_tree_and_hit_counters(llm: LLM) -> None:
    system = f"You are the tree assistant. {RULES}"
    for question in ["Where is my order?", "Do gift cards expire?", "Can I return a book?"]:
        llm.chat(system_chat(system, question), SamplingParams(temperature=0, max_tokens=1), cache_salt="tree",
                 use_tqdm=False)
    label = namespace_label(namespace_key("tree", None, llm.engine.model_name))
    tree = [entry for entry in llm.engine.cache_tree(top=50) if entry["namespace"] == label]
    shared = max(tree, key=lambda entry: entry["blocks"])
    assert shared["branches"] == 3 and shared["hits"] == 2 and not shared["pinned"], tree
    assert shared["text"].startswith("system\nYou are the tree assistant") and len(shared["text"]) <= 200
    assert shared["tokens"] % 16 == 0 and shared["namespace_owner"] is None
    counters = llm.engine.hit_counters()
    assert set(counters) == {"shared"} and 0 < counters["shared"]["hit_tokens"] < counters["shared"]["query_tokens"]
    assert llm.engine.hit_counters(Scope("someone", False)) == {}
    assert llm.engine.cache_tree(Scope("someone", False)) == []
    assert llm.engine.drift_report(Scope("someone", False))["groups"] == []


# --- the server: GET /v1/cache/drift, tenant-scoped --------------------------------------------------------------

KEY_A, KEY_B, ADMIN_KEY = "drift-key-alpha", "drift-key-bravo", "drift-admin"


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two servers with the same keys, started side by side: tenants isolated, and not."""
    folder = tmp_path_factory.mktemp("drift-servers")
    keys = ("--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN_KEY, "--stats-log-interval", "0")
    with ThreadPoolExecutor(2) as pool:
        isolated = pool.submit(start_server, tiny_model, folder / "isolated.log", *keys, "--isolate-tenants")
        shared = pool.submit(start_server, tiny_model, folder / "shared.log", *keys)
        running = {"isolated": isolated.result(), "shared": shared.result()}
    yield running
    with ThreadPoolExecutor(2) as pool:  # each drains for a moment: side by side
        list(pool.map(stop_server, running.values()))


def send(server: RunningServer, key: str, prompts: list[str], salt: str | None = None) -> None:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60) as client:
        for prompt in prompts:
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"cache_salt": salt} if salt else None)


def drift(server: RunningServer, key: str | None, query: str = "") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.base_url}/v1/cache/drift{query}", headers=headers, timeout=30)


def alpha_prompts() -> list[str]:
    return [f"Alpha desk. Now 2026-11-20 10:0{second}. {RULES}Question {second}" for second in range(3)]


def bravo_prompts() -> list[str]:
    return [f"Bravo desk. Session sess-{index}b{index}c9x. {RULES}Ask {index}" for index in range(3)]


def test_tenants_see_only_their_own_drift_when_isolated(servers: dict[str, RunningServer]) -> None:
    server = servers["isolated"]
    send(server, KEY_A, alpha_prompts())
    send(server, KEY_B, bravo_prompts())
    mine = drift(server, KEY_A).json()
    theirs = drift(server, KEY_B).json()
    everything = drift(server, ADMIN_KEY, "?top=50").json()
    assert mine["object"] == "cache.drift" and mine["groups"] and theirs["groups"]
    assert "Alpha" in json.dumps(mine) and "Bravo" not in json.dumps(mine)
    assert "Bravo" in json.dumps(theirs) and "Alpha" not in json.dumps(theirs)
    assert mine["total_misses"] is None  # totals over every namespace are for the admin
    assert any(group["kinds"] == ["datetime"] for group in mine["groups"]), mine
    assert any("id" in group["kinds"] for group in theirs["groups"]), theirs
    admin_text = json.dumps(everything)
    assert "Alpha" in admin_text and "Bravo" in admin_text and everything["total_misses"] >= 4


def test_a_namespace_two_tenants_used_is_hidden_from_both(servers: dict[str, RunningServer]) -> None:
    server = servers["shared"]
    send(server, KEY_A, alpha_prompts())  # no isolation, no salt: the shared namespace
    send(server, KEY_B, bravo_prompts())
    send(server, KEY_A, [f"Own salt. Now 2026-11-20 11:0{second}. {RULES}Q {second}" for second in range(2)],
         salt="alpha-only")
    mine, theirs = drift(server, KEY_A).json(), drift(server, KEY_B).json()
    assert [group["template"][:8] for group in mine["groups"]] == ["Own salt"]  # its own salt's namespace only
    assert theirs["groups"] == [] and "Alpha" not in json.dumps(theirs) and "Own salt" not in json.dumps(theirs)
    admin_text = json.dumps(drift(server, ADMIN_KEY, "?top=50").json())
    assert all(word in admin_text for word in ("Alpha", "Bravo", "Own salt"))


def test_drift_route_errors(servers: dict[str, RunningServer]) -> None:
    server = servers["isolated"]
    assert drift(server, None).status_code == 401
    for query in ("?top=0", "?top=abc", "?top=1000"):
        reply = drift(server, KEY_A, query)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "top", reply.text
