"""Many experts with few tokens each, in a handful of launches: torch's grouped GEMM.

A decode step gives each GPU-resident expert a token or two. One small GEMM per expert costs
a few kernel launches and their host time each, whatever the size; `torch._grouped_mm`
runs every expert of a layer in one launch per projection (EPS-MoE's grouped launch). It is a
private torch API (2.8+, bf16 on Hopper, any dtype on the CPU), so everything it does not
cover takes kernels.gpu_grouped (the same in Triton: any CUDA GPU, bf16, fp16 or float32), and the
CPU without torch's kernel the per-expert loop, which computes the same function.
"""
from __future__ import annotations

import torch

from moedesk.kernels import gpu_grouped
from moedesk.kernels.cpu_experts import expert_forward

_grouped_mm = getattr(torch, "_grouped_mm", None)
# Where both run (bf16 on sm90) torch's kernel is taken: the Triton launch alone was faster up to 16 rows per group,
# but whole decode steps were not (tests/perf/bench_gpu_grouped.py, moedesk bench; docs/measurements.md, "The GPU
# kernels").


def grouped_supported(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether `grouped_experts_forward` takes a grouped path for these tensors (one launch a projection, the
    groups' ends read on the device), rather than one GEMM per expert."""
    if x.is_cuda:
        return _torch_grouped(x, gate_up) or gpu_grouped.applies(x, gate_up)
    return _grouped_mm is not None and x.dtype in (torch.bfloat16, torch.float32)


def _torch_grouped(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    # torch's CUDA kernel is bf16-only, for sm90, with 16-byte aligned rows.
    return (_grouped_mm is not None and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) == (9, 0)
            and gate_up.shape[-1] % 8 == 0 and gate_up.shape[-2] % 16 == 0)


def grouped_experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                            ends: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert of the stacks: group g is x[ends[g-1]:ends[g]] and uses gate_up[g], down[g].

    x [M, H]; gate_up [G, 2F, H]; down [G, H, F]; ends [G] int32 on x's device (cumulative, so empty
    groups repeat the previous end). Returns [M, H].
    """
    if x.is_cuda:
        if not _torch_grouped(x, gate_up):
            if gpu_grouped.applies(x, gate_up):
                return gpu_grouped.grouped_experts_forward(x, gate_up, down, ends)
            return _per_expert(x, gate_up, down, ends.tolist())
    elif not grouped_supported(x, gate_up):
        return _per_expert(x, gate_up, down, ends.tolist())
    h = _grouped_mm(x, gate_up.transpose(1, 2), offs=ends)
    gate, up = h.chunk(2, dim=-1)
    return _grouped_mm(torch.nn.functional.silu(gate) * up, down.transpose(1, 2), offs=ends)


def _per_expert(x, gate_up, down, ends: list[int]) -> torch.Tensor:
    out = torch.empty_like(x)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = expert_forward(x[start:end], gate_up[g], down[g])
        start = end
    return out
