"""Routing policy of kvreuse.router: pure decisions, no HTTP."""

from __future__ import annotations

import pytest

from kvreuse.cache.hashing import extend_block_keys, namespace_key
from kvreuse.router.policy import (
    BackendBlockIndex,
    BackendLoad,
    PolicyConfig,
    Router,
    RouteRequest,
    prompt_block_keys,
)

BLOCK = 4


def request_for(tokens: list[int], session_id: str | None = None, salt: str | None = None) -> RouteRequest:
    return RouteRequest(tuple(prompt_block_keys(tokens, BLOCK, cache_salt=salt, model="m")), len(tokens), session_id)


def fleet(router: Router, *names: str) -> dict[str, BackendLoad]:
    for name in names:
        router.index.add_backend(name, capacity_blocks=1000)
    return {name: BackendLoad() for name in names}


def route(router: Router, loads: dict[str, BackendLoad], request: RouteRequest, now: float = 0.0):
    decision = router.choose(request, loads, now)
    router.record_sent(decision.backend, request)
    return decision


def test_block_keys_match_the_engine_hashing() -> None:
    tokens = list(range(11))
    engine_keys: list[bytes] = []
    extend_block_keys(engine_keys, namespace_key("salt", None, "m"), tokens, BLOCK)
    assert prompt_block_keys(tokens, BLOCK, cache_salt="salt", model="m") == engine_keys
    assert len(engine_keys) == 2  # the partial last block has no key
    assert prompt_block_keys(tokens, BLOCK, cache_salt="other", model="m")[0] != engine_keys[0]


def test_same_prefix_goes_to_the_same_backend() -> None:
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b", "c")
    prefix = list(range(100, 132))
    first = route(router, loads, request_for(prefix + [1, 2]))
    assert first.matched_blocks == 0
    for tail in range(5):
        decision = route(router, loads, request_for(prefix + [7, tail, 9]))
        assert decision.backend == first.backend
        assert decision.matched_blocks == len(prefix) // BLOCK
        assert decision.reason == "cache"
    other = route(router, loads, request_for(list(range(500, 532))))
    assert other.backend != first.backend  # a new prefix does not pile onto the warm backend


def test_namespaces_do_not_share_blocks() -> None:
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b")
    tokens = list(range(40))
    route(router, loads, request_for(tokens, salt="tenant-1"))
    assert router.choose(request_for(tokens, salt="tenant-2"), loads, 0.0).matched_blocks == 0


def test_load_guard_spills_a_hot_prefix() -> None:
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b", "c", "d")
    hot = list(range(64))
    first = route(router, loads, request_for(hot + [1]))
    loads[first.backend].in_flight = 1
    # One in flight: under the guard's minimum, the warm backend still wins.
    assert router.choose(request_for(hot + [2]), loads, 0.0).backend == first.backend
    loads[first.backend].in_flight = 3  # mean 0.75: 3 > 1.25 x 0.75
    spilled = route(router, loads, request_for(hot + [3]))
    assert spilled.backend != first.backend
    assert spilled.reason == "spill"
    # The second copy is now known: the next hot request goes where the hot prefix is cached and idle.
    after = router.choose(request_for(hot + [4]), loads, 0.0)
    assert after.backend == spilled.backend and after.matched_blocks == len(hot) // BLOCK


def test_load_guard_keeps_a_hit_when_other_prefixes_load_the_backend() -> None:
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b", "c", "d")
    warm, other = list(range(64)), list(range(1000, 1064))
    home = route(router, loads, request_for(warm + [1])).backend
    for i in range(4):  # a second group lives there too, and it is hot
        router.record_sent(home, request_for(other + [i]))
    for name, load in loads.items():
        load.in_flight = 5 if name == home else 1  # mean 2: over 1.25 x the mean, one of five shares `warm`
    assert router.in_flight_sharing(home, request_for(warm + [2])) == 1
    decision = router.choose(request_for(warm + [2]), loads, 0.0)
    assert decision.backend == home and decision.reason == "cache"
    # A request of the group that does load it is spilled; a cold prompt avoids it too.
    assert router.in_flight_sharing(home, request_for(other + [3])) == 4
    assert router.choose(request_for(other + [3]), loads, 0.0).backend != home
    assert router.choose(request_for(list(range(5000, 5064))), loads, 0.0).backend != home


def test_finished_requests_stop_counting_as_sharing() -> None:
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b")
    hot = list(range(32))
    requests = [request_for(hot + [i]) for i in range(3)]
    home = route(router, loads, requests[0]).backend
    for request in requests[1:]:
        router.record_sent(home, request)
    assert router.in_flight_sharing(home, requests[0]) == 3
    for request in requests:
        router.record_finished(home, request)
    assert router.in_flight_sharing(home, requests[0]) == 0
    assert router.index.matched_blocks(home, requests[0].block_keys) == len(hot) // BLOCK  # still cached
    loads[home].in_flight = 3  # load from elsewhere: the hit stays
    assert router.choose(requests[0], loads, 0.0).backend == home


def test_a_prefix_being_prefilled_draws_its_group_rather_than_an_idle_backend() -> None:
    # The first request of a group is still in prefill on its backend (its uncached tokens queued
    # there); a second one of the group waits for it there instead of computing the prefix again.
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b")
    prefix = list(range(512))
    home = route(router, loads, request_for(prefix + [1])).backend
    loads[home].in_flight, loads[home].queued_prefill_tokens = 1, 513
    assert router.choose(request_for(prefix + [2]), loads, 0.0).backend == home
    # With misses weighed like queued work, the idle backend looks (slightly) cheaper.
    plain = Router(PolicyConfig(block_size=BLOCK, miss_cost_weight=1.0), index=router.index)
    assert plain.choose(request_for(prefix + [2]), loads, 0.0).backend != home


def test_kv_usage_guard_skips_a_full_backend() -> None:
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b")
    tokens = list(range(32))
    first = route(router, loads, request_for(tokens))
    loads[first.backend].kv_usage = 0.95
    assert router.choose(request_for(tokens + [5]), loads, 0.0).backend != first.backend
    loads["a"].kv_usage = loads["b"].kv_usage = 0.95  # every backend guarded: still served
    assert router.choose(request_for(tokens), loads, 0.0).reason == "fallback"


def test_queued_prefill_work_outweighs_a_small_hit() -> None:
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b")
    tokens = list(range(8))
    first = route(router, loads, request_for(tokens))
    loads[first.backend].queued_prefill_tokens = 1000
    assert router.choose(request_for(tokens + [1, 2]), loads, 0.0).backend != first.backend


def test_index_is_an_lru_bounded_by_capacity() -> None:
    index = BackendBlockIndex()
    index.add_backend("a", capacity_blocks=4)
    old = prompt_block_keys(list(range(12)), BLOCK)  # 3 blocks
    new = prompt_block_keys(list(range(100, 112)), BLOCK)  # 3 blocks
    index.record("a", old)
    index.record("a", old[:1])  # touch the head: it outlives the older tail
    index.record("a", new)
    assert index.num_blocks("a") == 4
    assert index.matched_blocks("a", new) == 3
    assert index.matched_blocks("a", old) == 1  # only the touched head survived
    with pytest.raises(ValueError, match="capacity_blocks"):
        index.add_backend("b", capacity_blocks=0)


def test_failed_backend_loses_its_entries_and_gets_no_requests() -> None:
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b")
    tokens = list(range(40))
    first = route(router, loads, request_for(tokens))
    assert router.backend_failed(first.backend) == len(tokens) // BLOCK
    loads[first.backend].healthy = False
    decision = router.choose(request_for(tokens), loads, 0.0)
    assert decision.backend != first.backend and decision.matched_blocks == 0
    # It comes back: it rejoins, with an empty index.
    loads[first.backend].healthy = True
    assert router.index.matched_blocks(first.backend, request_for(tokens).block_keys) == 0
    assert router.choose(request_for(tokens), loads, 0.0, exclude=[decision.backend]).backend == first.backend
    loads["a"].healthy = loads["b"].healthy = False
    with pytest.raises(LookupError):
        router.choose(request_for(tokens), loads, 0.0)


def test_session_stickiness_and_ttl() -> None:
    router = Router(PolicyConfig(policy="session", block_size=BLOCK, session_ttl_s=10.0))
    loads = fleet(router, "a", "b", "c")
    first = route(router, loads, request_for(list(range(16)), session_id="s1"), now=0.0)
    # Unrelated prompts in the same session stay on its backend, and each use renews the TTL.
    for step, start in enumerate((200, 300, 400), start=1):
        decision = route(router, loads, request_for(list(range(start, start + 16)), session_id="s1"), now=8.0 * step)
        assert decision.backend == first.backend and decision.reason == "session"
    assert router.session_backend("s1", now=24.0 + 9.9) == first.backend
    assert router.session_backend("s1", now=24.0 + 10.0) is None  # expired
    router.expire_sessions(now=100.0)
    assert router._sessions == {}
    # A failed backend ends its sessions.
    sticky = route(router, loads, request_for(list(range(16)), session_id="s2"), now=200.0)
    router.backend_failed(sticky.backend)
    assert router.session_backend("s2", now=200.0) is None


def test_round_robin_and_least_loaded() -> None:
    router = Router(PolicyConfig(policy="round-robin", block_size=BLOCK))
    loads = fleet(router, "a", "b", "c")
    tokens = list(range(32))
    assert [route(router, loads, request_for(tokens)).backend for _ in range(6)] == ["a", "b", "c"] * 2
    least = Router(PolicyConfig(policy="least-loaded", block_size=BLOCK))
    fleet(least, "a", "b", "c")
    loads["a"].in_flight, loads["b"].in_flight, loads["c"].in_flight = 3, 1, 2
    assert least.choose(request_for(tokens), loads, 0.0).backend == "b"


@pytest.mark.parametrize("field, value", [("policy", "random"), ("max_load_ratio", 0.5), ("max_kv_usage", 0.0),
                                          ("block_size", 0), ("session_ttl_s", 0.0),
                                          ("miss_cost_weight", 0.5)])
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})


def test_a_hybrid_backend_is_credited_only_up_to_the_states_it_keeps() -> None:
    """Issue 66: a hybrid model's server reuses a prefix only from a recurrent-state snapshot on it; its blocks past
    the deepest such state are recomputed, so they must not draw a request (cache/events.py's state events)."""
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "hybrid", "plain")
    shared = list(range(40))  # 10 blocks
    keys = request_for(shared + [99]).keys_for("hybrid")
    for backend in ("hybrid", "plain"):
        router.index.record(backend, keys)
    router.index.set_recurrent("hybrid")
    assert router.index.matched_blocks("plain", keys) == 10
    assert router.index.matched_blocks("hybrid", keys) == 0  # the blocks, but no state on them
    router.index.record_state("hybrid", keys[3:4])
    assert router.index.matched_blocks("hybrid", keys) == 4  # resumes at block 4's end
    assert route(router, loads, request_for(shared + [7])).backend == "plain"  # 10 blocks reused beat 4
    router.index.record_state("hybrid", keys[8:9])
    assert router.index.matched_blocks("hybrid", keys) == 9
    router.index.remove_state("hybrid", keys[8])  # the snapshot went, the block stays
    assert router.index.matched_blocks("hybrid", keys) == 4
    router.index.remove("hybrid", keys[2])  # a block in the middle went: the chain stops before the state
    assert router.index.matched_blocks("hybrid", keys) == 0
    # A prompt the router sends to a hybrid backend leaves a state where it ends there (its prompt snapshot).
    other = request_for(list(range(100, 124)))
    router.record_sent("hybrid", other)
    assert router.index.matched_blocks("hybrid", other.keys_for("hybrid")) == 6
    assert router.index.drop_backend("hybrid") > 0 and router.index.is_recurrent("hybrid")
    assert router.index.matched_blocks("hybrid", other.keys_for("hybrid")) == 0


def test_a_hybrid_remote_group_is_credited_only_up_to_the_states_its_members_wrote() -> None:
    """Issue 66: a hybrid server writes its blocks and its kept states through to the remote tiers it shares; a
    member loading from there resumes at the deepest state, so the group's blocks past it must not draw a request."""
    router = Router(PolicyConfig(block_size=BLOCK))
    loads = fleet(router, "a", "b")
    for name in loads:
        router.set_remote_group(name, "redis/fp")
        router.set_recurrent(name)
    keys = request_for(list(range(40)) + [99]).keys_for("a")  # 10 full blocks
    router.index.record("a", keys)  # a's stored events: in its pool and in the group's remote
    router.record_remote("a", keys)
    request = request_for(list(range(40)) + [7])
    assert router.choose(request, {"b": BackendLoad()}, 0.0).remote_blocks == 0  # blocks, no state to resume from
    router.record_state("a", keys[3:4])  # a kept a state at block 4's end: written to the remote as well
    decision = router.choose(request, {"b": BackendLoad()}, 0.0)
    assert (decision.remote_blocks, decision.uncached_tokens, decision.reason) == (4, 41 - 16, "remote")
    router.index.remove_state("a", keys[3])  # a's pool dropped it; the remote keeps its copy
    assert router.index.matched_blocks("a", keys) == 0
    assert router.choose(request, {"a": BackendLoad()}, 0.0).remote_blocks == 4
    router.record_state("a", keys[8:9])
    assert router.choose(request, {"b": BackendLoad()}, 0.0).remote_blocks == 9
    # A prompt sent to a member leaves a state where it ends, on it and in the remote.
    other = request_for(list(range(100, 124)))
    router.record_sent("a", other)
    assert router.choose(other, {"b": BackendLoad()}, 0.0).remote_blocks == 6
    # The card can come after the group: the group still becomes a hybrid one.
    router.index.add_backend("c", capacity_blocks=1000)
    router.set_remote_group("c", "redis/fp2")
    router.set_recurrent("c")
    router.record_remote("c", keys)
    assert router.choose(request, {"c": BackendLoad()}, 0.0).remote_blocks == 0
    # A plain model's group is credited its whole run, as before.
    router.index.add_backend("d", capacity_blocks=1000)
    router.set_remote_group("d", "redis/fp3")
    router.record_remote("d", keys)
    assert router.choose(request, {"d": BackendLoad()}, 0.0).remote_blocks == 10
