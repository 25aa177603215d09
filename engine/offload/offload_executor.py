"""Experts split between GPU memory and (pinned) CPU memory, and the executor that runs them.

Every expert lives in host memory, stacked per layer ([E, 2F, H] gate+up, [E, H, F] down),
pinned when a GPU exists so that copies run at full PCIe speed. The experts a placement puts
on the GPU are copied there once. For each layer step the executor runs resident experts on
the GPU, and for each offloaded expert with tokens either computes it on the CPU or copies it
into a GPU staging slot and computes it there, as `decide` says; CPU work runs while the GPU
works. All of a layer's CPU experts go to `kernels.cpu_experts` in one call: one parallel
region streams their weights, where torch would run one small matmul after another. Each
(token, expert) pair's output lands in one row of the result wherever it was computed, and
the model sums them in ascending expert order (`MoE.combine`), so the result does not depend
on the placement beyond each expert's own arithmetic. The per-layer bookkeeping runs in
numpy on the host: it sits between the GPU's segments of every decode step, so its
microseconds add up across layers. A layer whose experts are all resident needs none of it:
`device_expert_outputs` runs it from device tensors alone, which CUDA graphs capture.

With `device` = cpu the "GPU" tier is simulated on the CPU: placement, decisions, staging
copies and the ordered sum all run for real, which is how CI tests them without a GPU.
"""
from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from functools import cached_property, partial
from typing import Callable

import numpy as np
import torch

from moedesk.engine.offload.assignment import copy_run_limit, resident_grouped
from moedesk.engine.offload.expert_executor import HostRouting
from moedesk.engine.offload.expert_cache import CachePolicy, ExpertCache, SwapPrice
from moedesk.kernels import gpu_fused, gpu_zero_copy
from moedesk.kernels.cpu_experts import call_beside_caller
from moedesk.kernels.host_handoff import handoff_wanted
from moedesk.kernels.expert_weights import ExpertWeights
from moedesk.kernels.experts import (expert_forward, experts_forward_routed, grouped_alike, grouped_experts_forward,
                                     grouped_pairs_forward, grouped_supported, prepare_routed)

# Above this many tokens on one resident expert, cuBLAS GEMMs per expert beat a grouped launch's savings on large
# experts (EPS-MoE); below it, launches dominate. Small experts stay grouped above it too (`resident_grouped`).
GROUPED_MAX_TOKENS = 64

__all__ = ["OffloadExecutor", "stack_experts"]


@dataclass
class LayerBank:
    host: ExpertWeights  # every expert of the layer, in host memory
    gpu_slot: list  # expert -> its index in `gpu`, or None when offloaded
    gpu: ExpertWeights | None = None  # the resident experts, in ascending id order
    # gpu's slots as one-expert stacks, made once: a view costs the host its checks in every prefill layer
    slot_views: list = field(default_factory=list)


@dataclass
class StepStats:
    """Counts and host-side times of the expert work, summed over the layers of the steps seen."""

    gpu_experts: int = 0  # resident on the GPU, computed there
    copied_experts: int = 0  # copied over PCIe, computed on the GPU
    cpu_experts: int = 0  # computed on the CPU
    zero_copy_experts: int = 0  # computed on the GPU from their pinned host copies, read over PCIe as it ran
    split_experts: int = 0  # of the CPU's, those whose last rows the GPU computed from their pinned host copies
    cpu_ms: float = 0.0
    wait_ms: float = 0.0  # blocked on the GPU for the routing (the attention and router work before it)
    # From the routing to the CPU's call: deciding the split, the CPU's tokens to the host, queueing the GPU's share
    # (where the call runs on its worker beside the queueing, `overlap_copies`, the two overlap)
    queue_ms: float = 0.0
    layer_ms: float = 0.0
    selections: int = 0  # (token, expert) pairs routed
    gpu_hits: int = 0  # of those, served by a resident expert
    swaps: int = 0  # experts the expert cache moved onto the GPU in place of others
    ahead_copied: int = 0  # experts copied during the layer before theirs (`copy_ahead`)
    ahead_used: int = 0  # of those, computed from their copy (their layer routed them a token)

    def since(self, earlier: "StepStats") -> "StepStats":
        """What was counted between `earlier` (a copy taken then) and now."""
        return StepStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def copy(self) -> "StepStats":
        return replace(self)

    def __add__(self, other: "StepStats") -> "StepStats":
        """Both counts together (the executors of several devices, one model's)."""
        return StepStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict:
        total = self.gpu_experts + self.copied_experts + self.cpu_experts + self.zero_copy_experts
        return {
            "experts_gpu": self.gpu_experts, "experts_copied": self.copied_experts, "experts_cpu": self.cpu_experts,
            "experts_zero_copy": self.zero_copy_experts, "experts_split": self.split_experts,
            "gpu_hit_rate": round(self.gpu_hits / self.selections, 4) if self.selections else None,
            "cpu_expert_ms": round(self.cpu_ms, 3), "gpu_wait_ms": round(self.wait_ms, 3),
            "queue_ms": round(self.queue_ms, 3), "moe_ms": round(self.layer_ms, 3), "active_experts": total,
            "expert_swaps": self.swaps, "experts_copied_ahead": self.ahead_copied,
            "experts_ahead_used": self.ahead_used,
        }


class _Background:
    """fn() on one long-lived worker thread (a thread started per call costs more than a decode step's share of it),
    in the caller's inference and grad modes (torch keeps them per thread); `join` waits for it and raises what it
    raised."""

    _worker: ThreadPoolExecutor | None = None

    def __init__(self, fn):
        if _Background._worker is None:
            _Background._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moedesk-cpu-experts")
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        self.seconds = 0.0  # fn's own time, once joined
        self.future = _Background._worker.submit(self._run, fn, modes)

    def _run(self, fn, modes) -> None:
        inference, grad = modes
        started = time.perf_counter()
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                fn()
        finally:
            self.seconds = time.perf_counter() - started

    def join(self) -> None:
        self.future.result()  # raises what fn raised


@contextlib.contextmanager
def _nothing():
    yield


def stack_experts(model, pinned: bool) -> dict[int, ExpertWeights]:
    """Banks for a model whose experts are already loaded: the layers' stacks copied to host memory."""
    banks = {}
    for moe in model.moe_blocks():
        host = moe.experts.empty_like("cpu")
        if pinned:
            host = host.pin_memory()
        banks[moe.layer] = host.copy_(moe.experts)
    return banks


def queue_copy(cuda_stream, expert: ExpertWeights, staging: ExpertWeights, after=None):
    """Queue one expert's host-to-GPU copy on `cuda_stream` (after the event `after`), its bytes as stored (a
    packed expert crosses PCIe packed); the event that marks it done."""
    with torch.cuda.stream(cuda_stream):
        if after is not None:
            cuda_stream.wait_event(after)
        staging.copy_(expert, non_blocking=True)
        return cuda_stream.record_event()


def compute_copied(xs, staging: ExpertWeights, ready=None):
    """A copied expert's output for its tokens xs once its copy (event `ready`) landed, and the event after
    which its staging slot may be overwritten (None on the simulated tier, where everything is synchronous)."""
    if ready is None:
        return expert_forward(xs, staging), None
    current = torch.cuda.current_stream(xs.device)
    current.wait_event(ready)
    out = expert_forward(xs, staging)
    return out, current.record_event()


def _gathers_cpu_share(cpu_pairs: int, tokens: int) -> bool:
    """Whether the CPU is handed its pairs' tokens alone rather than every token: when its pairs are fewer than the
    tokens (a prefill layer whose CPU takes a few light experts moves a few rows to the host and back, not the whole
    activations and every pair's result). Asked only where the activations are not on the host already: a captured
    step's lone token (its zero-copy and split-row shares included) comes with them."""
    return cpu_pairs < tokens


class _Pairs:
    """A step's (token, rank) pairs grouped by expert: `order` lists pair indices (token * K + rank),
    ascending by expert; `count[e]` is expert e's number of pairs, `active` the experts with any."""

    def __init__(self, pair_expert: np.ndarray, counts: np.ndarray):
        """counts: np.bincount of pair_expert over all experts."""
        self.experts = pair_expert
        self.order = np.argsort(pair_expert, kind="stable")
        self.expert_of_order = pair_expert[self.order]
        self.counts, self.count = counts, counts.tolist()
        self.active = np.flatnonzero(counts).tolist()

    @cached_property
    def start(self) -> list[int]:
        """Where each expert's pairs begin in `order` (only copied experts ask, one at a time)."""
        return (np.cumsum(self.counts) - self.counts).tolist()

    def of(self, experts: list[int]) -> np.ndarray:
        """Pair indices of distinct active `experts`, grouped expert by expert in ascending id."""
        if len(experts) == len(self.active):
            return self.order
        if len(experts) == 1:
            start = self.start[experts[0]]
            return self.order[start:start + self.count[experts[0]]]
        chosen = np.zeros(len(self.count), dtype=bool)
        chosen[experts] = True
        return self.order[chosen[self.expert_of_order]]


def _grouped_pairs(x, slots, gpu: ExpertWeights, tally=None):
    """Row p of the result: token p // K through resident slot slots.view(-1)[p] (slots [N, K]), from device
    tensors alone, in one grouped launch. tally [2, slots of gpu], where given, gains each slot's pairs and, where
    it has any, a step."""
    order, rows, ends, active = _arrange(slots.view(-1), gpu.num_experts, slots.shape[1], tally)
    return grouped_pairs_forward(x, gpu, rows, order, ends, active)


def _arrange(keys, groups: int, k: int, tally=None):
    """kernels.gpu_fused.group_pairs, by torch's ops where that kernel does not apply (and then no list of the
    groups with pairs: None)."""
    if keys.is_cuda and gpu_fused.wanted() and gpu_fused.group_fits(keys.numel(), groups):
        return gpu_fused.group_pairs(keys, groups, k, tally)
    order = torch.argsort(keys, stable=True)
    counts = torch.zeros(groups, dtype=torch.int64, device=keys.device).scatter_add_(0, keys, torch.ones_like(keys))
    if tally is not None:
        tally[0] += counts
        tally[1] += counts > 0
    return order, order // k, counts.cumsum(0).to(torch.int32), None


class OffloadExecutor:
    """Runs each layer's experts where a placement and a per-step decision say."""

    def __init__(self, banks: dict, on_gpu, device, decide, staging_slots: int | None = None, resident_to_cpu=None,
                 zero_copy_ranks=None, split_width=None, selections: dict | None = None, overlap_copies: bool = False,
                 copy_runs: Callable[[dict, list[int]], list[int] | None] | None = None):
        """banks: layer -> ExpertWeights in host memory; on_gpu[i][expert]: resident on the GPU (i-th MoE layer);
        decide(loads: {expert: tokens}) -> (cpu experts, experts to copy);
        resident_to_cpu(loads of the resident experts) -> those the CPU should compute from their host copies
        this step, asked only when the CPU computes experts of the layer anyway (None: never);
        zero_copy_ranks(top_k) -> how many of a lone token's experts the GPU should read from RAM itself while
        the CPU computes the others (`zero_copy_share`; None: never);
        split_width(top_k) -> how many of the last intermediate rows of a lone token's every expert the GPU should
        compute from RAM while the CPU computes the first ones (`width_split`; None: never);
        selections: the dict its counts go to (`selections`), shared by the executors of one model's devices;
        overlap_copies: a step's CPU call runs on a thread of its own while this one queues the step's copies (as
        `decide` must then price it: engine.offload.assignment.assign_offloaded's overlap), else after them;
        copy_runs(loads of the offloaded experts, the experts to copy) -> the sizes of the copy runs the copied experts
        are computed in, one grouped launch a run once its copies landed (`_queue_copy_runs`;
        engine.offload.assignment.copy_runs), as `decide` must price them (assign_offloaded's grouped_copies), or None;
        None (or no copy_runs): each copied expert computed on its own, after its own copy."""
        self.device = torch.device(device)
        self.overlap_copies = overlap_copies
        self.copy_runs = copy_runs
        self.decide = decide
        self.resident_to_cpu = resident_to_cpu
        self.zero_copy_ranks = zero_copy_ranks
        self.split_width = split_width
        self.simulated = self.device.type == "cpu"
        self.banks = {layer: LayerBank(w, [None] * w.num_experts) for layer, w in banks.items()}
        self._order = sorted(self.banks)  # the MoE layers in model order, and each one's place in it
        self._position = {layer: i for i, layer in enumerate(self._order)}
        any_bank = next(iter(self.banks.values())).host
        # Whether a layer with every expert resident can run from device tensors alone (one grouped launch).
        probe = torch.empty((0, any_bank.hidden), dtype=any_bank.dense_dtype or torch.bfloat16, device=self.device)
        self.whole_layers_on_device = self.simulated or grouped_supported(probe, any_bank)
        # Whether one-token decode steps may hand partly resident layers over (`host_only`, kernels.host_handoff):
        # the graph then launches their resident experts, not the host. Never where layers spread over devices.
        self.hands_over = not self.simulated and self.whole_layers_on_device and handoff_wanted()
        self._selections: dict[int, torch.Tensor] = {} if selections is None else selections
        # layer -> its `_slots`, made at each placement and rewritten in place by a swap: captured graphs read them
        self._slot_maps: dict[int, tuple] = {}
        self._stats = StepStats()
        self._tallies: dict[int, torch.Tensor] = {}  # layer run on the device alone -> its counts there
        self.placement_version = 0
        self.cache: ExpertCache | None = None  # set by `follow_routing`
        self._unapplied: list = []  # swaps the cache decided during a handed-over step, made by `settle`
        self._step_handed_over = False  # whether the step being counted for the cache was handed over
        self.set_placement(on_gpu)
        slots = staging_slots or any_bank.num_experts
        # One stack, so that a run of slots is one grouped launch's experts; `staging` views its slots one by one.
        self.staging_stack = any_bank.expert(0).empty_like(self.device, experts=slots)
        self.staging = [self.staging_stack.expert(slot) for slot in range(slots)]
        self.copy_stream = None if self.simulated else torch.cuda.Stream(self.device)
        self.slot_free = [None] * slots  # CUDA event: the last compute that read this staging slot
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}
        self._selection_counts: dict[int, tuple] = {}  # layer -> (its `selections` tensor, a numpy view)
        self.copy_ahead: Callable[[int, int, int, float, int], list[int]] | None = None  # set by `copy_ahead_with`
        self._ahead: tuple[int, dict] | None = None  # (layer, expert -> (slot, ready event)) copied ahead for it
        self._layer_start: tuple[int, float] | None = None  # the last host-decided layer and when its call began
        self._last_layer_ms: float | None = None  # `_layer_ms`

    def copy_ahead_with(self, plan: Callable[[int, int, int, float, int], list[int]] | None) -> None:
        """During each host-decided step of a layer, copy experts of the next MoE layer into the staging slots the
        layer's own copies leave (the last ones; no memory beyond the staging), on the copy stream after the layer's
        own copies: the link idles through the mixer and routing between layers (engine.offload.prefill_outlook's
        `prefetch_ahead`, which prices this). plan(next layer, tokens, free slots, layer ms, own copies) -> the experts
        to copy, where layer ms is how long the layer before this one took from call to call on the host (`_layer_ms`;
        the wait for each layer's routing makes it the GPU's layer time too): the link's time in this layer, its own
        copies in it. Nothing is copied ahead before a layer's time was measured once. The next layer computes those it
        routes tokens to from their copies before anything else, and its split sees the rest. None: off."""
        self._ahead = None
        self.copy_ahead = plan

    def _next_layer(self, layer: int) -> int | None:
        i = self._position[layer] + 1
        return self._order[i] if i < len(self._order) else None

    def _layer_ms(self, layer: int, started: float) -> float | None:
        """The host's time the layer before `layer` took, from the last host-decided layer's call to this one's
        (spread over the layers between, run on the device alone); at a step's first layer, the last one measured
        (None before any)."""
        last, self._layer_start = self._layer_start, (layer, started)
        if last is not None and last[0] < layer:
            between = self._position[layer] - self._position[last[0]]
            self._last_layer_ms = (started - last[1]) * 1e3 / between
        return self._last_layer_ms

    def _start_ahead(self, layer: int, tokens: int, own_copies: int, layer_ms: float | None) -> None:
        """Queue the copies `copy_ahead` plans for the MoE layer after `layer` (offloaded experts only) into the last
        staging slots, as many as this layer's `own_copies` leave, each after the kernels that last read its slot."""
        self._ahead = None
        following = self._next_layer(layer)
        free = len(self.staging) - own_copies
        if following is None or free <= 0 or layer_ms is None:
            return
        bank = self.banks[following]
        planned = self.copy_ahead(following, tokens, free, layer_ms, own_copies)
        # The plan's order is its priority: the first that fit, then by id (neighbouring slots, neighbouring ids).
        experts = sorted([e for e in dict.fromkeys(planned) if 0 <= e < len(bank.gpu_slot)
                          and bank.gpu_slot[e] is None][:free])
        if not experts:
            return
        started = {}
        for slot, e in enumerate(experts, start=len(self.staging) - len(experts)):
            if self.simulated:
                self.staging[slot].copy_(bank.host.expert(e))
                started[e] = (slot, None)
            else:
                started[e] = (slot, queue_copy(self.copy_stream, bank.host.expert(e), self.staging[slot],
                                               after=self.slot_free[slot]))
        self._ahead = (following, started)
        self._stats.ahead_copied += len(experts)

    def _landed_ahead(self, layer: int, offloaded: dict) -> dict:
        """The experts copied ahead for `layer` that it routes tokens to (expert -> (slot, ready)), taken out of
        `offloaded`; copies made for another layer (a step that went elsewhere) are dropped, their slots' bytes
        and events left as they are."""
        pending, self._ahead = self._ahead, None
        if pending is None or pending[0] != layer:
            return {}
        landed = {e: where for e, where in pending[1].items() if e in offloaded}
        for e in landed:
            del offloaded[e]
        return landed

    def set_placement(self, on_gpu) -> None:
        """Make exactly the experts marked in on_gpu[layer_index][expert] resident on the device."""
        self._unapplied = []  # swaps into the residency being replaced
        self._fold_tallies()
        self._tallies = {}
        self.placement_version += 1  # CUDA graphs that captured the old resident weights are stale
        for (layer, bank), row in zip(sorted(self.banks.items()), on_gpu):
            resident = [e for e, flag in enumerate(row) if flag]
            bank.gpu, bank.slot_views = None, []  # free the old copies before making new ones
            bank.gpu_slot = [None] * len(row)
            if resident:
                index = torch.tensor(resident)
                bank.gpu = bank.host.select(index).to(self.device)
                bank.slot_views = [bank.gpu.expert(slot) for slot in range(len(resident))]
                for slot, e in enumerate(resident):
                    bank.gpu_slot[e] = slot
                if len(resident) == len(row) and self.whole_layers_on_device:
                    self._tallies[layer] = torch.zeros(2 * len(row), dtype=torch.int64, device=self.device)
        self._refresh_slot_maps()
        if self.cache is not None:
            self.follow_routing(self.cache.policy, self.cache.scores, self.cache.price, self.cache.score_steps)

    def _refresh_slot_maps(self) -> None:
        self._slot_maps = {}
        for layer, bank in self.banks.items():  # here, not at a capture: a graph cannot copy from unpinned memory
            if any(slot is not None for slot in bank.gpu_slot):
                slots, resident, offloaded, ids = self._new_slot_maps(bank.gpu_slot)
                self._slot_maps[layer] = (slots.to(self.device), resident.to(self.device), offloaded, ids)

    def follow_routing(self, policy: CachePolicy | None, scores=None, price: SwapPrice | None = None,
                       score_steps: float | None = None) -> None:
        """Let the resident experts follow the routing (engine.offload.expert_cache): after each step the cache
        may swap experts of layers partly on the GPU, where `price` says a swap pays; None keeps the placement fixed.
        scores and score_steps: an earlier cache's, carried over a new placement."""
        self._unapplied = []  # decided against the residency being replaced
        if policy is None:
            self.cache = None
            return
        self.cache = ExpertCache(np.array(self.on_gpu(), dtype=bool), policy, scores, price, score_steps)
        mixed = [self._order[i] for i in self.cache.mixed_layers]
        self._first_mixed = min(mixed) if mixed else None
        self._step_counts = np.zeros(self.cache.resident.shape, dtype=np.int64)

    def _end_step(self, handed_over: bool = False) -> None:
        """The step whose counts are in `_step_counts` is over: let the cache decide, and make its swaps, unless
        handed_over: counted in a handed-over step (kernels.host_handoff), whose graph is waiting on this thread for
        the layer's flag. Making them there reads the new slot maps onto the device, which waits for that graph: a
        deadlock. They are made by `settle` before the next forward (engine.generation.cuda_graphs)."""
        self._unapplied += self.cache.observe(self._step_counts, in_graph=self._step_handed_over)
        self._step_counts[:] = 0
        if not handed_over:
            self.settle()

    def settle(self) -> None:
        """Make the swaps the cache decided and has not made yet: the copies, then the slot maps rewritten in place
        (`_rewrite_slot_maps`), so that captured graphs and prepared host calls, which read them, stay valid. Called
        between forwards (GraphedDecode.forward) and at an eager step's counting, never inside a handed-over step."""
        swaps, self._unapplied = self._unapplied, []
        if not swaps:
            return
        layers = self._order
        before = {layers[swap.layer]: _layer_kind(self.banks[layers[swap.layer]].gpu_slot) for swap in swaps}
        if not self.simulated:  # the copies read slots the last step's kernels may still be reading
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream) if not self.simulated else _nothing():
            for swap in swaps:
                bank = self.banks[layers[swap.layer]]
                slot = bank.gpu_slot[swap.evict]
                bank.gpu.expert(slot).copy_(bank.host.expert(swap.admit), non_blocking=not self.simulated)
                bank.gpu_slot[swap.evict], bank.gpu_slot[swap.admit] = None, slot
        if not self.simulated:
            # A few experts' bytes every so many steps; the next step's kernels read the new slots.
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self._stats.swaps += len(swaps)
        for layer, kind in before.items():
            if _layer_kind(self.banks[layer].gpu_slot) == kind:
                self._rewrite_slot_maps(layer)
            else:  # not from the cache, whose swaps keep a layer's count: the graphs baked the kind in, capture anew
                self.placement_version += 1
                self._refresh_slot_maps()
                break

    @staticmethod
    def _new_slot_maps(gpu_slot: list) -> tuple:
        """`_slots`' four maps of a layer whose experts sit in `gpu_slot` (expert -> slot or None)."""
        slots = torch.tensor([s or 0 for s in gpu_slot], dtype=torch.int64)
        offloaded = np.array([s is None for s in gpu_slot])
        return slots, torch.from_numpy(~offloaded), offloaded, np.flatnonzero(offloaded).astype(np.int64)

    def _rewrite_slot_maps(self, layer: int) -> None:
        """The layer's slot maps rewritten in place after a swap within it (same count resident): the device's on the
        current stream, after the swap's copies and before the next step's kernels or graph replay read them; the
        host's (which a prepared host call points into: kernels.cpu_quant.prepare_routed) at once, between steps."""
        slots, resident, offloaded, ids = self._slot_maps[layer]
        new = self._new_slot_maps(self.banks[layer].gpu_slot)
        for mine, fresh in zip((slots, resident), new):
            if self.simulated:
                mine.copy_(fresh)
            else:  # from pinned memory, which torch keeps until the copy ran
                mine.copy_(fresh.pin_memory(), non_blocking=True)
        offloaded[:], ids[:] = new[2], new[3]

    def on_gpu(self) -> list[list[bool]]:
        return [[s is not None for s in bank.gpu_slot] for _, bank in sorted(self.banks.items())]

    @property
    def stats(self) -> StepStats:
        self._fold_tallies()
        return self._stats

    @stats.setter
    def stats(self, value: StepStats) -> None:
        self._fold_tallies()  # counts so far belong to the stats being replaced
        self._stats = value

    @property
    def selections(self) -> dict[int, torch.Tensor]:
        """layer -> how often each expert was selected (CPU int64 counts): the popularity placement uses."""
        self._fold_tallies()
        return self._selections

    def runs_on_device(self, layer: int) -> bool:
        """Whether `device_expert_outputs` can run this layer: every expert resident, one grouped launch."""
        return layer in self._tallies

    def device_expert_outputs(self, moe, x, ids):
        """`expert_outputs` of a layer whose experts are all resident, from device tensors alone: no wait
        for the routing on the host and no host decision, so CUDA graphs capture it with the layers around
        it (a layer the CPU has no part in then costs no round trip). Counts go to a device tally that is
        folded into `stats` and `selections` when they are read."""
        bank, tally = self.banks[moe.layer], self._tallies[moe.layer]
        # Slot = expert id here; the tally gains each expert's selections, and steps with any.
        return _grouped_pairs(x, ids, bank.gpu, tally.view(2, -1))

    def zero_copy_share(self, layer: int, batch: int, top_k: int) -> int:
        """How many of each token's last ranks a captured decode step has the GPU compute from the experts'
        pinned host copies (`zero_copy_experts`, launched from the routing on the device, so inside the CUDA
        graphs), while the host runs the rest. 0 unless the batch is one token (tokens sharing an expert
        would each read it over PCIe), no expert of the layer is resident (those run on the GPU already),
        and the stacks are pinned and Triton is there."""
        if self.zero_copy_ranks is None or batch != 1 or self.simulated:
            return 0
        bank = self.banks[layer]
        if any(slot is not None for slot in bank.gpu_slot) or not gpu_zero_copy.applies(self.device, bank.host):
            return 0
        return min(top_k, max(0, int(self.zero_copy_ranks(top_k))))

    def width_split(self, layer: int, batch: int, top_k: int) -> int:
        """How many of each expert's first intermediate rows the host computes in a captured decode step whose
        GPU computes the rest from the experts' pinned host copies (`zero_copy_width`, into a partial output the
        step adds); 0: no split. Where `zero_copy_share` applies, and only where it reads no whole expert zero-copy."""
        if self.split_width is None or batch != 1 or self.simulated or self.zero_copy_share(layer, batch, top_k):
            return 0
        bank = self.banks[layer]
        if any(slot is not None for slot in bank.gpu_slot) or not gpu_zero_copy.applies(self.device, bank.host):
            return 0
        cpu_width = bank.host.width - int(self.split_width(top_k))
        if not 0 < cpu_width < bank.host.width or cpu_width % gpu_zero_copy.row_granule(bank.host):
            return 0
        return cpu_width

    def host_only(self, layer: int, batch: int, top_k: int) -> bool:
        """Whether a captured decode step of `batch` tokens may hand this layer to `host_share` without asking
        `expert_outputs`: one token, and the per-step rule computes its offloaded experts on the CPU (with
        `zero_copy_share` or `width_split` as they say), so no host decision depends on the routing and the
        step's graph can run on while the host computes (kernels.host_handoff). Resident experts then run on
        the GPU inside the graph (`device_share`), beside the host's; `resident_to_cpu`, which weighs the host's
        cost of launching them, does not apply there."""
        if batch != 1 or self.simulated:
            return False
        if all(slot is not None for slot in self.banks[layer].gpu_slot):
            return False  # run on the device whole (`runs_on_device`)
        resident = self.has_resident(layer)
        if resident and not self.whole_layers_on_device:
            return False  # no grouped launch for the resident share
        # Every expert of a layer has the same shape, so a decision depends only on how many are offloaded: all
        # of the token's, or with experts resident any number of them.
        return self._cpu_takes_lone_token(1 if resident else top_k, top_k)

    def _cpu_takes_lone_token(self, fewest: int, top_k: int) -> bool:
        """Whether the per-step rule computes one token's offloaded experts on the CPU, whether `fewest` or up to
        all `top_k` of them are offloaded (no copies, no resident expert moved)."""
        for offloaded in range(fewest, top_k + 1):
            on_cpu, to_copy = self.decide({e: 1 for e in range(offloaded)})
            if to_copy or len(on_cpu) != offloaded:
                return False
        return True

    @property
    def splits_lone_tokens(self) -> bool:
        """Whether one-token decode steps share a layer with nothing resident between the host and the GPU reading
        from pinned RAM (`zero_copy_share`, `width_split`, as the profile chose): what the placement prices such a
        layer at (engine.offload.placement.LayerCosts.lone_split_saving_ms)."""
        if self.simulated or (self.zero_copy_ranks is None and self.split_width is None):
            return False
        return all(gpu_zero_copy.applies(self.device, bank.host) for bank in self.banks.values())

    def hands_over_partly_resident(self, top_k: int) -> bool:
        """Whether one-token decode steps hand a partly resident layer over (`host_only`), so that the graph, not
        the host, launches its resident experts: what the placement prices such a layer at."""
        return self.hands_over and self.decide is not None and self._cpu_takes_lone_token(1, top_k)

    def has_resident(self, layer: int) -> bool:
        return layer in self._slot_maps  # `set_placement` maps exactly the layers with resident experts

    def device_share(self, moe, x, ids):
        """The resident experts' part of a `host_only` layer, from device tensors alone (captured with the
        step): (y [N*K, H], mask [N*K]) with y's rows valid where mask is set (the pair's expert resident).
        Pairs of offloaded experts are computed with resident slot 0 and thrown away: at one token that is
        a few rows, cheaper than a launch shaped by the routing."""
        slots, resident, _, _ = self._slots(moe.layer)
        return _grouped_pairs(x, slots[ids], self.banks[moe.layer].gpu), resident[ids.view(-1)]

    def _slots(self, layer: int) -> tuple:
        """(expert -> resident slot, or 0 when offloaded; expert -> resident), on the device for `device_share`;
        expert -> offloaded and the offloaded experts' ids, numpy arrays for `host_share`. The same objects from one
        placement to the next: a swap rewrites their contents (`settle`)."""
        return self._slot_maps[layer]

    def host_share(self, moe, host: HostRouting, out) -> None:
        """The CPU's part of a `host_only` layer of one token: its experts (all but the last `host.zero_copy`
        ranks; every expert's first `host.cpu_width` rows where set) applied to `host.x`, into rows [0, K -
        zero_copy) of the pinned `out`, from the routing the step's graph copied to `host` once `host.ready`
        says it is there."""
        started = time.perf_counter()
        host.ready.synchronize()
        routed = time.perf_counter()
        bank = self.banks[moe.layer]
        pair_expert = host.ids.view(-1)
        k = pair_expert.shape[0]
        index = self._buffer("cpu_index", (2 * k + 2 * len(bank.gpu_slot) + 1,), torch.int64, pinned=False)
        is_offloaded, offloaded = self._slots(moe.layer)[2:] if self.has_resident(moe.layer) else (None, None)
        experts_forward_routed(host.x, pair_expert[:k - host.zero_copy], k, offloaded, bank.host, out, index,
                               rows=host.cpu_width or None)
        self._host_tally(moe.layer, pair_expert.numpy(), host.zero_copy, bool(host.cpu_width), is_offloaded, started,
                         routed)

    def _host_tally(self, layer: int, experts_of: np.ndarray, zero_copy: int, split: bool, is_offloaded, started: float,
                    routed: float) -> None:
        """A host share's counts and times: experts_of the layer's routing, is_offloaded its map where the GPU
        computes the resident experts (None: every expert is the host's or zero-copy)."""
        self._count(layer, np.bincount(experts_of, minlength=len(self.banks[layer].gpu_slot)), handed_over=True)
        s, k = self._stats, len(experts_of)
        on_cpu = k - zero_copy  # a lone token's experts are distinct: its first ranks are the CPU's
        if is_offloaded is not None:
            on_cpu = int(is_offloaded[experts_of].sum())
            s.gpu_experts += k - on_cpu
            s.gpu_hits += k - on_cpu
        s.cpu_experts += on_cpu
        s.zero_copy_experts += zero_copy
        s.split_experts += on_cpu if split else 0
        s.selections += k
        done = time.perf_counter()
        s.wait_ms += (routed - started) * 1e3
        s.cpu_ms += (done - routed) * 1e3
        s.layer_ms += (done - started) * 1e3

    def host_plan(self, moe, host: HostRouting, out) -> Callable[[], None]:
        """`host_share(moe, host, out)` for a captured step that repeats it on the same buffers every step, prepared
        once (kernels.experts.prepare_routed): what is left to do each time is the wait, the kernel's call and the
        counts: about half the Python that host_share spends beside the kernel's call (docs/measurements.md, "The
        offload executor and the pinned banks"). Valid while the placement is (a capture is redone when it changes) and
        across the expert cache's swaps, whose new offloaded ids it reads in place (`_rewrite_slot_maps`)."""
        layer, bank = moe.layer, self.banks[moe.layer]
        pair_expert = host.ids.view(-1)
        k = pair_expert.shape[0]
        index = self._buffer("cpu_index", (2 * k + 2 * len(bank.gpu_slot) + 1,), torch.int64, pinned=False)
        is_offloaded, offloaded = self._slots(layer)[2:] if self.has_resident(layer) else (None, None)
        call = prepare_routed(host.x, pair_expert[:k - host.zero_copy], k, offloaded, bank.host, out, index,
                              rows=host.cpu_width or None)
        if call is None:
            return partial(self.host_share, moe, host, out)
        experts_of, zero_copy, split = pair_expert.numpy(), host.zero_copy, bool(host.cpu_width)

        def run() -> None:
            started = time.perf_counter()
            host.ready.synchronize()
            routed = time.perf_counter()
            call()
            self._host_tally(layer, experts_of, zero_copy, split, is_offloaded, started, routed)

        return run

    def zero_copy_width(self, moe, x, ids, cpu_width: int, out) -> None:
        """Queue the GPU's share of a `width_split` layer: every pair's expert over intermediate rows [cpu_width,
        F), read from pinned RAM, into `out` (float32 [N*K, H]), which the caller adds to the host's rows."""
        gpu_zero_copy.zero_copy_experts(x, ids, 0, self.banks[moe.layer].host, out, first_row=cpu_width)

    def zero_copy_experts(self, moe, x, ids, ranks: int, out) -> None:
        """Queue the GPU's computation of each token's last `ranks` experts into their rows of `out`, reading
        their weights from pinned RAM (kernels.gpu_zero_copy); the host's `expert_outputs` for the same step is
        then given `HostRouting.zero_copy = ranks` and leaves those rows alone."""
        bank = self.banks[moe.layer]
        gpu_zero_copy.zero_copy_experts(x, ids, ids.shape[1] - ranks, bank.host, out)

    def _fold_tallies(self) -> None:
        if not self._tallies:
            return
        host = torch.stack(list(self._tallies.values())).cpu()  # one wait, only when stats or selections are read
        if not host.any():
            return
        for tally in self._tallies.values():
            tally.zero_()
        for layer, row in zip(self._tallies, host.numpy()):
            if not row.any():
                continue
            counts, active = row.reshape(2, -1)
            self._count(layer, counts)
            n = int(counts.sum())
            s = self._stats
            s.selections += n
            s.gpu_hits += n
            s.gpu_experts += int(active.sum())

    def expert_outputs(self, moe, x, ids, out=None, host: HostRouting | None = None):
        """Row t*K + r of the result: expert ids[t, r] applied to x[t] (see engine.executor).

        The host does the bookkeeping of a step in numpy on the routing it fetched (or that CUDA
        graphs copied to pinned memory, `host`), queues the GPU's share, runs the CPU's share in
        one kernel call that writes each result at its pair's row, sends those rows to the device
        in one copy, and scatters the GPU's results over them.
        """
        if host is None and self.runs_on_device(moe.layer) and ids.numel() <= GROUPED_MAX_TOKENS * len(
                self.banks[moe.layer].gpu_slot):
            # Every expert resident and few tokens each (steps outside the graphs): nothing to decide on the
            # host, so no wait for the routing, as in the captured steps. A long prefill still takes the host
            # path: its wait is small beside the work, and one GEMM per expert beat the grouped launch there
            # (tests/perf/bench_gpu_grouped.py; docs/measurements.md, "The offload executor and the pinned banks").
            y = self.device_expert_outputs(moe, x, ids)
            return y if out is None else out.copy_(y)
        started = time.perf_counter()
        layer_ms = self._layer_ms(moe.layer, started) if self.copy_ahead is not None else None
        bank = self.banks[moe.layer]
        if host is None:
            ids_host, x_host = ids.cpu(), None  # the one wait per layer: decisions need the routing
        else:
            if host.ready is not None:
                host.ready.synchronize()
            ids_host, x_host = host.ids, host.x
        routed = time.perf_counter()
        self._stats.wait_ms += (routed - started) * 1e3
        n, k = ids_host.shape
        pair_expert = ids_host.view(-1)
        experts_of = pair_expert.numpy()
        counts = np.bincount(experts_of, minlength=len(bank.gpu_slot))
        self._count(moe.layer, counts)
        count, active = counts.tolist(), counts.nonzero()[0].tolist()
        zero_copy = host.zero_copy if host is not None else 0
        cpu_width = host.cpu_width if host is not None else 0
        if zero_copy:  # the GPU computes the lone token's last ranks (`zero_copy_share`)
            assert n == 1, "zero-copy experts are for a batch of one token"
            on_gpu_already = set(experts_of[k - zero_copy:].tolist())
            active = [e for e in active if e not in on_gpu_already]
        resident = [e for e in active if bank.gpu_slot[e] is not None]
        offloaded = {e: count[e] for e in active if bank.gpu_slot[e] is None}
        ahead = self._landed_ahead(moe.layer, offloaded) if self.copy_ahead is not None and not cpu_width else {}
        if cpu_width:  # the GPU computes the last rows of every expert (`width_split`), the CPU the first ones
            assert n == 1 and not zero_copy and not resident, "split rows are for a lone token, all experts offloaded"
            on_cpu, to_copy = active, []
        else:
            on_cpu, to_copy = self.decide(offloaded) if offloaded else ([], [])
        assert len(to_copy) <= len(self.staging), "more copies than staging slots in one layer"
        if on_cpu and resident and self.resident_to_cpu is not None:
            moved = set(self.resident_to_cpu({e: count[e] for e in resident}))
            if moved:
                on_cpu = [*on_cpu, *moved]
                resident = [e for e in resident if e not in moved]
        pairs = cpu_rows = cpu_rows_on_device = None  # cpu_rows: the CPU's pairs, when it gets their tokens alone
        if on_cpu and x_host is None:
            # Before any GPU work is queued: this copy waits for the stream to drain.
            if _gathers_cpu_share(sum(count[e] for e in on_cpu), n):
                pairs = _Pairs(experts_of, counts)
                rows = pairs.of(sorted(on_cpu))
                # The pairs' rows, their tokens and their experts in one buffer, the first two to the device in one
                # copy: no index arithmetic launched there. Reused next layer: the .cpu() below waits for the copy.
                cpu_rows = self._buffer("cpu_rows", (3, len(rows)), torch.int64, pinned=not self.simulated)
                words = cpu_rows.numpy()
                words[0], words[1], words[2] = rows, rows // k, experts_of[rows]
                cpu_rows_on_device, tokens_on_device = cpu_rows[:2].to(self.device, non_blocking=True)
                x_host = x.index_select(0, tokens_on_device).cpu()
            else:
                x_host = x.cpu()
        if out is None:
            out = torch.empty((n * k, x.shape[1]), dtype=x.dtype, device=self.device)

        cpu_call = background = None
        if on_cpu:
            m = n * k if cpu_rows is None else cpu_rows.shape[1]
            host_y = self._buffer("cpu_out", (m, x.shape[1]), x.dtype, pinned=not self.simulated)
            index = self._buffer("cpu_index", (2 * m + 2 * len(counts) + 1,), torch.int64, pinned=False)
            if cpu_rows is None:
                chosen = None if len(on_cpu) == len(active) and not zero_copy else on_cpu  # None: every pair
                cpu_call = partial(experts_forward_routed, x_host, pair_expert, k, chosen, bank.host, host_y, index,
                                   rows=cpu_width or None)
            else:  # row i: pair cpu_rows[i]'s token (gathered), its expert, one "rank" a row
                cpu_call = partial(experts_forward_routed, x_host, cpu_rows[2], 1, None, bank.host, host_y, index)
            if to_copy and self.overlap_copies:
                # The CPU's call starts now, beside the host's queueing of the copies (the native call lets go of the
                # GIL): a prefill's many copies no longer hold its experts back (engine.offload.assignment's overlap).
                background = _Background(partial(call_beside_caller, cpu_call))  # this thread keeps a core
        # GPU work first: it is queued asynchronously and runs while the CPU computes below.
        try:
            run_sizes = self.copy_runs(offloaded, to_copy) if to_copy and self.copy_runs else None
            gpu = self._queue_gpu(bank, x, k, pairs or _Pairs(experts_of, counts), resident, to_copy, run_sizes,
                                  ahead) if resident or to_copy or ahead else None
            if self.copy_ahead is not None and not zero_copy and not cpu_width:
                # After this layer's copies on the stream, while its CPU call runs and the next layer's mixer does.
                self._start_ahead(moe.layer, n, len(to_copy), layer_ms)
        except BaseException:
            # The worker still writes host_y: a retry's call into the same buffer must not run beside it.
            if background is not None:
                with contextlib.suppress(Exception):
                    background.join()
            raise
        self._stats.queue_ms += (time.perf_counter() - routed) * 1e3
        if on_cpu:
            # cpu_ms: the CPU's call and its copy back, not the queueing of the GPU's share before it
            cpu_started = time.perf_counter()
            if background is not None:
                background.join()
                # The call's own time: its wait in the join is part of it, not time beside it.
                cpu_started = time.perf_counter() - background.seconds
            else:
                cpu_call()
            # One copy back for all CPU experts (not over the zero-copy ranks' rows, last, which the GPU writes). The
            # buffer may be reused once the next layer's routing is in: that wait comes after this copy on
            # the same stream.
            if cpu_rows is not None:
                out.index_copy_(0, cpu_rows_on_device, host_y.to(self.device, non_blocking=True))
            elif zero_copy:
                out[:n * k - zero_copy].copy_(host_y[:n * k - zero_copy], non_blocking=True)
            else:
                out.copy_(host_y, non_blocking=True)
            self._stats.cpu_ms += (time.perf_counter() - cpu_started) * 1e3
        if gpu is not None:
            out.index_copy_(0, *gpu)

        s = self._stats
        s.gpu_experts += len(resident)
        s.copied_experts += len(to_copy) + len(ahead)
        s.ahead_used += len(ahead)
        s.cpu_experts += len(on_cpu)
        s.zero_copy_experts += zero_copy
        s.split_experts += len(on_cpu) if cpu_width else 0
        s.selections += n * k
        s.gpu_hits += sum(count[e] for e in resident)
        s.layer_ms += (time.perf_counter() - started) * 1e3
        return out

    def _queue_gpu(self, bank: LayerBank, x, k: int, pairs: "_Pairs", resident: list[int], to_copy,
                   run_sizes: list[int] | None = None, ahead: dict | None = None) -> tuple:
        """Queue the resident experts (one grouped launch per projection where `resident_grouped` says so: every
        expert at most GROUPED_MAX_TOKENS tokens, as in decode, or small experts; else one GEMM per expert) and the
        copied ones.
        run_sizes: the copied experts computed in copy runs of these sizes (`_queue_copy_runs`), None: one by one.
        ahead: experts copied during the layer before (`_landed_ahead`), computed first (`_compute_ahead`): this layer's
        own copies may reuse their slots (each copy waits for the compute that last read its slot, queued by then).
        Returns (pair rows on the device, their outputs) for the caller to scatter."""
        resident_rows = pairs.of(resident)  # expert by expert in ascending id
        by_slot = sorted(resident, key=bank.gpu_slot.__getitem__)  # the GPU's work goes slot by slot
        if by_slot != resident:  # slots out of id order, after the expert cache's swaps
            slot_of = np.array([-1 if slot is None else slot for slot in bank.gpu_slot])
            resident_rows = resident_rows[np.argsort(slot_of[pairs.experts[resident_rows]], kind="stable")]
            resident = by_slot
        sizes = [pairs.count[e] for e in resident]
        gpu = bank.gpu
        grouped = (bool(resident) and grouped_supported(x, gpu)
                   and resident_grouped(sizes, gpu.hidden, gpu.width, GROUPED_MAX_TOKENS, gpu.num_experts))
        spans = None if grouped or not resident else _resident_spans(x, bank, resident, sizes)
        runs = _runs_by_id(to_copy, run_sizes) if to_copy and run_sizes else None
        if runs is not None:
            to_copy = [e for run in runs for e in run]  # slot order: each run's experts by id
        ahead = ahead or {}
        ahead_order = sorted(ahead, key=lambda e: ahead[e][0])  # slot order: spans of slots, one grouped launch each
        pair_rows = np.concatenate([pairs.of([e]) for e in ahead_order] + [resident_rows]
                                   + [pairs.of([e]) for e in to_copy])
        m = len(pair_rows)
        parts = []  # int32 words of group ends: the resident experts', then each copy run's
        if grouped or spans:  # cumulative token counts per resident slot; slots hold resident experts in id order
            tokens = np.zeros(bank.gpu.num_experts, dtype=np.int64)
            tokens[[bank.gpu_slot[e] for e in resident]] = sizes
            # Each span's ends from 0, from a 16-byte boundary (`_aligned`), as a copy run's.
            parts = [np.cumsum(tokens)] if grouped else [_aligned(np.cumsum(tokens[a:b])) for a, b in spans]
        if runs is not None or ahead:  # each run's cumulative token counts per slot, from 0, after the resident ends
            parts = [_aligned(p) for p in parts]
        ahead_tokens = {ahead[e][0]: pairs.count[e] for e in ahead_order}
        ahead_spans = _slot_spans(list(ahead_tokens), copy_run_limit(self.staging_stack.hidden,
                                                                     self.staging_stack.width)) if ahead else []
        ahead_word = 4 * m + sum(len(p) for p in parts)
        parts += [_aligned(np.cumsum([ahead_tokens.get(s, 0) for s in range(a, b)])) for a, b in ahead_spans]
        resident_ends = sum(len(p) for p in parts)  # the resident experts' and the copies ahead's
        if runs is not None:
            parts += [_aligned(np.cumsum([pairs.count[e] for e in run])) for run in runs]
        ends = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        # The grouped launch's slots with tokens: its programs go to those alone (kernels.gpu_quant).
        listed = np.flatnonzero(tokens) if grouped else np.zeros(0, dtype=np.int64)
        # One pinned buffer and one copy for every index the GPU needs (each torch op costs the host tens of
        # microseconds): the pairs' tokens and rows as int64 (two int32 words each), then int32 group ends, then
        # the listed slots.
        index = self._buffer("gpu_index", (4 * m + len(ends) + len(listed),), torch.int32, pinned=not self.simulated)
        words = index.numpy()
        words[:4 * m].view(np.int64)[:] = np.concatenate([pair_rows // k, pair_rows])
        words[4 * m:4 * m + len(ends)] = ends
        words[4 * m + len(ends):] = listed
        index = index.to(self.device, non_blocking=True)
        token_rows, rows = index[:4 * m].view(torch.int64).split(m)
        xs = x.index_select(0, token_rows)
        ys, at = [], 0
        if ahead:
            ys, at = self._compute_ahead(xs, ahead, ahead_tokens, ahead_spans, index[ahead_word:])
        if runs is None:
            copies = self._start_copies(bank, to_copy)
        else:  # the first run's copies before the resident experts' launch: the link starts at once
            copies = self._start_copies(bank, runs[0], first_slot=0)
        if grouped:
            ys.append(grouped_experts_forward(xs[at:at + sum(sizes)], bank.gpu, index[4 * m:4 * m + len(tokens)],
                                              index[4 * m + len(ends):] if len(listed) else None))
            at += sum(sizes)
        elif spans:
            word = 4 * m
            for a, b in spans:
                n = int(tokens[a:b].sum())
                ys.append(grouped_experts_forward(xs[at:at + n], bank.gpu.span(a, b), index[word:word + b - a]))
                at, word = at + n, word + _padded(b - a)
        else:
            for e, n in zip(resident, sizes):
                slot = bank.gpu_slot[e]
                ys.append(expert_forward(xs[at:at + n], bank.slot_views[slot]))
                at += n
        if runs is not None:
            ys += self._queue_copy_runs(bank, xs[at:], runs, copies, pairs, index[4 * m + resident_ends:])
            return rows, ys[0] if len(ys) == 1 else torch.cat(ys)
        for e, (slot, ready) in copies.items():
            n = pairs.count[e]
            y, self.slot_free[slot] = compute_copied(xs[at:at + n], self.staging[slot], ready)
            ys.append(y)
            at += n
        return rows, ys[0] if len(ys) == 1 else torch.cat(ys)

    def _compute_ahead(self, xs, ahead: dict, tokens: dict, spans: list, ends) -> tuple[list, int]:
        """The experts copied ahead (expert -> (slot, ready)) on xs's first rows, slot by slot: one grouped launch a
        span of slots (`_slot_spans`; a slot between whose expert got no token counts zero rows) once every copy
        landed; then the event after which their slots may take other copies. Returns (outputs, rows used).
        tokens: slot -> rows; ends: each span's cumulative rows on the device, one after another (`_aligned`)."""
        if not self.simulated:
            current = torch.cuda.current_stream(self.device)
            for _, ready in ahead.values():
                current.wait_event(ready)
        ys, at = [], 0
        for a, b in spans:
            sizes = [tokens.get(slot, 0) for slot in range(a, b)]
            n = sum(sizes)
            ys.append(self._compute_copy_run(xs[at:at + n], self.staging_stack.span(a, b), ends[:b - a], None, sizes))
            ends, at = ends[_padded(b - a):], at + n
        if not self.simulated:
            done = torch.cuda.current_stream(self.device).record_event()
            for slot in tokens:
                self.slot_free[slot] = done
        return ys, at

    def _queue_copy_runs(self, bank: LayerBank, xs, runs: list[list[int]], first: dict, pairs: "_Pairs", ends) -> list:
        """The copied experts' outputs, run by run: each copy run's experts sit in consecutive staging slots, and
        once their copies landed one grouped launch computes them all (a copied expert computed alone costs the host
        more than its link time: docs/measurements.md, "Prefill's copies"). The next run's copies are queued before
        this run's launch, so the link keeps busy while the host launches. `first`: the first run's copies,
        already queued; ends: each run's cumulative token counts, on the device, one after another, each from a
        16-byte boundary (`_aligned`)."""
        ys, at, slot, copies = [], 0, 0, first
        for i, run in enumerate(runs):
            ready = next(iter(copies.values()))[1]
            if i + 1 < len(runs):
                copies = self._start_copies(bank, runs[i + 1], first_slot=slot + len(run))
            n = sum(pairs.count[e] for e in run)
            stack = self.staging_stack.span(slot, slot + len(run))
            ys.append(self._compute_copy_run(xs[at:at + n], stack, ends[:len(run)], ready,
                                             [pairs.count[e] for e in run]))
            if not self.simulated:
                done = torch.cuda.current_stream(self.device).record_event()
                self.slot_free[slot:slot + len(run)] = [done] * len(run)
            ends, at, slot = ends[_padded(len(run)):], at + n, slot + len(run)
        return ys

    @staticmethod
    def _compute_copy_run(xs, stack: ExpertWeights, ends, ready, sizes: list[int]):
        """xs's rows, grouped by the experts of the copy run `stack` (token counts `sizes`), once `ready` (their
        copies' event; None on the simulated tier) has passed: one grouped launch where the kernels take it."""
        if ready is not None:
            torch.cuda.current_stream(xs.device).wait_event(ready)
        if grouped_supported(xs, stack):
            return grouped_experts_forward(xs, stack, ends)
        out, at = [], 0
        for j, n in enumerate(sizes):
            if n:  # a slot between copied ahead whose expert got no token
                out.append(expert_forward(xs[at:at + n], stack.expert(j)))
            at += n
        return torch.cat(out)

    def _count(self, layer: int, counts: np.ndarray, handed_over: bool = False) -> None:
        """handed_over: counted by the host's side of a handed-over step (`_host_tally`), whose graph waits on it."""
        if self.cache is not None and self._first_mixed is not None:
            if self._unapplied and not handed_over:
                self.settle()  # an eager step after a handed-over one, with no forward between to settle them
            if layer == self._first_mixed and self._step_counts.any():
                self._end_step(handed_over)  # a new step begins: the last one's routing is complete
            self._step_counts[self._position[layer]] += counts
            self._step_handed_over = handed_over
        tensor, known = self._selections.get(layer), self._selection_counts.get(layer)
        if known is None or known[0] is not tensor:  # first count, or `selections` was cleared
            if tensor is None:
                tensor = self._selections[layer] = torch.zeros(len(counts), dtype=torch.int64)
            known = self._selection_counts[layer] = (tensor, tensor.numpy())
        view = known[1]
        view += counts

    def _buffer(self, name: str, shape: tuple, dtype, pinned: bool) -> torch.Tensor:
        """A reused host buffer of this shape (pinned when copies leave from it), a view of one flat allocation
        per name that grows, never shrinks. Reuse is safe because each layer starts by waiting for the stream,
        which orders it after the previous layer's copies out of these buffers. Views are kept: slicing a
        tensor costs microseconds, and this runs for every layer of every token."""
        key = (name, shape, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(max(numel, 1024), dtype=dtype, pin_memory=pinned)
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
        if len(self._views) > 256:  # prefill's many shapes: keep the map small
            self._views.clear()
        view = self._views[key] = buf[:numel].view(shape)
        return view

    def _start_copies(self, bank: LayerBank, experts, first_slot: int | None = None) -> dict:
        """Queue host-to-GPU copies of `experts` into staging slots; expert -> (slot, ready event).

        first_slot given (a copy run, `_queue_copy_runs`): into slots first_slot, first_slot + 1, ... in the order
        given, each span of consecutive ids as one copy (`_id_spans`), with one event for them all."""
        if first_slot is not None:
            return self._copy_run(bank, experts, first_slot)
        started = {}
        for i, e in enumerate(experts):
            slot = i % len(self.staging)
            staging = self.staging[slot]
            if self.simulated:
                staging.copy_(bank.host.expert(e))
                started[e] = (slot, None)
                continue
            started[e] = (slot, queue_copy(self.copy_stream, bank.host.expert(e), staging,
                                           after=self.slot_free[slot]))
        return started

    def _copy_run(self, bank: LayerBank, experts: list[int], first: int) -> dict:
        slots = range(first, first + len(experts))
        spans = _id_spans(experts)
        if self.simulated:
            for e, n, at in spans:
                self.staging_stack.copy_experts_(first + at, bank.host, e, n)
            return {e: (slot, None) for e, slot in zip(experts, slots)}
        with torch.cuda.stream(self.copy_stream):
            waited = set()
            for event in self.slot_free[first:first + len(experts)]:
                if event is not None and id(event) not in waited:  # the kernels still reading these slots
                    self.copy_stream.wait_event(event)
                    waited.add(id(event))
            for e, n, at in spans:
                self.staging_stack.copy_experts_(first + at, bank.host, e, n, non_blocking=True)
            ready = self.copy_stream.record_event()
        return {e: (slot, ready) for e, slot in zip(experts, slots)}


def _layer_kind(gpu_slot: list) -> tuple[int, int]:
    """What captured graphs bake in of a layer's residency: how many of its experts are resident, of how many (none:
    host-run alone, maybe zero-copy; all: run on the device whole; some: handed over with a resident share)."""
    return sum(slot is not None for slot in gpu_slot), len(gpu_slot)


_ALIGN = 4  # int32 words: each copy run's ends start on a 16-byte boundary, as the resident ones do


def _padded(n: int) -> int:
    return n + -n % _ALIGN


def _aligned(words: np.ndarray) -> np.ndarray:
    """words padded with zeros to a multiple of _ALIGN."""
    return np.concatenate([words, np.zeros(_padded(len(words)) - len(words), dtype=words.dtype)])


def _slot_spans(slots: list[int], limit: int) -> list[tuple[int, int]]:
    """Ascending `slots` cut into spans [first, stop) of at most `limit` slots each, greedily from the first: the
    slots between in a span (experts with no tokens this step) count toward its limit."""
    spans = []
    for s in slots:
        if spans and s + 1 - spans[-1][0] <= limit:
            spans[-1] = (spans[-1][0], s + 1)
        else:
            spans.append((s, s + 1))
    return spans


def _resident_spans(x, bank: LayerBank, resident: list[int], sizes: list[int]) -> list[tuple[int, int]] | None:
    """Spans of the resident slots (`_slot_spans`) to compute one grouped call each in place of one call an expert,
    where that computes each expert as its own call would (`grouped_alike`: packed experts on the GPU) and saves a
    call; each span's dequantised scratch within a copy run's (`copy_run_limit`). None: one call an expert.
    resident: the step's resident experts with tokens, in slot order; sizes: their tokens."""
    slots = [bank.gpu_slot[e] for e in resident]
    spans = _slot_spans(slots, copy_run_limit(bank.gpu.hidden, bank.gpu.width))
    if len(spans) == len(resident):
        return None
    tokens = dict(zip(slots, sizes))
    if all(grouped_alike(x, bank.gpu.span(a, b), [tokens.get(s, 0) for s in range(a, b)]) for a, b in spans):
        return spans
    return None


def _runs_by_id(experts: list[int], sizes: list[int]) -> list[list[int]]:
    """`experts` (in copy order) cut into consecutive copy runs of `sizes`, each run sorted by id so that
    neighbouring ids share one copy (`_id_spans`)."""
    runs, at = [], 0
    for size in sizes:
        if size > 0:
            runs.append(sorted(experts[at:at + size]))
        at += size
    assert at == len(experts), "copy run sizes must add up to the copies"
    return runs


def _id_spans(experts: list[int]) -> list[tuple[int, int, int]]:
    """(first id, length, offset in `experts`) of each span of consecutive ids in `experts` (sorted): one copy each."""
    spans = []
    for i, e in enumerate(experts):
        if spans and e == spans[-1][0] + spans[-1][1]:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1, spans[-1][2])
        else:
            spans.append((e, 1, i))
    return spans
