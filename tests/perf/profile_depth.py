"""Where does decode at a long context lose its time? Issue 42's 32k run read 17.4 tok/s at 512 and 10.8 at 32k on
the whole Mixtral shape with the same experts resident at both depths, so the difference is attention's (or
something else that grows with the context), far more than reading the cache once costs.

Usage (GPU box, repo root): python3 tests/perf/profile_depth.py [SHAPE:LAYERS] [--depths 512,32768] [--graphs on,off]
[--expert-format q4_k]
Every expert resident on the GPU, so a step is the non-expert work plus the GPU experts: per depth and per decode
attention (the split kernel, then SDPA with MOEDESK_NO_SPLIT_DECODE=1), and with CUDA graphs on and off, the ms of a
decode step (bench/depth.py's measure_at_depth); then a torch.profiler table of the deepest eager step, whose rows
say which kernels and host operations grow with the context.
"""
import argparse
import os

import torch

from moedesk.bench.depth import depth_context, measure_at_depth
from moedesk.bench.synthetic import random_prompt
from moedesk.engine.load.synthetic import shape_config, synthetic_model
from moedesk.engine.offload.offload_executor import OffloadExecutor

parser = argparse.ArgumentParser()
parser.add_argument("spec", nargs="?", default="mixtral-8x7b:8")
parser.add_argument("--depths", default="512,32768")
parser.add_argument("--graphs", default="on,off")
parser.add_argument("--expert-format", default="q4_k")
parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
args = parser.parse_args()

shape, layers = args.spec.split(":")
cfg = shape_config(shape, int(layers))
depths = [int(d) for d in args.depths.split(",")]
device, dtype, tokens = torch.device(args.device), torch.bfloat16, 24
model, banks = synthetic_model(cfg, dtype, device, pinned=device.type == "cuda", context=depth_context(max(depths), tokens, 512),
                               expert_format=args.expert_format)
ex = OffloadExecutor(banks, [[True] * cfg.num_experts for _ in banks], device, lambda loads: (sorted(loads), []))
rows = []
for attention in ("split", "sdpa"):
    os.environ["MOEDESK_NO_SPLIT_DECODE"] = "1" if attention == "sdpa" else ""
    for graphs in args.graphs.split(","):
        for depth in depths:
            t = measure_at_depth(model, ex, device, dtype, random_prompt(depth + 512, cfg.vocab_size, depth), depth,
                                 decode_tokens=tokens, graphs=graphs == "on")
            rows.append((attention, graphs, depth, 1000 * t.decode_s / t.decode_steps, 512 / t.prefill_s))
os.environ["MOEDESK_NO_SPLIT_DECODE"] = ""

acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (device.type == "cuda")
with torch.profiler.profile(activities=acts) as prof:
    measure_at_depth(model, ex, device, dtype, random_prompt(max(depths) + 512, cfg.vocab_size, 1), max(depths),
                     decode_tokens=8, graphs=False)
print(prof.key_averages().table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total", row_limit=20))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

print(f"{args.spec}, every expert on the GPU ({args.expert_format}); decode step ms and prefill-512 tok/s")
print(f"{'attention':<10}{'graphs':<8}{'depth':>7}{'step ms':>9}{'prefill':>9}")
for attention, graphs, depth, ms, pre in rows:
    print(f"{attention:<10}{graphs:<8}{depth:>7}{ms:>9.2f}{pre:>9.0f}")
