"""Auto replayed on session 37's run of the Qwen3-30B-A3B shape on the GPU box (12 layers, every expert in RAM, γ 4,
32 new tokens a row: `BATCHES=1,16 ACCEPT=0.5,0.8 bash tests/perf/spec_bench.sh qwen3`, 2026-11-29; docs/measurements.md,
"Auto's opening probe and the floor of a verify size"). There auto took 0.85x and 0.83x of chains of 4 at α 0.8
(B = 1, 16) and 0.96x plain at B = 16, α 0.5, because

- its first probes were held to a budget of 4% of 32 plain steps that a chain of 4 rejected at once nearly spends, and
  it preferred probes leaving room for another: 1, 2, 1, 2 drafts before 4 at B = 1, 1 before 4 at B = 16;
- an untimed verify size was floored at a timed plain step's price, so once a chain of 4 and a plain round were
  timed, every size between looked like a bargain and was probed in turn (4, 0, 3, 2, 1 at B = 16, α 0.8).

TABLE is the T(B, k) that run measured for auto; ROUNDS what its rounds took (replay_auto.round_costs of its report:
plain decoding's step from its tok/s, and the rounds that ran every row and captured no CUDA graph).
"""
import pytest

from moedesk.engine.speculative import auto, perf_model
from tests.speculative.test_auto_replay import SEEDS, fixed_choices, mean, simulate, table_of

TABLE = {
    (1, 1): 8.394, (1, 2): 13.334, (1, 3): 15.568, (1, 4): 17.727, (1, 5): 18.937,
    (16, 1): 76.5, (16, 2): 121.583, (16, 3): 144.4, (16, 4): 133.359, (16, 5): 144.199,
}
ROUNDS = {  # (B, α) -> {k: ms of a round of B rows x k tokens each, as the run's rounds took}
    (1, 0.5): {1: 8.86, 5: 18.62}, (1, 0.8): {1: 8.17, 2: 13.46, 3: 16.52, 5: 16.52},
    (16, 0.5): {1: 76.5, 2: 127.05, 5: 179.53}, (16, 0.8): {1: 71.61, 2: 124.63, 4: 165.3, 5: 170.02},
}


def replay(batch: int, alpha: float, tokens: int = 32) -> tuple[float, float]:
    """(auto's mean speedup over plain decoding, the best fixed choice's) over SEEDS runs of `tokens` a row."""
    auto_runs = mean(simulate(batch, alpha, tokens, s, None, TABLE, ROUNDS)[0] for s in range(SEEDS))
    return auto_runs, max(fixed_choices(batch, alpha, tokens, TABLE, ROUNDS))


@pytest.mark.parametrize("batch", [1, 16])
def test_the_opening_probe_is_the_longest_chain_that_pays_at_the_optimistic_acceptance(batch):
    """Nothing known of the draft: the first round drafts 4 (the table's best at acceptance 1), its own budget as
    large as the run's; a later probe with the same evidence is held to the run's budget, leaving room for another."""
    costs = auto.RunningCosts(table_of(batch, TABLE))
    prior = auto.acceptance_estimate(0, 0)
    assert auto.auto_gamma(costs, batch, prior, 4, horizon=32) == 4
    if batch == 1:  # 1.28 plain steps of budget: a rejected chain of 4 loses 1.26, so with another to come, 1 draft
        assert auto.auto_gamma(costs, 1, prior, 4, auto.AutoLedger(drafted=1), horizon=32) == 1
    # the opening's loss is not booked against the run's budget, its gain is
    ledger = auto.AutoLedger().book(costs, batch, 4, 1.0, evidence=0)
    assert ledger.loss_ms == 0 and ledger.drafted == 1
    assert auto.AutoLedger().book(costs, batch, 4, 5.0, evidence=0).loss_ms < 0
    # where earlier requests measured the draft, there is no opening: the run's budget holds from the first round
    assert not auto.AutoLedger().opens(auto.MIN_EVIDENCE)
    assert auto.AutoLedger().book(costs, batch, 4, 1.0, evidence=auto.MIN_EVIDENCE).loss_ms > 0


def test_a_timed_plain_round_does_not_make_every_shorter_chain_a_bargain():
    """B = 16, α 0.8: chains of 4 timed at 170 ms and plain rounds at 71.6. A chain of 3 cannot cost less than the
    chord between them (a forward's cost is concave in its tokens), so at that floor it would not beat 4 and is not
    probed, nor 2 or 1: auto drafts 4, as chains of 4 did (1.39x)."""
    costs = auto.RunningCosts(table_of(16, TABLE))
    costs.observe_round(16, 4, 170.02)
    costs.observe_round(16, 0, 71.61)
    four = costs.verify_ms(16, 4)
    assert costs.verify_floor_ms(16, 3) == pytest.approx(76.5 + (four - 76.5) * 3 / 4)
    assert costs.verify_floor_ms(16, 1) == pytest.approx(76.5 + (four - 76.5) / 4)
    for evidence in (30, 60, 64):
        assert auto.auto_gamma(costs, 16, 0.78, 4, evidence=evidence, horizon=32) == 4
    # B = 1: chains of 4 ran under the table (16.5 ms against 18.9), nothing shorter timed: a chain of 3 is floored
    # on the chord from the table's plain step, not at the plain step itself, and not probed
    one = auto.RunningCosts(table_of(1, TABLE))
    one.observe_round(1, 4, 16.52)
    assert one.verify_floor_ms(1, 3) == pytest.approx(8.394 + (16.52 - 8.394) * 3 / 4)
    assert auto.auto_gamma(one, 1, 0.8, 4, evidence=20, horizon=32) == 4


@pytest.mark.parametrize("batch, alpha, share", [(1, 0.8, 0.91), (16, 0.8, 0.96)])
def test_auto_takes_the_gain_where_drafting_pays(batch, alpha, share):
    """Fresh 32-token runs at α 0.8 (what the run measured: 0.85x and 0.83x of chains of 4)."""
    runs, best = replay(batch, alpha)
    assert runs >= share * best, (runs, best)


@pytest.mark.parametrize("batch, floor", [(1, 0.98), (16, 0.965)])
def test_auto_stays_near_plain_at_half_acceptance(batch, floor):
    """Fresh 32-token runs at α 0.5, where plain decoding (B = 16) or 2 drafts barely ahead of it (B = 1) is best: the
    opening probe and what follows cost at most 3.5% of plain decoding."""
    runs, best = replay(batch, 0.5)
    assert best < 1.02 and runs >= floor, (runs, best)
