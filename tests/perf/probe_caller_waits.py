"""Probe (GPU box; python3 tests/perf/probe_caller_waits.py): does decode gain when the thread that drives the GPU
leaves the CPU experts' streaming to the workers? Streaming evicts that thread's caches, and the Python it runs
next (the executor, the kernel's wrapper, the next graph's launch) runs cold: tests/perf/probe_kernel_trace.py
timed the wrapper's checks at 9.0 µs right after a call and 3.0 µs once more. Qwen3 shape, 12 layers, every
expert on the CPU, batch 1 and 16, the caller computing its share or only waiting, alternated over rounds."""
import statistics

import torch

from engine.bench import measure_decode
from engine.orchestration import leave_a_core_to_the_gpu_thread
from kernels import cpu_experts as ce
from qwen3_probe_model import qwen3_all_in_ram

leave_a_core_to_the_gpu_thread()
device, cfg, model, ex = qwen3_all_in_ram()
lib = ce._state["lib"]
runs = {}
for _ in range(3):
    for batch in (1, 16):
        for computes in (1, 0):
            lib.moe_set_caller_computes(computes)
            r = measure_decode(model, ex, cfg, device, torch.bfloat16, batch, 48)
            runs.setdefault((batch, computes), []).append(r.tok_s)
lib.moe_set_caller_computes(1)
print(f"threads {ce.get_num_threads()}; decode tok/s per round")
for (batch, computes), xs in runs.items():
    print(f"batch {batch:>2}, caller {'computes' if computes else 'waits   '}: "
          + " ".join(f"{x:7.1f}" for x in xs) + f"   median {statistics.median(xs):7.1f}")
