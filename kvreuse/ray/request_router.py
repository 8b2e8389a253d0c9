"""kvreuse's routing policy as a Ray Serve request router: each request goes to the engine replica that holds
most of its prompt's KV blocks, within the load guards.

Ray Serve builds one `KVReuseRequestRouter` per deployment handle (in the ingress replica's process) and
asks `choose_replicas` for each request. The decision is kvreuse.router.policy's `Router`, the code
``kvreuse route`` runs: a block-key index per replica, cost = queued prefill tokens + weighted uncached
tokens, and the guards that spill a hot prefix to another replica. What feeds it:

- the prompt's block keys, from the `RoutingHints` the ingress put in the request (its tokens, salt,
  model), keyed in each replica's namespace (model, adapter digest, draft digest, block size: the
  replica's ``record_replica_metadata``);
- the replicas' KV events, as they happen: every engine replica publishes vLLM-format events on its own
  ZMQ socket (named in its metadata) and a `KVEventFollower` thread here subscribes to each, so blocks a
  replica stores or evicts reach the index within milliseconds, without any call on the routing path
  (Ray's ``record_routing_stats`` poll, ~1-10 s, carries only KV usage and queue length);
- its own accounting of requests in flight (``on_request_routed`` / ``on_request_completed``).

A replica that leaves (dies, is scaled down) leaves the index and the follower at once (`update_replicas`,
`on_replica_actor_died`); a replacement is a new replica id with an empty index. A follower that misses
events it cannot replay reports a resync and the replica's entries are dropped (kvreuse/router/
kv_event_subscriber.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from kvreuse.ray.http_bridge import HTTPEnvelope, RoutingHints
from kvreuse.router.kv_event_subscriber import KVEventFollower, KVEventSource
from kvreuse.router.policy import BackendLoad, PolicyConfig, Router, RouteRequest
from kvreuse.router.prompts import Namespace, route_request

logger = logging.getLogger("kvreuse.ray")

DEFAULT_CAPACITY_BLOCKS = 4096  # a replica whose metadata names no KV pool size
MAX_DECISIONS = 100_000


@dataclass
class ReplicaView:
    """What the router knows of one engine replica."""

    name: str
    model: str | None = None
    draft: str | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # served name -> digest
    block_size: int | None = None
    load: BackendLoad = field(default_factory=BackendLoad)
    followed: bool = False

    def namespace(self, model: str | None) -> Namespace:
        digest = self.adapters.get(model) if model is not None else None
        if digest is not None:
            return Namespace(self.model, digest, self.draft)
        return Namespace(model or self.model, None, self.draft)


@dataclass
class _Routed:
    replica: str
    route: RouteRequest
    uncached_tokens: int


class KVReuseRequestRouter(RequestRouter):
    """``RequestRouterConfig(request_router_class=KVReuseRequestRouter, request_router_kwargs={...})``; the
    kwargs are kvreuse.router.policy.PolicyConfig's fields (``policy``, ``max_load_ratio``, ...)."""

    def initialize_state(self, **policy_kwargs: Any) -> None:
        self._policy_kwargs = dict(policy_kwargs)
        self._router: Router | None = None  # built once a replica's metadata gives the block size
        self._views: dict[str, ReplicaView] = {}
        self._follower: KVEventFollower | None = None
        # internal request id -> the decision for it, until the request completes; requests cancelled before
        # Ray routed them never complete, so the oldest entries go beyond MAX_DECISIONS.
        self._decisions: OrderedDict[str, _Routed] = OrderedDict()
        self.decision_counts: dict[str, int] = {}
        PolicyConfig(**self._policy_kwargs)  # a bad field fails the deployment here, naming it

    # Replicas come and go --------------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {replica.replica_id.unique_id for replica in replicas}
        for name in [name for name in self._views if name not in current]:
            self._forget(name, "left the deployment")

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id, "died")

    def _forget(self, name: str, why: str) -> None:
        self._views.pop(name, None)
        if self._follower is not None:
            self._follower.unfollow(name)
        if self._router is not None:
            dropped = self._router.backend_failed(name)
            logger.info("replica %s %s: %d index entries dropped", name, why, dropped)

    def _view(self, replica: RunningReplica) -> ReplicaView:
        name = replica.replica_id.unique_id
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = ReplicaView(name)
        if not view.followed:
            self._adopt(view, replica.replica_metadata)
        stats = replica.routing_stats or {}
        view.load.kv_usage = float(stats.get("kv_usage", 0.0))
        view.load.num_waiting = int(stats.get("num_waiting", 0))
        adapters = stats.get("adapters")
        if isinstance(adapters, dict):  # adapters loaded over HTTP after the replica started
            view.adapters = {str(k): str(v) for k, v in adapters.items()}
        return view

    def _adopt(self, view: ReplicaView, metadata: dict[str, Any]) -> None:
        """Read a replica's metadata (published once it is ready) and follow its KV events."""
        if not metadata:
            return
        view.model, view.draft = metadata.get("model"), metadata.get("draft_digest")
        view.adapters = dict(metadata.get("adapters") or {})
        view.block_size = metadata.get("block_size")
        if self._router is None and isinstance(view.block_size, int):
            self._router = Router(PolicyConfig(**{"block_size": view.block_size, **self._policy_kwargs}))
        if self._router is None:
            return
        self._router.index.add_backend(view.name, int(metadata.get("num_blocks") or DEFAULT_CAPACITY_BLOCKS))
        events = metadata.get("kv_events")
        if isinstance(events, dict) and events.get("endpoint"):
            if self._follower is None:
                self._follower = KVEventFollower()
            self._follower.follow(KVEventSource(view.name, events["endpoint"], events.get("replay_endpoint"),
                                                events.get("topic", "")))
        view.followed = True

    def _apply_events(self) -> None:
        if self._follower is None or self._router is None:
            return
        index = self._router.index
        for update in self._follower.drain():
            if update.source not in self._views:
                continue  # a replica that already left
            if update.kind == "stored":
                index.record(update.source, update.keys)
            elif update.kind == "removed":
                for key in update.keys:
                    index.remove(update.source, key)
            elif update.kind == "state_stored":  # a hybrid replica's states (cache/events.py)
                self._router.record_state(update.source, update.keys)
            elif update.kind == "state_removed":
                for key in update.keys:
                    index.remove_state(update.source, key)
            else:  # cleared, resync: what the index held for it may be wrong
                index.drop_backend(update.source)

    # Routing ------------------------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        views = {replica.replica_id.unique_id: (replica, self._view(replica)) for replica in candidate_replicas}
        self._apply_events()
        if pending_request is not None:
            # Ray re-asks after the ranks below were all full; it waits (backs off) before asking again.
            pending_request.routing_context.should_backoff = True
        hints = _hints_of(pending_request)
        router = self._router
        if router is None or hints is None:
            order = sorted(views, key=lambda name: views[name][1].load.in_flight)
            return [[views[name][0] for name in order]]
        namespaces = {name: view.namespace(hints.model) for name, (_, view) in views.items() if view.followed}
        if not namespaces:
            return [[replica for replica, _ in views.values()]]
        route = route_request(hints.prompt, hints.cache_salt, hints.session_id, namespaces,
                              router.config.block_size)
        loads = {name: views[name][1].load for name in namespaces}
        decision = router.choose(route, loads, time.monotonic())
        self.decision_counts[decision.reason] = self.decision_counts.get(decision.reason, 0) + 1
        if pending_request is not None:
            self._decisions[pending_request.metadata.internal_request_id] = _Routed(decision.backend, route,
                                                                                   decision.uncached_tokens)
            while len(self._decisions) > MAX_DECISIONS:
                self._decisions.popitem(last=False)
        chosen = views[decision.backend][0]
        # The choice first; if it is full (max_ongoing_requests), the rest by the same cost.
        others = [replica for name, (replica, _) in views.items() if name != decision.backend]
        return [[chosen], others] if others else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        routed = self._decisions.get(request_id)
        view = self._views.get(replica_id.unique_id)
        if routed is None or view is None or self._router is None:
            self._decisions.pop(request_id, None)
            return
        if routed.replica != replica_id.unique_id:  # Ray took another rank: the chosen one was full
            routed = _Routed(replica_id.unique_id, routed.route,
                             self._router.uncached_tokens(routed.route, replica_id.unique_id))
            self._decisions[request_id] = routed
        self._router.record_sent(routed.replica, routed.route)
        view.load.in_flight += 1
        view.load.queued_prefill_tokens += routed.uncached_tokens

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._decisions.pop(internal_request_id, None)
        view = self._views.get(replica_id.unique_id)
        if routed is None or view is None or self._router is None or routed.replica != replica_id.unique_id:
            return
        self._router.record_finished(routed.replica, routed.route)
        view.load.in_flight = max(0, view.load.in_flight - 1)
        view.load.queued_prefill_tokens = max(0, view.load.queued_prefill_tokens - routed.uncached_tokens)


def _hints_of(pending_request: PendingRequest | None) -> RoutingHints | None:
    if pending_request is None or not pending_request.args:
        return None
    envelope = pending_request.args[0]
    return envelope.hints if isinstance(envelope, HTTPEnvelope) else None
