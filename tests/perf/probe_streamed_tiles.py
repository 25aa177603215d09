"""How fast the GPU reads a packed expert's rows straight from pinned RAM (kernels.gpu_zero_copy) per tile shape.

The row split (OffloadExecutor.width_split) pays only if the GPU's share crosses PCIe near the link's speed; bf16's
dense kernels do, this times the packed one's tiles. Mixtral-8x7B expert shape, two experts a try (fresh ones each
try, as decode reads them), the last `--rows` intermediate rows of each. Prints GB/s of packed bytes per tile:

    python3 tests/perf/probe_streamed_tiles.py --format q4_0 --rows 3584
"""
import argparse
import itertools
import statistics

import torch

from moedesk.kernels import gpu_zero_copy
from moedesk.kernels.expert_weights import ExpertWeights
from moedesk.kernels.quant_formats import packed_format

parser = argparse.ArgumentParser()
parser.add_argument("--format", default="q4_0")
parser.add_argument("--rows", type=int, default=3584)
parser.add_argument("--experts", type=int, default=8)
parser.add_argument("--repeat", type=int, default=9)
args = parser.parse_args()
H, F, E = 4096, 14336, args.experts
fmt = packed_format(args.format)
gen = torch.Generator().manual_seed(0)


def random_bytes(rows, k):
    t = torch.randint(0, 256, (E, rows, fmt.row_bytes(k)), dtype=torch.uint8, generator=gen)
    return t.pin_memory()


w = ExpertWeights(random_bytes(2 * F, H), random_bytes(H, F), H, F, args.format, args.format)
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
out = torch.zeros(2, H, device="cuda", dtype=torch.float32)
first_row = F - args.rows
read = 2 * (2 * args.rows * fmt.row_bytes(H) + H * fmt.row_bytes(args.rows))
turn = itertools.count()
results = []
for rows, nb, warps in itertools.product((2, 4, 8, 16), (8, 16, 32), (1, 2, 4)):
    gpu_zero_copy._PACKED_TILES.update(ROWS=rows, NB=nb, num_warps=warps)
    times = []
    try:
        for i in range(args.repeat + 1):
            e = next(turn) % (E // 2) * 2
            ids = torch.tensor([[e, e + 1]], device="cuda")
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gpu_zero_copy.zero_copy_experts(x, ids, 0, w, out, first_row=first_row)
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end))
    except Exception as exc:  # a tile Triton cannot build
        print(f"ROWS={rows} NB={nb} warps={warps}: {type(exc).__name__}")
        continue
    ms = statistics.median(times)
    results.append((read / ms / 1e6, rows, nb, warps, ms))
    print(f"ROWS={rows:<3} NB={nb:<3} warps={warps}: {ms:.3f} ms, {read / ms / 1e6:.1f} GB/s", flush=True)
print(f"\n{args.format}, last {args.rows} of {F} rows of 2 experts ({read / 1e6:.1f} MB), best tiles:")
for gbs, rows, nb, warps, ms in sorted(results, reverse=True)[:5]:
    print(f"  ROWS={rows} NB={nb} num_warps={warps}: {gbs:.1f} GB/s ({ms:.3f} ms)")
