"""Probe (GPU box; python3 tests/perf/probe_split_batch.py [--format q4_0] [--tokens 1,2,4,8]): at a few tokens
per expert, would a layer of packed Mixtral experts go faster with the GPU reading part of every expert's rows from
pinned RAM (kernels/gpu_zero_copy.py) while the CPU kernel computes the rest?

At one token the CPU kernel reads RAM at ~130 GB/s and the split gains ~6%: the two slow each other's reads. With
16 sequences each of a layer's 8 experts gets ~4 tokens and the kernel computes at ~115 GB/s, bound by its
instructions more than by RAM, so RAM may have room for the GPU's reads. Measured per T (tokens per expert):
a layer of 8 experts, the GPU taking the last r intermediate rows of every expert (streamed from pinned RAM) while
the CPU kernel computes the first F - r, both launched together and timed until both are done; r = 0 is the CPU
alone. The GPU reads each expert's rows once, as a kernel grouping an expert's tokens would; `best` is the CPU
alone against the best r.

What came of it (GPU box, 2026-11-26): the split, built with a kernel that reads each expert's rows once for all of
its tokens (commit 77d6d46), made a layer of 8 q4_0 experts at 4 tokens each 1.25x faster than the CPU alone
(10.9 -> 8.7 ms), but the engine's 16-sequence decode already copies about half of the experts to the GPU by DMA
(54 GB/s, where a kernel reads pinned RAM at ~45), and a split step copies none: alternating runs (`moedesk bench
--shape mixtral-8x7b --layers 8 --expert-format q4_0 --batch 16`, one H200 machine) decoded 16 sequences at 230.8
and 269.7 tok/s split (2,944 and 4,512 GPU rows) against 271.3-282.1 without. Taken back; what is left for 16 sequences is the CPU
kernel at a few tokens per expert."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_quant import packed_stack, use_threads  # noqa: E402
from moedesk.kernels import cpu_quant, gpu_zero_copy  # noqa: E402
from moedesk.kernels.expert_weights import ExpertWeights  # noqa: E402

E, H, F, ACTIVE = 16, 4096, 14336, 8  # a stack of 16 Mixtral experts; the CPU's call computes 8 of them


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="q4_0")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--gpu-rows", default="0,1024,2048,3072,4096,5120,6144", help="rows of every expert the GPU takes")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=15)
    args = ap.parse_args()
    dev = torch.device("cuda")
    use_threads(args.threads)  # the engine's count: cores - 1
    w = ExpertWeights(packed_stack(args.format, E, 2 * F, H, True), packed_stack(args.format, E, H, F, True), H, F,
                      args.format, args.format)
    gen = torch.Generator().manual_seed(0)
    layer = ACTIVE * w.expert_bytes
    splits = [int(r) for r in args.gpu_rows.split(",")]
    print(f"{args.format}, {ACTIVE} Mixtral experts a call ({layer / 1e6:.0f} MB), {args.threads} CPU threads; "
          f"ms a layer, median of {args.rounds} rounds (the cases take turns)")
    print(f"{'T':>3} " + " ".join(f"{f'gpu {r}':>9}" for r in splits) + f" {'best':>6}")
    for T in [int(t) for t in args.tokens.split(",")]:
        pe = torch.arange(ACTIVE).repeat_interleave(T)
        x = torch.randn(pe.numel(), H, generator=gen).to(torch.bfloat16)
        cpu_out = torch.empty(pe.numel(), H, dtype=torch.float32)
        # The GPU's share reads each expert's rows once whatever T (a grouped kernel would): one token an expert.
        x_dev = x[::T].to(dev)
        ids = torch.arange(ACTIVE, device=dev).view(-1, 1)
        gpu_out = torch.empty(ACTIVE, H, dtype=torch.float32, device=dev)

        def layer_ms(gpu_rows, base):
            first = base * ACTIVE
            ids_r = ids + first % (E - ACTIVE + 1)  # another window of the stack each call: little left in the LLC
            pe_r = pe + first % (E - ACTIVE + 1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            if gpu_rows:
                gpu_zero_copy.zero_copy_experts(x_dev, ids_r, 0, w, gpu_out, first_row=F - gpu_rows)
            cpu_quant.experts_forward_routed(x, pe_r, 1, None, w, cpu_out, rows=F - gpu_rows if gpu_rows else None)
            torch.cuda.synchronize()
            return (time.perf_counter() - t) * 1e3

        for r in splits:
            layer_ms(r, 0)
        times = {r: [] for r in splits}
        for k in range(args.rounds):
            for j in range(len(splits)):
                r = splits[(j + k) % len(splits)]
                times[r].append(layer_ms(r, k + j))
        med = {r: statistics.median(v) for r, v in times.items()}
        best = min(med, key=med.get)
        print(f"{T:>3} " + " ".join(f"{med[r]:>9.2f}" for r in splits) + f" {med[splits[0]] / med[best]:>5.2f}x")


if __name__ == "__main__":
    main()
