"""What a hybrid model's recurrent layers hold per sequence in llama.cpp: its "RS buffer", beside the KV cache.

Gated DeltaNet (Qwen3-Next, Qwen3.5), Mamba-style and LFM2's short-convolution layers keep no cache that grows with
the context but a fixed state per sequence, which llama.cpp allocates in f32 for every sequence the context holds
(llama_memory_recurrent: a convolution row of n_embd_r floats and a state row of n_embd_s, per recurrent layer).
Those layers hold no KV cache. Pure functions of the GGUF's metadata, as llama.cpp's hparams read it; checked against
the "RS buffer size" llama.cpp logs (tests/llamacpp/test_recurrent_state.py).
"""
from __future__ import annotations

from typing import Callable

F32 = 4
# Architectures whose layers are recurrent but every `full_attention_interval`-th (4 unless the file says), where the
# file has no per-layer list (llama.cpp's qwen3next, qwen35, qwen35moe loaders)
INTERVAL_ARCHS = ("qwen3next", "qwen35", "qwen35moe")

Metadata = Callable[[str], object]  # the architecture's value for a key without its "<arch>." prefix, or None


def recurrent_layers(arch: str, meta: Metadata, layers: int) -> list[int]:
    """The layers llama.cpp gives recurrent state (and no KV cache): an explicit per-layer list where the file has
    one; the interval rule of the Qwen3-Next family; else, where key/value heads are given per layer, the layers with
    none (LFM2's short convolutions)."""
    flags = meta("attention.recurrent_layers")
    if isinstance(flags, list) and flags:
        return [i for i in range(min(layers, len(flags))) if flags[i]]
    if arch in INTERVAL_ARCHS:
        interval = meta("full_attention_interval")
        interval = interval if isinstance(interval, int) and interval > 0 else 4
        return [i for i in range(layers) if (i + 1) % interval]
    heads = meta("attention.head_count_kv")
    if isinstance(heads, list) and (meta("shortconv.l_cache") or meta("ssm.state_size")):
        return [i for i in range(min(layers, len(heads))) if heads[i] == 0]
    return []


def state_floats(meta: Metadata) -> tuple[int, int]:
    """(n_embd_r, n_embd_s): floats of one recurrent layer's convolution row and state row for one sequence. The
    convolution keeps its last kernel-1 inputs (of the hidden width for LFM2; of the value, key and query channels
    for Mamba-2 and Gated DeltaNet); the state is d_state x d_inner (for Gated DeltaNet: a key-by-value matrix per
    value head)."""
    def number(key):
        found = meta(key)
        return found if isinstance(found, int) else 0

    conv = number("shortconv.l_cache")
    d_conv, d_inner, d_state = number("ssm.conv_kernel"), number("ssm.inner_size"), number("ssm.state_size")
    if conv:
        r = number("embedding_length") * (conv - 1)
    else:
        r = max(0, d_conv - 1) * (d_inner + 2 * number("ssm.group_count") * d_state)
    return r, d_state * d_inner


def state_bytes_per_sequence(arch: str, meta: Metadata, layers: int) -> int:
    """Bytes of llama.cpp's RS buffer for each sequence the context holds (0: no recurrent layers)."""
    recurrent = recurrent_layers(arch, meta, layers)
    return F32 * len(recurrent) * sum(state_floats(meta)) if recurrent else 0
