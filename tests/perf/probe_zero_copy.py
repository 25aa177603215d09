"""Probe (GPU box; python3 tests/perf/probe_zero_copy.py [qwen3|mixtral]): can the GPU compute some of a decode
step's offloaded experts by reading their weights from pinned RAM directly (zero-copy, inside a CUDA graph), while
the CPU computes the others?

Question: how fast do SMs read pinned host memory over PCIe, and does that slow the CPU kernel's reads? If the two
add up, a layer's experts could be split between them with no copy queued by the host (which costs ~0.7 ms of host
time per copied expert on this box, so decode copies none today).
Prints, per case, medians over rotating experts (the set read per trial exceeds the last-level cache)."""
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from kernels import cpu_experts

SHAPES = {"qwen3": (128, 768, 2048, 8), "mixtral": (8, 14336, 4096, 2)}  # experts, F, H, top-k


class HostPointer:
    """A pinned CPU tensor as Triton sees a pointer argument (UVA: the host address is valid on the device)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


@triton.jit
def _gate_up(x_ptr, w_ptr, ids_ptr, h_ptr, H, F, BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr):
    pair = tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    base = w_ptr + e * 2 * F * H
    acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
    for c0 in range(0, H, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + cols).to(tl.float32)
        g = tl.load(base + rows[:, None] * H + cols[None, :]).to(tl.float32)
        u = tl.load(base + (rows[:, None] + F) * H + cols[None, :]).to(tl.float32)
        acc_g += tl.sum(g * x[None, :], axis=1)
        acc_u += tl.sum(u * x[None, :], axis=1)
    gate = acc_g.to(tl.bfloat16).to(tl.float32)
    up = acc_u.to(tl.bfloat16).to(tl.float32)
    act = (gate / (1 + tl.exp(-gate))).to(tl.bfloat16).to(tl.float32)
    tl.store(h_ptr + pair * F + rows, (act * up).to(tl.bfloat16))


@triton.jit
def _down(h_ptr, w_ptr, ids_ptr, out_ptr, H, F, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr):
    pair = tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    base = w_ptr + e * H * F
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        inside = cols < F
        h = tl.load(h_ptr + pair * F + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(base + rows[:, None] * F + cols[None, :], mask=inside[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * h[None, :], axis=1)
    tl.store(out_ptr + pair * H + rows, acc.to(tl.bfloat16))


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
    gu_ptr, d_ptr = HostPointer(gate_up), HostPointer(down)
    results = {}

    def zc(ids_dev, h, out, bf=8, bh=None, bc=8, bfd=None):
        n = ids_dev.numel()
        _gate_up[(F // bf, n)](x_dev, gu_ptr, ids_dev, h, H, F, BLOCK_F=bf, BLOCK_H=bh or min(H, 2048))
        _down[(H // bc, n)](h, d_ptr, ids_dev, out, H, F, BLOCK_C=bc, BLOCK_F=bfd or triton.next_power_of_2(min(F, 1024)))

    # Correctness of the probe kernels against the engine's expert arithmetic on one expert.
    ids = torch.tensor([3 % E], device=dev)
    h = torch.empty(1, F, dtype=torch.bfloat16, device=dev)
    out = torch.empty(1, H, dtype=torch.bfloat16, device=dev)
    zc(ids, h, out)
    ref = cpu_experts.expert_forward(x_dev, gate_up[3 % E].to(dev), down[3 % E].to(dev))
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(f"zero-copy expert vs torch: max rel err {err:.2e}")

    rotation = [0]

    def next_experts(n):
        start = rotation[0]
        rotation[0] = (start + n) % E
        return [(start + i) % E for i in range(n)]

    def timed_gpu(n, **kw):
        ids = torch.tensor(next_experts(n), device=dev)
        h = torch.empty(n, F, dtype=torch.bfloat16, device=dev)
        out = torch.empty(n, H, dtype=torch.bfloat16, device=dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record(); zc(ids, h, out, **kw); b.record(); b.synchronize()
        return a.elapsed_time(b) * 1e3

    cpu_out = torch.empty(K, H, dtype=torch.bfloat16, pin_memory=True)
    index = torch.empty(4 * K + 2 * E + 1, dtype=torch.int64)

    def cpu_call(experts):
        pair_expert = torch.tensor(sorted(experts), dtype=torch.int64)
        t0 = time.perf_counter()
        cpu_experts.experts_forward_routed(x_host, pair_expert, len(experts), None, gate_up, down, cpu_out, index)
        return (time.perf_counter() - t0) * 1e6

    reps = 30 if name == "qwen3" else 8
    # Zero-copy alone, several tilings.
    variants = {"bf8": dict(bf=8), "bf4": dict(bf=4), "bf16": dict(bf=16), "bf8-h512": dict(bf=8, bh=512),
                "bc4": dict(bf=8, bc=4), "bc16": dict(bf=8, bc=16)}
    n_gpu = 2 if name == "qwen3" else 1
    for label, kw in variants.items():
        try:
            timed_gpu(n_gpu, **kw)
            us = statistics.median(timed_gpu(n_gpu, **kw) for _ in range(reps))
            results[f"zc {n_gpu} experts {label}"] = (us, n_gpu * expert_bytes / us / 1e3)
        except Exception as exc:  # a tiling that does not compile for this shape
            print(label, "failed:", str(exc).splitlines()[0][:120])
    timed = {label: results[f"zc {n_gpu} experts {label}"][0] for label in variants if f"zc {n_gpu} experts {label}" in results}
    best = variants[min(timed, key=timed.get)]
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
        h = torch.empty(n_gpu, F, dtype=torch.bfloat16, device=dev)
        out = torch.empty(n_gpu, H, dtype=torch.bfloat16, device=dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record(); zc(ids, h, out, **best); b.record()
        cpu_t.append(cpu_call(next_experts(K - n_gpu)))
        b.synchronize()
        wall_t.append((time.perf_counter() - t0) * 1e6)
        gpu_t.append(a.elapsed_time(b) * 1e3)
    results[f"together: gpu {n_gpu} zc"] = (statistics.median(gpu_t), n_gpu * expert_bytes / statistics.median(gpu_t) / 1e3)
    results[f"together: cpu {K - n_gpu}"] = (statistics.median(cpu_t), (K - n_gpu) * expert_bytes / statistics.median(cpu_t) / 1e3)
    results["together: wall"] = (statistics.median(wall_t), K * expert_bytes / statistics.median(wall_t) / 1e3)
    print(f"{name}: expert {expert_bytes / 1e6:.1f} MB, top-{K}; best tiling {best}")
    print(f"{'case':<28}{'us':>10}{'GB/s':>8}")
    for k, (us, gbs) in results.items():
        print(f"{k:<28}{us:>10.0f}{gbs:>8.1f}")


if __name__ == "__main__":
    main()
