"""runner/step_threads.py: a server's small CPU steps run on the thread count their measured time favours."""

from __future__ import annotations

import pytest

from kvreuse.runner.step_threads import StepThreads


def run(policy: StepThreads, seconds_by_threads: dict[int, float], steps: int, tokens: int = 1,
        context: int = 64) -> list[int]:
    """Drive the policy for ``steps`` steps of ``tokens`` tokens over a ``context``-token context whose time
    depends on the thread count."""
    chosen = []
    for _ in range(steps):
        threads = policy.for_step(tokens, context)
        policy.record(tokens, threads, seconds_by_threads[threads], context)
        chosen.append(threads)
    return chosen


def test_a_small_step_starts_on_one_thread_fewer_then_keeps_the_faster_count():
    # The event loop slows a full team (SmolLM2 served on 2 cores): one thread fewer stays.
    policy = StepThreads(2, probe_steps=4, reprobe_every=64)
    chosen = run(policy, {1: 0.018, 2: 0.028}, 64)
    assert chosen[:4] == [1] * 4 and chosen[4:8] == [2] * 4  # measure the other count once
    assert chosen[8:63] == [1] * 55 and chosen[63] == 2  # then the faster; a re-probe every 64 steps
    # A bigger model's step gains from the second core despite the loop (qwen2.5-0.5b): every thread wins.
    policy = StepThreads(2, probe_steps=4, reprobe_every=64)
    chosen = run(policy, {1: 0.038, 2: 0.035}, 64)
    assert chosen[:8] == [1] * 4 + [2] * 4 and chosen[8:63] == [2] * 55 and chosen[63] == 1


def test_the_choice_follows_a_change_and_large_steps_use_every_thread():
    policy = StepThreads(4, probe_steps=2, reprobe_every=16)
    assert run(policy, {3: 0.010, 4: 0.020}, 16)[4:15] == [3] * 11
    # The loop goes quiet and the full team becomes faster: a re-probe finds it.
    later = run(policy, {3: 0.010, 4: 0.002}, 64)
    assert later[49:63] == [4] * 14 and later[63] == 3  # between re-probes of the count it left
    # Each token count is measured on its own; a prefill or a batch of 18 streams takes every thread
        # (a step of up to 17 tokens is small: one stream verifying 16 drafted tokens).
    assert policy.for_step(18) == 4 and policy.for_step(2048) == 4
    policy.record(2048, 4, 1.0)
    assert all(tokens <= 4 for tokens, _, _ in policy.step_seconds)
    with pytest.raises(ValueError, match="at least 2"):
        StepThreads(1)


def test_a_change_of_choice_is_logged_with_the_medians(caplog: pytest.LogCaptureFixture):
    policy = StepThreads(2, probe_steps=4, reprobe_every=64)
    with caplog.at_level("INFO", logger="kvreuse"):
        run(policy, {1: 0.038, 2: 0.035}, 16)
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["CPU steps of 1 token(s) over contexts under 512 tokens now run on 2 of 2 threads (median step "
                     "1 thread 38.0 ms, 2 threads 35.0 ms)"]


def test_each_context_band_keeps_its_own_choice():
    """A long context's steps favour the other count (attention split over both cores): measured apart from
    short contexts' steps, neither set of medians pulls the other's choice over."""
    policy = StepThreads(2, probe_steps=4, reprobe_every=256)
    short = run(policy, {1: 0.018, 2: 0.028}, 40, context=100)
    long = run(policy, {1: 0.060, 2: 0.040}, 40, context=4000)
    assert short[8:] == [1] * 32
    assert set(long[:8]) == {1, 2} and long[8:] == [2] * 32  # both counts measured in the new band, then 2
    # Back to a short context (a new conversation): its own medians still hold, no re-learning.
    again = run(policy, {1: 0.018, 2: 0.028}, 40, context=200)
    assert again == [1] * 40
    assert policy.describe(1, 2) == "1 thread 60.0 ms, 2 threads 40.0 ms"
