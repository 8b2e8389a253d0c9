"""``kvreuse route``: options and the entry point (mounted by kvreuse.cli with ``add_route_arguments``)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvreuse.router.policy import POLICIES, PolicyConfig

logger = logging.getLogger("kvreuse.router")


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a kvreuse (or any OpenAI-compatible) server; repeat for several")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--policy", default="cache-aware", choices=list(POLICIES))
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder of the served model: the router then computes the engines' "
                             "block keys (without it, it hashes characters)")
    parser.add_argument("--block-size", type=int, default=16, help="the engines' KV block size")
    parser.add_argument("--backend-capacity-blocks", type=int, default=4096,
                        help="KV blocks per backend, bounding the router's index of it when the backend "
                             "does not report its own")
    parser.add_argument("--max-load-ratio", type=float, default=1.25,
                        help="skip a backend above this multiple of the mean in-flight load")
    parser.add_argument("--min-in-flight-for-guard", type=int, default=2,
                        help="the load guard applies to backends with at least this many requests in flight")
    parser.add_argument("--max-kv-usage", type=float, default=0.9, help="skip a backend above this KV usage (0..1)")
    parser.add_argument("--decode-cost-tokens", type=float, default=64.0,
                        help="cost of one decoding request, in prompt tokens of prefill work")
    parser.add_argument("--miss-cost-weight", type=float, default=2.0,
                        help="weight of the uncached tokens in a backend's cost against its queued prefill "
                             "work (>= 1; higher keeps a prefix on fewer backends)")
    parser.add_argument("--remote-hit-cost-weight", type=float, default=0.25,
                        help="cost of a prompt token a backend loads from the remote KV tier it shares with "
                             "others (same kv_remote in /v1/models), as a fraction of a miss (0..1)")
    parser.add_argument("--remote-capacity-blocks", type=int, default=1 << 18,
                        help="blocks the router remembers per shared remote KV tier (LRU)")
    parser.add_argument("--session-ttl", type=float, default=600.0, help="seconds a session stays sticky")
    parser.add_argument("--max-retries", type=int, default=2,
                        help="retries on another backend before the first byte (connection error, 429, 502-504)")
    parser.add_argument("--retry-backoff", type=float, default=0.05,
                        help="seconds before the first retry, doubled for the next")
    parser.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                        help="follow each backend's stored / removed block events (GET /v1/cache/events) so "
                             "the index holds what the backend holds; without them it is the router's guess")
    parser.add_argument("--backend-api-key", default=None,
                        help="key for the router's own calls to the backends (model card, KV events); when the "
                             "backends use keys it must be one of their --admin-key keys (the KV event log "
                             "holds every tenant's block keys)")
    parser.add_argument("--isolate-tenants", action="store_true",
                        help="the backends run with --isolate-tenants: key each request's prefix with its API "
                             "key's tenant, as they do, so one tenant's cached prefix never draws another's requests")
    parser.add_argument("--probe-interval", type=float, default=1.0, help="seconds between health probes")
    parser.add_argument("--access-log", action="store_true")


def run_route(args: argparse.Namespace) -> int:
    """Serve the router until SIGINT / SIGTERM; returns the exit status (2 on bad options)."""
    import uvicorn

    from kvreuse.router.app import RouterConfig, RouterState, build_router_app
    from kvreuse.server.serve import CleanExitServer

    try:
        policy = PolicyConfig(policy=args.policy, block_size=args.block_size, max_load_ratio=args.max_load_ratio,
                              min_in_flight_for_guard=args.min_in_flight_for_guard, max_kv_usage=args.max_kv_usage,
                              decode_cost_tokens=args.decode_cost_tokens,
                              miss_cost_weight=args.miss_cost_weight,
                              remote_hit_cost_weight=args.remote_hit_cost_weight,
                              remote_capacity_blocks=args.remote_capacity_blocks, session_ttl_s=args.session_ttl)
        config = RouterConfig(backends=tuple(args.backend), policy=policy, tokenizer=args.tokenizer,
                              default_capacity_blocks=args.backend_capacity_blocks, max_retries=args.max_retries,
                              retry_backoff_s=args.retry_backoff,
                              probe_interval_s=args.probe_interval, kv_events=args.kv_events,
                              backend_api_key=args.backend_api_key, isolate_tenants=args.isolate_tenants)
        state = RouterState(config)
    except ValueError as error:
        print(f"kvreuse route: error: {error}", file=sys.stderr)
        return 2
    app = build_router_app(state)
    server = CleanExitServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                            access_log=args.access_log, timeout_keep_alive=30))
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvreuse route", description="prefix-aware router over kvreuse servers")
    add_route_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="log every routing decision")
    args = parser.parse_args(argv)
    from kvreuse.engine_args import configure_logging

    configure_logging(args.debug)
    return run_route(args)
