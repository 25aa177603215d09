"""The GPU expert cache against the fixed placement, on routing replayed from traces (docs/expert-cache.md).

A synthetic model of a real shape is built and profiled as `moedesk bench` builds it; its router is replaced by
a trace (engine.offload.routing_trace.replace_router) of the CONVERSATION preset (recent-use locality) and of
NO_LOCALITY. The fixed placement is planned from another conversation of the same model, as calibration
would, as the engine plans it without a cache (whole layers where the latency model says they pay); the cache
starts from the placement the engine plans with one (the same popularity, expert by expert over every layer) and
follows the routing. "fixed, per expert" is that second placement held fixed: what the cache adds to it. Decode
of one sequence, eager (a replayed router runs outside CUDA graphs, for all), tokens per second and the GPU hit
rate of the timed steps.

    python3 tests/perf/bench_expert_cache.py --shape qwen3-30b-a3b --layers 12 --gpu-budget 4
    python3 tests/perf/bench_expert_cache.py --shape tiny-moe --device cpu --decode-tokens 24   (a dry run)
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from moedesk.bench.synthetic import measure_decode, prepare_synthetic
from moedesk.engine.offload.expert_cache import CachePolicy
from moedesk.engine.offload.routing_trace import (CONVERSATION, NO_LOCALITY, TraceRouter, TraceShape, replace_router,
                                                  step_counts, synthetic_trace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--gpu-budget", type=float, default=4.0, metavar="GiB")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--expert-format", default="dense")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--intervals", default="1,16", help="swap rounds every N steps, each tried")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    bench = prepare_synthetic(args.shape, args.layers, args.gpu_budget, args.device, 64 + args.decode_tokens,
                              log=log, expert_format=args.expert_format)
    cfg, executor, orchestra = bench.cfg, bench.executor, bench.orchestra
    layers = sorted(bench.banks)
    shape = TraceShape(len(layers), cfg.num_experts, cfg.num_experts_per_tok)
    budget = bench.expert_budget  # what the whole-GPU budget leaves experts (bench.budget)
    rows = []
    for name, params in (("conversation", CONVERSATION), ("no locality", NO_LOCALITY)):
        calibration = sum(step_counts(s, shape.experts) for s in synthetic_trace(shape, 300, params, seed=99))
        trace = list(synthetic_trace(shape, args.decode_tokens + 8, params, seed=5))
        fixed = None
        for label, interval in [("fixed", None), ("fixed, per expert", 0),
                                *((f"cache every {n}", n) for n in map(int, args.intervals.split(",")))]:
            executor.follow_routing(None)
            orchestra.cache = None if interval is None else CachePolicy(interval=max(1, interval))
            orchestra.place(budget, popularity=calibration.tolist())
            if interval == 0:
                executor.follow_routing(None)
            replace_router(bench.model, TraceRouter(trace, layers, shape.top_k))
            result = measure_decode(bench.model, executor, cfg, bench.device, bench.dtype, 1, args.decode_tokens,
                                    graphs=False)
            replace_router(bench.model, None)
            stats = executor.stats.as_dict()
            fixed = fixed or result.tok_s
            rows.append({"trace": name, "placement": label, "experts_on_gpu": orchestra.placement.experts_on_gpu,
                         "whole_layers": int(orchestra.placement.on_gpu.all(axis=1).sum()),
                         "tok_s": round(result.tok_s, 2), "vs_fixed": round(result.tok_s / fixed, 3),
                         "gpu_hit_rate": stats["gpu_hit_rate"],
                         "swaps_per_step": round(stats["expert_swaps"] / (args.decode_tokens - 2), 2)})
    executor.follow_routing(None)
    orchestra.cache = None
    header = bench.header()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=1)
    print(f"{args.shape} x{cfg.num_layers}, {len(layers) * cfg.num_experts} experts, a {args.gpu_budget:.4g} GiB GPU "
          f"budget, {budget / 2**30:.4g} GiB of it for experts, {header['experts']}, {bench.device}")
    print(f"{'trace':<14}{'placement':<19}{'resident':>9}{'whole':>6}{'tok/s':>8}{'vs fixed':>10}{'GPU hits':>10}"
          f"{'swaps/step':>12}")
    for r in rows:
        hit = "-" if r["gpu_hit_rate"] is None else f"{r['gpu_hit_rate']:.0%}"
        print(f"{r['trace']:<14}{r['placement']:<19}{r['experts_on_gpu']:>9}{r['whole_layers']:>6}{r['tok_s']:>8.1f}"
              f"{r['vs_fixed']:>9.2f}x{hit:>10}{r['swaps_per_step']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
