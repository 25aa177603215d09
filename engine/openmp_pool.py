"""A thread hands work to the decode thread: it gives back its own OpenMP pool first.

Both engines compute on the CPU in OpenMP regions on the scheduler's decode thread: llama.cpp's ggml and torch's
CPU ops, through the process's one libgomp (the first libgomp.so.1 loaded, torch's, serves llama.cpp too). libgomp
keeps a pool of worker threads for every thread that ever opened a region, for as long as that thread lives, and
while the pools' threads outnumber the cores it cuts every barrier's spin to a few turns before sleeping. ggml
meets a barrier after each node of its graph, so with the main thread's pool alive (left by a load's torch ops, or
any parallel torch op there) both engines' decode steps ran far slower on a small machine
(docs/measurements.md, "Session 46"). OpenMP 5's omp_pause_resource_all frees the calling thread's pool; its next
region makes a new one.
"""
from __future__ import annotations

import ctypes
from functools import cache, wraps

OMP_PAUSE_SOFT = 1  # omp.h's omp_pause_soft: the threads go, the settings stay


@cache
def _pause():
    try:
        return ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):  # another OpenMP runtime, or a libgomp before OpenMP 5: nothing to free
        return None


def release_pool() -> bool:
    """Free the calling thread's OpenMP pool, if it has one (never call it inside a parallel region: libgomp then
    refuses). True when libgomp took the call."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


def frees_pool(function):
    """`function`, then the calling thread's OpenMP pool freed, whatever it returned or raised: for work a thread
    that lives on does beside the decode thread (a load's torch ops, on an executor's thread that serve reuses)."""
    @wraps(function)
    def freeing(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        finally:
            release_pool()

    return freeing
