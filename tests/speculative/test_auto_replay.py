"""Auto replayed on the step costs the GPU box measured for the Qwen3-30B-A3B shape (12 layers, every expert in RAM,
`bash tests/perf/spec_bench.sh qwen3`, 2026-11-29; docs/measurements.md, "Auto against chains on the Qwen3 shape").

Auto prices rounds at TABLE, the T(B, k) that run measured for it (random tokens, best of 3), but its rounds took
what ROUNDS says: plain decoding's step (B / its tok/s), the greedy chains of 4 (B x tokens per step / tok/s), and at
batch 1 auto's own chains of 2. The two disagree both ways: at batch 1 a chain of 4 took 20 ms where the table says
40, at batch 32 a plain step 112 ms where it says 155. Between the measured k, a round's time follows the table's
shape (true_costs). Drafting is free (the bench's oracle); each row accepts each draft with probability α.
"""
import random

import pytest

from moedesk.engine.speculative import auto, perf_model

TABLE = {
    (1, 1): 8.965, (1, 2): 15.924, (1, 3): 17.97, (1, 4): 27.936, (1, 5): 40.103,
    (4, 1): 41.429, (4, 2): 48.793, (4, 3): 66.042, (4, 4): 85.521, (4, 5): 95.906,
    (16, 1): 98.285, (16, 2): 148.444, (16, 3): 160.065, (16, 4): 175.688, (16, 5): 194.988,
    (32, 1): 155.009, (32, 2): 195.572, (32, 3): 211.478, (32, 4): 204.368, (32, 5): 226.797,
}
ROUNDS = {  # (B, α) -> {k: ms of a round of B rows x k tokens each, as the run's rounds took}
    (1, 0.5): {1: 11.29, 3: 17.86, 5: 26.33}, (1, 0.8): {1: 10.02, 3: 17.86, 5: 20.33},
    (4, 0.5): {1: 40.15, 5: 117.0}, (4, 0.8): {1: 29.95, 5: 109.2},
    (16, 0.5): {1: 90.76, 5: 253.7}, (16, 0.8): {1: 84.48, 5: 217.9},
    (32, 0.5): {1: 112.4, 5: 310.9}, (32, 0.8): {1: 113.3, 5: 278.7},
}
SEEDS = 40


def true_costs(batch: int, alpha: float, table: dict = TABLE, rounds: dict = ROUNDS) -> dict[int, float]:
    """A round's time for k = 1..5 (or as far as the table goes): measured where `rounds` has it, else between the
    measured neighbours in the proportions of the table's, never less than k - 1's."""
    measured, out = rounds[batch, alpha], {}
    for k in range(1, max(k for b, k in table if b == batch) + 1):
        lo, hi = max(m for m in measured if m <= k), min(m for m in measured if m >= k)
        share = 0.0 if lo == hi else (table[batch, k] - table[batch, lo]) / (table[batch, hi] - table[batch, lo])
        out[k] = max(out.get(k - 1, 0.0), measured[lo] + (measured[hi] - measured[lo]) * min(1.0, max(0.0, share)))
    return out


def table_of(batch: int, table: dict = TABLE) -> dict:
    return {key: ms for key, ms in table.items() if key[0] == batch}


def simulate(batch: int, alpha: float, tokens: int, seed: int, gamma: int | None = None, table: dict = TABLE,
             rounds: dict = ROUNDS, remaining: bool = True) -> tuple[float, list]:
    """(speedup over plain decoding's true step, each round's γ) of `tokens` new tokens a row; gamma None: auto
    decides every round from a fresh start (draft lengths up to the table's), its RunningCosts timing each round
    as SpeculativeBatch does."""
    true, rng = true_costs(batch, alpha, table, rounds), random.Random(seed)
    costs, ledger, counts = auto.RunningCosts(table_of(batch, table)), auto.AutoLedger(), (0, 0)
    made, ms, chosen = 0, 0.0, []
    while made < batch * tokens:
        g = gamma if gamma is not None else auto.auto_gamma(costs, batch, auto.acceptance_estimate(*counts),
                                                            len(true) - 1, ledger, counts[1],
                                                            min(auto.EXPLORE_HORIZON, tokens),
                                                            tokens - made / batch if remaining else None)
        takes = [next((t for t in range(g) if rng.random() >= alpha), g) for _ in range(batch)]
        costs.observe_round(batch, g, true[g + 1])
        ledger = ledger.book(costs, batch, g, 1 + sum(takes) / batch, counts[1])
        counts = auto.learn_acceptance(counts, sum(takes), sum(t + (t < g) for t in takes), 0 if g else 1)
        ms += true[g + 1]
        made += batch + sum(takes)
        chosen.append(g)
    return made / ms * true[1] / batch, chosen


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def fixed_choices(batch: int, alpha: float, tokens: int, table: dict = TABLE, rounds: dict = ROUNDS) -> list[float]:
    """Mean speedup of plain decoding (0) and of chains of each length, on the replayed costs."""
    longest = max(k for b, k in table if b == batch) - 1
    return [mean(simulate(batch, alpha, tokens, s, g, table, rounds)[0] for s in range(SEEDS))
            for g in range(longest + 1)]


def best_fixed(batch: int, alpha: float, tokens: int) -> float:
    return max(fixed_choices(batch, alpha, tokens))


def test_the_replayed_costs_are_the_runs():
    """The replay's chains of 4 reproduce the greedy rows of that run within its noise, where the table's price
    (what auto knew) said they lose at batch 1."""
    for (batch, alpha), measured in {(1, 0.8): 1.91, (16, 0.8): 1.27, (32, 0.5): 0.71}.items():
        assert mean(simulate(batch, alpha, 32, s, gamma=4)[0] for s in range(SEEDS)) == pytest.approx(measured,
                                                                                                     rel=0.15)
    priced = perf_model.predicted_speedup(perf_model.MeasuredCosts(table_of(1)), 1, 4, 0.88)
    assert priced < 1.0


def test_auto_tries_a_longer_chain_the_table_prices_too_dear():
    """Batch 1, a good draft (its acceptance known): chains of 2 timed as the table says; the table prices 4 drafts
    at 40 ms, so auto kept 2 (1.50x where chains of 4 gave 1.91x). It now times the next longer chain while a
    timed shorter one says it may cost as little (cost_probe), 3 then 4, and drafts 4 at the 20 ms it takes."""
    costs = auto.RunningCosts(table_of(1))
    for _ in range(3):
        costs.observe_round(1, 2, 17.86)
    assert perf_model.choose_draft_length(costs, 1, 0.87, 4, auto.AUTO_MARGIN).gamma == 2
    assert costs.verify_floor_ms(1, 4) == pytest.approx(17.86) and costs.verify_ms(1, 4) == pytest.approx(40.103)
    assert auto.auto_gamma(costs, 1, 0.87, 4, evidence=20, horizon=32) == 0  # a gain of 1.32x: time plain first
    costs.observe_round(1, 0, 10.02)
    assert costs.verify_ms(1, 2) == pytest.approx(17.86 * 8.965 / 10.02)  # priced against the plain round
    assert auto.auto_gamma(costs, 1, 0.87, 4, evidence=20, horizon=32) == 3
    costs.observe_round(1, 3, 18.97)
    assert auto.auto_gamma(costs, 1, 0.87, 4, evidence=20, horizon=32) == 4
    costs.observe_round(1, 4, 20.33)
    assert costs.verify_ms(1, 4) == pytest.approx(20.33 * 8.965 / 10.02)
    assert perf_model.choose_draft_length(costs, 1, 0.87, 4, auto.AUTO_MARGIN).gamma == 4
    # where the chain of 4 is as dear as the table says, a shorter one again
    for _ in range(3):
        costs.observe_round(1, 4, 41.0)
    assert perf_model.choose_draft_length(costs, 1, 0.87, 4, auto.AUTO_MARGIN).gamma in (2, 3)
    # a probe is held to the exploration budget: none with the budget spent
    spent = auto.AutoLedger(plain_ms=0.0, loss_ms=1000.0)
    fresh = auto.RunningCosts(table_of(1))
    fresh.observe_round(1, 0, 8.965)
    fresh.observe_round(1, 2, 17.86)
    assert auto.auto_gamma(fresh, 1, 0.87, 4, spent, evidence=20, horizon=32) == 2


def test_auto_times_a_plain_round_before_betting_on_a_small_gain():
    """Batch 32, acceptance 0.5: a chain of 3 timed at 268 ms looks like 1.08x against the table's 155 ms plain
    step, but plain decoding took 112 ms there (auto kept drafting: 0.89x). One plain round (plain_probe) and
    drafting is priced out; a chain of 1, not timed yet, may be probed once within the budget."""
    costs = auto.RunningCosts(table_of(32))
    costs.observe_round(32, 3, 268.5)
    assert perf_model.choose_draft_length(costs, 32, 0.5, 4, auto.AUTO_MARGIN).gamma == 3
    assert auto.auto_gamma(costs, 32, 0.5, 4, evidence=60, horizon=32) == 0
    costs.observe_round(32, 0, 112.4)
    assert costs.verify_ms(32, 3) == pytest.approx(268.5 * 155.009 / 112.4)
    assert perf_model.choose_draft_length(costs, 32, 0.5, 4, auto.AUTO_MARGIN).gamma == 0
    assert auto.auto_gamma(costs, 32, 0.5, 4, evidence=60, horizon=32) in (0, 1)
    costs.observe_round(32, 1, 224.6)
    assert auto.auto_gamma(costs, 32, 0.5, 4, evidence=60, horizon=32) == 0
    # a gain the plain step's doubt cannot erase is not held up by a plain round
    big = auto.RunningCosts(table_of(32))
    big.observe_round(32, 4, 160.0)
    assert auto.auto_gamma(big, 32, 0.8, 4, evidence=60, horizon=32) == 4


def test_running_costs_keep_timings_across_nearby_batch_sizes():
    """A batch whose rows finish one by one keeps its full rounds' timings (rows 32 down to 23 share them)."""
    costs = auto.RunningCosts(table_of(16) | table_of(32))
    costs.observe_round(32, 4, 300.0)
    assert costs.timed(31, 5) and costs.timed(23, 5) and not costs.timed(22, 5) and not costs.timed(32, 1)
    assert costs.verify_ms(31, 4) == pytest.approx(costs.table.verify_ms(31, 4) * 300.0 / 226.797)
    # an untimed shorter verify is never priced above the timed longer one
    assert costs.verify_ms(32, 1) <= costs.verify_ms(32, 4)
    # the floor of an untimed longer size is the largest shorter timed one, unless those rounds ran dearer than the
    # table by more than its noise
    assert costs.verify_floor_ms(16, 3) is None  # nothing timed at 16 rows
    costs.observe_round(16, 1, 150.0)
    assert costs.verify_floor_ms(16, 3) == pytest.approx(150.0)
    assert costs.verify_floor_ms(16, 1) == pytest.approx(150.0)  # timed: its own price
    costs.observe_round(16, 2, 200.0)  # the table says 160
    assert costs.verify_floor_ms(16, 3) is None


@pytest.mark.parametrize("batch", [1, 4, 16, 32])
@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_auto_is_within_5_percent_of_the_best_fixed_choice_on_the_measured_costs(batch, alpha):
    """Runs of 96 new tokens a row from a fresh start: issue 42's target (auto >= 0.95x the best of plain and chains
    of 1-4) on the costs the box measured, where the table's prices alone left auto at 0.81x (batch 1, α 0.8 and
    batch 32, α 0.5)."""
    runs = mean(simulate(batch, alpha, 96, s)[0] for s in range(SEEDS))
    assert runs >= 0.95 * best_fixed(batch, alpha, 96)


@pytest.mark.parametrize("batch", [1, 4, 16, 32])
@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_a_fresh_32_token_run_on_the_measured_costs(batch, alpha):
    """The bench's own length, 32 tokens a row from a fresh start: exploring takes a larger share of so few rounds.
    At batch 1 the budget (EXPLORE_SHARE of 32 plain steps) affords one rejected probe, so a run whose first draft
    is rejected stays plain: 0.84x of the best at α 0.8 on average over runs (0.77x before auto timed its rounds
    per size), 0.91x at batch 4, 0.94x and more above."""
    runs = mean(simulate(batch, alpha, 32, s)[0] for s in range(SEEDS))
    assert runs >= (0.82 if batch == 1 else 0.9 if batch == 4 else 0.93) * best_fixed(batch, alpha, 32)


@pytest.mark.parametrize("shape", ["mixtral", "qwen3"])
@pytest.mark.parametrize("batch", [1, 4, 16, 32])
@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_probes_cost_little_where_the_table_is_right(shape, batch, alpha):
    """Rounds that take what the table says, give or take 10% (test_auto_grid's step times): auto's probes of sizes
    and plain steps find nothing to correct, and cost it at most 5% of the best choice over 96 tokens a row."""
    from tests.speculative.test_auto_grid import step_table

    table = step_table(shape, batch)
    truth = perf_model.MeasuredCosts(table)

    def run(seed: int, gamma: int | None = None) -> float:
        rng, wobble = random.Random(seed), random.Random(seed + 1000)
        costs, ledger, counts = auto.RunningCosts(table), auto.AutoLedger(), (0, 0)
        made, ms = 0, 0.0
        while made < batch * 96:
            g = gamma if gamma is not None else auto.auto_gamma(
                costs, batch, auto.acceptance_estimate(*counts), 4, ledger, counts[1], 96)
            takes = [next((t for t in range(g) if rng.random() >= alpha), g) for _ in range(batch)]
            took = perf_model.step_ms(truth, batch, g) * (1 + 0.1 * (2 * wobble.random() - 1))
            costs.observe_round(batch, g, took)
            ledger = ledger.book(costs, batch, g, 1 + sum(takes) / batch, counts[1])
            counts = auto.learn_acceptance(counts, sum(takes), sum(t + (t < g) for t in takes), 0 if g else 1)
            ms += took
            made += batch + sum(takes)
        return made / ms * truth.ar_ms(batch) / batch

    best = max(mean(run(s, g) for s in range(SEEDS)) for g in range(5))
    assert mean(run(s) for s in range(SEEDS)) >= 0.95 * best
