"""Where routed experts run. The model hands every MoE layer's tokens to an executor.

`LocalExecutor` runs each expert on the device that holds its weights, one expert after
another; the CPU-GPU orchestration (placement, copies, parallel CPU work) plugs in here as
another executor with the same one method.
"""
from __future__ import annotations

from typing import Protocol

import torch


class ExpertExecutor(Protocol):
    def run_experts(self, moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's top-k experts of weight * expert(token); x [N, H], weights/ids [N, K]."""


class LocalExecutor:
    """Every active expert in turn, in ascending id order, where its weights live.

    Counts how often each (layer, expert) was selected: the popularity that placement uses.
    """

    def __init__(self):
        self.selections: dict[int, torch.Tensor] = {}

    def run_experts(self, moe, x, weights, ids):
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=len(moe.experts)).cpu()
        seen = self.selections.get(moe.layer)
        self.selections[moe.layer] = counts if seen is None else seen + counts
        for e in torch.nonzero(counts).flatten().tolist():
            token, slot = torch.where(ids == e)
            y = moe.experts[e](x[token]) * weights[token, slot].unsqueeze(-1)
            out.index_add_(0, token, y)
        return out
