"""What handing a decode step's MoE layers to the host through flags (kernels.host_handoff) saves at batch 1.

Usage (GPU box, repo root): python3 tests/perf/probe_handoff.py [SHAPE:LAYERS:FORMAT[:RESIDENT] ...] [--rounds N]
[--tokens N] [--shared-early] (default qwen3-30b-a3b:12:q4_k mixtral-8x7b:8:q4_0). Synthetic models of real shapes,
every expert in RAM and computed by the CPU, or with RESIDENT (a fraction) the first experts of every layer on the
GPU; per round, decode once with the step as one handed-over graph and once with a graph per segment
(MOEDESK_NO_HANDOFF=1), alternating, so drift hits both alike. --shared-early: the handed-over step with its layers'
shared experts computed after the host's results (MOEDESK_SHARED_EARLY=0), then beside the host's work (the
default). Prints per variant the median tok/s and, per step, the executor's time split into the wait for the GPU's
routing, the CPU experts' call and the rest.
"""
import argparse
import os
import statistics
import time

import torch

from moedesk.bench.synthetic import measure_decode
from moedesk.engine.load.synthetic import shape_config, synthetic_model
from moedesk.engine.offload.offload_executor import OffloadExecutor, StepStats
from moedesk.engine.offload.orchestration import leave_a_core_to_the_gpu_thread

parser = argparse.ArgumentParser()
parser.add_argument("shapes", nargs="*", default=["qwen3-30b-a3b:12:q4_k", "mixtral-8x7b:8:q4_0"])
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--tokens", type=int, default=48)
parser.add_argument("--shared-early", action="store_true",
                    help="shared experts after the host (MOEDESK_SHARED_EARLY=0) against beside it")
args = parser.parse_args()
device = torch.device("cuda")
leave_a_core_to_the_gpu_thread()
rows = []
for spec in args.shapes:
    shape, layers, fmt, *share = spec.split(":")
    share = float(share[0]) if share else 0.0
    cfg = shape_config(shape, int(layers))
    t0 = time.perf_counter()
    model, banks = synthetic_model(cfg, torch.bfloat16, device, pinned=True, context=256,
                                   expert_format="dense" if fmt == "bf16" else fmt)
    print(f"{spec}: built in {time.perf_counter() - t0:.0f}s", flush=True)
    resident = round(share * cfg.num_experts)
    ex = OffloadExecutor(banks, [[e < resident for e in range(cfg.num_experts)] for _ in banks], device,
                         lambda loads: (sorted(loads), []))
    variants = ({"handoff": {"MOEDESK_SHARED_EARLY": "0"}, "shared early": {}} if args.shared_early else
                {"handoff": {}, "graph per segment": {"MOEDESK_NO_HANDOFF": "1"}})
    results = {name: [] for name in variants}
    parts = {name: [] for name in results}
    measure_decode(model, ex, cfg, device, torch.bfloat16, 1, 8)  # warm-up: kernels built, threads up
    for _ in range(args.rounds):
        for name in results:
            for key in ("MOEDESK_NO_HANDOFF", "MOEDESK_SHARED_EARLY"):
                os.environ[key] = variants[name].get(key, "")
            r = measure_decode(model, ex, cfg, device, torch.bfloat16, 1, args.tokens)
            steps = args.tokens - 2
            s = ex.stats
            results[name].append(r.tok_s)
            parts[name].append((s.layer_ms / steps, s.wait_ms / steps, s.cpu_ms / steps))
            ex.stats = StepStats()
    os.environ["MOEDESK_NO_HANDOFF"] = os.environ["MOEDESK_SHARED_EARLY"] = ""
    for name, speeds in results.items():
        moe, wait, cpu = (statistics.median(p[i] for p in parts[name]) for i in range(3))
        rows.append((spec, name, statistics.median(speeds), min(speeds), max(speeds), moe, wait, cpu))
    del model, banks, ex
    torch.cuda.empty_cache()

print(f"\n{'shape':<30}{'variant':<20}{'tok/s':>8}{'min':>8}{'max':>8}{'step ms':>9}{'moe':>7}{'wait':>7}{'cpu':>7}")
for spec, name, tok_s, lo, hi, moe, wait, cpu in rows:
    print(f"{spec:<30}{name:<20}{tok_s:>8.1f}{lo:>8.1f}{hi:>8.1f}{1000 / tok_s:>9.2f}{moe:>7.2f}{wait:>7.2f}{cpu:>7.2f}")
