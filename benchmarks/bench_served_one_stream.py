"""One decode stream served against the same stream offline, on the same file, in one run (issue 65's first part).

Offline: ``LLM.generate`` of one prompt, greedy, ``--tokens`` tokens with ignore_eos; its decode rate is the
tokens after the first over the time after the first (a 1-token run gives the first token's time). Served: a
``kvreuse serve`` process on a free port, the same prompt streamed over /v1/completions, the tokens after the
first over the time from the first SSE event to the last. Both with the cache drafter off unless ``--drafts``
(the comparison is of the serving path, not of drafting). Medians of ``--repeats``. With ``--py-spy OUT`` the
server is also sampled by py-spy during one extra served stream (a flame graph of where a served step's time goes).

    python benchmarks/bench_served_one_stream.py [--model FILE] [--tokens 256] [--repeats 5] [--py-spy OUT.svg]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvreuse.bench.compare import ServerProcess, free_port

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


def offline_rate(model: str, tokens: int, repeats: int, drafts: bool) -> float:
    from kvreuse import LLM, SamplingParams

    llm = LLM(model, speculative_config=None if drafts else {"method": "none"})
    rates = []
    for _ in range(repeats + 1):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
        first = time.perf_counter() - start
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        rates.append((tokens - 1) / (time.perf_counter() - start - first))
    return statistics.median(rates[1:])


def served_rate(base_url: str, tokens: int) -> float:
    times = []
    with httpx.Client(timeout=300) as client, client.stream("POST", f"{base_url}/v1/completions", json={
            "model": "bench-model", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    # Each SSE event carries the tokens of one step; the events after the first carry tokens - 1 of them at most.
    return (tokens - 1) / (times[-1] - times[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or folder (default: the packaged SmolLM2 Q4_1)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--drafts", action="store_true", help="leave the cache drafter at its default")
    parser.add_argument("--py-spy", default=None, metavar="OUT", help="sample the server with py-spy into OUT")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from kvreuse.loading.gguf import packaged_gguf

        model = str(packaged_gguf()[0])
    flags = Path("/proc/cpuinfo").read_text().split("flags\t\t: ", 1)[1].split("\n", 1)[0].split()
    print(f"model {model}; CPU flags {', '.join(f for f in ('avx512f', 'avx512_vnni', 'avx512_bf16', 'amx_tile') if f in flags)}")
    port = free_port()
    command = [sys.executable, "-m", "kvreuse.cli", "serve", "--model", model, "--port", str(port),
               "--served-model-name", "bench-model", "--stats-log-interval", "0"]
    if not args.drafts:
        command += ["--speculative-config", '{"method": "none"}']
    base_url = f"http://127.0.0.1:{port}"
    with ServerProcess(command, Path(tempfile.mkdtemp()) / "server.log", base_url) as server:
        server.wait_ready(300)
        assert server.process is not None
        served_rate(base_url, 16)  # warm-up
        served = statistics.median(served_rate(base_url, args.tokens) for _ in range(args.repeats))
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "-o", args.py_spy, "--pid", str(server.process.pid), "--threads",
                                    "--nonblocking", "--rate", "250"])
            served_rate(base_url, args.tokens * 2)
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt; SIGTERM kills it before that
            spy.wait(30)
    offline = offline_rate(model, args.tokens, args.repeats, args.drafts)
    print(f"one stream, {args.tokens} tokens, median of {args.repeats}: served {served:.1f} tok/s, offline "
          f"{offline:.1f} tok/s, served / offline {served / offline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
