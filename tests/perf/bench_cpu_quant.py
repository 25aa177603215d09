"""The native packed-experts kernel (kernels/cpu_quant.c) per format, against the bf16 kernel, on real MoE shapes.

Usage (repo root; GPU box: 16 cores):
    python3 tests/perf/bench_cpu_quant.py [--formats q4_0,q8_0,q4_k,q5_k,q6_k] [--paths vnni,amx,avx2] [--threads N]
    python3 tests/perf/bench_cpu_quant.py --per-core    # one thread: GB/s of packed bytes one core computes
    python3 tests/perf/bench_cpu_quant.py --define along=-DSHORT_ROW_BYTES=0 --define pf2k=-DPREFETCH=2048
    python3 tests/perf/bench_cpu_quant.py --smoke       # tiny shapes, one repeat: checks the script runs
    python3 tests/perf/bench_cpu_quant.py --formats mxfp4 --shapes gpt-oss-120b   # gpt-oss's experts as they run

Shapes (--shapes): Mixtral-8x7B (8 experts of H=4096, F=14336, 2 per call), Qwen3-30B-A3B (128 experts of
H=2048, F=768, 8 per call), gpt-oss-120b (128 experts of H=F=2880, 4 per call, with gpt-oss's expert biases and
clamped SwiGLU computed in the call as the model runs them), `mixtral-layer` (all 8 of a Mixtral layer's experts per call, from a stack
of 16: 16 sequences decoding together) and `tiny` (16 experts of 256 x 256, 8 per call: what a call costs beyond its
weights: thread hand-out, phases, the wrapper). Each call computes `experts` distinct experts with exactly
T tokens each (--tokens, default 1, 2, 4, 8, 16), the experts picked at random per call from the whole
stack so that the caches hold no expert from the call before (as in decode; `tiny` fits in cache, that is
its point; `cached`, 4 experts of 1.8 MB of q4_0, stays in the last-level cache over calls: with --per-core,
the rate the instructions allow). Prints ms per call and GB/s of weight bytes read (each active expert's packed gate, up and down
once); the bf16 line is kernels/cpu_experts.c on the same shape. Weights are random blocks with sane
float16 scales: the values do not matter to the timing.

--define NAME=-DFLAG[,-DFLAG...] (repeatable) builds cpu_quant.c again with those flags (the knobs are its
#ifndef'd constants: PREFETCH, SHORT_ROW_BYTES, ITEM_BYTES, MAX_TT, ...) and measures it beside the
default build, the builds taking turns call by call (in a rotating order, each on experts the call before did not
read) so that all see the same machine state.
`--define maddubs=-UMQ_AVXVNNI` measures the AVX2 path without AVX-VNNI where the CPU has it (the default build
then uses it). `--define ro=-DMQ_READ_ONLY` builds a kernel that makes the same reads of whole segments without the arithmetic
(its results are wrong): the memory's ceiling for the kernel's traversal, beside which the kernel's own GB/s says
how much of a call the instructions add.
--uneven also times each packed case with the same tokens dealt unevenly (`uneven_loads`; rows marked ~), the even and
uneven calls in turns: what a batch's skewed routing costs the kernel beyond its bytes.
--per-core is --threads 1: on the GPU box at one token with all threads the 4-bit kernels were bound by
instructions per core, so GB/s per core is the figure an instruction-level change moves.
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
from moedesk.kernels import cpu_quant as cq  # noqa: E402
from moedesk.kernels.expert_weights import ClampedSwiGLU, ExpertWeights  # noqa: E402
from moedesk.kernels.quant_formats import packed_format  # noqa: E402

SHAPES = {  # name: (experts in the stack, hidden, intermediate, experts per call)
    "mixtral": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    # all 8 experts of a Mixtral layer in one call: 16 sequences decoding together give each ~4 tokens
    "mixtral-layer": (16, 4096, 14336, 8),
    "gpt-oss-120b": (128, 2880, 2880, 4),
    "qwen3.5-35b-a3b": (256, 2048, 512, 8),
    # 16 sequences decoding together: ~40 of a layer's 256 small experts a call, ~3 tokens each
    "qwen3.5-layer": (256, 2048, 512, 40),
}
# 7 MB of q4_0 that stays in the last-level cache: with one thread, the rate the instructions allow
CACHED = {"cached": (4, 2048, 512, 4)}
SMOKE = {"smoke": (4, 256, 512, 2)}
TINY = {"tiny": (16, 256, 256, 8)}
SCALE_AT = {"q4_0": [0], "q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208], "mxfp4": []}


def packed_stack(fmt, E, R, K, pinned):
    """[E, R, row_bytes(K)] of random blocks (one random block pattern repeated: filled at copy speed) whose
    float16 scales are small and finite."""
    f = packed_format(fmt)
    pin = pinned and torch.cuda.is_available()
    t = torch.empty((E, R, f.row_bytes(K)), dtype=torch.uint8, pin_memory=pin)
    blocks = t.view(-1, f.block_bytes)
    pattern = torch.randint(0, 256, (4096, f.block_bytes), dtype=torch.uint8)
    for at in SCALE_AT[fmt]:
        pattern[:, at:at + 2] = torch.full((4096,), 1e-3, dtype=torch.float16).view(torch.uint8).view(-1, 2)
    if fmt == "mxfp4":
        pattern[:, 0] = 120  # E8M0: weights up to 6 * 2^-7
    full = blocks.shape[0] // 4096 * 4096
    blocks[:full].view(-1, 4096, f.block_bytes).copy_(pattern.expand(full // 4096, 4096, f.block_bytes))
    blocks[full:].copy_(pattern[:blocks.shape[0] - full])
    return t


def bf16_stacks(E, H, F, pinned):
    pin = pinned and torch.cuda.is_available()
    gate_up = torch.empty((E, 2 * F, H), dtype=torch.bfloat16, pin_memory=pin)
    down = torch.empty((E, H, F), dtype=torch.bfloat16, pin_memory=pin)
    for t, fan_in in ((gate_up, H), (down, F)):
        flat = t.view(-1, t.shape[-1])
        block = (torch.randn(256, t.shape[-1]) / fan_in ** 0.5).to(torch.bfloat16)
        full = flat.shape[0] // 256 * 256
        flat[:full].view(-1, 256, t.shape[-1]).copy_(block.expand(full // 256, 256, t.shape[-1]))
        flat[full:].copy_(block[:flat.shape[0] - full])
    return gate_up, down


def uneven_loads(per_call, T, gen):
    """per_call token counts adding up to per_call x T, each from 1 to 4T, the rest dealt with Zipf weights (1 / rank):
    a batch's skewed routing (a few experts take several times their share of its tokens; a batch of B sequences
    gives an expert at most B), against `calls_for`'s T each."""
    loads = torch.ones(per_call, dtype=torch.int64)
    weights = 1 / torch.arange(1, per_call + 1, dtype=torch.float64)
    for _ in range(per_call * (T - 1)):
        e = int(torch.multinomial(weights, 1, generator=gen))
        loads[e] += 1
        if loads[e] == 4 * T:
            weights[e] = 0
    return loads.tolist()


def calls_for(E, per_call, T, H, n, gen, uneven=False):
    """n calls' (x, pair_expert): per_call distinct random experts, T tokens each (uneven, or a call's flag in a list
    of n: as many tokens in all, dealt by `uneven_loads`), k = 1. Consecutive calls share
    no expert (the stack is dealt out in random order, reshuffled when it runs out), so a call never finds the
    weights of the call before it in the last-level cache (a 2-of-8 Mixtral call is 200 MB of q4_0; the GPU
    box's L3 holds half of that), as in decode, where a token's other layers come between."""
    calls, deck, last = [], [], set()
    flags = uneven if isinstance(uneven, list) else [uneven] * n
    for flag in flags:
        if len(deck) < per_call:
            shuffled = torch.randperm(E, generator=gen).tolist()
            deck = [e for e in shuffled if e not in last] + [e for e in shuffled if e in last]
        experts, deck = torch.tensor(deck[:per_call]), deck[per_call:]
        last = set(experts.tolist())
        loads = torch.tensor(uneven_loads(per_call, T, gen)) if flag else T
        pair_expert = experts.repeat_interleave(loads)
        calls.append((torch.randn(pair_expert.numel(), H, generator=gen).to(torch.bfloat16), pair_expert))
    return calls


def timed(fn, calls, warmup=2):
    for c in calls[:warmup]:
        fn(*c)
    times = []
    for c in calls:
        t = time.perf_counter()
        fn(*c)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_builds(variants, fn, make_calls, rounds, warmup=2):
    """Median seconds per call of fn in each variant (name -> (library, uneven)), the variants taking turns call by
    call, in an order that rotates every round, so that no variant always runs right after the same other one.
    make_calls(flags) gives one call per flag (uneven or not) in the order they run (calls_for: consecutive calls
    share no expert)."""
    names = list(variants)
    order = [names[(j + r) % len(names)] for r in range(-warmup, rounds) for j in range(len(names))]
    calls = make_calls([variants[name][1] for name in order])
    times = {name: [] for name in names}
    for i, (name, call) in enumerate(zip(order, calls)):
        cq.use_library(variants[name][0])
        t = time.perf_counter()
        fn(*call)
        if i >= warmup * len(names):
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def use_threads(n: int) -> None:
    """The packed kernel's threads (kernels.cpu_quant.set_num_threads)."""
    cq.set_num_threads(n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q4_0,q8_0,q4_k,q5_k,q6_k")
    ap.add_argument("--paths", default=None, help="vnni,amx,avx2 (default: the ones this CPU has; amx: 8+ tokens per expert)")
    ap.add_argument("--shapes", default="mixtral,qwen3-30b-a3b,tiny", help="mixtral, qwen3-30b-a3b, mixtral-layer, gpt-oss-120b, qwen3.5-35b-a3b, qwen3.5-layer, tiny, cached")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--per-core", action="store_true", help="one thread (--threads 1)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--define", action="append", default=[], metavar="NAME=-DFLAG[,-DFLAG]",
                    help="also measure cpu_quant.c built with these flags, alternating with the default build")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and 3 calls: the script runs, numbers mean nothing")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--uneven", action="store_true",
                    help="also time each packed case with as many tokens dealt unevenly (rows marked ~), in turns")
    args = ap.parse_args()
    if not cq.available():
        sys.exit(f"packed kernel unavailable: {cq.unavailable_reason()}")
    threads = 1 if args.per_core else args.threads
    if threads:
        use_threads(threads)
    builds = {"": cq._state["lib"]}
    for d in args.define:
        name, _, flags = d.partition("=")
        if not name or not flags.startswith(("-D", "-U")):
            sys.exit(f"--define wants NAME=-DFLAG[,-DFLAG...] (or -UFLAG), not {d!r}")
        builds[name] = cq.build_variant(flags.split(","))
        if not ce.available() and threads:
            builds[name].mq_set_threads(threads)
    paths = args.paths.split(",") if args.paths else (
        ["vnni", *(["amx"] if cq.amx_supported() else []), "avx2"] if cq.vnni_supported() else ["avx2"])
    every = {**SHAPES, **TINY, **CACHED}
    shapes = SMOKE if args.smoke else {name: every[name] for name in args.shapes.split(",")}
    n_calls = 3 if args.smoke else args.calls
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    unit = "GB/s per core" if threads == 1 else "GB/s"
    print(f"threads {ce.get_num_threads()}, paths {paths}, builds {list(builds) if len(builds) > 1 else 'default'}, "
          f"bf16 kernel: {ce.describe()}; {unit} of weight bytes (packed for the packed formats)")
    width = max([8, *(len(f) + len(b) + 1 for f in args.formats.split(",") for b in builds)])
    for name, (E, H, F, per_call) in shapes.items():
        print(f"\n{name}: H={H} F={F}, {per_call} of {E} experts per call")
        print(f"{'format':>{width}} {'path':>5} " + " ".join(f"{f'T={t} ms':>9} {'GB/s':>6}" for t in tokens))
        if not args.no_bf16 and ce.available():
            gate_up, down = bf16_stacks(E, H, F, pinned=True)
            out_row = []
            for T in tokens:
                calls = calls_for(E, per_call, T, H, n_calls, gen)
                sec = timed(lambda x, pe: ce.experts_forward_routed(x, pe, 1, None, gate_up, down,
                                                                    torch.empty(pe.numel(), H, dtype=torch.bfloat16)), calls)
                out_row.append(f"{sec * 1e3:9.3f} {per_call * 3 * H * F * 2 / sec / 1e9:6.1f}")
            print(f"{'bf16':>{width}} {'':>5} " + " ".join(out_row))
            del gate_up, down
        for fmt in args.formats.split(","):
            w = ExpertWeights(packed_stack(fmt, E, 2 * F, H, True), packed_stack(fmt, E, H, F, True), H, F, fmt, fmt)
            if name == "gpt-oss-120b":  # its biases (bf16, as the model keeps them) and activation, in the call
                w = w.with_function(torch.randn(E, 2 * F).bfloat16(), torch.randn(E, H).bfloat16(),
                                    ClampedSwiGLU(alpha=1.702, limit=7.0))
            for path in paths:
                labels = {(b, u): (f"{fmt}/{b}" if b else fmt) + ("~" if u else "")
                          for b in builds for u in ([False, True] if args.uneven else [False])}
                rows = {label: [] for label in labels.values()}
                for T in tokens:
                    for lib in builds.values():
                        cq.use_library(lib)
                        cq.set_path(path)
                    variants = {label: (builds[b], u) for (b, u), label in labels.items()}
                    sec = timed_builds(variants, lambda x, pe: cq.experts_forward_routed(
                        x, pe, 1, None, w, torch.empty(pe.numel(), H, dtype=torch.bfloat16)),
                        lambda flags: calls_for(E, per_call, T, H, len(flags), gen, uneven=flags), n_calls)
                    for label in rows:
                        rows[label].append(f"{sec[label] * 1e3:9.3f} {per_call * w.expert_bytes / sec[label] / 1e9:6.1f}")
                for label in rows:
                    print(f"{label:>{width}} {path:>5} " + " ".join(rows[label]))
            del w
    for lib in builds.values():
        cq.use_library(lib)
        cq.set_path(None)
    cq.use_library(builds[""])


if __name__ == "__main__":
    main()
