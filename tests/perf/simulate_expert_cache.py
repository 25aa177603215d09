"""Predicted, not measured: what a GPU expert cache can gain over the fixed placement, replayed on the CPU.

Replays the routing traces of tests/perf/bench_expert_cache.py (CONVERSATION and NO_LOCALITY, the same seeds) on the
whole-model shapes and budgets of issue 42 (Qwen3-30B-A3B at 8 GiB: 1,901 of 6,144 experts resident; Mixtral-8x7B
at 16 GiB: 131 of 256) through the fixed placement, today's priced cache (engine.offload.expert_cache) and
alternatives: other prices (hysteresis, half-life, copy budget), an LRU within a copy budget, and placements that
give the cache more layers to follow. Each step is priced with the latency model the placement plans with
(engine.offload.placement.step_cost_ms, read from that step's selections instead of the popularity) and the copies
with the profile's copy and launch times, in three ways: stalled (today's executor: the next step waits for the
copies its host queued), overlapped (the copies run beside the step, the host still queues each one) and batched
(overlapped, one launch for all: only what the link cannot move within the step is paid).

With --prefetch it replays a predictor of the experts a few layers ahead instead (the next router applied early),
copying its guesses into a staging area taken from the budget (simulate_prefetch).

The prices are the H200 box's, session 35 (docs/measurements.md): the bench's start-up profiles (one expert on the
CPU at one token, one copy, the read bandwidth) and, for what those logs do not print (a call's own cost, the round
trip, the launches), the full profiles of the same session's Qwen3.5 and gpt-oss runs; `PRICES` says which is which.
The step's part outside the experts is what the eager bench measured for the fixed placement less the model's MoE
time, so the step times read against that bench's tok/s.

    python3 tests/perf/simulate_expert_cache.py                 # both shapes, both traces, ~2 min on one core
    python3 tests/perf/simulate_expert_cache.py --shape qwen3-30b-a3b --steps 128
    python3 tests/perf/simulate_expert_cache.py --shape qwen3-30b-a3b --profile ~/.cache/moedesk/profile-<key>.json
    python3 tests/perf/simulate_expert_cache.py --prefetch       # a predictor of the next layers' experts instead
    python3 tests/perf/simulate_expert_cache.py --prefetch --shape mixtral-8x7b --horizon 1,2,4 --accuracy 0.9
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from moedesk.engine.errors import MoedeskError
from moedesk.engine.offload.assignment import cpu_call_ms
from moedesk.engine.offload.expert_cache import CachePolicy, ExpertCache, Swap, SwapPrice
from moedesk.engine.offload.latency_model import fit_latency_model
from moedesk.engine.offload.placement import LayerCosts, plan_placement
from moedesk.engine.offload.routing_trace import (CONVERSATION, NO_LOCALITY, TraceParams, TraceShape, read_trace,
                                                  step_counts, synthetic_trace)

TRACES = {"conversation": CONVERSATION, "no locality": NO_LOCALITY}


@dataclass(frozen=True)
class StepPrices:
    """ms of the parts of a decode step an expert's residency changes (one token)."""

    roundtrip_ms: float  # a layer that is not wholly resident: routing to the host and outputs back
    call_ms: float  # the CPU call's own cost, once a layer with any offloaded selection
    share_ms: float  # one offloaded selection's share of that call
    resident_launch_ms: float  # the host queueing a partly resident layer's GPU experts
    copy_ms: float  # one expert host-to-device
    copy_launch_ms: float  # the host queueing one copy
    link_gbs: float  # host-to-device GB/s: what the link moves within a step
    expert_bytes: int

    @classmethod
    def from_profile(cls, profile: dict) -> "StepPrices":
        """From a start-up profile's measurements (the JSON the engine caches as profile-<key>.json), read as the
        engine reads them (engine.offload.latency_model.fit_latency_model)."""
        model = fit_latency_model(profile)
        return cls(roundtrip_ms=model.activation_roundtrip_ms(1), call_ms=cpu_call_ms(model, 1),
                   share_ms=model.cpu_expert_ms(1), resident_launch_ms=model.resident_launch_ms,
                   copy_ms=model.copy_expert_ms, copy_launch_ms=model.copy_launch_ms,
                   link_gbs=float(profile.get("h2d_gbs") or 0.0), expert_bytes=model.expert_bytes)

    def layer_costs(self) -> LayerCosts:
        return LayerCosts(self.roundtrip_ms, self.resident_launch_ms, self.share_ms, True, self.call_ms)

    def swap_price(self) -> SwapPrice:
        """As SwapPrice.from_model prices a swap: a selection's share against a copy's bytes over the link, and the
        resident launch a partly resident layer's hits must outweigh to save anything."""
        return SwapPrice(self.share_ms, self.copy_ms, resident_launch_ms=self.resident_launch_ms)


def _q4_k_bytes(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate * 144 // 256  # Q4_K: 144 bytes a block of 256 weights


# Session 35 on the H200 (docs/measurements.md). One selection's share at one token is the expert's bytes at the rate
# calls of several experts read (Qwen3.5's profile, 1.77 MB experts: 128 GB/s; Mixtral: its profile's 116 GB/s); the
# call's own cost is the one-expert call (Qwen3 0.0708 ms, Mixtral 0.980, the bench's logs) less that share. Round trip
# 0.0345 and launches: the Qwen3.5 profile (top-8; resident launch 0.47) and the gpt-oss one (top-4; 0.22) for Mixtral.
PRICES = {
    "qwen3-30b-a3b": StepPrices(roundtrip_ms=0.0345, call_ms=0.050, share_ms=0.0207, resident_launch_ms=0.47,
                                copy_ms=0.066, copy_launch_ms=0.19, link_gbs=40.2,
                                expert_bytes=_q4_k_bytes(2048, 768)),
    "mixtral-8x7b": StepPrices(roundtrip_ms=0.0345, call_ms=0.050, share_ms=0.93, resident_launch_ms=0.22,
                               copy_ms=1.86, copy_launch_ms=0.20, link_gbs=53.3,
                               expert_bytes=_q4_k_bytes(4096, 14336)),
}


@dataclass(frozen=True)
class Setting:
    shape: TraceShape
    resident: int  # experts the budget holds (the bench's placement at that budget)
    fixed_step_ms: dict  # the eager bench's fixed placement, ms a step, per trace


SETTINGS = {
    "qwen3-30b-a3b": Setting(TraceShape(48, 128, 8), 1901, {"conversation": 1000 / 17.14, "no locality": 1000 / 18.8}),
    "mixtral-8x7b": Setting(TraceShape(32, 8, 2), 131, {"conversation": 1000 / 15.1, "no locality": 1000 / 14.2}),
}


def moe_ms(resident: np.ndarray, counts: np.ndarray, prices: StepPrices) -> float:
    """Host ms of one step's MoE layers, as placement.step_cost_ms prices a placement, from this step's selections
    (one token): a wholly resident layer costs nothing (it runs inside the decode graphs); any other pays the round
    trip, the CPU call and its offloaded selections' shares where it has any, and the launch of its GPU experts where
    it has hits, unless the executor computes those on the CPU too, as it does where their shares cost less than
    the launch (engine.offload.assignment.resident_on_cpu): then a hit saves nothing."""
    return float(layers_ms(resident, counts, prices).sum())


def layers_ms(present: np.ndarray, counts: np.ndarray, prices: StepPrices,
              whole: np.ndarray | None = None) -> np.ndarray:
    """moe_ms layer by layer. `whole` marks the layers that run inside the graphs (default: those with every expert
    `present`); a layer whose experts are all present only with staged ones is still priced as partly resident."""
    partial = ~(present.all(axis=1) if whole is None else whole)
    misses = np.where(present, 0, counts).sum(axis=1)
    hits = np.where(present, counts, 0).sum(axis=1)
    moved = (misses > 0) & (hits * prices.share_ms < prices.resident_launch_ms)
    launched = (hits > 0) & ~moved
    cost = (prices.roundtrip_ms + (misses > 0) * prices.call_ms + (misses + moved * hits) * prices.share_ms
            + launched * prices.resident_launch_ms)
    return np.where(partial, cost, 0.0)


COPY_MODES = ("stalled", "overlapped", "batched")


def copies_ms(copies: int, step_ms: float, prices: StepPrices, mode: str) -> float:
    """What `copies` expert copies add to a step of `step_ms`: stalled, the host queues them and the next step waits
    for them; overlapped, they run beside the step and the host still queues each; batched, one launch for all. In
    the two overlapped modes the link moves link_gbs x step_ms within the step for free."""
    if mode == "stalled":
        return copies * (prices.copy_ms + prices.copy_launch_ms)
    beyond = max(0.0, copies * prices.copy_ms - step_ms)
    return beyond + (copies * prices.copy_launch_ms if mode == "overlapped" else 0.0)


class LruCache:
    """Least recently used within a copy budget: after a step, its missed experts (the most used first) take the
    slots of the residents used longest ago, as many as `copies_per_step` has paid for (unspent budget carried over
    up to one round's). Only the layers `mixed` (partly resident) change, as in ExpertCache."""

    def __init__(self, resident: np.ndarray, copies_per_step: float = np.inf):
        self.resident = np.array(resident, dtype=bool)
        self.copies_per_step = copies_per_step
        self.mixed = np.flatnonzero(self.resident.any(axis=1) & ~self.resident.all(axis=1))
        self.last_used = np.full(self.resident.shape, -1.0)
        self.last_used[self.resident] = -0.5  # the placement's residents: older than any use, newer than none
        self.credit = 0.0
        self.steps = self.swaps = self.hits = self.selections = 0

    def observe(self, counts: np.ndarray) -> list[Swap]:
        counts = np.asarray(counts)
        self.hits += int(counts[self.resident].sum())
        self.selections += int(counts.sum())
        self.last_used[counts > 0] = self.steps
        self.steps += 1
        self.credit = min(self.credit + self.copies_per_step, max(self.copies_per_step, 1.0))
        wanted = []  # (-count, layer, admit) for every miss of a mixed layer
        for layer in self.mixed:
            for admit in np.flatnonzero((counts[layer] > 0) & ~self.resident[layer]):
                wanted.append((-int(counts[layer, admit]), int(layer), int(admit)))
        wanted.sort()
        swaps = []
        for _, layer, admit in wanted[:int(min(self.credit, len(wanted)))]:
            on = self.resident[layer]
            oldest = np.where(on, self.last_used[layer], np.inf)
            evict = int(np.argmin(oldest))
            if oldest[evict] >= self.steps - 1:  # every resident was used this step: keep them
                continue
            on[evict], on[admit] = False, True
            swaps.append(Swap(layer, evict, admit))
        self.credit -= len(swaps)
        self.swaps += len(swaps)
        return swaps


class Clairvoyant:
    """The bound on any cache's hits with as many slots: Belady's rule, knowing the trace. Before each step, each
    partly resident layer's missed selections take the slots of the residents whose next use is farthest off;
    copies unlimited. Only the layers `mixed` change, as in ExpertCache."""

    def __init__(self, resident: np.ndarray, trace: list[np.ndarray]):
        self.resident = np.array(resident, dtype=bool)
        self.mixed = np.flatnonzero(self.resident.any(axis=1) & ~self.resident.all(axis=1))
        self.trace = trace
        self.next_use = np.full((len(trace) + 1, *self.resident.shape), np.inf)  # [t]: first use at or after t
        for t in range(len(trace) - 1, -1, -1):
            self.next_use[t] = np.where(trace[t] > 0, t, self.next_use[t + 1])
        self.steps = 0

    def observe(self, counts: np.ndarray) -> list[Swap]:
        self.steps += 1
        if self.steps >= len(self.trace):
            return []
        upcoming, later = self.trace[self.steps] > 0, self.next_use[self.steps]
        swaps = []
        for layer in self.mixed:
            on = self.resident[layer]
            for admit in np.flatnonzero(upcoming[layer] & ~on):
                farthest = np.where(on & ~upcoming[layer], later[layer], -np.inf)
                evict = int(np.argmax(farthest))
                if farthest[evict] == -np.inf:  # every slot holds an expert the next step needs
                    break
                on[evict], on[admit] = False, True
                swaps.append(Swap(int(layer), evict, int(admit)))
        return swaps


def reuse(trace: list[np.ndarray]) -> tuple[float, float]:
    """(chance, reuse): how often an expert is chosen at a step, and how often one chosen at step t is chosen again
    at t + 1. Recency can only predict where reuse exceeds chance."""
    chosen = np.stack(trace) > 0
    return float(chosen.mean()), float((chosen[1:] & chosen[:-1]).sum() / max(1, chosen[:-1].sum()))


def hindsight_placement(trace: list[np.ndarray], slots) -> np.ndarray:
    """The fixed placement that hits most of `trace`, knowing it: `slots` an int (the experts most used, any layer)
    or one count a layer (each layer's most used, as many as its slots). The bound on any cache that never copies."""
    total = np.sum(trace, axis=0)
    on = np.zeros(total.shape, dtype=bool)
    if np.ndim(slots) == 0:
        on.flat[np.argsort(-total, axis=None, kind="stable")[:int(slots)]] = True
        return on
    for layer, n in enumerate(slots):
        on[layer, np.argsort(-total[layer], kind="stable")[:int(n)]] = True
    return on


def belady_copies(trace: list[np.ndarray], slots: int) -> float:
    """Copies a step a clairvoyant cache of `slots` experts shared by all layers needs to hit every selection
    (Belady's rule: each expert a step needs and lacks is copied, evicting those not needed for longest): the fewest
    any cache of that size needs. Each must cross the link before its layer runs."""
    flat = [t.ravel() > 0 for t in trace]
    later = np.full((len(flat) + 1, flat[0].size), np.inf)  # [t]: the first step at or after t using each expert
    for t in range(len(flat) - 1, -1, -1):
        later[t] = np.where(flat[t], t, later[t + 1])
    on = np.zeros(flat[0].size, dtype=bool)
    copies = 0
    for t, used in enumerate(flat):
        needed = np.flatnonzero(used & ~on)
        copies += len(needed)
        on[needed] = True
        over = int(on.sum()) - slots
        if over > 0:
            spare = np.flatnonzero(on & ~used)
            on[spare[np.argsort(-later[t + 1][spare], kind="stable")[:over]]] = False
    return copies / max(1, len(flat))


@dataclass(frozen=True)
class LocalityRow:
    trace: str
    placement: str
    whole: int | None  # layers wholly resident (None: not one placement)
    hit_rate: float
    copies_per_step: float
    moe_ms: float
    vs_fixed: float  # predicted step against the fixed placement's, copies batched beside the step


def locality_rows(setting: Setting, prices: StepPrices, trace_name: str, steps: int, warmup: int,
                  fixed_step_ms: float, recorded: tuple[np.ndarray, list[np.ndarray]] | None = None
                  ) -> list[LocalityRow]:
    """What one trace leaves a cache to follow, and what following it could be worth: the hits of the fixed
    placement, of the best fixed placements knowing the trace (within the plan's slots a layer, and anywhere), of
    today's cache, an LRU and Belady's rule within the plan's slots, each with its predicted step against fixed
    (the step outside the experts: `fixed_step_ms` less the fixed placement's MoE layers); last, the ceiling where
    every selection hits, with the copies a clairvoyant cache of the whole budget needs for that. recorded:
    (calibration, trace) of a recorded conversation in place of the synthetic trace `trace_name`."""
    calibration, trace = recorded or traces_for(setting, TRACES[trace_name], steps)
    timed = trace[warmup:]
    plan = engine_plan(calibration, setting, prices, setting.resident)
    never = CachePolicy(swaps_per_step=0)
    fixed_moe = simulate(trace, ExpertCache(plan, never), prices, 0.0, warmup).moe_ms
    outside = fixed_step_ms - fixed_moe
    caches = [("fixed (the engine's plan)", ExpertCache(plan, never)),
              ("best fixed knowing the trace, plan's slots",
               ExpertCache(hindsight_placement(timed, plan.sum(axis=1)), never)),
              ("best fixed knowing the trace, any layer", ExpertCache(hindsight_placement(timed, setting.resident),
                                                                     never)),
              ("today's priced cache, every 16", ExpertCache(plan, CachePolicy(interval=16),
                                                             price=prices.swap_price())),
              ("LRU, plan's slots, unlimited copies", LruCache(plan)),
              ("Belady, plan's slots, unlimited copies", Clairvoyant(plan, trace))]
    rows = []
    for label, cache in caches:
        whole = int(cache.resident.all(axis=1).sum())
        p = simulate(trace, cache, prices, outside, warmup)
        rows.append(LocalityRow(trace_name, label, whole, p.hit_rate, p.swaps_per_step, p.moe_ms,
                                fixed_step_ms / p.step_ms["batched"]))
    rows.append(LocalityRow(trace_name, "every hit: clairvoyant, all layers, link free", None, 1.0,
                            belady_copies(timed, setting.resident), 0.0, fixed_step_ms / outside))
    return rows


def read_recorded(path, shape: TraceShape, warmup: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """(calibration, trace) from a recorded routing trace (engine.offload.routing_trace.TraceRecorder): its decode
    steps (one token each), the first half counted as the calibration the placement is planned from, the second
    replayed. MoedeskError, one line, where the file is not a trace of `shape` or has too few decode steps (at least
    4, and a replayed half longer than its `warmup`)."""
    got, steps = read_trace(path)
    if got != shape:
        raise MoedeskError(f"{path}: a trace of {got.layers} layers, {got.experts} experts, top-{got.top_k}; the shape "
                           f"has {shape.layers}, {shape.experts}, top-{shape.top_k}")
    decode = [step_counts(s, shape.experts) for s in steps if all(len(ids) == shape.top_k for ids in s)]
    if len(decode) < 4:
        raise MoedeskError(f"{path}: {len(decode)} decode steps; at least 4 needed")
    half = len(decode) // 2
    if len(decode) - half <= warmup:
        raise MoedeskError(f"{path}: {len(decode)} decode steps, half of them replayed; --warmup {warmup} leaves none "
                           f"timed")
    return np.sum(decode[:half], axis=0).astype(float), decode[half:]


def locality_table(name: str, setting: Setting, prices: StepPrices, args: argparse.Namespace) -> None:
    """locality_rows for both traces, with reuse against chance and what a hit and a copy are worth."""
    print(f"{name}: {setting.shape.layers} layers of {setting.shape.experts} experts, top-{setting.shape.top_k}, "
          f"{setting.resident} resident; a hit saves {prices.share_ms} ms of the CPU where launched (a partly resident "
          f"layer's hits under the {prices.resident_launch_ms} ms launch save nothing), a copy costs "
          f"{prices.copy_ms} ms of link and {prices.copy_launch_ms} ms to queue: it pays from "
          f"{break_even(prices, 'stalled'):.1f} extra hits (stalled), {break_even(prices, 'overlapped'):.1f} "
          f"(overlapped); vs fixed: copies batched beside the step")
    print(f"{'trace':13} {'chance':>6} {'reuse':>6} {'placement':46} {'whole':>5} {'hits':>5} {'copies/step':>11} "
          f"{'MoE ms':>7} {'vs fixed':>8}")
    recorded = read_recorded(args.trace, setting.shape, args.warmup) if args.trace else None
    for i, trace_name in enumerate(["recorded"] if recorded else TRACES):
        fixed_step = 1000 / args.fixed_tok_s[i] if args.fixed_tok_s else setting.fixed_step_ms["conversation"
                                                                                                if recorded else trace_name]
        trace = recorded[1] if recorded else traces_for(setting, TRACES[trace_name], args.steps)[1]
        chance, again = reuse(trace[args.warmup:])
        for row in locality_rows(setting, prices, trace_name, args.steps, args.warmup, fixed_step, recorded):
            print(f"{trace_name:13} {chance:6.3f} {again:6.3f} {row.placement:46} "
                  f"{'' if row.whole is None else row.whole:>5} {row.hit_rate:5.0%} {row.copies_per_step:11.1f} "
                  f"{row.moe_ms:7.2f} {row.vs_fixed:7.3f}x", flush=True)
        print(f"{trace_name:13} the fixed step {fixed_step:.1f} ms")


PREFETCH_MODES = ("overlapped", "batched", "in graph")


@dataclass(frozen=True)
class Prefetch:
    """A predictor of layer l + 1's experts made at layer l (the next router applied early), and the GPU memory and
    copies spent acting on it."""

    accuracy: float  # each of the step's true top-k is in the prediction with this probability; wrong experts fill in
    staging: int  # slots of a prefetched layer's staging area, taken from the resident experts' budget
    copies: int | None = None  # copies a layer at most (None: as many as the staging area holds)
    seed: int = 0
    horizon: int = 1  # layers ahead: the prediction for layer l + horizon is made at layer l


@dataclass(frozen=True)
class PrefetchRun:
    hit_rate: float  # selections served by the GPU: resident, or staged and landed before the layer needed them
    copies_per_step: float
    skipped: float  # share of the wanted copies not started: they would have landed after their layer needed them
    moe_ms: float
    step_ms: float


def predict(chosen: np.ndarray, experts: int, accuracy: float, rng: np.random.Generator) -> np.ndarray:
    """The predictor's guess at a layer's experts: each of `chosen` kept with probability `accuracy`, each dropped
    one replaced by an expert not chosen, in an order that says nothing of which are right. Draws as many numbers
    whatever the outcome, so runs that differ only in timing see the same guesses."""
    kept = rng.random(len(chosen)) < accuracy
    others = np.setdiff1d(np.arange(experts), chosen)
    wrong = rng.choice(others, size=min(len(others), int((~kept).sum())), replace=False)
    return rng.permutation(np.concatenate([chosen[kept], wrong]))


def staged_placement(plan: Callable[[int], np.ndarray], fits: int, staging: int,
                     horizon: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(resident, staged): `plan(n)`'s placement of n experts, n the largest for which the plan's experts and a
    staging area of `staging` slots in each layer it leaves not wholly resident fit in `fits`. The first `horizon`
    layers have no staging area: no layer of the step comes early enough to predict them."""
    budget = fits
    while True:
        resident = plan(budget)
        staged = ~resident.all(axis=1)
        staged[:horizon] = False
        area = staging * int(staged.sum())
        if int(resident.sum()) + area <= fits or budget <= 0:
            return resident, staged
        budget = max(0, min(budget - 1, fits - area))


def launches(copies: int, prices: StepPrices, mode: str) -> float:
    """The host's ms queueing a layer's `copies`: one launch each (overlapped), one for all (batched), none where
    the decode graph holds a gather that reads the predicted ids on the GPU and pulls the experts from pinned RAM
    (in graph)."""
    if mode == "in graph":
        return 0.0
    return prices.copy_launch_ms * (copies if mode == "overlapped" else min(copies, 1))


def in_time(copies: int, clock: float, link: float, window_ms: float, prices: StepPrices, mode: str) -> bool:
    """Whether `copies` queued now, the copy stream busy until `link`, all land within `window_ms` of the host
    having queued them: the copy stream moves one expert in copy_ms at the measured PCIe rate."""
    queued = clock + launches(copies, prices, mode)
    return max(queued, link) + copies * prices.copy_ms <= queued + window_ms


def simulate_prefetch(trace: list[np.ndarray], resident: np.ndarray, staged: np.ndarray, prefetch: Prefetch,
                      prices: StepPrices, outside_ms: float, warmup: int, mode: str) -> PrefetchRun:
    """Replay `trace` with the fixed placement `resident` and, in each `staged` layer, a staging area filled ahead.

    A step runs its layers in turn, each taking outside_ms / layers (attention and the rest) and then its experts,
    priced by layers_ms with the staged experts that have landed counted as resident (the layer still priced as
    partly resident: staged experts are not in the decode graphs). When layer l's experts start, the predictor
    names layer l + h's (h the horizon); those neither resident nor staged there are copied, at most `copies`,
    each into the staging slot whose expert the prediction does not name and was used longest ago. The host queues
    them before it runs layer l (`launches`). The copy stream moves one expert in copy_ms, one after another, across
    layers and steps. Only copies in time start (`in_time`): the link's queue and layer l's priced time are known
    when the prediction is made, and a copy landing after layer l + h's experts start would only hold up later
    ones. The window counted is layer l's experts and h layers' share of the outside; the experts of the layers
    between are left out (unknown when deciding), so a copy judged in time is in time and, for h > 1, a few that
    would have been are not started."""
    layers, experts = resident.shape
    whole = resident.all(axis=1)
    budget = prefetch.staging if prefetch.copies is None else min(prefetch.copies, prefetch.staging)
    slot = np.full((layers, prefetch.staging), -1)  # the expert each staging slot holds
    used = np.full((layers, prefetch.staging), -1)  # the step its expert was last predicted or used
    landed = np.full((layers, prefetch.staging), np.inf)  # when its copy lands, on the run's clock
    rng = np.random.default_rng(prefetch.seed)
    outside = outside_ms / layers
    clock = link = 0.0
    hits = selections = copies = skipped = 0
    moe = step = 0.0
    for t, counts in enumerate(trace):
        timed, begun = t >= warmup, clock
        for layer in range(layers):
            clock += outside
            present = resident[layer].copy()
            ready = slot[layer][(slot[layer] >= 0) & (landed[layer] <= clock)]
            present[ready] = True
            cost = float(layers_ms(present[None], counts[layer][None], prices, whole[layer:layer + 1])[0])
            used[layer][np.isin(slot[layer], np.flatnonzero(counts[layer]))] = t
            if timed:
                hits += int(counts[layer][present].sum())
                selections += int(counts[layer].sum())
                moe += cost
            nxt = layer + prefetch.horizon
            if nxt < layers and staged[nxt]:
                guess = predict(np.flatnonzero(trace[t][nxt]), experts, prefetch.accuracy, rng)
                guess = guess[~resident[nxt, guess]]
                used[nxt][np.isin(slot[nxt], guess)] = t
                wanted = [int(e) for e in guess if e not in slot[nxt]][:budget]
                free = np.flatnonzero(~np.isin(slot[nxt], guess))  # slots the guess does not need, oldest first
                free = free[np.argsort(used[nxt][free], kind="stable")][:len(wanted)]
                n = len(free)
                while n and not in_time(n, clock, link, cost + prefetch.horizon * outside, prices, mode):
                    n -= 1
                if timed:
                    copies += n
                    skipped += len(wanted) - n
                if n:
                    clock += launches(n, prices, mode)
                    for expert, victim in zip(wanted, free[:n]):
                        link = max(clock, link) + prices.copy_ms
                        slot[nxt, victim], used[nxt, victim], landed[nxt, victim] = expert, t, link
            clock += cost
        if timed:
            step += clock - begun
    n = max(1, len(trace) - warmup)
    return PrefetchRun(hits / max(1, selections), copies / n, skipped / max(1, copies + skipped), moe / n, step / n)


@dataclass(frozen=True)
class Prediction:
    hit_rate: float
    swaps_per_step: float
    moe_ms: float  # the MoE layers' host ms a step, on average
    step_ms: dict  # per copy mode: the whole step, the part outside the experts included


def simulate(trace: list[np.ndarray], cache, prices: StepPrices, outside_ms: float, warmup: int) -> Prediction:
    """Replay `trace` (per-step [layer, expert] counts) through `cache` (ExpertCache or LruCache; one whose
    observe never swaps is the fixed placement), a swap decided after step t serving from t + 1, as
    expert_cache.replay does. The first `warmup` steps are untimed but teach the cache, as in the bench."""
    hits = selections = swaps = 0
    moe = 0.0
    step = dict.fromkeys(COPY_MODES, 0.0)
    pending = 0  # copies decided after the last step, paid in this one
    for t, counts in enumerate(trace):
        layers_ms = moe_ms(cache.resident, counts, prices)
        timed = t >= warmup
        if timed:
            hits += int(counts[cache.resident].sum())
            selections += int(counts.sum())
            moe += layers_ms
            swaps += pending
            for mode in COPY_MODES:
                plain = outside_ms + layers_ms
                step[mode] += plain + copies_ms(pending, plain, prices, mode)
        pending = len(cache.observe(counts))
    n = max(1, len(trace) - warmup)
    return Prediction(hits / max(1, selections), swaps / n, moe / n, {m: v / n for m, v in step.items()})


def hits_per_copy(cache: Prediction, fixed: Prediction, shape: TraceShape) -> float | None:
    """Selections a copy turned into hits: the cache's hits a step beyond the same placement kept fixed, per swap
    (one token a step). None without swaps."""
    if cache.swaps_per_step <= 0:
        return None
    return (cache.hit_rate - fixed.hit_rate) * shape.layers * shape.top_k / cache.swaps_per_step


def break_even(prices: StepPrices, mode: str) -> float:
    """Hits a copy must bring to pay for itself, in shares: what `copies_ms` adds for it where the step leaves the
    link time to move it (stalled: all of it; overlapped: its launch; batched: nothing)."""
    return copies_ms(1, np.inf, prices, mode) / prices.share_ms


def spread_placement(popularity: np.ndarray, fits: int, whole: int) -> np.ndarray:
    """`whole` layers (the busiest) wholly resident, the other slots shared evenly by the other layers, each
    filling its share with its most popular experts: every partly resident layer gets a cache of the same size."""
    layers, experts = popularity.shape
    on = np.zeros(popularity.shape, dtype=bool)
    by_traffic = np.argsort(-popularity.sum(axis=1), kind="stable")
    on[by_traffic[:whole]] = True
    rest = by_traffic[whole:]
    left = fits - whole * experts
    if len(rest) and left > 0:
        per, extra = divmod(left, len(rest))
        for i, layer in enumerate(rest):
            slots = min(experts - 1, per + (i < extra))
            on[layer, np.argsort(-popularity[layer], kind="stable")[:slots]] = True
    return on


@dataclass(frozen=True)
class Candidate:
    label: str
    placement: str  # a placement_for name
    make: Callable | str  # resident -> cache; "clairvoyant": Clairvoyant, which needs the trace


def candidates(prices: StepPrices, whole_for_spread: tuple[int, ...]) -> list[Candidate]:
    """The fixed placement, today's cache and the alternatives asked about (priced with other hysteresis, half-life
    or copy budget; unpriced; LRU within a copy budget), each from the engine's placement and from spread ones."""
    price = prices.swap_price()
    never = CachePolicy(swaps_per_step=0)

    def priced(policy=CachePolicy(), swap_price=price):
        return lambda r: ExpertCache(r, policy, price=swap_price)

    rows = [
        Candidate("fixed", "fixed", lambda r: ExpertCache(r, never)),
        Candidate("today: priced, every 1", "fixed", priced()),
        Candidate("today: priced, every 16", "fixed", priced(CachePolicy(interval=16))),
        Candidate("priced, no hysteresis", "fixed", priced(swap_price=replace(price, noise_sigmas=0.0))),
        Candidate("priced, half-life 8", "fixed", priced(CachePolicy(half_life=8.0))),
        Candidate("priced, 20 ms of copies a step", "fixed", priced(CachePolicy(copy_ms_per_step=20.0))),
        Candidate("unpriced (margin 1.5, 4 a step)", "fixed", lambda r: ExpertCache(r, CachePolicy())),
        Candidate("LRU, 4 copies a step", "fixed", lambda r: LruCache(r, 4)),
        Candidate("LRU, unlimited", "fixed", lambda r: LruCache(r)),
        Candidate("fixed", "whole", lambda r: ExpertCache(r, never)),
    ]
    for whole in whole_for_spread:
        where = f"spread {whole}"
        rows += [
            Candidate("fixed", where, lambda r: ExpertCache(r, never)),
            Candidate("today: priced, every 1", where, priced()),
            Candidate("priced, no hysteresis, 20 ms", where,
                      priced(CachePolicy(copy_ms_per_step=20.0), replace(price, noise_sigmas=0.0))),
            Candidate("LRU, 16 copies a step", where, lambda r: LruCache(r, 16)),
            Candidate("LRU, 64 copies a step", where, lambda r: LruCache(r, 64)),
            Candidate("LRU, unlimited", where, lambda r: LruCache(r)),
        ]
    return rows + [Candidate("bound: clairvoyant, unlimited copies", where, "clairvoyant")
                   for where in ("fixed", *(f"spread {w}" for w in whole_for_spread))]


def traces_for(setting: Setting, params: TraceParams, steps: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(calibration counts of another conversation, the replayed trace's per-step counts): the bench's seeds."""
    shape = setting.shape
    calibration = sum(step_counts(s, shape.experts) for s in synthetic_trace(shape, 300, params, seed=99))
    trace = [step_counts(s, shape.experts) for s in synthetic_trace(shape, steps, params, seed=5)]
    return np.asarray(calibration, dtype=float), trace


def engine_plan(calibration: np.ndarray, setting: Setting, prices: StepPrices, fits: int) -> np.ndarray:
    """The engine's placement of `fits` experts (whole layers where the latency model says they pay)."""
    layers, experts = calibration.shape
    return plan_placement(1, layers, experts, calibration, fits, 0, layer_costs=prices.layer_costs(),
                          top_k=setting.shape.top_k).on_gpu


def placement_for(name: str, calibration: np.ndarray, setting: Setting, prices: StepPrices) -> np.ndarray:
    """"fixed": the engine's plan; "whole": its whole layers alone, the slots left over empty; "spread N"."""
    if name in ("fixed", "whole"):
        plan = engine_plan(calibration, setting, prices, setting.resident)
        return plan if name == "fixed" else plan & plan.all(axis=1, keepdims=True)
    return spread_placement(calibration, setting.resident, int(name.split()[1]))


# Staging slots a layer tried by default: a token's top-k and twice that (Mixtral: one and two of its 99 MB experts).
STAGING = {"qwen3-30b-a3b": (8, 16), "mixtral-8x7b": (1, 2)}
TARGET = 1.25  # issue 42's expert cache target against the fixed placement


def prefetch_table(name: str, setting: Setting, prices: StepPrices, accuracies: list[float], stagings, horizons,
                   args: argparse.Namespace) -> None:
    """Prefetch at each staging size and accuracy against the engine's fixed placement at the whole budget, both
    traces; then the least accuracy that reaches TARGET."""
    gib = prices.expert_bytes / 2 ** 30
    print(f"{name}: {setting.shape.layers} layers of {setting.shape.experts} experts, top-{setting.shape.top_k}, "
          f"{setting.resident} resident ({setting.resident * gib:.1f} GiB of experts); prices (ms) {prices}")
    print(f"{'trace':13} {'horizon':>7} {'staging':>7} {'GiB':>5} {'resident':>8} {'whole':>5} {'accuracy':>8} "
          f"{'hits':>5} {'copies/step':>11} {'skipped':>7} "
          + " ".join(f"{m + ' ms':>13} {'vs fixed':>8}" for m in PREFETCH_MODES))
    reached: dict[tuple, float] = {}
    for trace_name, params in TRACES.items():
        calibration, trace = traces_for(setting, params, args.steps)
        fixed_resident = engine_plan(calibration, setting, prices, setting.resident)
        still = simulate(trace, ExpertCache(fixed_resident, CachePolicy(swaps_per_step=0)), prices, 0.0, args.warmup)
        fixed_moe = still.moe_ms
        outside = setting.fixed_step_ms[trace_name] - fixed_moe if args.outside_ms is None else args.outside_ms
        fixed = outside + fixed_moe
        print(f"{trace_name:13} {'':>7} {'fixed':>7} {0:5.1f} {int(fixed_resident.sum()):8} "
              f"{int(fixed_resident.all(axis=1).sum()):5} {'':>8} {still.hit_rate:5.0%}"
              f" {0:11.2f} {'':>7} " + " ".join(f"{fixed:13.2f} {1:7.3f}x" for _ in PREFETCH_MODES))
        for horizon, staging in [(h, n) for h in horizons for n in stagings]:
            resident, staged = staged_placement(lambda n: engine_plan(calibration, setting, prices, n),
                                                setting.resident, staging, horizon)
            area = staging * int(staged.sum())
            for accuracy in accuracies:
                prefetch = Prefetch(accuracy, staging, horizon=horizon)
                runs = {m: simulate_prefetch(trace, resident, staged, prefetch, prices, outside, args.warmup, m)
                        for m in PREFETCH_MODES}
                first = runs[PREFETCH_MODES[-1]]
                cells = " ".join(f"{r.step_ms:13.2f} {fixed / r.step_ms:7.3f}x" for r in runs.values())
                print(f"{trace_name:13} {horizon:7} {staging:7} {area * gib:5.1f} {int(resident.sum()):8} "
                      f"{int(resident.all(axis=1).sum()):5} {accuracy:8.2f} {first.hit_rate:5.0%} "
                      f"{first.copies_per_step:11.2f} {first.skipped:7.0%} {cells}", flush=True)
                for mode, r in runs.items():
                    if fixed / r.step_ms >= TARGET:
                        key = (trace_name, horizon, staging, mode)
                        reached[key] = min(reached.get(key, np.inf), accuracy)
    for trace_name in TRACES:
        for horizon, staging in [(h, n) for h in horizons for n in stagings]:
            key = (trace_name, horizon, staging)
            found = ", ".join(f"{m} from accuracy {reached[(*key, m)]:.2f}" if (*key, m) in reached
                              else f"{m} never" for m in PREFETCH_MODES)
            print(f"{TARGET}x fixed on {trace_name}, horizon {horizon}, staging {staging} a layer: {found}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SETTINGS), action="append", help="default: both")
    parser.add_argument("--steps", type=int, default=256, help="decode steps replayed, warm-up included")
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--spread", default="0,7", help="whole layers of the spread placements tried")
    parser.add_argument("--resident-launch-ms", type=float, help="in place of the profile's (a sensitivity check)")
    parser.add_argument("--profile", metavar="JSON", help="price from this start-up profile (profile-<key>.json in "
                        "the engine's cache) in place of PRICES; with one --shape")
    parser.add_argument("--outside-ms", type=float,
                        help="the step outside the experts, in place of the eager bench's (e.g. with CUDA graphs)")
    parser.add_argument("--locality", action="store_true",
                        help="what the traces leave a cache to follow and the bounds on what following it gains")
    parser.add_argument("--fixed-tok-s", metavar="CONV,NOLOC",
                        help="the fixed placement's measured tok/s on each trace, in place of the bench's rows "
                        "(SETTINGS); with --trace, one rate")
    parser.add_argument("--trace", metavar="JSONL", help="--locality on a recorded routing trace of the --shape "
                        "(tests/perf/record_routing.py) in place of the synthetic ones")
    parser.add_argument("--prefetch", action="store_true",
                        help="replay prefetch from a predictor of the next layer's experts instead of the caches")
    parser.add_argument("--accuracy", default="0.5,0.7,0.8,0.9,1.0", help="the predictor's accuracies (--prefetch)")
    parser.add_argument("--horizon", default="1", help="layers ahead the predictor names, comma-separated "
                        "(--prefetch; its accuracy is the same at each: say so when reading a row)")
    parser.add_argument("--staging", help="staging slots a layer, comma-separated (--prefetch; default: the "
                        "shape's STAGING)")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be in 0..--steps - 1")
    spread = tuple(int(n) for n in args.spread.split(",") if n)
    if args.fixed_tok_s is not None:
        try:
            args.fixed_tok_s = [float(x) for x in args.fixed_tok_s.split(",")]
        except ValueError as e:
            parser.error(f"--fixed-tok-s: {e}")
        wanted = 1 if args.trace else len(TRACES)
        if len(args.fixed_tok_s) != wanted or min(args.fixed_tok_s) <= 0:
            parser.error(f"--fixed-tok-s takes {wanted} rate(s) > 0: " + ("the recorded trace's" if args.trace
                                                                            else "conversation, no locality"))
    if args.trace and (not args.locality or len(args.shape or []) != 1):
        parser.error("--trace is read by --locality, for one --shape")
    measured = None
    if args.profile:
        if len(args.shape or []) != 1:
            parser.error("--profile prices one shape: name it with --shape")
        try:
            with open(args.profile) as f:
                measured = StepPrices.from_profile(json.load(f))
        except (OSError, ValueError, MoedeskError) as e:
            parser.error(f"--profile {args.profile}: {e}")
    try:
        accuracies = [float(a) for a in args.accuracy.split(",") if a]
        stagings = [int(n) for n in args.staging.split(",") if n] if args.staging else None
        horizons = [int(n) for n in args.horizon.split(",") if n]
    except ValueError as e:
        parser.error(f"--accuracy / --staging / --horizon: {e}")
    if not all(0 <= a <= 1 for a in accuracies) or min([*(stagings or []), *horizons], default=1) < 1:
        parser.error("--accuracy takes values in 0..1, --staging and --horizon counts >= 1")
    for name in args.shape or list(SETTINGS):
        setting, prices = SETTINGS[name], measured or PRICES[name]
        if args.resident_launch_ms is not None:
            prices = replace(prices, resident_launch_ms=args.resident_launch_ms)
        if args.locality:
            try:
                locality_table(name, setting, prices, args)
            except MoedeskError as e:
                parser.error(f"--trace: {e}")
            continue
        if args.prefetch:
            prefetch_table(name, setting, prices, accuracies, stagings or STAGING[name], horizons, args)
            continue
        print(f"{name}: {setting.shape.layers} layers of {setting.shape.experts} experts, top-{setting.shape.top_k}, "
              f"{setting.resident} resident; prices (ms) {prices}")
        print(f"a copy pays when it brings {break_even(prices, 'stalled'):.1f} more hits (stalled), "
              f"{break_even(prices, 'overlapped'):.1f} (overlapped), 0 (batched) where the link has time")
        print(f"{'trace':13} {'placement':9} {'policy':36} {'whole':>5} {'hits':>5} {'swaps/step':>10} "
              f"{'hits/copy':>9} {'MoE ms':>7} " + " ".join(f"{m + ' ms':>13} {'vs fixed':>8}" for m in COPY_MODES))
        for trace_name, params in TRACES.items():
            calibration, trace = traces_for(setting, params, args.steps)
            outside = None
            base = None
            still: dict[str, Prediction] = {}  # each placement's fixed row
            for cand in candidates(prices, spread):
                resident = placement_for(cand.placement, calibration, setting, prices)
                if outside is None:  # the first row is the engine's fixed placement: the bench's step sets the rest
                    fixed_moe = simulate(trace, cand.make(resident), prices, 0.0, args.warmup).moe_ms
                    outside = setting.fixed_step_ms[trace_name] - fixed_moe if args.outside_ms is None \
                        else args.outside_ms
                cache = Clairvoyant(resident, trace) if cand.make == "clairvoyant" else cand.make(resident)
                p = simulate(trace, cache, prices, outside, args.warmup)
                base = base or p
                still.setdefault(cand.placement, p)
                gained = hits_per_copy(p, still[cand.placement], setting.shape)
                cells = " ".join(f"{p.step_ms[m]:13.2f} {base.step_ms[m] / p.step_ms[m]:7.3f}x" for m in COPY_MODES)
                print(f"{trace_name:13} {cand.placement:9} {cand.label:36} {int(resident.all(axis=1).sum()):5} "
                      f"{p.hit_rate:5.0%} {p.swaps_per_step:10.2f} {'' if gained is None else f'{gained:.2f}':>9} "
                      f"{p.moe_ms:7.2f} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
