"""GGUF serving benchmark: kvreuse and llama.cpp's llama-server on the same GGUF file, one run, side by side.

For each --gguf file, each system runs as a server subprocess with the cores to itself (one at a time):
``kvreuse serve --model FILE`` (its weights held as the file's quantized blocks: quantization "gguf", the
default for a GGUF file on CPU), the same with ``--enable-torch-compile`` (decode steps compiled: minutes
to start the first time on a machine, seconds once inductor's cache has them) and ``llama-server -m FILE
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
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_engine import machine_description  # noqa: E402

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
SYSTEMS = ("kvreuse", "kvreuse-op-by-op", "kvreuse-torch-attention", "kvreuse-kv-bf16", "kvreuse-kv-int8",
           "kvreuse-compiled", "llama-server")


def kv_bytes(gguf: str, tokens: int, dtype: str) -> int:
    """Bytes of K and V for ``tokens`` tokens of the file's model in kvreuse's ``dtype`` (its KV dtype): the
    pool that holds as many tokens as llama-server's -c (an f16 cache: the same bytes where kvreuse runs
    bf16; twice them in float32)."""
    import torch

    from kvreuse.models.config import ModelConfig
    from kvreuse.models.gguf import read_gguf
    from kvreuse.models.loader import resolve_dtype

    config = ModelConfig.from_dict(read_gguf(gguf).hf_config)
    size = torch.empty((), dtype=resolve_dtype(dtype, "cpu")).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * size * tokens


def server_command(system: str, gguf: str, port: int, args: argparse.Namespace) -> list[str]:
    threads = len(os.sched_getaffinity(0))
    if system == "llama-server":
        # Its serving defaults for --concurrency clients: a slot each, one unified KV buffer, f16 KV.
        return [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(args.concurrency),
                "-c", str(args.ctx_size), "--kv-unified", "-t", str(threads), "--alias", SERVED, "--no-webui"]
    kv_dtype = "bfloat16" if system == "kvreuse-kv-bf16" else args.dtype
    # `env` execs the server, so the pid measured is the server's.
    command = (["env", "KVREUSE_NATIVE_STEP=0"] if system == "kvreuse-op-by-op" else []) + [
        sys.executable, "-m", "kvreuse.cli", "serve", "--model", gguf, "--port", str(port), "--dtype", args.dtype,
        "--kv-cache-memory", str(kv_bytes(gguf, args.ctx_size, kv_dtype)), "--served-model-name", SERVED,
        "--stats-log-interval", "0"]
    if system == "kvreuse-torch-attention":
        command += ["--attention-backend", "torch"]
    if system == "kvreuse-kv-int8":
        command += ["--kv-cache-dtype", "int8"]
    if system == "kvreuse-kv-bf16":
        command += ["--kv-cache-dtype", "bfloat16"]
    return command + (["--enable-torch-compile"] if system == "kvreuse-compiled" else [])


class Client:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def stream(self, client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
        """(seconds to the first token, seconds to the last, tokens) of one streamed greedy completion."""
        body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        start = time.perf_counter()
        first = last = None
        async with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode(errors='replace')}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
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

    async def ttft(self, prompt: list[int]) -> float:
        async with httpx.AsyncClient(timeout=600) as client:
            first, _, _ = await self.stream(client, prompt, 1)
        return first


def vocabulary(gguf: str) -> list[int]:
    """Token ids a prompt may hold: the file's ordinary tokens (no special or added ones)."""
    from kvreuse.models.loader import resolve_tokenizer_path
    from kvreuse.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_tokenizer_path(Path(gguf)))
    special = set(tokenizer.added_tokens.values())
    size = len(tokenizer.hf_tokenizer)
    return [i for i in range(min(256, size // 4), size) if i not in special]


def measure(system: str, gguf: str, args: argparse.Namespace, rng: random.Random, vocab: list[int],
            log_dir: Path) -> dict:
    def tokens(count: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(count)]

    port = free_port()
    command = server_command(system, gguf, port, args)
    log = log_dir / f"{system}-{Path(gguf).stem}.log"
    result: dict = {}
    with ServerProcess(command, log, f"http://127.0.0.1:{port}") as server:
        started = time.perf_counter()
        server.wait_ready(timeout_s=900)
        result["start_s"] = time.perf_counter() - started
        time.sleep(args.settle_s)
        result["rss_idle_bytes"] = vm_status(server.process.pid)["VmRSS"]
        client = Client(server.base_url)
        # First requests, one and --concurrency at once: lazy set-up (and a compiled batch size) out of the figures.
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
            "rss_peak_bytes": vm_status(server.process.pid)["VmHWM"],
        }
        if system.startswith("kvreuse"):
            held = re.search(r"weights: ([0-9.]+) MiB as held", server.log_tail(10**6))
            result["weights_held_bytes"] = float(held.group(1)) * 2**20 if held else None
            # A CPU pool is resident as it fills; llama-server clears (writes) its whole cache at start. The
            # peak with a full pool adds the pool's pages still untouched at the end (they would have been
            # resident at the peak too; pages first written after the peak make this a slight underestimate).
            kv_dtype = "bfloat16" if system == "kvreuse-kv-bf16" else args.dtype
            pool = anonymous_mapping(server.process.pid, kv_bytes(gguf, args.ctx_size, kv_dtype))
            if pool is not None:
                result["kv_pool_bytes"], result["kv_pool_resident_bytes"] = pool
                result["rss_peak_full_pool_bytes"] = result["rss_peak_bytes"] + pool[0] - pool[1]
        else:
            result["rss_peak_full_pool_bytes"] = result["rss_peak_bytes"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", action="append", required=True, help="a GGUF file (repeat for several)")
    parser.add_argument("--llama-server", default=None, help="llama-server's binary (llama_cpp_peer.sh prints it)")
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    args.settle_s = SETTLE_S
    systems = args.systems.split(",")
    if any(system not in SYSTEMS for system in systems):
        parser.error(f"--systems must be among {list(SYSTEMS)}, got {args.systems!r}")
    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":  # the suite runs the documented command this way
        args.concurrency, args.decode_prompt_tokens, args.decode_tokens, args.prefill_len, args.repeats = 2, 8, 4, 32, 1
        args.long_context_tokens = 48
        args.ctx_size = 512
        systems = ["kvreuse"]
        args.settle_s = 0.0  # no llama-server whose threads to wait for
        print("KVREUSE_BENCH_SMOKE=1: kvreuse alone (eager) with the smallest sizes; the figures mean nothing")
    elif "llama-server" in systems and not args.llama_server:
        parser.error("--llama-server BIN is needed (bash ../shared/tools/llama_cpp_peer.sh MODEL_DIR q8_0 prints it)")
    print(f"machine: {machine_description()}")
    flags = set(next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "").split())
    print("CPU flags: " + ", ".join(flag for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
                                    if flag in flags))
    rng = random.Random(args.seed)
    all_results: dict[str, dict] = {}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for gguf in args.gguf:
            vocab = vocabulary(gguf)
            size = Path(gguf).stat().st_size
            rounds = [{system: measure(system, gguf, args, rng, vocab, Path(tmp)) for system in systems}
                      for _ in range(args.rounds)]
            figures = {system: median_of_rounds([one[system] for one in rounds]) for system in systems}
            if args.rounds > 1:
                for number, one in enumerate(rounds, 1):
                    print(f"round {number}: " + "; ".join(
                        f"{system} 1 stream {one[system]['decode_tok_s_one_stream']:.1f}, long context "
                        f"{one[system]['decode_tok_s_one_stream_long_context']:.1f} tok/s" for system in systems))
            all_results[Path(gguf).name] = {"file_bytes": size, **figures}
            report(Path(gguf).name, size, figures, args.concurrency)
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
            ("weights held MiB", "weights_held_bytes", "{:.1f}", False)]
    systems = list(figures)
    ours = [system for system in systems if system.startswith("kvreuse")]
    peer = "llama-server" if "llama-server" in figures else None
    header = "".join(f"{system:>24}" for system in systems)
    header += "".join(f"{system + '/llama':>30}" for system in ours) if peer else ""
    print(f"{'':28}{header}")
    for label, key, fmt, _ in rows:
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
