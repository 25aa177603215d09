"""The GPU expert cache against the fixed placement, in paired turns on the same routing (docs/expert-cache.md).

A synthetic model of a real shape is built and profiled as `moedesk bench` builds it; its router is replaced by
a trace (engine.offload.routing_trace.replace_router) of the CONVERSATION preset (recent-use locality) and of
NO_LOCALITY. Popularity is counted from another conversation of the same model (a trace of the same preset,
another seed), as calibration would count it, not shrunk toward even routing (the engine's calibration would
shrink it: these counts keep the model's static skew for the fixed placement). The fixed placement is planned
from it as the engine plans it (whole layers where the latency model says they pay); the cache starts from that
same placement, whole layers kept, and swaps within the layers partly resident where the latency model says a swap
pays (engine.offload.expert_cache.SwapPrice). "cache every N, per expert" starts from a placement made expert by
expert over every layer instead (the cache before session 35): what keeping whole layers is worth. "fixed again"
is the control: the fixed placement against itself, whose ratio says how far two identical placements differ here.
"every expert resident" (--ceiling) is the bound: what a cache or a prefetch that made every selection a hit without
a copy would gain at this budget (docs/measurements.md predicts it from the step's parts).

Paired rounds. Each pair keeps its two placements side by side, each in an executor of its own
(ExpertOrchestra.twin: its own GPU copies, so neither is re-copied between turns). Both replay one conversation:
an untimed warm-up round, then --rounds timed rounds, round r decoding the trace's positions r*T .. r*T + T - 1
(T = --decode-tokens: a 32-token prompt's prefill, then T - 1 decode steps, the first --warmup untimed) for both
placements, in the order fixed, other | other, fixed | fixed, other ... (ABBA), so that a drift of the machine
over the run falls on both alike. The cache's state (resident experts, decayed scores, copy credit) carries over
from each of its rounds to its next, and it keeps learning in all of them: a conversation's cache has seen every
earlier token, the fixed placement has seen the calibration, and neither sees a round's routing before it runs
it, so each round is the next stretch of one conversation for both. Each round's ratio is the other
placement's rate over the fixed one's; a pair reports the median ratio and the least and greatest of its rounds
(with 5 rounds the range holds the true median ratio 94% of the time, whatever the noise's shape). The standard
error within a round (over its steps, "step_se" in the JSON) says only how steady that round was.

What else makes two identical placements time differently in one process, and what the bench does about it:
  - first use: each executor's pinned staging buffers, remembered splits (RememberedSplit) and the allocator's
    blocks for the KV cache are made on first use, and the CPU's clocks rise under load: the untimed warm-up round
    of each placement pays them;
  - what one placement learned serving the other: none, each executor learns its own splits and cache;
  - the order of the turns (a placement that follows another's round): ABBA, and both read the same pinned host
    experts (built once, pinned at build); a step reads far more experts than the CPU's caches hold;
  - Python's garbage collection: collected before each round (what the build made frozen out of it) and off
    during it;
  - CUDA graphs: on where the engine decodes with them (CUDA, MOEDESK_NO_CUDA_GRAPHS unset), for both placements:
    the trace router steps on the device (TraceRouter), so the captured steps replay the trace. Each round's first
    decode step captures them (untimed); a swap of the cache rewrites the slot maps the graphs read in place, so its
    cost in the timed steps is its copies, not a capture (before session 39's in-place swaps it was). --eager
    replays eagerly (before session 38: the eager harness's Python diluted what a cache gains, most on
    Qwen3-30B-A3B: docs/measurements.md); the page cache: nothing is read from files after the build (the
    profile's JSON at most).
Out of its control: other work on the machine, the clocks and temperature of the CPU and GPU over the run, and
which NUMA node holds the pages of the experts each placement leaves in RAM (they differ between placements).
Both placements' copies are on the GPU at once, twice the budget (the H200 holds both; speed does not depend on
unused GPU memory).

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

Pairs run in the order issue 42's targets need them, so that a run cut short has the ratios first:
    conversation: cache every I1 (target >= 1.25x), no locality: cache every I1 (target >= 0.98x), the control
    (conversation, fixed again); then each further interval of --intervals on both traces; then "cache every I1,
    per expert" (skipped where that placement is the fixed one).
--json is rewritten after every pair; with --time-limit a pair starts only where the slowest pair so far would
still end in time, so the run ends on its own with what it finished rather than being cut mid-pair.
tests/perf/expert_cache_targets.sh runs both shapes in one device command (its time: docs/benchmarks.md).

    python3 tests/perf/bench_expert_cache.py --shape mixtral-8x7b --expert-format q4_k --gpu-budget 16 \\
        --reuse-profile --time-limit 190 --json expert_cache.json
    python3 tests/perf/bench_expert_cache.py --shape tiny-moe --device cpu --gpu-budget 0.003 --decode-tokens 12 \\
        --rounds 5   (a dry run)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from moedesk.engine.offload.routing_trace import (CONVERSATION, NO_LOCALITY, TraceRouter, TraceShape,
                                                  calibration_halves, replace_router, synthetic_trace)

TRACES = {"conversation": CONVERSATION, "no locality": NO_LOCALITY}
CONTROL = "fixed again"
CEILING = "every expert resident"


@dataclass(frozen=True)
class Pair:
    """The fixed placement against another on one trace."""
    trace: str  # a key of TRACES
    placement: str  # the other's name
    interval: int | None  # None: the fixed placement again (the control); N: a cache swapping every N steps
    whole_layers: bool = True  # False: the other placement made expert by expert over every layer
    every_expert: bool = False  # True: the other placement holds every expert (a budget the whole model fits)


def pair_plan(intervals: list[int], traces: tuple[str, ...] = tuple(TRACES), ceiling: bool = False) -> list[Pair]:
    """The pairs in the order the targets need them: the first interval's cache on each trace (conversation first),
    the control, then the other intervals, then the first interval's cache started per expert; only on `traces`
    (the control on the first of them). ceiling: after the control, every expert resident against the fixed
    placement, the bound on what any cache or prefetch of this budget can gain (every selection a hit, no copy)."""
    def both(label: str, interval: int, whole_layers: bool = True) -> list[Pair]:
        return [Pair(trace, label, interval, whole_layers) for trace in traces]

    first, *others = intervals
    plan = both(f"cache every {first}", first) + [Pair(traces[0], CONTROL, None)]
    if ceiling:
        plan.append(Pair(traces[0], CEILING, None, every_expert=True))
    for n in others:
        plan += both(f"cache every {n}", n)
    return plan + both(f"cache every {first}, per expert", first, whole_layers=False)


def turns(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in the order they run: round 0 the untimed warm-up, then rounds 1..`rounds`; the side going
    first alternates (fixed, other | other, fixed | ...: ABBA), so a drift over the run weighs on both alike."""
    order = []
    for r in range(rounds + 1):
        order += [(r, "fixed"), (r, "other")] if r % 2 == 0 else [(r, "other"), (r, "fixed")]
    return order


def paired_ratio(fixed_tok_s: list[float], other_tok_s: list[float]) -> dict:
    """The rounds' ratios (other / fixed, round by round), their median and range."""
    if len(fixed_tok_s) != len(other_tok_s) or not fixed_tok_s:
        raise ValueError("one rate of each placement a round, one round at least")
    ratios = [b / a for a, b in zip(fixed_tok_s, other_tok_s)]
    return {"ratios": [round(x, 4) for x in ratios], "vs_fixed": round(statistics.median(ratios), 4),
            "vs_fixed_range": [round(min(ratios), 4), round(max(ratios), 4)]}


def fits(elapsed: float, limit: float | None, durations: list[float], margin: float = 5.0) -> bool:
    """Whether a pair started `elapsed` seconds into the run ends before `limit`, priced as the slowest pair so far
    (the first one: whenever any time is left)."""
    if limit is None:
        return True
    return elapsed + (max(durations) + margin if durations else 0.0) < limit


def write_json(path: str, report: dict) -> None:
    """Whole or not at all: a run cut while writing keeps the previous pair's file."""
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def release(orchestra) -> None:
    """Give back a placement's GPU copies (the next pair places its own)."""
    import torch

    orchestra.executor.follow_routing(None)
    orchestra.executor.set_placement([[False] * len(row) for row in orchestra.executor.on_gpu()])
    if orchestra.executor.device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--gpu-budget", type=float, default=4.0, metavar="GiB")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--expert-format", default="dense")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each placement, after a warm-up round")
    parser.add_argument("--decode-tokens", type=int, default=20, help="tokens decoded a round, its untimed ones included")
    parser.add_argument("--warmup", type=int, default=2, help="the first decode steps of each round, untimed")
    parser.add_argument("--intervals", default="16,1", help="swap rounds every N steps, each tried, the first first")
    parser.add_argument("--traces", default=",".join(TRACES),
                        help=f"the traces replayed, comma-separated, from: {', '.join(TRACES)}")
    parser.add_argument("--reuse-profile", action="store_true",
                        help="the profile an earlier bench stored for this shape and format on this machine")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="start no pair that would end more than S seconds after this script started")
    parser.add_argument("--ceiling", action="store_true",
                        help=f"after the control, '{CEILING}' against the fixed placement: what every hit is worth "
                        "(needs the GPU to hold the whole model's experts and the fixed placement's)")
    parser.add_argument("--eager", action="store_true",
                        help="decode eagerly (no CUDA graphs), as the bench did before session 38")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    try:
        intervals = [int(n) for n in args.intervals.split(",")]
    except ValueError:
        parser.error(f"--intervals {args.intervals!r}: expected steps separated by commas, e.g. 16,1")
    traces_run = tuple(dict.fromkeys(t.strip() for t in args.traces.split(",") if t.strip()))
    if not traces_run or set(traces_run) - set(TRACES):
        parser.error(f"--traces {args.traces!r}: expected some of {', '.join(TRACES)}, separated by commas")
    if min(intervals) < 1 or args.rounds < 1 or not 1 <= args.warmup <= args.decode_tokens - 3:
        parser.error("intervals and --rounds must be >= 1 and --warmup in 1..--decode-tokens - 3 "
                     "(two steps a round timed at least)")

    from moedesk.bench.synthetic import measure_decode, prepare_synthetic
    from moedesk.engine.generation.cuda_graphs import graphs_wanted
    from moedesk.engine.load.synthetic import shape_config
    from moedesk.engine.offload.expert_cache import CachePolicy

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cfg = shape_config(args.shape, args.layers)
    shape = TraceShape(sum(map(cfg.is_moe_layer, range(cfg.num_layers))), cfg.num_experts, cfg.num_experts_per_tok)
    span = args.decode_tokens  # trace positions a round takes: its prefill's, then one a decode step
    t = time.monotonic()
    calibrations = {name: calibration_halves(shape, TRACES[name]) for name in traces_run}
    traces = {name: list(synthetic_trace(shape, (args.rounds + 1) * span + 8, TRACES[name], seed=5))
              for name in traces_run}
    log(f"traces in {time.monotonic() - t:.1f}s")
    t = time.monotonic()
    bench = prepare_synthetic(args.shape, args.layers, args.gpu_budget, args.device, 64 + args.decode_tokens, log=log,
                              expert_format=args.expert_format, reprofile=not args.reuse_profile,
                              calibration=calibrations[traces_run[0]])
    layers = sorted(bench.banks)
    budget = bench.expert_budget  # what the whole-GPU budget leaves experts (bench.budget)
    release(bench.orchestra)  # each pair places its own two
    gc.collect()
    gc.freeze()  # the model, traces and modules: never garbage, and the collection before each round skips them
    timed = args.decode_tokens - 1 - args.warmup
    graphs = not args.eager and graphs_wanted(bench.device)
    report = {**bench.header(), "graphs": graphs, "rounds": args.rounds, "decode_tokens": args.decode_tokens,
              "warmup_steps": args.warmup, "timed_steps": timed, "prepare_s": round(time.monotonic() - t, 1),
              "pairs": [], "skipped": [], "same_as_fixed": [], "complete": False}
    fixed_plans: dict[str, np.ndarray] = {}
    durations: list[float] = []

    def one_round(orchestra, trace: str, r: int):
        """Round r of one placement: the trace from position r * span, its stats over the timed steps."""
        router = TraceRouter(traces[trace][r * span:], layers, shape.top_k)
        replace_router(bench.model, router)
        gc.collect()
        gc.disable()  # a collection landing in one placement's round is the bench's noise, not the placement's
        try:
            result = measure_decode(bench.model, orchestra.executor, cfg, bench.device, bench.dtype, 1,
                                    args.decode_tokens, seed=r, graphs=graphs, warmup=args.warmup)
        finally:
            gc.enable()
            replace_router(bench.model, None)
        if router.step + 1 != span:
            raise RuntimeError(f"a round took {router.step + 1} trace positions, not {span}")
        return result, orchestra.executor.stats

    for pair in pair_plan(intervals, traces_run, args.ceiling):
        name = f"{pair.trace}, {pair.placement}"
        elapsed = time.monotonic() - started
        if not fits(elapsed, args.time_limit, durations):
            log(f"{name}: skipped ({elapsed:.0f} s of {args.time_limit:.0f} gone, "
                f"a pair takes up to {max(durations, default=0):.0f} s)")
            report["skipped"].append(name)
            continue
        t = time.monotonic()
        log(f"{name}: placing both, {elapsed:.0f} s into the run")
        popularity = np.add(*calibrations[pair.trace]).tolist()
        sides = {"fixed": bench.orchestra.twin(), "other": bench.orchestra.twin()}
        sides["fixed"].cache = None
        fixed_plans[pair.trace] = sides["fixed"].place(budget, popularity=popularity).on_gpu
        sides["other"].cache = None if pair.interval is None else CachePolicy(interval=pair.interval)
        every = sides["other"].expert_bytes * len(layers) * cfg.num_experts
        plan = sides["other"].place(every if pair.every_expert else budget, popularity=popularity,
                                    whole_layers=pair.whole_layers)
        if pair.interval is not None and not pair.whole_layers and np.array_equal(plan.on_gpu,
                                                                                  fixed_plans[pair.trace]):
            log(f"{name}: not run, the same placement as fixed")
            report["same_as_fixed"].append(name)
            for side in sides.values():
                release(side)
            continue
        rounds = [{"round": r, "first": "fixed" if r % 2 == 0 else "other"} for r in range(1, args.rounds + 1)]
        totals = {side: type(bench.executor.stats)() for side in sides}
        log(f"{name}: placed, {int(plan.on_gpu.sum())} experts resident, {time.monotonic() - t:.1f} s")
        for r, side in turns(args.rounds):
            turn = time.monotonic()
            result, stats = one_round(sides[side], pair.trace, r)
            # A line a turn: a run cut from outside shows the round and placement it was in.
            log(progress_line(name, r, args.rounds, side, result.tok_s, stats.swaps, time.monotonic() - turn))
            if r == 0:
                continue  # the warm-up round
            rounds[r - 1].update({f"{side}_tok_s": round(result.tok_s, 3),
                                  f"{side}_step_se": None if result.noise is None else round(result.noise, 4),
                                  f"{side}_swaps": stats.swaps})
            for field in ("selections", "gpu_hits", "swaps"):
                setattr(totals[side], field, getattr(totals[side], field) + getattr(stats, field))
        for side in sides.values():
            release(side)
        ratio = paired_ratio([x["fixed_tok_s"] for x in rounds], [x["other_tok_s"] for x in rounds])
        for x, value in zip(rounds, ratio["ratios"]):
            x["ratio"] = value
        steps = timed * args.rounds
        row = {"trace": pair.trace, "placement": pair.placement, "experts_on_gpu": int(plan.on_gpu.sum()),
               "whole_layers": int(plan.on_gpu.all(axis=1).sum()),
               "fixed_tok_s": round(statistics.median(x["fixed_tok_s"] for x in rounds), 2),
               "tok_s": round(statistics.median(x["other_tok_s"] for x in rounds), 2),
               "vs_fixed": ratio["vs_fixed"], "vs_fixed_range": ratio["vs_fixed_range"],
               "gpu_hit_rate": _rate(totals["other"]), "fixed_gpu_hit_rate": _rate(totals["fixed"]),
               "swaps_per_step": round(totals["other"].swaps / steps, 2),
               "selections": totals["other"].selections,  # (token, expert) pairs of the timed steps: alike in all
               "fixed_selections": totals["fixed"].selections, "rounds": rounds,
               "seconds": round(time.monotonic() - t, 1)}
        durations.append(time.monotonic() - t)
        report["pairs"].append(row)
        log(f"{name}: {row['vs_fixed']}x fixed (rounds {row['vs_fixed_range'][0]}-{row['vs_fixed_range'][1]}), "
            f"{row['tok_s']} against {row['fixed_tok_s']} tok/s, in {row['seconds']} s")
        if args.json:
            write_json(args.json, report)
    gc.unfreeze()  # for the interpreter's exit, which frees what it can find
    report["complete"] = not report["skipped"]
    report["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        write_json(args.json, report)
    print(f"{args.shape} x{cfg.num_layers}, {len(layers) * cfg.num_experts} experts, a {args.gpu_budget:.4g} GiB GPU "
          f"budget, {budget / 2**30:.4g} GiB of it for experts, {report['experts']}, {bench.device}; "
          f"{args.rounds} rounds of each placement in turns after a warm-up round, {timed} decode steps of each timed, "
          f"{'CUDA graphs' if graphs else 'eager'}")
    print(format_rows(report["pairs"]))
    for name in report["skipped"]:
        print(f"skipped at the time limit: {name}")
    for name in report["same_as_fixed"]:
        print(f"not run, its placement is the fixed one: {name}")
    return 0


def progress_line(name: str, r: int, rounds: int, side: str, tok_s: float, swaps: int, seconds: float) -> str:
    """One turn done: round r of `rounds` (0, the warm-up), which placement, its rate and swaps over the timed steps."""
    which = "warm-up round" if r == 0 else f"round {r} of {rounds}"
    return f"{name}: {which}, {side}: {tok_s:.1f} tok/s, {swaps} swaps, {seconds:.1f} s"


def _rate(stats) -> float | None:
    return round(stats.gpu_hits / stats.selections, 4) if stats.selections else None


def format_rows(pairs: list[dict]) -> str:
    """The table of pairs (also the targets scripts' summaries): medians over the rounds, and the least and
    greatest of the rounds' ratios."""
    lines = [f"{'trace':<14}{'placement':<28}{'resident':>9}{'whole':>6}{'fixed tok/s':>12}{'tok/s':>8}"
             f"{'vs fixed':>9}{'rounds':>13}{'GPU hits':>10}{'swaps/step':>12}"]
    for r in pairs:
        hit = "-" if r["gpu_hit_rate"] is None else f"{r['gpu_hit_rate']:.0%}"
        low, high = r["vs_fixed_range"]
        lines.append(f"{r['trace']:<14}{r['placement']:<28}{r['experts_on_gpu']:>9}{r['whole_layers']:>6}"
                     f"{r['fixed_tok_s']:>12.1f}{r['tok_s']:>8.1f}{r['vs_fixed']:>8.2f}x{f'{low:.2f}-{high:.2f}x':>13}"
                     f"{hit:>10}{r['swaps_per_step']:>12.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
