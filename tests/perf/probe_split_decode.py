"""Probe (GPU box; python3 tests/perf/probe_split_decode.py [--formats q4_0,bf16] [--define NAME=-DFLAG ...]
[--threads 16,12]): at one token, how much do the CPU's and the GPU's shares of a row split
(`OffloadExecutor.width_split`) slow each other, packed against bf16?

Per configuration (format, build of kernels/cpu_quant.c for the packed formats, CPU threads) and GPU share r (the
last r of F intermediate rows of a token's two Mixtral experts): the CPU's rows alone, the GPU's alone
(kernels/gpu_zero_copy.py reading pinned RAM), both launched together (the GPU's first, as the decode graph does)
and timed until both are done; `slow` is both against the slower alone, and in both, when the CPU's call
returned and how long the GPU's kernels took. Each call takes the next two experts of a stack of 16, so little is
left in the last-level cache from the call before, as in decode. Every case of every configuration takes turns in
one rotating schedule: the GPU box's RAM bandwidth drifts by 10-20% from minute to minute (another tenant's
traffic), so only figures timed side by side compare. `--define` builds take the knobs of kernels/cpu_quant.c
(PREFETCH, PREFETCH_HINT, PREFETCH_NEXT, SHORT_ROW_BYTES, ITEM_BYTES, MQ_READ_ONLY).

`--cpu-rows 256,3584,7168,14336`: instead the CPU alone on those first rows, and the line through them (a call's
fixed cost and its streaming rate)."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_quant import bf16_stacks, packed_stack, use_threads  # noqa: E402
from moedesk.kernels import cpu_experts, cpu_quant, experts, gpu_zero_copy  # noqa: E402
from moedesk.kernels.expert_weights import ExpertWeights  # noqa: E402

E, H, F, K = 16, 4096, 14336, 2  # Mixtral: a stack of 16 experts, a token's two a call


def stacks(fmt):
    if fmt == "bf16":
        gate_up, down = bf16_stacks(E, H, F, True)
        return ExpertWeights(gate_up, down, H, F)
    return ExpertWeights(packed_stack(fmt, E, 2 * F, H, True), packed_stack(fmt, E, H, F, True), H, F, fmt, fmt)


def fit_line(points):
    """Least squares t = cost + slope * mb over (mb, t): (slope in ms per MB, cost in ms)."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope, my - slope * mx


class Config:
    """One format with one CPU build and thread count, and the means to time a call of its cases."""

    def __init__(self, fmt, w, build, lib, threads, dev, x):
        self.fmt, self.w, self.build, self.lib, self.threads = fmt, w, build, lib, threads
        self.label = f"{fmt} {build}" + (f" {threads} threads" if threads else "")
        self.x, self.x_dev, self.dev = x, x.to(dev), dev
        self.cpu_out = torch.empty(K, H, dtype=torch.float32)
        self.gpu_out = torch.empty(K, H, dtype=torch.float32, device=dev)
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.calls = 0
        self.mb = K * w.expert_bytes / 1e6

    def run(self, gpu_rows, cpu, gpu, cpu_width=None):
        """ms until both are done, until the CPU's call returned, the GPU's kernels' own time"""
        first = (2 * self.calls) % (E - 1)
        self.calls += 1
        pair_expert, ids = torch.tensor([first, first + 1]), torch.tensor([[first, first + 1]], device=self.dev)
        if self.lib is not None:
            cpu_quant.use_library(self.lib)
        use_threads(self.threads or cpu_experts.default_num_threads())
        rows = cpu_width or (F - gpu_rows if gpu_rows else None)
        torch.cuda.synchronize()
        t = time.perf_counter()
        if gpu:
            self.start.record()
            gpu_zero_copy.zero_copy_experts(self.x_dev, ids, 0, self.w, self.gpu_out, first_row=F - gpu_rows)
            self.end.record()
        if cpu:
            experts.experts_forward_routed(self.x, pair_expert, K, None, self.w, self.cpu_out, rows=rows)
        cpu_ms = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3, cpu_ms, self.start.elapsed_time(self.end) if gpu else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q4_0,bf16")
    ap.add_argument("--gpu-rows", default="2688,3584,4480,5376", help="GPU shares to time (rows of every expert)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=-DFLAG[,-DFLAG]")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", default="0", help="CPU thread counts to compare (0: the engine's)")
    ap.add_argument("--cpu-rows", default=None, help="instead: the CPU alone on these first rows of every expert "
                    "(e.g. 256,3584,7168,14336), and the line through them: a call's fixed cost and its streaming")
    args = ap.parse_args()
    dev = torch.device("cuda")
    builds = {"default": cpu_quant._state["lib"] if cpu_quant.available() else None}
    for d in args.define:
        name, flags = d.split("=", 1)
        builds[name] = cpu_quant.build_variant(flags.split(","))
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    configs = []
    for fmt in args.formats.split(","):
        w = stacks(fmt)
        for build, lib in (builds.items() if fmt != "bf16" else [("default", None)]):
            for threads in (int(t) for t in args.threads.split(",")):
                configs.append(Config(fmt, w, build, lib, threads, dev, x))
    rows = [int(r) for r in args.gpu_rows.split(",")]
    if args.cpu_width:
        kinds = [(f"cpu {c}", 0, True, False, int(c)) for c in args.cpu_width.split(",")]
    else:
        kinds = [("cpu", 0, True, False, None)] + [(f"{kind} {r}", r, kind != "gpu", kind != "cpu", None)
                                                   for r in rows for kind in ("cpu", "gpu", "both")]
    schedule = [(c, kind) for c in configs for kind in kinds]
    for c, (_, r, cpu, gpu, cr) in schedule:
        c.run(r, cpu, gpu, cr)
    times = {(c.label, kind[0]): [] for c, kind in schedule}
    for k in range(args.rounds):
        for j in range(len(schedule)):
            c, (name, r, cpu, gpu, cr) = schedule[(j + k) % len(schedule)]
            times[c.label, name].append(c.run(r, cpu, gpu, cr))
    med = {key: [statistics.median(v[i] for v in runs) for i in range(3)] for key, runs in times.items()}
    print(f"a token's 2 Mixtral experts; ms, medians of {args.rounds} rounds, every case taking turns")
    summary = []
    for c in configs:
        m = {name: med[c.label, name] for name, *_ in kinds}
        if args.cpu_width:
            fit = [(c.mb * int(name.split()[1]) / F, m[name][0]) for name, *_ in kinds]
            slope, cost = fit_line(fit)
            print(f"{c.label}, the CPU alone: " + ", ".join(f"{name[4:]} rows {m[name][0]:.3f}" for name, *_ in kinds)
                  + f"; line {cost:.3f} ms + {c.mb:.0f} MB at {1 / slope:.1f} GB/s")
            continue
        print(f"\n{c.label}: {c.mb:.0f} MB")
        print(f"{'gpu rows':>9} {'cpu':>7} {'gpu':>7} {'both':>7} {'slow':>6} {'GB/s':>6}  in both: cpu, gpu kernels")
        alone = m["cpu"][0]
        print(f"{0:>9} {alone:>7.3f} {'':>7} {alone:>7.3f} {'':>6} {c.mb / alone:>6.1f}")
        best = alone
        for r in rows:
            (cpu, _, _), (gpu, _, _), (both, bc, bg) = m[f"cpu {r}"], m[f"gpu {r}"], m[f"both {r}"]
            best = min(best, both)
            print(f"{r:>9} {cpu:>7.3f} {gpu:>7.3f} {both:>7.3f} {both / max(cpu, gpu):>5.2f}x {c.mb / both:>6.1f}  "
                  f"{bc:>7.3f} {bg:>7.3f}")
        summary.append((c.label, alone, best))
    if summary:
        print(f"\n{'configuration':<28} cpu alone  best split  gain")
        for label, alone, best in summary:
            print(f"{label:<28} {alone:>9.3f} {best:>11.3f} {alone / best:>5.2f}x")


if __name__ == "__main__":
    main()
