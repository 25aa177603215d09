"""Placement, a pure decision made once at load time: which experts live on the GPU.

No tensors and no devices here, so every rule is unit-tested on hand-made numbers. Non-expert weights first,
then experts in order of measured popularity until the GPU budget is spent (Fiddler), or whole layers first
where the measured costs say a layer that never involves the host saves more than popularity order would.
Where each offloaded expert runs at every step is engine.offload.assignment's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moedesk.engine.errors import MoedeskError
from moedesk.engine.offload.assignment import cpu_call_ms, lone_token_saving_ms

_EPS = 1e-12


class BudgetError(MoedeskError):
    """The GPU budget cannot even hold the weights that must live there."""


@dataclass(frozen=True, eq=False)
class Placement:
    """Which experts are resident on the GPU, and what that costs in GPU memory."""

    on_gpu: np.ndarray  # bool [layers, experts], read-only
    expert_bytes: int
    non_expert_bytes: int
    reserve_bytes: int
    budget_bytes: int

    @property
    def experts_on_gpu(self) -> int:
        return int(self.on_gpu.sum())

    @property
    def experts_room(self) -> int:
        """How many experts the budget holds beside what comes first: more than `experts_on_gpu` where the plan left
        room free because layers with nothing resident run faster (`_whole_layer_plans`)."""
        left = max(self.budget_bytes - self.non_expert_bytes - self.reserve_bytes, 0)
        return min(left // self.expert_bytes, self.on_gpu.size)

    @property
    def expert_bytes_used(self) -> int:
        return self.experts_on_gpu * self.expert_bytes

    @property
    def bytes_used(self) -> int:
        """GPU bytes taken: non-expert weights, the reserve (cache, activations) and resident experts."""
        return self.non_expert_bytes + self.reserve_bytes + self.expert_bytes_used

    def gpu_hit_rate(self, popularity) -> float:
        """Expected share of expert selections served by GPU-resident experts, if spread like `popularity`."""
        counts = np.asarray(popularity, dtype=float)
        if counts.shape != self.on_gpu.shape:
            raise ValueError(f"popularity has shape {counts.shape}, the placement {self.on_gpu.shape}")
        total = counts.sum()
        return float(counts[self.on_gpu].sum() / total) if total > 0 else 0.0

    def as_lists(self) -> list[list[bool]]:
        """on_gpu[layer][expert] as plain lists (what `OffloadExecutor.set_placement` and JSON take)."""
        return self.on_gpu.tolist()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_placement(expert_bytes: int, num_layers: int, num_experts: int, popularity, budget_bytes: int,
                   non_expert_bytes: int, reserve_bytes: int = 0, layer_costs: "LayerCosts | None" = None,
                   top_k: int = 1) -> Placement:
    """The most popular experts on the GPU, one by one across all layers, until the budget is spent.

    budget_bytes is the whole GPU budget. Non-expert weights (attention, norms, router,
    embeddings) and the reserve (KV cache, activations, staging) come first: every token
    needs them. Experts are ranked per expert, not per layer: a popular expert of any layer
    beats an unpopular one of another. All experts have the same size, so taking them by
    descending count maximises the expected hit rate for that many bytes. Ties break by
    (layer, expert), so the plan is deterministic. Experts never selected still fill leftover
    budget: they cost nothing there and may be picked by other prompts.

    With `layer_costs` (and the model's experts per token, top_k), the same bytes may instead go
    to whole layers first, the busiest ones, and the rest by popularity: a layer with every expert
    resident never involves the host, which saves its fixed costs; what whole layers leave over may go
    by popularity, into one more layer, or nowhere (`_whole_layer_plans`). The plan with the lowest
    `step_cost_ms` wins; popularity alone wins ties. Routing that favours a few experts keeps
    popularity order; routing spread evenly gets whole layers. The prediction is only as good as
    `popularity` is a sample of the routing to come.
    """
    counts = np.asarray(popularity, dtype=float)
    if counts.shape != (num_layers, num_experts):
        raise ValueError(f"popularity has shape {counts.shape}, expected ({num_layers}, {num_experts})")
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise ValueError("popularity counts must be finite and >= 0")
    if expert_bytes <= 0:
        raise ValueError("expert_bytes must be > 0")
    fixed = non_expert_bytes + reserve_bytes
    if fixed > budget_bytes:
        raise BudgetError(f"GPU budget {_gib(budget_bytes)} cannot hold the non-expert weights "
                          f"({_gib(non_expert_bytes)}) and the reserve for cache and activations "
                          f"({_gib(reserve_bytes)}); raise --gpu-budget")
    fits = min((budget_bytes - fixed) // expert_bytes, num_layers * num_experts)
    on_gpu = _most_popular(counts, fits)
    if layer_costs is not None:
        best = step_cost_ms(on_gpu, counts, top_k, layer_costs)
        for candidate in _whole_layer_plans(counts, fits, layer_costs.lone_split_saving_ms > 0):
            cost = step_cost_ms(candidate, counts, top_k, layer_costs)
            if cost < best - _EPS:
                on_gpu, best = candidate, cost
    on_gpu.flags.writeable = False
    return Placement(on_gpu, int(expert_bytes), int(non_expert_bytes), int(reserve_bytes), int(budget_bytes))


def _whole_layers(counts: np.ndarray, full: int) -> tuple[np.ndarray, np.ndarray]:
    """The `full` busiest layers resident, and the counts with those layers ranked below every other expert."""
    layers = np.argsort(-counts.sum(axis=1), kind="stable")[:full]
    on_gpu = np.zeros(counts.shape, dtype=bool)
    on_gpu[layers] = True
    rest = counts.copy()
    rest[layers] = -1
    return on_gpu, rest


def _whole_layer_plans(counts: np.ndarray, fits: int, split: bool):
    """plan_placement's candidates beside popularity order, for `step_cost_ms` to choose from: 1 to all the whole
    layers that fit, the busiest first (a layer with every expert resident never waits for the host), the rest of the
    budget by popularity over the other layers. Where a lone token's layer is split with the GPU's zero-copy reads
    (`split`), which runs only in layers with nothing resident, so that a few resident experts in every other layer
    can cost more than they save (`LayerCosts.lone_split_saving_ms`): the most whole layers with the rest packed into
    the next busiest layer, or left unused."""
    per_layer = counts.shape[1]
    most = fits // per_layer
    for full in range(1, most + 1):
        candidate, rest = _whole_layers(counts, full)
        yield candidate | _most_popular(rest, fits - full * per_layer)
    left = fits - most * per_layer
    if split and left and most < counts.shape[0]:
        whole, rest = _whole_layers(counts, most)
        yield whole
        packed = whole.copy()
        nxt = int(np.argsort(-rest.sum(axis=1), kind="stable")[0])
        packed[nxt, np.argsort(-counts[nxt], kind="stable")[:left]] = True
        yield packed


def _most_popular(counts: np.ndarray, fits: int) -> np.ndarray:
    # Stable sort of row-major flat indices by descending count: ties stay in (layer, expert) order.
    order = np.argsort(-counts.ravel(), kind="stable")[:fits]
    on_gpu = np.zeros(counts.size, dtype=bool)
    on_gpu[order] = True
    return on_gpu.reshape(counts.shape)


@dataclass(frozen=True)
class LayerCosts:
    """What a decode step's MoE layer costs the host once the CPU takes part in it, in ms per token.

    A layer whose experts are all resident runs inside the GPU's CUDA graphs (engine.generation.cuda_graphs)
    and costs none of this where the executor can run it from device tensors alone
    (`whole_layer_skips_host`); any other layer pays the round trip of its routing and outputs, the CPU call
    and its offloaded experts' CPU work, and the host's queueing of its resident experts when it has any, unless
    the decode graph hands the layer over (`handed_over`, kernels.host_handoff): then the graph launches them.
    """

    roundtrip_ms: float  # routing to the host and expert outputs back
    resident_launch_ms: float  # the host queueing a layer step's resident experts
    cpu_expert_ms: float  # one offloaded expert's share of the CPU's call, one token
    whole_layer_skips_host: bool = True  # False: a fully resident layer still pays the round trip and launch
    cpu_call_ms: float = 0.0  # the CPU call's own cost, once a layer with offloaded experts
    handed_over: bool = False  # a partly resident layer's resident experts launched by the decode graph
    lone_split_saving_ms: float = 0.0  # a layer with nothing resident, its lone token shared with the GPU's zero-copy

    @classmethod
    def from_model(cls, costs, whole_layer_skips_host: bool = True, handed_over: bool = False,
                   splits_lone_tokens: bool = False) -> "LayerCosts":
        """From an engine.offload.latency_model.LatencyModel: its one-token figures. splits_lone_tokens: the executor
        shares a lone token's layer with nothing resident with the GPU reading from RAM (its `splits_lone_tokens`)."""
        saving = lone_token_saving_ms(costs) if splits_lone_tokens else 0.0
        return cls(costs.activation_roundtrip_ms(1), costs.resident_launch_ms, costs.cpu_expert_ms(1),
                   whole_layer_skips_host, cpu_call_ms(costs, 1), handed_over, saving)


def step_cost_ms(on_gpu: np.ndarray, popularity: np.ndarray, top_k: int, costs: LayerCosts) -> float:
    """Predicted host-side ms per decoded token of a placement, for tokens routed like `popularity`
    (a layer without counts: every expert equally likely)."""
    total = 0.0
    for resident, counts in zip(on_gpu, popularity):
        if resident.all():
            if not costs.whole_layer_skips_host:
                total += costs.roundtrip_ms + costs.resident_launch_ms
            continue
        mass = counts.sum()
        offloaded = counts[~resident].sum() / mass if mass > 0 else (~resident).mean()
        total += costs.roundtrip_ms + costs.cpu_call_ms + top_k * offloaded * costs.cpu_expert_ms
        if not resident.any():
            total -= costs.lone_split_saving_ms
        elif not costs.handed_over:
            total += costs.resident_launch_ms
    return total
