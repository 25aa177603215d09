"""Rounds that draft nothing (γ = 0: auto priced drafting out) run as the plain decode step does
(SpeculativeBatch._plain_round): no rejection call and no compaction, each row's token as Decoder._accept takes it,
and the same tokens, per-row stats and rounds as the general path (SpeculativeBatch._verify_round) gives such a
round, for greedy and seeded sampled rows, with the oracle and with an EAGLE head (which absorbs the target's
features of a plain round's token for its next draft)."""
import itertools

import pytest
import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.speculative import auto, perf_model, rejection, verification
from moedesk.engine.speculative.eagle_drafter import eagle_factory
from moedesk.engine.speculative.oracle_drafter import oracle_factory
from moedesk.engine.speculative.verification import SpeculativeBatch, Speculator
from tests.speculative.test_speculative_decode import PROMPTS, greedy, plain, random_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The per-row and per-run stats that do not depend on the clock.
COUNTS = ("drafted", "accepted", "verify_steps", "tokens_per_step", "acceptance")
SUMMARY = ("rounds", "speculative_rounds", "gammas", "mean_rows")


def _never_pays(batch):
    return auto.RunningCosts({(b, k): 10.0 * k for b in range(1, batch + 1) for k in range(1, 6)})


def _requests(engine, sampled):
    """Rows of different lengths; the first finishes first, so later rounds run rows 1.. (not a prefix slice)."""
    news = (6, 16, 11)
    params = [greedy(max_new=n) for n in news]
    if sampled:
        params[1] = SamplingParams(max_new_tokens=news[1], temperature=0.8, top_k=20, seed=3)
        params[2] = SamplingParams(max_new_tokens=news[2], temperature=1.0, top_p=0.9, seed=5)
    return [Request(engine.tokenizer.encode(p), q, tag=i) for i, (p, q) in enumerate(zip(PROMPTS, params))]


class Counts:
    """Counts rejection verdicts, compactions and plain rounds; records every proposal the drafter makes."""

    def __init__(self, monkeypatch):
        self.n = {"rejection": 0, "compact": 0, "plain_rounds": 0}
        self.proposals = []
        for name in ("greedy_chain", "greedy_tree", "sample_chain", "sample_tree"):
            monkeypatch.setattr(rejection, name, self._counting(getattr(rejection, name), "rejection"))
        monkeypatch.setattr(Speculator, "_compact", self._counting(Speculator._compact, "compact"))
        monkeypatch.setattr(SpeculativeBatch, "_plain_round",
                            self._counting(SpeculativeBatch._plain_round, "plain_rounds"))

    def _counting(self, f, key):
        def counted(*a, **k):
            self.n[key] += 1
            return f(*a, **k)
        return counted

    def factory(self, inner):
        def make(batch, capacity):
            drafter = inner(batch, capacity)
            propose = drafter.propose

            def recorded(*a, **k):
                p = propose(*a, **k)
                self.proposals.append((p.parents, p.tokens.tolist()))
                return p
            drafter.propose = recorded
            return drafter
        return make


def _run(engine, requests, factory, counts, costs):
    sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                    engine.tokenizer, graphs=False)
    done, stats = sp.run(requests, engine.executor, counts.factory(factory), mode="auto", draft_length=3, costs=costs)
    summary = stats.summary()
    return ([c.token_ids for c in done], [{k: c.stats["speculative"][k] for k in COUNTS} for c in done],
            [(r.gamma, r.rows, r.emitted) for r in stats.rounds], {k: summary[k] for k in SUMMARY})


def _general_path(monkeypatch):
    """γ = 0 rounds through the general path (draft, verify, reject, compact, emit), as before the plain one."""
    monkeypatch.setattr(SpeculativeBatch, "_plain_round",
                        lambda self, active, proposal, executor, t0: self._verify_round(active, proposal, executor,
                                                                                       0, t0))


def _factory(engine, draft, expected, tmp_path):
    if draft == "oracle":
        return oracle_factory(expected, 0.3, engine.vocab_size, seed=1)
    return eagle_factory(random_head(engine, int(draft[-1]), tmp_path / draft), engine.config.num_layers)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft", ["oracle", "eagle1", "eagle3"])
def test_rounds_that_draft_nothing_take_the_plain_path(draft, sampled, engines, tmp_path, monkeypatch):
    """auto priced out of drafting: every round is a plain one (no verdict, no compaction), and its tokens, stats
    and rounds are the general path's; greedy rows are plain greedy decoding's tokens."""
    engine = engines("mixtral")
    requests = _requests(engine, sampled)
    expected = plain(engine, requests)
    factory = _factory(engine, draft, expected, tmp_path)
    with monkeypatch.context() as m:
        fast = Counts(m)
        got = _run(engine, requests, factory, fast, _never_pays(3))
    assert {g for g, _, _ in got[2]} == {0}
    assert fast.n == {"rejection": 0, "compact": 0, "plain_rounds": len(got[2])}
    with monkeypatch.context() as m:
        general = Counts(m)
        _general_path(m)
        want = _run(engine, requests, factory, general, _never_pays(3))
    assert general.n["plain_rounds"] == 0 and general.n["rejection"] > 0  # the reference did go the general way
    assert got == want
    assert fast.proposals == general.proposals
    for tokens, want_tokens, r in zip(got[0], expected, requests):
        if r.params.temperature == 0:
            assert tokens == want_tokens


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft", ["oracle", "eagle1", "eagle3"])
def test_plain_rounds_between_drafting_rounds(draft, sampled, engines, tmp_path, monkeypatch):
    """Plain rounds between drafting ones (auto's choice scripted): the drafts after plain rounds (an EAGLE head's
    built on the features it absorbed in them), the tokens, stats and rounds are the general path's."""
    engine = engines("mixtral")
    requests = _requests(engine, sampled)
    expected = plain(engine, requests)
    factory = _factory(engine, draft, expected, tmp_path)
    script = [2, 0, 0, 3, 0, 1, 0, 0, 0]

    def run(general):
        with monkeypatch.context() as m:
            counts = Counts(m)
            if general:
                _general_path(m)
            schedule = itertools.cycle(script)
            m.setattr(verification, "auto_gamma", lambda *a, **k: next(schedule))
            return _run(engine, requests, factory, counts, _never_pays(3)), counts

    got, fast = run(False)
    want, general = run(True)
    assert {g for g, _, _ in got[2]} == {0, 1, 2, 3}
    assert fast.n["plain_rounds"] == sum(g == 0 for g, _, _ in got[2]) > 0
    assert general.n["plain_rounds"] == 0
    assert got == want
    assert fast.proposals == general.proposals
    for tokens, want_tokens, r in zip(got[0], expected, requests):
        if r.params.temperature == 0:
            assert tokens == want_tokens


def test_seeded_sampling_in_plain_rounds_is_plain_decodings(engines):
    """A sampled row's token in a round that drafts nothing is the plain step's sample (sample_token with the row's
    generator), so with auto priced out a seeded request gives plain decoding's tokens."""
    engine = engines("mixtral")
    requests = [Request(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=12, temperature=0.9, seed=s),
                        tag=i) for i, (p, s) in enumerate(zip(PROMPTS, (11, 12, 13)))]
    expected = plain(engine, requests)
    sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                    engine.tokenizer, graphs=False)
    done, stats = sp.run(requests, engine.executor, oracle_factory(expected, 0.0, engine.vocab_size), mode="auto",
                         draft_length=3, costs=_never_pays(3))
    assert {r.gamma for r in stats.rounds} == {0}
    assert [c.token_ids for c in done] == expected


def test_sample_chain_without_drafts_samples_the_target():
    """γ = 0 (the general path of a round that drafts nothing): no drafts tested, the token the target's own draw."""
    target = torch.softmax(torch.randn(3, 1, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    g, h = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    v = rejection.sample_chain(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0, 50), target, g)
    assert v.accepted.tolist() == [0, 0, 0]
    assert torch.equal(v.next_token, torch.multinomial(target[:, 0].double(), 1, generator=h)[:, 0])


def test_running_costs_price_what_the_table_says():
    """RunningCosts keeps the table's interpolations (auto asks for them every round): the same prices."""
    table = {(b, k): 5.0 + b * k ** 1.3 for b in (1, 2, 4, 8) for k in range(1, 6)}
    costs, raw = auto.RunningCosts(table), perf_model.MeasuredCosts(table)
    for _ in range(2):
        for b in (1, 3, 4, 7, 8, 9):
            assert costs.ar_ms(b) == raw.ar_ms(b)
            for gamma in range(0, 6):
                assert costs.verify_ms(b, gamma) == raw.verify_ms(b, gamma)
    costs.observe_round(4, 0, 2 * raw.ar_ms(4))
    costs.observe_round(4, 2, 6 * raw.verify_ms(4, 2))
    assert costs.verify_ms(4, 2) == pytest.approx(3 * raw.verify_ms(4, 2))
