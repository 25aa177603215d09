"""Many experts with few tokens each, in a handful of launches: torch's grouped GEMM.

A decode step gives each GPU-resident expert a token or two. One small GEMM per expert costs
a few kernel launches and their host time each, whatever the size; `torch._grouped_mm`
runs every expert of a layer in one launch per projection (EPS-MoE's grouped launch). It is a
private torch API (2.8+, bf16 on Hopper, any dtype on the CPU), so everything it does not
cover takes kernels.gpu_grouped (the same in Triton: any CUDA GPU, bf16, fp16 or float32), and the
CPU without torch's kernel the per-expert loop, which computes the same function.

gpt-oss's experts (a bias after each projection, the clamped SwiGLU: kernels.expert_weights) take the same paths,
rounding as its reference's torch ops do: each projection's output, then its bias added, in x's dtype.
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


def grouped_experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ends: torch.Tensor, *,
                            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                            glu=None, active: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of x grouped by expert of the stacks: group g is x[ends[g-1]:ends[g]] and uses gate_up[g], down[g].

    x [M, H]; gate_up [G, 2F, H]; down [G, H, F]; ends [G] int32 on x's device (cumulative, so empty
    groups repeat the previous end). Returns [M, H]. gate_up_bias [G, 2F], down_bias [G, H] and glu (a
    ClampedSwiGLU) where the experts are gpt-oss's. active: the groups with rows where known on the device
    (kernels.gpu_fused.group_pairs), for the Triton kernel's launch (torch's grouped GEMM reads `ends` alone).
    """
    function = dict(gate_up_bias=gate_up_bias, down_bias=down_bias, glu=glu)
    if x.is_cuda:
        if not _torch_grouped(x, gate_up):
            if gpu_grouped.applies(x, gate_up):
                return gpu_grouped.grouped_experts_forward(x, gate_up, down, ends, active=active, **function)
            return _per_expert(x, gate_up, down, ends.tolist(), **function)
    elif not grouped_supported(x, gate_up):
        return _per_expert(x, gate_up, down, ends.tolist(), **function)
    # Each row's group, for the biases: found on the device, so that nothing waits for the routing on the host.
    group = None if gate_up_bias is None and down_bias is None else torch.searchsorted(
        ends, torch.arange(x.shape[0], dtype=ends.dtype, device=ends.device), right=True)
    h = _grouped_mm(x, gate_up.transpose(1, 2), offs=ends)
    if gate_up_bias is not None:
        h = h + gate_up_bias[group]
    gate, up = h.chunk(2, dim=-1)
    act = glu(gate, up) if glu is not None else torch.nn.functional.silu(gate) * up
    y = _grouped_mm(act, down.transpose(1, 2), offs=ends)
    return y if down_bias is None else y + down_bias[group]


def biased_expert_forward(x, gate_up, down, gate_up_bias=None, down_bias=None, glu=None) -> torch.Tensor:
    """One expert with gpt-oss's function, in torch ops on x's device and dtype (its reference's roundings);
    kernels.cpu_experts.expert_forward without biases and activation."""
    if gate_up_bias is None and down_bias is None and glu is None:
        return expert_forward(x, gate_up, down)
    h = x @ gate_up.T
    if gate_up_bias is not None:
        h = h + gate_up_bias
    gate, up = h.chunk(2, dim=-1)
    y = (glu(gate, up) if glu is not None else torch.nn.functional.silu(gate) * up) @ down.T
    return y if down_bias is None else y + down_bias


def _per_expert(x, gate_up, down, ends: list[int], gate_up_bias=None, down_bias=None, glu=None) -> torch.Tensor:
    out = torch.empty_like(x)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = biased_expert_forward(x[start:end], gate_up[g], down[g],
                                                   None if gate_up_bias is None else gate_up_bias[g],
                                                   None if down_bias is None else down_bias[g], glu)
        start = end
    return out
