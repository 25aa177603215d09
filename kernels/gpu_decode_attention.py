"""Decode attention split over the keys (flash-decoding): one new token per row against a long KV cache.

A decode step has one query token per row, so a kernel that parallelises over rows, heads and query blocks (SDPA's
memory-efficient and flash kernels) runs rows x key/value heads programs, each reading a whole head of the cache
alone: a handful of the GPU's multiprocessors at batch 1, however long the context. Here each program takes one
key/value head of one row and one slice of SPLIT keys, with every query head that shares that key/value head as
the rows of its dot products (no key or value is repeated), and keeps a running max, sum and weighted value sum
(online softmax); a second kernel combines a row's slices by their maxima, up to its last slice. 16-bit caches are
multiplied on the tensor cores, whose products of 16-bit numbers are exact in float32. The cache is read in place
([rows, length, kv_heads, D], the rows a batch uses picked by index), up to each row's own length, which the kernel
reads from the device: no mask is made, and CUDA graphs replay it as positions move. A sliding layer's row reads its
window alone. gpt-oss's layers (sinks: a logit per head that joins its softmax) follow their eager reference's
16-bit roundings, which need the row's max and sum before any weight: three passes over the keys. A speculative
verify's chain (a few tokens a row, each seeing up to its own position) runs the same way, its (head, token) pairs
the program's rows.

MLA's absorbed decode (engine.model.mla) is the same computation with one key/value "head" that every query head
shares: keys are the cached latent and rotary key side by side, values the latent itself, so `latent_decode_attention`
reads each cached position's latent once per block of query heads and uses it for both products.

TRITON_INTERPRET=1 runs it on the CPU, which is how CI checks it (tests/kernels/test_gpu_decode_attention.py).
"""
from __future__ import annotations

import os

import torch

from moedesk.kernels import gpu_fused

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

SPLIT = 512  # keys per program: enough to amortise a program's start, few enough to fill the GPU at batch 1
BLOCK = 64  # keys per step of a program's loop
COMBINE_COLUMNS = 64  # of head_dim (or MLA's kv_lora_rank) a combine program merges: more programs, less each


def applies(q: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Whether the kernel takes queries q [B, H, D] against cache_k [rows, length, kv_heads, D] (16-bit, on a GPU).
    MOEDESK_NO_SPLIT_DECODE=1 leaves decode to SDPA (to compare the two in one tree)."""
    d, kv_heads = cache_k.shape[-1], cache_k.shape[2]
    off = os.environ.get("MOEDESK_NO_SPLIT_DECODE", "").strip().lower() not in ("", "0", "false", "no")
    return (not off and gpu_fused.wanted() and q.is_cuda and cache_k.is_cuda and q.dtype == cache_k.dtype
            and q.dtype in (torch.bfloat16, torch.float16) and d >= 16 and d & (d - 1) == 0
            and q.shape[1] % kv_heads == 0 and cache_k.stride(-1) == 1
            and not (torch.is_grad_enabled() and (q.requires_grad or cache_k.requires_grad)))


# Query rows (heads a group x tokens a row, padded to a power of 2) x head_dim a program holds: compiled for sm_90,
# 64 x 128 spilled its registers (tests/kernels/test_gpu_decode_attention_build.py).
MAX_TILE = 4096


def rows_fit(heads: int, kv_heads: int, tokens: int, head_dim: int) -> bool:
    """Whether `tokens` queries a row of `heads` heads fit one program's tile."""
    return max(16, triton.next_power_of_2(heads // kv_heads * tokens)) * head_dim <= MAX_TILE


def takes(q: torch.Tensor, cache_k: torch.Tensor, tokens: int) -> bool:
    """Whether decode_attention takes `tokens` queries a row of q's [B, H, D] heads at once (a speculative verify's
    chain): applies, and the program's tile fits."""
    return applies(q, cache_k) and rows_fit(q.shape[1], cache_k.shape[2], tokens, cache_k.shape[-1])


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, rows: torch.Tensor | None,
                     lengths: torch.Tensor, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√D)·v for queries q [B, H, D], row b attending to the first lengths[b] positions of cache row
    rows[b] (None: b) of cache_k/cache_v [rows, length, kv_heads, D]; returns [B, H, D] in q's dtype. Or several
    tokens a row: q [B, T, H, D] and lengths [B, T] (token t of row b sees the first lengths[b, t] positions: a
    chain's causal mask), returning [B, T, H, D].
    window: a sliding layer's (0: none), whose token sees only the last `window` of its positions; sinks [H]: a logit
    per query head that joins the softmax and attends to nothing (gpt-oss, engine.model.sinks)."""
    one = q.dim() == 3
    if one:
        q, lengths = q[:, None], lengths[:, None]
    batch, tokens, heads, d = q.shape
    kv_heads, length = cache_k.shape[2], cache_k.shape[1]
    groups = heads // kv_heads
    padded = max(16, triton.next_power_of_2(groups * tokens))  # the rows of a dot product: at least 16
    # Slices over the cache's whole length, so that CUDA graphs replay one grid as positions move; a slice past a
    # row's keys returns at once and the combine never reads it.
    splits = triton.cdiv(length, SPLIT)
    acc = torch.empty(batch, kv_heads, splits, groups * tokens, d, dtype=torch.float32, device=q.device)
    top = torch.empty(batch, kv_heads, splits, groups * tokens, dtype=torch.float32, device=q.device)
    total = torch.empty_like(top)
    q, lengths = q.contiguous(), lengths.contiguous()
    args = (q, cache_k, cache_v, rows if rows is not None else lengths, lengths, acc, top, total,
            q.stride(0), q.stride(1), q.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
            cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), d ** -0.5)
    meta = dict(KV_HEADS=kv_heads, GROUPS=groups, TOKENS=tokens, PADDED=padded, D=d, SPLIT=SPLIT, BLOCK=BLOCK,
                ROWS=rows is not None, WINDOW=window, TENSOR_CORES=q.dtype in (torch.bfloat16, torch.float16),
                INTERPRETED=_interpreted())
    if sinks is None:
        _split_attention[(batch * kv_heads, splits)](*args, **meta)
    else:
        # The sinks' reference is eager attention (engine.model.sinks, transformers' gpt-oss), which rounds the
        # scores, their difference from the row's max and the normalised weights to 16 bits each: the first needs
        # the max over every slice and the sink, the last the sum. So three passes over the keys (max, sum, p·v),
        # each slice's values then already normalised: the combine adds them. Sinks cast as the reference casts them.
        sinks = sinks.to(q.dtype)
        for phase in range(3):
            _split_sink_attention[(batch * kv_heads, splits)](*args, sinks, PHASE=phase, **meta)
    out = torch.empty(batch, tokens, heads, d, dtype=q.dtype, device=q.device)
    dc = min(d, COMBINE_COLUMNS)
    _combine[(batch * kv_heads, d // dc)](acc, top, total, lengths, out, splits,
                                          KV_HEADS=kv_heads, GROUPS=groups, TOKENS=tokens, PADDED=padded, D=d, DC=dc,
                                          SPLIT=SPLIT, WINDOW=window, SINKS=sinks is not None,
                                          INTERPRETED=_interpreted())
    return out[:, 0] if one else out


# Query heads a latent program takes, its positions a step and its warps: for kv_lora_rank 512 the largest block whose
# [heads, rank] float32 sum stays in registers when compiled for sm_90 (tests/kernels/test_gpu_decode_attention_build.py).
# Fewer heads a program would read each latent from L2 more often (once per block of heads).
LATENT_HEADS = 32
LATENT_BLOCK = 32
LATENT_WARPS = 8


def latent_applies(q_latent: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> bool:
    """Whether `latent_decode_attention` takes queries q_latent [B, H, C] against latent [rows, length, C] and
    rope [rows, length, R]: 16-bit on a GPU, C and R powers of two from 16, and H in blocks of LATENT_HEADS (or
    fewer heads than one block). MOEDESK_NO_SPLIT_DECODE=1 leaves it to the eager absorbed form."""
    heads, c, r = q_latent.shape[1], latent.shape[-1], rope.shape[-1]
    off = os.environ.get("MOEDESK_NO_SPLIT_DECODE", "").strip().lower() not in ("", "0", "false", "no")
    return (not off and gpu_fused.wanted() and q_latent.is_cuda and latent.is_cuda
            and q_latent.dtype == latent.dtype == rope.dtype and q_latent.dtype in (torch.bfloat16, torch.float16)
            and all(n >= 16 and n & (n - 1) == 0 for n in (c, r))
            and (heads % LATENT_HEADS == 0 or heads < LATENT_HEADS)
            and latent.stride(-1) == 1 and rope.stride(-1) == 1
            and not (torch.is_grad_enabled() and (q_latent.requires_grad or latent.requires_grad)))


def latent_split(length: int, programs_per_slice: int, target: int = 128) -> int:
    """Keys per slice for a cache of `length` positions: about `target` programs over the whole length (one per
    multiprocessor of a large GPU, as many as fit at LATENT_WARPS' registers), never under SPLIT. Each slice writes a
    [heads, kv_lora_rank] float32 partial sum that the combine reads back: slices of SPLIT keys at 32k would move
    half as many bytes as the latents themselves. Depends on the reserved length alone, so CUDA graphs keep one grid."""
    wanted = -(-length * programs_per_slice // target)
    return max(SPLIT, 1 << max(wanted - 1, 0).bit_length())


def latent_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                            rows: torch.Tensor | None, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA's absorbed attention for one token a row: softmax((q_latent·cᵀ + q_rope·rᵀ)·scale)·c for queries
    q_latent [B, H, C] (q_nope through W_UK) and q_rope [B, H, R], row b attending to the first lengths[b] positions
    of cache row rows[b] (None: b) of latent [rows, length, C] and rope [rows, length, R]. Returns [B, H, C], the
    context in latent space (W_UV turns it into each head's value)."""
    batch, heads, c = q_latent.shape
    r, length = rope.shape[-1], latent.shape[1]
    groups = min(heads, LATENT_HEADS)
    blocks = heads // groups
    padded = max(16, triton.next_power_of_2(groups))
    split = latent_split(length, batch * blocks)
    splits = triton.cdiv(length, split)
    acc = torch.empty(batch, blocks, splits, groups, c, dtype=torch.float32, device=q_latent.device)
    top = torch.empty(batch, blocks, splits, groups, dtype=torch.float32, device=q_latent.device)
    total = torch.empty_like(top)
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    _split_latent_attention[(batch * blocks, splits)](
        q_latent, q_rope, latent, rope, rows if rows is not None else lengths, lengths, acc, top, total,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent.stride(0), latent.stride(1), rope.stride(0), rope.stride(1), scale,
        BLOCKS=blocks, GROUPS=groups, PADDED=padded, C=c, R=r, SPLIT=split, BLOCK=LATENT_BLOCK,
        ROWS=rows is not None, TENSOR_CORES=q_latent.dtype in (torch.bfloat16, torch.float16),
        INTERPRETED=_interpreted(), num_warps=LATENT_WARPS)
    out = torch.empty(batch, heads, c, dtype=q_latent.dtype, device=q_latent.device)
    # The combine sees each block of query heads as a key/value head of `groups` query heads.
    dc = min(c, COMBINE_COLUMNS)
    _combine[(batch * blocks, c // dc)](acc, top, total, lengths, out, splits, KV_HEADS=blocks, GROUPS=groups,
                                        TOKENS=1, PADDED=padded, D=c, DC=dc, SPLIT=split, WINDOW=0, SINKS=False,
                                        INTERPRETED=_interpreted())
    return out


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() not in ("", "0", "false", "no")


if triton is not None:
    @triton.jit
    def _dot16(a, b, INTERPRETED: tl.constexpr):
        """a·b of 16-bit tiles into float32. Triton's CPU interpreter multiplies 16-bit dots wrongly (its bf16
        products come out as garbage): there the same exact products are taken in float32."""
        if INTERPRETED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _key_range(lengths_ptr, b, t, TOKENS: tl.constexpr, WINDOW: tl.constexpr):
        """Per query row of the program (head g of the group, token t: row g * TOKENS + t) the first position it sees
        and one past its last, and over the rows the least first and the most last."""
        last = tl.load(lengths_ptr + b * TOKENS + t)
        first = tl.maximum(last - WINDOW, 0) if WINDOW else tl.zeros_like(last)
        return first, last, tl.min(first, 0), tl.max(last, 0)

    @triton.jit
    def _split_attention(q_ptr, k_ptr, v_ptr, rows_ptr, lengths_ptr, acc_ptr, top_ptr, total_ptr,
                         stride_qb, stride_qt, stride_qh, stride_kr, stride_kl, stride_kh, stride_vr, stride_vl,
                         stride_vh, scale, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, TOKENS: tl.constexpr,
                         PADDED: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, WINDOW: tl.constexpr, TENSOR_CORES: tl.constexpr,
                         INTERPRETED: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // KV_HEADS
        h = pid % KV_HEADS
        r = tl.arange(0, PADDED)
        real = r < GROUPS * TOKENS
        g = r // TOKENS
        t = tl.where(real, r % TOKENS, 0)
        first, last, lo, hi = _key_range(lengths_ptr, b, t, TOKENS, WINDOW)
        start = tl.maximum(split * SPLIT, lo)
        end = tl.minimum(split * SPLIT + SPLIT, hi)
        if start < end:  # else a slice past every row's keys or before every window: the combine never reads it
            row = tl.load(rows_ptr + b) if ROWS else b
            d = tl.arange(0, D)
            q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + (h * GROUPS + g)[:, None] * stride_qh
                        + d[None, :], mask=real[:, None], other=0.0)
            if not TENSOR_CORES:
                q = q.to(tl.float32)
            top = tl.full([PADDED], float("-inf"), tl.float32)
            total = tl.zeros([PADDED], tl.float32)
            acc = tl.zeros([PADDED, D], tl.float32)
            k_base = k_ptr + row.to(tl.int64) * stride_kr + h * stride_kh
            v_base = v_ptr + row.to(tl.int64) * stride_vr + h * stride_vh
            for n0 in range(start, end, BLOCK):
                n = n0 + tl.arange(0, BLOCK)
                valid = n < end
                k = tl.load(k_base + n[:, None].to(tl.int64) * stride_kl + d[None, :], mask=valid[:, None], other=0.0)
                v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vl + d[None, :], mask=valid[:, None], other=0.0)
                if TENSOR_CORES:
                    # 16-bit products are exact in the float32 accumulator, so q·k on the tensor cores is the
                    # float32 path's up to summation order. The weights p go into p·v rounded to the cache's
                    # 16 bits, as SDPA's flash kernel and transformers' eager attention round them: greedy decoding
                    # follows the references' arithmetic (with p kept near float32, greedy runs parted from them on
                    # the GPU box: docs/measurements.md, session 35). The IEEE float32 dot (FMA) made programs spill.
                    scores = _dot16(q, tl.trans(k), INTERPRETED) * scale
                else:
                    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
                seen = valid[None, :] & (n[None, :] >= first[:, None]) & (n[None, :] < last[:, None])
                scores = tl.where(seen, scores, float("-inf"))
                new_top = tl.maximum(top, tl.max(scores, 1))
                # A row that has seen no key yet (a chain's earlier token, past its end) keeps -inf: 0, not NaN.
                safe = tl.where(new_top == float("-inf"), 0.0, new_top)
                p = tl.exp(scores - safe[:, None])
                rescale = tl.exp(top - safe)
                if TENSOR_CORES:
                    weighted = _dot16(p.to(v.dtype), v, INTERPRETED)
                else:
                    weighted = tl.dot(p, v, input_precision="ieee")
                acc = acc * rescale[:, None] + weighted
                total = total * rescale + tl.sum(p, 1)
                top = new_top
            at = (pid * tl.num_programs(1) + split) * GROUPS * TOKENS + r
            tl.store(top_ptr + at, top, mask=real)
            tl.store(total_ptr + at, total, mask=real)
            tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=real[:, None])

    @triton.jit
    def _to16(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """float32 x rounded to `dtype` (to nearest, ties to even, as the GPU's cast rounds), still in float32.
        Triton's interpreter casts float32 to bf16 by dropping the low 16 bits: there the rounding is done on them."""
        if INTERPRETED and dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _exp(x, INTERPRETED: tl.constexpr):
        """exp as CUDA's expf takes it (torch's softmax calls that), not Triton's faster approximation."""
        if INTERPRETED:
            return tl.exp(x)
        return libdevice.exp(x)

    @triton.jit
    def _split_sink_attention(q_ptr, k_ptr, v_ptr, rows_ptr, lengths_ptr, acc_ptr, top_ptr, total_ptr,
                              stride_qb, stride_qt, stride_qh, stride_kr, stride_kl, stride_kh, stride_vr, stride_vl,
                              stride_vh, scale, sinks_ptr, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr,
                              TOKENS: tl.constexpr, PADDED: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                              BLOCK: tl.constexpr, ROWS: tl.constexpr, WINDOW: tl.constexpr,
                              TENSOR_CORES: tl.constexpr, INTERPRETED: tl.constexpr, PHASE: tl.constexpr):
        """Attention with sinks rounded where eager attention rounds it in the cache's dtype (engine.model.sinks,
        transformers' gpt-oss): x = q·kᵀ, then x·scale, then y = x - m (m: the max over the row's keys and its
        sink), then p = exp(y) / Σ exp(y) (the sink's term included), each rounded to 16 bits; then p·v.
        One slice of one row and key/value head a program, in three launches: PHASE 0 stores the slice's max of
        x, 1 its Σ exp(y) (m from every slice's max), 2 its p·v (the sum from every slice's and the sink's)."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        b = pid // KV_HEADS
        h = pid % KV_HEADS
        r = tl.arange(0, PADDED)
        real = r < GROUPS * TOKENS
        g = r // TOKENS
        t = tl.where(real, r % TOKENS, 0)
        first, last, lo, hi = _key_range(lengths_ptr, b, t, TOKENS, WINDOW)
        start = tl.maximum(split * SPLIT, lo)
        end = tl.minimum(split * SPLIT + SPLIT, hi)
        if start < end:  # else a slice no pass reads (as in _split_attention)
            row = tl.load(rows_ptr + b) if ROWS else b
            d = tl.arange(0, D)
            q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + (h * GROUPS + g)[:, None] * stride_qh
                        + d[None, :], mask=real[:, None], other=0.0)
            if not TENSOR_CORES:
                q = q.to(tl.float32)
            dtype = k_ptr.dtype.element_ty
            rows_here = pid * splits * GROUPS * TOKENS + r  # each row's entry in slice 0
            if PHASE > 0:  # m, over the slices any token here reads (a row's unseen ones hold -inf)
                sink = tl.load(sinks_ptr + h * GROUPS + g, mask=real, other=0.0).to(tl.float32)
                top = sink
                for s in range(lo // SPLIT, tl.cdiv(hi, SPLIT)):
                    at = rows_here + s * GROUPS * TOKENS
                    top = tl.maximum(top, tl.load(top_ptr + at, mask=real, other=float("-inf")))
            if PHASE == 2:  # the softmax's sum, the sink's term last as the reference's row ends with it
                total = tl.zeros([PADDED], tl.float32)
                for s in range(lo // SPLIT, tl.cdiv(hi, SPLIT)):
                    total += tl.load(total_ptr + rows_here + s * GROUPS * TOKENS, mask=real, other=0.0)
                total += _exp(_to16(sink - top, dtype, INTERPRETED), INTERPRETED)
            most = tl.full([PADDED], float("-inf"), tl.float32)
            part = tl.zeros([PADDED], tl.float32)
            acc = tl.zeros([PADDED, D], tl.float32)
            k_base = k_ptr + row.to(tl.int64) * stride_kr + h * stride_kh
            v_base = v_ptr + row.to(tl.int64) * stride_vr + h * stride_vh
            for n0 in range(start, end, BLOCK):
                n = n0 + tl.arange(0, BLOCK)
                valid = n < end
                k = tl.load(k_base + n[:, None].to(tl.int64) * stride_kl + d[None, :], mask=valid[:, None], other=0.0)
                if TENSOR_CORES:  # exact 16-bit products summed in float32, rounded once as a 16-bit matmul rounds
                    x = _dot16(q, tl.trans(k), INTERPRETED)
                else:
                    x = tl.dot(q, tl.trans(k), input_precision="ieee")
                x = _to16(_to16(x, dtype, INTERPRETED) * scale, dtype, INTERPRETED)
                seen = valid[None, :] & (n[None, :] >= first[:, None]) & (n[None, :] < last[:, None])
                x = tl.where(seen, x, float("-inf"))
                if PHASE == 0:
                    most = tl.maximum(most, tl.max(x, 1))
                else:
                    e = _exp(_to16(x - top[:, None], dtype, INTERPRETED), INTERPRETED)
                    if PHASE == 1:
                        part += tl.sum(e, 1)
                    else:
                        v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vl + d[None, :], mask=valid[:, None],
                                    other=0.0)
                        p = tl.math.div_rn(e, total[:, None])  # IEEE division, as CUDA's softmax divides
                        if TENSOR_CORES:
                            acc += _dot16(_to16(p, dtype, INTERPRETED).to(dtype), v, INTERPRETED)
                        else:
                            acc += tl.dot(p, v, input_precision="ieee")
            mine = rows_here + split * GROUPS * TOKENS
            if PHASE == 0:
                tl.store(top_ptr + mine, most, mask=real)
            elif PHASE == 1:
                tl.store(total_ptr + mine, part, mask=real)
            else:
                tl.store(acc_ptr + mine[:, None] * D + d[None, :], acc, mask=real[:, None])

    @triton.jit
    def _split_latent_attention(q_ptr, qr_ptr, c_ptr, r_ptr, rows_ptr, lengths_ptr, acc_ptr, top_ptr, total_ptr,
                                stride_qb, stride_qh, stride_qrb, stride_qrh, stride_cr, stride_cl, stride_rr,
                                stride_rl, scale, BLOCKS: tl.constexpr, GROUPS: tl.constexpr, PADDED: tl.constexpr,
                                C: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                                ROWS: tl.constexpr, TENSOR_CORES: tl.constexpr, INTERPRETED: tl.constexpr):
        """One row, one block of GROUPS query heads, one slice of SPLIT positions: each block of latents is loaded
        once and is both the keys' first part and the values."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // BLOCKS
        first_head = (pid % BLOCKS) * GROUPS
        length = tl.load(lengths_ptr + b)
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, length)
        if start < end:  # else a slice past the row's length: the combine never reads it
            row = tl.load(rows_ptr + b) if ROWS else b
            g = tl.arange(0, PADDED)
            c = tl.arange(0, C)
            r = tl.arange(0, R)
            real = g < GROUPS
            q = tl.load(q_ptr + b * stride_qb + (first_head + g)[:, None] * stride_qh + c[None, :],
                        mask=real[:, None], other=0.0)
            qr = tl.load(qr_ptr + b * stride_qrb + (first_head + g)[:, None] * stride_qrh + r[None, :],
                         mask=real[:, None], other=0.0)
            if not TENSOR_CORES:
                q, qr = q.to(tl.float32), qr.to(tl.float32)
            top = tl.full([PADDED], float("-inf"), tl.float32)
            total = tl.zeros([PADDED], tl.float32)
            acc = tl.zeros([PADDED, C], tl.float32)
            c_base = c_ptr + row.to(tl.int64) * stride_cr
            r_base = r_ptr + row.to(tl.int64) * stride_rr
            for n0 in range(start, end, BLOCK):
                n = n0 + tl.arange(0, BLOCK)
                valid = n < end
                lat = tl.load(c_base + n[:, None].to(tl.int64) * stride_cl + c[None, :], mask=valid[:, None], other=0.0)
                kr = tl.load(r_base + n[:, None].to(tl.int64) * stride_rl + r[None, :], mask=valid[:, None], other=0.0)
                if TENSOR_CORES:  # as in _split_attention: exact 16-bit products, p rounded to 16 bits
                    scores = (_dot16(q, tl.trans(lat), INTERPRETED) + _dot16(qr, tl.trans(kr), INTERPRETED)) * scale
                else:
                    scores = (tl.dot(q, tl.trans(lat), input_precision="ieee")
                              + tl.dot(qr, tl.trans(kr), input_precision="ieee")) * scale
                scores = tl.where(valid[None, :], scores, float("-inf"))
                new_top = tl.maximum(top, tl.max(scores, 1))
                p = tl.exp(scores - new_top[:, None])
                rescale = tl.exp(top - new_top)
                if TENSOR_CORES:
                    weighted = _dot16(p.to(lat.dtype), lat, INTERPRETED)
                else:
                    weighted = tl.dot(p, lat, input_precision="ieee")
                acc = acc * rescale[:, None] + weighted
                total = total * rescale + tl.sum(p, 1)
                top = new_top
            at = (pid * tl.num_programs(1) + split) * GROUPS + g
            tl.store(top_ptr + at, top, mask=real)
            tl.store(total_ptr + at, total, mask=real)
            tl.store(acc_ptr + at[:, None] * C + c[None, :], acc, mask=real[:, None])

    @triton.jit
    def _combine(acc_ptr, top_ptr, total_ptr, lengths_ptr, out_ptr, splits,
                 KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, TOKENS: tl.constexpr, PADDED: tl.constexpr,
                 D: tl.constexpr, DC: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr,
                 SINKS: tl.constexpr, INTERPRETED: tl.constexpr):
        """The slices of one row and key/value head merged by their maxima (online, as the slices' own keys were),
        over the slices any of its tokens read: [B, T, H, D] in the output's dtype. With sinks the slices' sums are
        already weighted by the whole softmax (_split_sink_attention), and only added.
        Each program takes DC of the D columns (the second grid axis): MLA's latent partials are [heads, 512]
        float32 a slice, which one program a block of heads read alone, slice after slice."""
        pid = tl.program_id(0)
        b = pid // KV_HEADS
        h = pid % KV_HEADS
        r = tl.arange(0, PADDED)
        d = tl.program_id(1) * DC + tl.arange(0, DC)
        real = r < GROUPS * TOKENS
        g = r // TOKENS
        t = tl.where(real, r % TOKENS, 0)
        first, last, lo, hi = _key_range(lengths_ptr, b, t, TOKENS, WINDOW)
        best = tl.full([PADDED], float("-inf"), tl.float32)
        total = tl.zeros([PADDED], tl.float32)
        acc = tl.zeros([PADDED, DC], tl.float32)
        for s in range(lo // SPLIT, tl.cdiv(hi, SPLIT)):  # every slice here was written (for each row: -inf if idle)
            at = (pid * splits + s) * GROUPS * TOKENS + r
            part = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=real[:, None], other=0.0)
            if SINKS:
                acc += part
            else:
                top = tl.load(top_ptr + at, mask=real, other=float("-inf"))
                new_best = tl.maximum(best, top)
                safe = tl.where(new_best == float("-inf"), 0.0, new_best)
                old = tl.exp(best - safe)
                weight = tl.exp(top - safe)
                total = total * old + tl.load(total_ptr + at, mask=real, other=0.0) * weight
                acc = acc * old[:, None] + part * weight[:, None]
                best = new_best
        out = acc if SINKS else acc / tl.where(real, total, 1.0)[:, None]
        heads = KV_HEADS * GROUPS
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + ((b * TOKENS + t) * heads + h * GROUPS + g)[:, None] * D + d[None, :],
                 _to16(out, dtype, INTERPRETED).to(dtype), mask=real[:, None])
