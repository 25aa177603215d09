"""The record of a speculative run's rounds (engine.speculative.verification.RunStats, Round).

A round carries the tokens it emitted beside its three timings; the summary's milliseconds are those timings
only (the count of emitted tokens must not be summed into them), and a run's rounds emitted every token its
completions hold after the prefill's.
"""
import pytest

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.speculative.oracle_drafter import oracle_factory
from moedesk.engine.speculative.verification import Round, RunStats, Speculator


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_round_is_a_named_record_that_indexes_as_before():
    r = Round(4, 16, 1.5, 250.0, 3.0, 37)
    assert (r[0], r[1], r[2], r[3], r[4], r[5]) == (4, 16, 1.5, 250.0, 3.0, 37)
    assert (r.gamma, r.rows, r.draft_ms, r.verify_ms, r.accept_ms, r.emitted) == tuple(r)[:6]
    assert r.captured == 0 and Round(4, 16, 1.5, 250.0, 3.0, 37, 1).captured == 1


def test_speed_figures_leave_out_rounds_that_captured_graphs():
    """A round whose forward captured CUDA graphs pays a one-off cost: the bench's figures leave it out (as the
    plain run's first step), and auto does not price later rounds by it."""
    from moedesk.bench.speculative import full_batch_throughput, timed_rounds
    from moedesk.engine.speculative.verification import SpeculativeBatch

    rounds = [Round(0, 4, 0.0, 900.0, 1.0, 4, 1), Round(0, 4, 0.0, 99.0, 1.0, 4), Round(4, 4, 0.0, 199.0, 1.0, 12)]
    assert timed_rounds(rounds) == rounds[1:]
    assert full_batch_throughput(rounds, 4) == (pytest.approx(1000 * 16 / 300), 2)

    seen = []

    class Costs:
        def observe_round(self, rows, gamma, ms):
            seen.append((rows, gamma, ms))

    batch = SpeculativeBatch.__new__(SpeculativeBatch)
    batch.costs = Costs()
    batch._observe(4, 0, 900.0, 1)
    batch._observe(4, 0, 99.0, 0)
    assert seen == [(4, 0, 99.0)]


def test_summary_milliseconds_leave_the_emitted_tokens_out():
    # emitted counts far larger than the times: summed into the milliseconds they would dominate step_ms
    stats = RunStats("greedy", [Round(4, 16, 1.0, 200.0, 4.0, 1000), Round(0, 2, 0.0, 100.0, 2.0, 3000)])
    s = stats.summary()
    assert s["step_ms"] == pytest.approx((205.0 + 102.0) / 2)
    assert s["draft_ms"] == pytest.approx(0.5) and s["verify_ms"] == pytest.approx(150.0)
    assert s["rounds"] == 2 and s["speculative_rounds"] == 1 and s["gammas"] == [0, 4] and s["mean_rows"] == 9.0
    assert RunStats("greedy").summary() == {}


def test_rounds_record_every_token_the_run_emitted(engines):
    engine = engines("mixtral")
    prompts = ["The quick brown fox jumps over the lazy", "Hello, world!", "def add(a, b):"]
    # different lengths: rows finish at different rounds, and a finishing row takes less than it was offered
    requests = [Request(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True),
                        tag=i) for i, (p, n) in enumerate(zip(prompts, (7, 12, 18)))]
    expected = [next(iter(engine.generate([r], batch_size=1))).token_ids for r in requests]
    sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                    engine.tokenizer)
    done, stats = sp.run(requests, engine.executor, oracle_factory(expected, 0.3, engine.vocab_size, seed=1),
                         mode="greedy", draft_length=4)
    assert all(isinstance(r, Round) for r in stats.rounds)
    assert sum(r.emitted for r in stats.rounds) == sum(len(c.token_ids) - 1 for c in done)
    assert all(r.rows <= r.emitted <= r.rows * (r.gamma + 1) for r in stats.rounds[:-1])
    assert [r.rows for r in stats.rounds][0] == 3 and stats.rounds[-1].rows == 1
