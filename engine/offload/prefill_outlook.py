"""A whole prefill's time predicted from its layers' routing: pure arithmetic over the latency model, no tensors.

A prefill runs its MoE layers one after another. Each waits for its routing, splits its offloaded experts between the
CPU's call and the copies (`assign_offloaded`, as the executor decides it), and ends when the later of the two sides
does: the CPU's call, or the GPU's side (its resident experts, then the copies through the link and their compute).
What the split cannot move (the token mixers, the wait for the routing, the host's bookkeeping) is `fixed_ms`, taken
from a measurement. The link is busy only inside each layer's window, which is why the bench's bound (every offloaded
expert copied back to back, `link_bound_ms`) can sit far from a layer-by-layer prefill.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from moedesk.engine.offload.assignment import (GROUPED_COPIES_MIN_LOAD, Contended, assign_offloaded, cpu_path_ms,
                                               finish_times, mean_load, resident_grouped)


@dataclass(frozen=True)
class LayerOutlook:
    """One MoE layer's expert work in ms from its routing on: the CPU's call and the GPU's side run at once."""

    cpu_ms: float  # the CPU's call: its experts' shares and its own cost, slowed by the copies beside it
    gpu_ms: float  # when the GPU's side ends: resident experts, then the copies' pipeline and compute
    link_ms: float  # the copies on the link
    cpu_experts: int
    copies: int
    ahead_link_ms: float = 0.0  # copies of this layer's experts made during the layer before (`prefetch_ahead`)

    @property
    def window_ms(self) -> float:
        """The layer's expert window: the later of the CPU's call and the GPU's side."""
        return max(self.cpu_ms, self.gpu_ms)


@dataclass(frozen=True)
class PrefillOutlook:
    """A prefill of `tokens` tokens: its MoE layers' outlooks and the time no split moves (`fixed_ms`, the whole
    prefill's)."""

    tokens: int
    layers: tuple[LayerOutlook, ...]
    fixed_ms: float

    @property
    def cpu_ms(self) -> float:
        return sum(x.cpu_ms for x in self.layers)

    @property
    def link_ms(self) -> float:
        """The link's time on copies, those made a layer ahead included."""
        return sum(x.link_ms + x.ahead_link_ms for x in self.layers)

    @property
    def gpu_ms(self) -> float:
        return sum(x.gpu_ms for x in self.layers)

    @property
    def expert_ms(self) -> float:
        """The layers' expert windows end to end (`LayerOutlook.window_ms`)."""
        return sum(x.window_ms for x in self.layers)

    @property
    def overlap_ms(self) -> float:
        """Time the CPU's call and the GPU's side ran at once: the earlier side of each layer."""
        return sum(min(x.cpu_ms, x.gpu_ms) for x in self.layers)

    @property
    def total_ms(self) -> float:
        return self.fixed_ms + self.expert_ms

    @property
    def tok_s(self) -> float:
        return 1e3 * self.tokens / self.total_ms if self.total_ms > 0 else float("inf")

    @property
    def link_busy(self) -> float:
        """The share of the prefill the link spends copying experts."""
        return self.link_ms / self.total_ms if self.total_ms > 0 else 0.0

    def counts(self) -> tuple[int, int]:
        """(experts on the CPU, experts copied) over the prefill."""
        return sum(x.cpu_experts for x in self.layers), sum(x.copies for x in self.layers)


def layer_outlook(offloaded: dict[int, int], model, resident_ms: float = 0.0, overlap: bool = True,
                  grouped_copies: bool = True, ahead: Iterable[int] = ()) -> LayerOutlook:
    """One layer: the split the executor makes (`assign_offloaded`, which is not told `resident_ms`), priced with the
    GPU busy `resident_ms` first on its resident experts, as the executor queues them before the copies' compute.

    offloaded: expert id -> tokens of the layer's experts in RAM; overlap and grouped_copies as the executor runs
    (ExpertOrchestra.start's defaults on a GPU). ahead: experts copied during the layer before (`prefetch_ahead`):
    the GPU computes them with the resident ones (one grouped launch), the split sees the rest; each took the link,
    whether this layer routes it a token or not."""
    ahead = set(ahead)
    ahead_link_ms = len(ahead) * model.copy_expert_ms
    landed = [offloaded[e] for e in ahead if offloaded.get(e, 0) > 0]
    resident_ms += model.gpu_expert_ms(sum(landed)) if landed else 0.0
    active = {e: n for e, n in offloaded.items() if n > 0 and e not in ahead}
    if not active:
        return LayerOutlook(0.0, resident_ms, 0.0, 0, 0, ahead_link_ms)
    split = assign_offloaded(active, model, overlap=overlap, grouped_copies=grouped_copies)
    grouped = grouped_copies and mean_load(active) >= GROUPED_COPIES_MIN_LOAD
    # Both sides at work: the contention the split priced; one side alone: none (assign_offloaded's `alone`).
    both = bool(split.cpu) and bool(split.copy)
    priced = Contended(model, mean_load(active), apart=not both, overlap=overlap, grouped_copies=grouped)
    cpu, gpu = finish_times(active, list(split.copy), priced, gpu_busy_ms=resident_ms)
    return LayerOutlook(cpu, gpu, len(split.copy) * priced.copy_expert_ms, len(split.cpu), len(split.copy),
                        ahead_link_ms)


def prefetch_ahead(expected: dict[int, float], model, link_free_ms: float, slots: int) -> list[int]:
    """The next layer's offloaded experts to copy during this layer of a prefill: the dearest on the CPU at their
    expected loads first, as many as the link's free time in this layer and the free staging slots hold.

    expected: expert id -> the tokens it expects in the next layer (its calibrated popularity's share of the prefill's
    selections). The link idles while a layer's mixer, routing and host work run (`PrefillOutlook.link_busy`), so a copy
    made then costs the next layer only its compute; one whose expert gets no token costs nothing but the link.
    link_free_ms = inf: the slots alone bound it (the executor's plan, which cannot know a layer's free time ahead)."""
    link = model.copy_expert_ms
    fits = slots if link <= 0 or math.isinf(link_free_ms) else min(slots, int(link_free_ms // link))
    order = sorted((e for e, n in expected.items() if n > 0),
                   key=lambda e: (-cpu_path_ms(max(1, round(expected[e])), model), e))
    return order[:max(0, fits)]


def expected_loads(share: Sequence[float], offloaded: Sequence[bool], tokens: int, top_k: int) -> dict[int, float]:
    """A layer's offloaded experts' expected tokens in a step of `tokens` tokens (`prefetch_ahead`'s `expected`):
    each expert's share of the step's selections by its calibrated popularity `share`."""
    total = sum(share) or 1.0
    return {e: tokens * top_k * p / total for e, p in enumerate(share) if offloaded[e]}


def prefill_step(tokens: int, top_k: int, experts: int) -> bool:
    """Whether a step routes enough tokens an expert to copy ahead for (as copy runs start to pay,
    GROUPED_COPIES_MIN_LOAD): a decode step's few tokens would take the link for experts it mostly never routes."""
    return tokens * top_k >= GROUPED_COPIES_MIN_LOAD * experts


def prefill_outlook(layers: Sequence[tuple[dict[int, int], float]], model, tokens: int, fixed_ms: float,
                    **split) -> PrefillOutlook:
    """A prefill from each MoE layer's (offloaded loads, resident GPU ms); `split`: layer_outlook's options."""
    return PrefillOutlook(tokens, tuple(layer_outlook(loads, model, resident, **split) for loads, resident in layers),
                          fixed_ms)


def prefill_outlook_ahead(layers: Sequence[tuple[dict[int, int], float]], expected: Sequence[dict[int, float]], model,
                          tokens: int, fixed_ms: float, slots: int, **split) -> PrefillOutlook:
    """The same prefill with each layer's copies for the next one made during it (`prefetch_ahead`, from `expected`,
    one dict a layer): the link's free time in a layer is its share of `fixed_ms` and its window, less its own
    copies; its free slots are the `slots` of the staging its own copies leave (as OffloadExecutor.copy_ahead_with
    runs it); the first layer gets nothing ahead."""
    fixed_a_layer = fixed_ms / len(layers) if layers else 0.0
    done, ahead = [], []
    for i, (loads, resident) in enumerate(layers):
        layer = layer_outlook(loads, model, resident, ahead=ahead, **split)
        done.append(layer)
        if i + 1 < len(layers):
            free = fixed_a_layer + layer.window_ms - layer.link_ms
            ahead = prefetch_ahead(expected[i + 1], model, free, max(0, slots - layer.copies))
    return PrefillOutlook(tokens, tuple(done), fixed_ms)


def resident_gpu_ms(loads: Iterable[int], model, grouped_max: int, shape: tuple[int, int] | None = None) -> float:
    """The GPU's time on a layer's resident experts (tokens `loads`, one a resident slot), queued as the executor
    queues them: one grouped launch (priced as one expert of them all) while none has more than `grouped_max` tokens,
    or at any load where the experts of `shape` (H, F) are small (`resident_grouped`); else one GEMM an expert."""
    loads = list(loads)
    active = [n for n in loads if n > 0]
    if not active:
        return 0.0
    grouped = (max(active) <= grouped_max if shape is None
               else resident_grouped(loads, *shape, grouped_max=grouped_max))
    if grouped:
        return model.gpu_expert_ms(sum(active))
    return sum(model.gpu_expert_ms(n) for n in active)


def link_bound_ms(experts: int, copy_ms: float) -> float:
    """The bench's bound (bench.synthetic.traffic_bound at prefill): every offloaded expert the prefill touched
    copied back to back, nothing else costing time."""
    return experts * copy_ms


def shared_bound_ms(loads: Iterable[int], model) -> float:
    """A lower bound on the offloaded experts' time when the CPU and the link share them over the whole prefill, with
    no layer boundaries, no contention and no fixed cost: the fractional split that minimises max(CPU, link).

    loads: tokens of every offloaded expert the prefill touched, over all layers. Moving an expert off the CPU saves
    its CPU time and costs one copy, so the experts dearest on the CPU go to the link first (a fractional knapsack);
    the sides meet inside the first expert that would cross."""
    link_ms = model.copy_expert_ms
    cpu = sorted((cpu_path_ms(n, model) for n in loads if n > 0), reverse=True)
    cpu_left, link = sum(cpu), 0.0
    for c in cpu:
        if cpu_left <= link:
            break
        if cpu_left - c > link + link_ms:
            cpu_left, link = cpu_left - c, link + link_ms
        else:  # part of this expert on each side: they end together
            return cpu_left - (cpu_left - link) / (c + link_ms) * c
    return max(cpu_left, link)


def fixed_ms_for(tok_s: float, tokens: int, expert_ms: float) -> float:
    """The most time outside the experts' windows a prefill may take and still run at `tok_s`, given its expert
    windows take `expert_ms` (negative: the target is out of reach even with nothing else)."""
    return 1e3 * tokens / tok_s - expert_ms
