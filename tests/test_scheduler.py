"""Scheduler decisions without a model: budgets, cache-aware order with aging, in-batch sharing,
preemption. The 'forward' is simulated by advancing num_computed_tokens and appending a token."""

from __future__ import annotations

import itertools

from kvreuse.cache.hashing import namespace_key
from kvreuse.cache.manager import KVCacheManager
from kvreuse.config import SchedulerConfig
from kvreuse.request import Request
from kvreuse.sampling import SamplingParams
from kvreuse.scheduler import Scheduler

NS = namespace_key(None, None, "m")
_ids = itertools.count()


def request(tokens: list[int]) -> Request:
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(), NS, 0.0)


def step(scheduler: Scheduler):
    """One engine step without a model: every request whose prompt completes gets token 7."""
    out = scheduler.schedule()
    scheduler.advance(out.scheduled)
    for item in out.scheduled:
        if item.request.num_computed_tokens == item.request.num_tokens:
            item.request.append_token(7)
    scheduler.kv.check_integrity(scheduler.running)
    return out


def finish_all(scheduler: Scheduler) -> None:
    for r in list(scheduler.running):
        scheduler.finish(r, "stop")


def test_token_budget_chunks_prefill_and_decodes_first():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10), kv)
    long_prompt, short = request(list(range(25))), request([1, 2, 3])
    scheduler.add(long_prompt)
    out = step(scheduler)
    assert [(i.request, i.num_tokens) for i in out.scheduled] == [(long_prompt, 10)]
    scheduler.add(short)
    out = step(scheduler)
    # The running prefill continues first; the newcomer gets what is left of the budget... none.
    assert [(i.request, i.num_tokens) for i in out.scheduled] == [(long_prompt, 10)]
    out = step(scheduler)
    assert [(i.request, i.num_tokens) for i in out.scheduled] == [(long_prompt, 5), (short, 3)]
    out = step(scheduler)  # both decode now: one token each
    assert [i.num_tokens for i in out.scheduled] == [1, 1]


def test_max_num_seqs_limits_running():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2), kv)
    for i in range(3):
        scheduler.add(request([10 + i] * 5))
    step(scheduler)
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1


def warm(kv: KVCacheManager, tokens: list[int]) -> None:
    scheduler = Scheduler(SchedulerConfig(), kv)
    r = request(tokens)
    scheduler.add(r)
    step(scheduler)
    finish_all(scheduler)


def test_lpm_prefers_the_longest_cached_prefix_and_fcfs_does_not():
    shared = list(range(100, 140))
    for policy, expect_cached_first in (("lpm", True), ("fcfs", False)):
        kv = KVCacheManager(64, 4)
        warm(kv, shared + [1])
        scheduler = Scheduler(SchedulerConfig(scheduling_policy=policy, max_num_seqs=1), kv)
        cold, hit = request(list(range(500, 520))), request(shared + [2, 3])
        scheduler.add(cold)
        scheduler.add(hit)
        out = step(scheduler)
        assert (out.scheduled[0].request is hit) == expect_cached_first
        assert out.admitted[0][1].num_tokens == (40 if expect_cached_first else 0)


def test_lpm_aging_admits_a_passed_over_request():
    kv = KVCacheManager(256, 4)
    shared = list(range(100, 140))
    warm(kv, shared + [1])
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, starvation_limit=3), kv)
    cold = request(list(range(500, 520)))
    scheduler.add(cold)
    admitted_order = []
    for i in range(6):
        scheduler.add(request(shared + [50 + i]))  # a stream of cache-friendly newcomers
        out = step(scheduler)
        admitted_order += [r for r, _ in out.admitted]
        finish_all(scheduler)
    # Passed over 3 times, the cold request then goes before the cache-friendly ones.
    assert admitted_order.index(cold) == 3
    assert cold.num_times_passed_over == 3


def test_in_batch_sharing_defers_the_duplicate_until_the_prefix_exists():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    shared = list(range(200, 224))  # 6 blocks, computed over two steps with a budget of 16
    a, b = request(shared + [1, 2]), request(shared + [3, 4])
    scheduler.add(a)
    scheduler.add(b)
    out = step(scheduler)
    assert [i.request for i in out.scheduled] == [a]  # b waits: its next block is being computed
    out = step(scheduler)
    assert [i.request for i in out.scheduled] == [a]  # a's second chunk used the whole budget
    out = step(scheduler)
    admitted = dict((id(r), m.num_tokens) for r, m in out.admitted)
    assert admitted[id(b)] == 24  # b reuses everything a computed of the shared prefix
    assert b.num_cached_tokens == 24


def test_preemption_frees_the_newest_and_readmission_hits():
    kv = KVCacheManager(6, 4)  # 24 slots
    scheduler = Scheduler(SchedulerConfig(), kv)
    first, second = request(list(range(300, 310))), request(list(range(400, 410)))
    scheduler.add(first)
    scheduler.add(second)
    step(scheduler)  # both prefilled: 3 + 3 blocks, pool full
    preempted = []
    for _ in range(3):
        out = step(scheduler)
        preempted += out.preempted
    assert preempted == [second]  # the most recently admitted goes
    assert second.num_computed_tokens == 0 and not second.block_ids
    finish_all(scheduler)
    out = step(scheduler)
    assert out.admitted[0][0] is second
    assert out.admitted[0][1].num_tokens == 8  # its two full computed blocks stayed cached
    assert second.num_preemptions == 1 and scheduler.num_preemptions == 1


def test_a_match_that_an_earlier_admission_evicted_is_taken_again():
    """lpm orders the waiting requests by matches taken before any of them is admitted; an admission that needs room
    evicts idle blocks, which may be the match of a request admitted after it in the same step. That request matches
    again at its turn: it never holds an evicted node or a block that another request now writes (before, it did,
    and caching its next block failed with "insert under an evicted node")."""
    kv = KVCacheManager(15, 4)
    old, long_shared, newest = list(range(300, 308)), list(range(100, 116)), list(range(500, 508))
    for tokens in (old, long_shared, newest):  # idle, least recently used first: 3 + 5 + 3 blocks, 4 free
        warm(kv, tokens + [1])
    scheduler = Scheduler(SchedulerConfig(), kv)
    first = request(long_shared + list(range(600, 628)))  # 16 of 44 tokens cached: 7 blocks more, 3 evicted (old's)
    second = request(old + [9])  # its 8 cached tokens are old's, which the first admission evicts
    scheduler.add(second)
    scheduler.add(first)
    out = step(scheduler)
    assert [admitted for admitted, _ in out.admitted] == [first, second]
    assert [match.num_tokens for _, match in out.admitted] == [16, 0]
    assert not set(first.block_ids) & set(second.block_ids)
    for _ in range(3):  # both go on caching their blocks
        step(scheduler)
