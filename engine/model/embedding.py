"""The token-embedding table, on the GPU or in pinned host memory beside it.

A MoE model whose experts do not all fit its GPU budget gains more from resident experts than from holding the table
there: a step reads one row a token (kernels.gpu_host_rows reads it over PCIe, inside CUDA graphs too), and the table
is 0.1-1.9 GB on today's MoE models. `keep_in_host` moves it; the lookups still land on the model's device.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from moedesk.engine.model.config import ModelConfig
from moedesk.kernels import gpu_host_rows

ENV = "MOEDESK_EMBED_ON_GPU"  # 1: keep the table on the GPU, as before (to compare)


class Embedding(nn.Embedding):
    """nn.Embedding whose lookups land on `home` when its table lies in pinned host memory (`keep_in_host`)."""

    home: torch.device | None = None

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # a meta build's table is the checkpoint's; its random draw imports torch._dynamo
            super().reset_parameters()

    @property
    def device(self) -> torch.device:
        """Where lookups land: the model's first device, wherever the table lies."""
        return self.home if self.home is not None and not self.weight.is_cuda else self.weight.device

    @property
    def in_host(self) -> bool:
        """Whether the table lies in host memory while lookups land on a GPU."""
        return self.device != self.weight.device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return rows(self.weight, tokens)


def rows(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """table[tokens] on the tokens' device: read over PCIe where the table lies in host memory and they on a GPU."""
    if tokens.is_cuda and not table.is_cuda:
        return gpu_host_rows.host_rows(table, tokens)
    return F.embedding(tokens, table)


def shared_table(table: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """`table` for a module on `device` in `dtype` that looks rows up with `rows` (an EAGLE head's): as it is where it
    lies pinned beside that GPU in that dtype, else a copy there."""
    if (torch.device(device).type == "cuda" and table.dtype == dtype and not table.is_cuda and table.is_pinned()
            and gpu_host_rows.applies(device)):
        return table
    return table.to(device=device, dtype=dtype)


def table_stays_in_host(cfg: ModelConfig) -> bool:
    """Whether a model of `cfg` offloading experts from a GPU keeps its table in host memory: a MoE model whose head
    is not tied to the table (the head reads all of it every step), MOEDESK_EMBED_ON_GPU unset."""
    on_gpu = os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")
    return cfg.is_moe and not cfg.tie_word_embeddings and not on_gpu


def table_in_host(cfg: ModelConfig, device) -> bool:
    """`table_stays_in_host` where `device` is a GPU whose kernels read host memory (kernels.gpu_host_rows)."""
    return table_stays_in_host(cfg) and gpu_host_rows.applies(device)


def table_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """The table's bytes in the weights' dtype."""
    return cfg.vocab_size * cfg.hidden_size * dtype_bytes


def keep_in_host(embed: Embedding, table: torch.Tensor, device) -> None:
    """Make `table`, in pinned host memory, embed's table, its lookups landing on `device`."""
    embed.weight = nn.Parameter(table, requires_grad=False)
    embed.home = torch.device(device)
