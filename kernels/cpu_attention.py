"""A decode step's attention on a CPU load, on the native kernels' pool (cpu_attention.c says why).

`decode_attention` takes what kernels.gpu_decode_attention's does for one token a row: queries q [B, H, D], row
b attending to the first lengths[b] positions of cache row rows[b] of cache_k/cache_v [rows, length, kv_heads,
D], in place. Float32; the query heads that share a key/value head are consecutive (torch's enable_gqa).
MOEDESK_NO_NATIVE_KERNELS=1 turns it off, as the other native kernels.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from moedesk.kernels import cpu_experts
from moedesk.kernels.native_build import missing_cpu_flags, open_library

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-Wall", "-mavx2", "-mfma", cpu_experts.header_flag()]
MAX_HEADS = 128  # cpu_attention.c's
_state: dict = {}
_lock = threading.Lock()


def applies(q: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Whether `decode_attention` takes queries q [B, H, D] over cache_k [rows, length, kv_heads, D]: float32 CPU
    tensors, head_dim a multiple of 8, at most 128 query heads, the library built here."""
    return (q.dim() == 3 and q.is_cpu and q.dtype is torch.float32 and cache_k.dtype is torch.float32
            and cache_k.is_cpu and takes_heads(q.shape[1], cache_k.shape[2], q.shape[-1]))


def takes_heads(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes a model's attention heads, and is built and on here."""
    return (head_dim % 8 == 0 and heads % kv_heads == 0 and heads <= MAX_HEADS and not cpu_experts._disabled()
            and available())


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, rows: torch.Tensor | None,
                     lengths: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√D)·v for q [B, H, D], row b over the first lengths[b] positions of cache row rows[b] (None: b);
    returns [B, H, D]. The cache is read where it is (contiguous, as KVCache holds it)."""
    lib = _state["lib"]
    b, heads, d = q.shape
    kv_heads = cache_k.shape[2]
    if not (cache_k.is_contiguous() and cache_v.is_contiguous() and cache_k.shape == cache_v.shape):
        raise ValueError("the cache's keys and values must be contiguous and alike")
    q = q.contiguous()
    lengths = lengths.to(torch.int64).contiguous()
    rows = None if rows is None else rows.to(torch.int64).contiguous()
    longest = int(lengths.max())
    if lengths.shape != (b,) or int(lengths.min()) < 1 or longest > cache_k.shape[1] or (
            rows is not None and (rows.shape != (b,) or int(rows.min()) < 0 or int(rows.max()) >= cache_k.shape[0])):
        raise ValueError(f"{b} rows of lengths {lengths.tolist()} do not fit a cache {tuple(cache_k.shape)}")
    piece = lib.ca_piece(b, max(longest, 1), lib.ca_threads())
    pieces = max(1, -(-longest // piece))
    part = torch.empty(b * pieces * heads * (d + 2), dtype=torch.float32)
    out = torch.empty_like(q)
    rc = lib.ca_decode(q.data_ptr(), b, kv_heads, heads // kv_heads, d, cache_k.data_ptr(), cache_v.data_ptr(),
                       cache_k.stride(0), None if rows is None else rows.data_ptr(), lengths.data_ptr(), piece,
                       pieces, d ** -0.5, part.data_ptr(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"decode attention cannot take q {tuple(q.shape)} over a cache {tuple(cache_k.shape)}")
    return out


def available() -> bool:
    if not _state:
        _load()
    return "lib" in _state


def unavailable_reason() -> str | None:
    return None if available() else _state["reason"]


def _load() -> None:
    with _lock:
        if _state:
            return
        lib, reason = open_library(SOURCE, FLAGS, missing_cpu_flags(("avx2", "fma"), "AVX2 and FMA"),
                                   "ca_cpu_supported", "the CPU or OS lacks AVX2 or FMA")
        if reason is not None:
            _state["reason"] = reason
            return
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.ca_decode.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64, ctypes.c_float, ptr,
                                  ptr]
        lib.ca_decode.restype = ctypes.c_int
        lib.ca_piece.argtypes = [i64, i64, ctypes.c_int]
        lib.ca_piece.restype = i64
        lib.ca_threads.restype = ctypes.c_int
        lib.ca_set_threads.argtypes = [ctypes.c_int]
        lib.ca_use_pool.argtypes = [ptr, ptr]
        # One pool a process: cpu_experts' where its library runs here (its thread setting and spinning too).
        if cpu_experts.available():
            experts = cpu_experts._state["lib"]
            lib.ca_use_pool(ctypes.cast(experts.moe_pool_run, ptr), ctypes.cast(experts.moe_get_threads, ptr))
        else:
            lib.ca_set_threads(cpu_experts.get_num_threads())
        _state["lib"] = lib
