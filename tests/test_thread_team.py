"""runner/thread_team.py: a thread hands its OpenMP team back (its workers exit) and later runs on one
thread, so a served process keeps one team, the engine loop's (async_engine.py).

The checks count the process's threads, so they run in a fresh interpreter: in the suite's process,
threads that earlier tests left (daemons winding down, executors) come and go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvreuse.runner import thread_team

SCRIPT = textwrap.dedent("""
    import json, os, threading, time
    import torch
    from kvreuse.runner import thread_team

    def process_threads():
        return len(os.listdir("/proc/self/task"))

    threads = torch.get_num_threads()
    big = torch.randn(1 << 22)
    seen = {"threads": threads}

    def hand_back():
        before = process_threads()
        big.sin()  # a parallel op: this thread's team (threads - 1 workers) starts
        seen["with_team"] = process_threads() - before
        seen["previous"] = thread_team.hand_back_team()
        deadline = time.monotonic() + 10
        while process_threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)  # the workers leave as the runtime releases the pool
        seen["after"] = process_threads() - before
        seen["count"] = torch.get_num_threads()
        big.sin()  # on one thread: no team made again
        seen["later"] = process_threads() - before
        thread_team.restore_threads(seen["previous"])
        seen["restored"] = torch.get_num_threads()

    thread = threading.Thread(target=hand_back)
    thread.start()
    thread.join()
    seen["main"] = torch.get_num_threads()
    print(json.dumps(seen))
""")


def test_a_thread_hands_back_its_team_then_runs_on_one_thread_until_restored():
    if thread_team.libgomp() is None:
        pytest.skip("torch's OpenMP runtime is not libgomp here")
    # Two threads whatever the suite gives the processes it starts (conftest.py: OMP_NUM_THREADS=1).
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    threads = seen["threads"]
    assert threads == 2
    assert seen["with_team"] == threads - 1  # the team's workers started
    assert seen["after"] == 0 and seen["later"] == 0  # they left, and one thread makes no new team
    assert seen["previous"] == threads and seen["count"] == 1
    assert seen["restored"] == threads and seen["main"] == threads  # restored; other threads untouched
