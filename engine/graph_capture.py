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


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None, stream: torch.cuda.Stream | None = None):
    """`torch.cuda.graph(graph, pool, stream)` without a garbage collection inside it, in thread-local error mode:
    other threads' CUDA calls (another model freeing memory, a server's own work) cannot break the capture, only
    this thread's. stream: on the graph's device; None is torch's one side stream, made on the first device that
    captured, so a graph for another GPU names a stream of its own."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield graph
    finally:
        if collecting:
            gc.enable()
