"""Multi-head latent attention (MLA): DeepSeek-V3, Kimi-K2, GLM-4.7-Flash.

Keys and values come from one compressed latent per token (kv_lora_rank dims, RMS-normed) through kv_b_proj,
plus a rotary key part (qk_rope_head_dim dims) shared by every head; queries from an optional low-rank
bottleneck. The cache keeps only the latent and the rotated shared key (engine.model.cache.positional.LatentCache:
kv_lora_rank + qk_rope_head_dim values a token and layer, against 2 x heads x head_dim for the expanded keys and
values), and each forward attends one of two ways, the same function of the weights:

- expanded: kv_b_proj turns every cached latent into each head's key and value, then ordinary attention. Cheap
  when a forward brings many tokens (a prompt): the expansion is paid once for all of them;
- absorbed: kv_b_proj's key half is folded into the query (q_nope W_UK: a query in latent space) and its value half
  into the output (the latent-space context times W_UV), so attention runs against the cached latents directly.
  Cheap when few tokens attend a long cache (decode, a speculative verify): nothing is expanded per position.

`absorb_pays` picks by counting multiply-adds; both read the same cache, so a sequence may switch at any step.
A decode step on the GPU takes the absorbed form through the split-key kernel (kernels.gpu_decode_attention), which
reads each row's latents in place up to its own length, once per block of query heads: no scores over the whole
cache in memory, no gathered copy of the rows, nothing past a row's end when CUDA graphs reserve a longer cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moedesk.engine.model.cache.layers import own_kind
from moedesk.engine.model.cache.positional import LatentCache
from moedesk.engine.model.config import ModelConfig
from moedesk.engine.model.norm import RMSNorm
from moedesk.kernels import gpu_decode_attention


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


def absorb_pays(tokens: int, kv_len: int, cfg: ModelConfig) -> bool:
    """Whether the absorbed form costs fewer multiply-adds (per row and head) than expanding the cache, for a
    forward of `tokens` tokens a row attending `kv_len` positions. Expanding costs kv_len latents through kv_b_proj
    plus attention at head width; absorbing costs each token's query and output through W_UK and W_UV plus
    attention at latent width."""
    rank, rope, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    nope = cfg.head_dim - rope
    expanded = kv_len * rank * (nope + v) + tokens * kv_len * (nope + rope + v)
    absorbed = tokens * (nope * rank + kv_len * (2 * rank + rope) + rank * v)
    return absorbed < expanded


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
        self.absorb: bool | None = None  # None: as absorb_pays decides; True / False: always (tests compare them)

    def fuse_projections(self) -> None:
        """Nothing to fuse: kept for the model's loop over its layers' attention."""

    def forward(self, x, rope, cache, layer: int, batch):
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if cfg.q_lora_rank else self.wq(x)
        q_nope, q_rot = q.view(B, T, cfg.num_heads, cfg.head_dim).split([self.nope, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        turn = rope_pairs if cfg.rope_interleave else rope_halves
        q_rot = turn(q_rot, *rope)
        k_rot = turn(k_rot.unsqueeze(2), *rope).squeeze(2)
        values = {"latent": self.kv_a_norm(latent), "rope": k_rot}
        absorb = absorb_pays(T, batch.kv_len, cfg) if self.absorb is None else self.absorb
        own = own_kind(cache, layer)  # layers spread over devices: this layer's own latent cache
        if T == 1 and absorb and not batch.explicit_mask and isinstance(own, LatentCache):
            q_latent = self.query_in_latent(q_nope)[:, 0]  # [B, H, rank]
            i = own.index[layer]
            if gpu_decode_attention.latent_applies(q_latent, own.tensors["latent"][i], own.tensors["rope"][i]):
                whole = own.write(layer, values, batch.rows, batch.slots, batch.write_rows)
                context = gpu_decode_attention.latent_decode_attention(
                    q_latent, q_rot[:, 0], whole["latent"], whole["rope"], batch.rows, batch.key_lengths, self.scale)
                return self.wo(self.latent_to_values(context[:, None]).reshape(B, T, -1))
        stored = cache.write_and_read(layer, values, batch.rows, batch.slots, batch.kv_len, batch.write_rows)
        mask = batch.attention_mask(q.dtype)
        attend = self.absorbed if absorb else self.expanded
        out = attend(q_nope, q_rot, stored["latent"], stored["rope"], mask)  # [B, T, heads, v_head_dim]
        return self.wo(out.reshape(B, T, -1))

    def expanded(self, q_nope, q_rot, latent, k_rot, mask):
        """Every cached position's keys and values expanded per head, then ordinary attention (the reference's
        computation). q_nope/q_rot [B, T, H, *]; latent [B, L, rank]; k_rot [B, L, rope]."""
        cfg = self.cfg
        B, L = latent.shape[:2]
        k_nope, v = self.wkv_b(latent).view(B, L, cfg.num_heads, -1).split([self.nope, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(2).expand(B, L, cfg.num_heads, cfg.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=cfg.attention_scale)
        return out.transpose(1, 2)

    def absorbed(self, q_nope, q_rot, latent, k_rot, mask):
        """Attention against the cached latents: score = (q_nope W_UK_h) . latent + q_rot . k_rot, and the output
        (softmax . latent) W_UV_h, with W_UK_h and W_UV_h head h's blocks of kv_b_proj (views, no copies).
        The heads share one key, so each row's heads and tokens are the rows of one matrix product."""
        B, T, H, _ = q_nope.shape
        q_latent = self.query_in_latent(q_nope).transpose(1, 2).reshape(B, H * T, -1)
        scores = torch.baddbmm(q_latent @ latent.transpose(1, 2),  # [B, H*T, L]: rows head-major
                               q_rot.transpose(1, 2).reshape(B, H * T, -1), k_rot.transpose(1, 2))
        scores = scores.view(B, H, T, -1) * self.scale
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:  # the additive mask ForwardBatch makes on CUDA
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(latent.dtype)
        context = probs.view(B, H * T, -1) @ latent  # [B, H*T, rank]
        return self.latent_to_values(context.view(B, H, T, -1).transpose(1, 2))

    @property
    def scale(self) -> float:
        return self.cfg.attention_scale or self.cfg.head_dim ** -0.5

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank]: head h's blocks of kv_b_proj (views, no copies)."""
        cfg = self.cfg
        w = self.wkv_b.weight.view(cfg.num_heads, self.nope + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def query_in_latent(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [B, T, H, nope] through W_UK: [B, T, H, rank], the query's non-rotary part in latent space."""
        return torch.einsum("bthn,hnc->bthc", q_nope, self._absorbed_weights()[0])

    def latent_to_values(self, context: torch.Tensor) -> torch.Tensor:
        """A latent-space context [B, T, H, rank] through W_UV: [B, T, H, v_head_dim]."""
        return torch.einsum("bthc,hvc->bthv", context, self._absorbed_weights()[1])
