"""The KV cache: keys and values of every attention layer, one row per sequence slot, at each token's position."""
from __future__ import annotations

from typing import Sequence

import torch

from moedesk.engine.model.cache.positional import PositionalCache, write_rows
from moedesk.engine.model.config import ModelConfig
from moedesk.kernels import gpu_fused


class KVCache(PositionalCache):
    """Keys and values [rows, positions, kv_heads, head_dim] per layer (`k`, `v`: lists in layer order)."""

    def __init__(self, cfg: ModelConfig, rows: int, length: int, dtype: torch.dtype, device,
                 layers: Sequence[int] | None = None):
        """layers: the model layers it serves (default: all of them)."""
        self.cfg = cfg
        shape = (cfg.num_kv_heads, cfg.head_dim)
        super().__init__(range(cfg.num_layers) if layers is None else layers, {"k": shape, "v": shape}, rows,
                         length, dtype, device)

    @property
    def k(self) -> list[torch.Tensor]:
        return self.tensors["k"]

    @property
    def v(self) -> list[torch.Tensor]:
        return self.tensors["v"]

    def write(self, layer: int, k, v, rows, positions, index_rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, T, kv_heads, D] at `positions` [B, T] of `rows`; return the layer's whole key and value
        tensors [rows, length, kv_heads, D] (a kernel that reads the cache in place takes them).
        index_rows: the written rows as [B, 1] (`write_rows`), when the caller made it once for every layer."""
        i = self.index[layer]
        cache_k, cache_v = self.k[i], self.v[i]
        if index_rows is None:
            index_rows = write_rows(rows, k.shape[0], k.device)
        if gpu_fused.cache_write_fits(cache_k, k, v) and positions.is_cuda and index_rows.is_cuda:
            gpu_fused.write_cache(cache_k, cache_v, k, v, index_rows, positions)
        else:
            cache_k[index_rows, positions] = k
            cache_v[index_rows, positions] = v
        return cache_k, cache_v

    def write_and_read(self, layer: int, k, v, rows, positions, kv_len: int, index_rows=None):
        """`write`, then keys/values [B, kv_len, ...] of the written rows."""
        cache_k, cache_v = self.write(layer, k, v, rows, positions, index_rows)
        B = k.shape[0]
        if rows is None:
            return cache_k[:B, :kv_len], cache_v[:B, :kv_len]
        return cache_k[rows, :kv_len], cache_v[rows, :kv_len]
