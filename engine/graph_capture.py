"""Capturing a CUDA graph with Python's cyclic garbage collector held off.

The collector runs at whatever allocation crosses its threshold, in whichever thread made it: during a capture,
in the capturing thread. An object it finalises there may touch CUDA in a way a capture forbids (a
synchronisation, an event query, freeing pinned memory): the capture is invalidated, or a destructor that
throws aborts the process. Decode captures run on the scheduler's thread while other threads finish requests
and drop their objects, so that happened once in a few runs of tests/generation/test_scheduler_jobs.py (a beam
search's capture, "invalid argument", or the interpreter aborting mid-collection). `torch.cuda.graph`
collects once before it begins; this also keeps the collector off until the capture ends.
"""
from __future__ import annotations

import contextlib
import gc

import torch


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    """The current GPU's capture stream, made at its first capture."""
    index = torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(index)
    return _side_streams[index]


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None, stream: torch.cuda.Stream | None = None):
    """`torch.cuda.graph(graph, pool, stream)` without a garbage collection inside it, in thread-local error mode:
    other threads' CUDA calls (another model freeing memory, a server's own work) cannot break the capture, only
    this thread's. stream: on the graph's device; None takes a side stream of the current device (torch's own default
    lives on whichever GPU captured first, and a capture there records another GPU's kernels into nothing: seen on
    the two-GPU box)."""
    stream = stream or _side_stream()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield graph
    finally:
        if collecting:
            gc.enable()
