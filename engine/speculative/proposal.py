"""What a drafter hands verification: trees of draft tokens (`Proposal`) and the drafter's side of a round
(`Drafter`). A tree is a list of parent indices, node 0 the root (the row's last emitted token), a parent
before its children; a chain (greedy mode) is a tree whose nodes each have one child.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moedesk.engine.requests import SamplingParams


def node_depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: node i sees node j when j is i or one of its ancestors (parents precede children)."""
    n = len(parents)
    seen = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i] = seen[p]
        seen[i, i] = True
    return seen


def chain_parents(gamma: int) -> list[int]:
    return [-1] + list(range(gamma))


@dataclass
class Proposal:
    """Trees for the active rows, each of N+1 nodes (node 0: the root, the row's last emitted token)."""
    parents: list[list[int]]
    tokens: torch.Tensor  # [A, N+1] long, on the target's device
    draft_probs: torch.Tensor | None = None  # [A, N+1, V] on the CPU: a node's children were drawn from its row

    @property
    def is_chain(self) -> bool:
        return all(p == chain_parents(len(p) - 1) for p in self.parents)


class Drafter(Protocol):
    feature_keys: tuple  # what the target forward returns for it (engine.model.transformer.Transformer.forward)

    def absorb(self, row: int, start: int, tokens: list[int], features: torch.Tensor | None) -> None:
        """Target features at positions start.. with the tokens that follow each (EAGLE's row pairing)."""

    def propose(self, rows: list[int], lengths: list[int], last: list[int], depth: int, width: int, budget: int,
                params: list[SamplingParams], generators: list, emitted: list[int]) -> Proposal: ...

