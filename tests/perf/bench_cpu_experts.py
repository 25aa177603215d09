"""The native CPU experts kernel against torch's per-expert loop, on real MoE shapes.

Usage (repo root; GPU box: 16 cores):  python3 tests/perf/bench_cpu_experts.py [--quick] [--threads 8,15,16]
    python3 tests/perf/bench_cpu_experts.py --sweep-only --paths avx512,amx --threads 16   # AMX-BF16 vs FMAs
    python3 tests/perf/bench_cpu_experts.py --sweep-only --paths avx512,amx --define min4=-DAMX_MIN=4 --sweep-tokens 4,6,8

For Mixtral-8x7B (8 experts of 4096x14336, top-2) and Qwen3-30B-A3B (128 experts of 2048x768,
top-8) with random routing of 1, 4 and 16 tokens, prints ms per call and the GB/s of expert bytes
read per call (every active expert's gate, up and down once), for each thread count; then a sweep
of tokens per expert on one Mixtral expert, which is what kernels.cpu_experts.NATIVE_MAX_TOKENS
(the size above which a group goes to torch) should be read from. The experts live in pinned
memory when CUDA is available, as in the engine. Needs only torch, psutil and numpy.

On a CPU without AVX-512 the kernel is its AVX2 build (path avx2; MOEDESK_EXPERTS_PATH=avx2 loads it on one
with AVX-512 too). --paths avx512,amx measures the kernel's paths side by side (kernels.cpu_experts.set_path;
amx: AMX-BF16 tiles for experts of 8+ tokens, where the CPU has them); --define NAME=-DFLAG[,-DFLAG...]
(repeatable) also builds cpu_experts.c with those flags (its #ifndef'd knobs: AMX_MIN, PREFETCH, ITEM_BYTES, TILE
on AVX2, ...) and measures each path on it too. --table-tokens picks the tokens per call of the first table (80 =
16 sequences x 5 speculative tokens), --sweep-tokens the tokens per expert of the sweep.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moedesk.kernels import cpu_experts as ce  # noqa: E402

SHAPES = {  # name: (experts, hidden, intermediate, top-k)
    "mixtral": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
}


def expert_stacks(E, H, F, pinned):
    """Random-looking bf16 stacks filled at copy speed: a random block of rows repeated (the values
    do not matter to the timing, but NaNs and denormals could)."""
    pin = pinned and torch.cuda.is_available()
    gate_up = torch.empty((E, 2 * F, H), dtype=torch.bfloat16, pin_memory=pin)
    down = torch.empty((E, H, F), dtype=torch.bfloat16, pin_memory=pin)
    for t, fan_in in ((gate_up, H), (down, F)):
        rows = t.shape[-1]
        flat = t.view(-1, rows)
        block = (torch.randn(256, rows) / fan_in ** 0.5).to(torch.bfloat16)
        full = flat.shape[0] // 256 * 256
        flat[:full].view(-1, 256, rows).copy_(block.expand(full // 256, 256, rows))
        flat[full:].copy_(block[: flat.shape[0] - full])
    return gate_up, down


def routing(tokens, E, k, gen):
    """rows/expert_ids/offsets grouped by expert, as the executor builds them, for random top-k routing."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    active = torch.nonzero(counts).flatten()
    offsets = torch.zeros(len(active) + 1, dtype=torch.long)
    offsets[1:] = counts[active].cumsum(0)
    return order // k, active, offsets


def time_calls(fn, calls, warmup=2):
    for args in calls[:warmup]:
        fn(*args)
    times = []
    for args in calls:
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return times


def read_bandwidth(threads, gigabytes):
    """GB/s of torch summing a large fp32 tensor: the yardstick for what 'full bandwidth' means here."""
    torch.set_num_threads(threads)
    a = torch.ones(int(gigabytes * 2**30) // 4)
    a.sum()
    t = time.perf_counter()
    for _ in range(3):
        a.sum()
    return 3 * a.numel() * 4 / (time.perf_counter() - t) / 1e9


def use(lib, path, threads):
    """Route kernel calls through lib (a build) on path, with this many threads."""
    ce.use_library(lib)
    ce.set_path(path)
    ce.set_num_threads(threads)


def settle():
    # libgomp's idle threads spin for milliseconds after torch's last parallel region; let them
    # go to sleep before timing the other implementation.
    time.sleep(0.05)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer calls, Mixtral with 4 experts, no sweep")
    p.add_argument("--threads", default="8,15,16", help="comma-separated thread counts (default 8,15,16)")
    p.add_argument("--calls", type=int, default=None, help="timed calls per configuration")
    p.add_argument("--paths", default=None, help="kernel paths, e.g. avx512,amx (default: the one in use)")
    p.add_argument("--define", action="append", default=[], metavar="NAME=-DFLAG[,-DFLAG]",
                   help="also measure cpu_experts.c built with these flags")
    p.add_argument("--table-tokens", default="1,4,16", help="tokens per call of the first table (default 1,4,16)")
    p.add_argument("--sweep-tokens", default="8,16,24,32,48,64", help="tokens per expert of the sweep")
    p.add_argument("--sweep-only", action="store_true", help="skip the first table")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")]
    skipped = [t for t in threads if t > cores]
    threads = [t for t in threads if t <= cores] or sorted({max(1, cores - 1), cores})
    calls = args.calls or (6 if args.quick else 20)
    token_counts = [int(t) for t in args.table_tokens.split(",")]

    print(f"torch {torch.__version__}, {cores} CPUs, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"CUDA {'yes (pinned experts)' if torch.cuda.is_available() else 'no'}")
    reason = ce.unavailable_reason()
    print(f"native kernel: {'available' if reason is None else 'UNAVAILABLE: ' + reason}")
    variants = {}  # label -> (library, path)
    if reason is None:
        builds = {"": ce._state["lib"]}
        for d in args.define:
            name, _, flags = d.partition("=")
            if not name or not flags.startswith("-D"):
                sys.exit(f"--define wants NAME=-DFLAG[,-DFLAG...], not {d!r}")
            builds[name] = ce.build_variant(flags.split(","))
        paths = args.paths.split(",") if args.paths else [ce.get_path()]
        if "amx" in paths and not ce.amx_supported():
            print(f"no AMX here ({ce.amx_reason()}): amx dropped")
            paths = [q for q in paths if q != "amx"] or ["avx512"]
        variants = {"/".join(filter(None, (path, b))): (lib, path) for b, lib in builds.items() for path in paths}
        print(f"kernel paths and builds: {', '.join(variants)}")
    if skipped:
        print(f"skipping thread counts above the {cores} CPUs: {skipped}")
    for t in threads:
        print(f"read bandwidth, torch sum fp32, {t} threads: {read_bandwidth(t, 0.5 if args.quick else 2):.1f} GB/s")

    gen = torch.Generator().manual_seed(0)
    width = max([6, *map(len, variants)])
    header = (f"{'shape':<14}{'tokens':>6}{'thr':>5}{'experts':>8} {'kernel':>{width}}{'native ms':>11}{'GB/s':>7}"
              f"{'torch ms':>10}{'GB/s':>7}{'speedup':>8}")
    if not args.sweep_only:
        print("\n" + header + "\n" + "-" * len(header))
    for name, (E, H, F, k) in ({} if args.sweep_only else SHAPES).items():
        if args.quick and name == "mixtral":
            E = 4
        gate_up, down = expert_stacks(E, H, F, pinned=True)
        expert_bytes = 3 * H * F * 2
        for tokens in token_counts:
            x = torch.randn(tokens, H).to(torch.bfloat16)
            batch = [(x, *routing(tokens, E, k, gen), gate_up, down) for _ in range(calls)]
            check = batch[0]
            if reason is None:
                a, b = ce.experts_forward(*check).float(), ce.reference_experts_forward(*check).float()
                diff = float((a - b).norm() / b.norm())
                if diff > 2e-2:
                    print(f"WARNING {name} tokens={tokens}: native differs from torch by {diff:.2e} (relative)")
            n_experts = statistics.mean(len(c[2]) for c in batch)
            total_bytes = sum(len(c[2]) for c in batch) * expert_bytes
            for t in threads:
                native = {}
                for label, (lib, path) in variants.items():
                    use(lib, path, t)
                    settle()
                    native[label] = time_calls(ce.experts_forward, batch)
                torch.set_num_threads(t)
                settle()
                ref = time_calls(ce.reference_experts_forward, batch)
                torch_cols = f"{statistics.median(ref) * 1e3:>10.2f}{total_bytes / sum(ref) / 1e9:>7.1f}"
                for label, times in native.items() or {"-": None}.items():
                    row = f"{name:<14}{tokens:>6}{t:>5}{n_experts:>8.1f} {label:>{width}}"
                    if times is None:
                        row += f"{'-':>11}{'-':>7}" + torch_cols
                    else:
                        row += (f"{statistics.median(times) * 1e3:>11.2f}{total_bytes / sum(times) / 1e9:>7.1f}"
                                + torch_cols + f"{sum(ref) / sum(times):>7.2f}x")
                    print(row, flush=True)
        del gate_up, down

    if args.quick or reason is not None:
        return
    # One Mixtral expert with T tokens: where the native kernel stops beating oneDNN.
    E, H, F, _ = SHAPES["mixtral"]
    gate_up, down = expert_stacks(4, H, F, pinned=True)
    t = max(threads)
    torch.set_num_threads(t)
    print(f"\ntokens per expert (one Mixtral expert of 4, rotating, {t} threads): native ms and GB/s per kernel, torch")
    print(f"{'tokens':>6}" + "".join(f"{label:>{max(11, len(label) + 1)}}{'GB/s':>7}" for label in variants)
          + f"{'torch ms':>10}{'GB/s':>7}")
    for tokens in [int(n) for n in args.sweep_tokens.split(",")]:
        x = torch.randn(tokens, H).to(torch.bfloat16)
        rows = torch.arange(tokens)
        offsets = torch.tensor([0, tokens])
        batch = [(x, rows, torch.tensor([i % 4]), offsets, gate_up, down) for i in range(12)]
        nb = len(batch) * 3 * H * F * 2
        want = ce.reference_experts_forward(*batch[0]).float()
        row = f"{tokens:>6}"
        for label, (lib, path) in variants.items():
            use(lib, path, t)
            diff = float((ce.experts_forward(*batch[0], native_max_tokens=1 << 30).float() - want).norm() / want.norm())
            if diff > 2e-2:
                print(f"WARNING {label} tokens={tokens}: native differs from torch by {diff:.2e} (relative)")
            settle()
            nat = time_calls(lambda *a: ce.experts_forward(*a, native_max_tokens=1 << 30), batch)
            row += f"{statistics.median(nat) * 1e3:>{max(11, len(label) + 1)}.2f}{nb / sum(nat) / 1e9:>7.1f}"
        settle()
        ref = time_calls(ce.reference_experts_forward, batch)
        print(row + f"{statistics.median(ref) * 1e3:>10.2f}{nb / sum(ref) / 1e9:>7.1f}", flush=True)
    rest = "the kernel again, in slices of that many" if ce.get_path() == "avx2" else "torch"
    print(f"(groups above kernels.cpu_experts.max_native_tokens() = {ce.max_native_tokens()} go to {rest})")


if __name__ == "__main__":
    main()
