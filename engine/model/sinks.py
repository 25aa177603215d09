"""Attention with sinks over a sliding window (gpt-oss), computed as its reference does.

A sink is a learned logit per head that joins each query's softmax and attends to nothing: the weights of the
real keys then sum to less than one. Sliding layers see only the last `window` positions, themselves included.
Both run here as a mask over the ordinary KV cache, in plain torch; a cache that keeps only the window is the
model runner's (issue 41, item 0), and a fused kernel a later step.
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
    """q [B, heads, T, D], k and v [B, kv_heads, L, D], mask [B, 1, T, L] bool, sinks [heads]: [B, heads, T, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = logits.softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v
