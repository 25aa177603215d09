"""Preallocated key/value cache: one row per sequence slot, written at each token's position."""
from __future__ import annotations

import torch

from moedesk.engine.model.config import ModelConfig
from moedesk.kernels import gpu_fused


class KVCache:
    """Keys and values of every layer, [rows, positions, kv_heads, head_dim] each.

    Allocated once per batch shape; `ensure` grows it (rarely: only when a longer request
    arrives), never per token; only `shrink` gives memory back.
    """

    def __init__(self, cfg: ModelConfig, rows: int, length: int, dtype: torch.dtype, device):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.rows, self.length = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure(rows, length)

    def ensure(self, rows: int, length: int) -> None:
        """Make room for `rows` sequences of `length` positions, keeping what is stored."""
        if rows <= self.rows and length <= self.length:
            return
        rows, length = max(rows, self.rows), max(length, self.length)
        shape = (rows, length, self.cfg.num_kv_heads, self.cfg.head_dim)
        # Built aside and swapped in at the end: an out-of-memory error here leaves the cache as it was.
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.cfg.num_layers)]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.cfg.num_layers)]
        for new, old in zip(k + v, self.k + self.v):
            new[: old.shape[0], : old.shape[1]] = old
        self.k, self.v = k, v
        self.rows, self.length = rows, length

    def shrink(self, rows: int, length: int) -> None:
        """Reallocate at `rows` x `length`, dropping what is stored (no sequence may be using it): ensure only ever
        grows, so a batch that fell back to fewer rows would keep the memory of the most it ever held."""
        self.k, self.v, self.rows, self.length = [], [], 0, 0  # the old tensors go before the new ones are made
        self.ensure(rows, length)

    def nbytes(self) -> int:
        """The memory the keys and values take now."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_position(self) -> int:
        return 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * self.dtype.itemsize

    def storage_key(self) -> tuple:
        """Changes whenever the tensors move (a reallocation): CUDA graphs read them in place."""
        return self.k[0].data_ptr(), self.rows, self.length

    def reorder(self, block: list[int], source: list[int], length: int) -> None:
        """Row block[j] takes what row block[source[j]] holds in its first `length` positions (beam search's
        hypotheses continuing others): one gather per tensor, on the device."""
        W = len(block)
        if source == list(range(W)):
            return
        index = torch.tensor(source, device=self.device)
        start = block[0]
        if block == list(range(start, start + W)):
            for t in self.k + self.v:
                t[start:start + W, :length] = t[start:start + W, :length].index_select(0, index)
        else:
            rows = torch.tensor(block, device=self.device)
            origin = rows[index]
            for t in self.k + self.v:
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
        for t in self.k + self.v:
            t[index, dst] = t[index, src]

    def write_and_read(self, layer: int, k, v, rows, positions, kv_len: int, index_rows=None):
        """Store k/v [B, T, kv_heads, D] at `positions` [B, T] of `rows`; return keys/values [B, kv_len, ...].
        index_rows: the written rows as [B, 1] (`write_rows`), when the caller made it once for every layer."""
        cache_k, cache_v = self.k[layer], self.v[layer]
        B = k.shape[0]
        if index_rows is None:
            index_rows = write_rows(rows, B, k.device)
        if gpu_fused.cache_write_fits(cache_k, k, v) and positions.is_cuda and index_rows.is_cuda:
            gpu_fused.write_cache(cache_k, cache_v, k, v, index_rows, positions)
        else:
            cache_k[index_rows, positions] = k
            cache_v[index_rows, positions] = v
        if rows is None:
            return cache_k[:B, :kv_len], cache_v[:B, :kv_len]
        return cache_k[rows, :kv_len], cache_v[rows, :kv_len]


def write_rows(rows, batch: int, device) -> torch.Tensor:
    """The cache rows a batch writes, as the [B, 1] index that `write_and_read` takes (rows None: 0..B-1)."""
    return (rows if rows is not None else torch.arange(batch, device=device)).unsqueeze(1)
