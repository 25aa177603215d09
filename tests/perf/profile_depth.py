"""Where does decode at a long context lose its time? Issue 42's 32k run: decode 16.7 tok/s at 512 and 8.5 at 32k on
the whole Mixtral shape with the same experts resident at both depths, so the difference is attention's (or
something else that grows with the context), far more than reading the cache once costs.

Usage (GPU box, repo root): OUT=dir python3 tests/perf/profile_depth.py [SHAPE:LAYERS] [--depths 512,32768]
[--graphs on,off] [--expert-format q4_k]   (under 150 s on the H200 with the defaults)
MLA (issue 41, decode at 8k >= 0.8x decode at 512): `profile_depth.py deepseek-v3:4 --depths 512,8192,32768`; the
first three layers are dense, the fourth has DeepSeek-V3's 256 experts. There the path beside the split kernel is
the eager absorbed form (torch ops over [heads, positions] scores), labelled "eager".
Every expert resident on the GPU, so a step is the non-expert work plus the GPU experts. Per decode attention (the
split kernel, then SDPA with MOEDESK_NO_SPLIT_DECODE=1), graphs on and off, and depth: the ms of a decode step
(bench/depth.py's measure_at_depth). Then, per attention, a torch.profiler table of eager decode steps at the deepest
depth alone (the context's prefill and the first step are outside it), per step. The whole output goes to
$OUT/profile_depth.txt (OUT unset: the current folder); the short table is printed last.
"""
import argparse
import os
import time
from contextlib import contextmanager

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
parser.add_argument("--profiled-steps", type=int, default=6)
parser.add_argument("--budget-s", type=float, default=140, help="a profile that would end past it is skipped")
parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
args = parser.parse_args()

out_dir = os.environ.get("OUT") or "."
os.makedirs(out_dir, exist_ok=True)
report = open(os.path.join(out_dir, "profile_depth.txt"), "w")
started = time.perf_counter()


def say(text: str = "") -> None:
    print(text, flush=True)
    report.write(text + "\n")
    report.flush()


shape, layers = args.spec.split(":")
cfg = shape_config(shape, int(layers))
depths = [int(d) for d in args.depths.split(",")]
device, dtype, tokens = torch.device(args.device), torch.bfloat16, 24
model, banks = synthetic_model(cfg, dtype, device, pinned=device.type == "cuda", context=depth_context(max(depths), tokens, 512),
                               expert_format=args.expert_format)
ex = OffloadExecutor(banks, [[True] * cfg.num_experts for _ in banks], device, lambda loads: (sorted(loads), []))
say(f"model built in {time.perf_counter() - started:.0f} s")


ATTENTIONS = ("split", "eager" if cfg.kv_lora_rank else "sdpa")  # MLA's unsplit decode is the absorbed form in torch


def use(attention: str) -> None:
    os.environ["MOEDESK_NO_SPLIT_DECODE"] = "" if attention == "split" else "1"


rows, deepest_s = [], 0.0
for attention in ATTENTIONS:
    use(attention)
    for graphs in args.graphs.split(","):
        for depth in depths:
            run_started = time.perf_counter()
            t = measure_at_depth(model, ex, device, dtype, random_prompt(depth + 512, cfg.vocab_size, depth), depth,
                                 decode_tokens=tokens, graphs=graphs == "on")
            rows.append((attention, graphs, depth, 1000 * t.decode_s / t.decode_steps, 512 / t.prefill_s))
            if depth == max(depths):
                deepest_s = max(deepest_s, time.perf_counter() - run_started)
            say(f"{attention} graphs {graphs} depth {depth}: {rows[-1][3]:.2f} ms a step "
                f"({time.perf_counter() - started:.0f} s)")


@contextmanager
def profiled(holder: list):
    acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (device.type == "cuda")
    with torch.profiler.profile(activities=acts) as prof:
        yield
    holder.append(prof)


# Eager steps, so that each kernel is its own row; only the timed decode steps at the deepest depth are inside.
deepest = max(depths)
for attention in ATTENTIONS:
    if time.perf_counter() - started + deepest_s > args.budget_s:
        say(f"\n{attention}: profile skipped, it would end past {args.budget_s:.0f} s")
        continue
    use(attention)
    holder: list = []
    t = measure_at_depth(model, ex, device, dtype, random_prompt(deepest + 512, cfg.vocab_size, 1), deepest,
                         decode_tokens=args.profiled_steps + 2, graphs=False, around_decode=profiled(holder))
    averages = holder[0].key_averages()
    say(f"\n{attention}: {t.decode_steps} eager decode steps at depth {deepest} "
        f"({1000 * t.decode_s / t.decode_steps:.2f} ms a step under the profiler); totals over those steps")
    say(averages.table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total", row_limit=25))
    say(averages.table(sort_by="self_cpu_time_total", row_limit=12))
os.environ["MOEDESK_NO_SPLIT_DECODE"] = ""

say(f"\n{args.spec}, every expert on the GPU ({args.expert_format}); decode step ms, its growth per layer from the "
    f"shallowest depth, prefill-512 tok/s ({time.perf_counter() - started:.0f} s in all)")
say(f"{'attention':<10}{'graphs':<8}{'depth':>7}{'step ms':>9}{'+ms/layer':>10}{'prefill':>9}")
shallow = {(a, g): ms for a, g, d, ms, _ in rows if d == min(depths)}
for attention, graphs, depth, ms, pre in rows:
    grown = (ms - shallow[attention, graphs]) / cfg.num_layers
    say(f"{attention:<10}{graphs:<8}{depth:>7}{ms:>9.2f}{grown:>10.3f}{pre:>9.0f}")
report.close()
