"""A Gated DeltaNet decode step (one token a row) in three Triton kernels where torch launches dozens.

engine.model.delta_net's torch path for one token is the convolution's window shift, depthwise product and silu,
q/k's l2 norms and scaling, beta's sigmoid, the decay's softplus, the delta rule's update and the output q.S, then
the gated RMSNorm: some forty small kernels a layer, which a batch-1 step on the GPU pays for in count, not in
work. Here:
- `_conv_step`: per row and channel block, the window [state, token] through the filter and silu (rounded to the
  model's dtype where torch rounds), the shifted window written back in place;
- `_delta_step`: per row, value head and value block, q and k of the head's key head normalised, beta and g, the
  float32 state decayed, corrected and written back in place (value heads share their key head: no repeat);
- `_gated_norm`: per row and value head, the RMSNorm of the output times silu(z).

The cache's tensors are updated in place (rows by index or 0..B-1), so CUDA graphs replay the step as captured;
a row whose position is 0 starts from a zero state and window, read on the device. The torch path stays the
reference and runs everywhere else (CPU, prompts, draft trees); tests run these kernels under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch

from moedesk.kernels import gpu_fused
from moedesk.kernels.gpu_fused import triton

if triton is not None:
    import triton.language as tl

_BLOCK_CHANNELS = 256
_BLOCK_VALUES = 32  # a 128 x 32 float32 state tile a program: 4 programs a head, enough of them at batch 1


def fits(x: torch.Tensor, state: torch.Tensor, conv: torch.Tensor, key_dim: int, value_dim: int,
         kernel: int) -> bool:
    """Whether the fused step takes this layer's decode: CUDA, Triton wanted, a float32 state and dense cache
    tensors, heads of at most 256 (one block), a short convolution, and no gradient wanted."""
    return (x.is_cuda and gpu_fused.wanted() and not (torch.is_grad_enabled() and x.requires_grad)
            and state.dtype == torch.float32 and state.is_contiguous() and conv.is_contiguous()
            and x.device == state.device == conv.device and key_dim <= 256 and value_dim <= 1024 and kernel <= 8)


def decode_step(mixed, a, b, conv_weight, A_log, dt_bias, positions, rows, state, conv, kept_state, kept_conv,
                key_heads: int, key_dim: int, value_dim: int) -> torch.Tensor:
    """One token of every row: the recurrence's output [B, Hv, dv] (float32). mixed [B, 1, C] (the convolution's
    inputs), a and b [B, 1, Hv] (the decay's and beta's logits): views of the projection, last dimension dense.
    state [R, Hv, dk, dv] and conv [R, C, K - 1], the layer's cache (kept_*: [R, history, ...] or None) are
    updated in place at rows `rows` [B] (None: 0..B-1); positions [B, T]: a row at position 0 starts afresh."""
    B, _, C = mixed.shape
    value_heads = a.shape[-1]
    K = conv_weight.shape[-1]
    keep = kept_state is not None
    rows_arg = rows if rows is not None else positions  # unread without HAS_ROWS
    convolved = torch.empty(B, C, dtype=mixed.dtype, device=mixed.device)
    _conv_step[(B, triton.cdiv(C, _BLOCK_CHANNELS))](
        mixed, conv_weight, conv, kept_conv if keep else conv, convolved, positions, rows_arg,
        C, mixed.stride(0), positions.stride(0), conv.stride(0), kept_conv.stride(0) if keep else 0,
        K=K, KB=triton.next_power_of_2(K), BLOCK=_BLOCK_CHANNELS, HAS_ROWS=rows is not None, KEEP=keep,
        **gpu_fused._EXACT)
    out = torch.empty(B, value_heads, value_dim, dtype=torch.float32, device=mixed.device)
    block_v = min(_BLOCK_VALUES, triton.next_power_of_2(value_dim))
    block_k = triton.next_power_of_2(key_dim)
    _delta_step[(B, value_heads, triton.cdiv(value_dim, block_v))](
        convolved, a, b, A_log, dt_bias, state, kept_state if keep else state, out, positions, rows_arg,
        C, a.stride(0), b.stride(0), positions.stride(0), state.stride(0), kept_state.stride(0) if keep else 0,
        key_dim ** -0.5, GROUP=value_heads // key_heads, DK=key_dim, DV=value_dim, KEYS=key_heads * key_dim,
        BK=block_k, BV=block_v, HAS_ROWS=rows is not None, KEEP=keep, num_warps=4 if block_k <= 128 else 8,
        **gpu_fused._EXACT)
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """engine.model.delta_net.GatedRMSNorm for x [B, Hv, dv] (float32) and z [B, 1, Hv, dv] (a view, heads dense):
    [B, 1, Hv, dv] in z's dtype, rounded where the torch module rounds."""
    B, heads, d = x.shape
    out = torch.empty(B, 1, heads, d, dtype=z.dtype, device=z.device)
    block = triton.next_power_of_2(d)
    _gated_norm[(B, heads)](x, z, weight, out, eps, z.stride(0), D=d, BLOCK=block, **gpu_fused._EXACT)
    return out


if triton is not None:
    @triton.jit
    def _conv_step(x_ptr, w_ptr, conv_ptr, kept_ptr, out_ptr, pos_ptr, rows_ptr, C, x_b, pos_b, conv_r, kept_r,
                   K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr,
                   KEEP: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        row = b
        if HAS_ROWS:
            row = tl.load(rows_ptr + b).to(tl.int64)
        live = tl.load(pos_ptr + b * pos_b) != 0  # position 0: a fresh row
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        j = tl.arange(0, KB)
        inside = c < C
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + b * x_b + c, mask=inside, other=0.0)
        at = conv_ptr + row * conv_r + c[:, None] * (K - 1)
        held = inside[:, None] & (j[None, :] < K - 1)
        past = tl.where(live, tl.load(at + j[None, :], mask=held, other=0.0), 0.0).to(dtype).to(tl.float32)
        # The shifted window (tokens 1..K-1) read now: other threads of this program overwrite these entries.
        later = held & (j[None, :] + 1 < K - 1)
        shifted = tl.where(live, tl.load(at + j[None, :] + 1, mask=later, other=0.0), 0.0).to(dtype).to(tl.float32)
        newest = (j[None, :] == K - 1)
        window = tl.where(newest, x.to(tl.float32)[:, None], past)
        w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=inside[:, None] & (j[None, :] < K), other=0.0)
        products = (window * w.to(tl.float32)).to(dtype).to(tl.float32)  # torch rounds each product, then sums
        y = tl.sum(products, axis=1).to(dtype).to(tl.float32)
        tl.store(out_ptr + b * C + c, (y / (1.0 + tl.exp(-y))).to(dtype), mask=inside)
        kept = tl.where(j[None, :] + 1 == K - 1, x.to(tl.float32)[:, None], shifted)
        tl.debug_barrier()
        tl.store(at + j[None, :], kept.to(conv_ptr.dtype.element_ty), mask=held)
        if KEEP:  # the one token's window is also the history's first (what `accept` reads)
            tl.store(kept_ptr + row * kept_r + c[:, None] * (K - 1) + j[None, :],
                     kept.to(kept_ptr.dtype.element_ty), mask=held)

    @triton.jit
    def _delta_step(qkv_ptr, a_ptr, b_ptr, alog_ptr, bias_ptr, s_ptr, kept_ptr, out_ptr, pos_ptr, rows_ptr, C, a_b,
                    b_b, pos_b, s_r, kept_r, scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    KEYS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_ROWS: tl.constexpr,
                    KEEP: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        row = b
        if HAS_ROWS:
            row = tl.load(rows_ptr + b).to(tl.int64)
        live = tl.load(pos_ptr + b * pos_b) != 0  # position 0: a fresh row
        i = tl.arange(0, BK)
        v_at = tl.program_id(2) * BV + tl.arange(0, BV)
        in_k, in_v = i < DK, v_at < DV
        key_head = h // GROUP
        q = tl.load(qkv_ptr + b * C + key_head * DK + i, mask=in_k, other=0.0).to(tl.float32)
        k = tl.load(qkv_ptr + b * C + KEYS + key_head * DK + i, mask=in_k, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(qkv_ptr + b * C + 2 * KEYS + h * DV + v_at, mask=in_v, other=0.0).to(tl.float32)
        beta = tl.sigmoid(tl.load(b_ptr + b * b_b + h).to(tl.float32))
        a = tl.load(a_ptr + b * a_b + h).to(tl.float32) + tl.load(bias_ptr + h).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))  # torch's threshold
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
        tile = h * DK * DV + i[:, None] * DV + v_at[None, :]
        both = in_k[:, None] & in_v[None, :]
        S = tl.where(live, tl.load(s_ptr + row * s_r + tile, mask=both, other=0.0), 0.0) * tl.exp(g)
        delta = (v - tl.sum(k[:, None] * S, axis=0)) * beta  # the correction beta (v - S^T k)
        S = S + k[:, None] * delta[None, :]
        tl.store(s_ptr + row * s_r + tile, S, mask=both)
        if KEEP:
            tl.store(kept_ptr + row * kept_r + tile, S, mask=both)
        tl.store(out_ptr + (b * tl.num_programs(1) + h) * DV + v_at, tl.sum(q[:, None] * S, axis=0), mask=in_v)

    @triton.jit
    def _gated_norm(x_ptr, z_ptr, w_ptr, out_ptr, eps, z_b, D: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        cols = tl.arange(0, BLOCK)
        inside = cols < D
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + (b * heads + h) * D + cols, mask=inside, other=0.0)
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + b * z_b + h * D + cols, mask=inside, other=0.0).to(tl.float32)
        scaled = (w * normed).to(dtype).to(tl.float32)
        tl.store(out_ptr + (b * heads + h) * D + cols, (scaled * (z / (1.0 + tl.exp(-z)))).to(dtype), mask=inside)
