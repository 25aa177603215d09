"""Experts computed on the GPU from weights left in pinned RAM, read over PCIe as the kernel runs (zero-copy).

At decode the CPU computes a layer's offloaded experts one token at a time, bound by its read bandwidth
(~120 GB/s on the GPU box), while the PCIe link idles: copying an expert costs the host ~0.7 ms of
queueing, more than the CPU takes to compute it. A kernel can instead read the weights straight from
pinned memory (UVA makes a pinned host address valid on the device): on the H100 box SMs read them at
46-50 GB/s, the copy engine's 51-55, and reading 2 of 8 Qwen3 experts this way slowed the CPU's reads of
the other 6 by 8% (tests/perf/probe_zero_copy.py). Which experts to read comes from the routing on the
device, so the launch needs no host decision and CUDA graphs capture it.

The arithmetic rounds where engine.offload.offload_executor.expert_forward's torch ops round (gate and up, the activation,
their product, the output), each dot product summed in float32. TRITON_INTERPRET=1 runs it on the CPU,
which is how CI checks it.
"""
from __future__ import annotations

import os

import torch

from kernels import gpu_fused

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

_ROWS = 8  # rows of a weight per program: enough programs for two experts to fill the SMs' reads


def applies(device: torch.device, gate_up: torch.Tensor) -> bool:
    """Whether `streamed_experts` takes inputs on `device` and these stacks: a CUDA device, the stacks in pinned
    host memory (inputs must be in the stacks' dtype), Triton there and the fused kernels not turned off."""
    return gpu_fused.wanted() and device.type == "cuda" and not gate_up.is_cuda and gate_up.is_pinned()


def streamed_experts(x: torch.Tensor, ids: torch.Tensor, first_rank: int, gate_up: torch.Tensor,
                     down: torch.Tensor, out: torch.Tensor) -> None:
    """out[t*K + r] = expert ids[t, r] applied to x[t] for every token t and rank r >= first_rank.

    x [N, H]; ids [N, K] (int64) on x's device; gate_up [E, 2F, H] and down [E, H, F], the layer's
    stacks in pinned host memory (on the CPU interpreter: any CPU tensors); out [>= N*K, H]. Rows of
    ranks below first_rank are left as they are.
    """
    n, k = ids.shape
    ranks = k - first_rank
    _, two_f, h = gate_up.shape
    f = two_f // 2
    act = torch.empty(n * ranks, f, dtype=x.dtype, device=x.device)
    block_h = min(triton.next_power_of_2(h), 2048)
    _gate_up[(triton.cdiv(f, _ROWS), n * ranks)](
        x, _pointer(gate_up), ids, act, first_rank, ranks, H=h, F=f, K=k, ROWS=_ROWS, BLOCK_H=block_h, **_EXACT)
    block_f = min(triton.next_power_of_2(f), 1024)
    _down[(triton.cdiv(h, _ROWS), n * ranks)](
        act, _pointer(down), ids, out, first_rank, ranks, out.stride(0), H=h, F=f, K=k, ROWS=_ROWS,
        BLOCK_F=block_f, **_EXACT)


class _HostPointer:
    """A pinned CPU tensor as Triton takes a pointer argument: its address, valid on the device under UVA."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _pointer(t: torch.Tensor):
    # A Triton launch takes only CUDA tensors (or objects with data_ptr); its CPU interpreter needs the tensor.
    return t if t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" else _HostPointer(t)


_EXACT = dict(enable_fp_fusion=False)  # two roundings where torch has two (kernels.gpu_fused)

if triton is not None:
    @triton.jit
    def _gate_up(x_ptr, w_ptr, ids_ptr, act_ptr, FIRST, RANKS, H: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        pair = tl.program_id(1)  # the pair's index among the streamed ones: token pair // RANKS
        token = pair // RANKS
        e = tl.load(ids_ptr + token * K + FIRST + pair % RANKS).to(tl.int64)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = rows < F
        base = w_ptr + e * 2 * F * H
        gate = tl.zeros([ROWS], dtype=tl.float32)
        up = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, H, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            inside = cols < H
            x = tl.load(x_ptr + token * H + cols, mask=inside, other=0.0).to(tl.float32)
            both = live[:, None] & inside[None, :]
            g = tl.load(base + rows[:, None] * H + cols[None, :], mask=both, other=0.0).to(tl.float32)
            u = tl.load(base + (rows[:, None] + F) * H + cols[None, :], mask=both, other=0.0).to(tl.float32)
            gate += tl.sum(g * x[None, :], axis=1)
            up += tl.sum(u * x[None, :], axis=1)
        dtype = act_ptr.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(act_ptr + pair * F + rows, (silu * up).to(dtype), mask=live)

    @triton.jit
    def _down(act_ptr, w_ptr, ids_ptr, out_ptr, FIRST, RANKS, out_stride, H: tl.constexpr, F: tl.constexpr,
              K: tl.constexpr, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
        pair = tl.program_id(1)
        token = pair // RANKS
        rank = FIRST + pair % RANKS
        e = tl.load(ids_ptr + token * K + rank).to(tl.int64)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = rows < H
        base = w_ptr + e * H * F
        acc = tl.zeros([ROWS], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            inside = cols < F
            a = tl.load(act_ptr + pair * F + cols, mask=inside, other=0.0).to(tl.float32)
            w = tl.load(base + rows[:, None] * F + cols[None, :], mask=live[:, None] & inside[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        tl.store(out_ptr + (token * K + rank) * out_stride + rows, acc.to(out_ptr.dtype.element_ty), mask=live)
