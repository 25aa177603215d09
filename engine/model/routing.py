"""Router logits to expert weights and ids: the routing rules that are not a plain softmax over experts.

Pure functions of tensors, so that each rule is tested against its reference without a model. Each
returns (weights [N, k], ids [N, k]) with every row in ascending expert id: the order `MoE.combine` adds in.
"""
from __future__ import annotations

import torch

from moedesk.kernels import gpu_fused


def grouped_sigmoid_top_k(logits: torch.Tensor, correction: torch.Tensor, k: int, groups: int, top_groups: int,
                          renormalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (GLM-4.x's too), for float32 logits [N, E].

    Each expert scores sigmoid(logit). The choice adds a per-expert correction bias (trained to balance the
    load) to the scores: experts fall into `groups` equal groups, a group is ranked by the sum of its two best
    corrected scores, and the k experts are the best corrected scores within the `top_groups` best groups.
    Their weights are the uncorrected scores, divided by their sum when `renormalise`, times `scale`.
    """
    n, experts = logits.shape
    scores = logits.sigmoid()
    choice = scores + correction
    if groups > 1:
        per_group = choice.view(n, groups, experts // groups)
        group_scores = per_group.topk(min(2, experts // groups), dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(top_groups, dim=-1).indices, True)
        choice = per_group.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(n, experts)
    ids = choice.topk(k, dim=-1).indices.sort(dim=-1).values
    weights = scores.gather(1, ids)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the k largest logits [N, E], weighted by a softmax over those k alone (in the logits'
    dtype, as the reference computes it)."""
    if gpu_fused.applies(logits) and gpu_fused.route_fits(logits.shape[-1]):
        return gpu_fused.route(logits, k, False, logits.dtype, softmax_of_top_k=True)
    values, ids = logits.topk(k, dim=-1)
    weights = values.softmax(dim=-1)  # before reordering: summed in the reference's order, so bit for bit
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids
