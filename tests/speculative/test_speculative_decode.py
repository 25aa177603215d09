"""Speculative decoding (engine.speculative.verification) is lossless.

Temperature 0: the tokens equal plain greedy decoding's, token for token, for chains and trees, one
sequence and several of different lengths together, experts offloaded (the GPU tier simulated on the
CPU) or not, with a random-weight EAGLE-1 and EAGLE-3 head (written and read back through the checkpoint
loader; it almost never guesses right, so this checks every rejection path) and with an oracle draft
(the target's own greedy continuation corrupted at a chosen rate: acceptance under control, so accepted
chains, accepted tree branches other than the first child, and their cache compaction are checked).

Temperature > 0: 4000 sequences with their own seeds sampled in one batch; the pair of the first two
generated tokens (top_k 4, so 16 cells) against the target's exact joint distribution, by a chi-square
test whose false-alarm rate is 1e-4 per test.
"""
import dataclasses
import random

import numpy as np
import pytest
import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.speculative import auto, eagle_drafter, job, oracle_drafter, perf_model, proposal, rejection
from moedesk.engine.speculative.eagle_drafter import eagle_factory
from moedesk.engine.speculative.oracle_drafter import oracle_factory
from moedesk.engine.speculative.verification import Speculator
from moedesk.engine.speculative.eagle import EagleConfig, EagleHead, load_eagle_head, save_eagle_head

ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe", "minimax_m2"]
PROMPTS = ["The quick brown fox jumps over the lazy", "Hello, world!", "def add(a, b):"]
NEW = 20


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_head(engine, version, folder, seed=0, draft_ids=None):
    """A random EAGLE head for the engine's model, saved and loaded back as a user's would be. An EAGLE-3 head drafts
    `draft_ids` (increasing target ids), by default a random half of the vocabulary."""
    c = engine.config
    cfg = EagleConfig(version=version, hidden_size=c.hidden_size, intermediate_size=96, num_heads=4, num_kv_heads=2,
                      head_dim=16, rms_norm_eps=1e-6, vocab_size=c.vocab_size,
                      draft_vocab_size=c.vocab_size if version == 1 else
                      c.vocab_size // 2 if draft_ids is None else len(draft_ids),
                      target_hidden_size=c.hidden_size, fc_bias=version == 1)
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(cfg, embed=engine.model.embed.weight.detach().clone())
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        if version == 3:
            ids = torch.randperm(c.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values \
                if draft_ids is None else draft_ids
            head.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
            head.t2d[ids] = True
    save_eagle_head(head, folder, fmt="safetensors" if version == 3 else "bin", with_embedding=False)
    return load_eagle_head(folder, target_embed=engine.model.embed.weight.detach(),
                           target_lm_head=engine.model.lm_head.weight.detach())


def greedy(max_new=NEW, **kw):
    return SamplingParams(max_new_tokens=max_new, temperature=0, **kw)


def plain(engine, requests):
    """Plain greedy decoding, each request alone."""
    return [next(iter(engine.generate([r], batch_size=1))).token_ids for r in requests]


def speculate(engine, requests, factory, mode="greedy", length=4, width=1, budget=None):
    sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                    engine.tokenizer)
    return sp.run(requests, engine.executor, factory, mode=mode, draft_length=length, draft_width=width, budget=budget)


@pytest.mark.parametrize("offload", [False, True], ids=["in-place", "offloaded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_chain_and_tree_equal_plain_greedy(arch, offload, engines, tmp_path):
    engine = engines(arch, offload)
    requests = [Request(engine.tokenizer.encode(p), greedy(), tag=i) for i, p in enumerate(PROMPTS)]
    expected = plain(engine, requests)
    heads = {v: random_head(engine, v, tmp_path / f"eagle{v}") for v in (1, 3)}
    drafts = {"eagle1": eagle_factory(heads[1], engine.config.num_layers),
              "eagle3": eagle_factory(heads[3], engine.config.num_layers),
              "oracle": oracle_factory(expected, 0.3, engine.vocab_size, seed=1)}
    for name, factory in drafts.items():
        for mode, width, budget in (("greedy", 1, None), ("beam", 3, 7)):
            for batch in (requests[:1], requests):
                done, _ = speculate(engine, batch, factory, mode, length=4, width=width, budget=budget)
                for c, want in zip(done, expected):
                    assert c.token_ids == want, (name, mode, len(batch), c.tag)
                    assert c.finish_reason == "length" and c.text == engine.tokenizer.decode(want)
                spec = done[0].stats["speculative"]
                assert spec["verify_steps"] >= 1 and spec["drafted"] >= spec["accepted"]


def test_oracle_acceptance_sets_tokens_per_step(engines):
    engine = engines("mixtral")
    requests = [Request(engine.tokenizer.encode(PROMPTS[0]), greedy(max_new=41))]
    expected = plain(engine, requests)
    exact, _ = speculate(engine, requests, oracle_factory(expected, 0.0, engine.vocab_size), length=4)
    assert exact[0].token_ids == expected[0]
    assert exact[0].stats["speculative"]["tokens_per_step"] == 5.0  # 40 tokens after the first in 8 steps of 5
    wrong, _ = speculate(engine, requests, oracle_factory(expected, 1.0, engine.vocab_size), length=4)
    assert wrong[0].token_ids == expected[0] and wrong[0].stats["speculative"]["accepted"] == 0
    # a tree whose accepted branch is never the first child: the spine's sibling comes first
    tree, _ = speculate(engine, requests, oracle_factory(expected, 0.0, engine.vocab_size), "beam", length=4, width=3)
    assert tree[0].token_ids == expected[0] and tree[0].stats["speculative"]["tokens_per_step"] == 5.0


def test_tree_nodes_off_the_first_child_are_compacted(engines):
    """The oracle's spine child comes first; here a draft that puts it last at every depth, so every accepted
    node's key and value move (slot L + 3j to L + j): the output stays plain greedy's."""
    engine = engines("qwen3_moe")
    requests = [Request(engine.tokenizer.encode(PROMPTS[1]), greedy(max_new=25))]
    expected = plain(engine, requests)

    class Reversed(oracle_drafter.OracleDrafter):
        def propose(self, *args, **kw):
            p = super().propose(*args, **kw)
            parents, tokens = p.parents[0], p.tokens[0].tolist()
            # reverse each node's children: renumber nodes so that siblings appear in reverse order
            kids = {}
            for i, par in enumerate(parents[1:], start=1):
                kids.setdefault(par, []).append(i)
            new_parents, new_tokens, index = [-1], [tokens[0]], {0: 0}
            queue = [0]
            while queue:
                node = queue.pop(0)
                for child in reversed(kids.get(node, [])):
                    index[child] = len(new_parents)
                    new_parents.append(index[node])
                    new_tokens.append(tokens[child])
                    queue.append(child)
            return proposal.Proposal([new_parents], torch.tensor([new_tokens]), None)

    done, _ = speculate(engine, requests, lambda b, c: Reversed(expected, 0.0, engine.vocab_size), "beam", length=3,
                        width=3)
    assert done[0].token_ids == expected[0]
    assert done[0].stats["speculative"]["tokens_per_step"] == 4.0


def test_stops_where_plain_decoding_stops(engines, monkeypatch):
    """An EOS in the middle of an accepted chain ends the reply there; stop strings and max_new_tokens too."""
    engine = engines("mixtral")
    ids = engine.tokenizer.encode(PROMPTS[0])
    free = plain(engine, [Request(ids, greedy(max_new=30))])[0]
    eos = free[7]
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, eos_token_ids=(eos,)))
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset({eos}))
    monkeypatch.setattr(engine.runner, "stop_ids", frozenset({eos}))
    cases = [Request(ids, greedy(max_new=30)), Request(ids, greedy(max_new=6)),
             Request(ids, greedy(max_new=30, ignore_eos=True))]
    stop_text = engine.tokenizer.decode(free[3:5])
    cases.append(Request(ids, greedy(max_new=30, stop=(stop_text,), ignore_eos=True)))
    want = [next(iter(engine.generate([r], batch_size=1))) for r in cases]
    done, _ = speculate(engine, cases, oracle_factory([free] * len(cases), 0.0, engine.vocab_size), length=5)
    for c, w in zip(done, want):
        assert (c.token_ids, c.finish_reason, c.text) == (w.token_ids, w.finish_reason, w.text)


def _chi_square_p(counts: dict, probs: dict, n: int) -> float:
    from scipy.stats import chi2

    cells = [k for k in probs if probs[k] * n >= 5]
    rest = 1 - sum(probs[k] for k in cells)
    stat = sum((counts.get(k, 0) - n * probs[k]) ** 2 / (n * probs[k]) for k in cells)
    other = n - sum(counts.get(k, 0) for k in cells)
    dof = len(cells) - 1
    if rest * n >= 5:
        stat += (other - n * rest) ** 2 / (n * rest)
        dof += 1
    return float(chi2.sf(stat, dof))


@pytest.mark.parametrize("draft", ["oracle-chain", "eagle-chain", "eagle-tree"])
def test_sampling_keeps_the_targets_distribution(draft, engines, tmp_path):
    engine = engines("mixtral")
    ids = engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=4, ignore_eos=True)
    n = 4000
    requests = [Request(ids, dataclasses.replace(params, seed=s)) for s in range(n)]
    expected = plain(engine, [Request(ids, greedy(max_new=4))])
    if draft == "oracle-chain":
        factory, mode, width = oracle_factory(expected * n, 0.3, engine.vocab_size), "greedy", 1
    else:
        head = random_head(engine, 1, tmp_path / "eagle", seed=3)
        factory = eagle_factory(head, engine.config.num_layers)
        mode, width = ("beam", 2) if draft == "eagle-tree" else ("greedy", 1)
    done, _ = speculate(engine, requests, factory, mode, length=2, width=width)
    assert_two_tokens_follow_the_target(engine, done, ids, params, n)
    assert sum(c.stats["speculative"]["accepted"] for c in done) > 0 or draft != "oracle-chain"


def assert_two_tokens_follow_the_target(engine, done, prompt, params, n: int) -> None:
    """The `n` completions of two tokens after `prompt` are drawn from the target's exact joint distribution of
    them under `params` (a chi-square test at a false-alarm rate of 1e-4)."""
    counts: dict = {}
    for c in done:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    first = rejection.processed_probs(_logits(engine, prompt), params)
    probs = {}
    for a in first.nonzero().flatten().tolist():
        second = rejection.processed_probs(_logits(engine, prompt + [a]), params)
        for b in second.nonzero().flatten().tolist():
            probs[(a, b)] = float(first[a] * second[b])
    assert set(counts) <= set(probs)
    assert _chi_square_p(counts, probs, n) > 1e-4, (counts, probs)


def _logits(engine, ids):
    from moedesk.engine.model.cache.kv import KVCache

    cache = KVCache(engine.config, 1, len(ids) + 1, torch.float32, "cpu")
    return engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, engine.executor)[0, -1]


def _table(batch, max_k, cost):
    return {(b, k): cost(b, k) for b in range(1, batch + 1) for k in range(1, max_k + 1)}


def test_auto_chooses_plain_steps_where_drafting_does_not_pay():
    costs = auto.RunningCosts(_table(4, 5, lambda b, k: 10.0 * k))
    assert auto.auto_gamma(costs, 1, 0.95, 4, evidence=1000) == 0
    assert auto.auto_gamma(costs, 1, 0.95, 4) == 0  # not even a probe, with no evidence and the budget untouched
    flat = auto.RunningCosts(_table(4, 5, lambda b, k: 10.0))
    assert auto.auto_gamma(flat, 2, 0.8, 4, evidence=1000) == 4
    flat.observe_draft(50.0, 1)  # a draft token costing 5 plain steps: drafting no longer pays
    assert auto.auto_gamma(flat, 2, 0.3, 4, evidence=1000) == 0
    assert auto.auto_gamma(flat, 2, 0.3, 4) == 0  # nor would it at the optimistic estimate: no probe


def test_auto_decodes_plainly_where_a_run_is_too_short_to_afford_a_probe():
    ratios = [1, 1.48, 1.72, 1.90, 2.13]  # T(1, k) / T(1, 1), Qwen3 shape, every expert in RAM, on the GPU box
    costs = auto.RunningCosts({(1, k): 9.3 * r for k, r in enumerate(ratios, 1)})
    prior = auto.acceptance_estimate(0, 0)
    # 8 tokens: 4% of them is 0.32 plain steps, under the 0.48 a rejected 1-draft probe loses; auto's own rounds
    # would draft nothing, so the plain path takes the run
    assert auto.auto_gamma(costs, 1, prior, 4, horizon=8) == 0
    assert auto.auto_decodes_plainly(costs, 1, 4, horizon=8)
    # 32 tokens buy 1.28 steps: the opening probe has them to itself, so it drafts 4 (a rejected one loses 1.13)
    # and leaves the run's budget whole for another
    assert auto.auto_gamma(costs, 1, prior, 4, horizon=32) == 4
    assert auto.auto_gamma(costs, 1, prior, 4, auto.AutoLedger(drafted=1), horizon=32) == 2  # a later probe shares it
    assert not auto.auto_decodes_plainly(costs, 1, 4, horizon=32)
    assert auto.auto_gamma(costs, 1, prior, 4, horizon=160) == 4  # 6.4 steps: the longest probe at once
    assert not auto.auto_decodes_plainly(costs, 1, 4, horizon=10**6)  # the budget's horizon is capped
    steep = auto.RunningCosts({(1, k): 9.3 * k for k in range(1, 6)})  # verifying costs a step a token
    assert auto.auto_decodes_plainly(steep, 1, 4, horizon=10**6)
    # What earlier requests measured decides from the start: a good draft drafts even in a run too short to
    # probe, a bad one is not probed again even in a long run.
    assert not auto.auto_decodes_plainly(costs, 1, 4, horizon=8, counts=(32, 40))
    assert auto.auto_decodes_plainly(costs, 1, 4, horizon=10**6, counts=(2, 40))


def test_an_engine_keeps_what_auto_learnt_of_a_draft_for_its_next_requests():
    assert auto.carried_counts(30, 40) == (30, 40)
    accepted, tested = auto.carried_counts(800, 1000)
    assert tested == auto.ACCEPTANCE_MEMORY and accepted / tested == pytest.approx(0.8)


def test_auto_learns_acceptance_online_and_forgets_it_over_plain_steps():
    """Within a run the counts keep the last ACCEPTANCE_MEMORY drafts' worth: a draft that turns bad is judged by
    its recent rounds, not its average since the start; plain steps fade them until auto probes the draft again."""
    counts = (0, 0)
    for _ in range(40):  # 400 drafts at 0.9
        counts = auto.learn_acceptance(counts, 9, 10)
    assert counts[1] == auto.ACCEPTANCE_MEMORY and auto.acceptance_estimate(*counts) > 0.85
    for _ in range(6):  # 60 at 0.1: the whole-run average would still be 0.83
        counts = auto.learn_acceptance(counts, 1, 10)
    assert auto.acceptance_estimate(*counts) < 0.45
    faded = auto.learn_acceptance(counts, 0, 0, plain_steps=auto.FORGET_HALF_LIFE)
    assert faded[1] == pytest.approx(counts[1] / 2) and faded[0] / faded[1] == pytest.approx(counts[0] / counts[1])
    costs = auto.RunningCosts({(1, k): 10.0 * (1 + 0.5 * (k - 1)) for k in range(1, 6)})
    bad = (2.0, 40.0)
    assert auto.auto_gamma(costs, 1, auto.acceptance_estimate(*bad), 4, evidence=bad[1]) == 0
    steps = next(n for n in range(1, 1000) if auto.auto_gamma(
        costs, 1, auto.acceptance_estimate(*(f := auto.learn_acceptance(bad, 0, 0, n))), 4, evidence=f[1]))
    assert steps <= 5 * auto.FORGET_HALF_LIFE  # probed again within a few half-lives of plain steps, not never


def test_plain_requests_fade_a_bad_drafts_record_until_one_probes_it_again(engines, monkeypatch):
    engine = engines("qwen3_moe")
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=40), tag=i) for i, p in enumerate(PROMPTS)]
    expected = plain(engine, requests)
    monkeypatch.setattr(job, "engine_step_times", lambda *a, **k: _table(3, 5, lambda b, k: 10.0 * (1 + 0.5 * (k - 1))))
    draft = oracle_factory(expected, 0.0, engine.vocab_size)  # every draft right, though earlier ones were not
    engine.acceptance[draft] = (2, 64)
    paths = []
    for _ in range(4):
        before = engine.acceptance[draft]
        done = engine.speculate(requests, draft, mode="auto", draft_length=4)
        assert [c.token_ids for c in done] == expected
        paths.append("plain" if "plain" in done[0].stats["speculative"] else "speculative")
        if paths[-1] == "plain":
            assert engine.acceptance[draft][1] < before[1]  # faded by the request's plain steps
        else:
            break
    assert paths[0] == "plain" and paths[-1] == "speculative", paths
    assert auto.acceptance_estimate(*engine.acceptance[draft]) > 0.5  # it learnt the draft is good now


def test_engine_speculate_auto_sends_runs_too_short_to_probe_to_plain_decoding(engines, monkeypatch):
    engine = engines("qwen3_moe")
    table = _table(3, 5, lambda b, k: 10.0 * (1 + 0.5 * (k - 1)))  # drafting pays, but a probe risks 0.5 steps
    monkeypatch.setattr(job, "engine_step_times", lambda *a, **k: table)
    for new_tokens, went_plain in ((8, True), (60, False)):
        requests = [Request(engine.tokenizer.encode(p), greedy(max_new=new_tokens), tag=i)
                    for i, p in enumerate(PROMPTS)]
        expected = plain(engine, requests)
        done = engine.speculate(requests, oracle_factory(expected, 0.9, engine.vocab_size), mode="auto",
                                draft_length=4)
        assert [c.token_ids for c in done] == expected
        assert (done[0].stats["speculative"] == {"mode": "auto", "plain": True}) == went_plain, new_tokens


def test_auto_measures_step_times_for_the_rows_at_hand_only(engines, monkeypatch):
    """A lone request waits for batch 1's step times, not every size up to the job's limit; more rows joining
    later have theirs measured then."""
    engine = engines("qwen3_moe")
    asked = []

    def step_times(engine_, batch, max_gamma, **kw):
        asked.append(batch)
        return _table(batch, max_gamma + 1, lambda b, k: 10.0)

    monkeypatch.setattr(job, "engine_step_times", step_times)
    monkeypatch.setattr(job, "cached_step_times", lambda *a: None)
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=8), tag=i) for i, p in enumerate(PROMPTS)]
    expected = plain(engine, requests)
    done = engine.speculate(requests[:1], oracle_factory(expected[:1], 0.0, engine.vocab_size), mode="auto")
    assert done[0].token_ids == expected[0] and asked == [1]
    asked.clear()
    done = engine.speculate(requests, oracle_factory(expected, 0.0, engine.vocab_size), mode="auto")
    assert [c.token_ids for c in done] == expected and asked == [3]  # three rows, the job's limit here
    # measured before (as the app measures them with a progress bar): every size at once, nothing measured now
    asked.clear()
    monkeypatch.setattr(job, "cached_step_times",
                        lambda engine_, batch, gamma: _table(batch, gamma + 1, lambda b, k: 10.0))
    engine.speculate(requests[:1], oracle_factory(expected[:1], 0.0, engine.vocab_size), mode="auto")
    assert asked == []


def test_engine_speculate_auto_starts_from_what_earlier_requests_measured(engines, monkeypatch):
    engine = engines("qwen3_moe")
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=8), tag=i) for i, p in enumerate(PROMPTS)]
    expected = plain(engine, requests)
    table = _table(3, 5, lambda b, k: 10.0 * (1 + 0.5 * (k - 1)))  # 8 tokens cannot afford a probe here
    monkeypatch.setattr(job, "engine_step_times", lambda *a, **k: table)
    draft = oracle_factory(expected, 0.0, engine.vocab_size)  # never corrupted: every draft right
    first = engine.speculate(requests, draft, mode="auto", draft_length=4)
    assert first[0].stats["speculative"] == {"mode": "auto", "plain": True} and draft not in engine.acceptance
    engine.acceptance[draft] = (36, 40)  # as a longer earlier request of this draft would have left them
    done = engine.speculate(requests, draft, mode="auto", draft_length=4)
    assert [c.token_ids for c in done] == expected
    spec = done[0].stats["speculative"]
    assert "plain" not in spec and spec["accepted"] > 0
    accepted, tested = engine.acceptance[draft]  # this run's counts added to what it started from
    assert tested > 40 and accepted > 36


@pytest.mark.parametrize("cost", ["flat", "linear"])
def test_engine_speculate_auto_is_lossless_and_falls_back(cost, engines, tmp_path, monkeypatch):
    engine = engines("qwen3_moe")
    requests = [Request(engine.tokenizer.encode(p), greedy(), tag=f"t{i}") for i, p in enumerate(PROMPTS)]
    expected = plain(engine, requests)
    table = _table(3, 5, (lambda b, k: 10.0) if cost == "flat" else (lambda b, k: 10.0 * k))
    monkeypatch.setattr(job, "engine_step_times", lambda *a, **k: table)
    done = engine.speculate(requests, oracle_factory(expected, 0.2, engine.vocab_size), mode="auto", draft_length=4)
    assert [c.token_ids for c in done] == expected and [c.tag for c in done] == ["t0", "t1", "t2"]
    spec = done[0].stats["speculative"]
    if cost == "linear":
        assert spec == {"mode": "auto", "plain": True}
    else:
        assert spec["mode"] == "auto" and spec["accepted"] > 0 and max(spec["gammas"]) >= 1


def test_engine_speculate_with_a_head_folder_and_measured_step_times(engines, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    engine = engines("mixtral", offload=True)
    random_head(engine, 1, tmp_path / "head")
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=8)) for p in PROMPTS[:2]]
    expected = plain(engine, requests)
    for mode in ("greedy", "beam", "auto"):
        done = engine.speculate(requests, tmp_path / "head", mode=mode, draft_length=3, draft_width=2)
        assert [c.token_ids for c in done] == expected, mode
        assert "experts" in done[0].stats
    assert list((tmp_path / "cache").glob("speculative-steps-*.json"))  # measured once, kept


def test_moedesk_batch_speculative(tiny_checkpoint, engines, tmp_path, capsys):
    import json

    from moedesk.app.cli import main

    engine = engines("mixtral")
    random_head(engine, 1, tmp_path / "head")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    expected = plain(engine, [Request(engine.tokenizer.encode(p), greedy(max_new=12)) for p in PROMPTS])
    for mode in ("greedy", "beam"):
        out = tmp_path / f"{mode}.jsonl"
        assert main(["batch", str(src), "-o", str(out), "--model", str(tiny_checkpoint("mixtral")), "--device", "cpu",
                     "--dtype", "float32", "--temperature", "0", "--max-new-tokens", "12", "--batch-size", "2",
                     "--speculative", mode, "--draft", str(tmp_path / "head"), "--draft-length", "3",
                     "--draft-width", "2"]) == 0
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert [x["token_ids"] for x in lines] == expected
        assert lines[0]["stats"]["speculative"]["mode"] == mode
    assert main(["batch", str(src), "-o", str(tmp_path / "x.jsonl"), "--model", str(tiny_checkpoint("mixtral")),
                 "--speculative", "greedy"]) != 0
    assert "needs --draft" in capsys.readouterr().err


def test_auto_prices_rounds_at_what_they_took_not_the_table():
    # Flat table: drafting 4 at α = 0.5 looks like a ~1.9x win; rounds that verify turn out to take 2.5x the
    # table (the GPU box's B = 32 rounds took 1.3x): auto stops drafting.
    costs = auto.RunningCosts(_table(32, 5, lambda b, k: 100.0))
    assert auto.auto_gamma(costs, 32, 0.5, 4, evidence=1000) > 0
    costs.observe_round(32, 4, 250.0)
    assert costs.verify_ms(32, 4) == pytest.approx(250.0) and costs.ar_ms(32) == pytest.approx(100.0)
    # a shorter chain, not timed yet, may cost as little as a plain step: each is tried once (auto.cost_probe)
    tried = []
    while (gamma := auto.auto_gamma(costs, 32, 0.5, 4, evidence=1000)) and len(tried) < 4:
        tried.append(gamma)
        costs.observe_round(32, gamma, 250.0)
    assert gamma == 0 and len(set(tried)) == len(tried) and 4 not in tried
    # Plain rounds as slow as the verifying ones (a slower machine, not dearer drafts): the table's prices again.
    costs.observe_round(32, 0, 250.0)
    assert costs.verify_ms(32, 4) == pytest.approx(100.0) and costs.ar_ms(32) == pytest.approx(100.0)
    assert auto.auto_gamma(costs, 32, 0.5, 4, evidence=1000) > 0
    costs.observe_round(32, 4, 500.0)  # later rounds move the ratio part of the way
    assert 100.0 < costs.verify_ms(32, 4) < 200.0


def test_slow_plain_rounds_never_make_drafting_look_cheaper():
    costs = auto.RunningCosts(_table(4, 5, lambda b, k: 10.0 * k))  # drafting never pays
    for _ in range(5):
        costs.observe_round(1, 0, 50.0)  # plain rounds at 5x the table (real rounds, a made-up table)
    assert costs.ar_ms(1) == 10.0 and costs.verify_ms(1, 4) == 50.0
    assert auto.auto_gamma(costs, 1, 0.95, 4) == 0  # not even a probe


# The Qwen3-30B-A3B shape at batch 1, experts in RAM (docs/measurements.md: T(1,1)/T(1,5) = 0.51 on the GPU box's
# H200s; the T(1,2) of 1.5-2x T(1,1)), in ms: verifying even one draft costs 60% more than a plain step.
QWEN3_B1 = {1: 10.0, 2: 16.0, 3: 17.5, 4: 18.7, 5: 19.6}


def _simulate_auto(costs, batch, alpha, tokens, seed, horizon=None):
    """Auto over `tokens` new tokens per row as SpeculativeBatch.round drives it, each draft accepted with
    probability alpha (one chain for the whole batch, as the counts are per batch), times from the costs' own
    model. (auto's time / plain decoding's, rounds' γ, rounds whose γ the estimate chose, the ledger after
    every round). horizon: as SpeculativeBatch passes it, the run's length up to EXPLORE_HORIZON."""
    horizon = min(auto.EXPLORE_HORIZON, tokens) if horizon is None else horizon
    rng = random.Random(seed)
    accepted = tested = made = 0
    ms, gammas, exploits, ledgers = 0.0, [], [], []
    ledger = auto.AutoLedger()
    while made < tokens:
        estimate = auto.acceptance_estimate(accepted, tested)
        gamma = auto.auto_gamma(costs, batch, estimate, 4, ledger, tested, horizon)
        exploits.append(gamma > 0 and perf_model.choose_draft_length(costs, batch, estimate, 4).gamma > 0)
        taken = 0
        while taken < gamma and rng.random() < alpha:
            taken += 1
        ledger = ledger.book(costs, batch, gamma, 1 + taken, tested)
        accepted, tested = accepted + taken * batch, tested + (taken + (taken < gamma)) * batch
        ms += perf_model.step_ms(costs, batch, gamma)
        made += 1 + taken
        gammas.append(gamma)
        ledgers.append(ledger)
    # a row's last chain may overshoot: its tokens past `tokens` are thrown away, its time is not
    return ms / (tokens * costs.ar_ms(batch)), gammas, exploits, ledgers


def test_auto_finds_a_good_draft_in_the_first_rounds_where_verifying_is_dear():
    costs = auto.RunningCosts({(1, k): ms for k, ms in QWEN3_B1.items()})
    assert auto.auto_gamma(costs, 1, 0.5, 4, evidence=1000) == 0  # α = 0.5 known: plain
    assert auto.auto_gamma(costs, 1, 0.6, 4, evidence=1000) == 4  # the estimate drafting needs lies between
    ratio, gammas, exploits, _ = _simulate_auto(costs, 1, 0.8, 160, seed=0)
    assert gammas[0] == 4  # a probe in the very first round: the start's budget (6.4 steps) affords one
    assert exploits.index(True) <= 24
    # greedy chains of 4 would give 3.36 tokens / 1.96 steps = 1.71x; the old rule's first probe came at round 64
    assert 1 / ratio > 1.3
    # over many seeds: the estimate drafts within 6 rounds in 19 runs of 20, and on average auto gains nearly all
    # that chains do, in long runs and in short ones
    for tokens, gain in ((160, 1.65), (96, 1.6), (32, 1.45)):
        runs = [_simulate_auto(costs, 1, 0.8, tokens, seed) for seed in range(100)]
        assert sum(True in e[:6] for _, _, e, _ in runs) >= 90, tokens
        assert sum(1 / r for r, _, _, _ in runs) / len(runs) > gain, tokens


@pytest.mark.parametrize("tokens", [32, 96, 512])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5])
def test_auto_is_never_slower_than_plain_where_drafting_does_not_pay(alpha, tokens):
    costs = auto.RunningCosts({(1, k): ms for k, ms in QWEN3_B1.items()})
    for seed in range(10):
        # the horizon is the run's own length (up to EXPLORE_HORIZON): EXPLORE_SHARE at most, and one round that
        # the estimate said would pay, however short the run
        ratio, gammas, _, _ = _simulate_auto(costs, 1, alpha, tokens, seed)
        assert ratio <= 1 + auto.EXPLORE_SHARE + _worst_round(costs, 1) / tokens + 1e-9, (seed, ratio, gammas)
        # a run cut short of the horizon it was given (max_new_tokens 160, ended by EOS at `tokens`)
        ratio, gammas, _, _ = _simulate_auto(costs, 1, alpha, tokens, seed, horizon=auto.EXPLORE_HORIZON)
        assert ratio <= (1 + (auto.EXPLORE_SHARE * max(tokens, auto.EXPLORE_HORIZON) + _worst_round(costs, 1)) / tokens
                         + 1e-9)
    if alpha == 0.0:
        # three rejected drafts end the probing for good: the optimistic estimate, 5/9, is under the ~0.56 needed
        assert sum(g > 0 for g in gammas) <= 3


def _worst_round(costs, batch) -> float:
    """What one round may lose at most, in plain steps: its verify step for a single token."""
    return max(perf_model.step_ms(costs, batch, g) for g in range(1, 5)) / costs.ar_ms(batch) - 1


def test_auto_stays_within_its_budget_at_every_round_and_batch():
    # Random tables (verification nearly free, a step per token, between; drafting costing 0 to 0.2 steps), any
    # acceptance: after every round the modelled loss is within EXPLORE_SHARE of plain decoding's time so far
    # (at least EXPLORE_HORIZON steps of it) and one round: probes are held to the budget, and rounds that exploit
    # an estimate lose only where the estimate was luckier than the draft, which the next rounds correct.
    rng = np.random.default_rng(1)
    spoke = lost = 0
    for trial in range(40):
        batch = int(rng.choice([1, 2, 4, 8, 16, 32]))
        growth = float(rng.choice([rng.uniform(0, 0.1), rng.uniform(0.1, 1.2), rng.uniform(1.0, 1.5)]))
        costs = auto.RunningCosts({(batch, k): 20.0 * batch ** 0.3 * (1 + growth * (k - 1)) for k in range(1, 6)})
        costs.observe_draft(float(rng.uniform(0, 0.2)) * costs.ar_ms(batch), 1)
        alpha = float(rng.uniform(0, 1))
        ratio, gammas, _, ledgers = _simulate_auto(costs, batch, alpha, 200, trial)
        a = costs.ar_ms(batch)
        for ledger in ledgers:
            budget = auto.EXPLORE_SHARE * max(ledger.plain_ms, auto.EXPLORE_HORIZON * a)
            assert ledger.loss_ms <= budget + _worst_round(costs, batch) * a + 1e-9
        # the opening probe is not booked (its own budget, as large as a fresh run's): the whole run's loss is
        # within both budgets and one round
        opening = auto.EXPLORE_SHARE * auto.EXPLORE_HORIZON * a
        assert (ratio - 1) * 200 * a <= opening + budget + _worst_round(costs, batch) * a + 1e-9
        spoke += max(gammas) > 0
        lost += ratio > 1
    assert spoke >= 10 and lost >= 3  # drafting that paid, and probes that did not, both exercised


def test_drafting_keeps_no_autograd_graphs(engines, tmp_path):
    # A draft head's forwards recorded autograd graphs that its caches, written in place, kept alive: memory grew
    # with every round (~80 MB a second on 8 HumanEval prompts; 24 GB ran out in beam mode).
    engine = engines("qwen3_moe")
    random_head(engine, 1, tmp_path / "head")
    seen = []

    class Watching:  # the drafter the job makes, seen from inside its rounds
        def __init__(self, made):
            self.made = made

        def __getattr__(self, name):
            return getattr(self.made, name)

        def propose(self, *args, **kwargs):
            proposal = self.made.propose(*args, **kwargs)
            seen.append((torch.is_grad_enabled(), self.made.root.requires_grad, self.made.root.grad_fn))
            return proposal

    head = eagle_drafter.draft_head(engine, tmp_path / "head")
    assert not any(p.requires_grad for p in head.parameters())
    # loaded once, kept on the engine for every later request that names the folder
    assert engine.draft_heads[str(tmp_path / "head")] is head and engine.load_draft(tmp_path / "head") is head
    factory = eagle_factory(head, engine.config.num_layers)
    requests = [Request(engine.tokenizer.encode(p), greedy(max_new=8)) for p in PROMPTS[:2]]
    done = engine.speculate(requests, lambda batch, capacity: Watching(factory(batch, capacity)), mode="greedy")
    assert [c.token_ids for c in done] == plain(engine, requests)
    assert seen and all(state == (False, False, None) for state in seen)
    # Speculator.run, outside the scheduler, too; with a head whose weights still want gradients
    trainable = random_head(engine, 1, tmp_path / "head2")
    assert any(p.requires_grad for p in trainable.parameters())
    seen.clear()
    trainable_factory = eagle_factory(trainable, engine.config.num_layers)
    speculate(engine, requests, lambda batch, capacity: Watching(trainable_factory(batch, capacity)))
    assert seen and all(state == (False, False, None) for state in seen)
