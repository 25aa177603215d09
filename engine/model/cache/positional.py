"""Caches indexed by position: per layer, tensors [rows, positions, ...] that a token writes at its slot.

The KV cache (keys and values) is one (engine.model.cache.kv); MLA's latent cache is another: DeepSeek-V3's
attention keeps per token the compressed key/value latent (kv_lora_rank values) and the shared rotary key
(qk_rope_head_dim values), not full keys and values, and expands them (or absorbs the expansion into the
query and output projections) when it attends.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


class PositionalCache:
    """Per layer of `layers` and per named part, a tensor [rows, length, *shape]; a token's values go to its slot
    (by default its position), so what lies past a row's end is never read: attention's causal mask hides it
    until the row's own tokens overwrite it.

    Allocated once per batch shape; `ensure` grows it (rarely: only when a longer request arrives), never per
    token; only `shrink` gives memory back."""

    def __init__(self, layers: Sequence[int], parts: dict[str, tuple[int, ...]], rows: int, length: int,
                 dtype: torch.dtype, device):
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}  # a model layer's place in each part's list
        self.parts = dict(parts)
        self.dtype, self.device = dtype, torch.device(device)
        self.rows, self.length = 0, 0
        self.tensors: dict[str, list[torch.Tensor]] = {name: [] for name in self.parts}
        self.ensure(rows, length)

    def _all(self) -> list[torch.Tensor]:
        return [t for part in self.tensors.values() for t in part]

    def ensure(self, rows: int, length: int) -> None:
        """Make room for `rows` sequences of `length` positions, keeping what is stored."""
        if rows <= self.rows and length <= self.length:
            return
        rows, length = max(rows, self.rows), max(length, self.length)
        # Built aside and swapped in at the end: an out-of-memory error here leaves the cache as it was.
        grown = {name: [torch.zeros((rows, length, *shape), dtype=self.dtype, device=self.device)
                        for _ in self.layers] for name, shape in self.parts.items()}
        for name, tensors in grown.items():
            for new, old in zip(tensors, self.tensors[name]):
                new[: old.shape[0], : old.shape[1]] = old
        self.tensors, self.rows, self.length = grown, rows, length

    def shrink(self, rows: int, length: int) -> None:
        """Reallocate at `rows` x `length`, dropping what is stored (no sequence may be using it): ensure only ever
        grows, so a batch that fell back to fewer rows would keep the memory of the most it ever held."""
        self.tensors = {name: [] for name in self.parts}  # the old tensors go before the new ones are made
        self.rows, self.length = 0, 0
        self.ensure(rows, length)

    def nbytes(self) -> int:
        """The memory the cache takes now."""
        return sum(t.numel() * t.element_size() for t in self._all())

    def bytes_per_position(self) -> int:
        """What one more position of one row costs, over every layer and part."""
        return len(self.layers) * sum(math.prod(shape) for shape in self.parts.values()) * self.dtype.itemsize

    def bytes_per_row(self) -> int:
        return 0  # all of it grows with the positions

    def storage_key(self) -> tuple:
        """Changes whenever the tensors move (a reallocation): CUDA graphs read them in place."""
        first = self._all()[0] if self.layers else None
        return (first.data_ptr() if first is not None else 0), self.rows, self.length

    def reorder(self, block: list[int], source: list[int], length: int) -> None:
        """Row block[j] takes what row block[source[j]] holds in its first `length` positions (beam search's
        hypotheses continuing others): one gather per tensor, on the device."""
        W = len(block)
        if source == list(range(W)):
            return
        index = torch.tensor(source, device=self.device)
        start = block[0]
        if block == list(range(start, start + W)):
            for t in self._all():
                t[start:start + W, :length] = t[start:start + W, :length].index_select(0, index)
        else:
            rows = torch.tensor(block, device=self.device)
            origin = rows[index]
            for t in self._all():
                t[rows, :length] = t[origin, :length]

    def accept(self, rows: list[int], starts: list[int], paths: list[list[int]]) -> None:
        """Row rows[i]'s accepted draft nodes move from slots starts[i] + node to starts[i] + 1, + 2, ... (one
        gather and one scatter per tensor; a chain is already in place). What the rejected nodes wrote stays
        past the row's end, where the causal mask hides it until the row's own tokens overwrite it."""
        moves = [(i, k + 1, node) for i, path in enumerate(paths) for k, node in enumerate(path) if node != k + 1]
        if not moves:
            return
        index = torch.tensor([rows[i] for i, _, _ in moves], device=self.device)
        dst = torch.tensor([starts[i] + k for i, k, _ in moves], device=self.device)
        src = torch.tensor([starts[i] + node for i, _, node in moves], device=self.device)
        for t in self._all():
            t[index, dst] = t[index, src]

    def write_and_read(self, layer: int, values: dict[str, torch.Tensor], rows, slots, kv_len: int,
                       index_rows=None) -> dict[str, torch.Tensor]:
        """Store each part's values [B, T, *shape] at `slots` [B, T] of `rows` (None: rows 0..B-1; index_rows:
        the same as [B, 1], made once a step by `write_rows`); return each part's first kv_len positions of
        those rows, [B, kv_len, *shape]."""
        batch = slots.shape[0]
        whole = self.write(layer, values, rows, slots, index_rows)
        return {name: stored[:batch, :kv_len] if rows is None else stored[rows, :kv_len]
                for name, stored in whole.items()}

    def write(self, layer: int, values: dict[str, torch.Tensor], rows, slots,
              index_rows=None) -> dict[str, torch.Tensor]:
        """Store each part's values as `write_and_read` does; return the layer's whole tensors [rows, length,
        *shape] (a kernel that reads the cache in place, up to each row's length, takes them)."""
        i = self.index[layer]
        if index_rows is None:
            index_rows = write_rows(rows, slots.shape[0], slots.device)
        for name, value in values.items():
            self.tensors[name][i][index_rows, slots] = value
        return {name: self.tensors[name][i] for name in values}


class LatentCache(PositionalCache):
    """MLA's cache (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash): per token and layer the compressed key/value latent
    ("latent", kv_lora_rank values, after its norm) and the rotary key shared by the heads ("rope",
    qk_rope_head_dim values, rotated): (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes a position."""

    def __init__(self, layers: Sequence[int], rows: int, length: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device):
        super().__init__(layers, {"latent": (kv_lora_rank,), "rope": (rope_dim,)}, rows, length, dtype, device)


def write_rows(rows, batch: int, device) -> torch.Tensor:
    """The cache rows a batch writes, as the [B, 1] index that `write_and_read` takes (rows None: 0..B-1)."""
    return (rows if rows is not None else torch.arange(batch, device=device)).unsqueeze(1)
