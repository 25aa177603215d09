"""Probe (GPU box): the native CPU experts call inside decode vs the same calls in a loop (Qwen3 shape, 12 layers,
all experts on the CPU). Usage: python3 tests/perf/probe_cpu_calls.py.
Where do the executor's cpu_ms per layer go: the C call itself, or the Python around it?"""
import statistics
import time

import numpy as np
import torch
from moedesk.bench.synthetic import measure_decode
from moedesk.engine.offload.offload_executor import OffloadExecutor, StepStats
from moedesk.engine.offload.orchestration import leave_a_core_to_the_gpu_thread
from moedesk.engine.load.synthetic import shape_config, synthetic_model
from moedesk.kernels import cpu_experts as ce

class Timed:
    """The kernel library with its two entry points timed (decode goes through the routed one)."""
    def __init__(self, lib): self.lib, self.times = lib, []
    def _timed(self, name, *a):
        t = time.perf_counter(); r = getattr(self.lib, name)(*a); self.times.append(time.perf_counter() - t); return r
    def moe_experts_forward(self, *a): return self._timed("moe_experts_forward", *a)
    def moe_routed_experts_forward(self, *a): return self._timed("moe_routed_experts_forward", *a)
    def __getattr__(self, k): return getattr(self.lib, k)

device = torch.device("cuda")
leave_a_core_to_the_gpu_thread()
cfg = shape_config("qwen3-30b-a3b", 12)
model, banks = synthetic_model(cfg, torch.bfloat16, device, pinned=True, context=256)
assert ce.available(), ce.unavailable_reason()
lib = ce._state["lib"]
timed = Timed(lib); ce._state["lib"] = timed
import moedesk.engine.offload.offload_executor as offload_module
wrapper_times = []
_routed = offload_module.experts_forward_routed
def timed_routed(*a, **k):
    t = time.perf_counter(); r = _routed(*a, **k); wrapper_times.append(time.perf_counter() - t); return r
offload_module.experts_forward_routed = timed_routed
E, H, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
expert_bytes = 3 * H * F * 2
cpu_only = lambda loads: (sorted(loads), [])
ex = OffloadExecutor(banks, [[False] * E for _ in banks], device, cpu_only)
rows = []
def summary(name, times, experts_per_call):
    ms = [t * 1e3 for t in times]
    gbs = experts_per_call * expert_bytes * len(times) / sum(times) / 1e9
    rows.append((name, statistics.median(ms), statistics.mean(ms), np.percentile(ms, 90), gbs))
for threads in (15, 16):
    ce.set_num_threads(threads)
    measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 4)
    timed.times.clear()
    wrapper_times.clear()
    r = measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 24)
    steps = 22
    s = ex.stats
    c = timed.times[-steps * 12:]
    w = wrapper_times[-steps * 12:]
    print(f"  experts_forward_routed {sum(w) / len(w) * 1e3:.3f} ms/layer (median {statistics.median(w) * 1e3:.3f}), "
          f"its C call {sum(c) / len(c) * 1e3:.3f} (median {statistics.median(c) * 1e3:.3f})")
    step_ms = 1e3 / r.tok_s
    print(f"decode threads={threads}: {r.tok_s:.1f} tok/s = {step_ms:.2f} ms/step; per layer: executor {s.layer_ms / steps / 12:.3f} "
          f"(wait for the routing {s.wait_ms / steps / 12:.3f}, CPU part {s.cpu_ms / steps / 12:.3f} of which the C call "
          f"{sum(c) / len(c) * 1e3:.3f}, the rest {(s.layer_ms - s.wait_ms - s.cpu_ms) / steps / 12:.3f}); "
          f"outside the executor {step_ms - s.layer_ms / steps:.2f} ms/step")
    summary(f"decode C thr={threads}", c, 8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, H).bfloat16()
    out = torch.empty(8, H, dtype=torch.bfloat16, pin_memory=True)
    layers = sorted(banks)
    for gap_us in (0, 150):
        timed.times.clear()
        for step in range(40):
            for layer in layers:
                ids = torch.randperm(E, generator=gen)[:8].sort().values
                rws = torch.zeros(8, dtype=torch.long); offs = torch.arange(9)
                ce.experts_forward(x, rws, ids, offs, banks[layer].gate_up, banks[layer].down, out=out, out_rows=torch.arange(8))
                if gap_us:
                    t = time.perf_counter() + gap_us / 1e6
                    while time.perf_counter() < t: pass
        summary(f"loop gap={gap_us} thr={threads}", timed.times[12:], 8)
    # one expert, repeated (what the profiler measures)
    timed.times.clear()
    for i in range(200):
        ce.experts_forward(x, torch.zeros(1, dtype=torch.long), torch.tensor([i % E]), torch.tensor([0, 1]),
                           banks[layers[i % 12]].gate_up, banks[layers[i % 12]].down)
    summary(f"one expert thr={threads}", timed.times[10:], 1)
    # all 12 layers' 8 experts of one layer bank in one call (96 groups): kernel throughput with long calls
    timed.times.clear()
    for i in range(30):
        ids = torch.randperm(E, generator=gen)[:96].sort().values
        ce.experts_forward(x, torch.zeros(96, dtype=torch.long), ids, torch.arange(97), banks[layers[0]].gate_up, banks[layers[0]].down)
    summary(f"96 experts/call thr={threads}", timed.times[2:], 96)
print(f"\n{'case':<28}{'median ms':>10}{'mean ms':>9}{'p90 ms':>9}{'GB/s':>8}")
for name, med, mean, p90, gbs in rows:
    print(f"{name:<28}{med:>10.3f}{mean:>9.3f}{p90:>9.3f}{gbs:>8.1f}")
