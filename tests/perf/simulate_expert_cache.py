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

The prices are the H200 box's, session 35 (docs/measurements.md): the bench's start-up profiles (one expert on the
CPU at one token, one copy, the read bandwidth) and, for what those logs do not print (a call's own cost, the round
trip, the launches), the full profiles of the same session's Qwen3.5 and gpt-oss runs; `PRICES` says which is which.
The step's part outside the experts is what the eager bench measured for the fixed placement less the model's MoE
time, so the step times read against that bench's tok/s.

    python3 tests/perf/simulate_expert_cache.py                 # both shapes, both traces, ~2 min on one core
    python3 tests/perf/simulate_expert_cache.py --shape qwen3-30b-a3b --steps 128
    python3 tests/perf/simulate_expert_cache.py --shape qwen3-30b-a3b --profile ~/.cache/moedesk/profile-<key>.json
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
from moedesk.engine.offload.routing_trace import (CONVERSATION, NO_LOCALITY, TraceParams, TraceShape, step_counts,
                                                  synthetic_trace)

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
        """As SwapPrice.from_model prices a swap: a selection's share against a copy and its launch."""
        return SwapPrice(self.share_ms, self.copy_ms + self.copy_launch_ms)


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
    partial = ~resident.all(axis=1)
    misses = np.where(resident, 0, counts).sum(axis=1)[partial]
    hits = np.where(resident, counts, 0).sum(axis=1)[partial]
    moved = (misses > 0) & (hits * prices.share_ms < prices.resident_launch_ms)
    launched = (hits > 0) & ~moved
    return float(partial.sum() * prices.roundtrip_ms + (misses > 0).sum() * prices.call_ms
                 + (misses.sum() + hits[moved].sum()) * prices.share_ms + launched.sum() * prices.resident_launch_ms)


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


def placement_for(name: str, calibration: np.ndarray, setting: Setting, prices: StepPrices) -> np.ndarray:
    """"fixed": the engine's plan; "whole": its whole layers alone, the slots left over empty; "spread N"."""
    if name in ("fixed", "whole"):
        layers, experts = calibration.shape
        plan = plan_placement(1, layers, experts, calibration, setting.resident, 0, layer_costs=prices.layer_costs(),
                              top_k=setting.shape.top_k).on_gpu
        return plan if name == "fixed" else plan & plan.all(axis=1, keepdims=True)
    return spread_placement(calibration, setting.resident, int(name.split()[1]))


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
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be in 0..--steps - 1")
    spread = tuple(int(n) for n in args.spread.split(",") if n)
    measured = None
    if args.profile:
        if len(args.shape or []) != 1:
            parser.error("--profile prices one shape: name it with --shape")
        try:
            with open(args.profile) as f:
                measured = StepPrices.from_profile(json.load(f))
        except (OSError, ValueError, MoedeskError) as e:
            parser.error(f"--profile {args.profile}: {e}")
    for name in args.shape or list(SETTINGS):
        setting, prices = SETTINGS[name], measured or PRICES[name]
        if args.resident_launch_ms is not None:
            prices = replace(prices, resident_launch_ms=args.resident_launch_ms)
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
