"""One Triton kernel where torch launches many: RMSNorm, query/key norm with rotary, the cache's writes, routing,
the experts' sum.

A decode step of a 12-layer Qwen3 ran about a hundred GPU kernels per layer, most of them tiny
elementwise kernels: an RMSNorm is eight (cast, pow, mean, add, rsqrt, mul, cast, mul), rotary
five, the ordered sum of K expert outputs K + 1 (tests/perf/probe_segment.py). With one token
each does almost no work, so a layer's GPU time is the count of launches. Each kernel here does
one of those chains in one launch and rounds at exactly the places the torch chain rounds (a
16-bit intermediate is stored as 16 bits before the next operation), so greedy tokens stay those
of the reference; only the reductions' summation order differs.

Used for CUDA tensors when Triton is installed; engine.model keeps the torch versions for
everything else (and `MOEDESK_NO_FUSED_KERNELS=1` turns these off). TRITON_INTERPRET=1 runs the
kernels on the CPU, which is how CI checks them (the interpreter truncates float32 to bfloat16
where GPUs round to nearest, so there they agree to one 16-bit step, on the GPU exactly).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None


def wanted() -> bool:
    """Whether the fused kernels may be used at all: Triton is importable and they are not turned off."""
    disabled = os.environ.get("MOEDESK_NO_FUSED_KERNELS", "").strip().lower() not in ("", "0", "false", "no")
    return triton is not None and not disabled


def applies(*tensors: torch.Tensor, rows: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether the kernels take these tensors: all on one CUDA device, of one dtype, contiguous (those in `rows`:
    their last two dimensions dense, the rest strided as they are), and no gradient wanted through them (the
    kernels have no backward: training a draft head goes through torch's ops)."""
    every = (*tensors, *rows)
    first = every[0]
    if torch.is_grad_enabled() and any(t.requires_grad for t in every):
        return False
    return first.is_cuda and wanted() and all(t.device == first.device and t.dtype == first.dtype for t in every) \
        and all(t.is_contiguous() for t in tensors) and all(_dense_heads(t) for t in rows)


def _dense_heads(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.stride(3) == 1 and x.stride(2) == x.shape[3]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_first: bool = False,
             offset: bool = False) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dimension, normalised in float32 and rounded to x's dtype where
    engine.model.norm.rms_norm rounds: before the weight, or after it (`weight_first`: gpt-oss), or after a
    scale of 1 + weight (`offset`: Qwen3-Next)."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    block = triton.next_power_of_2(d)
    _rms_norm[(x.numel() // d,)](x, weight, out, eps, D=d, WEIGHT_FIRST=weight_first, OFFSET=offset, BLOCK=block,
                                 num_warps=_warps(block), **_EXACT)
    return out


def rotary_fits(head_dim: int) -> bool:
    """Whether `norm_rotary` takes this head size: each half a power of two (one Triton block)."""
    return head_dim % 2 == 0 and head_dim & (head_dim - 1) == 0


def norm_rotary(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding of x [B, T, heads, D] by cos/sin [B, T, D], after an RMSNorm of each
    head with `weight` [D] when one is given (Qwen3's query/key norm). x's heads are dense, its tokens may be
    strided (a slice of the fused q/k/v projection's output); the result is contiguous."""
    b, t, heads, d = x.shape
    out = torch.empty(b, t, heads, d, dtype=x.dtype, device=x.device)
    _norm_rotary[(b * t * heads,)](x, weight if weight is not None else x, cos, sin, out, eps, heads, t,
                                   x.stride(0), x.stride(1), NORM=weight is not None, D=d, **_EXACT)
    return out


def cache_write_fits(cache: torch.Tensor, *new: torch.Tensor) -> bool:
    """Whether `write_cache` takes keys/values `new` [B, T, heads, D] for `cache` [rows, length, heads, D]."""
    return applies(cache, rows=new) and all(t.shape[2:] == cache.shape[2:] for t in new)


def write_cache(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                slots: torch.Tensor) -> None:
    """cache_k[rows[b], slots[b, t]] = k[b, t] and the same for v, for keys/values [B, T, heads, D] (heads dense,
    tokens strided as they come) and the written rows [B, 1] (engine.model.cache.positional.write_rows): one
    kernel for what indexed assignment does in two, and without their index bookkeeping."""
    b, t, heads, d = k.shape
    _write_cache[(b * t,)](cache_k, cache_v, k, v, rows, slots, t, cache_k.stride(0), cache_k.stride(1),
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1), rows.stride(0),
                           slots.stride(0), slots.stride(1), N=heads * d, BLOCK=triton.next_power_of_2(heads * d))


def weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[n] = sum over j of weights[n, j] * y[n * K + j], each product and each partial sum rounded
    to y's dtype in ascending j: engine.model.transformer.MoE.combine."""
    n, k = weights.shape
    h = y.shape[-1]
    out = torch.empty(n, h, dtype=y.dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(h))
    _weighted_sum[(n, triton.cdiv(h, block))](y, weights, out, h, K=k, BLOCK=block, **_EXACT)
    return out


def route_fits(num_experts: int) -> bool:
    """Whether `route` takes this many experts: one program holds a row's logits (k passes over them)."""
    return num_experts <= 4096


def route(logits: torch.Tensor, k: int, renormalise: bool, dtype: torch.dtype,
          softmax_of_top_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.model.transformer.top_k_route: weights [N, k] in `dtype` and expert ids [N, k] (int64),
    each row in ascending expert order, from router logits [N, E].

    Softmax in float32, the k most probable experts, ties going to the lower id as in torch.topk on
    CUDA, optionally divided by their sum. `softmax_of_top_k`: engine.model.routing.top_k_softmax instead,
    the k largest logits weighted by a softmax over those k alone (gpt-oss; `renormalise` is moot). Torch takes
    six to seven kernels for this (softmax, top-k, its sort, the sum, the division, the sort by id, the gather and
    the cast), between the attention and the CPU's experts at batch 1 (docs/measurements.md, "The GPU kernels").
    """
    n, e = logits.shape
    weights = torch.empty(n, k, dtype=dtype, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(e)
    # One warp up to 512 experts: each of the 2 + 2k reductions is then warp shuffles, with no shared memory
    # round trip and barrier between warps (the former every-pair ranking held E^2 values in a program).
    _route[(n,)](logits, weights, ids, e, K=k, RENORMALISE=renormalise, OF_TOP_K=softmax_of_top_k, BLOCK=block,
                 num_warps=1 if block <= 512 else 4, **_EXACT)
    return weights, ids


def group_fits(pairs: int, groups: int) -> bool:
    """Whether `group_pairs` takes this many pairs and groups in its one program (a decode batch's, and a short
    prefill's: the executor's grouped launches take up to 64 tokens an expert)."""
    return 0 < pairs <= 1024 and 0 < groups <= 1024


def group_pairs(keys: torch.Tensor, groups: int, k: int, tally: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's (token, expert) pairs arranged for one grouped expert launch, from each pair's group `keys` [P]
    (int64: its expert, or its resident slot; pair p is token p // k's): (order [P] int64, the pairs group by group
    and in pair order within one, as a stable argsort gives them; rows [P] int64, order // k, the token each
    arranged pair reads; ends [groups] int32, where each group's pairs end; active [min(P, groups)] int32, the
    groups with pairs in ascending order, then -1s). tally [2, groups] int64, where given, gains each group's pairs
    and, where it has any, a step.

    Torch's chain for this (a stable sort and its copies, the counts, their cumulative sum, the casts) is a
    dozen tiny launches, which at one token cost more than the work (docs/measurements.md, "Session 42 on the H200
    boxes").
    """
    p = keys.numel()
    order = torch.empty(p, dtype=torch.int64, device=keys.device)
    rows = torch.empty_like(order)
    ends = torch.empty(groups, dtype=torch.int32, device=keys.device)
    active = torch.empty(min(p, groups), dtype=torch.int32, device=keys.device)
    block_p = max(16, triton.next_power_of_2(p))
    _group_pairs[(1,)](keys, order, rows, ends, active, order if tally is None else tally, p, groups, K=k,
                       TALLY=tally is not None, BLOCK_P=block_p, BLOCK_G=max(16, triton.next_power_of_2(groups)),
                       CHUNK=16 if block_p <= 256 else 4, num_warps=4 if block_p <= 256 else 8)
    return order, rows, ends, active


# Without this the compiler narrows a rounded product to a 16-bit multiply and contracts it with the
# following add into one fused multiply-add: one rounding where torch has two (seen in the PTX).
_EXACT = dict(enable_fp_fusion=False)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


if triton is not None:
    @triton.jit
    def _rms_norm(x_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, WEIGHT_FIRST: tl.constexpr, OFFSET: tl.constexpr,
                  BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        dtype = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if OFFSET:
            out = (x * inv) * (1.0 + w)
        elif WEIGHT_FIRST:
            out = w * (x * inv)
        else:
            out = w * (x * inv).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * D + cols, out.to(dtype), mask=inside)

    @triton.jit
    def _norm_rotary(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, eps, heads, T, stride_b, stride_t, NORM: tl.constexpr,
                     D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        HALF: tl.constexpr = D // 2
        cols = tl.arange(0, HALF)
        dtype = out_ptr.dtype.element_ty
        token = row // heads  # cos/sin hold one row per token, shared by its heads
        x_row = x_ptr + (token // T) * stride_b + (token % T) * stride_t + (row % heads) * D
        lo = tl.load(x_row + cols).to(tl.float32)
        hi = tl.load(x_row + HALF + cols).to(tl.float32)
        if NORM:
            inv = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / D + eps)
            w_lo = tl.load(w_ptr + cols).to(tl.float32)
            w_hi = tl.load(w_ptr + HALF + cols).to(tl.float32)
            lo = (w_lo * (lo * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            hi = (w_hi * (hi * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        cos_lo = tl.load(cos_ptr + token * D + cols).to(tl.float32)
        cos_hi = tl.load(cos_ptr + token * D + HALF + cols).to(tl.float32)
        sin_lo = tl.load(sin_ptr + token * D + cols).to(tl.float32)
        sin_hi = tl.load(sin_ptr + token * D + HALF + cols).to(tl.float32)
        # x * cos + cat(-hi, lo) * sin, each product rounded before the sum as in 16-bit torch.
        out_lo = (lo * cos_lo).to(dtype).to(tl.float32) + (-hi * sin_lo).to(dtype).to(tl.float32)
        out_hi = (hi * cos_hi).to(dtype).to(tl.float32) + (lo * sin_hi).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * D + cols, out_lo.to(dtype))
        tl.store(out_ptr + row * D + HALF + cols, out_hi.to(dtype))

    @triton.jit
    def _write_cache(k_cache, v_cache, k_ptr, v_ptr, rows_ptr, slots_ptr, T, cache_row, cache_slot, k_b, k_t, v_b, v_t,
                     rows_b, slots_b, slots_t, N: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        b, t = token // T, token % T
        at = tl.load(rows_ptr + b * rows_b) * cache_row + tl.load(slots_ptr + b * slots_b + t * slots_t) * cache_slot
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        tl.store(k_cache + at + cols, tl.load(k_ptr + b * k_b + t * k_t + cols, mask=inside), mask=inside)
        tl.store(v_cache + at + cols, tl.load(v_ptr + b * v_b + t * v_t + cols, mask=inside), mask=inside)

    @triton.jit
    def _route(logits_ptr, w_ptr, ids_ptr, E, K: tl.constexpr, RENORMALISE: tl.constexpr, OF_TOP_K: tl.constexpr,
               BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < E
        x = tl.load(logits_ptr + row * E + cols, mask=inside, other=-float("inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))  # padding: exp(-inf) = 0
        p = e / tl.sum(e, axis=0)
        # k rounds of "the most probable left, the lower id among equals" (torch.topk's order on CUDA): O(k E)
        # work in a few registers a thread. Ranking the probabilities, not the logits, keeps torch's ties where
        # exp underflows to zero; padding (below every probability) is never picked while real experts are left.
        if OF_TOP_K:  # torch ranks the logits themselves here; padding and the chosen sit at -inf
            left = x
            gone = -float("inf")
        else:
            left = tl.where(inside, p, -1.0)
            gone = -2.0
        chosen = cols < 0
        for _ in tl.static_range(K):
            best = tl.max(left, axis=0)
            first = tl.min(tl.where(left == best, cols, BLOCK), axis=0)
            chosen = chosen | (cols == first)
            left = tl.where(cols == first, gone, left)
        # Chosen experts are written in ascending id: each one's slot is the count of chosen below it.
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        if OF_TOP_K:  # the largest logit is among the chosen: e is exp(x - their max)
            p = e / tl.sum(tl.where(chosen, e, 0.0), axis=0)
        elif RENORMALISE:
            p = p / tl.sum(tl.where(chosen, p, 0.0), axis=0)
        tl.store(w_ptr + row * K + slot, p.to(w_ptr.dtype.element_ty), mask=chosen)
        tl.store(ids_ptr + row * K + slot, cols.to(tl.int64), mask=chosen)

    @triton.jit
    def _weighted_sum(y_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < H
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + n * K + j).to(tl.float32)
            y = tl.load(y_ptr + (n * K + j) * H + cols, mask=inside, other=0.0).to(tl.float32)
            term = (y * w).to(dtype).to(tl.float32)
            if j == 0:
                acc = term
            else:
                acc = (acc + term).to(dtype).to(tl.float32)
        tl.store(out_ptr + n * H + cols, acc.to(dtype), mask=inside)

    @triton.jit
    def _group_pairs(keys_ptr, order_ptr, rows_ptr, ends_ptr, active_ptr, tally_ptr, P, G, K: tl.constexpr,
                     TALLY: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK: tl.constexpr):
        # Pair p goes to the place of the pairs before it in the arrangement: those of a lower group, and those of
        # its own group that come earlier. Counted against the pairs CHUNK at a time, so no [P, P] block is held.
        pairs = tl.arange(0, BLOCK_P)
        real = pairs < P
        key = tl.load(keys_ptr + pairs, mask=real, other=G)  # padding: a group after every real one
        groups = tl.arange(0, BLOCK_G)
        place = tl.zeros([BLOCK_P], dtype=tl.int32)
        counts = tl.zeros([BLOCK_G], dtype=tl.int32)
        for start in range(0, P, CHUNK):
            q = start + tl.arange(0, CHUNK)
            other = tl.load(keys_ptr + q, mask=q < P, other=G)
            same = (other[None, :] == key[:, None]) & (q[None, :] < pairs[:, None])
            before = (other[None, :] < key[:, None]) | same
            place += tl.sum(before.to(tl.int32), axis=1)
            counts += tl.sum((other[None, :] == groups[:, None]).to(tl.int32), axis=1)
        tl.store(order_ptr + place, pairs.to(tl.int64), mask=real)
        tl.store(rows_ptr + place, (pairs // K).to(tl.int64), mask=real)
        inside = groups < G
        tl.store(ends_ptr + groups, tl.cumsum(counts, axis=0), mask=inside)
        used = (counts > 0) & inside  # (group G counts the padding pairs)
        listed = tl.sum(used.to(tl.int32), axis=0)
        tl.store(active_ptr + tl.cumsum(used.to(tl.int32), axis=0) - 1, groups, mask=used)
        rest = listed + groups
        tl.store(active_ptr + rest, tl.full([BLOCK_G], -1, tl.int32), mask=rest < tl.minimum(P, G))
        if TALLY:
            selected = tl.load(tally_ptr + groups, mask=inside)
            tl.store(tally_ptr + groups, selected + counts, mask=inside)
            steps = tl.load(tally_ptr + G + groups, mask=inside)
            tl.store(tally_ptr + G + groups, steps + used.to(tl.int64), mask=inside)
