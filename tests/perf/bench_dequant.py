"""A layer's packed experts dequantised to bf16 (kernels.gpu_quant.dequantize_experts): the prefill route's first
step, which writes every expert a prefill uses in bf16 before cuBLAS multiplies them.

Usage (repo root, GPU box): python tests/perf/bench_dequant.py [--shapes gpt-oss-20b,mixtral-8x7b] [--json PATH]

For each shape's gate/up and down stacks (every expert of a layer, as a 512-token prefill routes to nearly all of
them), µs per call and the GB/s of bf16 written, for a sweep of _dequant's tiles (ROWS weight rows x NB units a
program, warps); the default tile is marked. Calls replay from a CUDA
graph (tests/perf/bench_gpu_quant.py's `timed`). Last, per shape, the tile fastest over both stacks together, and
with --json every figure.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moedesk.kernels import gpu_quant  # noqa: E402
from tests.kernels.test_gpu_quant_kernel import random_stack  # noqa: E402
from tests.perf.bench_gpu_quant import timed  # noqa: E402

# (format, [(name, experts, rows, k)]) of a layer's expert stacks: gate/up (2F rows of H) and down (H rows of F)
SHAPES = {"gpt-oss-20b": ("mxfp4", [("gate_up", 32, 5760, 2880), ("down", 32, 2880, 2880)]),
          "mixtral-8x7b": ("q4_k", [("gate_up", 8, 28672, 4096), ("down", 8, 4096, 14336)]),
          "qwen3-30b-a3b": ("q4_k", [("gate_up", 128, 1536, 2048), ("down", 128, 2048, 768)])}
TILES = ([dict(ROWS=r, NB=nb, num_warps=4) for r, nb in itertools.product((16, 32, 64), (4, 8, 16))]
         + [dict(ROWS=r, NB=nb, num_warps=8) for r, nb in ((32, 8), (64, 8), (64, 16))])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gpt-oss-20b,mixtral-8x7b")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    figures, best = [], []
    for shape in args.shapes.split(","):
        fmt, stacks = SHAPES[shape]
        totals = {}
        for name, experts, rows, k in stacks:
            stack = random_stack(experts, rows, k, fmt, dev, seed=rows)
            written = experts * rows * k * 2
            print(f"{shape} {fmt} {name} [{experts} x {rows} x {k}]: {stack.nbytes / 1e6:.0f} MB packed, "
                  f"{written / 1e6:.0f} MB of bf16", flush=True)
            for tile in TILES:
                gpu_quant._DEQUANT_OVERRIDE = tile
                try:
                    t = timed(lambda i: gpu_quant.dequantize_experts(stack, fmt, k), 1, reps=8)
                except Exception as e:
                    print(f"  {tile}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                finally:
                    gpu_quant._DEQUANT_OVERRIDE = None
                mark = " (default)" if tile == gpu_quant._DEQUANT_TILE else ""
                print(f"  {tile}: {t * 1e6:8.1f} µs {written / t / 1e9:6.0f} GB/s written{mark}", flush=True)
                figures.append(dict(shape=shape, fmt=fmt, stack=name, tile=tile, us=t * 1e6))
                key = json.dumps(tile, sort_keys=True)
                totals[key] = totals.get(key, 0.0) + t
            del stack
            torch.cuda.empty_cache()
        default = totals.get(json.dumps(gpu_quant._DEQUANT_TILE, sort_keys=True))
        key, t = min(totals.items(), key=lambda kv: kv[1])
        best.append(dict(shape=shape, fmt=fmt, tile=json.loads(key), us=t * 1e6,
                         default_us=None if default is None else default * 1e6))
        print(f"{shape} {fmt}: gate/up and down fastest with {key}: {t * 1e6:.1f} µs; the default "
              f"{'-' if default is None else f'{default * 1e6:.1f}'} µs", flush=True)
    print("\n" + "\n".join(f"{b['shape']} {b['fmt']} best {b['tile']} {b['us']:.1f} µs (default "
                           f"{'-' if b['default_us'] is None else round(b['default_us'], 1)})" for b in best))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(figures=figures, best=best), f, indent=1)


if __name__ == "__main__":
    main()
