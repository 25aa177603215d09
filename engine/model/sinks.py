"""Attention with sinks over a sliding window (gpt-oss), computed as its reference does.

A sink is a learned logit per head that joins each query's softmax and attends to nothing: the weights of the
real keys then sum to less than one. Sliding layers see only the last `window` positions, themselves included.
Both run here as a mask over the ordinary KV cache. Decode takes kernels.gpu_decode_attention; prefill of 16-bit
CUDA tensors (whose mask comes additive, made once a forward) takes torch's memory-efficient attention, which never
holds the [heads, T, L] scores and also returns each row's log-sum-exp, from which the sink's share follows
(`with_sinks`); float32 and the CPU keep the plain torch arithmetic of the reference.
"""
from __future__ import annotations

import torch


def window_mask(mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """`mask` [B, 1, T, L] (True: may attend) narrowed to the keys at positions p - window < key <= p of each
    query's position p ([B, T]); the cache holds each key at its position."""
    keys = torch.arange(mask.shape[-1], device=mask.device).view(1, 1, 1, -1)
    return mask & (keys > positions.unsqueeze(1).unsqueeze(-1) - window)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """q [B, heads, T, D], k and v [B, kv_heads, L, D], mask [B, 1, T, L]: boolean (True: may attend) or additive (0
    or -inf, as ForwardBatch.attention_mask makes it on CUDA), sinks [heads]: [B, heads, T, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:  # each key/value head for its group of query heads: one copy, not repeat_interleave's
        b, _, length, d = k.shape
        k, v = (t[:, :, None].expand(b, kv_heads, heads // kv_heads, length, d).reshape(b, heads, length, d)
                for t in (k, v))
    if q.is_cuda and mask.dtype != torch.bool and q.dtype != torch.float32 and q.shape[-1] % 8 == 0:  # its heads
        return _efficient_sink_attention(q, k, v, mask, sinks)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = logits.softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention over the keys alone, out [B, heads, T, D] with its rows' log-sum-exp of the scaled scores lse
    [B, heads, T], as attention that also weighs each head's sink: the keys' weights shrink by
    e^lse / (e^lse + e^sink) = sigmoid(lse - sink). A row with no key (lse = -inf) gives zeros, as the sink takes all."""
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float().nan_to_num(0.0) * keep.unsqueeze(-1)).to(out.dtype)


def _efficient_sink_attention(q, k, v, bias, sinks):
    batch, heads, tokens, length = *q.shape[:3], k.shape[2]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias.expand(batch, heads, tokens, length), True, scale=q.shape[-1] ** -0.5)[:2]
    return with_sinks(out, lse[..., :tokens], sinks)
