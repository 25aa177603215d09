"""Auto mode's decision: the draft length of each round, 0 for a plain step, from the step costs and the
running acceptance (perf_model.choose_draft_length), within an exploration budget kept by a ledger; and the
costs it prices rounds at (`RunningCosts`: measured step times scaled to what this run's rounds take).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moedesk.engine.speculative import perf_model


def acceptance_estimate(accepted: int, tested: int, prior_accepted: float = 1.0, prior_tested: float = 2.0) -> float:
    """Per-draft acceptance α from counts: `tested` drafts reached (a chain stops testing at its first
    rejection), `accepted` of them taken; a weak prior (one of two) so that early steps do not swing it."""
    return (accepted + prior_accepted) / (tested + prior_tested)


# Speculate at all, in auto mode, only if even this acceptance would make it pay (else plain decoding
# through the engine's own decode path, CUDA graphs included).
OPTIMISTIC_ALPHA = 0.9
# Auto's exploration (auto_gamma): rounds may lose at most this share of plain decoding's time, counted as at least
# this many plain steps (or the run's length, if shorter), so that even a short run can probe in its first rounds.
# Kept under what issue 42's target for auto (near the best of plain and drafting) leaves for exploring.
EXPLORE_SHARE = 0.04
EXPLORE_HORIZON = 160
# A probe prices drafts at the acceptance this many standard deviations above the estimate: high while the
# evidence is thin, the estimate itself once it is not.
PROBE_Z = 2.0
# Tested drafts before the estimate alone may decide to draft (before them, every drafting round is a probe).
MIN_EVIDENCE = 4
# The least predicted gain auto drafts for. Below perf_model's SAFETY_MARGIN: auto prices rounds at what this run's
# rounds took (RunningCosts), not at a table measured once, so what is left to cover is the acceptance's noise.
AUTO_MARGIN = 0.03
# A probe needs a real gain in sight at the optimistic acceptance: perf_model's margin.
PROBE_MARGIN = perf_model.SAFETY_MARGIN
# How much cheaper than the table a plain step may run (plain_probe): about the least the GPU box's plain decoding
# took against the table's T(B, 1) (docs/measurements.md, "Auto against chains on the Qwen3 shape").
PLAIN_DOUBT = 0.7
# Until this many drafts are tested, a plain probe waits while the gain would survive cheap plain steps at the
# acceptance PLAIN_Z standard deviations above the estimate (plain_doubt_choice): early on, the estimate is dragged
# toward the prior's half and every gain looks small enough to doubt. PLAIN_Z is picked on the replays of sessions 37
# and 38 (docs/measurements.md, "Session 38: auto's opening at B = 1").
PLAIN_EVIDENCE = 4 * MIN_EVIDENCE
PLAIN_Z = 0.85
# Tested drafts auto's running acceptance remembers (carried_counts), within a request and between requests.
ACCEPTANCE_MEMORY = 64
# Plain steps after which the evidence about a draft has halved (learn_acceptance): a draft auto stopped using is
# probed again after a few dozen plain steps, so one that starts to guess well (a reply turning to code) is drafted.
FORGET_HALF_LIFE = 24


@dataclass(frozen=True)
class AutoLedger:
    """Auto's rounds priced by the step costs against plain decoding of the tokens they took: its exploration
    budget. Per batch, as the acceptance counts are. The opening probe's loss is not booked: it has its own budget
    (auto_gamma)."""
    plain_ms: float = 0.0  # plain decoding's time for those tokens: T(B, 1) per token of each row
    loss_ms: float = 0.0  # the rounds' time less plain_ms; negative where drafting gained
    drafted: int = 0  # rounds that drafted

    def book(self, costs: perf_model.StepCosts, batch: int, gamma: int, tokens_per_row: float,
             evidence: float = 0) -> AutoLedger:
        """After a round of `gamma` drafts in which each of the `batch` rows took `tokens_per_row` on average, decided
        with `evidence` tested drafts known. An opening round (opens) has its gain booked but not its loss."""
        ar, step = costs.ar_ms(batch), perf_model.step_ms(costs, batch, gamma)
        if ar is None or step is None:
            return self
        plain = tokens_per_row * ar
        loss = min(0.0, step - plain) if gamma and self.opens(evidence) else step - plain
        return AutoLedger(self.plain_ms + plain, self.loss_ms + loss, self.drafted + (gamma > 0))

    def opens(self, evidence: float) -> bool:
        """Whether the next drafting round is the opening probe, outside the budget (auto_gamma): none has drafted
        yet and too little is known of the draft to decide without one."""
        return not self.drafted and evidence < MIN_EVIDENCE

    def room_ms(self, ar_ms: float, horizon: int = EXPLORE_HORIZON) -> float:
        """What a round may still lose: EXPLORE_SHARE of plain decoding's time so far (at least `horizon` steps
        of it), less what earlier rounds lost."""
        return EXPLORE_SHARE * max(self.plain_ms, horizon * ar_ms) - self.loss_ms


def optimistic_acceptance(alpha: float, evidence: float, z: float | None = None) -> float:
    """What the acceptance may still be, `z` standard deviations above the estimate alpha of `evidence` tested
    drafts (the prior's two counted too): high while the evidence is thin, alpha itself once it is not."""
    z = PROBE_Z if z is None else z
    n = evidence + 2
    return min(1.0, alpha + z * math.sqrt(alpha * (1 - alpha) / (n + 1)))


def auto_gamma(costs: perf_model.StepCosts, batch: int, alpha: float, max_gamma: int,
               ledger: AutoLedger = AutoLedger(), evidence: int = 0, horizon: int = EXPLORE_HORIZON,
               remaining: float | None = None) -> int:
    """The draft length of the next round in auto mode, 0 for a plain step.

    alpha is acceptance_estimate's, over `evidence` tested drafts (carried over from earlier requests of the same
    draft where the engine kept them). Exploit: with MIN_EVIDENCE drafts tested, the γ that choose_draft_length
    finds pays at alpha by AUTO_MARGIN. Else probe: the γ that would pay by PROBE_MARGIN at the optimistic
    acceptance (optimistic_acceptance): near 1 before any evidence, near alpha once there is much of it, so a bad
    draft stops being probed on its own. With the evidence, two probes of the step costs (RunningCosts learns them
    from the rounds that ran): a longer draft whose verify has not been timed and may cost as little as a shorter
    one's (cost_probe), and one plain round where the gain hinges on what a plain step costs (plain_probe), not on
    an acceptance still in doubt (plain_doubt_choice).

    The exploration budget (AutoLedger.room_ms: EXPLORE_SHARE of plain decoding's time so far, at least `horizon`
    steps of it, less what earlier rounds lost, plus what they gained) bounds what probing can lose: a probe goes
    ahead only if, with nothing accepted, it still fits (a round of γ drafts loses at most γ·T_draft + T(B, γ+1) +
    T_reject - T(B, 1)), and preferably leaves room for a 1-draft probe after it, since one rejected first draft is
    thin evidence. The opening probe (AutoLedger.opens: the first drafting round, with fewer than MIN_EVIDENCE
    drafts known) has a budget of its own as large and spends none of the run's: the longest draft that pays at the
    optimistic acceptance, so a good draft is drafted from the first round of a short run. An exploiting round is
    not held to the budget: it pays at the estimate, and one unlucky round must not stop a good draft for the rest
    of a short run (the estimate, updated every round, stops it where the draft is worse than it looked). So, in the
    costs' own model at a fixed B, probing costs at most EXPLORE_SHARE · max(n, horizon) · T(B, 1) over plain
    decoding's time, and the opening EXPLORE_SHARE · horizon · T(B, 1), whatever the acceptance; the batch passes
    horizon = min(EXPLORE_HORIZON, its longest request). Where the runner knows the longest row's tokens left
    (`remaining`), a probe after the opening is the γ that fits the budget and worth most over them (probe_value), none
    if none is worth its round; one worth it may go one round past the budget (a run whose first drafts were rejected
    is not left plain to its end when enough tokens remain to use a good draft). tests/speculative/test_auto_grid.py
    simulates auto against the best fixed choice on the Mixtral and Qwen3 shapes' step times."""
    ar = costs.ar_ms(batch)
    if ar is None:
        return 0
    if evidence >= MIN_EVIDENCE:  # exploit where the evidence says a draft length pays
        choice = perf_model.choose_draft_length(costs, batch, alpha, max_gamma, AUTO_MARGIN)
        if choice.gamma and plain_probe(costs, batch, choice, plain_doubt_choice(costs, batch, alpha, evidence,
                                                                                 max_gamma)):
            return 0
        gamma = cost_probe(costs, batch, alpha, max_gamma, choice, ledger.room_ms(ar, horizon)) or choice.gamma
        if gamma:
            return gamma
    # Else probe, at what the acceptance may still be, within the budget even if its first draft is rejected.
    hopeful = optimistic_acceptance(alpha, evidence)
    gamma = perf_model.choose_draft_length(costs, batch, hopeful, max_gamma, PROBE_MARGIN).gamma
    # The opening leaves the run's whole budget for probing again if its first draft is rejected; later probes
    # preferably leave room for a 1-draft probe after them: one rejected first draft is thin evidence.
    opening = ledger.opens(evidence)
    room = (AutoLedger() if opening else ledger).room_ms(ar, horizon)
    loss = {g: perf_model.step_ms(costs, batch, g) - ar for g in range(1, gamma + 1)
            if perf_model.step_ms(costs, batch, g) is not None}
    fits = [g for g in range(gamma, 0, -1) if g in loss and loss[g] <= room
            and perf_model.predicted_speedup(costs, batch, g, hopeful) >= 1.0 + PROBE_MARGIN]
    if remaining is not None and not opening:  # the run's length known: the γ worth most over what is left, if any
        accepted = max(0.0, alpha * (evidence + 2) - 1)  # acceptance_estimate's counts, its prior taken out
        grid = acceptance_grid(costs, batch, accepted, evidence, max_gamma)  # the same for every γ: made once
        worth = {g: v for g in loss
                 if (v := probe_value(costs, batch, g, accepted, evidence, remaining, max_gamma, grid)) is not None
                 and v > 0}
        stretched = room + max(loss.values(), default=0.0)
        fits = [g for g in worth if loss[g] <= stretched
                and perf_model.predicted_speedup(costs, batch, g, hopeful) >= 1.0 + PROBE_MARGIN]
        return max(fits, key=worth.get, default=0)
    again = [g for g in fits if opening or loss[g] + loss.get(1, 0.0) <= room]
    return (again or fits or [0])[0]


def probe_value(costs: perf_model.StepCosts, batch: int, gamma: int, accepted: float, tested: float,
                remaining: float, max_gamma: int, grid: list[tuple[float, float, float]] | None = None) -> float | None:
    """What probing `gamma` drafts now is expected to save, in ms against plain decoding, over the `remaining` new
    tokens of the batch's longest row (value of information); None where the costs cannot price it.

    Acceptance α is uncertain: Beta(accepted + 1, tested - accepted + 1), integrated on `acceptance_grid`'s points
    (`grid`: made there when not given). At each α the probe round gains or loses T(B, 1)·tokens_per_step(α, γ) -
    step(γ) (no more tokens than are left); what it teaches is worth, over the rounds left after it, drafting at the
    best length that pays at α by AUTO_MARGIN instead of decoding plainly. One round does not reveal α: that worth is
    shrunk by the share of the evidence the probe adds (its expected tested drafts over those plus the ones known and
    the prior's two). So a probe near the end of a run, or one more where many drafts have been tested, is worth less
    than it costs; one early in a long run with the draft in doubt, more."""
    ar, step = costs.ar_ms(batch), perf_model.step_ms(costs, batch, gamma)
    if ar is None or step is None or gamma < 1:
        return None
    if grid is None:
        grid = acceptance_grid(costs, batch, accepted, tested, max_gamma)
    total = value = 0.0
    for a, weight, rate in grid:
        # its tokens past the `remaining` are dropped: drafts beyond remaining - 1 gain nothing
        made = perf_model.tokens_per_step(a, max(0, min(gamma, math.ceil(remaining) - 1)))
        now = ar * made - step
        learnt = batch * perf_model.tokens_per_step(a, gamma - 1)  # drafts it tests: up to the first rejection
        share = learnt / (learnt + tested + 2)
        value += weight * (now + share * rate * ar * max(0.0, remaining - made))
        total += weight
    return value / total


def acceptance_grid(costs: perf_model.StepCosts, batch: int, accepted: float, tested: float, max_gamma: int,
                    points: int = 40) -> list[tuple[float, float, float]]:
    """(α, its weight under Beta(accepted + 1, tested - accepted + 1) unnormalised, the ms saved per plain step's
    worth of tokens by the best draft length that pays at α by AUTO_MARGIN, 0 for plain) on `points` midpoints: what
    probe_value integrates, whatever γ it prices."""
    ar = costs.ar_ms(batch)
    steps = {g: perf_model.step_ms(costs, batch, g) for g in range(1, max_gamma + 1)}
    grid = []
    for i in range(points):
        a = (i + 0.5) / points
        weight = a ** accepted * (1 - a) ** max(0.0, tested - accepted)
        plain = {g: ar * perf_model.tokens_per_step(a, g) for g in steps}  # plain decoding's ms for a round's tokens
        rate = max([0.0] + [1 - t / plain[g] for g, t in steps.items()
                            if t is not None and plain[g] >= t * (1 + AUTO_MARGIN)])
        grid.append((a, weight, rate))
    return grid


class _AtFloor:
    """Step costs with each verify size not yet timed priced at the least it may cost (verify_floor_ms)."""

    def __init__(self, costs):
        self.costs = costs

    def ar_ms(self, batch):
        return self.costs.ar_ms(batch)

    def verify_ms(self, batch, gamma):
        floor = self.costs.verify_floor_ms(batch, gamma)
        return self.costs.verify_ms(batch, gamma) if floor is None else floor

    def draft_ms(self, batch):
        return self.costs.draft_ms(batch)

    def reject_ms(self, batch):
        return self.costs.reject_ms(batch)


def plain_doubt_choice(costs, batch: int, alpha: float, evidence: float, max_gamma: int) -> perf_model.Choice | None:
    """The choice plain_probe must also find in doubt before a plain round is run: with fewer than PLAIN_EVIDENCE
    drafts tested, the best draft length at the acceptance PLAIN_Z standard deviations above the estimate alpha; None
    (the estimate's choice alone decides) once that many are. Why: a plain round costs a drafting round's gain, and
    with a few drafts tested the estimate sits between the prior's half and the draft's real acceptance, so a good
    draft's gain looked small enough to doubt and auto spent a round of a 32-token run timing plain decoding
    (docs/measurements.md, "Session 38: auto's opening at B = 1")."""
    if evidence >= PLAIN_EVIDENCE:
        return None
    return perf_model.choose_draft_length(costs, batch, optimistic_acceptance(alpha, evidence, PLAIN_Z), max_gamma,
                                         AUTO_MARGIN)


def plain_probe(costs, batch: int, choice: perf_model.Choice, hopeful: perf_model.Choice | None = None) -> bool:
    """Whether to run one plain round, to time it, before drafting on: where the chosen draft length's rounds were
    timed in this run but no plain round of about this batch size was, and the choice's predicted gain would vanish
    were plain steps PLAIN_DOUBT times the table's. Why: auto weighs drafting against the table's plain step, which
    was off either way from the plain decoding beside it on the GPU box (docs/measurements.md, "Auto against chains
    on the Qwen3 shape"); once a plain round is timed, RunningCosts prices verifying against it. One plain round
    costs at most the choice's gain over one round. `hopeful` (plain_doubt_choice), where given, must be in that
    doubt too."""
    timed = getattr(costs, "timed", None)
    return (timed is not None and not timed(batch, 1) and timed(batch, choice.gamma + 1)
            and max(choice.speedup, hopeful.speedup if hopeful else 0.0) * PLAIN_DOUBT < 1.0 + AUTO_MARGIN)


def cost_probe(costs, batch: int, alpha: float, max_gamma: int, choice: perf_model.Choice,
               room_ms: float) -> int | None:
    """A draft length to try instead of the one the prices chose, because its verify has not been timed yet and, at
    the least it may cost (RunningCosts.verify_floor_ms), it would beat the choice by AUTO_MARGIN; None if none.

    Why: a table of random tokens' forwards can price a long verify far above what the run's rounds take (the GPU
    box's Qwen3 shape at batch 1: docs/measurements.md, "Auto against chains on the Qwen3 shape"), and auto only
    learns a size's price by running it. Held to the exploration budget: what the probe is expected to lose against plain decoding at the acceptance
    alpha if it costs its full price must fit `room_ms` (AutoLedger.room_ms), so a wrong guess costs what a probe
    of the acceptance may."""
    if not hasattr(costs, "verify_floor_ms"):
        return None
    ar, low = costs.ar_ms(batch), _AtFloor(costs)
    # Nearest the choice first (longer before shorter): the least guessed of the sizes not timed.
    for gamma in sorted(range(1, max_gamma + 1), key=lambda g: (abs(g - choice.gamma), -g)):
        floor, price = costs.verify_floor_ms(batch, gamma), costs.verify_ms(batch, gamma)
        if floor is None or price is None or floor >= price:
            continue  # timed already, or nothing says the table is too dear
        hope = perf_model.predicted_speedup(low, batch, gamma, alpha)
        risk = perf_model.step_ms(costs, batch, gamma) - ar * perf_model.tokens_per_step(alpha, gamma)
        if hope >= choice.speedup * (1 + PROBE_MARGIN) and risk <= room_ms:
            return gamma
    return None


def auto_decodes_plainly(costs: perf_model.StepCosts, batch: int, max_gamma: int,
                         horizon: int = EXPLORE_HORIZON, counts: tuple[float, float] = (0, 0)) -> bool:
    """Whether auto hands `batch` new requests, the longest asking `horizon` new tokens, to plain decoding (its CUDA
    graphs and all) instead of running rounds: where not even an optimistic acceptance (OPTIMISTIC_ALPHA) makes any
    draft length pay at this batch size, or where its first round, with the acceptance `counts` (accepted, tested)
    known so far, would draft nothing (auto_gamma with min(horizon, EXPLORE_HORIZON): that round is the opening probe,
    which the budget decides, not probe_value). The budget of a run no
    longer than that horizon does not grow with its plain rounds, so such a run would draft nothing to its end,
    paying for the speculative path's rounds instead of plain steps (slower than plain on the GPU box:
    docs/measurements.md, "Speculation and the benches")."""
    if not perf_model.choose_draft_length(costs, batch, OPTIMISTIC_ALPHA, max_gamma).gamma:
        return True
    accepted, tested = counts
    return not auto_gamma(costs, batch, acceptance_estimate(accepted, tested), max_gamma, AutoLedger(), tested,
                          min(horizon, EXPLORE_HORIZON))


def learn_acceptance(counts: tuple[float, float], accepted: float, tested: float,
                     plain_steps: int = 0) -> tuple[float, float]:
    """Auto's running acceptance counts (accepted, tested) after a round in which `tested` drafts were reached and
    `accepted` taken, or `plain_steps` steps drafted nothing: online, so the estimate follows the draft as a reply
    goes on. The counts keep the last ACCEPTANCE_MEMORY tested drafts' worth (carried_counts), so acceptance that
    falls turns drafting off within a few rounds; plain steps fade them (FORGET_HALF_LIFE) toward the prior, whose
    optimistic acceptance (auto_gamma's probes) then rises until a probe tests the draft again."""
    accepted, tested = counts[0] + accepted, counts[1] + tested
    if plain_steps:
        kept = 0.5 ** (plain_steps / FORGET_HALF_LIFE)
        accepted, tested = accepted * kept, tested * kept
    return carried_counts(accepted, tested)


def carried_counts(accepted: float, tested: float, memory: float | None = None) -> tuple[float, float]:
    """Acceptance counts as an engine keeps them between requests of one draft: scaled down to at most `memory`
    tested drafts, so a new request starts from what earlier ones measured and a change of subject still moves
    the estimate within a reply or two."""
    memory = ACCEPTANCE_MEMORY if memory is None else memory
    if tested <= memory:
        return accepted, tested
    return accepted * memory / tested, memory


@dataclass(frozen=True)
class Outlook:
    """What one sequence could gain from drafting on measured step times (drafting itself taken as free, so an upper
    bound): the best draft length at OPTIMISTIC_ALPHA acceptance, its speedup over plain decoding, what its verify
    step costs in plain steps, and the lowest acceptance at which any draft length pays (None: not even at 1)."""
    gamma: int
    speedup: float
    verify_cost: float  # T(1, gamma + 1) / T(1, 1)
    break_even: float | None = None
    alpha: float = OPTIMISTIC_ALPHA

    @property
    def loses(self) -> bool:
        """As auto decides: not even OPTIMISTIC_ALPHA acceptance makes drafting pay."""
        return self.speedup < 1.0 + perf_model.SAFETY_MARGIN


def batch_one_outlook(step_times, max_gamma: int) -> Outlook | None:
    """Outlook for a lone sequence (a chat) from T(B, k) in ms keyed (B, k); None when batch 1 was not measured."""
    costs = perf_model.MeasuredCosts(step_times)
    ar = costs.ar_ms(1)
    if ar is None:
        return None

    def best(alpha: float) -> tuple[float, int] | None:
        found = [(s, g) for g in range(1, max_gamma + 1)
                 if (s := perf_model.predicted_speedup(costs, 1, g, alpha)) is not None]
        return max(found) if found else None

    top = best(OPTIMISTIC_ALPHA)
    if top is None:
        return None
    speedup, gamma = top
    even = next((a / 100 for a in range(101) if (b := best(a / 100)) and b[0] >= 1.0 + perf_model.SAFETY_MARGIN),
                None)
    return Outlook(gamma, speedup, costs.verify_ms(1, gamma) / ar, even)


def _size_class(batch: int) -> int:
    """Batch sizes whose rounds RunningCosts times together: those nearest the same power of two (a batch whose rows
    finish one by one keeps what its full rounds measured)."""
    return round(math.log2(max(1, batch)))


class RunningCosts:
    """Measured target step times, corrected by what this run's rounds take, plus the draft's cost per drafted
    token as this run measures it.

    The table is the best of 3 bare forwards of random tokens; a run's rounds also accept, compact and stream, on a
    machine whose memory bandwidth varies from run to run, and their tokens reach other experts than random ones
    do: on the GPU box's Qwen3 shape, rounds of 4 drafts at batch 1 took far less than the table's T(1, 5), plain
    steps at batch 32 less than its T(32, 1) (docs/measurements.md, "Auto against chains on the Qwen3 shape"). So
    each round's time (verify to streamed tokens) over the table's is kept per tokens per row and batch size
    (_size_class), a running average, and

    - a verify size this run has timed is priced at what its rounds took, scaled by the table's plain step over
      what this run's plain rounds took where any were timed (both sides measured: what auto weighs is the ratio);
    - one it has not is priced at the table times how much dearer than the table, against plain rounds, the nearest
      size timed ran (every verifying round so far where none was; never less than the table: a machine slower all
      round, or plain rounds not timed yet, must not make drafting look cheaper), and never above a larger size's
      timed price (a forward of more tokens is never cheaper).

    verify_floor_ms is the least a size not yet timed may cost: what auto's cost probes price it at (cost_probe);
    timed(B, k) says whether rounds of that shape ran (plain_probe)."""

    def __init__(self, target_ms: dict):
        self.table = perf_model.MeasuredCosts(target_ms)
        self.draft_token_ms: float = 0.0  # 0 until a round drafts: optimistic, so auto tries once
        self.scale = {False: 1.0, True: 1.0}  # observed / table: rounds that draft nothing, rounds that verify
        self.rounds = {False: 0, True: 0}
        self.ratios: dict = {}  # (size class, k) -> this run's rounds of that shape over the table's, running average
        self._table_ms: dict = {}  # (B, k) -> the table's T(B, k): interpolated once, asked for every round

    def _table(self, batch: int, k: int) -> float | None:
        key = (batch, k)
        if key not in self._table_ms:
            self._table_ms[key] = self.table.ar_ms(batch) if k == 1 else self.table.verify_ms(batch, k - 1)
        return self._table_ms[key]

    def keeping(self, earlier: "RunningCosts") -> "RunningCosts":
        """These step times with what `earlier` learnt of this run (the draft's cost, the rounds' corrections)."""
        self.draft_token_ms = earlier.draft_token_ms
        self.scale, self.rounds, self.ratios = dict(earlier.scale), dict(earlier.rounds), dict(earlier.ratios)
        return self

    def observe_draft(self, ms: float, tokens: int) -> None:
        if tokens:
            per = ms / tokens
            self.draft_token_ms = per if not self.draft_token_ms else 0.8 * self.draft_token_ms + 0.2 * per

    def observe_round(self, batch: int, gamma: int, ms: float) -> None:
        """A round of `batch` rows and `gamma` drafts each took `ms` from its verify forward to its last token."""
        table = self._table(batch, gamma + 1)
        if not table or ms <= 0:
            return
        side, ratio = gamma > 0, ms / table
        self.scale[side] = ratio if not self.rounds[side] else 0.7 * self.scale[side] + 0.3 * ratio
        self.rounds[side] += 1
        key = (_size_class(batch), gamma + 1)
        self.ratios[key] = ratio if key not in self.ratios else 0.7 * self.ratios[key] + 0.3 * ratio

    def timed(self, batch: int, k: int) -> bool:
        """Whether rounds of about `batch` rows and k tokens each ran in this run."""
        return (_size_class(batch), k) in self.ratios

    def ar_ms(self, batch):
        return self._table(batch, 1)

    def _timed_ms(self, batch: int, k: int) -> float | None:
        """The price of a timed verify size (the class's note), None where it was not timed."""
        ratio, table = self.ratios.get((_size_class(batch), k)), self._table(batch, k)
        if ratio is None or table is None:
            return None
        return table * ratio / self.ratios.get((_size_class(batch), 1), 1.0)

    def verify_ms(self, batch, gamma):
        timed = self._timed_ms(batch, gamma + 1)
        if timed is not None:
            return timed
        t = self._table(batch, gamma + 1)
        if t is None:
            return None
        size = _size_class(batch)
        verified = [k for (c, k) in self.ratios if c == size and k > 1]
        if verified:  # as much dearer than the table as the nearest size timed, against plain rounds
            near = min(verified, key=lambda k: (abs(k - gamma - 1), k))
            dearer = self.ratios[size, near] / self.ratios.get((size, 1), self.scale[False])
        else:
            dearer = self.scale[True] / self.scale[False]
        price = t * max(1.0, dearer)
        above = [self._timed_ms(batch, k) for k in verified if k > gamma + 1]
        return min([price] + [a for a in above if a is not None])

    def verify_floor_ms(self, batch, gamma):
        """The least γ drafts' verify may cost: its price where timed, else the price of the largest smaller size timed
        at this batch size, plain rounds included, or with none a plain step's where a longer size ran under the table
        by more than its noise (perf_model.SAFETY_MARGIN); with a longer size timed too, the chord from that price to
        the nearest longer one's (a plain step's price alone made every size below a timed chain look worth a probe,
        and auto probed them one after another). None where nothing says the table is too dear: no such
        size, or the smaller one's rounds ran dearer than the table by more than its noise."""
        timed = self._timed_ms(batch, gamma + 1)
        if timed is not None:
            return timed
        size = _size_class(batch)
        timed = [k for (c, k) in self.ratios if c == size]
        below = [k for k in timed if k < gamma + 1]
        above = [k for k in timed if k > gamma + 1]
        if below:
            k = max(below)
            price = self._timed_ms(batch, k)
            if price > self._table(batch, k) * (1 + perf_model.SAFETY_MARGIN):
                return None
        elif any(self._timed_ms(batch, h) < self._table(batch, h) * (1 - perf_model.SAFETY_MARGIN) for h in above):
            k, price = 1, self.ar_ms(batch)  # a verify costs at least a plain step
        else:
            return None
        if above:  # a forward's cost is concave in its tokens (the experts they reach saturate): not under the chord
            h = min(above)
            price += (self._timed_ms(batch, h) - price) * (gamma + 1 - k) / (h - k)
        return price

    def draft_ms(self, batch):
        return self.draft_token_ms

    def reject_ms(self, batch):
        return 0.0
