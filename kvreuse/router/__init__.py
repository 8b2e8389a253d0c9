"""Prefix-aware router over several kvreuse servers (``kvreuse route``): policy, backends, HTTP proxy."""

from kvreuse.router.cli import add_route_arguments, run_route
from kvreuse.router.policy import (
                                   BackendBlockIndex,
                                   BackendLoad,
                                   PolicyConfig,
                                   RouteDecision,
                                   Router,
                                   RouteRequest,
)

__all__ = ["BackendBlockIndex", "BackendLoad", "PolicyConfig", "RouteDecision", "RouteRequest", "Router",
           "add_route_arguments", "run_route"]
