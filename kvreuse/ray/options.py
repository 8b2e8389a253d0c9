"""The options of a kvreuse deployment on Ray Serve: ``kvreuse serve``'s own, plus the Ray Serve ones.

Two ways in, one result (an `argparse.Namespace` of ``kvreuse serve``'s options and a `RayServeOptions`):
``kvreuse serve --ray-address ADDR --num-replicas N ...`` parses them from the command line, and a Ray
Serve config file naming ``kvreuse.ray:app`` passes them as ``args``, a mapping whose keys are the same
options spelled with underscores (``model``, ``max_model_len``, ``api_key: [k1, k2]``,
``enable_prefix_caching: false``, ``kv_events_config: {...}``) next to the Ray ones (``num_replicas``,
``autoscaling_config``, ...). Both go through the same argparse parser, so a config file gets the same
checks and errors as the command line. No Ray import here: ``kvreuse serve --help`` stays light.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvreuse.config import reject_unknown_fields
from kvreuse.engine_args import add_engine_arguments
from kvreuse.server.serve import add_server_arguments

REQUEST_ROUTERS = ("kvreuse", "pow2")
# Ray Serve's proxy locations kvreuse offers (its ProxyLocation names). Ray's own default is EveryNode; kvreuse's
# is HeadOnly: the one entry --host / --port names. Proxies of several nodes on one machine share the port
# through SO_REUSEPORT, so the kernel hands each connection to any of them, and one still starting (or
# stopping after its node's last replica left) answers 404 for every route.
PROXY_LOCATIONS = ("HeadOnly", "EveryNode")


@dataclass(frozen=True)
class RayServeOptions:
    """How the engine replicas are deployed; Ray Serve's own names where it has one."""

    num_replicas: int | str | None = 1  # an int, or "auto" (Ray Serve's autoscaling defaults)
    autoscaling_config: dict[str, Any] | None = None  # Ray Serve's, passed through (replaces num_replicas)
    ray_actor_options: dict[str, Any] | None = None  # e.g. {"num_cpus": 1, "resources": {"node_a": 1}}
    max_ongoing_requests: int = 64
    max_replicas_per_node: int | None = None
    request_router: str = "kvreuse"  # "kvreuse" (prefix-aware) or "pow2" (Ray Serve's default)
    routing_policy: dict[str, Any] = field(default_factory=dict)  # kvreuse.router.policy.PolicyConfig fields
    request_routing_stats_period_s: float = 1.0  # how often replicas report KV usage and queue length
    max_attempts: int = 3  # tries per request while no replica has sent a byte
    app_name: str = "kvreuse"
    route_prefix: str = "/"

    def __post_init__(self) -> None:
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"request_router must be one of {list(REQUEST_ROUTERS)}, got {self.request_router!r}")
        if not (self.num_replicas is None or self.num_replicas == "auto"
                or (isinstance(self.num_replicas, int) and self.num_replicas >= 1)):
            raise ValueError(f"num_replicas must be a positive integer or 'auto', got {self.num_replicas!r}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if not 1 <= self.max_attempts <= 10:
            raise ValueError(f"max_attempts must be in 1..10, got {self.max_attempts}")
        if not self.request_routing_stats_period_s > 0:
            raise ValueError(f"request_routing_stats_period_s must be > 0, got {self.request_routing_stats_period_s}")
        for name in ("autoscaling_config", "ray_actor_options", "routing_policy"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvreuse serve``'s Ray Serve options (all inert without --ray-address)."""
    group = parser.add_argument_group("Ray Serve (with --ray-address; needs pip install -e \".[ray]\")")
    group.add_argument("--ray-address", default=None,
                       help="deploy on this Ray cluster ('auto', or HOST:PORT of its head) instead of serving here: "
                            "--num-replicas engine replicas behind one ingress on --host / --port")
    group.add_argument("--num-replicas", default="1", help="engine replicas (an integer, or 'auto' for Ray Serve's "
                                                             "autoscaling)")
    group.add_argument("--ray-request-router", choices=REQUEST_ROUTERS, default="kvreuse",
                       help="kvreuse: route by cached prefix (this project's policy); pow2: Ray Serve's default "
                            "(power of two choices)")
    group.add_argument("--ray-actor-options", default=None, metavar="JSON",
                       help="Ray Serve ray_actor_options of each engine replica, e.g. '{\"num_cpus\": 1}'")
    group.add_argument("--autoscaling-config", default=None, metavar="JSON", help="Ray Serve autoscaling_config")
    group.add_argument("--max-replicas-per-node", type=int, default=None)
    group.add_argument("--max-ongoing-requests", type=int, default=64,
                       help="requests one replica takes at once (Ray Serve's limit; more wait in the router)")
    group.add_argument("--ray-proxy-location", choices=PROXY_LOCATIONS, default="HeadOnly",
                       help="where Ray Serve runs its HTTP proxies (set when Serve first starts on the cluster): "
                            "HeadOnly, one entry on the head node at --host / --port (default); EveryNode, one on "
                            "every node with a replica, each on --port (for a load balancer in front)")


def serve_parser() -> argparse.ArgumentParser:
    """``kvreuse serve``'s engine and server options, raising argparse's errors as ValueError."""
    parser = _RaisingParser(prog="kvreuse.ray:app", add_help=False)
    add_engine_arguments(parser)
    add_server_arguments(parser)
    return parser


def ray_options_from_namespace(args: argparse.Namespace) -> RayServeOptions:
    num_replicas: int | str = args.num_replicas
    if num_replicas != "auto":
        try:
            num_replicas = int(num_replicas)
        except ValueError:
            raise ValueError(f"num_replicas must be a positive integer or 'auto', got {num_replicas!r}") from None
    return RayServeOptions(
        num_replicas=None if args.autoscaling_config else num_replicas,
        autoscaling_config=_json_object(args.autoscaling_config, "autoscaling_config"),
        ray_actor_options=_json_object(args.ray_actor_options, "ray_actor_options"),
        max_ongoing_requests=args.max_ongoing_requests, max_replicas_per_node=args.max_replicas_per_node,
        request_router=args.ray_request_router)


def options_from_mapping(raw: Mapping[str, Any]) -> tuple[argparse.Namespace, RayServeOptions]:
    """A Ray Serve config file's ``args``: ``kvreuse serve`` options by their underscore names, and the
    `RayServeOptions` fields. An unknown key is refused, naming it."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"kvreuse.ray:app args must be a mapping of options, got {type(raw).__name__}")
    ray_names = {f.name for f in fields(RayServeOptions)}
    parser = serve_parser()
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    reject_unknown_fields(raw, (*ray_names, *actions), "kvreuse.ray:app args")
    argv: list[str] = []
    for name, value in raw.items():
        if name in ray_names:
            continue
        argv.extend(_option_argv(parser, name, value))
    args = parser.parse_args(argv)
    ray_options = RayServeOptions(**{name: value for name, value in raw.items() if name in ray_names})
    return args, ray_options


def _option_argv(parser: argparse.ArgumentParser, dest: str, value: Any) -> list[str]:
    """``value`` for the option whose dest is ``dest``, as command-line words."""
    candidates = [action for action in parser._actions if action.dest == dest and action.option_strings]
    if isinstance(value, bool):
        flag = next((a for a in candidates if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
                     and a.const is value), None)
        if flag is None:
            if all(a.default is value for a in candidates):
                return []
            raise ValueError(f"{dest} takes a value, not {value}")
        return [flag.option_strings[0]]
    if value is None:
        return []
    option = candidates[0].option_strings[0]
    if isinstance(value, (dict, list)) and dest in ("kv_events_config", "speculative_config"):
        return [option, json.dumps(value)]
    if isinstance(value, list):
        return [word for item in value for word in (option, str(item))]
    if isinstance(value, dict):
        return [option, json.dumps(value)]
    return [option, str(value)]


_PATH_OPTIONS = ("model", "tokenizer", "api_keys_file", "admin_keys_file", "warm_prompts", "kv_disk_dir")


def with_absolute_paths(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every relative path that exists here made absolute: Ray starts the replicas in
    folders of its own (on other nodes too), where ``./model`` means nothing. A relative path that does
    not exist here is left as it is (a hub id, or a path that only the nodes have)."""
    def absolute(path: str) -> str:
        return os.path.abspath(path) if not os.path.isabs(path) and os.path.exists(path) else path

    changes: dict[str, Any] = {name: absolute(getattr(args, name)) for name in _PATH_OPTIONS
                               if isinstance(getattr(args, name, None), str)}
    if args.served_model_name is None:
        changes["served_model_name"] = args.model  # the name clients send stays the one typed, as on one server
    if args.lora_dir:
        changes["lora_dir"] = [absolute(path) for path in args.lora_dir]
    if args.lora_modules:
        changes["lora_modules"] = [f"{name}={absolute(path)}" if sep else spec for spec in args.lora_modules
                                   for name, sep, path in [spec.partition("=")]]
    if args.speculative_config:
        try:
            speculative = json.loads(args.speculative_config)
        except json.JSONDecodeError:
            speculative = None  # the replica's own parse names the error
        if isinstance(speculative, dict) and isinstance(speculative.get("model"), str):
            changes["speculative_config"] = json.dumps({**speculative, "model": absolute(speculative["model"])})
    return argparse.Namespace(**{**vars(args), **changes})


def _json_object(text: str | None, name: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)
