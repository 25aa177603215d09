"""A linear layer whose weight stays packed (a GGUF's block quantisation), on a GPU or the CPU (`wanted`).

A GGUF's attention projections, shared experts, dense layers and head are held in 16 bits otherwise (float32 on the
CPU): several times their file size, and read whole by every decode step. `PackedLinear` keeps the packed rows as a
buffer and computes from them: on the CPU, the packed experts' native kernel with one group (kernels.cpu_quant.linear:
each weight read once, packed, x quantised to int8 per 32 values as for the experts); on CUDA with few rows of input
(decode, a speculative verify), the GPU kernel with one group (kernels.gpu_quant.packed_linear); with many rows
(prefill) on CUDA, and on the CPU where its kernel is not built, the rows dequantised a slice at a time and
multiplied by torch (cuBLAS reads 16 bits faster than any packed kernel once a weight serves many rows). The GPU
routes dequantise exactly as kernels.quant_formats.dequantize.

Which weights: every nn.Linear the loader fills from a packed tensor (`packable`), except those read as a matrix
rather than through forward: the router (scored in float32), a shared expert's one-row gate, MLA's kv_b_proj (its
blocks are absorbed into the queries), Gated DeltaNet's input projections (fused by concatenating weights). The
embedding table stays 16-bit (a lookup reads one row per token). The output head is packed: it is the largest
matrix every decode step reads.
"""
from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from moedesk.kernels import cpu_quant, gpu_quant
from moedesk.kernels.quant_formats import FORMATS, dequantize

ENV = "MOEDESK_PACKED_WEIGHTS"
# Weights read as matrices, not through their module's forward (see the module docstring).
_UNPACKABLE = re.compile(r".*(moe\.router|shared_gate|attn\.wkv_b|attn\.in_qkv|attn\.in_z|attn\.in_b|attn\.in_a)"
                         r"\.weight")
# Weights dequantised at once on the many-rows route: bounds its scratch (64 MiB of float32).
_DEQUANT_CHUNK = 1 << 24


def wanted(device) -> bool:
    """Whether a load onto `device` keeps packed non-expert weights packed (read once per load by its caller):
    MOEDESK_PACKED_WEIGHTS=1 or 0 says; unset, on a GPU (smaller and, at a few rows, faster there) and on the CPU
    where the native packed kernel runs (without it each forward would dequantise every weight)."""
    setting = os.environ.get(ENV)
    if setting in ("0", "1"):
        return setting == "1"
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and cpu_quant.available())


def formats() -> tuple[str, ...]:
    """The packed formats a PackedLinear computes from: those both the GPU and the CPU kernel read."""
    return tuple(f for f in gpu_quant.supported_formats() if f in cpu_quant.FORMAT_CODES)


def packable(name: str) -> bool:
    """Whether the model's parameter `name` (our name) may be held by a PackedLinear: a Linear's weight, other than
    the embedding table and the weights read as matrices."""
    return name.endswith(".weight") and not name.startswith("embed.") and not _UNPACKABLE.fullmatch(name)


def keeps(name: str, fmt: str | None, in_features: int) -> bool:
    """Whether a load that keeps packed weights keeps the parameter `name` (ours), stored in `fmt` with rows of
    `in_features` weights, packed: a packable Linear weight, in a format the kernels read, of whole blocks."""
    return packable(name) and fmt in formats() and in_features % FORMATS[fmt].block == 0


def route(on_cuda: bool, kernel: bool, rows: int) -> str:
    """"kernel" (the packed kernel) where it applies, on CUDA for few rows only, else "dequant"."""
    return "kernel" if kernel and (not on_cuda or rows < gpu_quant.LINEAR_ROWS) else "dequant"


class PackedLinear(nn.Module):
    """y = x W^T (+ bias) with W [out_features, in_features] held as packed rows [out_features, row_bytes]."""

    def __init__(self, rows: torch.Tensor, fmt: str, in_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if fmt not in FORMATS or rows.dtype != torch.uint8 or rows.dim() != 2 \
                or rows.shape[1] != FORMATS[fmt].row_bytes(in_features):
            raise ValueError(f"{fmt} rows of {in_features} weights: got {rows.dtype} {tuple(rows.shape)}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, rows.shape[0]
        self.dtype = dtype  # the model's: what `weight` dequantises to
        self.register_buffer("packed", rows)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}, bias={self.bias is not None}"

    @property
    def weight(self) -> torch.Tensor:
        """The matrix dequantised (a new copy in the model's dtype each time): for the rare reader of a head's
        matrix (EAGLE-1/2 draft heads), never for the forward."""
        return dequantize(self.packed, self.fmt, self.in_features, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.is_cuda:
            kernel = gpu_quant.linear_applies(flat, self.packed, self.fmt)
            if route(True, kernel, flat.shape[0]) == "kernel":
                y = gpu_quant.packed_linear(flat, self.packed, self.fmt, self.bias)
            else:
                y = self._dequantised(flat, on_gpu=kernel)
        elif route(False, cpu_quant.linear_applies(flat, self.packed, self.fmt), flat.shape[0]) == "kernel":
            y = cpu_quant.linear(flat, self.packed, self.fmt, self.bias)
        else:
            y = self._dequantised(flat, on_gpu=False)
        return y.view(*lead, self.out_features)

    def _dequantised(self, x: torch.Tensor, on_gpu: bool) -> torch.Tensor:
        """x W^T through W dequantised a slice of rows at a time (the head's 16-bit copy would be hundreds of MiB);
        on_gpu: by the GPU kernel (gpu_quant.linear_applies), else kernels.quant_formats.dequantize."""
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        step = max(1, _DEQUANT_CHUNK // self.in_features)
        for start in range(0, self.out_features, step):
            rows = self.packed[start:start + step]
            if on_gpu:
                w = gpu_quant.dequantize_experts(rows.unsqueeze(0), self.fmt, self.in_features, dtype=x.dtype)[0]
            else:
                w = dequantize(rows, self.fmt, self.in_features, x.dtype)
            bias = None if self.bias is None else self.bias[start:start + step].to(x.dtype)
            out[:, start:start + step] = F.linear(x, w, bias)
        return out

    @classmethod
    def joined(cls, parts: list["PackedLinear"]) -> "PackedLinear":
        """One PackedLinear computing `parts` (one format, one input width) at once, their outputs side by side:
        the rows concatenated (a packed row is self-contained). The parts' buffers become views of the joined
        rows, so the bytes are held once."""
        fmt, k = parts[0].fmt, parts[0].in_features
        if any(p.fmt != fmt or p.in_features != k for p in parts):
            raise ValueError("joined parts must share a format and an input width")
        rows = torch.cat([p.packed for p in parts])
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        start = 0
        for p in parts:
            p.packed = rows[start:start + p.out_features]
            if bias is not None:
                p.bias.data = bias[start:start + p.out_features]
            start += p.out_features
        return cls(rows, fmt, k, bias, parts[0].dtype)


def replace_linear(model: nn.Module, name: str, rows: torch.Tensor, fmt: str, in_features: int,
                   dtype: torch.dtype = torch.bfloat16) -> PackedLinear:
    """Put a PackedLinear of `rows` where the Linear owning parameter `name` is, keeping that Linear's bias (loaded
    or not yet: the loader sets it on the new module like any parameter)."""
    owner_name, _, _ = name.rpartition(".")
    parent_name, _, leaf = owner_name.rpartition(".")
    old = model.get_submodule(owner_name)
    if rows.shape[0] != old.out_features or in_features != old.in_features:
        raise ValueError(f"{name}: packed rows {tuple(rows.shape)} of {in_features} weights for a "
                         f"{old.out_features} x {old.in_features} Linear")
    packed = PackedLinear(rows, fmt, in_features, dtype=dtype)
    packed.bias = old.bias
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, packed)
    return packed


def plan_of(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """The packed weights of a loaded model: parameter name it replaced -> (format, rows, columns)."""
    return {f"{name}.weight": (m.fmt, m.out_features, m.in_features) for name, m in model.named_modules()
            if isinstance(m, PackedLinear)}
