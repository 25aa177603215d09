"""The decoder-only transformer every supported architecture runs through.

One module tree for dense and MoE models; `ModelConfig` switches the differences on.
Routed experts are computed by an `ExpertExecutor` (engine.offload.expert_executor) so that where an expert
runs (GPU, CPU, copied over PCIe) is decided outside the model.
"""
from __future__ import annotations

import copy
import logging
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moedesk.engine.model.config import ModelConfig, RopeConfig
from moedesk.engine.model.cache.kv import KVCache
from moedesk.engine.model.cache.layers import LayerCaches, own_kind
from moedesk.engine.model.cache.positional import LatentCache, write_rows
from moedesk.engine.model.cache.recurrent import RecurrentState
from moedesk.engine.model.embedding import Embedding
from moedesk.engine.model.delta_net import GatedDeltaNet, tree_parents
from moedesk.engine.model.mla import LatentAttention
from moedesk.engine.model.norm import RMSNorm
from moedesk.engine.model.packed_linear import PackedLinear
from moedesk.engine.model.routing import grouped_sigmoid_top_k, top_k_softmax
from moedesk.engine.model.sinks import sink_attention, window_mask
from moedesk.kernels import cpu_attention, gpu_decode_attention, gpu_fused
from moedesk.kernels.expert_weights import ClampedSwiGLU, ExpertWeights

log = logging.getLogger("moedesk")


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # On the CPU inside a meta build too (Rotary says why).
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    elif rope.kind == "yarn":
        inv_freq = _yarn(rope, head_dim)
    return inv_freq


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are slowed by `factor`,
    those that turn more than beta_fast times kept, a linear ramp between (the reference's arithmetic)."""
    def turns_to_dim(turns):
        return dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = turns_to_dim(rope.beta_fast), turns_to_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = high - low if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / span).clamp(0, 1)
    kept = 1 - ramp
    wavelengths = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    return 1.0 / (rope.factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context length, gathered per token.

    Computed on the CPU even where the model is built on the meta device (engine.load.loader): the tables are then
    real from the start, and arithmetic on meta tensors runs torch's Python decompositions, whose first use imports
    torch._dynamo, a slow part of every start (docs/measurements.md, "Session 65")."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(cfg.rope, cfg.rope_dims)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * cfg.rope.attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * cfg.rope.attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, heads, D]; cos/sin: [B, T, R]. Half-split rotation (the Hugging Face layout) of each head's first
    # R dims; the rest pass through (partial RoPE, GLM-4.x).
    if cos.shape[-1] < x.shape[-1]:
        turned, kept = x.split([cos.shape[-1], x.shape[-1] - cos.shape[-1]], dim=-1)
        return torch.cat([apply_rope(turned, cos, sin), kept], dim=-1)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def norm_and_rope(x: torch.Tensor, norm: RMSNorm | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(norm(x)) for x [B, T, heads, D], norm over each head (None: no norm); on the GPU one kernel.
    x's heads must be dense; its tokens may be strided (a slice of the fused q/k/v projection)."""
    weights = () if norm is None else (norm.weight,)
    if (gpu_fused.applies(cos, sin, *weights, rows=(x,)) and gpu_fused.rotary_fits(x.shape[-1])
            and not (norm is not None and norm.offset)
            and cos.shape[-1] == x.shape[-1]):
        return gpu_fused.norm_rotary(x, None if norm is None else norm.weight, 0.0 if norm is None else norm.eps,
                                     cos, sin)
    return apply_rope(x if norm is None else norm(x), cos, sin)


# On CUDA, SDPA with a boolean mask picks cuDNN's kernel, slower at decode than all else in the step
# (docs/measurements.md, "The model's layers"). Memory-efficient attention takes masks and is fast, but
# not enable_gqa (that falls back to the bf16 math path, which lost greedy equivalence in the GPU
# tests), so for prefill key/value heads are repeated for it (decode folds the heads instead).
_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION]
_SDPA_FLAGS = threading.Lock()
# Query tokens a row up to which the heads that share a key/value head are folded into its rows (decode, a
# speculative verify); a longer piece (prefill) repeats the keys and values instead.
FOLD_TOKENS = 8


def attention(q, k, v, mask, gqa: bool):
    b, heads, t, d = q.shape
    kv_heads = k.shape[1]
    if gqa and t <= FOLD_TOKENS:
        # The query heads that share a key/value head become its query rows, (head, token) pairs each with its
        # token's mask row, rather than repeating keys and values over the whole cache in every layer, which costs
        # a copy of the cache per layer and as many reads of it as there are query heads.
        groups = heads // kv_heads
        out = _sdpa(q.reshape(b, kv_heads, groups * t, d), k, v, fold_mask(mask, groups), gqa=False)
        return out.reshape(b, heads, t, d)
    if gqa and q.is_cuda:
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        gqa = False
    return _sdpa(q, k, v, mask, gqa)


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """mask [B, 1, T, L] for queries folded as `attention` folds them: [B, 1, groups * T, L], row g * T + t being
    token t's. One token's row holds for every head as it is. The rows of a copy stay 16-aligned (attention_mask's
    layout, which the memory-efficient kernel takes without padding it again)."""
    if mask.shape[-2] == 1:
        return mask
    *lead, t, length = mask.shape
    aligned = -(-length // 16) * 16 if mask.is_cuda else length
    folded = torch.empty(*lead, groups * t, aligned, dtype=mask.dtype, device=mask.device)[..., :length]
    folded.view(*lead, groups, t, length).copy_(mask.unsqueeze(-3).expand(*lead, groups, t, length))
    return folded


def _sdpa(q, k, v, mask, gqa: bool):
    if q.is_cuda:
        # sdpa_kernel sets process-wide flags and restores what it found on exit: two threads inside at once
        # (two engines' decode threads, as when a model is replaced) could leave only our backend enabled for
        # every later caller, transformers included (seen on the GPU box: "No available kernel").
        with _SDPA_FLAGS, sdpa_kernel(_CUDA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.window = cfg.sliding_window if cfg.is_sliding_layer(layer) else 0
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # With an output gate, each head's query is followed by its gate's head_dim channels (Qwen3-Next).
        self.wq = nn.Linear(cfg.hidden_size, q_out * (2 if cfg.attention_gate else 1), bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.wo = nn.Linear(q_out, cfg.hidden_size, bias=cfg.attention_out_bias)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=cfg.norm_offset)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(q_out, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kv_out, cfg.rms_norm_eps)

    def fuse_projections(self) -> None:
        """Compute q, k and v with one matmul from here on (as gpt-fast does): at decode one GEMV costs less than
        three small ones (docs/measurements.md, "The model's layers"). wq, wk and wv
        keep their parameters, now views of the fused weight, so loading, state dicts and draft-head training
        see them as before."""
        projections = (self.wq, self.wk, self.wv)
        sizes = [p.out_features for p in projections]
        if any(isinstance(p, PackedLinear) for p in projections):
            # Packed (MOEDESK_PACKED_WEIGHTS): rows of one format join as they are; mixed formats (a Q4_K_M file's
            # q6_k v) stay apart. Kept off the module tree: the parts' buffers become views of its rows.
            if all(isinstance(p, PackedLinear) for p in projections) and len({p.fmt for p in projections}) == 1:
                self.__dict__["qkv_packed"] = PackedLinear.joined(list(projections))
                self.qkv_sizes = sizes
            return
        # Both made before anything changes: running out of memory here leaves the module as it was.
        weight = torch.cat([p.weight.detach() for p in projections])
        bias = torch.cat([p.bias.detach() for p in projections]) if self.wq.bias is not None else None
        for fused, name in ((weight, "weight"), (bias, "bias")):
            if fused is not None:
                for p, part in zip(projections, fused.split(sizes)):
                    getattr(p, name).data = part
        self.qkv_sizes = sizes
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)

    def _decode_kernel(self, q, own, layer: int):
        """The kernel that reads the cache in place for these few tokens a row (q [B, T, H, D]), or None (SDPA over
        the cache read out). On the CPU only one token a row, without window or sinks, and only in a layer whose
        projections the native kernels compute: its pool computes the attention too, where a float32 load keeps
        the reference's arithmetic (SDPA's)."""
        if not isinstance(own, KVCache):
            return None
        cache_k, T = own.k[own.index[layer]], q.shape[1]
        if (self.cfg.attention_sinks or not self.window) and gpu_decode_attention.takes(q[:, 0], cache_k, T):
            return gpu_decode_attention
        if T == 1 and q.is_cpu and self.native_decode and cpu_attention.applies(q[:, 0], cache_k):
            return cpu_attention
        return None

    @property
    def native_decode(self) -> bool:
        """Whether a float32 decode step's attention (one token a row) runs in kernels/cpu_attention.py: a CPU layer
        whose projections the native kernels compute, without window or sinks (`_decode_kernel`)."""
        cfg = self.cfg
        return (("qkv_packed" in self.__dict__ or isinstance(self.wq, PackedLinear)) and not self.window
                and not cfg.attention_sinks and cpu_attention.takes_heads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))

    def forward(self, x, rope, cache: KVCache, layer: int, batch: "ForwardBatch"):
        cfg = self.cfg
        B, T, _ = x.shape
        if hasattr(self, "qkv_weight"):
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(self.qkv_sizes, dim=-1)
        elif "qkv_packed" in self.__dict__:
            q, k, v = self.qkv_packed(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        gate = None
        if cfg.attention_gate:
            q, gate = q.view(B, T, cfg.num_heads, 2 * cfg.head_dim).split(cfg.head_dim, dim=-1)
            gate = gate.reshape(B, T, -1)
        q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = k.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        head_norm = cfg.qk_norm == "head"
        q = norm_and_rope(q, self.q_norm if head_norm else None, *rope)
        k = norm_and_rope(k, self.k_norm if head_norm else None, *rope)
        # (Windows are applied with sinks only, gpt-oss's pair; the SDPA path below applies none.)
        own = own_kind(cache, layer)  # inside LayerCaches too: Qwen3.5's and gpt-oss's kinds, a device's layers
        kernel = self._decode_kernel(q, own, layer) if T <= FOLD_TOKENS and not batch.explicit_mask else None
        if kernel is not None:
            # Decode, or a speculative verify's chain, over the cache in place, split over its keys
            # (kernels.gpu_decode_attention, kernels.cpu_attention): a long context's keys are read by every
            # core, not by one per key/value head, and a window's alone.
            cache_k, cache_v = own.write(layer, k, v, batch.rows, batch.slots, batch.write_rows)
            sinks = self.sinks if cfg.attention_sinks else None
            if kernel is cpu_attention:
                out = cpu_attention.decode_attention(q[:, 0], cache_k, cache_v, batch.rows, batch.key_lengths)
            elif T == 1:
                out = gpu_decode_attention.decode_attention(q[:, 0], cache_k, cache_v, batch.rows, batch.key_lengths,
                                                            self.window, sinks)
            else:
                out = gpu_decode_attention.decode_attention(q, cache_k, cache_v, batch.rows, batch.token_lengths,
                                                            self.window, sinks)
            out = out.reshape(B, T, -1)
            return self.wo(out if gate is None else out * torch.sigmoid(gate))
        keys, values = cache.write_and_read(layer, k, v, batch.rows, batch.slots, batch.kv_len, batch.write_rows)
        if cfg.attention_sinks:
            out = sink_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                 batch.attention_mask(q.dtype, self.window), self.sinks)
            return self.wo(out.transpose(1, 2).reshape(B, T, -1))
        out = attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), batch.attention_mask(q.dtype),
                        cfg.num_kv_heads != cfg.num_heads)
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.wo(out if gate is None else out * torch.sigmoid(gate))


def top_k_route(logits: torch.Tensor, k: int, renormalise: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] to weights [N, k] in `dtype` and expert ids [N, k], each row in ascending id:
    softmax in float32, the top k, optionally divided by their sum (the reference's routing)."""
    if gpu_fused.applies(logits) and gpu_fused.route_fits(logits.shape[-1]):
        return gpu_fused.route(logits, k, renormalise, dtype)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids, rank = ids.sort(dim=-1)
    return weights.gather(-1, rank).to(dtype), ids


class MLP(nn.Module):
    """SwiGLU feed-forward: a dense layer's MLP, one routed expert, or a shared expert."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate = nn.Linear(hidden, width, bias=False)
        self.up = nn.Linear(hidden, width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        if cfg.expert_bias:  # joined to the expert stacks once loaded (`join_expert_function`)
            self.gate_up_bias = nn.Parameter(torch.zeros(cfg.num_experts, 2 * cfg.moe_intermediate_size))
            self.down_bias = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if cfg.router == "sigmoid":
            self.score_bias = nn.Parameter(torch.zeros(cfg.num_experts))  # the choice's correction bias
        # All routed experts of the layer as one stack, dense or packed (kernels.expert_weights); the loader
        # replaces this placeholder with stacks in their final place and format (device, RAM bank).
        self.experts = ExpertWeights.empty(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                           dtype=torch.get_default_dtype())
        if cfg.shared_expert_intermediate_size:
            self.shared = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [N, K] (in x's dtype) and top-k expert ids [N, K] for tokens x [N, H], each row in
        ascending expert order: the order `combine` adds in."""
        cfg = self.cfg
        if cfg.router == "sigmoid":  # scored in float32 from float32 router weights, as the reference keeps them
            weights, ids = grouped_sigmoid_top_k(F.linear(x.float(), self.router.weight.float()), self.score_bias,
                                                 cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                                 cfg.norm_topk_prob, cfg.routed_scaling_factor)
            return weights.to(x.dtype), ids
        if cfg.router == "topk_softmax":
            weights, ids = top_k_softmax(self.router(x), cfg.num_experts_per_tok)
            return weights.to(x.dtype), ids
        return top_k_route(self.router(x), self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob, x.dtype)

    def join_expert_function(self, stack: ExpertWeights) -> ExpertWeights:
        """`stack` (these experts, wherever they live) computing with this layer's expert biases and activation,
        where it has any (gpt-oss); the biases follow the stack's device, pinned where it is (the GPU's kernels
        read a pinned stack's experts and biases where they lie: kernels.gpu_zero_copy)."""
        cfg = self.cfg
        if not cfg.expert_bias and not cfg.swiglu_limit:
            return stack
        device, pinned = stack.gate_up.device, stack.is_pinned()

        def beside(bias):
            bias = bias.detach().to(device)
            return bias.pin_memory() if pinned else bias

        return stack.with_function(
            beside(self.gate_up_bias) if cfg.expert_bias else None,
            beside(self.down_bias) if cfg.expert_bias else None,
            ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.swiglu_limit else None)

    @staticmethod
    def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of weight * output; y [N*K, H] holds the pairs as an executor
        returns them. bf16 sums depend on their order: adding in ascending expert order rounds exactly
        as the reference's loop of one index_add_ per expert does, in K adds whatever N is."""
        if gpu_fused.applies(y, weights):
            return gpu_fused.weighted_sum(y, weights)
        n, k = weights.shape
        weighted = y.view(n, k, -1) * weights.unsqueeze(-1)
        out = weighted[:, 0].clone()
        for j in range(1, k):
            out += weighted[:, j]
        return out

    def shared_out(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output for tokens `flat` (gated where it is), None where the layer has none: it
        needs no routing, so a handed-over decode step computes it on the GPU while the host runs the routed ones."""
        if not self.cfg.shared_expert_intermediate_size:
            return None
        if self.cfg.shared_expert_gate:
            return torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return self.shared(flat)

    def finish(self, flat: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output from the routed experts' sum: plus the shared expert, where there is one (`shared`:
        its output, computed already)."""
        if not self.cfg.shared_expert_intermediate_size:
            return routed
        return routed + (self.shared_out(flat) if shared is None else shared)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_first, cfg.norm_offset)
        if cfg.is_linear_layer(layer):
            self.attn = GatedDeltaNet(cfg, layer)
        else:
            self.attn = LatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_first, cfg.norm_offset)
        if cfg.is_moe_layer(layer):
            self.moe = MoE(cfg, layer)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, cache, batch):
        if hasattr(self, "moe"):
            x, flat, weights, ids = self.before_experts(x, rope, cache, batch)
            if batch.real is None:
                y = batch.executor.expert_outputs(self.moe, flat, ids)
                return self.after_experts(x, flat, self.moe.combine(y, weights))
            # A padded prompt batch: padding gets no expert (its output is never read), so the experts
            # neither compute nor count it.
            y = batch.executor.expert_outputs(self.moe, flat[batch.real], ids[batch.real])
            routed = torch.zeros_like(flat).index_copy_(0, batch.real, self.moe.combine(y, weights[batch.real]))
            return self.after_experts(x, flat, routed)
        x = x + self.attn(self.attn_norm(x), rope, cache, self.layer, batch)
        return x + self.mlp(self.mlp_norm(x))

    def before_experts(self, x, rope, cache, batch):
        """An MoE block up to its routing: (residual, normalised tokens [N, H], weights, ids); the
        executor's experts and `after_experts` complete it. CUDA graphs capture the two parts apart
        (engine.generation.cuda_graphs), with the experts between them outside the graphs."""
        x = x + self.attn(self.attn_norm(x), rope, cache, self.layer, batch)
        flat = self.mlp_norm(x).reshape(-1, x.shape[-1])
        return x, flat, *self.moe.route(flat)

    def after_experts(self, x, flat, routed, shared=None):
        return x + self.moe.finish(flat, routed, shared).view(x.shape)


class ForwardBatch:
    """What one forward pass shares across its layers: which cache rows, positions, mask, executor. (A decode
    "step" is the scheduler's: one forward of the running batch and what it does with the tokens.)

    kv_len: how many cache positions attention reads; by default up to the furthest position
    (read from the device), or a fixed length, which CUDA graphs need (the mask hides the rest).
    """

    def __init__(self, positions: torch.Tensor, rows: torch.Tensor | None, executor, kv_len: int | None = None,
                 real: torch.Tensor | None = None, mask: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None, keep_states: bool = False):
        self.positions = positions  # [B, T] absolute position of every token (its rotary angle)
        self.lengths = lengths  # [B] real tokens of each right-padded row; None: all T of every row
        # Recurrent layers hand over the state after every token (a verify forward, whose drafts may be
        # rejected), not only the last one's.
        self.keep_states = keep_states
        self._parents = None
        self.slots = positions if slots is None else slots  # [B, T] where its key and value go in the cache
        self.real = real  # flat indices of the tokens that are not padding; None: every token is real
        self.rows = rows  # cache rows of the batch's sequences; None = rows 0..B-1
        self.write_rows = write_rows(rows, positions.shape[0], positions.device)  # once, not in every layer
        self.executor = executor
        self._additive = {}  # attention_mask's, once made per (dtype, window)
        self._windowed = {}  # the boolean mask narrowed to each sliding window, once made
        self._key_lengths = None  # key_lengths', once made
        self._token_lengths = None  # token_lengths', once made
        self._real_mask = None  # real_mask's, once made
        self.kv_len = int(positions.max()) + 1 if kv_len is None else kv_len
        self.explicit_mask = mask is not None
        if mask is not None:  # the caller's: e.g. a draft tree, where a token sees its ancestors only
            self.mask = mask
            return
        keys = torch.arange(self.kv_len, device=positions.device)
        # A token sees every cache entry at or before its own position. Rows are right-padded
        # with positions that run on, so stale entries past a row's end are never visible.
        self.mask = (keys.view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1))

    def to(self, device) -> "ForwardBatch":
        """This batch for layers on `device` (engine.model.layer_devices): its tensors copied there, the rest shared."""
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(moved, name, value.to(device))
        moved._additive, moved._windowed = {}, {}  # made again there, in the queries' dtype
        return moved

    @property
    def key_lengths(self) -> torch.Tensor:
        """[B] cache positions each row's last token attends to (up to its own position), made once a forward."""
        if self._key_lengths is None:
            self._key_lengths = self.positions[:, -1] + 1
        return self._key_lengths

    @property
    def token_lengths(self) -> torch.Tensor:
        """[B, T] cache positions each token attends to (up to its own position: a chain's causal mask), made once a
        forward."""
        if self._token_lengths is None:
            self._token_lengths = self.positions + 1
        return self._token_lengths

    @property
    def parents(self) -> torch.Tensor | None:
        """[B, T] each token's parent in a draft tree verified in this forward (engine.model.delta_net.tree_parents);
        None for a chain, whose parent is the token before."""
        if self._parents is None and self.explicit_mask:
            self._parents = tree_parents(self.mask, self.slots)
        return self._parents

    def real_mask(self, length: int) -> torch.Tensor | None:
        """[B, T] float, 1 where a token is real and 0 where it pads its row; None where no row is padded."""
        if self.lengths is None:
            return None
        if self._real_mask is None or self._real_mask.shape[1] != length:  # once a forward, not once a layer
            self._real_mask = (torch.arange(length, device=self.lengths.device) < self.lengths.unsqueeze(1)).float()
        return self._real_mask

    def attention_mask(self, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
        """The mask as every layer's attention takes it, narrowed to the last `window` positions of each token where
        window > 0 (gpt-oss's sliding layers: engine.model.sinks.window_mask). On CUDA, made once a forward what SDPA
        would make of the boolean mask in every layer (0 where a token may attend, -inf elsewhere, in the queries'
        dtype; its rows 16-aligned as the memory-efficient kernel wants them): that conversion and padding were five
        small kernels a layer. Elsewhere the boolean mask itself."""
        mask = self.mask
        if window:
            if window not in self._windowed:
                self._windowed[window] = window_mask(self.mask, self.positions, window)
            mask = self._windowed[window]
        if not mask.is_cuda:
            return mask
        if (dtype, window) not in self._additive:
            self._additive[dtype, window] = additive_mask(mask, dtype)
        return self._additive[dtype, window]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as 0 where it is True and -inf elsewhere, in `dtype`, its rows 16-aligned as torch's
    memory-efficient attention kernel wants them."""
    *lead, length = mask.shape
    bias = torch.full((*lead, -(-length // 16) * 16), float("-inf"), dtype=dtype, device=mask.device)
    return bias[..., :length].masked_fill_(mask, 0.0)


def parameter_dtype(cfg: ModelConfig, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` (our name) is kept in when the model runs in `dtype`: a sigmoid router's weights
    and correction bias stay float32, as the reference keeps them (in 16 bits the bias's small differences, which
    pick the experts, round away)."""
    if cfg.router == "sigmoid" and name.endswith(("moe.score_bias", "moe.router.weight")):
        return torch.float32
    return dtype


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_first, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, max_positions)
        self.spread = None  # engine.model.layer_devices.LayerDevices once its layers run on several devices

    def parameter_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        return parameter_dtype(self.cfg, name, dtype)

    @property
    def supports_graphs(self) -> bool:
        """Whether CUDA graphs can replay its decode (engine.generation.cuda_graphs): yes, over several devices too
        (a graph per device's stretch of layers). Recurrent layers replay too: their state is updated in place in
        the cache's tensors, which the graphs read and write where they were captured."""
        return True

    def new_cache(self, rows: int, length: int, dtype: torch.dtype, device) -> KVCache | LatentCache | LayerCaches:
        """The cache this model's layers write and read, for `rows` sequences of `length` positions: keys and
        values, MLA's latent where the attention is latent, and beside them a recurrent state for Gated DeltaNet
        layers (its matrix state in float32). Over several devices, one such cache per run of layers on its device
        (`device` is then the first's)."""
        if self.spread is not None:
            return LayerCaches([self.layers_cache(rows, length, dtype, self.spread.devices[d], range(start, stop))
                                for d, start, stop in self.spread.runs])
        return self.layers_cache(rows, length, dtype, device)

    def layers_cache(self, rows: int, length: int, dtype: torch.dtype, device, layers: range | None = None):
        """new_cache's cache for `layers` only (None: every layer)."""
        cfg = self.cfg
        if cfg.kv_lora_rank:
            return LatentCache(range(cfg.num_layers) if layers is None else layers, rows, length, cfg.kv_lora_rank,
                               cfg.qk_rope_head_dim, dtype, device)
        if not cfg.is_recurrent:
            return KVCache(cfg, rows, length, dtype, device, layers=layers)
        layers = range(cfg.num_layers) if layers is None else layers
        linear = [i for i in layers if cfg.is_linear_layer(i)]
        full = [i for i in layers if not cfg.is_linear_layer(i)]
        conv_dim = 2 * cfg.linear_key_heads * cfg.linear_key_dim + cfg.linear_value_heads * cfg.linear_value_dim
        state = RecurrentState(linear, rows, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim,
                               conv_dim, cfg.linear_conv_kernel, history=1, device=device, conv_dtype=dtype,
                               length=length)
        return LayerCaches([KVCache(cfg, rows, length, dtype, device, layers=full), state])

    def moe_blocks(self) -> list[MoE]:
        return [b.moe for b in self.layers if hasattr(b, "moe")]

    def fuse_projections(self) -> None:
        """Fuse what runs faster fused once the weights are in place (Attention.fuse_projections). On CUDA only:
        on the CPU the separate matmuls keep the reference's rounding exactly, and cost no kernel launches."""
        if self.embed.device.type == "cuda":
            fuse_attention_projections(self.layers)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, executor,
                rows: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, slots: torch.Tensor | None = None, features: tuple = (),
                drafts: bool = False):
        """Logits (float32) for tokens [B, T] at positions [B, T].

        logits_at [B] picks one position per row: the last real token of a right-padded prompt,
        so the tokens after it are padding, which no expert computes. None returns logits for every
        position.
        mask [B, 1, T, L] (bool, True = may attend) replaces the causal mask over the L = kv_len cache
        positions the forward reads, and slots [B, T] says where each token's key and value go in the cache
        (default: at its position): a draft tree verified in one pass, its nodes in slots one after another,
        siblings at one position, each token seeing its ancestors.
        features: also return hidden states, as (logits, {feature: [B, T, H]}): an int i is the residual
        stream entering layer i, "final" the last layer's output after the final norm (the features EAGLE
        heads draft from). Every position's, whatever logits_at picks.
        drafts: the tokens after each row's first may be rejected (a verify forward): recurrent layers keep the
        state after each of them for the cache's `accept`.
        """
        lengths = None if logits_at is None else logits_at + 1
        batch = ForwardBatch(positions, rows, executor, real=_real_tokens(logits_at, tokens.shape), mask=mask,
                             kv_len=None if mask is None else mask.shape[-1], slots=slots, lengths=lengths,
                             keep_states=drafts and tokens.shape[1] > 1)
        x, rope = self.embed_tokens(tokens, positions)
        hidden = {}
        if self.spread is not None:  # layers on several devices: engine.model.layer_devices runs them
            logits = self.spread.forward(self, x, rope, cache, batch, features, hidden, logits_at)
            return (logits, hidden) if features else logits
        x = self.run_layers(x, rope, cache, batch, 0, len(self.layers), features, hidden)
        logits = self.head(x, features, hidden, logits_at)
        return (logits, hidden) if features else logits

    # The three parts of a forward, as `forward` runs them and as CUDA graphs capture them between the experts
    # that run on the host (engine.generation.cuda_graphs): one layer loop for both.

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """Token embeddings [B, T, H] and the rotary tables of their positions."""
        x = self.embed(tokens)
        return x, self.rotary(positions, x.dtype)

    def run_layers(self, x, rope, cache, batch: ForwardBatch, start: int, end: int, features: tuple = (),
                   hidden: dict | None = None) -> torch.Tensor:
        """Layers start..end-1 over the residual stream x; the residual entering layer i goes to hidden[i] where
        i is in `features`."""
        for i in range(start, end):
            if i in features:
                hidden[i] = x
            x = self.layers[i](x, rope, cache, batch)
        return x

    def head(self, x, features: tuple = (), hidden: dict | None = None, logits_at: torch.Tensor | None = None):
        """Logits (float32) from the last layer's output: the final norm (kept as hidden["final"] where asked),
        then at one position per row (logits_at) or at every position."""
        x = self.norm(x)
        if "final" in features:
            hidden["final"] = x
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at].unsqueeze(1)
        return self.lm_head(x).float()


def fuse_attention_projections(blocks) -> int:
    """Each block's token mixer's fuse_projections (attention's, MLA's, a Gated DeltaNet's) in turn, until memory
    runs out (a layer's weights exist twice for a moment); the layers left keep theirs apart. Returns how many were
    fused."""
    for done, block in enumerate(blocks):
        try:
            block.attn.fuse_projections()
        except torch.OutOfMemoryError:
            log.warning("out of memory fusing the attention projections: layers from %d on keep them apart", done)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return done
    return len(blocks)


def _real_tokens(last: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """Flat indices of the tokens up to each row's `last` position; None when no row is padded."""
    batch, length = shape
    if last is None or batch == 1:
        return None
    real = (torch.arange(length, device=last.device) <= last.unsqueeze(1)).view(-1)
    return None if bool(real.all()) else real.nonzero().squeeze(1)
