"""Router near-ties in a bf16 run: where our bf16 engine picks other experts than our float32 engine (which equals
transformers' float32), by how little float32 decided, and our bf16 logits with those choices pinned to float32's.

A random tiny model's router has choices decided by less than a bf16 step of their scores. Any two bf16
computations (ours, transformers', on the CPU or on CUDA) can fall on either side of such a choice, and one flipped
expert early in a prompt moves every later position's logits more than rounding does. Pinning the flipped choices
separates that from arithmetic that rounds worse. Helpers for tests and tests/perf/router_ties.py, wrapping
`MoE.route` for the length of a `with`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moedesk.engine.model import transformer
from tests.model.test_gpu_equivalence import teacher_forced_logits

TIE = 1.0  # a choice decided by less than one bf16 step of the scores compared is a tie


def ranked_scores(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float32 scores the router ranks [N, E], the scores the chosen experts are weighted by [N, E]): for a
    sigmoid router the corrected scores and the sigmoid ones, otherwise the logits and the softmax."""
    if moe.cfg.router == "sigmoid":
        s = F.linear(x.float(), moe.router.weight.float()).sigmoid()
        return s + moe.score_bias.float(), s
    logits = moe.router(x).float()
    return logits, logits.softmax(-1)


@contextlib.contextmanager
def patched_route(route):
    original = transformer.MoE.route
    transformer.MoE.route = lambda self, x: route(self, x, original)
    try:
        yield
    finally:
        transformer.MoE.route = original


def margins(moe, x: torch.Tensor, k: int) -> torch.Tensor:
    """[N] by how much each token's choice was made, in bf16 steps of the scores compared (2^-7 of the larger, as
    tests/model/test_gpu_equivalence.py counts them for logits): the k-th best ranked score over the (k+1)-th, and
    where experts are chosen within the best groups (DeepSeek-V3, GLM-4.x) also the last kept group's score over the
    next one's (engine.model.routing.grouped_sigmoid_top_k's ranking), whichever is less."""
    ranked = ranked_scores(moe, x)[0]
    groups, kept = moe.cfg.n_group, moe.cfg.topk_group
    if moe.cfg.router != "sigmoid" or groups <= 1:
        return _steps(ranked.topk(k + 1, dim=-1).values[:, -2:])
    per_group = ranked.view(ranked.shape[0], groups, -1)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1).sort(-1, descending=True)
    within = per_group.gather(1, group_scores.indices[:, :kept, None].expand(-1, -1, per_group.shape[-1]))
    return torch.minimum(_steps(within.flatten(1).topk(k + 1, dim=-1).values[:, -2:]),
                         _steps(group_scores.values[:, kept - 1:kept + 1]))


def _steps(pairs: torch.Tensor) -> torch.Tensor:
    """[N] (a - b) / (2^-7 max(|a|, 1)) for pairs [N, 2] of (a, b), a >= b."""
    return (pairs[:, 0] - pairs[:, 1]) / (2.0 ** -7 * pairs[:, 0].abs().clamp(min=1.0))


def routed_logits(engine, ids: list[int], prompt: int | None = None) -> tuple[torch.Tensor, dict]:
    """Teacher-forced logits along ids and each MoE layer's choices: {layer: (ids [N, k] ascending, margins [N])},
    margins in bf16 steps (`margins`). prompt: as teacher_forced_logits's (the calls of a decode)."""
    seen = {}

    def route(moe, x, original):
        weights, chosen = original(moe, x)
        seen.setdefault(moe.layer, []).append((chosen.cpu(), margins(moe, x, chosen.shape[1]).cpu()))
        return weights, chosen

    with patched_route(route):
        logits = teacher_forced_logits(engine, ids, prompt)
    return logits, {layer: tuple(torch.cat(parts) for parts in zip(*calls)) for layer, calls in seen.items()}


def flipped(ours: dict, exact: dict) -> dict:
    """{layer: {token: (exact's ids, exact's margin)}} where `ours` chose other experts than `exact`."""
    flips = {}
    for layer, (mine, _) in ours.items():
        theirs, steps = exact[layer]
        for t in (mine != theirs).any(-1).nonzero().flatten().tolist():
            flips.setdefault(layer, {})[t] = (theirs[t], steps[t].item())
    return flips


def pinned_logits(engine, ids: list[int], flips: dict) -> torch.Tensor:
    """Teacher-forced logits along ids with the flipped choices taken as `flips` says, weighted as the router weighs
    its own (renormalised where it renormalises, scaled by a sigmoid router's scaling factor)."""
    def route(moe, x, original):
        weights, chosen = original(moe, x)
        cfg = moe.cfg
        for t, (pick, _) in flips.get(moe.layer, {}).items():
            pick = pick.to(chosen.device)
            w = ranked_scores(moe, x)[1][t].gather(0, pick)
            w = w / w.sum() if cfg.norm_topk_prob else w
            w = w * cfg.routed_scaling_factor if cfg.router == "sigmoid" else w
            weights, chosen = weights.clone(), chosen.clone()
            chosen[t], weights[t] = pick, w.to(weights.dtype)
        return weights, chosen

    with patched_route(route):
        return teacher_forced_logits(engine, ids)
