"""Rows of a table kept in pinned host memory, gathered onto the GPU by a kernel that reads them over PCIe.

A step reads one row of the token-embedding table per token, yet the table takes 0.1-1.9 GB of the GPU on today's MoE
models, room that resident experts use better (llama.cpp keeps its token_embd in RAM for the same reason). UVA makes a
pinned host address valid on the device (kernels.gpu_zero_copy), so the kernel takes the token ids where they lie on
the device and CUDA graphs capture it like any other launch. A copy, not arithmetic: the rows are those of the table.
"""
from __future__ import annotations

import torch

from moedesk.kernels import gpu_fused
from moedesk.kernels.gpu_zero_copy import pointer_arg

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None


def applies(device) -> bool:
    """Whether `host_rows` serves lookups on `device`: a CUDA device, Triton there, the fused kernels not turned off."""
    return torch.device(device).type == "cuda" and gpu_fused.wanted()


def host_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] on ids' device: table [V, H] in pinned host memory (on the CPU interpreter: any CPU tensor), ids any
    shape of integers; returns ids.shape + [H] in the table's dtype."""
    flat = ids.reshape(-1)
    rows, hidden = table.shape
    out = torch.empty(flat.numel(), hidden, dtype=table.dtype, device=ids.device)
    if flat.numel():
        block = min(triton.next_power_of_2(hidden), 1024)
        _gather[(flat.numel(), triton.cdiv(hidden, block))](pointer_arg(table), flat, out, H=hidden, BLOCK=block)
    return out.view(*ids.shape, hidden)


if triton is not None:
    @triton.jit
    def _gather(table_ptr, ids_ptr, out_ptr, H: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < H
        row = tl.load(ids_ptr + i).to(tl.int64)
        tl.store(out_ptr + i * H + cols, tl.load(table_ptr + row * H + cols, mask=inside), mask=inside)
