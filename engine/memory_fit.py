"""Whether a model fits the memory before it is built or read: refused in one line that names a setting that
fits, rather than a traceback (or a machine brought down) half way through.

Pure functions of the sizes; the callers read what is available (RAM: psutil's `available`).
"""
from __future__ import annotations

from moedesk.engine.errors import MoedeskError
from moedesk.engine.model.config import ModelConfig

GIB = 2**30
# What else a process needs besides the weights (the KV cache, activations, torch itself): a model must leave
# this much of the available memory free.
HEADROOM = 0.10


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def layer_weights(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(expert weights, other weights) of one transformer layer, in parameters."""
    hidden, heads, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention = hidden * heads * hd * (3 if cfg.attention_gate else 2) + hidden * kv * hd * 2
    if cfg.is_linear_layer(layer):  # Gated DeltaNet: q, k, v and the gate z in, beta and the decay, out; the conv
        keys, values = cfg.linear_key_heads * cfg.linear_key_dim, cfg.linear_value_heads * cfg.linear_value_dim
        attention = (hidden * (2 * keys + 3 * values + 2 * cfg.linear_value_heads)
                     + (2 * keys + values) * cfg.linear_conv_kernel)
    moe = bool(cfg.moe_layers) and cfg.moe_layers[layer] if layer < len(cfg.moe_layers) else cfg.num_experts > 0
    if not moe:
        return 0, attention + 3 * hidden * cfg.intermediate_size
    shared = 3 * hidden * cfg.shared_expert_intermediate_size
    return 3 * hidden * cfg.moe_intermediate_size * cfg.num_experts, attention + shared + hidden * cfg.num_experts


def packed_savings(packed, dtype_bytes: int) -> dict:
    """Bytes that weights kept packed (MOEDESK_PACKED_WEIGHTS: our name -> (format, rows, columns), as
    engine.model.packed_linear.plan_of or engine.load.loader.packed_plan give them) hold less than in `dtype_bytes`,
    per layer index, and "head" for the output head."""
    from moedesk.kernels.quant_formats import packed_format

    saved: dict = {}
    for name, (fmt, rows, k) in (packed or {}).items():
        part, _, rest = name.partition(".")
        where = int(rest.partition(".")[0]) if part == "layers" else "head"
        saved[where] = saved.get(where, 0) + rows * (k * dtype_bytes - packed_format(fmt).row_bytes(k))
    return saved


def model_bytes(cfg: ModelConfig, layers: int, dtype_bytes: int, expert_bits: float) -> int:
    """Bytes of the first `layers` layers plus the embeddings, the experts at `expert_bits` per weight."""
    total = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) * dtype_bytes
    for layer in range(layers):
        experts, other = layer_weights(cfg, layer)
        total += int(experts * expert_bits / 8) + other * dtype_bytes
    return total


def usable(available: int) -> int:
    return int(available * (1 - HEADROOM))


def check_bench_fits(cfg: ModelConfig, layers: int, dtype_bytes: int, expert_bits: float, available: int,
                     shape: str) -> None:
    """MoedeskError unless the synthetic `shape` of `layers` layers fits: naming the --layers that would."""
    need = model_bytes(cfg, layers, dtype_bytes, expert_bits)
    if need <= usable(available):
        return
    fitting = max((n for n in range(1, layers) if model_bytes(cfg, n, dtype_bytes, expert_bits) <= usable(available)),
                  default=0)
    advice = f"use --layers {fitting}" if fitting else "use --shape tiny-moe"
    raise MoedeskError(f"bench: {shape} x{layers} layers needs {gib(need)} of RAM, {gib(available)} is available; "
                       f"{advice}")


def shortfall(need: int, available: int, alternatives: dict[str, int]) -> str | None:
    """None when `need` bytes fit `available`; else what is short, in words, naming the first of `alternatives` (a
    setting -> the bytes it would need) that fits, if any."""
    if need <= usable(available):
        return None
    fits = next((setting for setting, size in alternatives.items() if size <= usable(available)), None)
    advice = f"try {fits}" if fits else "it does not fit this machine's memory in any form moedesk has"
    return f"needs {gib(need)} of RAM once loaded, {gib(available)} is available; {advice}"


def check_load_fits(need: int, available: int, what: str, alternatives: dict[str, int]) -> None:
    """MoedeskError unless `need` bytes fit `available`: `what` and its shortfall, in one line."""
    short = shortfall(need, available, alternatives)
    if short is not None:
        raise MoedeskError(f"{what} {short}")
