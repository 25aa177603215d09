"""Few tokens through one packed matrix (kernels.gpu_quant.packed_linear): the non-expert weights of a decode step.

Usage (repo root, GPU box): python tests/perf/bench_packed_linear.py [--shapes gpt-oss-20b] [--formats q8_0] [--rows 1]

For each of a model's packed non-expert matrices at `--rows` tokens (1: one sequence's decode step; 16: sixteen
sequences'; gpt-oss-20b: the fused q/k/v projection, the output projection, the head), µs per call and the GB/s its
packed bytes were read at, for the integer route's tiles (ROWS rows x NB units a program, num_warps; min(rows, 4)
tokens a step) beside the route packed_linear takes by default, the matrix dequantised to bf16 and multiplied by cuBLAS
(the engine's route from LINEAR_ROWS rows), and cuBLAS on the same matrix held in bf16. Calls replay from a CUDA graph
and cycle over copies of the matrix so the weights come from memory, not from L2 (tests/perf/bench_gpu_quant.py's
`timed`). The default tile is marked; the fastest per matrix is printed last.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moedesk.kernels import gpu_quant  # noqa: E402
from tests.kernels.test_gpu_quant_kernel import random_stack  # noqa: E402
from tests.perf.bench_gpu_quant import L2_FLUSH, timed  # noqa: E402

# (name, rows, k) of each packed matrix a decode step reads once a layer (the head once a step)
SHAPES = {"gpt-oss-20b": [("qkv", 5120, 2880), ("o", 2880, 4096), ("head", 201088, 2880)],
          "qwen3-30b-a3b": [("qkv", 5120, 2048), ("o", 2048, 4096), ("head", 151936, 2048)],
          "mixtral-8x7b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("head", 32000, 4096)]}
TILES = [(1, 32, 1), (2, 16, 1), (2, 32, 1), (4, 16, 1), (4, 32, 2), (8, 16, 2), (8, 32, 4), (16, 16, 4), (1, 16, 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gpt-oss-20b")
    ap.add_argument("--formats", default="q8_0")
    ap.add_argument("--rows", type=int, default=1, help="tokens a call (rows of x)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    best = []
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            for name, rows, k in SHAPES[shape]:
                one = random_stack(1, rows, k, fmt, dev, seed=rows)[0]
                copies = [one] + [random_stack(1, rows, k, fmt, dev, seed=rows + i)[0]
                                  for i in range(1, max(1, min(8, -(-L2_FLUSH // one.nbytes))))]
                x = torch.randn(args.rows, k, device=dev).to(torch.bfloat16)
                dense = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                         for _ in range(max(1, min(4, -(-L2_FLUSH // (rows * k * 2)))))]
                t_bf16 = timed(lambda i: F.linear(x, dense[i]), len(dense))
                del dense
                print(f"{shape} {fmt} {name} [{rows} x {k}]: {one.nbytes / 1e6:.1f} MB packed; cuBLAS bf16 "
                      f"{t_bf16 * 1e6:.1f} µs ({rows * k * 2 / t_bf16 / 1e9:.0f} GB/s)", flush=True)
                # what the engine's PackedLinear does from LINEAR_ROWS rows: dequantised to bf16, then cuBLAS
                t_dequant = timed(lambda i: F.linear(x, gpu_quant.dequantize_experts(copies[i][None], fmt, k)[0]),
                                  len(copies))
                print(f"  dequantised, then cuBLAS: {t_dequant * 1e6:8.1f} µs", flush=True)
                t_default = timed(lambda i: gpu_quant.packed_linear(x, copies[i], fmt), len(copies))
                route = "integer" if gpu_quant.takes_q8(x, one, fmt, args.rows, 1, linear=True) else "float"
                print(f"  packed_linear as it chooses ({route} route): {t_default * 1e6:8.1f} µs "
                      f"{one.nbytes / t_default / 1e9:6.0f} GB/s", flush=True)
                default = gpu_quant._q8_config(args.rows, fmt)
                bt = min(4, args.rows)
                results = [(t_default, 0, 0, 0)]
                for r, nb, wp in TILES:
                    gpu_quant._OVERRIDE = dict(Q8=True, ROWS=r, NB=nb, BT=bt, num_warps=wp)
                    try:
                        t = timed(lambda i: gpu_quant.packed_linear(x, copies[i], fmt), len(copies))
                    except Exception as e:
                        print(f"  ROWS={r} NB={nb} warps={wp}: failed {type(e).__name__}: {str(e)[:160]}")
                        continue
                    finally:
                        gpu_quant._OVERRIDE = None
                    mark = " (default)" if (r, nb, wp) == (default["ROWS"], default["NB"], default["num_warps"]) else ""
                    print(f"  ROWS={r:2d} NB={nb:2d} warps={wp}: {t * 1e6:8.1f} µs {one.nbytes / t / 1e9:6.0f} GB/s"
                          f"{mark}", flush=True)
                    results.append((t, r, nb, wp))
                t, r, nb, wp = min(results)
                tile = f"ROWS={r} NB={nb} warps={wp}" if r else f"the {route} route as chosen"
                best.append(f"{shape} {fmt} {name} at {args.rows} rows: best {tile} {t * 1e6:.1f} µs "
                            f"{one.nbytes / t / 1e9:.0f} GB/s; as chosen {t_default * 1e6:.1f} µs; "
                            f"dequantised + cuBLAS {t_dequant * 1e6:.1f} µs; cuBLAS bf16 {t_bf16 * 1e6:.1f} µs")
                del copies
                torch.cuda.empty_cache()
    print("\n" + "\n".join(best))


if __name__ == "__main__":
    main()
