"""bench.kernel_builds: Triton's builds of kernel variants counted through its JIT hooks, with the hooks a caller
had set kept working and put back afterwards; on the GPU, a real launch of a new variant counted once."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from moedesk.bench.kernel_builds import recorded_builds

knobs = pytest.importorskip("triton").knobs


def _build(name: str, seconds: float) -> None:
    """What Triton's JITFunction._do_compile does around a build: the cache hook, the build, the post hook."""
    runtime, key = knobs.runtime, (name, object())
    hook = dict(key=key, repr=name, fn=SimpleNamespace(name=name), compile={"key": key}, is_manual_warmup=False,
                already_compiled=False)
    skipped = runtime.jit_cache_hook(**hook) if runtime.jit_cache_hook else None
    assert not skipped  # a true answer would make Triton skip the build
    time.sleep(seconds)
    if runtime.jit_post_compile_hook:
        runtime.jit_post_compile_hook(**hook)


def test_builds_are_counted_from_a_start_and_earlier_hooks_keep_working(monkeypatch):
    theirs = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **hook: theirs.append("miss"))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **hook: theirs.append("built"))
    mine, own_post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    with recorded_builds() as builds:
        _build("_warm", 0.0)
        start = time.perf_counter()
        _build("_packed_mm", 0.05)
        _build("_packed_mm", 0.0)
        _build("_q8_mm", 0.0)
    assert knobs.runtime.jit_cache_hook is mine and knobs.runtime.jit_post_compile_hook is own_post
    assert theirs == ["miss", "built"] * 4
    late = builds.since(start)
    assert late["count"] == 3 and late["kernels"] == ["_packed_mm", "_q8_mm"] and late["ms"] >= 50
    assert builds.since(time.perf_counter()) is None
    _build("_after", 0.0)  # outside the block: not counted
    assert len(builds.done) == 4


@pytest.mark.gpu
def test_a_new_variant_launched_on_the_gpu_is_one_build():
    import torch
    import triton
    import triton.language as tl

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    @triton.jit
    def _fill(out_ptr, VALUE: tl.constexpr):
        tl.store(out_ptr, VALUE)

    out = torch.zeros(1, device="cuda")
    value = time.time_ns() % 1000 + 0.5  # a constexpr no run of this process built before
    with recorded_builds() as builds:
        _fill[(1,)](out, VALUE=value)
        _fill[(1,)](out, VALUE=value)  # built: no second build
    torch.cuda.synchronize()
    assert out.item() == value
    assert [b.kernel for b in builds.done] == ["_fill"]
