"""Auto against the best fixed choice (plain decoding, or chains of 1 to 4 drafts) on simulated runs: batch 1, 4, 16
and 32, acceptance 0.5 and 0.8, on the step times of the Mixtral and Qwen3 shapes with every expert in RAM.

The cost model: T(B, k), one forward of B rows and k tokens each, from the GPU box's measured T(B,1)/T(B,5)
(docs/measurements.md, "Speculative decoding on the synthetic shapes") and, between k = 1 and 5, the distinct
experts the B·k tokens reach (perf_model.activated_experts: with experts in RAM a step costs about the experts it
reads); the Qwen3 batch-1 row is the box's measured one. Drafting is free, as the oracle of `moedesk bench
--speculative` is. Each row accepts each draft with probability α, independently; the batch stays full (a finished
row's place taken at once, as in the app). Throughput is compared over the same number of tokens.
"""
import random

import pytest

from moedesk.engine.speculative import auto, perf_model

SHAPES = {  # experts, top-k, T(B,1)/T(B,5) at B = 1, 4, 16, 32
    "mixtral": (8, 2, {1: 0.36, 4: 0.67, 16: 0.96, 32: 1.01}),
    "qwen3": (128, 8, {1: 0.51, 4: 0.53, 16: 0.63, 32: 0.55}),
}
MEASURED = {("qwen3", 1): [1, 1.48, 1.72, 1.90, 2.13]}  # T(1, k) / T(1, 1)
SEEDS = 40


def step_table(shape: str, batch: int) -> dict:
    if (shape, batch) in MEASURED:
        return {(batch, k): 10.0 * r for k, r in enumerate(MEASURED[(shape, batch)], 1)}
    experts, top_k, efficiency = SHAPES[shape]
    reached = lambda t: float(perf_model.activated_experts(t, experts, top_k))  # noqa: E731
    t1 = 10.0 * batch ** 0.3
    t5 = t1 / efficiency[batch]
    share = lambda k: (reached(batch * k) - reached(batch)) / (reached(5 * batch) - reached(batch))  # noqa: E731
    return {(batch, k): t1 + (t5 - t1) * share(k) for k in range(1, 6)}


def simulate(costs, batch: int, alpha: float, tokens: int, seed: int, gamma: int | None = None,
             counts=(0, 0)) -> tuple[float, tuple]:
    """Tokens per ms against plain decoding's over `tokens` tokens a row; gamma None: auto decides every round,
    starting from acceptance `counts`. Returns (speedup, counts after the run)."""
    rng = random.Random(seed)
    accepted, tested = counts
    made, ms, ledger = 0, 0.0, auto.AutoLedger()
    horizon = min(auto.EXPLORE_HORIZON, tokens)
    while made < batch * tokens:
        g = gamma if gamma is not None else auto.auto_gamma(costs, batch, auto.acceptance_estimate(accepted, tested),
                                                            4, ledger, tested, horizon, tokens - made / batch)
        takes = []
        for _ in range(batch):
            taken = 0
            while taken < g and rng.random() < alpha:
                taken += 1
            takes.append(taken)
        ledger = ledger.book(costs, batch, g, 1 + sum(takes) / batch, tested)
        accepted, tested = auto.learn_acceptance((accepted, tested), sum(takes), sum(t + (t < g) for t in takes),
                                                 0 if g else 1)
        ms += perf_model.step_ms(costs, batch, g)
        made += batch + sum(takes)
    return made / ms * costs.ar_ms(batch) / batch, (accepted, tested)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def best_fixed(costs, batch, alpha, tokens) -> float:
    return max([1.0] + [mean(simulate(costs, batch, alpha, tokens, s, gamma=g)[0] for s in range(SEEDS))
                        for g in range(1, 5)])


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 4, 16, 32])
@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_auto_is_within_5_percent_of_the_best_choice(shape, batch, alpha):
    """A fresh run of 96 tokens a row, and one of 32 started from what an earlier request of the same draft
    measured (the engine keeps it: SpeculativeJob.close); a fresh 32-token run at batch 1 is below (the next test)."""
    costs = auto.RunningCosts(step_table(shape, batch))
    for tokens, counts in ((96, None), (32, "earlier")):
        runs = []
        for s in range(SEEDS):
            start = (0, 0)
            if counts == "earlier":  # a 64-token request before this one, its counts as the engine keeps them
                start = auto.carried_counts(*simulate(costs, batch, alpha, 64, 1000 + s)[1])
            runs.append(simulate(costs, batch, alpha, tokens, s, counts=start)[0])
        best = best_fixed(costs, batch, alpha, tokens)
        assert mean(runs) >= 0.95 * best, (tokens, counts, mean(runs), best)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 4, 16, 32])
@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_a_fresh_short_run_probes_at_once(shape, batch, alpha):
    """32 tokens a row with nothing known of the draft: the first rounds probe, so a good draft is drafted within
    the run (the issue's case: auto at 1.00x where chains gave 1.47x and 1.65x). At batch 1, where a rejected probe
    costs most and the run has the fewest rounds to recover, 0.9x of the best; elsewhere 0.95x."""
    costs = auto.RunningCosts(step_table(shape, batch))
    runs = mean(simulate(costs, batch, alpha, 32, s)[0] for s in range(SEEDS))
    best = best_fixed(costs, batch, alpha, 32)
    assert runs >= (0.9 if batch == 1 else 0.95) * best, (runs, best)
    if best > 1.4:
        assert runs > 1.3  # not the plain path


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 4, 16, 32])
def test_auto_stays_near_plain_where_drafting_loses(shape, batch):
    """A draft that is never right: probing costs at most the exploration budget (EXPLORE_SHARE) and one round."""
    costs = auto.RunningCosts(step_table(shape, batch))
    for tokens in (32, 96, 512):
        worst = max(perf_model.step_ms(costs, batch, g) for g in range(1, 5)) / costs.ar_ms(batch) - 1
        floor = 1 / (1 + auto.EXPLORE_SHARE + worst / tokens)
        assert min(simulate(costs, batch, 0.0, tokens, s)[0] for s in range(10)) >= floor - 1e-9


def gammas(costs, batch: int, phases, seed: int) -> list[list[int]]:
    """Auto's draft length each round of one run whose rows accept drafts at α, phase after phase of (α, rounds)."""
    rng = random.Random(seed)
    counts, ledger, chosen = (0, 0), auto.AutoLedger(), []
    left = sum(rounds for _, rounds in phases)  # rounds left: at least as many tokens a row
    for alpha, rounds in phases:
        chosen.append([])
        for _ in range(rounds):
            g = auto.auto_gamma(costs, batch, auto.acceptance_estimate(*counts), 4, ledger, counts[1],
                                remaining=left)
            left -= 1
            takes = [next((t for t in range(g) if rng.random() >= alpha), g) for _ in range(batch)]
            ledger = ledger.book(costs, batch, g, 1 + sum(takes) / batch, counts[1])
            counts = auto.learn_acceptance(counts, sum(takes), sum(t + (t < g) for t in takes), 0 if g else 1)
            chosen[-1].append(g)
    return chosen


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 4, 16, 32])
def test_auto_switches_drafting_on_and_off_as_the_acceptance_changes_within_a_run(shape, batch):
    """A reply whose draft guesses well (α 0.9), then badly (0.1: a change of subject), then well again: auto drafts
    in the first part, mostly decodes plainly in the second where drafting loses there, and drafts again in the
    third. Its acceptance is learnt online (auto.learn_acceptance: the last 64 drafts' worth, faded by plain steps),
    not averaged over the whole run, which kept it drafting through the bad part and plain through the good one."""
    costs = auto.RunningCosts(step_table(shape, batch))
    # Mixtral at 16 and 32 rows: drafting still gains a little at 0.1 (1.07x, 1.12x), so staying on is right there.
    drafting_loses_when_bad = best_fixed(costs, batch, 0.1, 96) <= 1.0
    for seed in range(20):
        good, bad, again = gammas(costs, batch, [(0.9, 60), (0.1, 120), (0.9, 160)], seed)
        assert all(good[-30:]), good
        if drafting_loses_when_bad:
            assert sum(g > 0 for g in bad[-60:]) <= 15, bad  # probes, within the exploration budget
        assert all(again[-40:]), again
