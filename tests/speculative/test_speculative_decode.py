"""Speculative decoding (engine.speculative.decode) is lossless.

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

import pytest
import torch

from engine.requests import Request, SamplingParams
from engine.speculative import decode
from engine.speculative.decode import Speculator, eagle_factory, oracle_factory
from engine.speculative.eagle import EagleConfig, EagleHead, load_eagle_head, save_eagle_head

ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe"]
PROMPTS = ["The quick brown fox jumps over the lazy", "Hello, world!", "def add(a, b):"]
NEW = 20


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_head(engine, version, folder, seed=0):
    """A random EAGLE head for the engine's model, saved and loaded back as a user's would be."""
    c = engine.config
    cfg = EagleConfig(version=version, hidden_size=c.hidden_size, intermediate_size=96, num_heads=4, num_kv_heads=2,
                      head_dim=16, rms_norm_eps=1e-6, vocab_size=c.vocab_size,
                      draft_vocab_size=c.vocab_size if version == 1 else c.vocab_size // 2,
                      target_hidden_size=c.hidden_size, fc_bias=version == 1)
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(cfg, embed=engine.model.embed.weight.detach().clone())
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        if version == 3:
            ids = torch.randperm(c.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values
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

    class Reversed(decode.OracleDrafter):
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
            return decode.Proposal([new_parents], torch.tensor([new_tokens]), None)

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
    counts: dict = {}
    for c in done:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    # the exact joint distribution of the first two tokens
    first = decode.processed_probs(_logits(engine, ids), params)
    probs = {}
    for a in first.nonzero().flatten().tolist():
        second = decode.processed_probs(_logits(engine, ids + [a]), params)
        for b in second.nonzero().flatten().tolist():
            probs[(a, b)] = float(first[a] * second[b])
    assert set(counts) <= set(probs)
    assert _chi_square_p(counts, probs, n) > 1e-4, (counts, probs)
    assert sum(c.stats["speculative"]["accepted"] for c in done) > 0 or draft != "oracle-chain"


def _logits(engine, ids):
    from engine.generation.kv_cache import KVCache

    cache = KVCache(engine.config, 1, len(ids) + 1, torch.float32, "cpu")
    return engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, engine.executor)[0, -1]


def _table(batch, max_k, cost):
    return {(b, k): cost(b, k) for b in range(1, batch + 1) for k in range(1, max_k + 1)}


def test_auto_chooses_plain_steps_where_drafting_does_not_pay():
    costs = decode.RunningCosts(_table(4, 5, lambda b, k: 10.0 * k))
    assert decode.auto_gamma(costs, 1, 0.95, 4, plain_steps=0) == 0
    assert decode.auto_gamma(costs, 1, 0.95, 4, plain_steps=decode.PROBE_EVERY) == 0  # not even a probe
    flat = decode.RunningCosts(_table(4, 5, lambda b, k: 10.0))
    assert decode.auto_gamma(flat, 2, 0.8, 4, plain_steps=0) == 4
    flat.observe_draft(50.0, 1)  # a draft token costing 5 plain steps: drafting no longer pays
    assert decode.auto_gamma(flat, 2, 0.3, 4, plain_steps=0) == 0
    assert decode.auto_gamma(flat, 2, 0.3, 4, plain_steps=decode.PROBE_EVERY) in (0, 1)


@pytest.mark.parametrize("cost", ["flat", "linear"])
def test_engine_speculate_auto_is_lossless_and_falls_back(cost, engines, tmp_path, monkeypatch):
    engine = engines("qwen3_moe")
    requests = [Request(engine.tokenizer.encode(p), greedy(), tag=f"t{i}") for i, p in enumerate(PROMPTS)]
    expected = plain(engine, requests)
    table = _table(3, 5, (lambda b, k: 10.0) if cost == "flat" else (lambda b, k: 10.0 * k))
    monkeypatch.setattr(decode, "engine_step_times", lambda *a, **k: table)
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

    from app.cli import main

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
    costs = decode.RunningCosts(_table(32, 5, lambda b, k: 100.0))
    assert decode.auto_gamma(costs, 32, 0.5, 4, plain_steps=0) > 0
    costs.observe_round(32, 4, 250.0)
    assert costs.verify_ms(32, 4) == pytest.approx(250.0) and costs.ar_ms(32) == pytest.approx(100.0)
    assert decode.auto_gamma(costs, 32, 0.5, 4, plain_steps=0) == 0
    # Plain rounds as slow as the verifying ones (a slower machine, not dearer drafts): the table's prices again.
    costs.observe_round(32, 0, 250.0)
    assert costs.verify_ms(32, 4) == pytest.approx(100.0) and costs.ar_ms(32) == pytest.approx(100.0)
    assert decode.auto_gamma(costs, 32, 0.5, 4, plain_steps=0) > 0
    costs.observe_round(32, 4, 500.0)  # later rounds move the ratio part of the way
    assert 100.0 < costs.verify_ms(32, 4) < 200.0


def test_slow_plain_rounds_never_make_drafting_look_cheaper():
    costs = decode.RunningCosts(_table(4, 5, lambda b, k: 10.0 * k))  # drafting never pays
    for _ in range(5):
        costs.observe_round(1, 0, 50.0)  # plain rounds at 5x the table (real rounds, a made-up table)
    assert costs.ar_ms(1) == 10.0 and costs.verify_ms(1, 4) == 50.0
    assert decode.auto_gamma(costs, 1, 0.95, 4, plain_steps=decode.PROBE_EVERY) == 0


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

    head = decode.draft_head(engine, tmp_path / "head")
    assert not any(p.requires_grad for p in head.parameters())
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
