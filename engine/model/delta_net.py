"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5-MoE.

Per sequence the layer keeps a matrix state S [value_heads, key_dim, value_dim] and the last kernel - 1 inputs
of a short causal convolution (engine.model.cache.recurrent.RecurrentState). Each token decays S by exp(g) and
writes the delta rule's correction beta * (v - S^T k) at key k; its output is S^T q, normalised and gated.

Two forms of the same recurrence:
- `chunked_delta_rule` (prompts): chunks of 64 tokens solved at once with the UT transform, one sequential
  step per chunk. A right-padded row's padding gets beta = 0 and g = 0, so the state passes through it
  unchanged and ends as it was after the row's last real token.
- `recurrent_delta_rule` (decode steps and draft verification): token by token, handing back the state after
  each token. Token n continues from the state after its parent (a draft tree; a chain's parent is n - 1), so
  one forward verifies a whole tree and `RecurrentState.accept` keeps the accepted path's state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moedesk.engine.model.config import ModelConfig
from moedesk.kernels import gpu_delta_chunks, gpu_delta_net

CHUNK = 64


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Outputs [B, T, H, dv] and the final state [B, H, dk, dv] for q, k [B, T, H, dk], v [B, T, H, dv], g and beta
    [B, T, H] (float32; q already scaled), from state [B, H, dk, dv]."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    pad = -T % chunk
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))  # [B, H, T', d]
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))  # [B, H, T']
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    # Within a chunk, token t sees the state at the chunk's start decayed by exp(cum[t]) and token j's write
    # decayed by exp(cum[t] - cum[j]).
    cum = g.cumsum(-1)
    # [.., t, j]; exp's overflow above the diagonal (j > t) is zeroed by tril, which selects rather than multiplies.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).exp().tril()
    k_beta = k * beta.unsqueeze(-1)
    grown = cum.exp().unsqueeze(-1)  # exp(cum[t]): the chunk's start state decayed to token t
    # The corrections u solve (I + L) u = beta v - beta exp(cum) k S0, L[t, j] = beta_t decay[t, j] k_t.k_j (j < t):
    # both right-hand sides in one triangular solve.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u_fixed, u_per_state = torch.linalg.solve_triangular(
        system, torch.cat([v * beta.unsqueeze(-1), k_beta * grown], dim=-1), upper=False, unitriangular=True,
    ).split([dv, dk], dim=-1)
    within = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * grown
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # each key decayed to its chunk's end
    ends = grown[..., -1, 0]  # [B, H, n]: a whole chunk's decay
    if gpu_delta_chunks.fits(state, chunk, dk):  # the walk in one launch, not nine a chunk
        out, state = gpu_delta_chunks.walk_chunks(u_fixed, u_per_state, q_decayed, within, k_to_end, ends, state)
    else:
        out, state = walk_chunks(u_fixed, u_per_state, q_decayed, within, k_to_end, ends, state)
    return out.reshape(B, H, -1, dv)[:, :, :T].transpose(1, 2), state


def walk_chunks(u_fixed, u_per_state, q_decayed, within, k_to_end, ends, state):
    """The state carried from chunk to chunk: (outputs [B, H, n, C, dv], the last state), shapes as
    kernels.gpu_delta_chunks.walk_chunks takes them (which computes the same on CUDA)."""
    B, H, n, chunk, dv = u_fixed.shape
    out = torch.empty(B, H, n, chunk, dv, dtype=u_fixed.dtype, device=u_fixed.device)
    for c in range(n):
        u = u_fixed[:, :, c] - u_per_state[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + within[:, :, c] @ u
        state = state * ends[:, :, c, None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u
    return out, state


def delta_step(state, q, k, v, g, beta):
    """One token of the recurrence for every row and head at once: (output [B, Hv, dv], state after it).
    state [B, Hv, dk, dv] float32; q, k [B, Hk, dk] (q scaled); v [B, Hv, dv]; g, beta [B, Hv]. Value heads come
    in groups sharing a key head (Hv = Hk * group): the key heads are broadcast over their group, not repeated."""
    B, Hv, dk, dv = state.shape
    Hk = k.shape[1]
    grouped = state.view(B, Hk, Hv // Hk, dk, dv)
    q, k = q.view(B, Hk, 1, 1, dk), k.view(B, Hk, 1, 1, dk)
    grouped = grouped * g.exp().view(B, Hk, -1, 1, 1)
    remembered = k @ grouped  # [B, Hk, G, 1, dv]: S^T k
    delta = (v.view(B, Hk, -1, 1, dv) - remembered) * beta.view(B, Hk, -1, 1, 1)
    grouped = grouped + k.transpose(-1, -2) * delta  # the outer product k delta^T
    return (q @ grouped).view(B, Hv, dv), grouped.view(B, Hv, dk, dv)


def recurrent_delta_rule(q, k, v, g, beta, state, parents: torch.Tensor | None = None):
    """Outputs [B, T, Hv, dv] and the state after each token [B, T, Hv, dk, dv] for q, k [B, T, Hk, dk] and v
    [B, T, Hv, dv] (Hv a multiple of Hk); parents [B, T] (-1: the root, which continues from `state`) or None
    for a chain."""
    T = q.shape[1]
    states, outs = [], []
    current = state
    for t in range(T):
        if parents is not None and t > 0:
            current = _from_parents(state, torch.stack(states, 1), parents[:, t])
        out, current = delta_step(current, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(out)
        states.append(current)
    return _stack(outs), _stack(states)


def _stack(items: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(items, 1), a view where there is one (a decode step's token)."""
    return items[0].unsqueeze(1) if len(items) == 1 else torch.stack(items, 1)


def _from_parents(initial: torch.Tensor, after: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """Per row, the state after token parent[b] of `after` [B, t, ...], or `initial` [B, ...] where parent is -1."""
    picked = after[torch.arange(after.shape[0], device=after.device), parent.clamp(min=0)]
    root = (parent < 0).view(-1, *([1] * (picked.dim() - 1)))
    return torch.where(root, initial, picked)


def tree_parents(mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B, T] each token's parent among the forward's own tokens (-1: none), from a draft tree's mask [B, 1, T, L]
    and slots [B, T]: the latest earlier token it may attend to."""
    B, T = slots.shape
    own = mask[:, 0].gather(-1, slots.unsqueeze(1).expand(B, T, T))  # [B, query, key]
    earlier = torch.ones(T, T, dtype=torch.bool, device=slots.device).tril(-1)
    index = torch.arange(T, device=slots.device).expand(B, T, T)
    return torch.where(own & earlier, index, -1).amax(-1)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output times silu(z), z the layer's output gate, in z's dtype. The output is
    taken as the recurrence left it (float32), not rounded to the model's dtype first (one round trip fewer)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        dtype = z.dtype
        x32 = x.float()
        x = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (x * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear-attention layer, in place of attention: (x, rope, cache, layer, batch) -> [B, T, H].
    Projections as Qwen3.5 keeps them (q, k and v in one, the gate z, beta's and the decay's logits apart); value
    heads grouped by the key head they share."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.key_heads, self.value_heads = cfg.linear_key_heads, cfg.linear_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_dim = 2 * keys + values
        self.in_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_z = nn.Linear(cfg.hidden_size, values, bias=False)
        self.in_b = nn.Linear(cfg.hidden_size, self.value_heads, bias=False)
        self.in_a = nn.Linear(cfg.hidden_size, self.value_heads, bias=False)
        self.conv = nn.Parameter(torch.zeros(self.conv_dim, 1, cfg.linear_conv_kernel))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.rms_norm_eps)
        self.out = nn.Linear(values, cfg.hidden_size, bias=False)

    def fuse_projections(self) -> None:
        """On CUDA: the four input projections as one matmul, and the decay rate -exp(A_log) computed once (a decode
        step's layer is launch bound: every kernel saved counts). The parameters become views of the fused weight."""
        parts = (self.in_qkv, self.in_z, self.in_b, self.in_a)
        sizes = [p.out_features for p in parts]
        weight = torch.cat([p.weight.detach() for p in parts])  # made first: out of memory here changes nothing
        for p, part in zip(parts, weight.split(sizes)):  # the parameters become views of it: no second copy
            p.weight.data = part
        self.in_sizes = sizes
        self.register_buffer("in_weight", weight, persistent=False)
        self.register_buffer("decay_rate", -self.A_log.detach().float().exp(), persistent=False)

    def project(self, x):
        """(mixed [B, T, C], z, beta's logits, the decay's logits) from x [B, T, H]."""
        if hasattr(self, "in_weight"):
            return F.linear(x, self.in_weight).split(self.in_sizes, dim=-1)
        return self.in_qkv(x), self.in_z(x), self.in_b(x), self.in_a(x)

    def forward(self, x, rope, cache, layer: int, batch) -> torch.Tensor:
        B, T, _ = x.shape
        state_cache = cache[layer]
        if T == 1:
            state, conv, kept_state, kept_conv = state_cache.layer_tensors(layer)
            if gpu_delta_net.fits(x, state, conv, self.key_dim, self.value_dim, self.conv.shape[-1]):
                return self._fused_step(x, batch, state, conv, kept_state, kept_conv)
        state, conv_state = state_cache.read(layer, batch.rows, B)
        # A new sequence in a row (its first position 0) starts from nothing; on the device, no host decision.
        fresh = (batch.positions[:, 0] == 0).view(B, 1, 1)
        state = torch.where(fresh.unsqueeze(-1), 0, state.float())
        conv_state = torch.where(fresh, 0, conv_state.to(x.dtype))
        mixed, z, b, a = self.project(x)
        z = z.reshape(B, T, self.value_heads, self.value_dim)
        beta = torch.sigmoid(b.float())
        decay_rate = self.decay_rate if hasattr(self, "decay_rate") else -self.A_log.float().exp()
        g = decay_rate * F.softplus(a.float() + self.dt_bias)
        recurrent = T == 1 or batch.keep_states
        if recurrent:
            mixed, convs = self._conv_steps(mixed, conv_state, batch.parents if T > 1 else None)
        else:
            mixed, convs = self._conv_sequence(mixed, conv_state, batch.lengths)
            real = batch.real_mask(T)
            if real is not None:  # padding leaves the state as the row's last real token left it
                beta, g = beta * real.unsqueeze(-1), g * real.unsqueeze(-1)
        keys = self.key_heads * self.key_dim
        # q and k normalised together; value heads share their group's key head (no repeated copies).
        qk = l2_normalise(mixed[..., :2 * keys].reshape(B, T, 2 * self.key_heads, self.key_dim).float())
        q, k = qk.split(self.key_heads, dim=2)
        q = q * self.key_dim ** -0.5
        v = mixed[..., 2 * keys:].reshape(B, T, self.value_heads, self.value_dim).float()
        if recurrent:
            out, states = recurrent_delta_rule(q, k, v, g, beta, state, batch.parents if T > 1 else None)
        else:
            group = self.value_heads // self.key_heads
            if group > 1:  # each key head beside its group's value heads, in one copy (no repeat_interleave)
                q, k = (t.unsqueeze(3).expand(B, T, self.key_heads, group, self.key_dim)
                        .reshape(B, T, self.value_heads, self.key_dim) for t in (q, k))
            out, last = chunked_delta_rule(q, k, v, g, beta, state)
            states = last.unsqueeze(1)
        state_cache.write(layer, batch.rows, states, convs)
        out = self.norm(out, z)
        return self.out(out.reshape(B, T, -1))

    def _fused_step(self, x, batch, state, conv, kept_state, kept_conv) -> torch.Tensor:
        """A decode step's token through kernels.gpu_delta_net: the cache's rows updated in place, as `forward`'s
        torch path leaves them."""
        B = x.shape[0]
        mixed, z, b, a = self.project(x)
        out = gpu_delta_net.decode_step(mixed, a, b, self.conv, self.A_log, self.dt_bias, batch.positions,
                                        batch.rows, state, conv, kept_state, kept_conv, self.key_heads,
                                        self.key_dim, self.value_dim)
        z = z.reshape(B, 1, self.value_heads, self.value_dim)
        out = gpu_delta_net.gated_rms_norm(out, z, self.norm.weight, self.norm.eps)
        return self.out(out.reshape(B, 1, -1))

    def _conv_sequence(self, mixed, conv_state, lengths):
        """A prompt's causal convolution (then silu) over [state, tokens], and the convolution state after each
        row's last real token, as [B, 1, C, K - 1]."""
        kernel = self.conv.shape[-1]
        seq = torch.cat([conv_state, mixed.transpose(1, 2)], dim=-1)  # [B, C, K - 1 + T]
        out = F.silu(F.conv1d(seq.to(self.conv.dtype), self.conv, groups=self.conv_dim)).to(mixed.dtype)
        T = mixed.shape[1]
        if lengths is None:
            last = seq[:, :, T:]
        else:  # inputs lengths[b] .. lengths[b] + K - 2 of seq: the row's last K - 1, state included
            at = lengths.view(-1, 1) + torch.arange(kernel - 1, device=seq.device)
            last = seq.gather(-1, at.unsqueeze(1).expand(-1, seq.shape[1], -1))
        return out.transpose(1, 2), last.unsqueeze(1)

    def _conv_steps(self, mixed, conv_state, parents):
        """Token by token (a decode step, or a verify forward's tree): each token's window continues its parent's.
        Outputs [B, T, C] and the convolution state after each token [B, T, C, K - 1]."""
        weight = self.conv[:, 0]  # [C, K]
        outs, states = [], []
        current = conv_state
        for t in range(mixed.shape[1]):
            if parents is not None and t > 0:
                current = _from_parents(conv_state, torch.stack(states, 1), parents[:, t])
            window = torch.cat([current, mixed[:, t, :, None]], dim=-1)  # [B, C, K]
            outs.append(F.silu((window * weight).sum(-1)))
            current = window[..., 1:]
            states.append(current)
        return _stack(outs), _stack(states)
