"""runner/thread_team.py: a thread hands its OpenMP team back (its workers exit) and later runs on one
thread, so a served process keeps one team, the engine loop's (async_engine.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvreuse.runner import thread_team


def process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture()
def two_threads():
    if thread_team.libgomp() is None:
        pytest.skip("torch's OpenMP runtime is not libgomp here")
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no team to hand back")


def run_in_thread(function):
    result: list = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(function())
        except BaseException as error:  # surfaced in the test's thread
            errors.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def test_a_thread_hands_back_its_team_and_then_runs_on_one_thread(two_threads):
    threads = torch.get_num_threads()
    big = torch.randn(1 << 22)

    def in_thread() -> tuple[int, int, int, int, int]:
        before = process_threads()
        big.sin()  # a parallel op: this thread's team (threads - 1 workers) starts
        with_team = process_threads()
        previous = thread_team.hand_back_team()
        deadline = time.monotonic() + 5
        while process_threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)  # the workers leave as the runtime releases the pool
        after = process_threads()
        count = torch.get_num_threads()
        big.sin()  # on one thread: no team made again
        return before, with_team, after, previous, count, process_threads()

    before, with_team, after, previous, count, later = run_in_thread(in_thread)
    assert with_team == before + threads - 1
    assert after == before and later == before
    assert previous == threads and count == 1
    assert torch.get_num_threads() == threads  # other threads keep their count


def test_restore_gives_the_thread_its_count_back(two_threads):
    threads = torch.get_num_threads()

    def in_thread() -> tuple[int, int]:
        torch.randn(1 << 22).sin()
        previous = thread_team.hand_back_team()
        during = torch.get_num_threads()
        thread_team.restore_threads(previous)
        return during, torch.get_num_threads()

    assert run_in_thread(in_thread) == (1, threads)
