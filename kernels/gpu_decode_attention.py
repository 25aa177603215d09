"""Decode attention split over the keys (flash-decoding): one new token per row against a long KV cache.

A decode step has one query token per row, so a kernel that parallelises over rows, heads and query blocks (SDPA's
memory-efficient and flash kernels) runs rows x key/value heads programs, each reading a whole head of the cache
alone: a handful of the GPU's multiprocessors at batch 1, however long the context. Here each program takes one
key/value head of one row and one slice of SPLIT keys, with every query head that shares that key/value head as
the rows of its dot products (no key or value is repeated), and keeps a running max, sum and weighted value sum
(online softmax); a few torch operations then combine the slices by their log-sum-exp. The cache is read in place
([rows, length, kv_heads, D], the rows a batch uses picked by index), up to each row's own length, which the kernel
reads from the device: no mask is made, and CUDA graphs replay it as positions move.

TRITON_INTERPRET=1 runs it on the CPU, which is how CI checks it (tests/kernels/test_gpu_decode_attention.py).
"""
from __future__ import annotations

import os

import torch

from moedesk.kernels import gpu_fused

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

SPLIT = 512  # keys per program: enough to amortise a program's start, few enough to fill the GPU at batch 1
BLOCK = 64  # keys per step of a program's loop


def applies(q: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Whether the kernel takes queries q [B, H, D] against cache_k [rows, length, kv_heads, D] (16-bit, on a GPU).
    MOEDESK_NO_SPLIT_DECODE=1 leaves decode to SDPA (to compare the two in one tree)."""
    d, kv_heads = cache_k.shape[-1], cache_k.shape[2]
    off = os.environ.get("MOEDESK_NO_SPLIT_DECODE", "").strip().lower() not in ("", "0", "false", "no")
    return (not off and gpu_fused.wanted() and q.is_cuda and cache_k.is_cuda and q.dtype == cache_k.dtype
            and q.dtype in (torch.bfloat16, torch.float16) and d >= 16 and d & (d - 1) == 0
            and q.shape[1] % kv_heads == 0 and cache_k.stride(-1) == 1
            and not (torch.is_grad_enabled() and (q.requires_grad or cache_k.requires_grad)))


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, rows: torch.Tensor | None,
                     lengths: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√D)·v for queries q [B, H, D], row b attending to the first lengths[b] positions of cache row
    rows[b] (None: b) of cache_k/cache_v [rows, length, kv_heads, D]; returns [B, H, D] in q's dtype."""
    batch, heads, d = q.shape
    kv_heads, length = cache_k.shape[2], cache_k.shape[1]
    groups = heads // kv_heads
    padded = max(16, triton.next_power_of_2(groups))  # the rows of a dot product: at least 16
    splits = triton.cdiv(length, SPLIT)
    acc = torch.empty(batch, kv_heads, splits, padded, d, dtype=torch.float32, device=q.device)
    top = torch.empty(batch, kv_heads, splits, padded, dtype=torch.float32, device=q.device)
    total = torch.empty_like(top)
    q = q.contiguous()
    _split_attention[(batch * kv_heads, splits)](
        q, cache_k, cache_v, rows if rows is not None else lengths, lengths, acc, top, total,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), d ** -0.5,
        KV_HEADS=kv_heads, GROUPS=groups, PADDED=padded, D=d, SPLIT=SPLIT, BLOCK=BLOCK, ROWS=rows is not None)
    # The slices' partial results, weighted by how their maxima compare with the row's overall maximum.
    best = top.amax(dim=2, keepdim=True)
    weight = torch.exp(top - best)  # a slice past a row's length kept -inf: weight 0
    out = (acc * weight.unsqueeze(-1)).sum(2) / (total * weight).sum(2).unsqueeze(-1)
    return out[:, :, :groups].reshape(batch, heads, d).to(q.dtype)


if triton is not None:
    @triton.jit
    def _split_attention(q_ptr, k_ptr, v_ptr, rows_ptr, lengths_ptr, acc_ptr, top_ptr, total_ptr,
                         stride_qb, stride_qh, stride_kr, stride_kl, stride_kh, stride_vr, stride_vl, stride_vh, scale,
                         KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, PADDED: tl.constexpr, D: tl.constexpr,
                         SPLIT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // KV_HEADS
        h = pid % KV_HEADS
        row = tl.load(rows_ptr + b) if ROWS else b
        length = tl.load(lengths_ptr + b)
        g = tl.arange(0, PADDED)
        d = tl.arange(0, D)
        # In float32 throughout (IEEE products, not TF32): a decode step is bound by reading the cache, not by
        # these few products, and the softmax then rounds as the reference's float32 path does.
        q = tl.load(q_ptr + b * stride_qb + (h * GROUPS + g)[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUPS)[:, None], other=0.0).to(tl.float32)
        top = tl.full([PADDED], float("-inf"), tl.float32)
        total = tl.zeros([PADDED], tl.float32)
        acc = tl.zeros([PADDED, D], tl.float32)
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, length)
        k_base = k_ptr + row.to(tl.int64) * stride_kr + h * stride_kh
        v_base = v_ptr + row.to(tl.int64) * stride_vr + h * stride_vh
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            valid = n < end
            k = tl.load(k_base + n[:, None].to(tl.int64) * stride_kl + d[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            p = tl.exp(scores - new_top[:, None])
            rescale = tl.exp(top - new_top)
            v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vl + d[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
            total = total * rescale + tl.sum(p, 1)
            top = new_top
        at = (pid * tl.num_programs(1) + split) * PADDED + g
        tl.store(top_ptr + at, top)
        tl.store(total_ptr + at, total)
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc)
