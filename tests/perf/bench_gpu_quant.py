"""Packed experts on the GPU (kernels.gpu_quant) against the bf16 grouped GEMM, on real MoE shapes.

Usage (repo root, GPU box):  python tests/perf/bench_gpu_quant.py [--no-sweep] [--formats q4_0,q4_k]
                                 [--shapes mixtral,qwen3,gpt-oss] [--sweep-shape mixtral] [--sweep-only]
                                 [--sweep-cases decode4of32,batch16,prefill64]

For Mixtral-8x7B (H=4096, F=14336), Qwen3-30B-A3B (H=2048, F=768) and gpt-oss-120b (H=F=2880) experts in every
packed format (mxfp4 ones with gpt-oss's biases and clamped SwiGLU, as its experts compute):
decode, 8 resident experts with 1, 4 and 16 rows each, and prefill, 64 rows on each of 8 experts and 512 rows on 2.
Prints µs per call (gate/up and down together), the GB/s of packed expert bytes read (every expert's weights once
per call), and the bf16 grouped path (kernels.gpu_experts) at the same shapes. Calls are captured in a CUDA
graph, as decode runs them, and cycle over enough copies of the stacks that the weights come from
memory, not from the 50 MB L2. Then a sweep of tile sizes on Mixtral q4_0 and q4_k (what gpu_quant._config
should be read from), or with --sweep-shape gpt-oss on its shape, one token's 4 of 32 experts as gpt-oss-20b's
decode launches them.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moedesk.kernels import gpu_experts, gpu_quant  # noqa: E402
from moedesk.kernels.quant_formats import packed_format  # noqa: E402
from tests.kernels.test_gpu_quant_kernel import gpt_oss_function, random_experts  # noqa: E402

SHAPES = {"mixtral": (4096, 14336), "qwen3": (2048, 768), "gpt-oss": (2880, 2880)}
FORMATS = ["q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4"]
L2_FLUSH = 256 << 20  # bytes of weights cycled through between uses of one copy


def timed(fn, copies: int, reps: int = 24) -> float:
    """Seconds per fn(i) call, fn(i) using copy i % copies, replayed from one CUDA graph."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(reps):
                fn(i % copies)
        run = graph.replay
    except Exception as e:  # a route that cannot be captured is timed eagerly
        print(f"  (not captured: {type(e).__name__}: {e})", flush=True)

        def run():
            for i in range(reps):
                fn(i % copies)
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def stacks(n_experts, h, f, fmt, dev):
    def make(seed):
        w = random_experts(n_experts, h, f, fmt, device=dev, seed=seed)
        return gpt_oss_function(w, limit=7.0, dtype=torch.bfloat16) if fmt == "mxfp4" else w

    one = make(0)
    copies = max(1, min(16, -(-L2_FLUSH // one.nbytes)))
    return [one] + [make(2 * i + 3) for i in range(1, copies)]


def bf16_stacks(n_experts, h, f, dev):
    nbytes = n_experts * 3 * h * f * 2
    copies = max(1, min(16, -(-L2_FLUSH // nbytes)))
    return [(torch.randn(n_experts, 2 * f, h, device=dev).to(torch.bfloat16) / h ** 0.5,
             torch.randn(n_experts, h, f, device=dev).to(torch.bfloat16) / f ** 0.5) for _ in range(copies)]


def case_sizes():
    # prefill at 64 rows on each of 8 experts: many experts with few rows each, as gpt-oss's 128 at top-4 have in a
    # 2048-token piece (past gpu_quant._MANY, so the prefill route by default), besides 256 rows on each of 2
    return [("decode", t, [t] * 8) for t in (1, 4, 16)] + [("prefill", 64, [64] * 8), ("prefill", 256, [256, 256])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep-shape", default="mixtral", choices=sorted(SHAPES))
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--sweep-cases", help="the sweep's cases, comma-separated (all of the shape's by default)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    cases = args.sweep_cases.split(",") if args.sweep_cases else None
    if args.sweep_only:
        return sweep(dev, args.formats.split(","), args.sweep_shape, cases)
    print(f"{'shape':8} {'fmt':5} {'case':8} {'rows/exp':>8} {'µs':>9} {'GB/s':>7} {'bf16 µs':>9} {'bf16 GB/s':>9} "
          f"{'vs bf16':>7}  route", flush=True)
    bf16_time = {}
    for shape in args.shapes.split(","):
        h, f = SHAPES[shape]
        base = {8: bf16_stacks(8, h, f, dev)}
        base[2] = [(gu[:2], d[:2]) for gu, d in base[8]]
        for fmt in args.formats.split(","):
            if h % packed_format(fmt).block or f % packed_format(fmt).block:
                continue  # gpt-oss's 2880 is no multiple of the k-quants' 256
            all_w = stacks(8, h, f, fmt, dev)
            for case, per, sizes in case_sizes():
                g = len(sizes)
                ws = [w.select(list(range(g))) if g < 8 else w for w in all_w]
                m = sum(sizes)
                x = torch.randn(m, h, device=dev).to(torch.bfloat16)
                ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
                packed_bytes = ws[0].nbytes
                if (shape, case, per) not in bf16_time:
                    b = base[g]
                    bf16_time[shape, case, per] = timed(
                        lambda i: gpu_experts.grouped_experts_forward(x, b[i][0], b[i][1], ends), len(b))
                tb = bf16_time[shape, case, per]
                routes = [None] if case == "decode" else ["fused", "dequant"]
                for route in routes:
                    if route == "dequant" and not gpu_quant._dequant_route_works(x):
                        continue
                    t = timed(lambda i: gpu_quant.grouped_experts_forward(x, ws[i], ends, route=route), len(ws))
                    name = route or ("fused/" + ("q8" if gpu_quant.takes_q8(x, ws[0].gate_up, fmt, m, g) else
                                                 "dot" if gpu_quant._config(x.dtype, m, g, 1)["DOT"] else "fma"))
                    print(f"{shape:8} {fmt:5} {case:8} {per:8d} {t * 1e6:9.1f} {packed_bytes / t / 1e9:7.0f} "
                          f"{tb * 1e6:9.1f} {g * 3 * h * f * 2 / tb / 1e9:9.0f} {tb / t:7.2f}  {name}", flush=True)
            del all_w
            torch.cuda.empty_cache()
    if not args.no_sweep:
        sweep(dev, [f for f in ("q4_0", "q4_k", "q5_k", "q6_k", "q8_0", "mxfp4") if f in args.formats.split(",")],
              args.sweep_shape, cases)


def _fma(r, nb, wp, bt=1):
    return dict(ROWS=r, NB=nb, BT=bt, DOT=False, SPLIT=1, num_warps=wp)


def _dot(r, nb, wp, bt=16, stages=None):
    stages = {} if stages is None else {"num_stages": stages}
    return dict(ROWS=r, NB=nb, BT=bt, DOT=True, SPLIT=1, num_warps=wp, **stages)


def _q8(r, nb, bt, wp):  # q4_k's integer route (x in 8 bits); other formats ignore the key and take their default
    return dict(Q8=True, ROWS=r, NB=nb, BT=bt, num_warps=wp)


SWEEP = {
    "decode": (1, [_fma(4, 8, 1), _q8(2, 16, 1, 1), _q8(1, 32, 1, 1), _q8(2, 32, 1, 1), _q8(4, 16, 1, 2)]),
    # one token's step as a resident Mixtral layer launches it: 2 of the 8 experts listed (group_pairs's `active`),
    # a quarter of the programs above
    "decode2": (1, [_q8(2, 16, 1, 1), _q8(1, 16, 1, 1), _q8(1, 32, 1, 1), _q8(1, 8, 1, 1), _q8(2, 8, 1, 1)]),
    "decode4": (4, [_dot(64, 4, 4), _q8(2, 16, 4, 1), _q8(4, 8, 4, 1), _q8(2, 8, 4, 1), _q8(1, 16, 4, 1),
                    _q8(4, 16, 4, 2)]),
    "decode16": (16, [_dot(64, 4, 4), _dot(64, 2, 4), _q8(2, 16, 4, 1), _q8(4, 8, 4, 1)]),
}
# gpt-oss-20b's decode: one token's 4 experts listed of the layer's 32 (here 4 of a stack of 8, the same programs)
SWEEP_GPT_OSS = {"decode4of32": (1, [_q8(2, 16, 1, 1), _q8(1, 32, 1, 1), _q8(1, 16, 1, 1), _q8(2, 32, 1, 1),
                                     _q8(2, 8, 1, 1), _q8(4, 8, 1, 1), _q8(4, 16, 1, 2), _q8(1, 64, 1, 1),
                                     _q8(1, 64, 1, 2), _q8(2, 64, 1, 2)]),
                 # sixteen sequences' step: 64 pairs over the 32 experts, two rows each on average
                 "batch16": (2, [_q8(2, 16, 2, 1), _q8(1, 32, 2, 1), _q8(1, 16, 2, 1), _q8(2, 32, 2, 1),
                                 _q8(1, 32, 4, 1), _q8(2, 16, 4, 1), _q8(4, 16, 2, 2), _dot(64, 2, 4)]),
                 # a prefill's 64 rows on each expert, the tensor-core tiles' case (gpu_quant._config's from 32 rows
                 # first): tokens, weight rows and units a step, warps, pipeline stages
                 "prefill64": (64, [_dot(r, nb, wp, bt, st) for r, nb, bt, wp, st in (
                     (128, 2, 128, 8, 3), (128, 2, 64, 8, 3), (128, 4, 64, 8, 3), (64, 4, 64, 4, 3),
                     (128, 4, 64, 4, 3), (64, 8, 64, 4, 3), (128, 8, 64, 8, 2), (64, 2, 64, 4, 3),
                     (256, 2, 64, 8, 3), (128, 4, 64, 8, 4))])}
LISTED = {"decode2": 2, "decode4of32": 4}  # cases whose launch lists only the first few experts (`active`)


def sweep(dev, formats, shape="mixtral", cases=None):
    h, f = SHAPES[shape]
    print(f"\nTile sweep, {shape} shape (µs per call; GB/s of packed bytes)", flush=True)
    default = gpu_quant._MXFP4_LOOKUP
    for fmt in formats:
        all_w = stacks(8, h, f, fmt, dev)
        for case, (per, configs) in (SWEEP_GPT_OSS if shape == "gpt-oss" else SWEEP).items():
            if cases and case not in cases:
                continue
            g = 2 if case == "prefill" else 8
            ws = [w.select(list(range(g))) if g < 8 else w for w in all_w]
            listed = LISTED.get(case, g)
            sizes = [per] * listed + [0] * (g - listed)
            x = torch.randn(sum(sizes), h, device=dev).to(torch.bfloat16)
            ends = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
            active = torch.arange(listed, dtype=torch.int32, device=dev) if listed < g else None
            read = ws[0].nbytes * sum(1 for n in sizes if n) // g  # the listed experts' bytes alone
            # mxfp4's integer route both ways: its codes split by sign, and looked up (MOEDESK_Q8_MXFP4_LOOKUP)
            reads = [(False, ""), (True, " looked up")] if fmt == "mxfp4" else [(default, "")]
            for cfg in configs:
                if cfg.get("Q8") and not gpu_quant._q8_route(x, ws[0].gate_up, fmt, x.dtype):  # mxfp4: MOEDESK_Q8_MXFP4
                    continue
                for lookup, label in reads if cfg.get("Q8") else reads[:1]:
                    gpu_quant._OVERRIDE, gpu_quant._MXFP4_LOOKUP = cfg, lookup
                    try:
                        t = timed(lambda i: gpu_quant.grouped_experts_forward(x, ws[i], ends, route="fused",
                                                                              active=active), len(ws))
                        print(f"  {fmt} {case:8} {cfg}{label}: {t * 1e6:9.1f} µs {read / t / 1e9:6.0f} GB/s",
                              flush=True)
                    except Exception as e:
                        print(f"  {fmt} {case:8} {cfg}{label}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    finally:
                        gpu_quant._OVERRIDE, gpu_quant._MXFP4_LOOKUP = None, default
        del all_w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
