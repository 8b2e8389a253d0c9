"""kvreuse on Ray Serve: engine replicas behind one OpenAI/Anthropic-compatible ingress, routed by their cache.

``kvreuse serve --ray-address ADDR --num-replicas N`` deploys it from the command line; a Ray Serve config
file names ``kvreuse.ray:app`` with ``kvreuse serve``'s options as its ``args`` (kvreuse/ray/options.py).
Modules: ``options`` (the options, no Ray import), ``http_bridge`` (a request crossing a Ray handle),
``deployments`` (the ingress and the engine replica), ``request_router`` (kvreuse's policy as a Ray Serve
request router, fed by the replicas' KV events), ``builder`` (the application, and the command). Needs
``pip install -e ".[ray]"``.
"""

from __future__ import annotations

from typing import Any


def app(args: dict[str, Any]) -> Any:
    """The Ray Serve application builder a config file's ``import_path: kvreuse.ray:app`` names."""
    from kvreuse.ray.builder import app_from_args

    return app_from_args(args)
