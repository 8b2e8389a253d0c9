"""The ``kvreuse`` command: mounts the sub-commands and runs the one named.

Each sub-command lives in its own module and exposes two functions, one adding its options to a
parser and one running it; this module imports them, never the other way round (the options they
share live in kvreuse.engine_args). Every sub-command takes ``--debug``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvreuse.engine_args import add_engine_arguments, configure_logging


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from kvreuse.server.serve import add_server_arguments

    add_engine_arguments(parser)
    add_server_arguments(parser)


def _run_serve(args: argparse.Namespace) -> int:
    from kvreuse.server.serve import run_server

    return run_server(args)


def _commands() -> list[Command]:
    from kvreuse.batch import add_run_arguments, run_command
    from kvreuse.demo import add_demo_arguments, run_demo
    from kvreuse.models.make import add_make_model_arguments, run_make_model
    from kvreuse.observatory.diagnose import add_diagnose_arguments, run_diagnose
    from kvreuse.router.cli import add_route_arguments, run_route
    from kvreuse.spec.distill import add_distill_arguments, run_distill

    return [
        Command("demo", "requests sharing a long system prompt: cold vs warm TTFT", add_demo_arguments, run_demo),
        Command("make-model", "write a random-weight model folder with a real tokenizer",
                add_make_model_arguments, run_make_model),
        Command("serve", "OpenAI-compatible HTTP server (FastAPI on uvicorn)", _add_serve_arguments, _run_serve),
        Command("run", "run a batch file of requests (system prompt cache format)", add_run_arguments, run_command),
        Command("route", "prefix-aware router in front of several servers", add_route_arguments, run_route),
        Command("distill-eagle", "train an EAGLE draft head for a model folder (CPU, minutes)",
                add_distill_arguments, run_distill),
        Command("diagnose", "why a log of prompts would miss the prefix cache: drift diagnostics, offline",
                add_diagnose_arguments, run_diagnose),
    ]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    from kvreuse.bench.cli import add_bench_arguments, run_bench

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="log every cache decision (the same as KVREUSE_LOG=debug)")
    parser = argparse.ArgumentParser(prog="kvreuse", description="kvreuse: an LLM inference engine that reuses "
                                     "the attention KV cache across requests")
    subparsers = parser.add_subparsers(dest="command", required=True)
    commands = {command.name: command for command in _commands()}
    for command in commands.values():
        command.add_arguments(subparsers.add_parser(command.name, help=command.help, parents=[common]))
    bench = subparsers.add_parser("bench", help="benchmark suite: prefix-sharing workloads, reports and plots")
    add_bench_arguments(bench, parents=[common])
    commands["bench"] = Command("bench", "", lambda parser: None, run_bench)
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.debug)
    try:
        return commands[args.command].run(args)
    except ValueError as error:  # bad options or input: one clear line, no traceback
        print(f"kvreuse {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
