"""The kvreuse Ray Serve application, and ``kvreuse serve --ray-address`` which deploys it.

`build_application` binds the two deployments of kvreuse/ray/deployments.py: the engine replicas (Ray
Serve's ``num_replicas`` / ``autoscaling_config`` / ``ray_actor_options`` / ``max_replicas_per_node`` and
its health checks, replica restarts and placement as for any deployment), with kvreuse's request router
or Ray Serve's default, behind one ingress on Ray Serve's HTTP proxy.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig
from ray.serve.schema import ProxyStatus

from kvreuse.ray.deployments import EngineReplica, Ingress
from kvreuse.ray.options import (
    RayServeOptions,
    options_from_mapping,
    ray_options_from_namespace,
    with_absolute_paths,
)
from kvreuse.ray.request_router import KVReuseRequestRouter
from kvreuse.router.policy import PolicyConfig

logger = logging.getLogger("kvreuse.ray")

ENGINE_DEPLOYMENT = "kvreuse-engine"
INGRESS_DEPLOYMENT = "kvreuse-ingress"


def build_application(args: argparse.Namespace, options: RayServeOptions) -> Any:
    """The bound application (a Ray Serve ``Application``) for ``kvreuse serve``'s options ``args``."""
    args = with_absolute_paths(args)
    if options.request_router == "kvreuse":
        PolicyConfig(**options.routing_policy)  # a bad field is named here, before anything is deployed
        router_config = RequestRouterConfig(request_router_class=KVReuseRequestRouter,
                                            request_router_kwargs=dict(options.routing_policy),
                                            request_routing_stats_period_s=options.request_routing_stats_period_s)
    else:
        router_config = RequestRouterConfig(request_routing_stats_period_s=options.request_routing_stats_period_s)
    engine_options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT, "max_ongoing_requests": options.max_ongoing_requests,
        "request_router_config": router_config, "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
    }
    if options.autoscaling_config is not None:
        engine_options["autoscaling_config"] = options.autoscaling_config
    else:
        engine_options["num_replicas"] = options.num_replicas
    if options.ray_actor_options is not None:
        engine_options["ray_actor_options"] = options.ray_actor_options
    if options.max_replicas_per_node is not None:
        engine_options["max_replicas_per_node"] = options.max_replicas_per_node
    engine = serve.deployment(EngineReplica).options(**engine_options).bind(args)
    ingress = serve.deployment(Ingress).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0}).bind(engine, args, options.max_attempts)
    return ingress


def app_from_args(raw: dict[str, Any]) -> Any:
    """``kvreuse.ray:app``: the application from a config file's ``args``."""
    args, options = options_from_mapping(raw)
    return build_application(args, options)


def _check_proxy_address(host: str, port: int) -> None:
    """Serve's HTTP proxy is set up once per cluster: a later ``serve.start`` keeps the first one's address
    (and only logs it). Say so instead of printing an address nothing listens on."""
    from ray.serve.context import (
        _get_global_client,  # no public reader of the running proxy's options
    )

    http = _get_global_client().http_config
    if (http.host, http.port) != (host, port):
        raise ValueError(f"host/port: Ray Serve already runs on this cluster with its HTTP proxy on "
                         f"{http.host}:{http.port}; pass --host {http.host} --port {http.port}, or shut Serve down "
                         f"first (serve shutdown)")


def _check_no_application(name: str) -> None:
    """A second ``serve.run`` under a running application's name replaces it without a word, under the first
    deployment's feet (its ``kvreuse serve`` still says it serves, then deletes the other's application when
    it stops). Refuse instead."""
    running = serve.status().applications
    if name in running:
        raise ValueError(f"Ray Serve already runs an application named {name!r} on this cluster "
                         f"({running[name].status}); stop the kvreuse serve that deployed it (or `serve delete "
                         f"{name}`) first")


def start_serve(proxy_location: str, host: str, port: int, proxy_deadline_s: float = 300.0) -> None:
    """``serve.start``, surviving a proxy that Serve restarts while it starts. Serve's controller gives a new HTTP
    proxy 5 s to report ready (``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``) and replaces a slower one (a loaded or
    small machine: the proxy imports Serve and uvicorn in a fresh worker); ``serve.start`` waited on the first and
    fails with its death (``ActorDiedError``), though the controller is up and the next proxy starting. Connect to
    that controller again, then wait until every proxy is healthy before saying where it serves."""
    options = HTTPOptions(host=host, port=port)
    try:
        serve.start(proxy_location=proxy_location, http_options=options)
        return
    except ray.exceptions.ActorDiedError as exc:
        logger.warning("Ray Serve replaced its HTTP proxy while starting (%s); waiting for the new one",
                       str(exc).splitlines()[0])
    serve.start(proxy_location=proxy_location, http_options=options)  # the running controller's client
    deadline = time.monotonic() + proxy_deadline_s
    while True:
        proxies = serve.status().proxies
        if proxies and all(status == ProxyStatus.HEALTHY for status in proxies.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray Serve's HTTP proxies are not healthy after {proxy_deadline_s:.0f} s: "
                               f"{ {node: str(status) for node, status in proxies.items()} }")
        time.sleep(0.5)


def run_on_ray(args: argparse.Namespace) -> int:
    """``kvreuse serve --ray-address``: deploy, serve on --host / --port until SIGTERM / SIGINT, then delete
    the application (its replicas drain and stop) and exit 0. The cluster itself stays up."""
    options = ray_options_from_namespace(args)
    application = build_application(args, options)
    ray.init(address=args.ray_address, log_to_driver=False)
    start_serve(args.ray_proxy_location, args.host, args.port)
    _check_proxy_address(args.host, args.port)
    _check_no_application(options.app_name)
    serve.run(application, name=options.app_name, route_prefix=options.route_prefix, blocking=False)
    logger.info("kvreuse on Ray Serve: %s engine replica(s) of %s behind http://%s:%d (request router: %s)",
                options.num_replicas if options.autoscaling_config is None else "autoscaled", args.model, args.host,
                args.port, options.request_router)
    print(f"serving on http://{args.host}:{args.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    logger.info("stopping: deleting the application %r", options.app_name)
    serve.delete(options.app_name)
    return 0
