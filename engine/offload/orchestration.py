"""Experts of a loaded model put to work across GPU and CPU: profile, popularity, placement, back-off.

`ExpertOrchestra` owns the `OffloadExecutor` of one loaded MoE model and the decisions around
it: the latency model (profiled once per machine, shape and dtype, cached), the popularity
(counted once per model on the calibration prompts, cached, and trusted as far as one half of
the prompts predicts the other: engine.offload.popularity), and the placement under a GPU budget.
When the GPU runs out of memory, at load or while generating, the budget shrinks and the
placement is redone with a warning; it never ends the program while experts can still leave
the GPU.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from moedesk.engine.offload.expert_cache import CachePolicy, SwapPrice, policy_from_env
from moedesk.engine.offload.latency_model import LatencyModel, fit_latency_model
from moedesk.engine.offload.offload_executor import OffloadExecutor
from moedesk.engine.offload.pinned_memory import HostBanks
from moedesk.engine.offload.assignment import (RememberedSplit, assign_offloaded, copy_run_limit, copy_runs,
                                               fiddler_assign, lone_token_split, resident_on_cpu, split_width,
                                               zero_copy_ranks)
from moedesk.engine.offload.placement import LayerCosts, Placement, plan_placement
from moedesk.engine.offload.popularity import estimated_popularity
from moedesk.engine.offload.prefill_outlook import expected_loads, prefetch_ahead, prefill_step
from moedesk.engine.offload.cpu_paths import apply_cpu_path
from moedesk.engine.offload.profiler import (cached_profile, copy_launch_prefill_ms, copy_queue_prefill_ms,
                                             profile_expert, profile_key, profile_prefill_cpu, profile_zero_copy)

log = logging.getLogger("moedesk")

GIB = 2**30
# Kept free on the GPU besides the KV cache and staging: activations, allocator slack, cuBLAS
# workspaces, and whatever else the desktop has open.
SAFETY_MARGIN = 0.10
MIN_MARGIN_BYTES = GIB
KV_ROWS_RESERVED = 4  # sequences whose full-context KV cache the default budget leaves room for


def host_bank_allocator(dtype: torch.dtype, pinned: bool, warnings: list[str]) -> HostBanks:
    """The loader's `expert_banks`: an exact-size arena per layer, page-locked in place once filled when a GPU
    will copy from it (engine.offload.pinned_memory); left pageable, with a warning, if locking fails."""
    return HostBanks(dtype, pinned, warnings)


def _warn(warnings: list[str], message: str) -> None:
    warnings.append(message)
    log.warning(message)


def leave_a_core_to_the_gpu_thread() -> int:
    """Torch's CPU threads = physical cores - 1: a busy pool starves the thread that launches GPU work
    (docs/measurements.md, "Facts measured on the GPU box"). The native experts kernel's pool keeps the same rule
    (kernels.cpu_experts.default_num_threads). Returns the thread count set."""
    import psutil

    threads = max(1, (psutil.cpu_count(logical=False) or 2) - 1)
    torch.set_num_threads(threads)
    return threads


def default_expert_budget(free_bytes: int, kv_bytes: int) -> int:
    """GPU bytes for resident experts when the user names no budget: what is free once the KV cache
    and a margin are set aside (non-expert weights and staging slots are allocated before this is asked)."""
    margin = max(int(free_bytes * SAFETY_MARGIN), MIN_MARGIN_BYTES)
    return max(0, free_bytes - kv_bytes - margin)


@dataclass
class ExpertOrchestra:
    executor: OffloadExecutor
    costs: LatencyModel
    expert_bytes: int
    popularity: list[list[float]]
    budget_bytes: int
    placement: Placement | None = None
    warnings: list[str] = field(default_factory=list)
    profile_key: str = ""  # names this machine, expert shape and dtype in the measurement cache
    profile: dict = field(default_factory=dict)  # the raw measurements the latency model was fitted to
    # Let the resident experts follow the routing (engine.offload.expert_cache); opt-in until it pays on a GPU
    # (docs/expert-cache.md). None keeps the placement fixed.
    cache: CachePolicy | None = field(default_factory=lambda: policy_from_env(os.environ.get("MOEDESK_EXPERT_CACHE")))
    top_k: int = 1  # experts per token: what a layer's offloaded share costs (placement's layer costs)
    evenness: float | None = None  # weight of even routing in `popularity` (engine.offload.popularity); None: not calibrated

    @classmethod
    def start(cls, banks: dict, device: torch.device, profile_key_parts: tuple, cache_dir: Path,
              reprofile: bool = False, warnings: list[str] | None = None, policy: str = "balanced",
              top_k: int = 1, dtype: torch.dtype | None = None, selections: dict | None = None) -> "ExpertOrchestra":
        """Profile one expert (cached) and build the executor with no expert resident yet.

        policy: "balanced" splits offloaded experts so the CPU and the copies finish together, and lets
        the GPU compute some of a lone token's experts, or the last rows of each, from RAM while the CPU
        computes the rest;
        "fiddler" decides expert by expert (kept for comparison). dtype: the activations' (the model's).
        selections: where the executor counts the routing (OffloadExecutor), shared by one model's devices.
        """
        first = next(iter(banks.values()))
        key = profile_key(*profile_key_parts, first.describe(), device)
        points = cached_profile(cache_dir, key, lambda: measure_profile(first, top_k, device, dtype), reprofile)
        warnings = [] if warnings is None else warnings
        rates = prefill_rates_wanted()  # off: prefill priced, and the kernel's path kept, as before they were measured
        costs = fit_latency_model(points, apply_cpu_path(points, warnings) if rates else None, prefill_rates=rates)
        nothing = [[False] * first.num_experts for _ in banks]
        balanced = policy == "balanced"
        # The CPU's call beside the queueing of the copies, priced so (assign_offloaded's overlap); off with the rates.
        overlap = balanced and rates
        executor = OffloadExecutor(banks, nothing, device, decide=None,
                                   resident_to_cpu=lambda loads: resident_on_cpu(loads, costs),
                                   zero_copy_ranks=(lambda k: zero_copy_ranks(k, costs)) if balanced else None,
                                   split_width=(lambda k: split_width(k, costs)) if balanced else None,
                                   selections=selections, overlap_copies=overlap)
        uniform = [[0] * first.num_experts for _ in banks]
        orchestra = cls(executor, costs, first.expert_bytes, uniform, 0, warnings=warnings,
                        profile_key=key, profile=points, top_k=top_k)
        orchestra.group_copies(balanced and overlap and grouped_copies_wanted(), balanced)
        orchestra.copy_ahead(balanced and copy_ahead_wanted())
        return orchestra

    def group_copies(self, on: bool, balanced: bool = True) -> None:
        """Compute a prefill step's copied experts in copy runs, one grouped launch each, and price its split so
        (engine.offload.assignment.copy_runs, assign_offloaded's grouped_copies); off: each copied expert on its own and
        priced so, as before. Settable on a running model, for measuring both on one build (profile_prefill.py)."""
        costs, overlap = self.costs, self.executor.overlap_copies
        rule = partial(assign_offloaded, overlap=overlap, grouped_copies=on) if balanced else fiddler_assign
        self.executor.decide = RememberedSplit(lambda loads: rule(loads, costs))
        host = next(iter(self.executor.banks.values())).host
        limit = copy_run_limit(host.hidden, host.width)
        self.executor.copy_runs = (lambda loads, copy: copy_runs(loads, copy, costs, limit)) if on else None

    def copy_ahead(self, on: bool) -> None:
        """Copy experts of the next layer during each prefill layer into the staging slots its own copies leave: those
        `prefetch_ahead` picks from the calibrated popularity, the dearest on the CPU first, as many as the free slots
        and the link's free time hold; that time is the layer before's, less this layer's own copies (as
        prefill_outlook_ahead prices it: a layer's share of the time outside the windows, and its window).
        Settable on a running model, for measuring both on one build."""
        executor, top_k = self.executor, self.top_k
        layers = sorted(executor.banks)

        def plan(layer: int, tokens: int, room: int, layer_ms: float, own_copies: int) -> list[int]:
            slots_of = executor.banks[layer].gpu_slot
            if not prefill_step(tokens, top_k, len(slots_of)):
                return []
            share = self.popularity[layers.index(layer)]
            offloaded = [slot is None for slot in slots_of]
            free_ms = layer_ms - own_copies * self.costs.copy_expert_ms
            return prefetch_ahead(expected_loads(share, offloaded, tokens, top_k), self.costs, free_ms, room)

        executor.copy_ahead_with(plan if on else None)

    def twin(self) -> "ExpertOrchestra":
        """Another orchestra over the same host experts, latency model and popularity, with an executor of its own
        (its own GPU copies, remembered splits, buffers and cache) and nothing resident: two placements kept side by
        side and measured in turns, neither re-copied between them nor sharing what the other learned
        (tests/perf/bench_expert_cache.py)."""
        old = self.executor
        decide = RememberedSplit(old.decide.rule) if isinstance(old.decide, RememberedSplit) else old.decide
        banks = {layer: bank.host for layer, bank in old.banks.items()}
        executor = OffloadExecutor(banks, [[False] * bank.host.num_experts for _, bank in sorted(old.banks.items())],
                                   old.device, decide=decide, staging_slots=len(old.staging),
                                   resident_to_cpu=old.resident_to_cpu, zero_copy_ranks=old.zero_copy_ranks,
                                   split_width=old.split_width, overlap_copies=old.overlap_copies,
                                   copy_runs=old.copy_runs)
        twin = replace(self, executor=executor, placement=None, budget_bytes=0, warnings=[])
        twin.copy_ahead(old.copy_ahead is not None)  # a plan of its own: this one reads this executor's placement
        return twin

    def cpu_path(self) -> str:
        """What computes this model's experts on the CPU, in words (kernels.experts.cpu_path of its first layer's
        experts): asked now, not read from the cached profile, which names the native kernel whatever the model."""
        from moedesk.kernels.experts import cpu_path

        return cpu_path(next(iter(self.executor.banks.values())).host)

    def lone_token_split(self) -> tuple[int, int]:
        """How a lone decoded token's offloaded experts are shared with the GPU reading from RAM: (whole experts,
        0) or (0, last rows of each); engine.offload.assignment.lone_token_split over this profile."""
        return lone_token_split(self.top_k, self.costs)

    def calibrate(self, halves) -> None:
        """Popularity from the two halves of a calibration run: their counts, shrunk toward even routing as far
        as one half fails to predict the other."""
        counts, self.evenness = estimated_popularity(halves)
        self.popularity = counts.tolist()
        log.info("expert popularity: %.0f%% even routing mixed in (how little one half of the calibration "
                 "predicted the other)", 100 * self.evenness)

    def place(self, budget_bytes: int, popularity: list[list[float]] | None = None,
              whole_layers: bool = True) -> Placement:
        """Make the experts that fit `budget_bytes` resident (by popularity, or whole layers first where the
        latency model says that is faster: engine.offload.placement.plan_placement); shrink the budget on GPU OOM.

        A cache starts from the same plan, whole layers kept (no handoff, inside the graphs), and follows the routing
        in the layers partly resident, swapping where the same latency model says a swap pays. whole_layers=False:
        expert by expert across every layer (for comparison)."""
        if popularity is not None:
            self.popularity = popularity
        layers, experts = len(self.popularity), len(self.popularity[0])
        executor = self.executor
        layer_costs = LayerCosts.from_model(self.costs, executor.whole_layers_on_device,
                                            executor.hands_over_partly_resident(self.top_k),
                                            executor.splits_lone_tokens) if whole_layers else None
        while True:
            plan = plan_placement(self.expert_bytes, layers, experts, self.popularity, max(0, budget_bytes), 0,
                                  layer_costs=layer_costs, top_k=self.top_k)
            try:
                self.executor.set_placement(plan.as_lists())
            except torch.OutOfMemoryError:
                self.executor.set_placement([[False] * experts for _ in range(layers)])
                _empty_device_cache(self.executor.device)
                if plan.experts_on_gpu == 0:
                    raise
                budget_bytes = plan.expert_bytes_used * 3 // 4
                _warn(self.warnings, f"GPU out of memory placing {plan.experts_on_gpu} experts; "
                                     f"GPU budget lowered to {budget_bytes / GIB:.2f} GiB")
                continue
            self.placement, self.budget_bytes = plan, budget_bytes
            if self.cache is not None:
                self.executor.follow_routing(self.cache, price=SwapPrice.from_model(self.costs))
            return plan

    def back_off(self) -> bool:
        """After a GPU OOM while generating: halve the resident experts. False when none were left to move."""
        resident = self.placement.experts_on_gpu if self.placement else 0
        if resident == 0:
            return False
        budget = (resident // 2) * self.expert_bytes
        _warn(self.warnings, f"GPU out of memory while generating; moving {resident - resident // 2} experts "
                             f"to RAM (GPU budget now {budget / GIB:.2f} GiB)")
        self.executor.set_placement([[False] * len(row) for row in self.popularity])
        _empty_device_cache(self.executor.device)
        self.place(budget)
        return True

    def summary(self) -> dict:
        plan = self.placement
        total = len(self.popularity) * len(self.popularity[0])
        return {
            "experts_on_gpu": plan.experts_on_gpu if plan else 0, "experts_total": total,
            "experts_room": plan.experts_room if plan else 0,
            "gpu_budget_gib": round(self.budget_bytes / GIB, 3),
            "expected_gpu_hit_rate": round(plan.gpu_hit_rate(self.popularity), 4) if plan and any(map(any, self.popularity)) else None,
            "popularity_evenness": None if self.evenness is None else round(self.evenness, 4),
        }


def measure_profile(first, top_k: int, device: torch.device, dtype: torch.dtype | None) -> dict:
    """Every start-up measurement of one layer's experts `first` (engine.offload.profiler)."""
    points = {**profile_expert(first, device, dtype), **profile_zero_copy(first, top_k, device, dtype=dtype),
              **profile_prefill_cpu(first, dtype)}
    if torch.device(device).type == "cuda":
        points.update(copy_launch_prefill_ms(first, dtype, device))
        points.update(copy_queue_prefill_ms(first, device))
    return points


def copy_ahead_wanted() -> bool:
    """MOEDESK_COPY_AHEAD=1 copies experts of the next MoE layer during each prefill layer (`ExpertOrchestra
    .copy_ahead`); off until the GPU measures it."""
    return os.environ.get("MOEDESK_COPY_AHEAD", "").strip().lower() not in ("", "0", "false", "no")


def grouped_copies_wanted() -> bool:
    """MOEDESK_COPIES_ONE_BY_ONE=1 computes a prefill's copied experts one by one and prices them so, as before the
    copy runs (`ExpertOrchestra.group_copies`): for measuring the difference."""
    return os.environ.get("MOEDESK_COPIES_ONE_BY_ONE", "").strip().lower() in ("", "0", "false", "no")


def prefill_rates_wanted() -> bool:
    """MOEDESK_NO_PREFILL_RATES=1 prices prefill steps as before their rates were measured (the CPU's share from
    one-expert calls, each copy's launch from a lone drained one) and runs the CPU's call after the copies are
    queued, as before: for measuring the difference."""
    return os.environ.get("MOEDESK_NO_PREFILL_RATES", "").strip().lower() in ("", "0", "false", "no")


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
