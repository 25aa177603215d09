"""Triton's builds of kernel variants while a measurement runs.

A variant this process has not built yet (a new tile, or an integer argument newly 1 or a multiple of 16, which
Triton specialises on) is compiled, or loaded from Triton's disk cache, on the host inside the step that first
launches it: that step stalls for as long. The bench counts the builds inside its timed rounds through Triton's
JIT hooks, so a round that stalled says whether a build was the cause (docs/benchmarks.md).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Build:
    kernel: str
    started: float  # time.perf_counter() when Triton began it
    ms: float


@dataclass
class Builds:
    done: list[Build] = field(default_factory=list)

    def since(self, start: float) -> dict | None:
        """The builds begun at or after `start` (a measurement's first timed round): count, ms and the kernels;
        None when there were none."""
        late = [b for b in self.done if b.started >= start]
        if not late:
            return None
        return {"count": len(late), "ms": round(sum(b.ms for b in late), 2),
                "kernels": sorted({b.kernel for b in late})}


@contextmanager
def recorded_builds():
    """Record Triton's builds for the block's length (chaining any hooks already set); without Triton, nothing."""
    builds = Builds()
    try:
        from triton import knobs
    except ImportError:
        yield builds
        return
    runtime = knobs.runtime
    before_miss, before_built = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    pending: dict[int, float] = {}

    def on_miss(**hook):
        pending[id(hook["compile"]["key"])] = time.perf_counter()
        # A true result from this hook tells Triton to skip the build: only the chained hook may say so.
        return before_miss(**hook) if before_miss else None

    def on_built(**hook):
        started = pending.pop(id(hook["compile"]["key"]), None)
        if started is not None:
            # Triton names a kernel by its qualified name (`outer.<locals>._fill`); the report wants `_fill`.
            name = hook["fn"].name.rsplit(".", 1)[-1]
            builds.done.append(Build(name, started, 1e3 * (time.perf_counter() - started)))
        return before_built(**hook) if before_built else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_built
    try:
        yield builds
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before_miss, before_built
