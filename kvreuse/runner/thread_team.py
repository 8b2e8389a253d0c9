"""One OpenMP team per process: the thread that built a served engine hands its team back.

torch's CPU wheels run intra-op parallelism on libgomp. Each thread that runs a parallel op gets a team
of its own (the thread and ``threads - 1`` workers), and the workers stay for as long as that thread
lives. libgomp lets idle team members spin, waiting for the next parallel region, only while the
process holds no more team threads than it has cores; past that it spins them ~100 times, then puts them
to sleep on a futex, and every region starts by waking them.

A server builds its engine on one thread (loading the weights, warm-up steps: parallel ops, so a team)
and steps it on another (the engine loop, async_engine.py: a second team). So every team member slept
between regions, and a one-token decode step of SmolLM2 is about 150 of them, each waking a sleeper.
Measured served on 2 cores (AMD EPYC, avx2; SmolLM2-135M Q4_1; /proc per-thread counts): the engine
team's worker slept 148 times per token, the step took 20-21 ms against 16-17 ms in a process with one
team, and one stream decoded at 46-49 tok/s; with the building thread's team handed back, the worker
slept 13 times in 800 tokens, the step took 17.7-17.9 ms and the stream 54-56 tok/s.

``hand_back_team`` gives the calling thread's team back to the runtime (``omp_pause_resource_all``, the
OpenMP 5.0 call, which in libgomp releases the calling thread's pool) and runs that thread's later torch
ops on one thread, so it does not make a new one. Where torch's OpenMP runtime is not libgomp (none is
loaded under that name), it does nothing: the rule above is libgomp's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

logger = logging.getLogger("kvreuse")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: soft keeps the runtime usable, a later region makes a new team


@functools.cache
def libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already loaded (torch's, by its soname), or None."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def hand_back_team() -> int | None:
    """Release the calling thread's OpenMP team and run its torch ops on one thread from now on.

    Returns the thread's previous thread count (for ``restore_threads``), or None where libgomp is not
    torch's runtime (nothing was changed)."""
    gomp = libgomp()
    if gomp is None:
        return None
    # get_num_threads first: torch sets a thread's count lazily, at its first parallel op, from the count
    # last set by any thread; read here, that has happened and cannot undo the count set below.
    threads = torch.get_num_threads()
    if gomp.omp_pause_resource_all(OMP_PAUSE_SOFT) != 0:
        logger.warning("libgomp refused to release this thread's OpenMP team (inside a parallel region?)")
    gomp.omp_set_num_threads(1)  # this thread only: torch.set_num_threads would also set the default of new threads
    return threads


def restore_threads(threads: int | None) -> None:
    """Give the calling thread back the count ``hand_back_team`` returned (its team is made again when
    it next runs a parallel op)."""
    gomp = libgomp()
    if threads is not None and gomp is not None:
        gomp.omp_set_num_threads(threads)
