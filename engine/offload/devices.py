"""Several GPUs in one machine, planned: which device holds which layers, and which experts each keeps resident.

A pure decision over sizes, like engine.offload.placement, which it reuses device by device. Each device takes a
run of consecutive layers (a token then crosses from one device to the next once per step, not once per layer),
as many as its share of the budgets says; the first device also holds the embeddings, the last the output head.
Each device's budget covers what it holds: its layers' non-expert weights, their KV cache and its resident experts.
engine.model.layer_devices runs the layers where the plan puts them; engine.offload.device_orchestra places each
device's experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moedesk.engine.errors import MoedeskError
from moedesk.engine.offload.placement import BudgetError, LayerCosts, Placement, plan_placement

GIB = 2**30


class DeviceCountError(MoedeskError):
    """--gpu-budget names a different number of GPUs than this machine has."""


def check_device_budgets(budgets: Sequence[float], gpus: int) -> tuple[float, ...]:
    """The per-device budgets (GiB) as a tuple, or one line saying why not. One figure is today's single budget and
    needs no GPU count (without a GPU the CPU stands in for the GPU tier); several must name every GPU detected."""
    budgets = tuple(float(b) for b in budgets)
    if not budgets:
        raise DeviceCountError("--gpu-budget: no figure given")
    if any(not np.isfinite(b) or b < 0 for b in budgets):
        raise DeviceCountError(f"--gpu-budget {','.join(f'{b:g}' for b in budgets)}: every figure must be >= 0 GiB")
    if len(budgets) > 1 and len(budgets) != gpus:
        found = f"{gpus} CUDA GPU" + ("" if gpus == 1 else "s")
        raise DeviceCountError(f"--gpu-budget {','.join(f'{b:g}' for b in budgets)} names {len(budgets)} GPUs and "
                               f"this machine has {found}: give one figure per GPU, or one figure")
    return budgets


@dataclass(frozen=True, eq=False)
class DevicePlan:
    """Where every layer lives and what each device keeps resident. placements[d] covers the MoE layers of device d,
    in order (see `moe_layers`)."""

    device_of_layer: tuple[int, ...]  # device index of each transformer layer
    placements: tuple[Placement, ...]  # one per device, over its MoE layers only
    budgets: tuple[int, ...]  # bytes, one per device
    kv_bytes: tuple[int, ...]  # each device's layers' KV cache
    moe_layers: tuple[tuple[int, ...], ...]  # the transformer-layer index of each row of placements[d].on_gpu

    @property
    def devices(self) -> int:
        return len(self.budgets)

    @property
    def bytes_per_device(self) -> tuple[int, ...]:
        """GPU bytes each device takes: non-expert weights, KV cache and resident experts."""
        return tuple(p.bytes_used for p in self.placements)

    def layers(self, device: int) -> range:
        """The consecutive transformer layers `device` holds (empty when it holds none)."""
        held = [i for i, d in enumerate(self.device_of_layer) if d == device]
        return range(held[0], held[-1] + 1) if held else range(0)

    def crossings(self) -> int:
        """How many times a token's hidden state moves between devices in one forward step."""
        return sum(a != b for a, b in zip(self.device_of_layer, self.device_of_layer[1:]))

    def on_gpu(self) -> np.ndarray:
        """bool [MoE layers, experts] over the whole model: resident on whichever device holds the layer."""
        return np.concatenate([p.on_gpu for p in self.placements], axis=0)


def layer_sizes(cfg, dtype_bytes: int, positions: int, devices: int = 1,
                packed: dict | None = None) -> tuple[list[int], list[int], list[bool], int, int]:
    """What plan_devices takes of a model config: per layer its non-expert weight bytes, its KV cache bytes for
    `positions` positions (rows x context) and whether it has routed experts; then the embeddings' and the output
    head's bytes. A Gated DeltaNet layer's state is per sequence, small, and counted as none here. packed: weights
    kept packed (engine.memory_fit.packed_savings), counted packed."""
    from moedesk.engine.memory_fit import layer_weights, packed_savings

    saved = packed_savings(packed, dtype_bytes)
    weights, kv, moe = [], [], []
    for layer in range(cfg.num_layers):
        experts, other = layer_weights(cfg, layer)
        weights.append(max(0, other * dtype_bytes - saved.get(layer, 0)))  # (MLA's layers are modelled roughly)
        moe.append(experts > 0)
        if cfg.kv_lora_rank:
            per_position = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
        else:
            per_position = 0 if cfg.is_linear_layer(layer) else 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
        kv.append(per_position * positions)
    table = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    # a tied head reads the embedding table: on a second device it needs a copy of its own
    head = table if devices > 1 or not cfg.tie_word_embeddings else 0
    return weights, kv, moe, table, max(0, head - saved.get("head", 0))


def split_layers(budgets: Sequence[int], layer_bytes: Sequence[int], first_bytes: int = 0,
                 last_bytes: int = 0) -> tuple[int, ...]:
    """Device index per layer: consecutive runs, each device's share of all the bytes (the layers', plus the
    embeddings on the first device and the head on the last) in proportion to its budget. A cut goes at the layer
    boundary nearest the device's target; every device gets at least one layer while there are layers enough."""
    n, devices = len(layer_bytes), len(budgets)
    total_budget = sum(budgets)
    if devices == 1 or n == 0:
        return (0,) * n
    if total_budget <= 0:
        raise BudgetError("every GPU budget is 0: nothing can hold the layers; raise --gpu-budget")
    # ends[i]: bytes up to and including layer i, as the devices fill in order
    ends = first_bytes + np.cumsum(np.asarray(layer_bytes, dtype=float))
    whole = ends[-1] + last_bytes
    cuts, start = [], 0
    for d in range(devices - 1):
        target = whole * sum(budgets[:d + 1]) / total_budget
        room_after = devices - 1 - d if n >= devices else 0  # later devices each need one layer, if there are enough
        lo, hi = start + (1 if n >= devices else 0), max(start, n - room_after)
        # the number of layers before the cut, among lo..hi, whose end lies nearest the target
        candidates = range(lo, hi + 1)
        cut = min(candidates, key=lambda k: (abs((ends[k - 1] if k else first_bytes) - target), k))
        cuts.append(cut)
        start = cut
    owner, bounds = [], [0, *cuts, n]
    for d in range(devices):
        owner += [d] * (bounds[d + 1] - bounds[d])
    return tuple(owner)


def layer_owner(budgets: Sequence[int], expert_bytes: int, num_experts: int, layer_non_expert_bytes: Sequence[int],
                layer_kv_bytes: Sequence[int], is_moe: Sequence[bool], first_bytes: int = 0,
                last_bytes: int = 0) -> tuple[int, ...]:
    """The device index of each layer as plan_devices splits them: by sizes alone (every expert of a layer counted),
    so it is known before the popularity that chooses each device's hot experts."""
    sizes = [w + kv + (expert_bytes * num_experts if moe else 0)
             for w, kv, moe in zip(layer_non_expert_bytes, layer_kv_bytes, is_moe)]
    return split_layers(tuple(int(b) for b in budgets), sizes, first_bytes, last_bytes)


def plan_devices(budgets: Sequence[int], expert_bytes: int, num_experts: int, popularity,
                 layer_non_expert_bytes: Sequence[int], layer_kv_bytes: Sequence[int],
                 is_moe: Sequence[bool] | None = None, first_bytes: int = 0, last_bytes: int = 0,
                 layer_costs: LayerCosts | Sequence[LayerCosts | None] | None = None, top_k: int = 1) -> DevicePlan:
    """Plan `budgets` (bytes, one per GPU) over the model's layers.

    popularity: one row of `num_experts` counts per MoE layer (the orchestra's). layer_non_expert_bytes and
    layer_kv_bytes: one figure per transformer layer; is_moe says which layers have routed experts (default all).
    first_bytes / last_bytes: the embeddings and the output head, on the first and last device. Layers split by
    `split_layers`, sized with every expert of a layer counted; then each device's hot experts are chosen by
    engine.offload.placement.plan_placement over its own MoE layers and budget, priced by layer_costs: one for
    every device, or one per device (each device's own copies and calls). With one budget the plan is exactly
    plan_placement's over the whole model. BudgetError, naming the device, when a budget cannot hold its
    layers' non-expert weights and KV cache.
    """
    n = len(layer_non_expert_bytes)
    if len(layer_kv_bytes) != n:
        raise ValueError(f"{len(layer_kv_bytes)} KV figures for {n} layers")
    is_moe = tuple(bool(m) for m in (is_moe if is_moe is not None else [True] * n))
    counts = np.asarray(popularity, dtype=float).reshape(-1, num_experts)
    if len(is_moe) != n or counts.shape[0] != sum(is_moe):
        raise ValueError(f"popularity has {counts.shape[0]} rows for {sum(is_moe)} MoE layers of {n}")
    budgets = tuple(int(b) for b in budgets)
    owner = layer_owner(budgets, expert_bytes, num_experts, layer_non_expert_bytes, layer_kv_bytes, is_moe,
                        first_bytes, last_bytes)
    per_device = layer_costs if isinstance(layer_costs, (list, tuple)) else [layer_costs] * len(budgets)
    moe_index = np.cumsum(is_moe) - 1  # row of `counts` for each MoE layer
    placements, kv_per_device, moe_layers = [], [], []
    for d, budget in enumerate(budgets):
        mine = [i for i in range(n) if owner[i] == d]
        moe_mine = tuple(i for i in mine if is_moe[i])
        fixed = sum(layer_non_expert_bytes[i] for i in mine) + (first_bytes if d == 0 else 0) \
            + (last_bytes if d == len(budgets) - 1 else 0)
        kv = sum(layer_kv_bytes[i] for i in mine)
        rows = counts[moe_index[list(moe_mine)]] if moe_mine else np.zeros((0, num_experts))
        try:
            plan = plan_placement(expert_bytes, len(moe_mine), num_experts, rows, budget, fixed, kv,
                                  layer_costs=per_device[d], top_k=top_k)
        except BudgetError:
            if len(budgets) == 1:
                raise
            held = f"layers {mine[0]}-{mine[-1]}" if mine else "no layers"
            raise BudgetError(f"GPU {d}'s budget {budget / GIB:.2f} GiB cannot hold the non-expert weights "
                              f"({fixed / GIB:.2f} GiB) and KV cache ({kv / GIB:.2f} GiB) of its {held}; raise its "
                              f"figure in --gpu-budget") from None
        placements.append(plan)
        kv_per_device.append(kv)
        moe_layers.append(moe_mine)
    return DevicePlan(owner, tuple(placements), budgets, tuple(kv_per_device), tuple(moe_layers))


def format_device_plan(plan: DevicePlan, popularity=None) -> list[str]:
    """Lines for `moedesk profile`: per device its layers, bytes and resident experts."""
    lines = [f"per-device plan over {plan.devices} GPUs, {plan.crossings()} device crossing(s) per token:"]
    counts = None if popularity is None else np.asarray(popularity, dtype=float)
    for d, place in enumerate(plan.placements):
        layers = plan.layers(d)
        held = f"layers {layers.start}-{layers.stop - 1}" if layers else "no layers"
        line = (f"  GPU {d}: {held}, {plan.bytes_per_device[d] / GIB:.2f} of {plan.budgets[d] / GIB:.2f} GiB "
                f"(weights {place.non_expert_bytes / GIB:.2f}, KV cache {plan.kv_bytes[d] / GIB:.2f}, "
                f"{place.experts_on_gpu} of {place.on_gpu.size} experts {place.expert_bytes_used / GIB:.2f})")
        if counts is not None and place.on_gpu.size and counts.size:
            first = sum(len(m) for m in plan.moe_layers[:d])
            mine = counts[first:first + place.on_gpu.shape[0]]
            if mine.sum() > 0:
                line += f", expected hit rate {place.gpu_hit_rate(mine):.0%}"
        lines.append(line)
    return lines
