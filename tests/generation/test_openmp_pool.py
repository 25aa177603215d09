"""A thread that hands the decode thread work gives back its own OpenMP pool first (engine.openmp_pool): libgomp
throttles every barrier's wait while the pools' threads outnumber the cores, and ggml's steps wait at one a node.

Each case counts the process's threads, so it runs in a child interpreter of its own (this module run as a
script), where no other test's threads come and go."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moedesk.engine.openmp_pool import _pause, release_pool

pytestmark = pytest.mark.skipif(_pause() is None, reason="no libgomp with OpenMP 5's pause here")
REPO = Path(__file__).resolve().parents[2]


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def settled(expected: int, timeout: float = 5.0) -> int:
    """The process's thread count once it reaches `expected` (exiting threads take a moment to leave the list)."""
    deadline = time.monotonic() + timeout
    while threads_now() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads_now()


def parallel_torch_op():
    a = torch.randn(256, 256)
    for _ in range(4):
        a @ a


def released_by_hand() -> dict:
    start = threads_now()
    parallel_torch_op()
    with_pool = settled(start + 1)
    return {"start": start, "with_pool": with_pool, "released": release_pool(), "after": settled(start)}


def released_by_submit(checkpoint: str) -> dict:
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    engine = Engine.load(checkpoint, device="cpu", dtype="float32")
    request = Request(engine.tokenizer.encode("Experts live in RAM"),
                      SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    engine.scheduler.drain(10)
    start = threads_now()
    parallel_torch_op()
    with_pool = settled(start + 1)
    for _ in engine.submit(request).updates(timeout=30):
        pass
    engine.scheduler.drain(10)
    return {"start": start, "with_pool": with_pool, "after": settled(start)}


def released_by_load(checkpoint: str) -> dict:
    import moedesk.engine.runtime as runtime

    real, seen = runtime.Engine._load_native.__func__, {}

    def loading(cls, *args, **kwargs):
        engine = real(cls, *args, **kwargs)
        parallel_torch_op()  # whatever the load itself ran, its thread has a pool now
        seen["at_the_end"] = settled(seen["start"] + 1)
        return engine

    runtime.Engine._load_native = classmethod(loading)
    seen["start"] = threads_now()
    runtime.Engine.load(checkpoint, device="cpu", dtype="float32")
    return {**seen, "after": settled(seen["start"])}


CASES = {"by_hand": released_by_hand, "by_submit": released_by_submit, "by_load": released_by_load}


def child(case: str, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # torch's threads, two whatever the machine
    done = subprocess.run([sys.executable, "-m", "tests.generation.test_openmp_pool", case, *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_threads_pool_outlives_its_parallel_op_until_released():
    seen = child("by_hand")
    assert seen["with_pool"] == seen["start"] + 1  # a second thread works for this one, and stays after the op
    assert seen["released"] and seen["after"] == seen["start"]


def test_submitting_frees_the_callers_pool_before_the_decode_thread_runs(tiny_checkpoint):
    seen = child("by_submit", tiny_checkpoint("qwen3_moe"))
    assert seen["with_pool"] == seen["start"] + 1 and seen["after"] == seen["start"]


def test_a_load_frees_the_pool_its_torch_work_left_on_the_loading_thread(tiny_checkpoint):
    """serve loads on an executor's thread that lives on: the pool its torch work leaves there would throttle every
    decode thread after it."""
    seen = child("by_load", tiny_checkpoint("qwen3_moe"))
    assert seen["at_the_end"] == seen["start"] + 1 and seen["after"] == seen["start"]


if __name__ == "__main__":
    print(json.dumps(CASES[sys.argv[1]](*sys.argv[2:])))
