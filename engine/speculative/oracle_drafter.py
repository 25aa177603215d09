"""The oracle drafter: proposes a known continuation (e.g. the target's own greedy output), each token
corrupted with a given probability: acceptance under control, for tests and for benchmarks on synthetic
shapes where no trained head exists.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moedesk.engine.errors import MoedeskError
from moedesk.engine.speculative.proposal import Proposal


class OracleDrafter:
    """Proposes `references[row]` (e.g. the target's own greedy continuation), each proposed token replaced by
    a random other one with probability `corruption`: per-draft acceptance 1 - corruption at temperature 0.
    Trees: a spine along the reference, each spine node with width-1 random siblings. Its draft is a
    point mass, so rejection sampling is exact for chains; sampled trees are refused."""

    feature_keys: tuple = ()

    def __init__(self, references: list[list[int]], corruption: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= corruption <= 1.0:
            raise ValueError(f"corruption must be in [0, 1], got {corruption}")
        self.references, self.corruption, self.vocab = references, corruption, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def absorb(self, row, start, tokens, features):
        pass

    def _random_other(self, avoid: set[int]) -> int:
        while True:
            t = int(torch.randint(self.vocab, (1,), generator=self.generator))
            if t not in avoid:
                return t

    def _spine(self, row: int, emitted: int, depth: int) -> list[int]:
        ref = self.references[row] if row < len(self.references) else []
        out = []
        for j in range(depth):
            i = emitted + j
            want = ref[i] if i < len(ref) else None
            bad = want is None or float(torch.rand((), generator=self.generator)) < self.corruption
            out.append(self._random_other({want}) if bad else want)
        return out

    def propose(self, rows, lengths, last, depth, width, budget, params, generators, emitted):
        sampled = any(p.temperature > 0 for p in params)
        if sampled and width > 1:
            raise MoedeskError("the oracle draft proposes trees only at temperature 0")
        parents_all, tokens_all = [], []
        for i, row in enumerate(rows):
            spine = self._spine(row, emitted[i], depth)
            parents, tokens = [-1], [last[i]]
            at = 0
            for t in spine:
                node = len(parents)
                parents.append(at)
                tokens.append(t)
                for _ in range(width - 1):
                    parents.append(at)
                    tokens.append(self._random_other(set(tokens[-(width - 1) - 1:]) | {t}))
                at = node
            parents_all.append(parents[:budget + 1])  # creation order: a prefix keeps every node's parent
            tokens_all.append(tokens[:budget + 1])
        tokens = torch.tensor(tokens_all, dtype=torch.long)
        probs = None
        if sampled:  # a chain: node j's child was "drawn" from a point mass on it
            probs = F.one_hot(torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1), self.vocab).float()
        return Proposal(parents_all, tokens, probs)


def oracle_factory(references: list[list[int]], corruption: float, vocab_size: int, seed: int = 0):
    """A drafter factory proposing `references[i]` for request i, corrupted at the given rate."""
    return lambda batch, capacity: OracleDrafter(references, corruption, vocab_size, seed)

