"""Where does a decode step's time go? torch.profiler over a few steps of a synthetic model, experts on the CPU.

Usage (GPU box): python3 tests/perf/profile_decode.py SHAPE LAYERS [THREADS]
"""
import sys
import time

import torch

from engine.bench import measure_decode
from engine.latency_model import fit_latency_model
from engine.offload import OffloadExecutor
from engine.placement import assign_offloaded
from engine.profiler import profile_expert
from engine.synthetic import shape_config, synthetic_model

shape, layers = sys.argv[1], int(sys.argv[2])
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 15
torch.set_num_threads(threads)
device = torch.device("cuda")
cfg = shape_config(shape, layers)
model, banks = synthetic_model(cfg, torch.bfloat16, device, pinned=True, context=512)
prof = profile_expert(banks[0][0][0], banks[0][1][0], device, cpu_tokens=(1, 2, 4), gpu_tokens=(1, 4))
costs = fit_latency_model(prof)
print("cpu_ms", prof["cpu_expert_ms"], "copy", round(prof["copy_expert_ms"], 2))
on_gpu = [[False] * cfg.num_experts for _ in banks]
for name, decide in [("cpu-only", lambda loads: (sorted(loads), [])),
                     ("balanced", lambda loads: assign_offloaded(loads, costs))]:
    ex = OffloadExecutor(banks, on_gpu, device, decide)
    r = measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 24)
    tokens = 23
    print(f"{name:<10} threads={threads} decode {r.tok_s:.2f} tok/s  per token {1000 / r.tok_s:.1f} ms;",
          {k: (round(v / tokens, 2) if isinstance(v, float) else v) for k, v in ex.stats.as_dict().items()})
ex = OffloadExecutor(banks, on_gpu, device, lambda loads: (sorted(loads), []))
measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 4)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
    measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 6)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=40))
