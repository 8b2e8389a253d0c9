"""Options shared by ``kvreuse bench serve`` and ``kvreuse bench compare``: the workload, the client,
the tokenizer the prompts are built with, and their JSON descriptions in a report.

Both commands (kvreuse/bench/cli.py and kvreuse/bench/compare.py) import from here, so neither
imports the other's module for its options.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvreuse.bench.client import ENDPOINTS, PROMPT_FORMATS, ClientConfig
from kvreuse.bench.workloads import (
    WORKLOAD_NAMES,
    AgentOptions,
    HotPrefixOptions,
    MultiTurnOptions,
    RagOptions,
    RandomOptions,
    SharedPrefixOptions,
    TextTokenizer,
    Workload,
    WorkloadOptions,
    generate_workload,
)


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """--workload and every workload's options (names as SGLang's for shared-prefix)."""
    parser.add_argument("--workload", required=True, choices=WORKLOAD_NAMES)
    parser.add_argument("--num-requests", type=int, default=None,
                        help="rag / random / hot-prefix: how many requests; shared-prefix / multi-turn / agent: "
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
    add_agent_arguments(parser.add_argument_group(
        "agent (N agents x T turns of tool calls over a shared tool list; chat endpoint)"))


def add_agent_arguments(group: Any) -> None:
    """The agent workload's options (``kvreuse bench`` and benchmarks/bench_agent.py)."""
    agent = AgentOptions()
    group.add_argument("--agent-num-agents", type=int, default=agent.num_agents)
    group.add_argument("--agent-num-turns", type=int, default=agent.num_turns)
    group.add_argument("--agent-tools-len", type=int, default=agent.tools_len,
                       help="tokens of tool definitions (as compact JSON)")
    group.add_argument("--agent-result-len", type=int, default=agent.result_len, help="tokens of each tool result")
    group.add_argument("--agent-output-len", type=int, default=agent.output_len,
                       help="max_tokens of each turn (a forced tool call ends well within it)")
    group.add_argument("--agent-system-prompt-len", type=int, default=agent.system_prompt_len)
    group.add_argument("--agent-task-len", type=int, default=agent.task_len, help="tokens of each agent's first task")
    group.add_argument("--agent-num-tool-sets", type=int, default=agent.num_tool_sets,
                       help="distinct tool lists, agents spread over them (1: one list shared by all)")
    group.add_argument("--agent-no-tools", action="store_true",
                       help="send no tools: the tool list goes into the system prompt and replies are text "
                            "(a baseline for servers without tool calling)")


def agent_options(args: argparse.Namespace) -> AgentOptions:
    return AgentOptions(args.agent_num_agents, args.agent_num_turns, args.agent_tools_len, args.agent_result_len,
                        args.agent_output_len, args.agent_system_prompt_len, args.agent_task_len,
                        args.agent_num_tool_sets, args.agent_no_tools)


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
    if name == "agent":
        return agent_options(args)
    raise ValueError(f"workload must be one of {list(WORKLOAD_NAMES)}, got {name!r}")


# KVREUSE_BENCH_SMOKE=1 (the test suite runs every documented benchmark command this way): the same
# commands and code paths with at most this many requests; the figures then mean nothing.
SMOKE_NUM_REQUESTS = 4


def smoke_mode() -> bool:
    return os.environ.get("KVREUSE_BENCH_SMOKE") == "1"


def build_workload(args: argparse.Namespace, tokenizer: TextTokenizer) -> Workload:
    if smoke_mode():
        print(f"KVREUSE_BENCH_SMOKE=1: smoke run with at most {SMOKE_NUM_REQUESTS} requests; the figures mean "
              "nothing", flush=True)
        args.num_requests = min(args.num_requests or SMOKE_NUM_REQUESTS, SMOKE_NUM_REQUESTS)
    return generate_workload(args.workload, tokenizer, workload_options(args), args.seed, args.num_requests)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="completions", choices=list(ENDPOINTS),
                        help="completions (token-exact prompts, the default) or chat")
    parser.add_argument("--prompt-format", default="text", choices=list(PROMPT_FORMATS),
                        help="text (portable) or ids (token ids as the /v1/completions prompt)")
    parser.add_argument("--request-rate", type=positive_float, default=math.inf,
                        help="Poisson arrivals at this many requests/s (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send vLLM's ignore_eos (for servers that reject it); output lengths may vary")
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per request")
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


def load_tokenizer(path: str) -> TextTokenizer:
    from kvreuse.tokenizer import Tokenizer

    if Path(path).suffix.lower() == ".gguf" and Path(path).is_file():
        from kvreuse.loading.loader import (
            resolve_tokenizer_path,  # torch: only for a GGUF file's tokenizer
        )

        return Tokenizer(resolve_tokenizer_path(path))
    if not Path(path).is_dir():
        raise ValueError(f"tokenizer must be a local folder with the model's tokenizer files or a GGUF file, "
                         f"got {path!r}")
    return Tokenizer(path)


def config_dict(config: ClientConfig, args: argparse.Namespace) -> dict[str, Any]:
    settings = asdict(config)
    settings.pop("api_key", None)
    settings["request_rate"] = None if math.isinf(config.request_rate) else config.request_rate
    settings["command"] = " ".join(sys.argv)
    return settings


def workload_dict(workload: Workload) -> dict[str, Any]:
    return {"name": workload.name, "seed": workload.seed, "options": workload.options,
            "num_requests": len(workload.requests)}
