"""Probe (GPU box; python3 tests/perf/probe_streamed_decode.py [qwen3|mixtral] [ROUNDS] [MAX]): decode speed at batch 1 as a
function of how many of each token's experts the GPU streams from pinned RAM (kernels.gpu_zero_copy) while the CPU
computes the rest. One model, one process, the counts interleaved over rounds, so the machine is the same for all.
Prints tok/s per count (median of the rounds) and what the profile-based rule (engine.offload.assignment.zero_copy_ranks)
would pick."""
import statistics
import sys

import torch

from moedesk.bench.synthetic import measure_decode
from moedesk.engine.offload.latency_model import fit_latency_model
from moedesk.engine.offload.offload_executor import OffloadExecutor
from moedesk.engine.offload.assignment import zero_copy_ranks
from moedesk.engine.offload.profiler import profile_expert, profile_zero_copy
from moedesk.engine.load.synthetic import shape_config, synthetic_model

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3"
shape, layers = {"qwen3": ("qwen3-30b-a3b", 12), "mixtral": ("mixtral-8x7b", 8)}[name]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
device = torch.device("cuda")
torch.set_num_threads(15)
cfg = shape_config(shape, layers)
model, banks = synthetic_model(cfg, torch.bfloat16, device, pinned=True, context=256)
first = next(iter(banks.values()))
k = cfg.num_experts_per_tok
costs = fit_latency_model({**profile_expert(first, device), **profile_zero_copy(first, k, device)})
counts = list(range(0, min(k, int(sys.argv[3]) if len(sys.argv) > 3 else 4) + 1))
chosen = {"ranks": 0}
executor = OffloadExecutor(banks, [[False] * cfg.num_experts for _ in banks], device, lambda loads: (sorted(loads), []),
                           zero_copy_ranks=lambda top_k: chosen["ranks"])
speeds = {g: [] for g in counts}
per_token = {}
for _ in range(rounds):
    for g in counts:
        chosen["ranks"] = g
        r = measure_decode(model, executor, cfg, device, torch.bfloat16, 1, 64 if name == "qwen3" else 24)
        speeds[g].append(r.tok_s)
        s = executor.stats
        steps = r.tokens - 2
        per_token[g] = (s.cpu_experts / steps, s.zero_copy_experts / steps, s.cpu_ms / steps, s.layer_ms / steps)
split = " ".join(f"{g}:{ms:.3f}" for g, ms in enumerate(costs.zero_copy_split_ms))
print(f"{shape} x{layers}: start-up split (streamed: ms) {split}; rule picks {zero_copy_ranks(k, costs)}")
print(f"{'streamed':>9}{'tok/s':>8}  {'runs':<36} cpu/tok streamed/tok cpu ms/tok host ms/tok")
for g in counts:
    runs = " ".join(f"{v:.1f}" for v in speeds[g])
    cpu, streamed, cpu_ms, host_ms = per_token[g]
    print(f"{g:>9}{statistics.median(speeds[g]):>8.1f}  {runs:<36} {cpu:>7.1f} {streamed:>12.1f} {cpu_ms:>10.2f} {host_ms:>11.2f}")
