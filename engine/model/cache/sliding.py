"""A sliding-window layer's cache: the keys and values of each row's last `window` positions, in a ring.

gpt-oss alternates full attention with attention over the last 128 positions; its sliding layers need no more
than that many keys a row, however long the context. The ring has `spare` slots beyond the window so that a
speculative verify can write its drafts without overwriting positions the window still needs once the drafts
are rejected. Every slot records the position it holds (-1: none), so reads know what is current: an entry at
or past the first slot a forward writes is stale (a rejected draft, prompt padding, a row's previous sequence)
and is never returned as valid.

A forward's own tokens are attended to as computed, not read back from the ring: a prompt longer than the ring
sees every key it needs.
"""
from __future__ import annotations

from typing import Sequence

import torch


class SlidingWindowCache:
    """Keys and values [rows, window + spare, kv_heads, head_dim] per layer of `layers`, slot = position mod ring."""

    def __init__(self, layers: Sequence[int], rows: int, window: int, spare: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        """spare: ring slots past the window; at least the most tokens one forward writes past a row's end
        (a speculative verify's draft nodes), so that rejecting them loses no position the window needs."""
        if window < 1 or spare < 0:
            raise ValueError(f"a sliding window needs window >= 1 and spare >= 0, got {window} and {spare}")
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.window, self.ring = window, window + spare
        self.shape = (kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.rows, self.length = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slot_positions: list[torch.Tensor] = []  # per layer [rows, ring]: the position each slot holds, or -1
        self.ensure(rows, 0)

    def _all(self) -> list[torch.Tensor]:
        return self.k + self.v + self.slot_positions

    def ensure(self, rows: int, length: int) -> None:
        """Room for `rows` sequences (the ring's size does not depend on `length`), keeping what is stored."""
        self.length = max(self.length, length)
        if rows <= self.rows:
            return
        layers = range(len(self.layers))
        k = [torch.zeros((rows, self.ring, *self.shape), dtype=self.dtype, device=self.device) for _ in layers]
        v = [torch.zeros((rows, self.ring, *self.shape), dtype=self.dtype, device=self.device) for _ in layers]
        positions = [torch.full((rows, self.ring), -1, dtype=torch.long, device=self.device) for _ in layers]
        for new, old in zip(k + v + positions, self._all()):
            new[: old.shape[0]] = old
        self.k, self.v, self.slot_positions, self.rows = k, v, positions, rows

    def shrink(self, rows: int, length: int) -> None:
        """Reallocate for `rows` sequences, dropping what is stored (no sequence may be using it)."""
        self.k, self.v, self.slot_positions, self.rows, self.length = [], [], [], 0, 0
        self.ensure(rows, length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._all())

    def bytes_per_position(self) -> int:
        return 0  # a row's ring is all it ever takes

    def bytes_per_row(self) -> int:
        per_layer = self.ring * (2 * self.shape[0] * self.shape[1] * self.dtype.itemsize + 8)
        return len(self.layers) * per_layer

    def storage_key(self) -> tuple:
        return (self.k[0].data_ptr() if self.k else 0), self.rows

    def write_and_read(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows, slots: torch.Tensor):
        """Attend-ready keys and values for k, v [B, T, kv_heads, D] written at `slots` [B, T] of `rows` (None:
        0..B-1): (keys, values [B, ring + T, ...], key_positions [B, ring + T]), the ring as it was before this
        forward (stale entries at -1) followed by the forward's own tokens. Then the last `ring` of those tokens
        go into the ring. `window_mask` turns the positions into the mask."""
        i = self.index[layer]
        batch, length = slots.shape
        index = rows if rows is not None else torch.arange(batch, device=slots.device)
        old_positions = self.slot_positions[i][index]
        current = (old_positions >= 0) & (old_positions < slots[:, :1])
        keys = torch.cat([self.k[i][index], k], dim=1)
        values = torch.cat([self.v[i][index], v], dim=1)
        positions = torch.cat([torch.where(current, old_positions, -1), slots], dim=1)
        keep = min(length, self.ring)  # of a longer forward, only the last ring's worth stays
        at = slots[:, -keep:] % self.ring
        row_index = index.unsqueeze(1)
        self.k[i][row_index, at] = k[:, -keep:]
        self.v[i][row_index, at] = v[:, -keep:]
        self.slot_positions[i][row_index, at] = slots[:, -keep:]
        return keys, values, positions

    def reorder(self, block: list[int], source: list[int], length: int) -> None:
        """Row block[j] takes row block[source[j]]'s ring (beam search)."""
        if source == list(range(len(block))):
            return
        rows = torch.tensor(block, device=self.device)
        origin = rows[torch.tensor(source, device=self.device)]
        for t in self._all():
            t[rows] = t[origin]

    def accept(self, rows: list[int], starts: list[int], paths: list[list[int]]) -> None:
        """Row rows[i]'s accepted draft nodes move from slots starts[i] + node to starts[i] + 1, .... The rejected
        ones stay in slots past the row's new end, which the next forward's read treats as stale (at or past the
        first slot it writes): no trace of them is ever attended to."""
        moves = [(i, k + 1, node) for i, path in enumerate(paths) for k, node in enumerate(path) if node != k + 1]
        if not moves:
            return
        index = torch.tensor([rows[i] for i, _, _ in moves], device=self.device)
        dst_positions = torch.tensor([starts[i] + k for i, k, _ in moves], device=self.device)
        src = torch.tensor([starts[i] + node for i, _, node in moves], device=self.device) % self.ring
        dst = dst_positions % self.ring
        for t in self.k + self.v:
            t[index, dst] = t[index, src]
        for t in self.slot_positions:
            t[index, dst] = dst_positions


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, 1, T, S] bool, True where a query at query_positions [B, T] may attend a key at key_positions [B, S]:
    a key held (>= 0), at or before the query and among its last `window` positions (q - window < k <= q)."""
    q = query_positions.unsqueeze(-1)
    k = key_positions.unsqueeze(1)
    return ((k >= 0) & (k <= q) & (k > q - window)).unsqueeze(1)
