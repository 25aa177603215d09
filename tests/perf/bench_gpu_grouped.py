"""Dense resident experts on the GPU: the Triton grouped launch (kernels.gpu_grouped) against torch's grouped GEMM
and one GEMM per expert.

Usage (repo root, GPU box):  python tests/perf/bench_gpu_grouped.py [--shapes demo,qwen3,mixtral] [--tokens 1,8,256]

For each shape (H, F, experts, top-k) and dtype, a layer's experts all resident, T tokens routed at random
(top-k distinct experts each): ms per call of
- loop: one GEMM per expert, the groups' sizes read on the host (what a GPU without a grouped path ran, its
  wait for the routing included);
- torch: torch._grouped_mm (bf16 on sm90 only);
- triton: kernels.gpu_grouped, the path for float32, float16 and GPUs other than sm90; float32 both with IEEE
  products and with 3xTF32 (gpu_grouped.FP32_DOT).
Prints a table and the largest difference of each grouped result from the loop's, relative to its RMS.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moedesk.kernels import gpu_experts, gpu_grouped  # noqa: E402

SHAPES = {"demo": (576, 1536, 4, 2), "qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}


def routed(tokens: int, experts: int, k: int, hidden: int, dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(k, dim=1).indices.view(-1)
    counts = torch.bincount(ids, minlength=experts)
    x = torch.randn(tokens * k, hidden, generator=g, device="cuda").to(dtype)
    return x, counts.cumsum(0).to(torch.int32)


def ms_per_call(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="demo,qwen3,mixtral")
    ap.add_argument("--tokens", default="1,4,16,64,256,2048")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':>8} {'dtype':>9} {'T':>5} {'loop ms':>8} {'torch ms':>9} {'triton ms':>10} {'err':>8}"
          f" {'tf32x3 ms':>10} {'err':>8}")
    for name in args.shapes.split(","):
        hidden, width, experts, k = SHAPES[name]
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            g = torch.Generator().manual_seed(0)
            gate_up = (torch.randn(experts, 2 * width, hidden, generator=g) / hidden ** 0.5).to(dtype).cuda()
            down = (torch.randn(experts, hidden, width, generator=g) / width ** 0.5).to(dtype).cuda()
            for t in (int(s) for s in args.tokens.split(",")):
                x, ends = routed(t, experts, k, hidden, dtype)
                loop = ms_per_call(lambda: gpu_experts._per_expert(x, gate_up, down, ends.tolist()))
                ref = gpu_experts._per_expert(x, gate_up, down, ends.tolist()).float()
                torch_ms = float("nan")
                if gpu_experts._torch_grouped(x, gate_up):
                    torch_ms = ms_per_call(lambda: gpu_experts.grouped_experts_forward(x, gate_up, down, ends))
                cells = []
                for dot in ("ieee", "tf32x3") if dtype == torch.float32 else ("",):
                    gpu_grouped.FP32_DOT = dot
                    ms = ms_per_call(lambda: gpu_grouped.grouped_experts_forward(x, gate_up, down, ends))
                    got = gpu_grouped.grouped_experts_forward(x, gate_up, down, ends).float()
                    err = ((got - ref).abs().max() / ref.pow(2).mean().sqrt()).item()
                    cells.append(f"{ms:10.3f} {err:8.1e}")
                gpu_grouped.FP32_DOT = "ieee"
                print(f"{name:>8} {str(dtype)[6:]:>9} {t:>5} {loop:8.3f} {torch_ms:9.3f} {' '.join(cells)}", flush=True)
            del gate_up, down
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
