"""Where does a decode step's time go? Synthetic models of real shapes, one variant after another.

Usage (GPU box, repo root): python3 tests/perf/profile_decode.py [SHAPE:LAYERS ...] [--variants a,b]
[--spin US,US] [--no-trace] [--expert-format q4_0]   (default qwen3-30b-a3b:12 mixtral-8x7b:8, every variant, the kernel's default spin).
Per variant: tok/s and, per decode step, the executor's MoE time split into the wait for the GPU's routing,
the CPU experts' call and the host's bookkeeping, and the time outside the executor. Variants: every expert
resident on the GPU (the floor the non-expert work sets), all on the CPU through the native kernel, all on the
CPU through torch, and the balanced CPU/copy split. Then a torch.profiler table of the native CPU variant;
its trace goes to $OUT.
"""
import argparse
import os
import time

import torch

from moedesk.bench.synthetic import measure_decode
from moedesk.engine.offload.latency_model import fit_latency_model
from moedesk.engine.offload.offload_executor import OffloadExecutor, StepStats
from moedesk.engine.offload.orchestration import leave_a_core_to_the_gpu_thread
from moedesk.engine.offload.assignment import assign_offloaded
from moedesk.engine.offload.profiler import profile_expert
from moedesk.engine.load.synthetic import shape_config, synthetic_model
from moedesk.kernels import cpu_experts

parser = argparse.ArgumentParser()
parser.add_argument("shapes", nargs="*", default=["qwen3-30b-a3b:12", "mixtral-8x7b:8"])
parser.add_argument("--variants", default="gpu,native,native-eager,torch,balanced,balanced-eager")
parser.add_argument("--spin", default="", help="kernel worker spin times (µs) to try, comma-separated")
parser.add_argument("--no-trace", action="store_true")
parser.add_argument("--expert-format", default="dense", help="dense or a packed format (q4_0, q8_0, q4_k, ...)")
args = parser.parse_args()
spins = [int(v) for v in args.spin.split(",") if v] or [None]
out = os.environ.get("OUT", "/tmp")
device = torch.device("cuda")
leave_a_core_to_the_gpu_thread()
print("torch threads", torch.get_num_threads(), "| cpu experts:", cpu_experts.describe())
rows = []
for spec in args.shapes:
    shape, layers = spec.split(":")
    cfg = shape_config(shape, int(layers))
    t0 = time.perf_counter()
    model, banks = synthetic_model(cfg, torch.bfloat16, device, pinned=True, context=256,
                                   expert_format=args.expert_format)
    prof = profile_expert(banks[0], device, cpu_tokens=(1, 2, 4, 8), gpu_tokens=(1, 4))
    costs = fit_latency_model(prof)
    print(f"{spec}: built+profiled in {time.perf_counter() - t0:.0f}s; cpu ms {prof['cpu_expert_ms']} "
          f"copy {prof['copy_expert_ms']:.2f} ms")
    n_layers, n_exp = len(banks), cfg.num_experts
    cpu_only = lambda loads: (sorted(loads), [])  # noqa: E731
    balanced = lambda loads: assign_offloaded(loads, costs)  # noqa: E731
    variants = {"gpu": ("all on GPU", True, cpu_only, False, None), "native": ("CPU native", False, cpu_only, False, None),
                "native-eager": ("CPU native eager", False, cpu_only, False, False),
                "torch": ("CPU torch", False, cpu_only, True, None), "balanced": ("balanced", False, balanced, False, None),
                "balanced-eager": ("balanced eager", False, balanced, False, False)}
    runs = [(variants[v], spin) for v in args.variants.split(",") for spin in (spins if v != "gpu" else [None])]
    for (name, resident, decide, no_native, graphs), spin in runs:
        os.environ["MOEDESK_NO_NATIVE_KERNELS"] = "1" if no_native else ""
        if spin is not None:
            cpu_experts.set_spin_us(spin)
            name = f"{name} {spin}"
        ex = OffloadExecutor(banks, [[resident] * n_exp for _ in range(n_layers)], device, decide)
        for batch in (1, 16):
            measure_decode(model, ex, cfg, device, torch.bfloat16, batch, 4, graphs=graphs)  # warm-up
            ex.stats = StepStats()
            r = measure_decode(model, ex, cfg, device, torch.bfloat16, batch, 24, graphs=graphs)
            steps = 24 - 2  # measure_decode times (and restarts the stats for) all steps but the first
            s = ex.stats
            step_ms = 1000 * batch / r.tok_s
            moe, wait, cpu = s.layer_ms / steps, s.wait_ms / steps, s.cpu_ms / steps
            rows.append((spec, name, batch, r.tok_s, step_ms, moe, wait, cpu, moe - wait - cpu, step_ms - moe,
                         s.copied_experts / steps))
        del ex
        torch.cuda.empty_cache()
    os.environ["MOEDESK_NO_NATIVE_KERNELS"] = ""
    if args.no_trace:
        continue
    ex = OffloadExecutor(banks, [[False] * n_exp for _ in range(n_layers)], device, cpu_only)
    measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 4)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as p:
        measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 6)
    p.export_chrome_trace(os.path.join(out, f"trace-{shape}.json"))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=36))
    del model, banks, ex
    torch.cuda.empty_cache()

# Per decode step, in ms: moe = in the executor, of which wait (for the GPU's routing), cpu (the CPU experts'
# call) and host (bookkeeping, queueing GPU work); outside = the rest of the step (graph launches, sampling).
print(f"\n{'shape':<18}{'variant':<18}{'batch':>6}{'tok/s':>8}{'step':>8}{'moe':>8}{'wait':>8}"
      f"{'cpu':>8}{'host':>8}{'outside':>8}{'copied':>7}")
for spec, name, batch, tok_s, step, moe, wait, cpu, host, outside, copied in rows:
    print(f"{spec:<18}{name:<18}{batch:>6}{tok_s:>8.1f}{step:>8.2f}{moe:>8.2f}{wait:>8.2f}{cpu:>8.2f}{host:>8.2f}"
          f"{outside:>8.2f}{copied:>7.1f}")
