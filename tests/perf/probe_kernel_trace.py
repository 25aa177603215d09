"""Probe (GPU box): where does a CPU experts call lose time beyond streaming its weights?

Usage: python3 tests/perf/probe_kernel_trace.py [qwen3|mixtral] [NAME=-DFLAG,-DFLAG ...] [OTHER_SOURCE.c]
(env PROBE_E, PROBE_L: experts and layers, to try it on a small machine). Decode-like calls, one token on each of K
experts of the Qwen3-30B-A3B (Mixtral-8x7B) shape, rotating over the layers' pinned banks: 8 (2) experts back to
back, 8 (2) with the caller busy for 300 µs between calls (as while the GPU runs the next layer), and 128 (8) back
to back. Builds of the kernel, interleaved over three rounds:
  - this source, called straight through ctypes with prepared arguments ("raw"), and through the engine's wrapper;
  - this source with -DMOE_TRACE, which records the last call's timeline: its setup before the threads start, how
    long the participants take to pick up their first item (join, phase 0's conversion of the x rows included),
    the spread of their last finishes (tail), the wait of phase-2 items for phase 1, and the wait for the workers
    after the last item (close);
  - this source with -DMOE_READ_ONLY: the same reads without the arithmetic, the streaming the pattern allows;
  - this source with the flags given as NAME=..., raw (for example t1=-DPREFETCH_HINT=_MM_HINT_T1);
  - OTHER_SOURCE.c, raw (for example an older kernel: git show REV:kernels/cpu_experts.c > .baseline/old.c).
Last, whether the last-level cache could hold experts read ahead (say, the next layer's predicted experts while the
GPU works): each timed call of the top-k experts follows an untimed call on P of them (P = 2, 4), against an untimed
call on P other experts (the same traffic, nothing to reuse).
Prints medians over calls and rounds (µs per call); the calls' raw figures go to $OUT/kernel_trace.json."""
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from moedesk.kernels import cpu_experts as ce
from moedesk.kernels.native_build import build_library

ARGS = sys.argv[1:]
SHAPE = ARGS.pop(0) if ARGS and ARGS[0] in ("qwen3", "mixtral") else "qwen3"
(E, H, F, L), TOP_K = {"qwen3": ((128, 2048, 768, 8), 8), "mixtral": ((8, 4096, 14336, 4), 2)}[SHAPE]
E, L = int(os.environ.get("PROBE_E", E)), int(os.environ.get("PROBE_L", L))
BF16 = torch.bfloat16
EXPERT_BYTES = 3 * H * F * 2
CASES = [(TOP_K, 0), (TOP_K, 300), (E, 0)]
TRACE_KEYS = ["setup", "join_med", "join_max", "tail", "close", "wait"]


def load(source, *flags):
    lib = ctypes.CDLL(str(build_library(Path(source), [*ce.FLAGS, *flags])))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.moe_routed_experts_forward.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64,
                                               ptr, i64, i64, i64, ptr, ctypes.POINTER(i64), ctypes.POINTER(i64), i64]
    lib.moe_set_threads(ce.get_num_threads())
    return lib


def timeline(lib, words):
    """The traced call's figures in µs."""
    lib.moe_trace_read(words.data_ptr())
    w = words.tolist()
    n = (len(w) - 3) // 4
    enter, start, exit_ = w[:3]
    first, last, items, wait = (w[3 + i * n:3 + (i + 1) * n] for i in range(4))
    on = [i for i in range(n) if items[i]]
    lasts = [last[i] for i in on]
    return {"call": (exit_ - enter) / 1e3, "setup": (start - enter) / 1e3,
            "join_med": statistics.median(first[i] - start for i in on) / 1e3,
            "join_max": max(first[i] - start for i in on) / 1e3,
            "tail": (max(lasts) - min(lasts)) / 1e3, "close": (exit_ - max(lasts)) / 1e3,
            "wait": statistics.mean(wait[i] for i in on) / 1e3, "items": [items[i] for i in on]}


class RawCall:
    """The routed kernel called straight through ctypes, one token on each of up to `n` experts."""

    def __init__(self, n: int):
        self.n = n
        self.x = torch.randn(1, H).to(BF16).expand(n, H).contiguous()
        self.out = torch.empty(n, H, dtype=BF16)
        self.index = torch.empty(2 * n + 2 * E + 1, dtype=torch.int64)
        self.shape, self.skipped = (ctypes.c_int64 * 2)(), ctypes.c_int64(0)

    def __call__(self, lib, ids, gu, dn):
        lib.moe_routed_experts_forward(self.x.data_ptr(), self.n, H, H, ids.data_ptr(), len(ids), 1, None, 0,
                                       gu.data_ptr(), dn.data_ptr(), E, F, self.out.data_ptr(), H, self.n, 32,
                                       self.index.data_ptr(), self.shape, ctypes.byref(self.skipped), F)


def calls(K):
    """How many calls of K experts a case makes: the first L warm up."""
    return max(4 * L, min(100, int(6e9 / (K * EXPERT_BYTES))))


def run(kind, lib, banks, K, gap_us, gen):
    """Per call: µs as the caller sees it (and the trace's figures for the traced build)."""
    call = RawCall(K)
    ids = torch.empty(K, dtype=torch.int64)
    words = torch.zeros(lib.moe_trace_words(), dtype=torch.int64) if kind == "trace" else None
    rows = []
    for step in range(calls(K)):
        gu, dn = banks[step % L]
        ids.copy_(torch.randperm(E, generator=gen)[:K].sort().values)
        if gap_us:
            until = time.perf_counter() + gap_us * 1e-6
            while time.perf_counter() < until:
                pass
        t = time.perf_counter()
        if kind == "wrapper":
            ce.experts_forward_routed(call.x, ids, 1, None, gu, dn, call.out, call.index)
        else:
            call(lib, ids, gu, dn)
        us = (time.perf_counter() - t) * 1e6
        if step >= L:
            rows.append({"us": us, **(timeline(lib, words) if words is not None else {})})
    time.sleep(0.05)  # this build's workers stop spinning before the next build runs
    return rows


def pre_read(lib, banks, P, reuse, gen):
    """Median µs of a top-k call right after an untimed call on P of its experts (reuse) or on P others."""
    K = TOP_K
    call = RawCall(K)
    times = []
    for step in range(calls(K)):
        gu, dn = banks[step % L]
        perm = torch.randperm(E, generator=gen)
        ids = perm[:K].sort().values
        ahead = (ids[:P] if reuse else perm[K:K + P]).sort().values
        for chosen, timed in ((ahead, False), (ids, True)):
            t = time.perf_counter()
            call(lib, chosen, gu, dn)
            if timed and step >= L:
                times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main():
    assert ce.available(), ce.unavailable_reason()
    here = ce.SOURCE
    builds = {"raw": load(here), "wrapper": ce._state["lib"], "trace": load(here, "-DMOE_TRACE"),
              "read-only": load(here, "-DMOE_READ_ONLY")}
    builds["trace"].moe_trace_words.restype = ctypes.c_int
    builds["trace"].moe_trace_read.argtypes = [ctypes.c_void_p]
    for arg in ARGS:
        name, is_flags, flags = arg.partition("=")
        builds[name if is_flags else "other"] = load(here, *flags.split(",")) if is_flags else load(arg)
    pinned = torch.cuda.is_available()
    banks = [(torch.full((E, 2 * F, H), 0.01, dtype=BF16, pin_memory=pinned),
              torch.full((E, H, F), 0.01, dtype=BF16, pin_memory=pinned)) for _ in range(L)]
    gen = torch.Generator().manual_seed(0)
    results = {}
    for _ in range(3):
        for K, gap in CASES:
            for kind, lib in builds.items():
                results.setdefault(f"{K} experts, gap {gap} µs", {}).setdefault(kind, []).extend(
                    run(kind, lib, banks, K, gap, gen))
    out = os.environ.get("OUT")
    if out:
        Path(out, "kernel_trace.json").write_text(json.dumps(results))
    print(f"{SHAPE}, threads {ce.get_num_threads()}; µs per call (GB/s), medians over calls and 3 rounds")
    for case, by_kind in results.items():
        K = int(case.split()[0])
        cells = []
        for kind, rows in by_kind.items():
            us = statistics.median(r["us"] for r in rows)
            cells.append(f"{kind} {us:.0f} ({K * EXPERT_BYTES / us / 1e3:.0f})")
        print(f"{case:<22}" + "  ".join(cells))
        traced = by_kind["trace"]
        items = traced[len(traced) // 2]["items"]
        print(f"{'  trace':<22}" + "  ".join(f"{k} {statistics.median(r[k] for r in traced):.1f}"
                                             for k in ["call", *TRACE_KEYS])
              + f"  items per thread {min(items)}-{max(items)}")
    if E > TOP_K + 4:
        cells = [f"P={P}: after {P} others {pre_read(builds['raw'], banks, P, False, gen):.0f}, "
                 f"after {P} of its own {pre_read(builds['raw'], banks, P, True, gen):.0f}" for P in (2, 4)]
        print(f"L3 pre-read, µs per {TOP_K}-expert call: " + "; ".join(cells))


if __name__ == "__main__":
    main()
