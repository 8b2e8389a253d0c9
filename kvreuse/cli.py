"""The ``kvreuse`` command: mounts the sub-commands and runs the one named.

Each sub-command lives in its own module and exposes two functions, one adding its options to a
parser and one running it; this module imports them, never the other way round (the options they
share live in kvreuse.engine_args), and only the one named on the command line, so the router,
``diagnose`` and ``--help`` start without importing torch. Every sub-command takes ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from kvreuse.engine_args import add_engine_arguments, configure_logging


@dataclass(frozen=True)
class Command:
    """A sub-command whose options and code live in ``module``, imported only when this command is the one
    parsed or run: most sub-commands need torch (two seconds to import), the router and diagnose do not."""

    name: str
    help: str
    module: str
    add_arguments_name: str  # (parser) -> None
    run_name: str  # (args) -> exit status

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        getattr(importlib.import_module(self.module), self.add_arguments_name)(parser)

    def run(self, args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(self.module), self.run_name)(args)


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from kvreuse.ray.options import add_ray_arguments
    from kvreuse.server.serve import add_server_arguments

    add_engine_arguments(parser)
    add_server_arguments(parser)
    add_ray_arguments(parser)


def _run_serve(args: argparse.Namespace) -> int:
    if args.ray_address is not None:
        try:
            from kvreuse.ray.builder import run_on_ray
        except ModuleNotFoundError as error:
            if error.name is None or not error.name.startswith("ray"):
                raise
            raise ValueError('--ray-address needs Ray Serve: pip install -e ".[ray]"') from None
        return run_on_ray(args)
    from kvreuse.server.serve import run_server

    return run_server(args)


COMMANDS = (
    Command("demo", "requests sharing a long system prompt: cold vs warm TTFT", "kvreuse.demo",
            "add_demo_arguments", "run_demo"),
    Command("make-model", "write a random-weight model folder with a real tokenizer", "kvreuse.model_tools.make_model",
            "add_make_model_arguments", "run_make_model"),
    Command("serve", "OpenAI-compatible HTTP server (FastAPI on uvicorn)", __name__, "_add_serve_arguments",
            "_run_serve"),
    Command("run", "run a batch file of requests (system prompt cache format)", "kvreuse.batch",
            "add_run_arguments", "run_command"),
    Command("route", "prefix-aware router in front of several servers", "kvreuse.router.cli",
            "add_route_arguments", "run_route"),
    Command("distill-eagle", "train an EAGLE draft head for a model folder (CPU, minutes)", "kvreuse.model_tools.distill",
            "add_distill_arguments", "run_distill"),
    Command("diagnose", "why a log of prompts would miss the prefix cache: drift diagnostics, offline",
            "kvreuse.observatory.diagnose", "add_diagnose_arguments", "run_diagnose"),
)


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    """The ``kvreuse`` parser. With ``only``, just that sub-command gets its options (the others are listed
    by name): what main does, so ``kvreuse route`` or ``kvreuse --help`` never import torch."""
    from kvreuse.bench.cli import (
        add_bench_arguments,  # torch-free, and its nested sub-commands need `common`
    )

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="log every cache decision (the same as KVREUSE_LOG=debug)")
    parser = argparse.ArgumentParser(prog="kvreuse", description="kvreuse: an LLM inference engine that reuses "
                                     "the attention KV cache across requests")
    subparsers = parser.add_subparsers(dest="command", required=True)
    commands = {command.name: command for command in COMMANDS}
    for command in commands.values():
        subparser = subparsers.add_parser(command.name, help=command.help, parents=[common])
        if only is None or only == command.name:
            command.add_arguments(subparser)
    bench = subparsers.add_parser("bench", help="benchmark suite: prefix-sharing workloads, reports and plots")
    add_bench_arguments(bench, parents=[common])
    # Its options are added just above (bench serve / bench compare under it); only run is looked up.
    commands["bench"] = Command("bench", "", "kvreuse.bench.cli", "add_bench_arguments", "run_bench")
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser, commands = build_parser(only=words[0] if words else "")
    args = parser.parse_args(words)
    configure_logging(args.debug)
    try:
        return commands[args.command].run(args)
    except ValueError as error:  # bad options or input: one clear line, no traceback
        print(f"kvreuse {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
