"""Probe (GPU box; python3 tests/perf/probe_zero_copy.py [qwen3|mixtral]): can the GPU compute some of a decode
step's offloaded experts by reading their weights from pinned RAM directly (zero-copy, inside a CUDA graph), while
the CPU computes the others?

Question: how fast do SMs read pinned host memory over PCIe, and does that slow the CPU kernel's reads? If the two
add up, a layer's experts could be split between them with no copy queued by the host (which costs ~0.7 ms of host
time per copied expert on this box, so decode copies none today).
Prints, per case, medians over rotating experts (the set read per trial exceeds the last-level cache). The kernels
are kernels.gpu_zero_copy's; an earlier version of this probe (64cdc74) tried six tilings of its own, all within 3%."""
import statistics
import sys
import time

import torch

from moedesk.kernels.expert_weights import ExpertWeights
from moedesk.kernels import cpu_experts, gpu_zero_copy

SHAPES = {"qwen3": (128, 768, 2048, 8), "mixtral": (8, 14336, 4096, 2)}  # experts, F, H, top-k


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen3"
    E, F, H, K = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    gate_up = torch.empty((E, 2 * F, H), dtype=torch.bfloat16, pin_memory=True)
    down = torch.empty((E, H, F), dtype=torch.bfloat16, pin_memory=True)
    block = (torch.randn(1 << 22, generator=g) * 0.02).to(torch.bfloat16)
    for t in (gate_up.view(-1), down.view(-1)):  # tiled random values: fast to fill, real arithmetic
        for s in range(0, t.numel(), block.numel()):
            t[s:s + block.numel()] = block[:t.numel() - s]
    expert_bytes = 3 * F * H * 2
    x_dev = (torch.randn(1, H, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    x_host = x_dev.cpu()
    results = {}

    def zc(ids_dev, out):
        gpu_zero_copy.zero_copy_experts(x_dev, ids_dev.view(1, -1), 0, ExpertWeights(gate_up, down, H, F), out)

    # Correctness of the probe kernels against the engine's expert arithmetic on one expert.
    ids = torch.tensor([3 % E], device=dev)
    out = torch.empty(1, H, dtype=torch.bfloat16, device=dev)
    zc(ids, out)
    ref = cpu_experts.expert_forward(x_dev, gate_up[3 % E].to(dev), down[3 % E].to(dev))
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(f"zero-copy expert vs torch: max rel err {err:.2e}")

    rotation = [0]

    def next_experts(n):
        start = rotation[0]
        rotation[0] = (start + n) % E
        return [(start + i) % E for i in range(n)]

    def timed_gpu(n):
        ids = torch.tensor(next_experts(n), device=dev)
        out = torch.empty(n, H, dtype=torch.bfloat16, device=dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record(); zc(ids, out); b.record(); b.synchronize()
        return a.elapsed_time(b) * 1e3

    cpu_out = torch.empty(K, H, dtype=torch.bfloat16, pin_memory=True)
    index = torch.empty(4 * K + 2 * E + 1, dtype=torch.int64)

    def cpu_call(experts):
        pair_expert = torch.tensor(sorted(experts), dtype=torch.int64)
        t0 = time.perf_counter()
        cpu_experts.experts_forward_routed(x_host, pair_expert, len(experts), None, gate_up, down, cpu_out, index)
        return (time.perf_counter() - t0) * 1e6

    reps = 30 if name == "qwen3" else 8
    # Zero-copy alone.
    n_gpu = 2 if name == "qwen3" else 1
    timed_gpu(n_gpu)
    us = statistics.median(timed_gpu(n_gpu) for _ in range(reps))
    results[f"zc {n_gpu} experts"] = (us, n_gpu * expert_bytes / us / 1e3)
    # Copy engine, for reference.
    staging = torch.empty(n_gpu, 3 * F * H, dtype=torch.bfloat16, device=dev)

    def timed_dma():
        es = next_experts(n_gpu)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for i, e in enumerate(es):
            staging[i, :2 * F * H].copy_(gate_up[e].view(-1), non_blocking=True)
            staging[i, 2 * F * H:].copy_(down[e].view(-1), non_blocking=True)
        b.record(); b.synchronize()
        return a.elapsed_time(b) * 1e3
    us = statistics.median(timed_dma() for _ in range(reps))
    results[f"dma copy {n_gpu} experts"] = (us, n_gpu * expert_bytes / us / 1e3)
    # CPU alone: all K, and K - n_gpu.
    cpu_call(next_experts(K))
    for n in (K, K - n_gpu):
        us = statistics.median(cpu_call(next_experts(n)) for _ in range(reps))
        results[f"cpu {n} experts"] = (us, n * expert_bytes / us / 1e3)
    # Together: the GPU's zero-copy share launched, then the CPU's share on the calling thread.
    cpu_t, gpu_t, wall_t = [], [], []
    for _ in range(reps):
        ids = torch.tensor(next_experts(n_gpu), device=dev)
        out = torch.empty(n_gpu, H, dtype=torch.bfloat16, device=dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record(); zc(ids, out); b.record()
        cpu_t.append(cpu_call(next_experts(K - n_gpu)))
        b.synchronize()
        wall_t.append((time.perf_counter() - t0) * 1e6)
        gpu_t.append(a.elapsed_time(b) * 1e3)
    results[f"together: gpu {n_gpu} zc"] = (statistics.median(gpu_t), n_gpu * expert_bytes / statistics.median(gpu_t) / 1e3)
    results[f"together: cpu {K - n_gpu}"] = (statistics.median(cpu_t), (K - n_gpu) * expert_bytes / statistics.median(cpu_t) / 1e3)
    results["together: wall"] = (statistics.median(wall_t), K * expert_bytes / statistics.median(wall_t) / 1e3)
    print(f"{name}: expert {expert_bytes / 1e6:.1f} MB, top-{K}")
    print(f"{'case':<28}{'us':>10}{'GB/s':>8}")
    for k, (us, gbs) in results.items():
        print(f"{k:<28}{us:>10.0f}{gbs:>8.1f}")


if __name__ == "__main__":
    main()
