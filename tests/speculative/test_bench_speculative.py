"""`moedesk bench --speculative`, `--beams` and `--model/--draft/--prompts` (bench.speculative), on the CPU.

The command runs end to end on a tiny synthetic shape and on a tiny checkpoint with a random head; its JSON
has the fields docs/benchmarks.md names; the oracle draft's measured acceptance is the requested one within a
binomial tolerance; auto's decision never speculates where the measured step times say it loses; the fit's
error is what the fitted model does at the measured points.
"""
import json
import math
import random
import types

import numpy as np
import pytest

from moedesk.engine.speculative import auto, perf_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_bench():
    from moedesk.bench.synthetic import prepare_synthetic

    return prepare_synthetic("tiny-moe", 2, _two_experts(160), "cpu", context=160, log=lambda *a: None)


def _two_experts(context: int) -> float:
    """The GPU budget (GiB) that keeps 2 of tiny-moe's 16 experts resident beside its weights and cache."""
    from moedesk.bench.budget import budget_for_experts
    from moedesk.engine.load.synthetic import shape_config

    return budget_for_experts(shape_config("tiny-moe", 2), 2, context)


def test_bench_speculative_and_beams_run_end_to_end(capsys, tmp_path, monkeypatch):
    from moedesk.app.cli import main
    from moedesk.bench.synthetic import format_beam
    from moedesk.bench.speculative import format_speculative

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    from moedesk.bench.speculative import PROMPT_TOKENS

    budget = _two_experts(PROMPT_TOKENS + 10 + 2 * (2 + 1) + 8)  # the context the command builds for these flags
    assert main(["bench", "--shape", "tiny-moe", "--layers", "2", "--gpu-budget", str(budget), "--device", "cpu",
                 "--speculative", "--beams", "2", "--batches", "1,2", "--acceptance", "0.5,0.9",
                 "--draft-length", "2", "--decode-tokens", "10", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shape"] == "tiny-moe" and report["layers"] == 2
    s = report["speculative"]
    assert s["gamma"] == 2 and s["batches"] == [1, 2] and s["acceptances"] == [0.5, 0.9]
    assert sorted(s["step_times_ms"]) == ["1,1", "1,2", "1,3", "2,1", "2,2", "2,3"]
    assert set(s["fit"]) >= {"ridge_tokens", "rms_relative_error", "max_relative_error", "residuals", "params"}
    assert [p["batch"] for p in s["per_batch"]] == [1, 2]
    for p in s["per_batch"]:
        assert p["efficiency"] == pytest.approx(p["T_ms"]["1"] / p["T_ms"]["3"], rel=1e-2)
        assert p["plain_tok_s"] > 0 and isinstance(p["auto_ok"], bool)
    assert s["auto_never_loses"] == all(p["auto_ok"] for p in s["per_batch"])
    runs = s["runs"]
    assert [(r["batch"], r["acceptance"], r["mode"]) for r in runs] == [
        (b, a, m) for b in (1, 2) for a in (0.5, 0.9) for m in ("greedy", "auto")]
    for r in runs:
        assert r["tok_s"] > 0 and r["speedup"] == pytest.approx(r["tok_s"] / r["plain_tok_s"], rel=1e-2)
        assert r["full_batch_speedup"] == pytest.approx(r["full_batch_tok_s"] / r["plain_tok_s"], rel=1e-2)
        if r.get("path") != "plain":  # each round as it ran: [γ, rows, verify ms, accept ms, emitted, captured]
            log = r["round_log"]
            assert len(log) == r["rounds"] and sorted({g for g, *_ in log}) == r["gammas"]
            assert all(1 <= rows <= r["batch"] and v > 0 and e >= rows for _, rows, v, _, e, _ in log)
        if r["mode"] == "greedy":
            assert r["predicted_speedup"] > 0 and 0 <= r["measured_acceptance"] <= 1
            assert r["same_as_plain"] == 1.0  # float32 on the CPU: lossless to the token
            assert r["agreement"] == 1.0 and r["acceptance_capped"] is False  # float32: every clean draft holds
            assert 1 <= r["full_batch_rounds"] <= r["rounds"]
            if r["batch"] == 1:  # one row: every round ran the full batch
                assert r["full_batch_rounds"] == r["rounds"]
                assert r["full_batch_tok_s"] == pytest.approx(r["tok_s"], rel=1e-2)
    judged = {b: min(r["full_batch_speedup"] for r in runs if r["batch"] == b and r["mode"] == "auto") for b in (1, 2)}
    for p in s["per_batch"]:
        assert p["auto_min_speedup"] == pytest.approx(judged[p["batch"]], abs=1e-3)
        assert p["auto_ok"] == (p["auto_min_speedup"] >= s["auto_floor"])
        assert p["auto_min_speedup_whole_run"] == min(r["speedup"] for r in runs if r["batch"] == p["batch"]
                                                      and r["mode"] == "auto")
    assert s["auto_judged_on"] == "full_batch"
    # tests/perf/replay_auto.py reads the rounds back: a cost per draft length that ran, plain's from its tok/s
    from tests.perf import replay_auto

    table, rounds = replay_auto.round_costs(report)
    assert sorted(table) == sorted(tuple(int(x) for x in k.split(",")) for k in s["step_times_ms"])
    assert sorted(rounds) == [(b, a) for b in (1, 2) for a in (0.5, 0.9)]
    for (b, a), ks in rounds.items():
        plain = next(r["plain_tok_s"] for r in runs if (r["batch"], r["acceptance"]) == (b, a))
        assert ks[1] == pytest.approx(1000 * b / plain) and all(ms > 0 for ms in ks.values())
        assert 3 in ks  # the greedy chains of 2, every one of them ran both rows (continuous batching keeps them full)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert replay_auto.main([str(path), "--tokens", "8"]) == 0
    replayed = capsys.readouterr().out.splitlines()
    assert replayed[0].startswith("B ") and len(replayed) == 5
    b = report["beam"]
    assert b["beams"] == 2 and len(b["rounds"]) == 3
    assert b["ratio"] == pytest.approx(b["beam_step_ms"] / b["batched_step_ms"], rel=1e-2)
    text = format_speculative(report)
    assert "auto >= 0.98x plain at every B (full-batch figure" in text
    header = next(line for line in text.splitlines() if "full-batch" in line and "α meas" in line)
    assert header.split()[:8] == ["B", "α", "req", "mode", "plain", "spec", "speedup", "full-batch"]
    assert "agree" in header and "cannot reach it" not in text
    runs[0]["acceptance_capped"] = True  # as on the GPU box when α is asked above the target's agreement
    assert "cannot reach it" in format_speculative(report)
    assert "beam / batched" in format_beam(report)


@pytest.fixture(scope="module")
def plain_run(tiny_bench):
    from moedesk.bench.synthetic import random_prompt
    from moedesk.bench.speculative import plain_decode

    prompts = [random_prompt(16, tiny_bench.cfg.vocab_size, 50 + i) for i in range(8)]
    return prompts, plain_decode(tiny_bench, prompts, 48 + 3, 120)[0]


@pytest.mark.parametrize("draft", ["reference", "redrafted", "half left"])
@pytest.mark.parametrize("alpha", [0.6, 0.85])
def test_oracle_acceptance_is_the_requested_rate(tiny_bench, plain_run, alpha, draft):
    """The oracle drafts from the plain run's tokens while a sequence follows them, and redrafts from the actual
    prefix once it does not (here forced: no reference at all, or half the references wrong from token 5 on)."""
    from moedesk.bench.speculative import speculative_decode
    from moedesk.engine.speculative.verification import Speculator

    prompts, reference = plain_run
    references = {"reference": reference, "redrafted": None,
                  "half left": [r if i % 2 else r[:5] + [(t + 1) % 512 for t in r[5:]] for i, r in enumerate(reference)]}
    spec = Speculator(tiny_bench.model, "cpu", tiny_bench.dtype, 120, tiny_bench.cfg.eos_token_ids)
    run = speculative_decode(tiny_bench, spec, prompts, 48, alpha, 3, seed=3, references=references[draft])
    assert run["tokens"] == [r[:48] for r in reference]
    assert run["redrafted"] == {"reference": 0, "redrafted": 8, "half left": 4}[draft]
    assert (run["oracle_s"] > 0) == (draft != "reference")
    tested = round(8 * 47 / run["tokens_per_step"])  # about one test per verify step
    assert abs(run["acceptance"] - alpha) <= 4 * math.sqrt(alpha * (1 - alpha) / tested)
    # tokens per verify step as the model expects at that acceptance, within the same kind of tolerance
    assert run["tokens_per_step"] == pytest.approx(perf_model.tokens_per_step(alpha, 3), rel=0.15)


def test_full_batch_throughput_takes_only_the_rounds_that_ran_every_row():
    from moedesk.bench.speculative import full_batch_throughput, judged_speedup
    from moedesk.engine.speculative.verification import Round

    rounds = [Round(4, 4, 0.5, 100.0, 2.0, 12), Round(4, 4, 0.5, 110.0, 3.0, 10),
              Round(4, 3, 0.5, 95.0, 2.0, 5),  # a row finished: the rest run at nearly full cost
              Round(4, 1, 0.5, 90.0, 1.0, 2), Round(0, 1, 0.0, 40.0, 1.0, 1)]
    tok_s, n = full_batch_throughput(rounds, 4)
    assert n == 2 and tok_s == pytest.approx(1000 * 22 / 215.0)  # draft milliseconds left out, as the whole run's
    whole = 1000 * sum(r.emitted for r in rounds) / sum(r.verify_ms + r.accept_ms for r in rounds)
    assert whole < tok_s
    assert full_batch_throughput(rounds, 8) == (None, 0)  # no round ran 8 rows
    assert full_batch_throughput(rounds[3:], 1) == (pytest.approx(1000 * 3 / 132.0), 2)
    assert full_batch_throughput([], 2) == (None, 0)
    # auto is judged on the full-batch figure, on the whole run's where no round ran the full batch
    assert judged_speedup({"speedup": 0.9, "full_batch_speedup": 1.1}) == 1.1
    assert judged_speedup({"speedup": 0.9, "full_batch_speedup": None}) == 0.9


V = 1000  # the simulated target's vocabulary


def _belief(prefix):
    """The oracle's greedy continuation of `prefix` in the simulation (deterministic, no model)."""
    return hash((1,) + tuple(prefix)) % V


def _target(prefix, agree):
    """The simulated target's greedy token after `prefix`: the oracle's belief with probability `agree`, another
    token otherwise (fixed per prefix), as a bf16 verify forward takes the other side of a near tie."""
    rng = random.Random(hash((2,) + tuple(prefix)))
    t = _belief(prefix)
    return t if rng.random() < agree else (t + 1 + rng.randrange(V - 1)) % V


def _simulate(oracle_class, alpha, agree, rows=8, new=300, gamma=4, seed=5):
    """A LookaheadOracle (its drafting from `_belief` in place of the model's forwards) driven as the Speculator
    drives it, against `_target`: greedy chains of `gamma`, each row to `new` tokens. (measured acceptance, q)."""
    from moedesk.engine.requests import SamplingParams

    prompts = [[7 + r, 11 * r] for r in range(rows)]
    model = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=V))
    oracle = oracle_class(model, None, prompts, alpha, 0, None, "cpu", seed=seed)

    def lookahead(off, depth):
        out = []
        for r in off:
            seq = list(oracle.sequences[r])
            for _ in range(depth):
                seq.append(_belief(seq))
            out.append(seq[-depth:])
        return out

    oracle._lookahead = lookahead
    seqs = [p + [_target(p, agree)] for p in prompts]  # the prefill's token
    tokens = [s[-1:] for s in seqs]
    accepted = [0] * rows
    params = SamplingParams(max_new_tokens=new, temperature=0)
    active = list(range(rows))
    while active:
        proposal = oracle.propose(active, [len(seqs[r]) - 1 for r in active], [seqs[r][-1] for r in active], gamma, 1,
                                  gamma, [params] * len(active), [None] * len(active), [len(tokens[r]) for r in active])
        for i, r in enumerate(active):
            drafts = proposal.tokens[i, 1:].tolist()
            n = 0
            while n < len(drafts) and drafts[n] == _target(seqs[r] + drafts[:n], agree):
                n += 1
            emitted = (drafts[:n] + [_target(seqs[r] + drafts[:n], agree)])[:new - len(tokens[r])]
            accepted[r] += n
            seqs[r] += emitted
            tokens[r] += emitted
        active = [r for r in active if len(tokens[r]) < new]
    done = [types.SimpleNamespace(stats={"speculative": {"accepted": a}}) for a in accepted]
    acc, tested = oracle.finish(done)
    assert oracle.finish(done) == (acc, tested)  # the last rounds are scored once
    return acc / tested, oracle.agreement


def test_oracle_reaches_the_requested_acceptance_where_the_target_rejects_uncorrupted_drafts():
    """The target rejects 20% of the uncorrupted drafts (as bf16 verify forwards did on the GPU box): corrupting
    at 1 - α would measure about 0.8 α; corrupting at 1 - α / q measures α."""
    from moedesk.bench.speculative import LookaheadOracle

    class Fixed(LookaheadOracle):  # the corruption before q: 1 - α, whatever the target does
        corruption = property(lambda self: 1.0 - self.acceptance)

    fixed, q_fixed = _simulate(Fixed, 0.6, 0.8)
    assert fixed == pytest.approx(0.48, abs=0.03) and q_fixed == pytest.approx(0.8, abs=0.03)
    # ~3000 drafts tested: the binomial sd of the measured acceptance is ~0.01; the prior's pull in the first
    # rounds is smaller still
    measured, q = _simulate(LookaheadOracle, 0.6, 0.8)
    assert measured == pytest.approx(0.6, abs=0.03) and q == pytest.approx(0.8, abs=0.03)
    assert abs(measured - 0.6) < abs(fixed - 0.6) / 3
    assert _simulate(LookaheadOracle, 0.6, 0.8) == (measured, q)  # deterministic given the seed
    # asked more than the target's agreement: nothing is corrupted, and the measured acceptance is q itself
    capped, q = _simulate(LookaheadOracle, 0.9, 0.8)
    assert capped == pytest.approx(q, abs=0.01) and q == pytest.approx(0.8, abs=0.03)  # (the prior: c > 0 at first)
    # a target that always agrees: q stays 1 and the corruption is 1 - α, as it always was
    same, q = _simulate(LookaheadOracle, 0.6, 1.0)
    assert q == 1.0 and same == _simulate(Fixed, 0.6, 1.0)[0]


def _random_tables(rng, batches=(1, 4, 16, 32), max_k=5):
    """T(B, k) tables of every kind: verification nearly free, costing a full step per token, and between."""
    for _ in range(300):
        table = {}
        for b in batches:
            base = float(rng.uniform(5, 200))
            growth = float(rng.choice([rng.uniform(0, 0.1), rng.uniform(0.1, 1.2), rng.uniform(1.0, 1.5)]))
            for k in range(1, max_k + 1):
                table[b, k] = base * (1 + growth * (k - 1)) * float(rng.uniform(0.98, 1.02))
        yield table


def test_auto_never_speculates_where_the_measured_steps_say_it_loses():
    from moedesk.bench.speculative import OracleCosts

    rng = np.random.default_rng(0)
    spoke = plain = 0
    for table in _random_tables(rng):
        costs = OracleCosts(table)
        for b in (1, 4, 16, 32):
            if auto.auto_decodes_plainly(costs, b, 4):
                plain += 1
                # not even a 0.9 draft (or the 5/6 a first probe assumes) would gain: every γ loses (or gains under
                # the margin) by the table; or no probe's loss fits the exploration budget of a run
                def never_gains(alpha):
                    return all(perf_model.tokens_per_step(alpha, g) * table[b, 1] / table[b, g + 1]
                               < 1 + perf_model.SAFETY_MARGIN for g in range(1, 5))
                cheapest_probe = min(table[b, g + 1] for g in range(1, 5)) - table[b, 1]
                assert never_gains(0.9) or never_gains(5 / 6) or (
                    cheapest_probe > auto.EXPLORE_SHARE * auto.EXPLORE_HORIZON * table[b, 1])
            for alpha in (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95):
                gamma = auto.auto_gamma(costs, b, alpha, 4, evidence=10**6)
                if gamma:
                    spoke += 1
                    gain = perf_model.tokens_per_step(alpha, gamma) * table[b, 1] / table[b, gamma + 1]
                    assert gain >= 1 + auto.AUTO_MARGIN, (table, b, alpha, gamma)
    assert spoke and plain  # both kinds of decision were exercised


def test_auto_with_verification_costing_a_step_per_token_decodes_plainly():
    from moedesk.bench.speculative import OracleCosts

    table = {(b, k): 10.0 * b * k for b in (1, 4) for k in range(1, 6)}
    costs = OracleCosts(table)
    assert auto.auto_decodes_plainly(costs, 1, 4) and auto.auto_decodes_plainly(costs, 4, 4)
    assert all(auto.auto_gamma(costs, 4, a, 4) == 0 for a in (0.5, 0.9, 0.99))
    flat = OracleCosts({(b, k): 10.0 for b in (1, 4) for k in range(1, 6)})
    assert not auto.auto_decodes_plainly(flat, 4, 4) and auto.auto_gamma(flat, 4, 0.8, 4) == 4
    costs.observe_draft(1000.0, 1)  # the oracle's own forwards never count as drafting
    assert costs.draft_ms(1) == 0.0


def test_fit_error_comes_from_the_fitted_models_residuals():
    from moedesk.bench.speculative import fit_residuals, fit_step_table

    truth = perf_model.SpeedupModel(experts=8, top_k=2, ridge=64.0, bias=2.0, k1=1.0, k2=5.0, k3=0.5, lam=0.5, s=1.05)
    table = {(b, k): float(perf_model.target_time(truth, b * k)) for b in (1, 4, 16, 32) for k in range(1, 6)}
    fit = fit_step_table(table, 8, 2, ridges=(32.0, 64.0))
    assert fit["rms_relative_error"] < 0.02
    recomputed = fit_residuals(fit["model"], table)
    assert fit["residuals"] == recomputed
    assert fit["rms_relative_error"] == pytest.approx(math.sqrt(np.mean(np.square(list(recomputed.values())))))
    assert fit["max_relative_error"] == pytest.approx(max(abs(r) for r in recomputed.values()))
    # one measurement 40% off: no such model passes through it, and the error shows it
    bad = dict(table)
    bad[16, 3] *= 1.4
    off = fit_step_table(bad, 8, 2, ridges=(32.0, 64.0))
    assert off["max_relative_error"] > 0.05 and off["rms_relative_error"] > fit["rms_relative_error"]
    assert fit_step_table({(1, 1): 1.0, (1, 2): 2.0}, 8, 2) is None  # too few points to fit 6 parameters


def test_load_prompts_reads_mt_bench_humaneval_and_plain_forms(tmp_path, tiny_checkpoint):
    from moedesk.bench.speculative import load_prompts
    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.runtime import Engine

    engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cpu", dtype="float32")
    tok = engine.tokenizer
    lines = [{"question_id": 81, "turns": ["Write a poem.", "Now shorter."]}, {"task_id": "x", "prompt": "def f():"},
             "plain text", {"prompt_ids": [5, 6, 7]}, {"messages": [{"role": "user", "content": "hi"}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = load_prompts(path, tok)
    assert got == [tok.chat_prompt([{"role": "user", "content": "Write a poem."}]), tok.encode("def f():"),
                   tok.encode("plain text"), [5, 6, 7], tok.chat_prompt([{"role": "user", "content": "hi"}])]
    (tmp_path / "p.json").write_text(json.dumps(lines))
    assert load_prompts(tmp_path / "p.json", tok, limit=2) == got[:2]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"nothing": 1}) + "\n")
    with pytest.raises(MoedeskError, match="item 1"):
        load_prompts(tmp_path / "bad.jsonl", tok)


def test_bench_with_a_model_and_its_draft_head(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from moedesk.app.cli import main
    from moedesk.engine.runtime import Engine
    from tests.speculative.test_speculative_decode import random_head

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = str(tiny_checkpoint("mixtral"))
    random_head(Engine.load(ckpt, device="cpu", dtype="float32"), 1, tmp_path / "head")
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("Hello there.", "Name a colour.", "Why?")))
    assert main(["bench", "--model", ckpt, "--draft", str(tmp_path / "head"), "--prompts", str(prompts),
                 "--device", "cpu", "--batches", "1,2", "--decode-tokens", "6", "--draft-length", "2",
                 "--draft-width", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    chain, tree = report["acceptance"]
    assert chain["mode"] == "greedy" and tree["mode"] == "beam" and tree["verified_nodes"] == 2
    for a in (chain, tree):
        assert a["prompts"] == 3 and 1.0 <= a["tokens_per_step"] <= 3.0
        assert a["tokens_per_step"] == pytest.approx((a["accepted"] + a["verify_steps"]) / a["verify_steps"], abs=1e-3)
    assert [r["batch"] for r in report["throughput"]] == [1, 2]
    for r in report["throughput"]:
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and r["same_as_plain"] == 1.0
    assert main(["bench", "--model", ckpt, "--prompts", str(prompts)]) == 2
    assert "with --draft unless the model is the demo" in capsys.readouterr().err


def test_bench_reports_how_one_token_shares_experts_with_the_gpu(tiny_bench):
    """The header names the profile's decision (engine.offload.assignment.lone_token_split): what to compare decode
    figures by when a split was or was not taken."""
    from dataclasses import replace

    costs, policy = tiny_bench.orchestra.costs, tiny_bench.policy
    assert tiny_bench.header()["lone_token_split"] == {"gpu_experts": 0, "gpu_width": 0}  # simulated: none measured
    k = tiny_bench.orchestra.top_k
    try:
        tiny_bench.orchestra.costs = replace(costs, zero_copy_split_ms=(1.8, 2.5), zero_copy_top_k=k,
                                             split_width_ms=((32, 1.5),))
        assert tiny_bench.header()["lone_token_split"] == {"gpu_experts": 0, "gpu_width": 32}
        tiny_bench.policy = "fiddler"  # never splits
        assert tiny_bench.header()["lone_token_split"] == {"gpu_experts": 0, "gpu_width": 0}
    finally:
        tiny_bench.orchestra.costs, tiny_bench.policy = costs, policy
