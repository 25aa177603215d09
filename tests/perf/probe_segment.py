"""Probe (GPU box; python3 tests/perf/probe_segment.py): what does a decode step's GPU work consist of?
Qwen3 shape, 12 layers, every expert on the CPU (so the GPU runs only the graphs: attention, norms, router,
the ordered sum), batch 1: kernels and copies per step by name, and the GPU time they add up to."""
import collections

import torch

from engine.bench import measure_decode
from qwen3_probe_model import qwen3_all_in_ram
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("no triton:", e)
device, cfg, model, ex = qwen3_all_in_ram()
acts = [torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=acts) as p:
    measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 6)
names = collections.Counter()
total = collections.Counter()
for e in p.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        names[e.name[:60]] += 1
        total[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
steps = 6
print(f"GPU kernels/copies per step: {sum(names.values()) / steps:.0f}; GPU busy per step {sum(total.values()) / steps / 1e3:.2f} ms")
for n, c in names.most_common():
    print(f"{c / steps:7.1f}/step {total[n] / c:8.1f} us  {n}")
