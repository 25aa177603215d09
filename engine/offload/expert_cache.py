"""A GPU expert cache that follows the routing: which experts to swap onto the GPU after each step.

The placement at load fills each layer's GPU slots with the experts calibration found popular. Real
conversations move: an expert a layer just used is likely to be used again soon, while a list of
experts popular on average covers little of any one conversation (docs/expert-cache.md). So after
each step every expert's score decays and gains its new selections; an expert that is not resident
takes the slot of the weakest resident one of its layer when its score beats that one's by a margin
(hysteresis: two experts of nearly equal use never trade places back and forth), a few swaps per step
at most, so the copies fit between steps on the copy stream.

With a `SwapPrice` (the placement's perf model: what an offloaded expert's selection costs the CPU, what a copy
costs) a swap must pay: a decayed score is about the selections an expert will get over the cache's memory, so
(newcomer's score - resident's score - their noise) x the CPU's price of a selection is the predicted saving, and it
must exceed the copy's price. The noise (what recent-use counts of equally used experts differ by) is the
hysteresis: routing without locality then makes next to no swaps. A hit saves that price only where the executor
launches the layer's GPU share; where the layer's hits a step would cost the CPU less than the launch, it computes
them on the CPU and a swap into that layer buys nothing (`hits_launched`). A step handed over to the host inside the
decode graphs (kernels.host_handoff) runs the resident share in the graph, with no launch: there every hit saves its
price. A swap costs one expert's copy over the link: the executor rewrites the slot maps in place, so the captured
graphs stay valid (no recapture), and the admitted expert is computed in the resident share (no launch of its own).

Swaps stay within a layer (each layer's GPU slots are one tensor), so a layer whose every expert is resident never
changes: it runs inside the decode graphs with no handoff, which the placement priced when it made it whole
(engine.offload.placement.plan_placement); the cache follows the routing in the layers partly resident.

Decisions only: `ExpertCache` holds scores and residency and says what to swap; the executor does
the copies (engine.offload.offload_executor).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class CachePolicy:
    half_life: float = 32.0  # steps after which a selection counts half
    margin: float = 1.5  # unpriced: a newcomer's score must exceed the resident's by this factor
    min_score: float = 1.0  # and reach this: one selection long ago does not earn a copy
    swaps_per_step: int = 4  # across all layers, on average (unpriced)
    copy_ms_per_step: float = 1.0  # priced: the copies' time across all layers, on average (a few big experts, or
    # many small ones: Mixtral's 99 MB and Qwen3-30B-A3B's 2.6 MB Q4_K experts)
    interval: int = 1  # steps between two rounds of swaps

    def __post_init__(self):
        if (self.half_life <= 0 or self.margin < 1 or self.swaps_per_step < 0 or self.copy_ms_per_step < 0
                or self.interval < 1):
            raise ValueError("half_life must be > 0, margin >= 1, swaps_per_step and copy_ms_per_step >= 0 and "
                             "interval >= 1")


@dataclass(frozen=True)
class SwapPrice:
    """The placement's perf model as a swap sees it, in ms."""

    cpu_selection_ms: float  # one selection of an offloaded expert, one token (placement.LayerCosts.cpu_expert_ms)
    copy_ms: float  # one expert onto the GPU: its bytes over the link
    # Standard deviations of the scores' noise a difference must clear (the hysteresis): two, as the pairs compared are
    # extremes (a layer's strongest outsiders against its weakest residents) of many noisy counts.
    noise_sigmas: float = 2.0
    # The host's queueing of a partly resident layer's GPU experts. Where their selections cost the CPU less, the
    # executor computes them there (engine.offload.assignment.resident_on_cpu): such hits save nothing.
    resident_launch_ms: float = 0.0

    @classmethod
    def from_model(cls, costs) -> "SwapPrice":
        """From an engine.offload.latency_model.LatencyModel: its one-token figures. A swap's copy is its bytes alone
        (`copy_expert_ms`): not `copy_launch_ms`, which adds a copied expert's own compute launch; a swapped-in expert
        runs in its layer's resident share, and the slot maps are rewritten in place (no graph captured again)."""
        return cls(costs.cpu_expert_ms(1), costs.copy_expert_ms, resident_launch_ms=costs.resident_launch_ms)

    def in_graph(self) -> "SwapPrice":
        """The price in a step handed over inside the decode graphs: the resident share runs in the graph, so no
        launch on the host for hits to outweigh (`hits_launched` then holds for any hits)."""
        return replace(self, resident_launch_ms=0.0)


@dataclass(frozen=True)
class Swap:
    layer: int  # index among the MoE layers (the rows of `resident`)
    evict: int
    admit: int


class ExpertCache:
    """Scores and residency of [layers, experts]; `observe` a step's selections, get the swaps to make."""

    def __init__(self, resident: np.ndarray, policy: CachePolicy = CachePolicy(), scores: np.ndarray | None = None,
                 price: SwapPrice | None = None, score_steps: float | None = None):
        """price None: a newcomer replaces a resident when its score is `margin` times the resident's (unpriced).
        score_steps: the decayed count of steps `scores` hold (an earlier cache's, carried with its scores)."""
        self.resident = np.array(resident, dtype=bool)
        self.policy, self.price = policy, price
        self.scores = np.zeros(self.resident.shape) if scores is None else np.array(scores, dtype=float)
        self._decay = 0.5 ** (1.0 / policy.half_life)
        # The decayed count of steps the scores hold (scores given without it: as many as they would hold in the long
        # run), so that score / score_steps is selections a step from the first step on.
        if score_steps is None:
            score_steps = 0.0 if scores is None else 1.0 / (1.0 - self._decay)
        self.score_steps = score_steps
        # A layer entirely on the GPU (or entirely off it) has nothing to trade.
        self.mixed_layers = self._mixed = np.flatnonzero(self.resident.any(axis=1) & ~self.resident.all(axis=1))
        self._credit_ms = 0.0  # copy time paid for and not spent (priced)
        self.hits = 0
        self.selections = 0
        self.swaps = 0
        self.steps = 0

    def observe(self, counts: np.ndarray, in_graph: bool = False) -> list[Swap]:
        """Fold in one step's selections per [layer, expert]; the swaps to make now, best first.
        `resident` already reflects them: the caller copies each admitted expert into its slot.
        in_graph: the step was handed over inside the decode graphs, its resident shares launched by no host
        (`SwapPrice.in_graph`)."""
        counts = np.asarray(counts)
        self.hits += int(counts[self.resident].sum())
        self.selections += int(counts.sum())
        self.scores *= self._decay
        self.scores += counts
        self.score_steps = self.score_steps * self._decay + 1.0
        self.steps += 1
        swaps: list[Swap] = []
        if len(self._mixed) == 0 or self.steps % self.policy.interval:
            return swaps
        budget = self.swap_budget()
        if budget == 0:
            return swaps
        # Per layer, the strongest outsiders against the weakest residents, paired in order; all layers at once.
        rows = self._mixed
        score, on = self.scores[rows], self.resident[rows]
        n = min(budget, on.shape[1])
        pairs = np.minimum((~on).sum(axis=1), on.sum(axis=1))[:, None]  # how many pairs each layer has
        outside = np.argsort(np.where(on, np.inf, -score), axis=1, kind="stable")[:, :n]
        inside = np.argsort(np.where(on, score, np.inf), axis=1, kind="stable")[:, :n]
        admit_score = np.take_along_axis(score, outside, axis=1)
        evict_score = np.take_along_axis(score, inside, axis=1)
        gain = swap_gain(admit_score, evict_score, self.policy, self.price)
        if self.price is not None:  # a layer whose hits, swaps made, still go to the CPU gains nothing from them
            price = self.price.in_graph() if in_graph else self.price
            resident_after = np.where(on, score, 0.0).sum(axis=1, keepdims=True) + np.cumsum(
                np.where(np.arange(n) < pairs, admit_score - evict_score, 0.0), axis=1)
            gain = np.where(hits_launched(resident_after / self.score_steps, price), gain, -np.inf)
        # A pair counts only while every stronger pair of its layer does too.
        good = (gain > 0) & (admit_score >= self.policy.min_score) & (np.arange(n) < pairs)
        good = np.cumprod(good, axis=1).astype(bool)
        order = np.argsort(-np.where(good, gain, -np.inf), axis=None, kind="stable")[:budget]
        for flat in order:
            i, j = divmod(int(flat), n)
            if not good[i, j]:
                break
            layer, evict, admit = int(rows[i]), int(inside[i, j]), int(outside[i, j])
            self.resident[layer, evict], self.resident[layer, admit] = False, True
            swaps.append(Swap(layer, evict, admit))
        self.swaps += len(swaps)
        if self.price is not None:
            self._credit_ms = max(0.0, self._credit_ms - len(swaps) * self.price.copy_ms)
        return swaps

    def swap_budget(self) -> int:
        """Swaps this round may make (asked once a round). Priced: as many copies as `copy_ms_per_step` has paid for since the last ones,
        unspent time carried over up to a round's or one copy's worth (so an expert bigger than a round's budget
        still moves, less often)."""
        policy = self.policy
        if self.price is None:
            return policy.swaps_per_step * policy.interval
        if self.price.copy_ms <= 0:
            return int(self.resident.sum())
        round_ms = policy.copy_ms_per_step * policy.interval
        self._credit_ms = min(self._credit_ms + round_ms, max(round_ms, self.price.copy_ms))
        return int(self._credit_ms / self.price.copy_ms)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.selections if self.selections else 0.0


def swap_gain(admit: np.ndarray, evict: np.ndarray, policy: CachePolicy, price: SwapPrice | None) -> np.ndarray:
    """What admitting an expert of score `admit` in place of a resident of score `evict` is worth; > 0: swap.
    Priced: ms saved over the scores' memory (a score counts the selections of about that many steps) less a copy,
    the difference first cut by its noise (two decayed Poisson counts differ with variance (a + e) / (1 + decay)):
    the hysteresis, so experts used alike never trade places. Unpriced: `admit` must be `margin` times `evict`."""
    if price is None:
        return admit - policy.margin * evict
    decay = 0.5 ** (1.0 / policy.half_life)
    noise = price.noise_sigmas * np.sqrt((admit + evict) / (1.0 + decay))
    return (admit - evict - noise) * price.cpu_selection_ms - price.copy_ms


def hits_launched(hits_a_step: np.ndarray, price: SwapPrice) -> np.ndarray:
    """Whether a partly resident layer whose resident experts get `hits_a_step` selections a step has them computed
    on the GPU: the executor launches the GPU's share only where those selections would cost the CPU more than the
    launch (assignment.resident_on_cpu). Where not (Qwen3-30B-A3B's small experts at one token, a few hits a step:
    docs/measurements.md, "what the expert cache's traces leave to follow"), a swap into the layer buys no time and
    only costs its copy."""
    return hits_a_step * price.cpu_selection_ms >= price.resident_launch_ms


@dataclass(frozen=True)
class Replay:
    hit_rate: float
    swaps: int
    steps: int

    @property
    def swaps_per_step(self) -> float:
        return self.swaps / self.steps if self.steps else 0.0


def replay(counts_per_step, resident: np.ndarray, policy: CachePolicy | None, price: SwapPrice | None = None) -> Replay:
    """Hit rate and swaps over a trace's steps (per-step [layer, expert] counts). policy None: the placement
    stays fixed. A swap decided after step t serves from step t + 1 on, as in the engine."""
    cache = ExpertCache(resident, policy or CachePolicy(swaps_per_step=0), price=price if policy else None)
    steps = 0
    for counts in counts_per_step:
        cache.observe(counts)
        steps += 1
    return Replay(cache.hit_rate, cache.swaps, steps)


def policy_from_env(value: str | None) -> CachePolicy | None:
    """MOEDESK_EXPERT_CACHE: unset, "" or "0" keeps the placement fixed; "1" the default policy; "N" rounds of
    swaps every N steps."""
    if not value or value == "0":
        return None
    try:
        interval = int(value)
    except ValueError:
        raise ValueError(f"MOEDESK_EXPERT_CACHE={value!r}: expected 0, 1 or a number of steps") from None
    return CachePolicy(interval=max(1, interval))
