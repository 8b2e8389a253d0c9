"""``kvreuse bench serve`` and ``kvreuse bench compare``: argument parsing and the two runs.

``serve`` drives one running OpenAI-compatible server; ``compare`` starts kvreuse (prefix caching
on, then off) and the transformers reference in turn on a free loopback port and runs the same
workload against each. ``kvreuse.cli`` mounts these with ``add_bench_parser`` / ``run_bench``;
``python -m kvreuse.bench`` runs them directly.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvreuse.bench.client import ENDPOINTS, PROMPT_FORMATS, BenchmarkRun, ClientConfig, LoadClient
from kvreuse.bench.workloads import (
    WORKLOAD_NAMES, HotPrefixOptions, MultiTurnOptions, RagOptions, RandomOptions, SharedPrefixOptions,
    TextTokenizer, Workload, WorkloadOptions, generate_workload,
)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """--workload and every workload's options (names as SGLang's for shared-prefix)."""
    parser.add_argument("--workload", required=True, choices=WORKLOAD_NAMES)
    parser.add_argument("--num-requests", type=int, default=None,
                        help="rag / random / hot-prefix: how many requests; shared-prefix / multi-turn: "
                             "send only the first N of the (shuffled) workload")
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload and the Poisson arrivals")
    gsp, mt, rag, rnd, hot = (SharedPrefixOptions(), MultiTurnOptions(), RagOptions(), RandomOptions(),
                              HotPrefixOptions())
    group = parser.add_argument_group("shared-prefix (G groups x P prompts, as SGLang's generated-shared-prefix)")
    group.add_argument("--gsp-num-groups", type=int, default=gsp.num_groups)
    group.add_argument("--gsp-prompts-per-group", type=int, default=gsp.prompts_per_group)
    group.add_argument("--gsp-system-prompt-len", type=int, default=gsp.system_prompt_len)
    group.add_argument("--gsp-question-len", type=int, default=gsp.question_len)
    group.add_argument("--gsp-output-len", type=int, default=gsp.output_len)
    group = parser.add_argument_group("multi-turn (C conversations x T turns)")
    group.add_argument("--mt-num-conversations", type=int, default=mt.num_conversations)
    group.add_argument("--mt-num-turns", type=int, default=mt.num_turns)
    group.add_argument("--mt-system-prompt-len", type=int, default=mt.system_prompt_len,
                       help="a system prompt every conversation starts with (0: none)")
    group.add_argument("--mt-user-len", type=int, default=mt.user_len)
    group.add_argument("--mt-output-len", type=int, default=mt.output_len)
    group = parser.add_argument_group("rag (k of D chunks per request, Zipf-skewed)")
    group.add_argument("--rag-num-chunks", type=int, default=rag.num_chunks)
    group.add_argument("--rag-chunk-len", type=int, default=rag.chunk_len)
    group.add_argument("--rag-top-k", type=int, default=rag.top_k)
    group.add_argument("--rag-zipf-a", type=float, default=rag.zipf_a)
    group.add_argument("--rag-question-len", type=int, default=rag.question_len)
    group.add_argument("--rag-output-len", type=int, default=rag.output_len)
    group.add_argument("--rag-system-prompt-len", type=int, default=rag.system_prompt_len,
                       help="shared instructions before the chunks (0: none)")
    group = parser.add_argument_group("random (no sharing: the control)")
    group.add_argument("--random-input-len", type=int, default=rnd.input_len)
    group.add_argument("--random-output-len", type=int, default=rnd.output_len)
    group = parser.add_argument_group("hot-prefix (one prefix takes most of the traffic)")
    group.add_argument("--hot-fraction", type=float, default=hot.hot_fraction)
    group.add_argument("--hot-num-cold-prefixes", type=int, default=hot.num_cold_prefixes)
    group.add_argument("--hot-prefix-len", type=int, default=hot.prefix_len)
    group.add_argument("--hot-question-len", type=int, default=hot.question_len)
    group.add_argument("--hot-output-len", type=int, default=hot.output_len)


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    name = args.workload
    if name == "shared-prefix":
        return SharedPrefixOptions(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                                   args.gsp_question_len, args.gsp_output_len)
    if name == "multi-turn":
        return MultiTurnOptions(args.mt_num_conversations, args.mt_num_turns, args.mt_system_prompt_len,
                                args.mt_user_len, args.mt_output_len)
    if name == "rag":
        return RagOptions(args.rag_num_chunks, args.rag_chunk_len, args.rag_top_k, args.rag_zipf_a,
                          args.rag_question_len, args.rag_output_len, args.rag_system_prompt_len,
                          args.num_requests or RagOptions.num_requests)
    if name == "random":
        return RandomOptions(args.random_input_len, args.random_output_len,
                             args.num_requests or RandomOptions.num_requests)
    if name == "hot-prefix":
        return HotPrefixOptions(args.hot_num_cold_prefixes, args.hot_fraction, args.hot_prefix_len,
                                args.hot_question_len, args.hot_output_len,
                                args.num_requests or HotPrefixOptions.num_requests)
    raise ValueError(f"workload must be one of {list(WORKLOAD_NAMES)}, got {name!r}")


def build_workload(args: argparse.Namespace, tokenizer: TextTokenizer) -> Workload:
    return generate_workload(args.workload, tokenizer, workload_options(args), args.seed, args.num_requests)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="completions", choices=list(ENDPOINTS),
                        help="completions (token-exact prompts, the default) or chat")
    parser.add_argument("--prompt-format", default="text", choices=list(PROMPT_FORMATS),
                        help="text (portable) or ids (token ids as the /v1/completions prompt)")
    parser.add_argument("--request-rate", type=_positive_float, default=math.inf,
                        help="Poisson arrivals at this many requests/s (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send vLLM's ignore_eos (for servers that reject it); output lengths may vary")
    parser.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds per request")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--out", default=None, help="JSON with the summary and every request")
    parser.add_argument("--plot", default=None, help="PNG with the TTFT distribution and hit rate")


def client_config(args: argparse.Namespace, base_url: str, model: str) -> ClientConfig:
    return ClientConfig(
        base_url=base_url, model=model, endpoint=args.endpoint, prompt_format=args.prompt_format,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
        ignore_eos=args.ignore_eos, temperature=args.temperature, timeout_s=args.timeout, api_key=args.api_key,
        progress=not args.disable_tqdm,
    )


def add_bench_parser(subparsers: Any) -> None:
    """Add ``bench`` (with ``serve`` and ``compare``) to ``kvreuse``'s subcommands."""
    bench = subparsers.add_parser("bench", help="benchmark suite: prefix-sharing workloads, reports and plots",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser("serve", help="run a workload against a running OpenAI-compatible server")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", required=True, help="the model name the server serves")
    serve.add_argument("--tokenizer", default=None,
                       help="tokenizer folder the prompts are built with (default: --model, if a folder)")
    serve.add_argument("--reset-prefix-cache", action="store_true",
                       help="POST /reset_prefix_cache first (kvreuse, vLLM) so an earlier run's prompts do not hit")
    add_workload_arguments(serve)
    add_client_arguments(serve)

    compare = commands.add_parser("compare", help="kvreuse with caching on / off and transformers, same workload")
    compare.add_argument("--model", default=None, help="model folder (default: the --preset folder, made once)")
    compare.add_argument("--preset", default="smollm2-135m", help="model preset when --model is not given")
    compare.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    compare.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (all systems use it)")
    compare.add_argument("--kv-cache-memory", default="1GiB", help="kvreuse's KV pool")
    compare.add_argument("--systems", default="kvreuse,kvreuse-no-cache,transformers",
                         help="comma-separated, run in this order: kvreuse, kvreuse-no-cache, transformers")
    compare.add_argument("--warmup-requests", type=int, default=2,
                         help="short unrelated requests sent to each server before timing")
    compare.add_argument("--startup-timeout", type=_positive_float, default=900.0)
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


def load_tokenizer(path: str) -> TextTokenizer:
    from kvreuse.tokenizer import Tokenizer

    if not Path(path).is_dir():
        raise ValueError(f"tokenizer must be a local folder with the model's tokenizer files, got {path!r}")
    return Tokenizer(path)


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
        document = run_document(run, summary, _config_dict(config, args), _workload_dict(workload))
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


def _config_dict(config: ClientConfig, args: argparse.Namespace) -> dict[str, Any]:
    settings = asdict(config)
    settings.pop("api_key", None)
    settings["request_rate"] = None if math.isinf(config.request_rate) else config.request_rate
    settings["command"] = " ".join(sys.argv)
    return settings


def _workload_dict(workload: Workload) -> dict[str, Any]:
    return {"name": workload.name, "seed": workload.seed, "options": workload.options,
            "num_requests": len(workload.requests)}


def main(argv: list[str] | None = None) -> int:
    """``python -m kvreuse.bench serve|compare ...``."""
    parser = argparse.ArgumentParser(prog="kvreuse")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    raw = list(sys.argv[1:] if argv is None else argv)
    # Accept both "python -m kvreuse.bench serve ..." and "python -m kvreuse.bench bench serve ...".
    if raw and raw[0] != "bench" and not raw[0].startswith("-"):
        raw = ["bench", *raw]
    args = parser.parse_args(raw)
    return run_bench(args)
