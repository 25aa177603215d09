"""Assignment, a pure decision made at every layer step: where each offloaded expert with tokens runs.

No tensors and no devices here, so every rule is unit-tested on hand-made numbers. An offloaded expert either
runs on the CPU (its tokens' activations travel instead of its weights) or is copied over PCIe and runs on the
GPU. Fiddler decides expert by expert (`fiddler_rule`); `assign_offloaded` instead splits the set so that the
CPU queue and the copy→GPU pipeline, which run at the same time, end together. Which experts live on the GPU
at all is engine.offload.placement's, decided at load.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Callable, Iterable, Literal, Protocol, Sequence

# Subsets an exact assignment search may cover: every set of up to 16 offloaded experts, and
# larger ones whose loads repeat enough (experts with equal loads are interchangeable).
EXACT_LIMIT = 1 << 16
_EPS = 1e-12


class ExpertCosts(Protocol):
    """What the assignment reads from a latency model (engine.offload.latency_model.LatencyModel has it)."""

    copy_expert_ms: float

    def cpu_expert_ms(self, tokens: int) -> float: ...  # an expert's share of the CPU's call (`cpu_call_ms`)

    def gpu_expert_ms(self, tokens: int) -> float: ...

    def activation_roundtrip_ms(self, tokens: int) -> float: ...


@dataclass(frozen=True)
class Costs:
    """ExpertCosts from plain callables: hand-made tables in tests, interpolated profiles in benchmarks."""

    cpu_ms: Callable[[int], float]
    gpu_ms: Callable[[int], float]
    copy_ms: float
    roundtrip_ms: float = 0.0

    @property
    def copy_expert_ms(self) -> float:
        return self.copy_ms

    def cpu_expert_ms(self, tokens: int) -> float:
        return self.cpu_ms(tokens)

    def gpu_expert_ms(self, tokens: int) -> float:
        return self.gpu_ms(tokens)

    def activation_roundtrip_ms(self, tokens: int) -> float:
        return self.roundtrip_ms


@dataclass(frozen=True)
class Contended:
    """A model's costs while the CPU experts and the copies run at the same time: each side slowed by
    the factor the profiler measured with both running, CPU experts of about `tokens` tokens each
    (the model's `slowdowns`; 1 where a model has none)."""

    model: ExpertCosts
    tokens: float = 1.0
    apart: bool = False  # each side alone (no contention), still priced at these loads (`copy_launch_ms`)
    # The executor's CPU call runs beside the queueing of the copies (OffloadExecutor's overlap_copies): a copy's
    # launch then holds back the copies that follow it, not the CPU.
    overlap: bool = False
    # A prefill step's copied experts computed in copy runs, one grouped launch each (OffloadExecutor's copy_runs): a
    # copy then costs the host only its queueing, and the step one launch (`copy_step_ms`).
    grouped_copies: bool = False
    factors: tuple[float, float] = field(init=False)  # (CPU, copy); every cost the split search prices reads them

    def __post_init__(self):
        slowdowns = None if self.apart else getattr(self.model, "slowdowns", None)
        object.__setattr__(self, "factors", slowdowns(self.tokens) if slowdowns else (1.0, 1.0))

    @property
    def copy_expert_ms(self) -> float:
        copy = self.model.copy_expert_ms * self.factors[1]
        return max(copy, self._launch()) if self.overlap else copy  # the link waits for each copy to be queued

    @property
    def copy_launch_ms(self) -> float:
        return 0.0 if self.overlap else self._launch()

    @property
    def copy_step_ms(self) -> float:
        """Added to the GPU's finish once a step copies anything: with grouped copies, a copy run's launch (host
        time, as one copy's launch measured) and its compute after the last copy landed (one expert's at the mean
        load)."""
        if not self.grouped_copies:
            return 0.0
        at = getattr(self.model, "copy_launch_at", None)
        launch = at(self.tokens) if at else copy_launch_ms(self.model)
        return launch + self.model.gpu_expert_ms(max(1, round(self.tokens)))

    def _launch(self) -> float:
        if self.grouped_copies:  # the copy's queueing alone: its compute is the run's launch
            return getattr(self.model, "copy_queue_ms", 0.0)
        # Queued back to back for a step of these loads where the profile measured that (a prefill's copies).
        at = getattr(self.model, "copy_launch_at", None)
        return at(self.tokens) if at else copy_launch_ms(self.model)

    def cpu_expert_ms(self, tokens: int) -> float:
        return self.model.cpu_expert_ms(tokens) * self.factors[0]

    def cpu_call_ms(self, tokens: float) -> float:
        return cpu_call_ms(self.model, tokens)  # waking the pool and quantising activations: not reads

    def gpu_expert_ms(self, tokens: int) -> float:
        # Grouped, a copied expert's device time hides under the link's (Qwen3.5's q4_k experts in session 36's
        # trace: docs/measurements.md, "Prefill's copies"): the run's launch is `copy_step_ms`.
        return 0.0 if self.grouped_copies else self.model.gpu_expert_ms(tokens)

    def activation_roundtrip_ms(self, tokens: int) -> float:
        return self.model.activation_roundtrip_ms(tokens)


# From this many tokens an expert on average (a prefill chunk of a prompt, not a decode step's few), a step's copied
# experts are computed in copy runs, one grouped launch each (OffloadExecutor's copy_runs); decode keeps one by one.
# Sixteen sequences on a model's own skewed routing reach 4-5 tokens an expert, where the copy runs' price (measured on
# prefills) chose copies that made the step slower than none (docs/measurements.md, "Session 58"): hence 8, not 4.
GROUPED_COPIES_MIN_LOAD = 8.0
MAX_COPY_RUNS = 4  # run counts tried, from the fewest the size limit allows up
# A copy run of packed experts with many tokens is dequantised to bf16 scratch for torch's grouped GEMM
# (kernels.gpu_quant): this much GPU memory at most, so that a small GPU's runs stay small.
COPY_RUN_SCRATCH_BYTES = 1 << 30


# Experts of at most this many weights (3·H·F) run in one grouped launch at any load: one GEMM an expert is
# launch-bound on small experts, paying off on large ones only (docs/measurements.md, "The offload path").
SMALL_EXPERT_WEIGHTS = 1 << 24


def resident_grouped(sizes: Sequence[int], hidden: int, width: int, grouped_max: int,
                     slots: int | None = None) -> bool:
    """Whether a step's resident experts (tokens `sizes`) run in one grouped launch rather than one GEMM each: always
    while none has more than `grouped_max` tokens (a decode step's few); at prefill loads only for small experts
    (SMALL_EXPERT_WEIGHTS), and only where a copy run's scratch (`copy_run_limit`) holds the `slots` experts the launch
    spans (default: len(sizes)), as it dequantises them to bf16 there."""
    active = [n for n in sizes if n > 0]
    if not active:
        return False
    if max(active) <= grouped_max:
        return True
    spans = len(sizes) if slots is None else slots
    return 3 * hidden * width <= SMALL_EXPERT_WEIGHTS and spans <= copy_run_limit(hidden, width)


def copy_run_limit(hidden: int, width: int) -> int:
    """The most experts of this shape (H, F) a copy run may hold: their gate/up and down in bf16 within
    COPY_RUN_SCRATCH_BYTES."""
    return max(1, COPY_RUN_SCRATCH_BYTES // (3 * hidden * width * 2))


def copy_runs(loads: dict[int, int], copy: Sequence[int], model, limit: int | None = None) -> list[int] | None:
    """The sizes of the copy runs a step's copied experts `copy` (in copy order) are computed in, one grouped launch
    each once the run's copies landed; None: one by one, as each copy lands (a decode step's few tokens an expert:
    GROUPED_COPIES_MIN_LOAD). Of even runs of at most `limit` experts (`copy_run_limit`; None: any), MAX_COPY_RUNS
    counts from the fewest up, the count whose `copy_runs_gpu_ms` is the least (ties: fewer): more runs start the GPU
    earlier and leave less compute after the last copy, but each costs the host a launch."""
    if not copy or mean_load(loads) < GROUPED_COPIES_MIN_LOAD:
        return None
    fewest = -(-len(copy) // limit) if limit else 1
    options = [_even(len(copy), k) for k in range(fewest, min(fewest + MAX_COPY_RUNS - 1, len(copy)) + 1)]
    return min(options, key=lambda sizes: copy_runs_gpu_ms([loads[e] for e in copy], sizes, model))


def _even(count: int, parts: int) -> list[int]:
    return [count // parts + (i < count % parts) for i in range(parts)]


def copy_runs_gpu_ms(loads: Sequence[int], sizes: Sequence[int], model) -> float:
    """When the GPU finishes a step's copied experts (tokens `loads`, in copy order) in copy runs of `sizes`.

    The host queues the first run's copies, then for each run the next run's copies and this run's grouped launch
    (OffloadExecutor._queue_copy_runs): each copy costs it `copy_queue_ms` and the link `copy_expert_ms` once
    queued, each launch `copy_launch_at` the mean load; a run computes (as one expert of all its tokens,
    `gpu_expert_ms`) once its copies landed, its launch is queued and the run before it is done."""
    queue, link_ms = getattr(model, "copy_queue_ms", 0.0), model.copy_expert_ms
    at = getattr(model, "copy_launch_at", None)
    launch = at(mean_load(dict(enumerate(loads)))) if at else copy_launch_ms(model)
    starts = list(accumulate(sizes, initial=0))
    host = link = gpu = 0.0
    ready = []

    def queue_run(j: int) -> None:
        nonlocal host, link
        for _ in range(sizes[j]):
            host += queue
            link = max(link, host) + link_ms
        ready.append(link)

    queue_run(0)
    for j in range(len(sizes)):
        if j + 1 < len(sizes):
            queue_run(j + 1)
        host += launch
        tokens = sum(loads[starts[j]:starts[j + 1]])
        gpu = max(gpu, host, ready[j]) + model.gpu_expert_ms(tokens)
    return gpu


@dataclass(frozen=True)
class Assignment:
    """Where the offloaded experts of one layer step run, and when each side is predicted to finish.

    Unpacks as (cpu, copy) lists, the `decide` contract of `engine.offload.offload_executor.OffloadExecutor`;
    `copy` is in the order the copies should be issued.
    """

    cpu: tuple[int, ...]  # computed on the CPU, ascending expert id
    copy: tuple[int, ...]  # copied over PCIe and computed on the GPU, in copy order
    cpu_finish_ms: float
    gpu_finish_ms: float
    method: str  # "exact", "greedy", "fiddler", "given" or "measured" (`lone_token_measured`)

    @property
    def makespan_ms(self) -> float:
        return max(self.cpu_finish_ms, self.gpu_finish_ms)

    def __iter__(self):
        return iter((list(self.cpu), list(self.copy)))


def copy_launch_ms(model: ExpertCosts) -> float:
    """Host time to queue one expert's copy and its GPU compute; 0 where a model has no such measurement."""
    return getattr(model, "copy_launch_ms", 0.0)


def cpu_call_ms(model: ExpertCosts, tokens: float) -> float:
    """The CPU call's own cost, beyond its experts' shares, for experts of about `tokens` tokens each (paid once a
    layer step with any CPU expert); 0 where a model has no such measurement (engine.offload.latency_model)."""
    call = getattr(model, "cpu_call_ms", None)
    return call(tokens) if call else 0.0


def mean_load(loads: dict[int, int]) -> float:
    """Tokens an active expert of a step, on average: what the call's own cost and the contention are read at."""
    active = [n for n in loads.values() if n > 0]
    return sum(active) / len(active) if active else 0.0


def cpu_path_ms(tokens: int, model: ExpertCosts) -> float:
    """One offloaded expert on the CPU: compute plus its activations' round trip."""
    return model.cpu_expert_ms(tokens) + model.activation_roundtrip_ms(tokens)


def copy_order(loads: dict[int, int], copy: Iterable[int], model: ExpertCosts) -> list[int]:
    """The order that lets the copied experts finish earliest: descending GPU time.

    Copy then compute is a two-machine flow shop (the PCIe link, then the GPU). Johnson's
    rule is optimal for it: jobs whose copy is no longer than their compute first, by
    ascending copy time, then the rest by descending compute time. Every expert of a model
    copies the same bytes, so both groups reduce to descending compute time. Ties: heavier
    load first, then lower id (the order `assign_offloaded` returns).
    """
    return sorted(copy, key=lambda e: (-model.gpu_expert_ms(loads[e]), -loads[e], e))


def finish_times(loads: dict[int, int], copy: Sequence[int], model: ExpertCosts,
                 gpu_busy_ms: float = 0.0) -> tuple[float, float]:
    """(CPU finish, GPU finish) in ms from now: `copy` copied in that order, every other expert with tokens on the CPU.

    The CPU pool runs its experts in one call (its own cost, `cpu_call_ms`, and each expert's share), after the host
    thread (which then joins it) has queued each copy and its GPU compute (`copy_launch_ms` each). Copies are sequential on the link; the
    GPU starts a copied expert once its copy has landed and the GPU is free, and it is busy
    for `gpu_busy_ms` first (the resident experts, which the executor queues before them).
    """
    copied = set(copy)
    # Per distinct load, not per expert: a batched step has ~100 experts with a handful of loads.
    on_cpu = Counter(n for e, n in loads.items() if n > 0 and e not in copied)
    cpu = sum(cpu_path_ms(n, model) * times for n, times in sorted(on_cpu.items()))
    cpu += cpu_call_ms(model, mean_load(loads)) if on_cpu else 0.0
    cpu += len(copied) * copy_launch_ms(model)
    link, gpu = 0.0, gpu_busy_ms
    for e in copy:
        link += model.copy_expert_ms
        gpu = max(gpu, link) + model.gpu_expert_ms(loads[e])
    return cpu, gpu + (copy_step_ms(model) if copy else 0.0)


def copy_step_ms(model: ExpertCosts) -> float:
    """GPU-side time a step with any copy pays once (`Contended.copy_step_ms`); 0 where a model has none."""
    return getattr(model, "copy_step_ms", 0.0)


def assignment_for(loads: dict[int, int], copy: Iterable[int], model: ExpertCosts, gpu_busy_ms: float = 0.0,
                   method: str = "given") -> Assignment:
    """The Assignment that copies exactly `copy` (in the best order) and runs the other active experts on the CPU."""
    active = {e: n for e, n in loads.items() if n > 0}
    order = copy_order(active, [e for e in copy if e in active], model)
    cpu, gpu = finish_times(active, order, model, gpu_busy_ms)
    return Assignment(tuple(sorted(set(active) - set(order))), tuple(order), cpu, gpu, method)


def resident_on_cpu(loads: dict[int, int], model: ExpertCosts) -> list[int]:
    """GPU-resident experts of one layer step to compute on the CPU instead, from their host copy: all of
    them when the CPU computes experts of this layer anyway and taking these on costs it less (their shares
    of the call it makes anyway) than queueing the GPU's share would (the measured `resident_launch_ms`,
    which the same host thread pays before the CPU call), else none (moving some would not save the launch).

    Small experts with a token each, the decode of a model whose few resident experts per layer come from a flat
    popularity, are where this wins: a small expert at one token adds less to the CPU's call than launching the GPU's
    share costs (docs/measurements.md, "The placement's rules and the latency model"). Call it only for layers with
    CPU work.
    """
    launch = getattr(model, "resident_launch_ms", 0.0)
    active = {e: n for e, n in loads.items() if n > 0}
    if not active or sum(model.cpu_expert_ms(n) for n in active.values()) >= launch:
        return []
    return sorted(active)


# A split must beat the CPU alone by this much at start-up to be used: the medians of a few tries move by
# a few percent between runs.
ZERO_COPY_MIN_GAIN = 0.05


def lone_token_split(top_k: int, model) -> tuple[int, int]:
    """How a lone decoded token's `top_k` offloaded experts are shared between the CPU and the GPU, which reads
    its share of the weights from pinned RAM (kernels.gpu_zero_copy): (ranks, 0) — the GPU computes the last
    `ranks` experts whole, the CPU the others — or (0, width) — the GPU computes the last `width` of every
    expert's intermediate width, the CPU the rest. Each step away from the CPU alone must win by ZERO_COPY_MIN_GAIN
    in its measured time (the model's `zero_copy_split_ms` and `split_width_ms`,
    engine.offload.profiler.profile_zero_copy): the fastest whole-expert split against the CPU alone, then the
    fastest width against that. (0, 0) where nothing was measured for this top_k.

    Widths only on a clear lead: on gpt-oss, widths profiled barely ahead of one whole expert decoded slower than it
    on the same machine (docs/measurements.md, "Session 49").

    Measured, not predicted from one expert's costs: predicted from them (with the contention factors of copies), the
    split got both Mixtral and Qwen3 wrong (docs/measurements.md, "The placement's rules and the latency model").
    Splitting rows is what lets the GPU help at top-2 (Mixtral), where one whole expert over PCIe takes longer than
    both on the CPU.
    """
    split = getattr(model, "zero_copy_split_ms", ())
    if getattr(model, "zero_copy_top_k", 0) != top_k or len(split) < 2:
        return 0, 0
    keep = 1 - ZERO_COPY_MIN_GAIN
    ranks, best = min(enumerate(split), key=lambda o: (o[1], o[0]))  # on a tie, fewer ranks
    if best > keep * split[0]:
        ranks, best = 0, split[0]
    widths = getattr(model, "split_width_ms", ())
    if widths:
        width, ms = min(widths, key=lambda o: (o[1], o[0]))  # on a tie, less width
        if ms <= keep * best:
            return 0, width
    return ranks, 0


def lone_token_saving_ms(model) -> float:
    """What `lone_token_split` saves a lone token's layer step against the CPU alone, as the start-up profile timed
    both (zero_copy_split_ms, split_width_ms at the profile's zero_copy_top_k): 0 where it keeps the CPU alone. The
    executor splits only layers with no expert resident, so the placement weighs this against resident experts."""
    split = getattr(model, "zero_copy_split_ms", ())
    ranks, width = lone_token_split(getattr(model, "zero_copy_top_k", 0), model)
    if width:
        chosen = dict(model.split_width_ms)[width]
    elif ranks:
        chosen = split[ranks]
    else:
        return 0.0
    return max(0.0, split[0] - chosen)


def lone_token_measured(loads: dict[int, int], model) -> bool:
    """Whether the start-up profile measured the GPU's part in these loads directly, so that the CPU computes them
    all: one token an expert, no more experts than the profile's `zero_copy_top_k`, and its `zero_copy_split_ms`
    measured. `lone_token_split` has then weighed the GPU reading whole experts or every expert's last rows from
    pinned RAM against the CPU alone, and the executor gives the GPU what it chose; copying an expert moves the
    same bytes over PCIe as reading it zero-copy, and pays its staging and launches on top.

    Priced instead by `assign_offloaded` from a profile that timed each CPU expert in a call of its own (before
    `cpu_call_ms`), a call of Mixtral's two q4_0 experts cost the CPU twice one expert's call, where one call of both
    takes less: the rule copied one of them in every layer and decoded slower than both on the CPU, and slower still
    than the profile's row split (tests/perf/probe_split_rows_decode.py; docs/measurements.md, "The placement's rules
    and the latency model"). The measured split stays the better guide for a lone token: it timed the very layer step,
    the prices only its parts."""
    split = getattr(model, "zero_copy_split_ms", ())
    return (len(split) >= 2 and len(loads) <= getattr(model, "zero_copy_top_k", 0)
            and all(n == 1 for n in loads.values()))


def zero_copy_ranks(top_k: int, model) -> int:
    """`lone_token_split`'s whole experts for the GPU."""
    return lone_token_split(top_k, model)[0]


def split_width(top_k: int, model) -> int:
    """`lone_token_split`'s width of every expert for the GPU."""
    return lone_token_split(top_k, model)[1]


class RememberedSplit:
    """A per-step rule (loads -> (cpu, copy)) that answers again from memory for loads it has seen.

    Experts with equal loads are interchangeable to every rule here, so the answer depends only on the
    multiset of loads: it is computed once for experts renamed 0..n-1 in descending load, and mapped
    onto each later step's experts in that same order. Decode repeats a few multisets in every layer of
    every step (a Qwen3 token: eight experts with one token each), where the search's Python would cost tens of
    microseconds per layer (docs/measurements.md, "The placement's rules and the latency model").
    """

    def __init__(self, rule: Callable[[dict[int, int]], Iterable], capacity: int = 4096):
        self.rule, self.capacity = rule, capacity
        self.memory: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}

    def __call__(self, loads: dict[int, int]) -> tuple[list[int], list[int]]:
        order = sorted((e for e, n in loads.items() if n > 0), key=lambda e: (-loads[e], e))
        key = tuple(loads[e] for e in order)
        answer = self.memory.get(key)
        if answer is None:
            cpu, copy = self.rule(dict(enumerate(key)))
            answer = (sorted(cpu), list(copy))
            if len(self.memory) >= self.capacity:
                self.memory.clear()  # routing changed character (a new batch size): start over
            self.memory[key] = answer
        cpu, copy = answer
        return sorted(order[i] for i in cpu), [order[i] for i in copy]


def fiddler_rule(tokens: int, model: ExpertCosts) -> Literal["cpu", "gpu"]:
    """Fiddler's per-expert rule: copy the weights when cpu_lat(s) > gpu_lat(s) + transfer_lat."""
    return "gpu" if model.cpu_expert_ms(tokens) > model.gpu_expert_ms(tokens) + model.copy_expert_ms else "cpu"


def fiddler_assign(loads: dict[int, int], model: ExpertCosts, gpu_busy_ms: float = 0.0) -> Assignment:
    """Fiddler's rule applied to every expert of a step, for comparison with `assign_offloaded`."""
    copy = [e for e, n in loads.items() if n > 0 and fiddler_rule(n, model) == "gpu"]
    return assignment_for(loads, copy, model, gpu_busy_ms, method="fiddler")


@dataclass
class _Groups:
    """Offloaded experts grouped by load: experts with equal loads cost the same and are interchangeable.

    Groups are in copy order (descending GPU time), so copying x[k] experts of each group k
    in group order is the Johnson-optimal pipeline for that choice.
    """

    ids: list[list[int]]  # per group, ascending expert ids (the lowest are the ones copied)
    cpu: list[float]  # per expert of the group
    gpu: list[float]
    copy_ms: float
    gpu_busy_ms: float
    cpu_base: float = 0.0  # CPU-side time whatever the split (see _group)
    cpu_call: float = 0.0  # the CPU call's own cost, paid unless every expert is copied (in cpu_base if it must be)
    copy_step: float = 0.0  # added to the GPU finish once anything is copied (`copy_step_ms`)

    @property
    def sizes(self) -> list[int]:
        return [len(ids) for ids in self.ids]

    def finish(self, x: Sequence[int]) -> tuple[float, float]:
        """(CPU finish, GPU finish) when x[k] experts of group k are copied, in group order."""
        cpu = self.cpu_base + sum((len(ids) - xk) * c for ids, xk, c in zip(self.ids, x, self.cpu))
        cpu += self.cpu_call if any(xk < len(ids) for ids, xk in zip(self.ids, x)) else 0.0
        d, link, gpu = self.copy_ms, 0.0, self.gpu_busy_ms
        for xk, g in zip(x, self.gpu):
            if xk:
                # xk equal jobs through the link→GPU pipeline, in closed form: the GPU is the
                # bottleneck from the first copy on (g >= d) or waits for the last (g < d).
                gpu = max(gpu + xk * g, link + max(d + xk * g, xk * d + g))
                link += xk * d
        return cpu, gpu + (self.copy_step if any(x) else 0.0)

    def makespan(self, x: Sequence[int]) -> float:
        return max(self.finish(x))

    def counts_of(self, copy: set[int]) -> list[int]:
        """x for a set of experts (only its size per group matters)."""
        return [sum(e in copy for e in ids) for ids in self.ids]

    def assignment(self, x: Sequence[int], method: str) -> Assignment:
        copy = [e for ids, xk in zip(self.ids, x) for e in ids[:xk]]
        cpu = sorted(e for ids, xk in zip(self.ids, x) for e in ids[xk:])
        cpu_ms, gpu_ms = self.finish(x)
        return Assignment(tuple(cpu), tuple(copy), cpu_ms, gpu_ms, method)


def _group(loads: dict[int, int], model: ExpertCosts, gpu_busy_ms: float, call_tokens: float = 0.0) -> _Groups:
    """Group by load. Each copy costs the CPU side `copy_launch_ms` of host time, so a CPU expert
    costs its CPU time minus that, on top of a base of one launch per expert (copied or not):
    the CPU finish stays a sum over the experts left on the CPU, as the solvers need. Callers
    leave out experts whose CPU time does not exceed a launch: copying them can never help.
    call_tokens: the step's mean load, which the CPU call's own cost is read at."""
    launch = copy_launch_ms(model)
    by_load: dict[int, list[int]] = {}
    for e, n in loads.items():
        by_load.setdefault(n, []).append(e)
    costs = {n: (cpu_path_ms(n, model) - launch, model.gpu_expert_ms(n)) for n in by_load}
    order = sorted(by_load, key=lambda n: (-costs[n][1], -n))
    return _Groups(ids=[sorted(by_load[n]) for n in order], cpu=[costs[n][0] for n in order],
                   gpu=[costs[n][1] for n in order], copy_ms=model.copy_expert_ms, gpu_busy_ms=gpu_busy_ms,
                   cpu_base=launch * len(loads), cpu_call=cpu_call_ms(model, call_tokens),
                   copy_step=copy_step_ms(model))


def _greedy(groups: _Groups, fiddler: list[int]) -> list[int]:
    """A good split fast: the best of every prefix split and Fiddler's, then single moves while they help.

    Prefixes rank experts by what copying saves, CPU time minus GPU time (each copy costs the
    same link time); prefix 0 is all-CPU and the last is all-GPU. So the result is never worse
    than all-CPU, all-GPU or Fiddler's rule.
    """
    sizes = groups.sizes
    K = len(sizes)
    rank = sorted(range(K), key=lambda k: (-(groups.cpu[k] - groups.gpu[k]), k))
    candidates = [list(fiddler)]
    x = [0] * K
    candidates.append(list(x))
    for k in rank:
        for _ in range(sizes[k]):
            x[k] += 1
            candidates.append(list(x))
    best = min(candidates, key=groups.makespan)  # min keeps the first of equal ones
    best_ms = groups.makespan(best)
    for _ in range(sum(sizes)):  # every pass must improve; the cap only bounds the time
        moves = []
        for k in range(K):
            for step in (1, -1):
                if 0 <= best[k] + step <= sizes[k]:
                    y = list(best)
                    y[k] += step
                    moves.append((groups.makespan(y), k, -step, y))
        if not moves:
            break
        ms, *_, y = min(moves, key=lambda m: m[:3])
        if ms >= best_ms - _EPS:
            break
        best, best_ms = y, ms
    return best


def _equal_gpu_split(groups: _Groups) -> list[int]:
    """The optimal counts when every copied expert costs the GPU the same (a prefill step's copy runs price each
    copy's compute at 0: `Contended.gpu_expert_ms`). The GPU then finishes C copies at the same time whichever they
    are (`_Groups.finish`'s pipeline in closed form), so for each C the CPU should keep the experts of least CPU
    time: one pass over C, exact, where the greedy search's Python cost milliseconds a layer at a prefill's ~100
    distinct loads."""
    sizes, K = groups.sizes, len(groups.ids)
    order = sorted(range(K), key=lambda k: (-groups.cpu[k], k))  # the CPU's costliest experts are copied first
    g, d, busy, total = (groups.gpu[0] if K else 0.0), groups.copy_ms, groups.gpu_busy_ms, sum(sizes)
    cpu = groups.cpu_base + sum(m * c for m, c in zip(sizes, groups.cpu))
    best, best_c, copied = max(cpu + (groups.cpu_call if total else 0.0), busy), 0, 0
    for k in order:
        for _ in range(sizes[k]):
            copied += 1
            cpu -= groups.cpu[k]
            gpu = max(busy + copied * g, d + copied * g, copied * d + g) + groups.copy_step
            ms = max(cpu + (groups.cpu_call if copied < total else 0.0), gpu)
            if ms < best - _EPS:
                best, best_c = ms, copied
    x = [0] * K
    for k in order:
        x[k] = min(sizes[k], best_c)
        best_c -= x[k]
    return x


def _suffix_sums(values: list[float]) -> list[float]:
    """s[k] = sum(values[k:]), with s[len(values)] = 0."""
    return list(accumulate(reversed(values), initial=0.0))[::-1]


def _pareto(states: list[tuple[float, float, tuple[int, ...]]]) -> list[tuple[float, float, tuple[int, ...]]]:
    """The states no other state beats on both CPU and GPU finish."""
    kept, lowest_gpu = [], float("inf")
    for state in sorted(states):
        if state[1] < lowest_gpu:
            kept.append(state)
            lowest_gpu = state[1]
    return kept


def _balanced_bound(cpu: float, other: float, rest: list[tuple[float, float, int]]) -> float:
    """min over fractional splits of max(CPU finish, other finish): a lower bound on any integer split.

    cpu has every remaining expert on it; moving one expert of (c, w, m) off the CPU takes c
    from the CPU and adds w to the other side. `rest` is sorted by c/w, best first, so moving
    whole groups in that order until the two sides cross, then a fraction, is the optimum of
    this relaxation (a fractional knapsack).
    """
    for c, w, m in rest:
        if cpu <= other:
            break
        if cpu - m * c > other + m * w:
            cpu, other = cpu - m * c, other + m * w
        else:
            return cpu - (cpu - other) / (c + w) * c
    return max(cpu, other)


def _exact(groups: _Groups, start: list[int]) -> list[int]:
    """The optimal counts: dynamic programming over the load groups in copy order, with dominance and bounds.

    After deciding the first groups, a partial split is a state (copies so far, CPU finish,
    GPU finish); the link finish is copies × copy time. Groups come in Johnson order, so later
    copies only extend the pipeline, and the rest of the step depends on the state alone:
    the CPU adds the same, and the GPU recurrence max(gpu, link) + g is monotone in gpu. So of
    two states with as many copies, one no later on either side does at least as well, and
    the other is dropped (exact). States that cannot beat the best split found are dropped
    too: each remaining expert adds its CPU time to the CPU queue or, copied, at least its GPU
    time to the GPU and its copy time to the link, which the GPU finish never precedes. So
    the fractional balance of CPU against link, and of CPU against GPU (`_balanced_bound`),
    bound any completion from below. `start` (the greedy split) is the first best. Every state pays the CPU
    call's own cost: only copying every expert saves it, and `start` is never worse than that (`_greedy`).
    """
    K = len(groups.ids)
    sizes, cpu_k, gpu_k, d = groups.sizes, groups.cpu, groups.gpu, groups.copy_ms
    rest_cpu = _suffix_sums([m * c for m, c in zip(sizes, cpu_k)])

    def by_ratio(k: int, w: list[float]) -> list[tuple[float, float, int]]:
        rest = [(cpu_k[j], w[j], sizes[j]) for j in range(k, K)]
        return sorted(rest, key=lambda r: -r[0] / r[1] if r[1] > 0 else -float("inf"))

    rest_link = [by_ratio(k, [d] * K) for k in range(K + 1)]
    rest_gpu = [by_ratio(k, gpu_k) for k in range(K + 1)]
    best_x, best = tuple(start), groups.makespan(start)
    states: dict[int, list] = {0: [(groups.cpu_base + groups.cpu_call, groups.gpu_busy_ms, ())]}
    for k in range(K):
        grown: dict[int, list] = {}
        for copies, frontier in states.items():
            m, c, g = sizes[k], cpu_k[k], gpu_k[k]
            for cpu0, gpu0, x in frontier:
                link0 = copies * d
                # CPU finish falls and GPU finish rises with the copies taken from this group:
                # start where the CPU side can beat the best, stop where the GPU side cannot.
                lo = 0 if c <= 0 else max(0, math.floor(m - (best - cpu0) / c))
                for xk in range(lo, m + 1):
                    link = link0 + xk * d
                    gpu = max(gpu0 + xk * g, link0 + max(d + xk * g, xk * d + g)) if xk else gpu0
                    # The step's once-only GPU-side cost comes after the pipeline, as `_Groups.finish` adds it: kept
                    # out of the state, or a later group's link-bound copies would absorb it.
                    finish = gpu + (groups.copy_step if copies + xk else 0.0)
                    if finish >= best - _EPS:
                        break
                    cpu = cpu0 + (m - xk) * c
                    all_cpu = cpu + rest_cpu[k + 1]
                    if (cpu >= best - _EPS
                            or _balanced_bound(all_cpu, link, rest_link[k + 1]) >= best - _EPS
                            or _balanced_bound(all_cpu, finish, rest_gpu[k + 1]) >= best - _EPS):
                        continue
                    # Every remaining expert on the CPU completes this state: a cheap incumbent.
                    done = max(all_cpu, finish)
                    if done < best - _EPS:
                        best, best_x = done, x + (xk,) + (0,) * (K - k - 1)
                    grown.setdefault(copies + xk, []).append((cpu, gpu, x + (xk,)))
        states = {copies: _pareto(frontier) for copies, frontier in grown.items()}
    return list(best_x)


def assign_offloaded(loads: dict[int, int], model: ExpertCosts, gpu_busy_ms: float = 0.0,
                     exact_limit: int = EXACT_LIMIT, overlap: bool = False,
                     grouped_copies: bool = False) -> Assignment:
    """Split the offloaded experts active in one layer step between the CPU and copy-to-GPU, minimising the makespan.

    loads: expert id → tokens routed to it, for the CPU-resident experts of the layer (experts
    with 0 tokens are ignored). The CPU queue and the copy→GPU pipeline run at the same time
    (`finish_times`); the step ends when the later of the two does, so the best split makes
    them end as close together as the experts' sizes allow.

    Exact (method "exact") when the choices, at most 2^(experts) and fewer when loads repeat,
    number at most `exact_limit`; this covers every step with up to 16 offloaded experts.
    The problem contains PARTITION (CPU and GPU times equal, no copy time), so no sort order
    with prefix splits is exact in general; dynamic programming over load groups with
    dominance and bounds is, and stays fast (`_exact`). Larger steps (prefill over many
    experts) take the greedy split, which is never worse than all-CPU, all-GPU or Fiddler's
    rule; or, where every copy costs the GPU the same (a prefill's copy runs), the exact one-pass split
    (`_equal_gpu_split`). `gpu_busy_ms`: how long the GPU is still busy with resident experts before it can
    compute a copied one.

    Both read host memory, so a split is costed with the slowdowns measured while both run
    (`Contended`) and kept only when it beats running everything on one side, uncontended.
    Assumed, as in Fiddler: enough staging slots for every copy of the step. A lone token's experts
    whose GPU options the start-up profile measured directly stay on the CPU (method "measured",
    `lone_token_measured`). overlap: the executor runs the CPU's call beside the queueing of the copies
    (`Contended.overlap`), so their launches pace the link instead of delaying the CPU.
    grouped_copies: the executor computes a prefill step's copies in copy runs of one grouped launch each
    (`copy_runs`), so a copy costs the host its queueing, not its compute's launch.
    """
    active = {e: int(n) for e, n in loads.items() if n > 0}
    if not active:
        return _group(active, model, gpu_busy_ms).assignment([], "exact")
    if lone_token_measured(active, model):
        return assignment_for(active, [], model, gpu_busy_ms, "measured")
    grouped_copies = grouped_copies and mean_load(active) >= GROUPED_COPIES_MIN_LOAD
    launch = copy_launch_ms(model)
    if launch and not grouped_copies and all(cpu_path_ms(n, model) <= launch for n in set(active.values())):
        # Every expert is cheaper on the CPU than queueing its copy and its launch (small experts at decode): no
        # search. This runs for every layer of every step, where the search's Python would cost more than it saves.
        # In copy runs (a prefill's) a copy costs the host its queueing alone, and the link may well be the faster
        # side: a prefill of small experts routed evenly went all to the CPU (docs/measurements.md, "Session 55").
        return assignment_for(active, [], model, gpu_busy_ms, "exact")
    # The contention of a step where the CPU's experts have about the step's mean load: how far their
    # time is reads, which copies slow, rather than arithmetic, which they do not.
    contended = Contended(model, mean_load(active), overlap=overlap, grouped_copies=grouped_copies)
    split = _best_split(active, contended, gpu_busy_ms, exact_limit)
    if contended.factors == (1.0, 1.0):
        return split
    # A split was costed as if the CPU and the copies ran side by side all the step long, which
    # over-charges it; running everything on one side has no contention at all.
    alone = Contended(model, mean_load(active), apart=True, overlap=overlap, grouped_copies=grouped_copies)
    sides = [assignment_for(active, [], alone, gpu_busy_ms, split.method),
             assignment_for(active, list(active), alone, gpu_busy_ms, split.method)]
    return min([split, *sides], key=lambda a: a.makespan_ms)


def _best_split(active: dict[int, int], model: ExpertCosts, gpu_busy_ms: float, exact_limit: int) -> Assignment:
    launch = copy_launch_ms(model)
    path = {n: cpu_path_ms(n, model) for n in set(active.values())}  # per load: a prefill has ~100 experts
    stay = {e: n for e, n in active.items() if path[n] <= launch}  # copying costs the CPU more
    movable = {e: n for e, n in active.items() if e not in stay}
    groups = _group(movable, model, gpu_busy_ms, mean_load(active))
    if stay:  # the CPU calls its kernel whatever is copied
        groups.cpu_base += sum(path[n] for n in stay.values()) + groups.cpu_call
        groups.cpu_call = 0.0
    small = math.prod(m + 1 for m in groups.sizes) <= exact_limit
    if not small and all(abs(g - groups.gpu[0]) <= _EPS for g in groups.gpu):  # a prefill's copy runs (GPU time 0)
        x, method = _equal_gpu_split(groups), "exact"
    else:
        fiddler = groups.counts_of({e for e, n in movable.items() if fiddler_rule(n, model) == "gpu"})
        x = _greedy(groups, fiddler)
        method = "greedy"
        if small:
            x, method = _exact(groups, x), "exact"
    split = groups.assignment(x, method)
    return replace(split, cpu=tuple(sorted(split.cpu + tuple(stay)))) if stay else split
