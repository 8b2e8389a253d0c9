"""``kvreuse bench serve`` and ``kvreuse bench compare``: argument parsing and the two runs.

``serve`` drives one running OpenAI-compatible server; ``compare`` starts kvreuse (prefix caching
on, then off), the transformers reference and, given its binary and a GGUF, llama.cpp's llama-server
in turn on a free loopback port and runs the same workload against each. ``kvreuse.cli`` mounts these with ``add_bench_arguments`` / ``run_bench``;
``python -m kvreuse.bench`` is the same as ``kvreuse bench``.
"""

from __future__ import annotations

import argparse
import sys

from kvreuse.bench.client import BenchmarkRun, ClientConfig, LoadClient
from kvreuse.bench.options import (
    add_client_arguments,
    add_workload_arguments,
    build_workload,
    client_config,
    config_dict,
    load_tokenizer,
    positive_float,
    workload_dict,
)


def add_bench_arguments(bench: argparse.ArgumentParser, parents: list[argparse.ArgumentParser]) -> None:
    """``bench serve`` and ``bench compare`` under the ``bench`` parser; ``parents`` hold the options every
    kvreuse command takes (``--debug``)."""
    commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser("serve", help="run a workload against a running OpenAI-compatible server",
                                parents=parents)
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", required=True, help="the model name the server serves")
    serve.add_argument("--tokenizer", default=None,
                       help="tokenizer folder the prompts are built with (default: --model, if a folder)")
    serve.add_argument("--reset-prefix-cache", action="store_true",
                       help="POST /reset_prefix_cache first (kvreuse, vLLM) so an earlier run's prompts do not hit")
    add_workload_arguments(serve)
    add_client_arguments(serve)

    compare = commands.add_parser("compare", help="kvreuse with caching on / off, transformers (and llama-server), "
                                  "same workload",
                                  parents=parents)
    compare.add_argument("--model", default=None, help="model folder (default: the --preset folder, made once)")
    compare.add_argument("--preset", default="smollm2-135m", help="model preset when --model is not given")
    compare.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    compare.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (all systems use it)")
    compare.add_argument("--kv-cache-memory", default="1GiB", help="kvreuse's KV pool")
    compare.add_argument("--systems", default="kvreuse,kvreuse-no-cache,transformers",
                         help="comma-separated, run in this order: kvreuse, kvreuse-no-cache, transformers, "
                              "llama-server (needs --llama-server and --gguf)")
    compare.add_argument("--llama-server", default=None,
                         help="llama.cpp's llama-server binary (../shared/tools/llama_cpp_peer.sh prints it)")
    compare.add_argument("--gguf", default=None, help="a GGUF of the same model, for --llama-server")
    compare.add_argument("--llama-ctx-size", type=int, default=32768,
                         help="llama-server's KV buffer in tokens (-c), shared by its slots "
                              "(one per --max-concurrency)")
    compare.add_argument("--llama-cache-ram", type=int, default=4096, help="llama-server's host prompt cache (MiB)")
    compare.add_argument("--warmup-requests", type=int, default=2,
                         help="short unrelated requests sent to each server before timing")
    compare.add_argument("--startup-timeout", type=positive_float, default=900.0)
    compare.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    add_workload_arguments(compare)
    add_client_arguments(compare)


def run_bench(args: argparse.Namespace) -> int:
    """Run ``kvreuse bench serve`` or ``kvreuse bench compare``; returns the exit status."""
    try:
        if args.bench_command == "serve":
            return run_serve(args)
        if args.bench_command == "compare":
            from kvreuse.bench.compare import run_compare

            return run_compare(args)
    except ValueError as error:  # bad options: one clear line, no traceback
        print(f"kvreuse bench {args.bench_command}: error: {error}", file=sys.stderr)
        return 2
    print(f"kvreuse bench: unknown command {args.bench_command!r}", file=sys.stderr)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    from kvreuse.bench.report import format_table, run_document, summarize, write_json

    tokenizer = load_tokenizer(args.tokenizer or args.model)
    workload = build_workload(args, tokenizer)
    config = client_config(args, args.base_url, args.model)
    print(f"workload: {workload.describe()}", flush=True)
    if args.reset_prefix_cache:
        _reset_prefix_cache(config)
    run = LoadClient(config, tokenizer).run(workload.requests)
    summary = summarize(run)
    title = f"{workload.name} against {args.base_url}"
    print(format_table(summary, title))
    _warn_about_reporting(run)
    if args.out:
        document = run_document(run, summary, config_dict(config, args), workload_dict(workload))
        write_json(args.out, document)
        print(f"wrote {args.out}")
    if args.plot:
        from kvreuse.bench.plot import plot_run

        plot_run(run.results, summary, f"{title}\n{workload.describe()}", args.plot)
        print(f"wrote {args.plot}")
    return 0 if summary.completed else 1


def _reset_prefix_cache(config: ClientConfig) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    response = httpx.post(config.base_url.rstrip("/") + "/reset_prefix_cache", headers=headers, timeout=60)
    if response.status_code != 200:
        raise ValueError(f"POST /reset_prefix_cache answered {response.status_code}: the server cannot reset "
                         "its prefix cache this way; restart it instead")


def _warn_about_reporting(run: BenchmarkRun) -> None:
    ok = [result for result in run.results if result.success]
    if ok and not any(result.cached_tokens_reported for result in ok):
        print("note: the server reported no usage.prompt_tokens_details.cached_tokens; cached tokens count as 0")
    ideal = [result for result in ok if result.ideal_cached_tokens is not None]
    served = sum(result.cached_tokens for result in ideal)
    if ideal and served > 1.01 * sum(result.ideal_cached_tokens or 0 for result in ideal) + 16:
        print("note: the server served more cached tokens than this run could have shared: its cache held these "
              "prompts from an earlier run (use --reset-prefix-cache, a fresh server or another --seed)")
    at_end = sum(1 for result in ok if result.output_arrived_at_end)
    if at_end:
        print(f"note: {at_end} streams showed nothing until their end, so their TTFT is their whole latency: "
              "the server sends no chunk for tokens without text (a random-weight model whose config "
              "vocabulary is larger than its tokenizer's does that); vLLM sends a chunk per token")
    if ok and not all(result.usage_reported for result in ok):
        print("note: some streams carried no usage chunk; their output tokens are counted from content events")
