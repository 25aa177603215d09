"""The GPU expert cache against the fixed placement, on routing replayed from traces (docs/expert-cache.md).

A synthetic model of a real shape is built and profiled as `moedesk bench` builds it; its router is replaced by
a trace (engine.offload.routing_trace.replace_router) of the CONVERSATION preset (recent-use locality) and of
NO_LOCALITY. Popularity is counted from another conversation of the same model (a trace of the same preset,
another seed), as calibration would count it, not shrunk toward even routing (the engine's calibration would
shrink it: these counts keep the model's static skew for the fixed placement). The fixed placement is planned
from it as the engine plans it (whole layers where the latency model says they pay); the cache starts from that
same placement, whole layers kept, and swaps within the layers partly resident where the latency model says a swap
pays (engine.offload.expert_cache.SwapPrice). "cache every N, per expert" starts from a placement made expert by
expert over every layer instead (the cache before session 35): what keeping whole layers is worth. Decode of one
sequence, eager (a replayed router runs outside CUDA graphs, for all), on the same prompt and trace in every case;
the first --warmup decode steps are untimed in every case (the cache starts learning there, as in a conversation's
first tokens); tokens per second, its noise (standard error over the timed steps) and the GPU hit rate of the
timed steps.

Where the traces' parameters come from (engine.offload.routing_trace, docs/expert-cache.md): llama.cpp #27861
measured, on a 512-expert top-10 model, little static skew and strong recent-use locality (a per-layer LRU of 64
experts hit ~67%, of 128 ~81%; a static top-32 covered ~10%); CONVERSATION (skew 0.35, reuse 0.8, window 16)
reproduces those three figures on that shape (tests/offload/test_expert_cache.py). llama.cpp #24524's "10% of the
experts take ~80% of hits" is a share of its CPU-side cache's hits, not of all selections, over an unstated span:
CONVERSATION gives the top 10% of a layer's experts 74% of 64 steps' selections on the 512-expert shape, 36% on
Qwen3's 128 and 21% on Mixtral's 8 (there 10% is less than one expert), less over longer spans. Locality is a
property of many experts: with 8 a layer and a 16-step reuse window nearly every expert is recent, so on Mixtral
the trace leaves a cache little to follow; on Qwen3-30B-A3B (128 a layer, top-8), where whole layers are costly
and per-expert caching is the natural unit, it leaves much.

Cases run in the order issue 42's targets need them, so that a run cut short has the ratios first:
    conversation fixed, conversation cache every I1 (target >= 1.25x), no locality fixed, no locality cache every
    I1 (target >= 0.98x); then each further interval of --intervals on both traces; then "cache every I1, per expert"
    (skipped where that placement is the fixed one).
--json is rewritten after every case; with --time-limit a case starts only where the slowest case so far would
still end in time, so the run ends on its own with what it finished rather than being cut mid-case.
tests/perf/expert_cache_targets.sh runs both shapes in one device command.

Time on the GPU box, predicted (not measured): the whole Mixtral-8x7B shape with q4_k experts at 16 GiB: start-up
~10 s, build 42 s (session 33), profile ~0 s with --reuse-profile after a bench of the same shape and format on the
machine (otherwise 10-30 s), traces ~1 s; each case (placement <= 13 GB over PCIe, a 32-token prompt, 16 + 96 decode
steps at 9-11 tok/s eager, session 34) ~12 s: the four target cases ~50 s, ~110-140 s with the two per-expert ones.
Qwen3-30B-A3B whole at 8 GiB: build ~25 s (16 GB of q4_k), traces ~5 s, cases ~4-8 s each: ~60-90 s in all.
96 timed steps: if a step's time varies by 10% (how many of its experts are resident), a rate's standard error
is 1% and a ratio's 1.5%, well inside 1.25x; the table shows it beside each ratio.

    python3 tests/perf/bench_expert_cache.py --shape mixtral-8x7b --expert-format q4_k --gpu-budget 16 \\
        --reuse-profile --time-limit 190 --json expert_cache.json
    python3 tests/perf/bench_expert_cache.py --shape tiny-moe --device cpu --gpu-budget 0.003 --decode-tokens 24 \\
        --warmup 4   (a dry run)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from moedesk.engine.offload.routing_trace import (CONVERSATION, NO_LOCALITY, TraceParams, TraceRouter, TraceShape,
                                                  replace_router, step_counts, synthetic_trace)

TRACES = {"conversation": CONVERSATION, "no locality": NO_LOCALITY}
CALIBRATION_STEPS = 300  # the other conversation popularity is calibrated from, in two halves


@dataclass(frozen=True)
class Case:
    trace: str  # a key of TRACES
    placement: str
    interval: int | None  # None: the placement fixed; N: swaps every N steps
    whole_layers: bool = True  # False: the placement made expert by expert over every layer


def case_plan(intervals: list[int]) -> list[Case]:
    """The cases in the order the targets need them: each trace's fixed placement beside the first interval's
    cache (conversation first), then the other intervals, then the first interval's cache started per expert."""
    def both(label: str, interval: int | None, whole_layers: bool = True) -> list[Case]:
        return [Case(trace, label, interval, whole_layers) for trace in TRACES]

    first, *others = intervals
    plan = [case for pair in zip(both("fixed", None), both(f"cache every {first}", first)) for case in pair]
    for n in others:
        plan += both(f"cache every {n}", n)
    return plan + both(f"cache every {first}, per expert", first, whole_layers=False)


def fits(elapsed: float, limit: float | None, durations: list[float], margin: float = 5.0) -> bool:
    """Whether a case started `elapsed` seconds into the run ends before `limit`, priced as the slowest case so far
    (the first one: whenever any time is left)."""
    if limit is None:
        return True
    return elapsed + (max(durations) + margin if durations else 0.0) < limit


def calibration_halves(shape: TraceShape, params: TraceParams, seed: int = 99) -> list[list[list[int]]]:
    """Selections per [layer, expert] of another conversation of the same model, in two halves (as the engine's
    calibration gives them to ExpertOrchestra.calibrate: prepare_synthetic's, in place of its calibration decodes)."""
    counts = [step_counts(s, shape.experts) for s in synthetic_trace(shape, CALIBRATION_STEPS, params, seed=seed)]
    half = len(counts) // 2
    return [sum(counts[:half]).tolist(), sum(counts[half:]).tolist()]


def ratio_noise(a: float | None, b: float | None) -> float | None:
    """Relative noise of a ratio of two independent rates from theirs."""
    return None if a is None or b is None else math.hypot(a, b)


def write_json(path: str, report: dict) -> None:
    """Whole or not at all: a run cut while writing keeps the previous case's file."""
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--gpu-budget", type=float, default=4.0, metavar="GiB")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--expert-format", default="dense")
    parser.add_argument("--decode-tokens", type=int, default=112, help="tokens decoded per case, warm-up included")
    parser.add_argument("--warmup", type=int, default=16, help="the first decode steps of each case, untimed")
    parser.add_argument("--intervals", default="16,1", help="swap rounds every N steps, each tried, the first first")
    parser.add_argument("--reuse-profile", action="store_true",
                        help="the profile an earlier bench stored for this shape and format on this machine")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="start no case that would end more than S seconds after this script started")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    try:
        intervals = [int(n) for n in args.intervals.split(",")]
    except ValueError:
        parser.error(f"--intervals {args.intervals!r}: expected steps separated by commas, e.g. 16,1")
    if min(intervals) < 1 or not 1 <= args.warmup <= args.decode_tokens - 3:
        parser.error("intervals must be >= 1 and --warmup in 1..--decode-tokens - 3 (two steps timed at least)")

    from moedesk.bench.synthetic import measure_decode, prepare_synthetic
    from moedesk.engine.load.synthetic import shape_config
    from moedesk.engine.offload.expert_cache import CachePolicy

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cfg = shape_config(args.shape, args.layers)
    shape = TraceShape(sum(map(cfg.is_moe_layer, range(cfg.num_layers))), cfg.num_experts, cfg.num_experts_per_tok)
    t = time.monotonic()
    calibrations = {name: calibration_halves(shape, params) for name, params in TRACES.items()}
    traces = {name: list(synthetic_trace(shape, args.decode_tokens + 8, params, seed=5))
              for name, params in TRACES.items()}
    log(f"traces in {time.monotonic() - t:.1f}s")
    t = time.monotonic()
    bench = prepare_synthetic(args.shape, args.layers, args.gpu_budget, args.device, 64 + args.decode_tokens, log=log,
                              expert_format=args.expert_format, reprofile=not args.reuse_profile,
                              calibration=calibrations["conversation"])
    executor, orchestra = bench.executor, bench.orchestra
    layers = sorted(bench.banks)
    budget = bench.expert_budget  # what the whole-GPU budget leaves experts (bench.budget)
    report = {**bench.header(), "decode_tokens": args.decode_tokens, "warmup_steps": args.warmup,
              "prepare_s": round(time.monotonic() - t, 1), "rows": [], "skipped": [],
              "same_as_fixed": [], "complete": False}
    fixed: dict[str, dict] = {}
    fixed_plans: dict[str, np.ndarray] = {}
    durations: list[float] = []
    for case in case_plan(intervals):
        elapsed = time.monotonic() - started
        if not fits(elapsed, args.time_limit, durations):
            log(f"{case.trace}, {case.placement}: skipped ({elapsed:.0f} s of {args.time_limit:.0f} gone, "
                f"a case takes up to {max(durations, default=0):.0f} s)")
            report["skipped"].append(f"{case.trace}, {case.placement}")
            continue
        t = time.monotonic()
        executor.follow_routing(None)
        orchestra.cache = None if case.interval is None else CachePolicy(interval=case.interval)
        plan = orchestra.place(budget, popularity=np.add(*calibrations[case.trace]).tolist(),
                               whole_layers=case.whole_layers)
        if not case.whole_layers and np.array_equal(plan.on_gpu, fixed_plans.get(case.trace)):
            log(f"{case.trace}, {case.placement}: not run, the same placement as fixed")
            report["same_as_fixed"].append(f"{case.trace}, {case.placement}")
            continue
        if case.interval is None:
            fixed_plans[case.trace] = plan.on_gpu
        replace_router(bench.model, TraceRouter(traces[case.trace], layers, shape.top_k))
        try:
            result = measure_decode(bench.model, executor, cfg, bench.device, bench.dtype, 1, args.decode_tokens,
                                    graphs=False, warmup=args.warmup)
        finally:
            replace_router(bench.model, None)
        stats = executor.stats.as_dict()
        timed = args.decode_tokens - 1 - args.warmup
        base = fixed.setdefault(case.trace, {"tok_s": result.tok_s, "noise": result.noise})
        row = {"trace": case.trace, "placement": case.placement, "experts_on_gpu": orchestra.placement.experts_on_gpu,
               "whole_layers": int(plan.on_gpu.all(axis=1).sum()), "timed_steps": timed,
               "tok_s": round(result.tok_s, 2), "noise": None if result.noise is None else round(result.noise, 4),
               "vs_fixed": round(result.tok_s / base["tok_s"], 3),
               "vs_fixed_noise": None if case.interval is None else _round(ratio_noise(result.noise, base["noise"])),
               "gpu_hit_rate": stats["gpu_hit_rate"], "swaps_per_step": round(stats["expert_swaps"] / timed, 2),
               "selections": executor.stats.selections,  # (token, expert) pairs of the timed steps: alike in all
               "seconds": round(time.monotonic() - t, 1)}
        durations.append(time.monotonic() - t)
        report["rows"].append(row)
        log(f"{case.trace}, {case.placement}: {row['tok_s']} tok/s, {row['vs_fixed']}x fixed, in {row['seconds']} s")
        if args.json:
            write_json(args.json, report)
    executor.follow_routing(None)
    orchestra.cache = None
    report["complete"] = not report["skipped"]
    report["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        write_json(args.json, report)
    print(f"{args.shape} x{cfg.num_layers}, {len(layers) * cfg.num_experts} experts, a {args.gpu_budget:.4g} GiB GPU "
          f"budget, {budget / 2**30:.4g} GiB of it for experts, {report['experts']}, {bench.device}; "
          f"{args.warmup} + {args.decode_tokens - 1 - args.warmup} decode steps a case, the first untimed")
    print(format_rows(report["rows"]))
    for name in report["skipped"]:
        print(f"skipped at the time limit: {name}")
    for name in report["same_as_fixed"]:
        print(f"not run, its placement is the fixed one: {name}")
    return 0


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def format_rows(rows: list[dict]) -> str:
    """The table of cases (also issue42_targets.sh's summary)."""
    lines = [f"{'trace':<14}{'placement':<28}{'resident':>9}{'whole':>6}{'tok/s':>8}{'vs fixed':>15}{'GPU hits':>10}"
             f"{'swaps/step':>12}"]
    for r in rows:
        hit = "-" if r["gpu_hit_rate"] is None else f"{r['gpu_hit_rate']:.0%}"
        noise = f" ±{r['vs_fixed_noise']:.1%}" if r.get("vs_fixed_noise") is not None else ""
        ratio = f"{r['vs_fixed']:.2f}x{noise}"
        lines.append(f"{r['trace']:<14}{r['placement']:<28}{r['experts_on_gpu']:>9}{r['whole_layers']:>6}"
                     f"{r['tok_s']:>8.1f}{ratio:>15}{hit:>10}{r['swaps_per_step']:>12.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
