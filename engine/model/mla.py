"""DeepSeek-V3's multi-head latent attention (MLA), in its plain form.

Keys and values come from one compressed latent per token (kv_lora_rank dims, RMS-normed) through kv_b_proj,
plus a rotary key part (qk_rope_head_dim dims) shared by every head; queries from an optional low-rank
bottleneck. This plain form expands every head's key and value and keeps them in the ordinary KV cache (values
zero-padded to the key width, so one cache shape holds both), as transformers' reference computes them. The
latent cache (only kv_lora_rank + rope dims a token) and the absorbed form of decode are the model runner's
cache kind (issue 41, item 0), not this module's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moedesk.engine.model.config import ModelConfig
from moedesk.engine.model.norm import RMSNorm


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's weights' layout), written out de-interleaved,
    evens' results then odds' (the reference's layout: q and k alike, so their products are unchanged).
    x [B, T, heads, R]; cos/sin [B, T, R] (each frequency twice, as the Rotary tables hold them)."""
    cos, sin = cos[..., : cos.shape[-1] // 2].unsqueeze(2), sin[..., : sin.shape[-1] // 2].unsqueeze(2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        heads, rope, nope = cfg.num_heads, cfg.qk_rope_head_dim, cfg.head_dim - cfg.qk_rope_head_dim
        self.nope = nope
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * cfg.head_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.hidden_size, heads * cfg.head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + rope, bias=cfg.attention_bias)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, heads * (nope + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * cfg.v_head_dim, cfg.hidden_size, bias=cfg.attention_bias)

    def fuse_projections(self) -> None:
        """Nothing to fuse: kept for the model's loop over its layers' attention."""

    def forward(self, x, rope, cache, layer: int, batch):
        cfg = self.cfg
        B, T, _ = x.shape
        heads, v_dim = cfg.num_heads, cfg.v_head_dim
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if cfg.q_lora_rank else self.wq(x)
        q = q.view(B, T, heads, cfg.head_dim)
        latent, k_rot = self.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(latent)).view(B, T, heads, self.nope + v_dim)
        k_nope, v = kv.split([self.nope, v_dim], dim=-1)
        turn = rope_pairs if cfg.rope_interleave else rope_halves
        q = torch.cat([q[..., :self.nope], turn(q[..., self.nope:], *rope)], dim=-1)
        k_rot = turn(k_rot.unsqueeze(2), *rope).expand(B, T, heads, cfg.qk_rope_head_dim)
        k = torch.cat([k_nope, k_rot], dim=-1)
        v = F.pad(v, (0, cfg.head_dim - v_dim))  # one cache width for keys and values
        keys, values = cache.write_and_read(layer, k, v, batch.rows, batch.slots, batch.kv_len, batch.write_rows)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=batch.attention_mask(q.dtype), scale=cfg.attention_scale)
        return self.wo(out[..., :v_dim].transpose(1, 2).reshape(B, T, -1))
