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
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()  # [.., t, j]
    k_beta = k * beta.unsqueeze(-1)
    # The corrections u solve (I + L) u = beta v - beta exp(cum) k S0, L[t, j] = beta_t decay[t, j] k_t.k_j (j < t).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    u_fixed = solve(v * beta.unsqueeze(-1))
    u_per_state = solve(k_beta * cum.exp().unsqueeze(-1))
    within = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    out = torch.empty(B, H, n, chunk, dv, dtype=v.dtype, device=v.device)
    for c in range(n):
        u = u_fixed[:, :, c] - u_per_state[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + within[:, :, c] @ u
        state = state * cum[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ u
    return out.reshape(B, H, -1, dv)[:, :, :T].transpose(1, 2), state


def recurrent_delta_rule(q, k, v, g, beta, state, parents: torch.Tensor | None = None):
    """Outputs [B, T, H, dv] and the state after each token [B, T, H, dk, dv]; parents [B, T] (-1: the root, which
    continues from `state`) or None for a chain."""
    B, T = q.shape[:2]
    states, outs = [], []
    current = state
    for t in range(T):
        if parents is not None and t > 0:
            current = _from_parents(state, torch.stack(states, 1), parents[:, t])
        current = current * g[:, t].exp()[..., None, None]
        remembered = (current * k[:, t].unsqueeze(-1)).sum(-2)
        current = current + k[:, t].unsqueeze(-1) * ((v[:, t] - remembered) * beta[:, t].unsqueeze(-1)).unsqueeze(-2)
        outs.append((current * q[:, t].unsqueeze(-1)).sum(-2))
        states.append(current)
    return torch.stack(outs, 1), torch.stack(states, 1)


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
    """RMSNorm of each value head's output times silu(z), z the layer's output gate."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        dtype = x.dtype
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

    def forward(self, x, rope, cache, layer: int, batch) -> torch.Tensor:
        B, T, _ = x.shape
        state_cache = cache[layer]
        rows = batch.rows if batch.rows is not None else torch.arange(B, device=x.device)
        state, conv_state = state_cache.read(layer, rows)
        fresh = batch.positions[:, 0] == 0  # a new sequence in this row: nothing before it
        state = torch.where(fresh.view(B, 1, 1, 1), 0, state).float()
        conv_state = torch.where(fresh.view(B, 1, 1), 0, conv_state).to(x.dtype)
        mixed = self.in_qkv(x)  # [B, T, C]
        z = self.in_z(x).view(B, T, self.value_heads, self.value_dim)
        beta = torch.sigmoid(self.in_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_a(x).float() + self.dt_bias)
        recurrent = T == 1 or batch.keep_states
        if recurrent:
            mixed, convs = self._conv_steps(mixed, conv_state, batch.parents if T > 1 else None)
        else:
            mixed, convs = self._conv_sequence(mixed, conv_state, batch.lengths)
            real = batch.real_mask(T)
            if real is not None:  # padding leaves the state as the row's last real token left it
                beta, g = beta * real.unsqueeze(-1), g * real.unsqueeze(-1)
        q, k, v = mixed.split([self.key_heads * self.key_dim] * 2 + [self.value_heads * self.value_dim], dim=-1)
        q, k = (l2_normalise(t.reshape(B, T, self.key_heads, self.key_dim).float()) for t in (q, k))
        group = self.value_heads // self.key_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        q = q * self.key_dim ** -0.5
        v = v.reshape(B, T, self.value_heads, self.value_dim).float()
        if recurrent:
            out, states = recurrent_delta_rule(q, k, v, g, beta, state, batch.parents if T > 1 else None)
            if not batch.keep_states:
                states = states[:, -1:]
        else:
            out, last = chunked_delta_rule(q, k, v, g, beta, state)
            states = last.unsqueeze(1)
        state_cache.write(layer, rows, states, convs)
        out = self.norm(out.to(x.dtype), z)
        return self.out(out.reshape(B, T, -1))

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
            outs.append(F.silu((window.to(weight.dtype) * weight).sum(-1)).to(mixed.dtype))
            current = window[..., 1:]
            states.append(current)
        return torch.stack(outs, 1), torch.stack(states, 1)
