"""A thread that hands the decode thread work gives back its own OpenMP pool first (engine.openmp_pool): libgomp
throttles every barrier's wait while the pools' threads outnumber the cores, and ggml's steps wait at one a node."""
import os
import threading
import time

import pytest
import torch

from moedesk.engine.openmp_pool import _pause, release_pool
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine

pytestmark = pytest.mark.skipif(_pause() is None, reason="no libgomp with OpenMP 5's pause here")


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def settled(expected: int, timeout: float = 5.0) -> int:
    """The process's thread count once it reaches `expected` (exiting threads take a moment to leave the list)."""
    deadline = time.monotonic() + timeout
    while threads_now() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads_now()


def on_own_thread(work):
    out = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join()
    return out[0]


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def parallel_torch_op():
    a = torch.randn(256, 256)
    for _ in range(4):
        a @ a


def test_a_threads_pool_outlives_its_parallel_op_until_released(two_torch_threads):
    def work():
        start = threads_now()
        parallel_torch_op()
        with_pool = settled(start + 1)
        released = release_pool()
        return start, with_pool, released, settled(start)

    start, with_pool, released, after = on_own_thread(work)
    assert with_pool == start + 1  # a second thread works for this one, and stays after the op
    assert released and after == start


def test_submitting_frees_the_callers_pool_before_the_decode_thread_runs(two_torch_threads, tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32")
    request = Request(engine.tokenizer.encode("Experts live in RAM"),
                      SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))

    def work():
        engine.scheduler.drain(10)
        start = threads_now()
        parallel_torch_op()
        with_pool = settled(start + 1)
        handle = engine.submit(request)
        [u for u in handle.updates(timeout=30)]
        engine.scheduler.drain(10)
        return start, with_pool, settled(start)

    start, with_pool, after = on_own_thread(work)
    assert with_pool == start + 1 and after == start


def test_a_load_frees_the_pool_its_torch_work_left_on_the_loading_thread(two_torch_threads, tiny_checkpoint,
                                                                          monkeypatch):
    """serve loads on an executor's thread that lives on: the pool its torch work leaves there would throttle every
    decode thread after it."""
    import moedesk.engine.runtime as runtime

    real, seen = runtime.Engine._load_native.__func__, {}

    def loading(cls, *args, **kwargs):
        engine = real(cls, *args, **kwargs)
        parallel_torch_op()  # whatever the load itself ran, its thread has a pool now
        seen["at_the_end"] = settled(seen["start"] + 1)
        return engine

    monkeypatch.setattr(runtime.Engine, "_load_native", classmethod(loading))

    def work():
        seen["start"] = threads_now()
        Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32")
        return settled(seen["start"])

    assert on_own_thread(work) == seen["start"] and seen["at_the_end"] == seen["start"] + 1
