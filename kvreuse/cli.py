"""The ``kvreuse`` command: ``demo``, ``make-model`` and ``serve`` (``run``, ``route`` and ``bench``
arrive with the batch runner, router and benchmark issues)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvreuse.config import SCHEDULING_POLICIES


def configure_logging(debug: bool = False) -> None:
    level_name = "DEBUG" if debug else os.environ.get("KVREUSE_LOG", "INFO").upper()
    level = getattr(logging, level_name, logging.INFO)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("kvreuse").setLevel(level)


def add_engine_arguments(parser: argparse.ArgumentParser, default_model: str | None = None) -> None:
    """Engine options shared by every command that loads a model (names as vLLM's)."""
    parser.add_argument("--model", default=default_model, required=default_model is None,
                        help="model folder or hub id")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV pool size, e.g. 2GiB or 512MiB")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--scheduling-policy", default="lpm", choices=list(SCHEDULING_POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-pinned-fraction", type=float, default=0.5,
                        help="share of the KV pool that pins may hold; over it the least recently used pin is demoted")
    parser.add_argument("--debug", action="store_true", help="log every cache decision")


def llm_from_args(args: argparse.Namespace):
    from kvreuse.llm import LLM

    return LLM(
        args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, load_format=args.load_format,
        enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy, seed=args.seed, max_pinned_fraction=args.max_pinned_fraction,
        served_model_name=getattr(args, "served_model_name", None),
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make-model":
        from kvreuse.models.make import main_make_model

        return main_make_model(argv[1:])
    parser = argparse.ArgumentParser(prog="kvreuse", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("make-model", help="write a random-weight model folder with a real tokenizer")
    demo = commands.add_parser("demo", help="requests sharing a long system prompt: cold vs warm TTFT")
    add_engine_arguments(demo, default_model="")
    demo.add_argument("--preset", default="smollm2-135m", help="model made on first use when --model is not given")
    demo.add_argument("--num-requests", type=int, default=8)
    demo.add_argument("--max-tokens", type=int, default=16)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI on uvicorn)")
    add_engine_arguments(serve)
    from kvreuse.server.serve import add_server_arguments

    add_server_arguments(serve)
    from kvreuse.batch import add_run_parser

    add_run_parser(commands, add_engine_arguments)
    from kvreuse.router import add_route_parser

    add_route_parser(commands)
    from kvreuse.bench.cli import add_bench_parser

    add_bench_parser(commands)
    args = parser.parse_args(argv)
    configure_logging(args.debug)
    if args.command == "serve":
        from kvreuse.server.serve import run_server

        try:
            return run_server(args)
        except ValueError as error:  # bad options: one clear line, no traceback
            print(f"kvreuse serve: error: {error}", file=sys.stderr)
            return 2
    if args.command == "bench":
        from kvreuse.bench.cli import run_bench

        return run_bench(args)
    if args.command == "route":
        from kvreuse.router import run_route

        return run_route(args)
    if args.command == "run":
        from kvreuse.batch import run_command

        return run_command(args)
    if args.command == "demo":
        from kvreuse.demo import run_demo

        try:
            return run_demo(args)
        except ValueError as error:  # bad options or input: one clear line, no traceback
            print(f"kvreuse demo: error: {error}", file=sys.stderr)
            return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
