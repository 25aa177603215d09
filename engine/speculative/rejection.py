"""Verifying draft tokens so that speculation never changes what the target would have produced.

A draft proposes tokens; one target forward scores them all. Names here say which model a
distribution belongs to, since the literature swaps the letters (Leviathan et al. write p for the
target and q for the draft; the EAGLE papers the other way round):

    target  the target model's next-token distribution (`target_probs`, `target_logits`)
    draft   the draft model's distribution the draft tokens were drawn from (`draft_probs`)

Greedy (temperature 0): keep the longest prefix of drafts that equal the target's argmax, then
append the target's argmax after it. The output is token for token what plain greedy decoding gives.

Sampling: walk the drafts in order; accept draft token x with probability
min(1, target(x) / draft(x)). At the first rejection, emit a token sampled from the residual
norm(max(0, target - draft)) at that position and stop; if every draft is accepted, emit one more
token sampled from the target's distribution after the last draft. Each emitted token is then
distributed exactly as the target's (Leviathan et al., Theorem 1), whatever the draft.

Trees: each node holds one draft token and its parent (node 0 is the root, the last token already
accepted; a parent's index is below its children's). The target scores every node in one forward
with a tree attention mask; `target_*[i]` is its distribution after node i. Greedy descends into the
child whose token is the target's argmax. Sampling treats a node's children, in index order, as
candidates drawn from the draft's distribution at the node *without replacement*, and applies the
multi-candidate rule: accept a candidate with probability min(1, target(x)/draft(x)); on rejection
the target becomes norm(max(0, target - draft)) and the draft loses x (draft(x) := 0, renormalised);
after the last rejected candidate a token is sampled from what the target has become. The output is
exact when the children really were drawn that way; a tree of the draft's top-k children keeps
greedy exact but makes sampled output only approximately the target's.

Everything is batched over leading dimensions and draws its random numbers in a fixed order from
the one `generator` given, so a sequence verified alone with its own generator is reproducible
(engine.generation.sampling samples that way too). Probabilities are those actually sampled from, after
temperature / top-k / top-p, for both models.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moedesk.engine.generation.sampling import sampling_probs
from moedesk.engine.requests import SamplingParams


@dataclass(frozen=True)
class ChainVerdict:
    accepted: torch.Tensor  # [...] how many drafts were accepted, 0..γ
    next_token: torch.Tensor  # [...] the token emitted after them (the target's own)

    def tokens(self, draft_tokens: torch.Tensor, row: int | tuple = ()) -> list[int]:
        """The tokens one sequence emits this step: its accepted drafts, then the next token."""
        n = int(self.accepted[row])
        return [int(t) for t in draft_tokens[row][:n]] + [int(self.next_token[row])]


@dataclass(frozen=True)
class TreeVerdict:
    path: torch.Tensor  # [..., depth] accepted node indices from the root's child down, -1 padded
    accepted: torch.Tensor  # [...] length of the accepted path
    next_token: torch.Tensor  # [...]

    def tokens(self, node_tokens: torch.Tensor, row: int | tuple = ()) -> list[int]:
        n = int(self.accepted[row])
        nodes = self.path[row][:n]
        return [int(node_tokens[row][i]) for i in nodes] + [int(self.next_token[row])]


def _leading_accepted(ok: torch.Tensor) -> torch.Tensor:
    return ok.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def greedy_chain(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> ChainVerdict:
    """draft_tokens [..., γ]; target_logits [..., γ+1, V], row j scoring the token after the j-th
    input (row 0: after the last accepted token, i.e. the first draft's position)."""
    gamma = draft_tokens.shape[-1]
    if target_logits.shape[-2] != gamma + 1:
        raise ValueError(f"target_logits has {target_logits.shape[-2]} positions for {gamma} drafts; expected {gamma + 1}")
    best = target_logits.argmax(dim=-1)
    n = _leading_accepted(draft_tokens == best[..., :gamma])
    return ChainVerdict(n, best.gather(-1, n.unsqueeze(-1)).squeeze(-1))


def _residual(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)), unnormalised; where it is all zero (target equals draft, so a
    rejection had probability 0 and only rounding got here) the target itself."""
    r = (target - draft).clamp_min(0)
    empty = r.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target, r)


def _sample_rows(weights: torch.Tensor, generator) -> torch.Tensor:
    flat = weights.reshape(-1, weights.shape[-1]).to(torch.float64)
    return torch.multinomial(flat, 1, generator=generator).reshape(weights.shape[:-1])


def sample_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 generator: torch.Generator | None = None) -> ChainVerdict:
    """draft_tokens [..., γ] drawn from draft_probs [..., γ, V]; target_probs [..., γ+1, V]."""
    gamma = draft_tokens.shape[-1]
    if draft_probs.shape[-2] != gamma or target_probs.shape[-2] != gamma + 1:
        raise ValueError("need draft_probs [..., γ, V] and target_probs [..., γ+1, V] for γ drafts")
    target_probs, draft_probs = target_probs.float(), draft_probs.float()
    x = draft_tokens.unsqueeze(-1)
    target_x = target_probs[..., :gamma, :].gather(-1, x).squeeze(-1)
    draft_x = draft_probs.gather(-1, x).squeeze(-1)
    u = torch.rand(draft_tokens.shape, generator=generator, device=draft_tokens.device)
    # u < target/draft without dividing: a draft token the draft gave no mass is accepted where the
    # target gives it mass (ratio infinite) and never where the target gives none.
    n = _leading_accepted(u * draft_x < target_x)
    at = n.unsqueeze(-1).unsqueeze(-1).expand(*n.shape, 1, target_probs.shape[-1])
    target_at = target_probs.gather(-2, at).squeeze(-2)
    # (a zero row shaped from the target's: with no drafts, γ = 0, the draft has no row to copy the shape of)
    padded_draft = torch.cat([draft_probs, torch.zeros_like(target_probs[..., :1, :])], dim=-2)
    draft_at = padded_draft.gather(-2, at).squeeze(-2)
    # after all γ accepted the "draft" row is zero, so the residual is the target's own distribution
    return ChainVerdict(n, _sample_rows(_residual(target_at, draft_at), generator))


def _children(parents: torch.Tensor) -> torch.Tensor:
    """[N, C] child indices of each node in index order, -1 padded (C = the most children of any node)."""
    parents = [int(p) for p in parents]
    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError("parents must start with -1 (the root) and name an earlier node for every other node")
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    width = max(1, max(len(k) for k in kids))
    return torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.int64)


def _depth(parents: torch.Tensor) -> int:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[int(parents[i])] + 1
    return max(depth)


def _row_gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, N, ...] at index [B] -> [B, ...]."""
    return values[torch.arange(values.shape[0], device=values.device), index]


def greedy_tree(parents: torch.Tensor, node_tokens: torch.Tensor, target_logits: torch.Tensor) -> TreeVerdict:
    """parents [N] (one tree shape for the batch); node_tokens [..., N]; target_logits [..., N, V]."""
    kids = _children(parents).to(node_tokens.device)
    lead = node_tokens.shape[:-1]
    tokens = node_tokens.reshape(-1, node_tokens.shape[-1])
    best = target_logits.reshape(-1, *target_logits.shape[-2:]).argmax(dim=-1)  # [B, N]
    b = tokens.shape[0]
    depth = _depth(parents)
    cur = torch.zeros(b, dtype=torch.int64, device=tokens.device)
    alive = torch.ones(b, dtype=torch.bool, device=tokens.device)
    path = torch.full((b, depth), -1, dtype=torch.int64, device=tokens.device)
    for d in range(depth):
        want = _row_gather(best, cur)
        step = torch.full_like(cur, -1)
        for j in range(kids.shape[1]):
            child = kids[cur, j]
            valid = (child >= 0) & (step < 0)
            hit = valid & (tokens.gather(1, child.clamp_min(0).unsqueeze(1)).squeeze(1) == want)
            step = torch.where(hit, child, step)
        alive &= step >= 0
        path[:, d] = torch.where(alive, step, -1)
        cur = torch.where(alive, step, cur)
    n = (path >= 0).sum(dim=-1)
    return TreeVerdict(path.reshape(*lead, depth), n.reshape(lead), _row_gather(best, cur).reshape(lead))


def sample_tree(parents: torch.Tensor, node_tokens: torch.Tensor, draft_probs: torch.Tensor,
                target_probs: torch.Tensor, generator: torch.Generator | None = None) -> TreeVerdict:
    """parents [N]; node_tokens [..., N]; draft_probs [..., N, V] (the draft's distribution at each
    node, from which its children were drawn without replacement); target_probs [..., N, V]."""
    kids = _children(parents).to(node_tokens.device)
    lead, v = node_tokens.shape[:-1], target_probs.shape[-1]
    tokens = node_tokens.reshape(-1, node_tokens.shape[-1])
    draft_all = draft_probs.reshape(-1, *draft_probs.shape[-2:]).float()
    target_all = target_probs.reshape(-1, *target_probs.shape[-2:]).float()
    b = tokens.shape[0]
    depth = _depth(parents)
    device = tokens.device
    cur = torch.zeros(b, dtype=torch.int64, device=device)
    alive = torch.ones(b, dtype=torch.bool, device=device)
    path = torch.full((b, depth), -1, dtype=torch.int64, device=device)
    # what the target and draft have become at each row's current node, after its rejected candidates
    target = _row_gather(target_all, cur)
    for d in range(depth + 1):
        draft = _row_gather(draft_all, cur)
        chosen = torch.full_like(cur, -1)
        for j in range(kids.shape[1]):
            child = kids[cur, j]
            trying = alive & (child >= 0) & (chosen < 0)
            x = tokens.gather(1, child.clamp_min(0).unsqueeze(1))
            target_x, draft_x = target.gather(1, x).squeeze(1), draft.gather(1, x).squeeze(1)
            u = torch.rand(b, generator=generator, device=device)
            accept = trying & (u * draft_x < target_x)
            chosen = torch.where(accept, child, chosen)
            rejected = (trying & ~accept).unsqueeze(1)
            r = _residual(target, draft)
            target = torch.where(rejected, r / r.sum(dim=1, keepdim=True), target)
            draft_minus = draft.scatter(1, x, 0.0)
            mass = draft_minus.sum(dim=1, keepdim=True)
            draft = torch.where(rejected & (mass > 0), draft_minus / mass.clamp_min(1e-30), draft)
        if d == depth:
            break
        moved = alive & (chosen >= 0)
        path[:, d] = torch.where(moved, chosen, -1)
        cur = torch.where(moved, chosen, cur)
        target = torch.where(moved.unsqueeze(1), _row_gather(target_all, cur), target)
        alive = moved
    n = (path >= 0).sum(dim=-1)
    # rows that stopped carry their residual target; rows at a leaf carry the leaf's target
    next_token = _sample_rows(target, generator)
    return TreeVerdict(path.reshape(*lead, depth), n.reshape(lead), next_token.reshape(lead))


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution engine.generation.sampling.sample_tokens draws from (temperature, top-k, top-p), over the
    last dimension of float logits: rejection sampling needs both models' distributions as actually sampled."""
    rows = logits.reshape(-1, logits.shape[-1])
    return sampling_probs(rows, [params] * rows.shape[0]).reshape(logits.shape)

