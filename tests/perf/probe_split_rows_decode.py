"""Probe (GPU box; python3 tests/perf/probe_split_rows_decode.py [--formats q4_0,dense] [--rounds 3]): at one token,
how fast does whole decode run with the GPU taking each share of every expert's rows (`OffloadExecutor.width_split`),
and does the start-up profile's pick (engine.offload.assignment.lone_token_split) land on the fastest?

Per format one synthetic model (by default the mixtral-8x7b shape, 8 layers; GPU budget 0), profiled as
`moedesk bench` profiles it. Then rounds of batch-1 decode in which the policies take turns, every format's in
one rotating schedule (the box's RAM bandwidth drifts from minute to minute, so only figures timed side by side
compare): "model" (the profile's pick), "model, priced" (the same split, with the per-step rule as it was before
assignment.lone_token_measured), "rows r" (the GPU the last r of every expert's rows; 0: no split, the per-step
rule decides) and "cpu only" (no split, no copies). Printed per format: the profile's times of one
layer per option, tok/s per policy (median of the rounds) and the experts copied a token."""
import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moedesk.bench.synthetic import measure_decode, prepare_synthetic  # noqa: E402
from moedesk.engine.offload.assignment import RememberedSplit, assign_offloaded, lone_token_split  # noqa: E402
from moedesk.engine.offload.profiler import split_width_candidates  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q4_0,dense")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--shape", default="mixtral-8x7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--most", type=float, default=0.375, help="largest GPU share of the rows tried")
    args = ap.parse_args()
    benches, unmeasured, policies = {}, {}, []
    for fmt in args.formats.split(","):
        bench = prepare_synthetic(args.shape, args.layers, 0.0, expert_format=fmt, log=lambda *a: None)
        bank = next(iter(bench.banks.values()))
        benches[fmt] = bench
        decide = bench.executor.decide
        policies.append((fmt, "model", bench.executor.split_width, decide))
        # The per-step rule without assignment.lone_token_measured (the profile's streaming forgotten): a lone token
        # priced from the latency model's costs, which may copy one of its experts (and then the step is not handed to
        # the host whole). Before a1c768e those costs timed each CPU expert in a call of its own.
        unmeasured[fmt] = replace(bench.orchestra.costs, zero_copy_split_ms=())
        policies.append((fmt, "model, priced", bench.executor.split_width,
                         RememberedSplit(lambda loads, c=unmeasured[fmt]: assign_offloaded(loads, c))))
        policies.append((fmt, "cpu only", lambda k: 0, lambda loads: (sorted(loads), [])))
        for rows in [0] + split_width_candidates(bank, most=args.most):
            policies.append((fmt, f"rows {rows}", lambda k, rows=rows: rows, decide))
    runs = {(fmt, name): [] for fmt, name, *_ in policies}
    copied = {key: [] for key in runs}
    for r in range(args.rounds):
        for j in range(len(policies)):
            fmt, name, rows, decide = policies[(j + r) % len(policies)]
            bench = benches[fmt]
            ex = bench.executor
            kept = ex.split_width, ex.decide
            ex.split_width, ex.decide = rows, decide
            res = measure_decode(bench.model, ex, bench.cfg, bench.device, bench.dtype, 1, args.tokens, seed=100 * r)
            ex.split_width, ex.decide = kept
            runs[(fmt, name)].append(res.tok_s)
            copied[(fmt, name)].append(ex.stats.copied_experts / (args.tokens - 2))
    out = os.environ.get("OUT", "/tmp")
    report = {}
    for fmt, bench in benches.items():
        costs = bench.orchestra.costs
        prof = bench.profile
        report[fmt] = {"split_width_ms": dict(costs.split_width_ms), "zero_copy_split_ms": list(costs.zero_copy_split_ms),
                       "pick": lone_token_split(bench.cfg.num_experts_per_tok, costs),
                       "priced_rule_copies": len(assign_offloaded(
                           {e: 1 for e in range(bench.cfg.num_experts_per_tok)}, unmeasured[fmt]).copy),
                       "cpu_read_gbs": prof.get("cpu_read_gbs"),
                       "tok_s": {name: v for (f, name), v in runs.items() if f == fmt},
                       "copied_a_token": {name: statistics.median(v) for (f, name), v in copied.items() if f == fmt}}
    json.dump(report, open(f"{out}/split_rows_decode.json", "w"), indent=1)
    for fmt, rep in report.items():
        alone = rep["zero_copy_split_ms"][0] if rep["zero_copy_split_ms"] else float("nan")
        times = " ".join(f"{r}:{ms:.3f}" for r, ms in rep["split_width_ms"].items())
        print(f"{fmt}: read {rep['cpu_read_gbs']:.0f} GB/s; profile ms a layer: CPU alone {alone:.3f}, rows {times}; "
              f"pick {rep['pick']}; the priced rule copies {rep['priced_rule_copies']} of a lone token's experts")
        print(f"  {'policy':<15}{'tok/s':>8}{'copied':>8}  runs")
        for name, v in rep["tok_s"].items():
            print(f"  {name:<15}{statistics.median(v):>8.1f}{rep['copied_a_token'][name]:>8.1f}  "
                  f"{' '.join(f'{x:.1f}' for x in v)}")
    if "q4_0" in report and "dense" in report:
        q, d = (statistics.median(report[f]["tok_s"]["model"]) for f in ("q4_0", "dense"))
        best = max(statistics.median(v) for v in report["q4_0"]["tok_s"].values())
        print(f"q4_0 / dense, each the profile's pick: {q / d:.2f}x; "
              f"q4_0's best policy / dense's pick: {best / d:.2f}x")


if __name__ == "__main__":
    main()
