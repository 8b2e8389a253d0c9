"""Routing policy of ``kvreuse route``: a prefix index over the backends, a cost model and load guards.

Pure Python, no HTTP and no clock of its own (``now`` is passed in), so every decision can be
tested exactly. The index holds, per backend, the chained block keys (kvreuse.cache.hashing, the
same keys the engines compute) of the prompts the router sent there, in an LRU bounded by that
backend's KV capacity in blocks: the router's belief of what each backend has cached. A prompt's keys
are per backend where the backends' namespaces differ (`RouteRequest.keys_for`): a backend with a
speculative draft keys every block with the draft's digest too.

Backends that share a remote KV tier (the same Redis database and model fingerprint, from their
/v1/models card's ``kv_remote``) form a remote group: every block one of them computes is written to
the remote, so the router keeps a second index per group (`Router.remote_index`, an LRU of
``remote_capacity_blocks``). A backend's cost counts the blocks it holds itself as free, the run of
blocks after them that its group's remote holds as ``remote_hit_cost_weight`` of a miss (loading
them is cheaper than computing, dearer than a device hit) and the rest as misses. A backend that
fails loses its own index entries, never its group's: the remote still holds what it wrote.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvreuse.cache.hashing import extend_block_keys, namespace_key

POLICIES = ("cache-aware", "round-robin", "least-loaded", "session")


def prompt_block_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                      adapter: str | None = None, model: str | None = None, draft: str | None = None) -> list[bytes]:
    """Chained keys of every full block of ``token_ids`` in the namespace (cache_salt, adapter, model,
    draft): the engine's own functions, so the keys are the ones its KV events carry. ``draft`` is the
    speculative draft's digest of a backend that runs one (its /v1/models card's ``draft_digest``)."""
    keys: list[bytes] = []
    extend_block_keys(keys, namespace_key(cache_salt, adapter, model, draft), token_ids, block_size)
    return keys


class BackendBlockIndex:
    """Block key -> backends believed to hold it; each backend's share is an LRU of ``capacity`` blocks.

    A backend that runs a hybrid model (issue 66: recurrent layers, whose past is one state per sequence) reuses a
    prefix only from a state snapshot on it: its blocks without a state there are recomputed. For such a backend the
    index also keeps the blocks whose nodes anchor a snapshot (its ``state_stored`` / ``state_removed`` events, and
    the end of each prompt the router sends it, where the server keeps one), and credits a prompt only with the
    blocks up to the deepest of those on its path."""

    def __init__(self) -> None:
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}
        self._capacity: dict[str, int] = {}
        self._states: dict[str, set[bytes]] = {}  # the hybrid backends: their blocks that anchor a state

    def add_backend(self, backend: str, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks of {backend} must be >= 1, got {capacity_blocks}")
        self._blocks.setdefault(backend, OrderedDict())
        self._capacity[backend] = capacity_blocks
        self._evict(backend)

    def capacity(self, backend: str) -> int:
        return self._capacity[backend]

    def has_backend(self, backend: str) -> bool:
        return backend in self._capacity

    def num_blocks(self, backend: str) -> int:
        return len(self._blocks.get(backend, ()))

    def record(self, backend: str, keys: Sequence[bytes]) -> None:
        """The backend computed (or reused) these blocks: they become its most recently used."""
        blocks = self._blocks[backend]
        for key in keys:  # head first, so the tail of a chain is the most recent and the head outlives it
            blocks[key] = None
            blocks.move_to_end(key)
        self._evict(backend)

    def remove(self, backend: str, key: bytes) -> None:
        """The backend evicted this block (a KV event): requests stop matching at it (its states went with it)."""
        blocks = self._blocks.get(backend)
        if blocks is not None:
            blocks.pop(key, None)
        self._states.get(backend, set()).discard(key)

    def set_recurrent(self, backend: str) -> None:
        """The backend runs a hybrid model (its model card says so, or it sent a state event): credit it only up to
        the states it keeps."""
        self._states.setdefault(backend, set())

    def is_recurrent(self, backend: str) -> bool:
        return backend in self._states

    def record_state(self, backend: str, keys: Sequence[bytes]) -> None:
        """These blocks' nodes anchor a state snapshot on the backend (a ``state_stored`` event)."""
        self._states.setdefault(backend, set()).update(keys)

    def remove_state(self, backend: str, key: bytes) -> None:
        """The block's node anchors no state any more (a ``state_removed`` event); the block stays."""
        self._states.get(backend, set()).discard(key)

    def matched_blocks(self, backend: str, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` the backend is believed to reuse: those it holds (chains: stop at the
        first miss), and on a hybrid backend only up to the deepest one that anchors a state."""
        blocks = self._blocks.get(backend)
        if not blocks:
            return 0
        states = self._states.get(backend)
        count = reusable = 0
        for key in keys:
            if key not in blocks:
                break
            count += 1
            if states is not None and key in states:
                reusable = count
        return count if states is None else reusable

    def drop_backend(self, backend: str) -> int:
        """Forget everything the backend held (it failed or restarted); returns how many entries went."""
        blocks = self._blocks.get(backend)
        if blocks is None:
            return 0
        dropped = len(blocks)
        blocks.clear()
        if backend in self._states:
            self._states[backend].clear()
        return dropped

    def _evict(self, backend: str) -> None:
        blocks, states = self._blocks[backend], self._states.get(backend)
        while len(blocks) > self._capacity[backend]:
            key, _ = blocks.popitem(last=False)
            if states is not None:
                states.discard(key)


@dataclass
class BackendLoad:
    """What the router knows of one backend's load (its own accounting plus the last /metrics scrape)."""

    healthy: bool = True
    in_flight: int = 0  # requests sent there and not finished
    queued_prefill_tokens: int = 0  # uncached prompt tokens of requests whose first byte has not come back
    num_decoding: int = 0  # requests streaming their output
    kv_usage: float = 0.0  # kvreuse:kv_cache_usage_perc, 0..1
    num_waiting: int = 0  # kvreuse:num_requests_waiting


@dataclass(frozen=True)
class PolicyConfig:
    policy: str = "cache-aware"
    block_size: int = 16
    # A backend above this multiple of the mean in-flight load is skipped for this request ...
    max_load_ratio: float = 1.25
    # ... once it has at least this many requests in flight (else one request on an idle fleet trips it).
    min_in_flight_for_guard: int = 2
    max_kv_usage: float = 0.9
    # Decode cost of one streaming request, in prompt-token equivalents of prefill work.
    decode_cost_tokens: float = 64.0
    # Uncached tokens count this many times in the cost: the request waits for them like for queued
    # work, and on top of that they put a second copy of the prefix into the fleet's KV and lengthen
    # the queue of every later request on that backend. With 1, a request whose prefix is still being
    # prefilled on backend A goes to an idle backend B and computes the whole prefix again.
    miss_cost_weight: float = 2.0
    # A token a backend loads from the remote KV tier its group shares costs this fraction of a miss
    # (0: as free as a device hit; 1: as dear as computing it).
    remote_hit_cost_weight: float = 0.25
    # Blocks the router remembers per remote group (an LRU; the remote itself may hold more or fewer).
    remote_capacity_blocks: int = 1 << 18
    session_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.max_load_ratio >= 1.0:
            raise ValueError(f"max_load_ratio must be >= 1.0, got {self.max_load_ratio}")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage must be in (0, 1], got {self.max_kv_usage}")
        if self.min_in_flight_for_guard < 0:
            raise ValueError(f"min_in_flight_for_guard must be >= 0, got {self.min_in_flight_for_guard}")
        if not self.miss_cost_weight >= 1.0:
            raise ValueError(f"miss_cost_weight must be >= 1.0, got {self.miss_cost_weight}")
        if not 0.0 <= self.remote_hit_cost_weight <= 1.0:
            raise ValueError(f"remote_hit_cost_weight must be in [0, 1], got {self.remote_hit_cost_weight}")
        if self.remote_capacity_blocks < 1:
            raise ValueError(f"remote_capacity_blocks must be >= 1, got {self.remote_capacity_blocks}")
        if self.decode_cost_tokens < 0:
            raise ValueError(f"decode_cost_tokens must be >= 0, got {self.decode_cost_tokens}")
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")


@dataclass(frozen=True)
class RouteRequest:
    block_keys: tuple[bytes, ...]
    num_prompt_tokens: int
    session_id: str | None = None
    # The keys of backends that key this prompt in another namespace than ``block_keys`` (another
    # speculative draft, other adapter weights under the same name); empty when all key it alike.
    backend_keys: Mapping[str, tuple[bytes, ...]] = field(default_factory=dict, hash=False)

    def keys_for(self, backend: str) -> tuple[bytes, ...]:
        """The block keys of this prompt on ``backend``: the ones its engine computes."""
        return self.backend_keys.get(backend, self.block_keys)


@dataclass(frozen=True)
class RouteDecision:
    backend: str
    matched_blocks: int  # leading blocks the backend holds itself
    uncached_tokens: int  # prompt tokens it must compute (neither held nor in its remote group)
    # "cache", "remote" (part of the prompt comes from the remote tier the backend shares), "session",
    # "spill" (a guard skipped a better backend), "round-robin", "least-loaded", "fallback"
    reason: str
    remote_blocks: int = 0  # blocks after ``matched_blocks`` the backend's remote group holds


@dataclass
class _Session:
    backend: str
    expires_at: float


@dataclass
class Router:
    """Chooses a backend per request; ``loads`` is read, never written, here (the proxy keeps it)."""

    config: PolicyConfig
    index: BackendBlockIndex = field(default_factory=BackendBlockIndex)
    _sessions: dict[str, _Session] = field(default_factory=dict)
    _round_robin: itertools.count = field(default_factory=itertools.count)
    # backend -> block key -> requests in flight there whose prompt holds that block
    _in_flight_blocks: dict[str, Counter[bytes]] = field(default_factory=dict)
    # Remote groups: group id -> the blocks its backends wrote there (keyed like BackendBlockIndex's
    # backends); backend -> its group.
    remote_index: BackendBlockIndex = field(default_factory=BackendBlockIndex)
    _remote_groups: dict[str, str] = field(default_factory=dict)

    def set_remote_group(self, backend: str, group: str | None) -> None:
        """``backend`` shares the remote KV tier ``group`` (its card's url digest and fingerprint), or
        none. The group's index outlives its members: the remote keeps what they wrote."""
        if group is None:
            self._remote_groups.pop(backend, None)
            return
        self._remote_groups[backend] = group
        if not self.remote_index.has_backend(group):
            self.remote_index.add_backend(group, self.config.remote_capacity_blocks)
        if self.index.is_recurrent(backend):
            self.remote_index.set_recurrent(group)

    def remote_group(self, backend: str) -> str | None:
        return self._remote_groups.get(backend)

    def set_recurrent(self, backend: str) -> None:
        """``backend`` runs a hybrid model (its card says so): it, and the remote group it shares, reuse a prefix only
        up to a state snapshot they hold."""
        self.index.set_recurrent(backend)
        group = self._remote_groups.get(backend)
        if group is not None:
            self.remote_index.set_recurrent(group)

    def record_state(self, backend: str, keys: Sequence[bytes]) -> None:
        """These blocks anchor a state ``backend`` kept (a ``state_stored`` event, or where a prompt sent there
        ends). Its engine writes each kept state through to its remote tiers (server.md's KV tiers), so its remote
        group holds the state too, and keeps it when the device pool drops it."""
        self.index.record_state(backend, keys)
        group = self._remote_groups.get(backend)
        if group is not None and keys:
            self.remote_index.record_state(group, keys)

    def record_remote(self, backend: str, keys: Sequence[bytes]) -> None:
        """``backend`` computed these blocks (a KV event): its remote group holds them now too."""
        group = self._remote_groups.get(backend)
        if group is not None and keys:
            self.remote_index.record(group, keys)

    def choose(self, request: RouteRequest, loads: Mapping[str, BackendLoad], now: float,
               exclude: Iterable[str] = ()) -> RouteDecision:
        """The backend for ``request``; ``exclude`` holds backends that already failed it."""
        excluded = set(exclude)
        healthy = [name for name, load in loads.items() if load.healthy and name not in excluded]
        if not healthy:
            raise LookupError("no healthy backend")
        policy = self.config.policy
        if policy == "round-robin":
            return self._decision(request, healthy[next(self._round_robin) % len(healthy)], "round-robin")
        if policy == "least-loaded":
            name = min(healthy, key=lambda n: (loads[n].in_flight, self._cost(request, n, loads[n]), n))
            return self._decision(request, name, "least-loaded")
        allowed = self._guarded(request, healthy, loads)
        if policy == "session" and request.session_id is not None:
            session = self._sessions.get(request.session_id)
            if session is not None and session.expires_at > now and session.backend in allowed:
                session.expires_at = now + self.config.session_ttl_s
                return self._decision(request, session.backend, "session")
        candidates = allowed or healthy  # every backend guarded: the cheapest one still serves
        # Ties (nothing cached anywhere) go to the least loaded, then to the emptiest index (new
        # prefixes spread over the fleet's KV), then rotate.
        turn = next(self._round_robin)
        order = {name: (i - turn) % len(healthy) for i, name in enumerate(healthy)}
        name = min(candidates, key=lambda n: (self._cost(request, n, loads[n]), loads[n].in_flight,
                                              self.index.num_blocks(n), order[n]))
        best_anywhere = max(self.index.matched_blocks(n, request.keys_for(n)) for n in healthy)
        reason = "fallback" if not allowed else "cache"
        if allowed and self._remote_blocks(request, name) > 0:
            reason = "remote"
        elif allowed and self.index.matched_blocks(name, request.keys_for(name)) < best_anywhere:
            reason = "spill"
        if policy == "session" and request.session_id is not None:
            self._sessions[request.session_id] = _Session(name, now + self.config.session_ttl_s)
        return self._decision(request, name, reason)

    def record_sent(self, backend: str, request: RouteRequest) -> None:
        """The request went to ``backend``: its prompt blocks will be cached there; it is in flight until
        ``record_finished``."""
        keys = request.keys_for(backend)
        self.index.record(backend, keys)
        if keys and self.index.is_recurrent(backend):  # a hybrid server keeps a state where the prompt ends
            self.record_state(backend, keys[-1:])
        self.record_remote(backend, keys)  # its engine writes each computed block through to the remote
        self._in_flight_blocks.setdefault(backend, Counter()).update(keys)

    def record_finished(self, backend: str, request: RouteRequest) -> None:
        """A request ``record_sent`` to ``backend`` finished, failed or was cancelled."""
        counts = self._in_flight_blocks.get(backend)
        if counts is not None:
            keys = request.keys_for(backend)
            counts.subtract(keys)
            for key in keys:
                if counts[key] <= 0:
                    del counts[key]

    def in_flight_sharing(self, backend: str, request: RouteRequest) -> int:
        """Requests in flight on ``backend`` that share the part of this prompt it is believed to hold."""
        return self._sharing(backend, request, self.index.matched_blocks(backend, request.keys_for(backend)))

    def _sharing(self, backend: str, request: RouteRequest, matched: int) -> int:
        if matched == 0:
            return 0
        return self._in_flight_blocks.get(backend, Counter())[request.keys_for(backend)[matched - 1]]

    def backend_failed(self, backend: str) -> int:
        """Drop the backend's index entries and sessions; returns the index entries dropped."""
        for session_id in [s for s, session in self._sessions.items() if session.backend == backend]:
            del self._sessions[session_id]
        return self.index.drop_backend(backend)

    def expire_sessions(self, now: float) -> None:
        for session_id in [s for s, session in self._sessions.items() if session.expires_at <= now]:
            del self._sessions[session_id]

    def session_backend(self, session_id: str, now: float) -> str | None:
        session = self._sessions.get(session_id)
        return session.backend if session is not None and session.expires_at > now else None

    def _guarded(self, request: RouteRequest, healthy: list[str], loads: Mapping[str, BackendLoad]) -> list[str]:
        """Backends that pass this request's guards: not far above the mean load because of this
        request's prefix, KV not nearly full."""
        config = self.config
        mean_in_flight = sum(loads[name].in_flight for name in healthy) / len(healthy)
        allowed = []
        for name in healthy:
            load = loads[name]
            overloaded = (load.in_flight >= config.min_in_flight_for_guard
                          and load.in_flight > config.max_load_ratio * mean_in_flight)
            matched = self.index.matched_blocks(name, request.keys_for(name)) if overloaded else 0
            if matched:
                # A hit there: skip the backend only when the requests sharing this hit are by
                # themselves above the limit, i.e. the prefix is hot and moving this request moves that
                # excess. Above the mean for unrelated reasons (two warm groups' requests arriving
                # together), it keeps the hit: spilling would compute the prefix a second time to
                # even out a momentary imbalance.
                overloaded = self._sharing(name, request, matched) >= config.max_load_ratio * mean_in_flight
            if overloaded or load.kv_usage > self.config.max_kv_usage:
                continue
            allowed.append(name)
        return allowed

    def _cost(self, request: RouteRequest, name: str, load: BackendLoad) -> float:
        """Queued prefill work, plus this prompt's misses (weighted) and remote hits (a fraction of a
        miss), plus the decoding requests; tokens the backend holds itself cost nothing."""
        config = self.config
        uncached, remote = self._split(request, name)
        return (load.queued_prefill_tokens
                + config.miss_cost_weight * (uncached + config.remote_hit_cost_weight * remote)
                + config.decode_cost_tokens * load.num_decoding)

    def _remote_blocks(self, request: RouteRequest, name: str) -> int:
        """Blocks right after what ``name`` holds that its remote group holds (the engine looks the
        tiers up after its device match, for a contiguous run); for a hybrid group, only up to the deepest
        block there that anchors a state its members wrote (the engine resumes from that state)."""
        group = self._remote_groups.get(name)
        if group is None:
            return 0
        keys = request.keys_for(name)
        matched = self.index.matched_blocks(name, keys)
        return self.remote_index.matched_blocks(group, keys[matched:])

    def _split(self, request: RouteRequest, name: str) -> tuple[int, int]:
        """(uncached tokens, tokens from the remote tier) of ``request`` on ``name``."""
        block_size = self.config.block_size
        prompt = request.num_prompt_tokens
        held = min(self.index.matched_blocks(name, request.keys_for(name)) * block_size, prompt)
        reused = min(held + self._remote_blocks(request, name) * block_size, prompt)
        return prompt - reused, reused - held

    def uncached_tokens(self, request: RouteRequest, name: str) -> int:
        """Prompt tokens ``name`` would compute for ``request`` (neither held nor in its remote group)."""
        return self._split(request, name)[0]

    def _decision(self, request: RouteRequest, name: str, reason: str) -> RouteDecision:
        matched = self.index.matched_blocks(name, request.keys_for(name))
        return RouteDecision(name, matched, self.uncached_tokens(request, name), reason,
                             self._remote_blocks(request, name))
