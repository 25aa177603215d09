"""Pure decisions: which experts live on the GPU, and where each offloaded expert runs this step.

No tensors and no devices here, so every rule is unit-tested on hand-made numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.errors import MoedeskError


class BudgetError(MoedeskError):
    """The GPU budget cannot even hold the weights that must live there."""


def plan_placement(popularity: list[list[int]], expert_bytes: int, budget_bytes: int) -> list[list[bool]]:
    """on_gpu[layer][expert]: the most popular experts, one by one across all layers, until the budget is spent.

    Per expert, not per layer: a popular expert of any layer beats an unpopular one of another.
    Ties break by (layer, expert) so the plan is deterministic.
    """
    order = sorted(((-count, layer, e) for layer, row in enumerate(popularity) for e, count in enumerate(row)))
    on_gpu = [[False] * len(row) for row in popularity]
    fits = max(0, budget_bytes) // expert_bytes if expert_bytes else 0
    for _, layer, e in order[:fits]:
        on_gpu[layer][e] = True
    return on_gpu


def expert_budget(gpu_budget_bytes: int, non_expert_bytes: int, reserve_bytes: int) -> int:
    """What is left for experts once non-expert weights and the KV cache/activations reserve are in."""
    left = gpu_budget_bytes - non_expert_bytes - reserve_bytes
    if left < 0:
        raise BudgetError(f"GPU budget {gpu_budget_bytes / 2**30:.1f} GiB cannot hold the non-expert weights and "
                          f"cache ({(non_expert_bytes + reserve_bytes) / 2**30:.1f} GiB)")
    return left


def gpu_hit_rate(on_gpu: list[list[bool]], popularity: list[list[int]]) -> float:
    """Expected share of expert selections served by GPU-resident experts."""
    total = sum(sum(row) for row in popularity)
    hits = sum(c for flags, row in zip(on_gpu, popularity) for flag, c in zip(flags, row) if flag)
    return hits / total if total else 0.0


@dataclass(frozen=True)
class Costs:
    """Latency model in ms: CPU compute of one expert on n tokens, GPU compute, one expert's copy."""

    cpu_ms: Callable[[int], float]
    gpu_ms: Callable[[int], float]
    copy_ms: float


def finish_times(cpu: list[int], copy: list[int], loads: dict[int, int], costs: Costs) -> tuple[float, float]:
    """When the CPU queue and the copy+GPU pipeline end, both starting now.

    CPU experts run one after another on the whole pool. Copies are sequential on the link; the
    GPU computes a copied expert as soon as its copy lands and the previous one is done.
    """
    cpu_end = sum(costs.cpu_ms(loads[e]) for e in cpu)
    link = gpu = 0.0
    for e in copy:
        link += costs.copy_ms
        gpu = max(gpu, link) + costs.gpu_ms(loads[e])
    return cpu_end, gpu


def assign_offloaded(loads: dict[int, int], costs: Costs) -> tuple[list[int], list[int]]:
    """Split offloaded experts with tokens into (run on CPU, copy to GPU) to minimise the later finish.

    A copy costs the same whatever the load, while CPU cost grows with it, so the experts worth
    copying are the most loaded: sort by load, try every split point, keep the best. This is exact
    when GPU compute does not grow with the load (decode-sized loads on a GPU); otherwise a
    close approximation (tests compare it with brute force).
    """
    ranked = sorted(loads, key=lambda e: (-loads[e], e))
    best = None
    for k in range(len(ranked) + 1):
        copy, cpu = ranked[:k], ranked[k:]
        makespan = max(finish_times(cpu, copy, loads, costs))
        if best is None or makespan < best[0] - 1e-12:
            best = (makespan, sorted(cpu), sorted(copy))
    return best[1], best[2]


def fiddler_rule(loads: dict[int, int], costs: Costs) -> tuple[list[int], list[int]]:
    """Fiddler's per-expert rule, for comparison: copy when CPU compute is slower than copy + GPU compute."""
    copy = sorted(e for e, n in loads.items() if costs.cpu_ms(n) > costs.gpu_ms(n) + costs.copy_ms)
    return sorted(set(loads) - set(copy)), copy
