"""One decode stream served against the same stream offline, same file, rounds interleaved (issue 65's first part).

Served: a ``kvreuse serve`` process on a free port, one prompt streamed over /v1/completions, greedy, ``--tokens``
tokens with ignore_eos; its rate is the tokens after the first over the time from the first SSE event to the last.
Offline: the same prompt in a second process (``--offline-worker``, loaded once) through the engine, stepped as
``LLM.generate`` steps it; the tokens after the first over the time from the step that gave the first token. Both
with the cache drafter off unless ``--drafts`` (the comparison is of the serving path, not of drafting).

Both processes are up for the whole run, and each round runs one served stream, then one offline stream, so the
two see the machine in the same state: a virtual machine's speed moves by 10-30% within minutes (measured on the
2-core EPYC VM of docs/benchmarks.md), and a served run followed by an offline run compared two moments, not two
paths. The ratio reported is the median of the rounds' ratios, beside the median rates.

Beside the rates: the bandwidth floor of one token per pass, the bytes of the file's tensors (what a decode step
reads: a tied head reads the embedding table once) over the machine's read bandwidth (a torch sum over 512 MiB on
the step's threads, median of 5, measured before and after the rounds).

    python benchmarks/bench_served_one_stream.py [--model FILE] [--tokens 256] [--repeats 5] [--stream-interval N]
        [--json OUT] [--py-spy OUT.svg]

KVREUSE_BENCH_SMOKE=1 runs the tiny float32 preset with 8 tokens and one round (the suite runs the documented
command that way); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvreuse.bench.compare import ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cache_drafts import bytes_per_token, read_bandwidth  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


def offline_worker(model: str, tokens: int, drafts: bool) -> int:
    """Load the model, say "ready", then run one offline stream per line read and print its decode rate: the
    engine stepped in this process as ``LLM.generate`` steps it, timed from the step that gave the first token."""
    from kvreuse import LLM, SamplingParams

    llm = LLM(model, speculative_config=None if drafts else {"method": "none"})
    engine = llm.engine
    print("ready", flush=True)
    for number, _ in enumerate(sys.stdin):
        llm.reset_prefix_cache()
        engine.add_request(f"offline-{number}", PROMPT, SamplingParams(temperature=0, max_tokens=tokens,
                                                                       ignore_eos=True))
        first = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first is None and any(output.outputs[0].token_ids for output in outputs):
                first = time.perf_counter()
        assert first is not None
        print((tokens - 1) / (time.perf_counter() - first), flush=True)
    return 0


class OfflineProcess:
    """The offline side: a worker process, one stream per ``rate()`` call."""

    def __init__(self, model: str, tokens: int, drafts: bool) -> None:
        command = [sys.executable, __file__, "--offline-worker", "--model", model, "--tokens", str(tokens)]
        self.process = subprocess.Popen(command + (["--drafts"] if drafts else []), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        for line in self.process.stdout:  # the engine's logs go to stderr
            if line.strip() == "ready":
                return
        raise RuntimeError(f"the offline worker exited with {self.process.wait()} before it was ready")

    def rate(self) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(60)


def served_rate(base_url: str, tokens: int) -> float:
    sent = time.perf_counter()
    times = []
    with httpx.Client(timeout=300) as client, client.stream("POST", f"{base_url}/v1/completions", json={
            "model": "bench-model", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    # Each SSE event carries the tokens of one step; the events after the first carry tokens - 1 of them at most.
    # A stream whose text came in one event (a random model's bytes that complete no character) is timed from the
    # request.
    return (tokens - 1) / (times[-1] - (times[0] if len(times) > 1 else sent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or folder (default: the packaged SmolLM2 Q4_1)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="rounds, each one served and one offline stream")
    parser.add_argument("--drafts", action="store_true", help="leave the cache drafter at its default")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the server's --stream-interval (tokens a chunk)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the figures as JSON")
    parser.add_argument("--py-spy", default=None, metavar="OUT", help="sample the server with py-spy into OUT")
    parser.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_worker:
        return offline_worker(args.model, args.tokens, args.drafts)
    import torch

    if os.environ.get("KVREUSE_BENCH_SMOKE") == "1":
        from kvreuse.model_tools.make_model import ensure_model

        print("KVREUSE_BENCH_SMOKE=1: the tiny float32 preset, 8 tokens, one round; the figures mean nothing")
        args.model, args.tokens, args.repeats = str(ensure_model("tiny", dtype="float32")), 8, 1
    if args.model is None:
        from kvreuse.loading.gguf import packaged_gguf

        found, why = packaged_gguf()
        args.model = str(found) if found is not None else parser.error(f"--model not given and {why}")
    model = args.model
    threads = torch.get_num_threads()
    flags = Path("/proc/cpuinfo").read_text().split("flags\t\t: ", 1)[1].split("\n", 1)[0].split()
    print(f"model {model}; {os.cpu_count()} cores, {threads} threads; CPU flags "
          f"{', '.join(f for f in ('avx2', 'avx512f', 'avx512_vnni', 'avx512_bf16', 'amx_tile') if f in flags)}",
          flush=True)
    bandwidth = [read_bandwidth(threads)]
    port = free_port()
    command = [sys.executable, "-m", "kvreuse.cli", "serve", "--model", model, "--port", str(port),
               "--served-model-name", "bench-model", "--stats-log-interval", "0", "--stream-interval",
               str(args.stream_interval)]
    if not args.drafts:
        command += ["--speculative-config", '{"method": "none"}']
    base_url = f"http://127.0.0.1:{port}"
    served: list[float] = []
    offline: list[float] = []
    with ServerProcess(command, Path(tempfile.mkdtemp()) / "server.log", base_url) as server:
        server.wait_ready(300)
        assert server.process is not None
        worker = OfflineProcess(model, args.tokens, args.drafts)
        try:
            served_rate(base_url, 16)  # warm-up, both sides
            worker.rate()
            for _ in range(args.repeats):
                served.append(served_rate(base_url, args.tokens))
                offline.append(worker.rate())
        finally:
            worker.close()
        if args.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "-o", args.py_spy, "--pid", str(server.process.pid),
                                    "--threads", "--nonblocking", "--rate", "250"])
            served_rate(base_url, args.tokens * 2)
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt; SIGTERM kills it before that
            spy.wait(30)
    bandwidth.append(read_bandwidth(threads))
    ratios = [s / o for s, o in zip(served, offline)]
    figures = {"model": model, "tokens": args.tokens, "rounds": args.repeats, "threads": threads,
               "stream_interval": args.stream_interval,
               "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags],
               "served_tok_s": served, "offline_tok_s": offline, "served_over_offline": ratios,
               "read_bandwidth_gb_s": [b / 1e9 for b in bandwidth],
               "bytes_per_token": bytes_per_token(model)[0] if model.endswith(".gguf") else None}
    print(f"one stream, {args.tokens} tokens, {args.repeats} interleaved rounds, --stream-interval "
          f"{args.stream_interval}: served {', '.join(f'{rate:.1f}' for rate in served)} tok/s; offline "
          f"{', '.join(f'{rate:.1f}' for rate in offline)}")
    print(f"medians: served {statistics.median(served):.1f} tok/s, offline {statistics.median(offline):.1f} tok/s; "
          f"served / offline, median of the rounds' ratios: {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    if figures["bytes_per_token"] is not None:
        floors = [b / figures["bytes_per_token"] for b in bandwidth]
        figures["floor_tok_s"] = floors
        print(f"bandwidth floor: {figures['bytes_per_token'] / 1e6:.1f} MB a token at "
              f"{min(bandwidth) / 1e9:.1f}-{max(bandwidth) / 1e9:.1f} GB/s read: {min(floors):.0f}-{max(floors):.0f} "
              f"tok/s; served at {statistics.median(served) / max(floors):.0%}-"
              f"{statistics.median(served) / min(floors):.0%} of it")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
