"""The CPU experts' calls of a real decode, timed where they ran and again alone: is a batch's CPU call slow
because of the kernel on its routing, or because of what runs beside it?

Usage (GPU box, repo root): python3 tests/perf/replay_cpu_calls.py [SHAPE:LAYERS] [--batch 16] [--expert-format q4_k]
(default qwen3.5-35b-a3b:12). Every expert in RAM, all of them on the CPU (profile_decode.py's "CPU native"
variant). Each call of kernels/cpu_quant.c's mq_routed_forward during the decode steps is recorded (its pairs, the
experts it computes, its wall time); then the same calls run again one after another in the order they came, on
the same weights, with nothing else running: once with the recorded tokens an expert (the routing's skew), once
with as many tokens dealt evenly over the same experts, and once with each call started as long after the one before
as in situ (paced: the kernel's threads as idle between calls). Prints ms a call for each and the calls' shape
(experts, tokens an expert: mean and largest). In situ above paced: the cost is beside the kernel (the GPU thread,
the copies); paced above alone: the threads waking, cold caches; alone above even: the skew.
"""
import argparse
import ctypes
import statistics
import time

import numpy as np
import torch

from moedesk.bench.synthetic import measure_decode
from moedesk.engine.load.synthetic import shape_config, synthetic_model
from moedesk.engine.offload.offload_executor import OffloadExecutor
from moedesk.engine.offload.orchestration import leave_a_core_to_the_gpu_thread
from moedesk.kernels import cpu_quant

parser = argparse.ArgumentParser()
parser.add_argument("shape", nargs="?", default="qwen3.5-35b-a3b:12")
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--expert-format", default="q4_k")
parser.add_argument("--device", default="cuda", help="cpu: checks the script on a machine without a GPU")
args = parser.parse_args()

P_ARG, NP_ARG, PICK_ARG, NPICK_ARG, E_ARG = 5, 6, 8, 9, 12  # mq_routed_forward's argument positions
X_ARG, N_ARG, XSTRIDE_ARG, XF32_ARG, H_ARG = 0, 1, 2, 3, 4
OUT_ARG, OSTRIDE_ARG, OROWS_ARG, OF32_ARG, INDEX_ARG = 16, 17, 18, 19, 20


def int64s(ptr, n):
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int64)), (n,)).copy() if n else \
        np.zeros(0, np.int64)


class Recorder:
    """Stands in for the library's mq_routed_forward: records each call's routing and wall time while on."""

    def __init__(self, fn):
        self.fn, self.on, self.calls = fn, False, []

    def __call__(self, *a):
        t0 = time.perf_counter()
        rc = self.fn(*a)
        t1 = time.perf_counter()
        if self.on:
            self.calls.append((a, int64s(a[P_ARG], a[NP_ARG]), int64s(a[PICK_ARG], a[NPICK_ARG]), 1000 * (t1 - t0),
                               t0))
        return rc


def evened(pe, picked):
    """The same pairs' count dealt evenly over the same experts (the first ones get the remainder)."""
    ids = picked if len(picked) else np.unique(pe[pe >= 0])
    mine = np.isin(pe, ids)
    n = int(mine.sum())
    out = pe.copy()
    out[np.flatnonzero(mine)] = np.sort(np.resize(ids, n))
    return out


def replay(calls, pes, paced=False):
    """ms of each call run alone, in order, on its own buffers (x random: the values do not move the time). paced:
    each call starts as long after the one before as it did in situ (the kernel's threads idle as long between)."""
    times, last = [], None
    for i, ((a, _, picked, _, _), pe) in enumerate(zip(calls, pes)):
        a = list(a)
        x = torch.randn(a[N_ARG], a[H_ARG], dtype=torch.float32 if a[XF32_ARG] else torch.bfloat16)
        out = torch.zeros(a[OROWS_ARG], a[H_ARG], dtype=torch.float32 if a[OF32_ARG] else torch.bfloat16)
        index = torch.empty(2 * len(pe) + 2 * a[E_ARG] + 1, dtype=torch.int64)
        pe_t, pick = torch.from_numpy(pe), np.ascontiguousarray(picked)
        a[X_ARG], a[XSTRIDE_ARG], a[P_ARG] = x.data_ptr(), x.stride(0), pe_t.data_ptr()
        a[OUT_ARG], a[OSTRIDE_ARG], a[INDEX_ARG] = out.data_ptr(), out.stride(0), index.data_ptr()
        a[PICK_ARG] = pick.ctypes.data if len(pick) else None
        if paced and i and calls[i][4] - calls[i - 1][4] < 0.1:
            while time.perf_counter() - last < calls[i][4] - calls[i - 1][4]:
                pass
        t0 = last = time.perf_counter()
        cpu_quant._check_rc(recorder.fn(*a))
        times.append(1000 * (time.perf_counter() - t0))
    return times


leave_a_core_to_the_gpu_thread()
device = torch.device(args.device)
shape, layers = args.shape.split(":")
cfg = shape_config(shape, int(layers))
model, banks = synthetic_model(cfg, torch.bfloat16, device, pinned=device.type == "cuda", context=256,
                               expert_format=args.expert_format)
lib = cpu_quant._loaded()
recorder = Recorder(lib.mq_routed_forward)
lib.mq_routed_forward = recorder  # prepare_routed binds whatever the attribute is when it prepares
n_layers, n_exp = len(banks), cfg.num_experts
ex = OffloadExecutor(banks, [[False] * n_exp for _ in range(n_layers)], device, lambda loads: (sorted(loads), []))
measure_decode(model, ex, cfg, device, torch.bfloat16, args.batch, 4)  # warm-up
recorder.on = True
r = measure_decode(model, ex, cfg, device, torch.bfloat16, args.batch, args.steps)
recorder.on = False
calls = [c for c in recorder.calls if c[0][NP_ARG] <= args.batch * cfg.num_experts_per_tok]  # not the prompt's
print(f"{args.shape} {args.expert_format}, batch {args.batch}: {r.tok_s:.1f} tok/s, {len(calls)} CPU calls, "
      f"kernel {cpu_quant.describe()}")

sizes = []
for a, pe, picked, _, _ in calls:
    ids = picked if len(picked) else np.unique(pe[pe >= 0])
    per = np.array([(pe == e).sum() for e in ids])
    sizes.append((len(ids), per.mean(), per.max()))
experts = [s[0] for s in sizes]
print(f"experts a call: mean {statistics.mean(experts):.1f} (min {min(experts)}, max {max(experts)}); "
      f"tokens an expert: mean {statistics.mean(s[1] for s in sizes):.2f}, largest in a call: median "
      f"{statistics.median(s[2] for s in sizes):.0f}, max {max(s[2] for s in sizes)}")
in_situ = [c[3] for c in calls]
rounds = {"in situ": in_situ}
for name in ("alone", "alone, even", "alone, paced", "alone ", "alone, even ", "alone, paced "):  # in turns
    pes = [c[1] if "even" not in name else evened(c[1], c[2]) for c in calls]
    rounds[name] = replay(calls, pes, paced="paced" in name)
print(f"\n{'calls':<14}{'median ms':>10}{'mean ms':>10}{'total ms':>10}")
for name, t in rounds.items():
    print(f"{name:<14}{statistics.median(t):>10.3f}{statistics.mean(t):>10.3f}{sum(t):>10.1f}")
