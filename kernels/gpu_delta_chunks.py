"""A Gated DeltaNet prefill's walk over its chunks in one Triton kernel, where torch launches nine kernels a chunk.

engine.model.delta_net.chunked_delta_rule solves every chunk's corrections at once, then carries the state from
chunk to chunk: per chunk u = u_fixed - u_per_state S, the outputs q_decayed S + within u, and the state
ends S + k_to_end u. A 512-token prompt is eight chunks, about seventy launches that a prefill pays in host time,
not in work. Here one program a (row, value head, block of value columns) keeps its columns of S on chip for the
whole walk: the delta rule never mixes value columns, so the blocks are independent and the sums are exact.

Dots run in full float32 (no TF32): the state feeds every later token, and the torch path stays the reference.
"""
from __future__ import annotations

import torch

from moedesk.kernels import gpu_fused
from moedesk.kernels.gpu_fused import triton

if triton is not None:
    import triton.language as tl

# Sizes at which the sm_90 build keeps everything in registers (tests/kernels/test_gpu_delta_net_build.py): Triton's
# float32 dots (FMA, not tensor cores) hold a whole reduction row a thread, so the tiles stay narrow.
_BLOCK_VALUES = 16  # value columns a program: Qwen3.5's 32 heads x 8 blocks, two programs an H200 SM
_BLOCK_KEYS = 16  # the state's key rows a dot takes at a time
_WARPS = 8


def fits(state: torch.Tensor, chunk: int, key_dim: int) -> bool:
    """Whether the kernel takes this walk: CUDA, Triton wanted, a float32 state, no gradient wanted, and tiles a
    program holds (chunks and key heads of at most 128)."""
    return (state.is_cuda and gpu_fused.wanted() and not torch.is_grad_enabled()
            and state.dtype == torch.float32 and chunk <= 128 and key_dim <= 128)


def walk_chunks(u_fixed, u_per_state, q_decayed, within, k_to_end, ends, state):
    """(outputs [B, H, n, C, dv], the state after the last chunk [B, H, dk, dv]) for u_fixed [B, H, n, C, dv],
    u_per_state, q_decayed and k_to_end [B, H, n, C, dk] (k_to_end untransposed: each key decayed to its chunk's
    end), within [B, H, n, C, C], ends [B, H, n] (a chunk's whole decay) and state [B, H, dk, dv], all float32;
    any may be a strided view (the triangular solve hands back column-major ones)."""
    B, H, n, C, dv = u_fixed.shape
    dk = state.shape[-2]
    out = torch.empty(B, H, n, C, dv, dtype=torch.float32, device=state.device)
    last = torch.empty(B, H, dk, dv, dtype=torch.float32, device=state.device)
    tensors = (u_fixed, u_per_state, q_decayed, within, k_to_end, state)
    strides = [s for t in tensors for s in t.stride()[:2]] + [s for t in tensors[:5] for s in t.stride()[2:]]
    strides += [*state.stride()[2:], *ends.stride()]
    block_v = _BLOCK_VALUES
    block_k = max(16, triton.next_power_of_2(dk))
    _walk[(B * H, triton.cdiv(dv, block_v))](
        u_fixed, u_per_state, q_decayed, within, k_to_end, ends, state, out, last, H, n, *strides,
        C=C, DK=dk, DV=dv, BC=max(16, triton.next_power_of_2(C)), BK=block_k,
        BKB=min(_BLOCK_KEYS, block_k), BV=block_v, num_warps=_WARPS, **gpu_fused._EXACT)
    return out, last


if triton is not None:
    @triton.jit
    def _walk(uf_ptr, up_ptr, qd_ptr, w_ptr, ke_ptr, e_ptr, s_ptr, out_ptr, last_ptr, H, n,
              uf_b, uf_h, up_b, up_h, qd_b, qd_h, w_b, w_h, ke_b, ke_h, s_b, s_h,
              uf_n, uf_r, uf_c, up_n, up_r, up_c, qd_n, qd_r, qd_c, w_n, w_r, w_c, ke_n, ke_r, ke_c, s_r, s_c,
              e_b, e_h, e_n,
              C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
              BKB: tl.constexpr, BV: tl.constexpr):
        b = (tl.program_id(0) // H).to(tl.int64)
        h = (tl.program_id(0) % H).to(tl.int64)
        t = tl.arange(0, BC)  # a token of the chunk
        j = tl.arange(0, BC)  # an earlier token of the chunk (within's columns, k_to_end's)
        i = tl.arange(0, BKB)  # a key dimension, within a block of them
        v = tl.program_id(1) * BV + tl.arange(0, BV)  # this program's value columns
        in_t, in_j, in_v = t < C, j < C, v < DV
        tv, tj = in_t[:, None] & in_v[None, :], in_t[:, None] & in_j[None, :]
        # The state lives in `last` (this program's columns, L1/L2-resident), a block of key rows at a time: the
        # whole 128 x BV tile with its chunk-long operands would not fit in registers. Pointer tiles are made where
        # they are used, for the same reason (a 64 x 64 tile of 64-bit pointers is 64 registers a thread).
        S_at = last_ptr + (b * H + h) * DK * DV
        for kb in range(0, BK, BKB):
            kv = ((kb + i) < DK)[:, None] & in_v[None, :]
            S = tl.load(s_ptr + b * s_b + h * s_h + (kb + i[:, None]) * s_r + v[None, :] * s_c, mask=kv, other=0.0)
            tl.store(S_at + (kb + i[:, None]) * DV + v[None, :], S, mask=kv)
        tl.debug_barrier()
        uf, up, qd = uf_ptr + b * uf_b + h * uf_h, up_ptr + b * up_b + h * up_h, qd_ptr + b * qd_b + h * qd_h
        w, ke = w_ptr + b * w_b + h * w_h, ke_ptr + b * ke_b + h * ke_h
        out = out_ptr + (b * H + h) * n * C * DV
        for c in range(n):
            u = tl.load(uf + c * uf_n + t[:, None] * uf_r + v[None, :] * uf_c, mask=tv, other=0.0)
            o = tl.zeros((BC, BV), dtype=tl.float32)
            for kb in range(0, BK, BKB):
                tk = in_t[:, None] & ((kb + i) < DK)[None, :]
                S = tl.load(S_at + (kb + i[:, None]) * DV + v[None, :], mask=((kb + i) < DK)[:, None] & in_v[None, :],
                            other=0.0)
                u -= tl.dot(tl.load(up + c * up_n + t[:, None] * up_r + (kb + i[None, :]) * up_c, mask=tk, other=0.0),
                            S, input_precision="ieee")
                o += tl.dot(tl.load(qd + c * qd_n + t[:, None] * qd_r + (kb + i[None, :]) * qd_c, mask=tk, other=0.0),
                            S, input_precision="ieee")
            o += tl.dot(tl.load(w + c * w_n + t[:, None] * w_r + j[None, :] * w_c, mask=tj, other=0.0), u,
                        input_precision="ieee")
            tl.store(out + (c * C + t[:, None]) * DV + v[None, :], o, mask=tv)
            decay = tl.load(e_ptr + b * e_b + h * e_h + c * e_n)
            tl.debug_barrier()  # every thread has read this chunk's state before any writes the next
            for kb in range(0, BK, BKB):
                kv = ((kb + i) < DK)[:, None] & in_v[None, :]
                kj = ((kb + i) < DK)[:, None] & in_j[None, :]
                k_t = tl.load(ke + c * ke_n + j[None, :] * ke_r + (kb + i[:, None]) * ke_c, mask=kj, other=0.0)
                at = S_at + (kb + i[:, None]) * DV + v[None, :]
                tl.store(at, tl.load(at, mask=kv, other=0.0) * decay + tl.dot(k_t, u, input_precision="ieee"), mask=kv)
            tl.debug_barrier()
