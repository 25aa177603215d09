"""What training computes for a draft chain is what drafting computes (training.train against
engine.speculative.eagle_drafter's EagleDrafter), for an EAGLE-1 head and an EAGLE-3 head with a reduced draft vocabulary.

A chain drafted from a prefix ending at the token x at position L (the head's root row is L - 1, the target's
feature there with x) is depth 0's prediction of the token at L + 1, then depth k's of L + k + 1 from the head's own
depth k - 1 output and draft. Training's pass k at row L - 1 + k predicts the same token from the same inputs when
the sequence it is fed is the prefix followed by the drafts: so on a random head (whose drafts are its own guesses,
never the target's) the head's outputs, its logits and its drafts must agree at every depth, in every round of a
real speculative run (the root absorbed from the prefill, then from each verify forward). Training's features are
the ones it computes (train._head_features: for eagle3 the three layer inputs in bfloat16, checked here against the
float32 ones drafting uses, which the comparison then takes so the agreement is not left to bfloat16's rounding).
"""
import copy

import pytest
import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.speculative import eagle_drafter
from moedesk.training import train as T

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEPTH = 4
UNROLLED, BATCH_LOSSES = T.unrolled_forward, T.batch_losses  # spied on below, never wrapping a spy
DRAFT_VOCAB = 96  # of the tiny model's 384 tokens


def random_head(engine, kind: str, seed: int = 11):
    """A head with weights large enough that every input matters (the training init's 0.02 leaves the attention
    nearly silent, hiding a wrong mask or position), norms away from 1 (so which norm is applied shows)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    if kind == "eagle3":
        cfg = T.head_config(engine, "eagle3", draft_vocab=DRAFT_VOCAB)
        ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
        head = T._init_eagle3(engine, cfg, "random", seed, ids)
    else:
        cfg = T.head_config(engine, "eagle1")
        head = T._seeded_head(cfg, seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name == "lm_head.weight":
                continue  # the target's rows for the draft vocabulary (frozen in training)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    head.embed = engine.model.embed.weight.detach().float()
    head.target_lm_head = engine.model.lm_head.weight.detach().float()
    return head.float().eval().requires_grad_(False)


class RecordingDrafter(eagle_drafter.EagleDrafter):
    """The chain drafter as decoding runs it, keeping for every row and round its prefix length, drafts and the
    head's output at every depth (what the draft distribution is taken from). references {row: the target's own
    continuation}: a row's first `forced` drafts are taken from it instead of the head's argmax, so they are
    accepted and the next root comes from a verify forward's accepted nodes, several rows at once."""

    def __init__(self, head, layers, batch, capacity, references, forced):
        super().__init__(head, layers, batch, capacity)
        self.references, self.forced = references, forced
        self.rounds, self._hidden = [], []

    def _draft_dist(self, hidden, sampled_rows):
        self._hidden.append(hidden.clone())
        return super()._draft_dist(hidden, sampled_rows)

    def _pick(self, logp, k, sampled, generators):
        ids, values = super()._pick(logp, k, sampled, generators)
        depth = len(self._hidden) - 1
        for i, row in enumerate(self._rows):
            at = self._emitted[i] + depth
            if depth < self.forced.get(row, 0) and at < len(self.references[row]):
                ids[i, 0, 0] = self.references[row][at]
        return ids, values

    def propose(self, rows, lengths, last, depth, width, budget, params, generators, emitted):
        self._hidden, self._rows, self._emitted = [], rows, emitted
        proposal = super().propose(rows, lengths, last, depth, width, budget, params, generators, emitted)
        for i, row in enumerate(rows if depth else ()):
            self.rounds.append(dict(row=row, length=lengths[i], last=last[i], emitted=emitted[i],
                                    drafts=proposal.tokens[i, 1:].tolist(),
                                    hidden=torch.stack([h[i] for h in self._hidden])))
        return proposal


def drafted_rounds(engine, head, prompts, forced):
    """Greedy chains of DEPTH drafts for `prompts` verified together; (every row's rounds, the target features the
    drafter asks for, each prompt's plain greedy continuation)."""
    params = SamplingParams(max_new_tokens=12, temperature=0)
    requests = [Request(p, params, tag=i) for i, p in enumerate(prompts)]
    plain = [next(iter(engine.generate([r], batch_size=1))).token_ids for r in requests]
    made = []

    def factory(batch, capacity):
        made.append(RecordingDrafter(head, engine.config.num_layers, batch, capacity, dict(enumerate(plain)), forced))
        return made[-1]

    out = engine.speculate(requests, factory, mode="greedy", draft_length=DEPTH)
    assert [c.token_ids for c in out] == plain
    return made[0].rounds, made[0].feature_keys, plain


def trained_outputs(engine, head, seq, prompt_len, feature_keys, monkeypatch):
    """The head's outputs of every pass over `seq` and the LM-head rows its token loss scores them against, as
    T.train computes them (one step at learning rate 0: train's choice of rows, batch_losses' shift of tokens
    against features, unrolled_forward), fed training's features."""
    kind = "eagle3" if head.cfg.version == 3 else "eagle1"
    features, final = T._head_features(engine, [seq], 1, None, kind)
    exact = T._features(engine, [seq], 1, None, feature_keys)  # what drafting asked the target for
    if kind == "eagle3":  # the layers training keeps are drafting's, rounded to bfloat16
        torch.testing.assert_close(features.float(), exact, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(features, exact, rtol=1e-5, atol=1e-5)
    data = T.DraftData(tokens=torch.tensor(seq), offsets=torch.tensor([0, len(seq)]),
                       answer_start=torch.tensor([prompt_len]), loss_end=torch.tensor([len(seq) - 1]),
                       features=exact, final=final)
    seen = {}

    def spy_unrolled(*args, **kw):
        outs = UNROLLED(*args, **kw)
        seen["outs"] = [o[0].detach() for o in outs]
        return outs

    def spy_losses(head, lm_head, *args, **kw):
        seen["lm"] = lm_head.detach().float()
        return BATCH_LOSSES(head, lm_head, *args, **kw)

    monkeypatch.setattr(T, "unrolled_forward", spy_unrolled)
    monkeypatch.setattr(T, "batch_losses", spy_losses)
    # vocab "full" for eagle1: its default scores only the data's tokens, where drafting takes the argmax of all
    settings = T.TrainSettings(steps=1, lr=0.0, min_lr=0.0, warmup=0, depths=DEPTH, head=kind, ce_dtype="float32",
                               vocab="full", draft_vocab=DRAFT_VOCAB if kind == "eagle3" else 0)
    trained = copy.deepcopy(head).requires_grad_(True)
    if kind == "eagle3":
        trained.lm_head.weight.requires_grad_(False)  # frozen, as _init_eagle3 leaves it
    T.train(trained, engine.model.lm_head.weight.detach(), data, settings, checkpoint=None)
    return seen["outs"], seen["lm"]


# two prompts of different lengths verified together: the drafter's shared cache then has holes its masks must hide
PROMPTS = ["How do experts route tokens?", "Hi"]


@pytest.mark.parametrize("forced", [{}, {0: 2}], ids=["own-drafts", "accepted-drafts"])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_training_passes_compute_the_drafted_chain(engine, kind, forced, monkeypatch):
    head = random_head(engine, kind)
    prompts = [engine.tokenizer.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    rounds, feature_keys, plain = drafted_rounds(engine, head, prompts, forced)
    assert len({r["row"] for r in rounds}) == 2 and len(rounds) >= 6
    if forced:  # every root of row 0 after its first came from the accepted nodes of a verify forward
        emitted = [r["emitted"] for r in rounds if r["row"] == 0]
        assert all(b - a > 1 for a, b in zip(emitted, emitted[1:])) and len(emitted) > 1
    for n, r in enumerate(rounds):
        prompt = prompts[r["row"]]
        prefix = prompt + plain[r["row"]][:r["emitted"]]
        last = len(prefix) - 1  # x, the last token emitted, at position L
        assert (r["length"], r["last"]) == (last, prefix[-1])
        # the tokens drafting fed the head after x (its first DEPTH - 1 drafts), as training's sequence
        seq = prefix + r["drafts"][:DEPTH - 1]
        outs, lm = trained_outputs(engine, head, seq, len(prompt), feature_keys, monkeypatch)
        if kind == "eagle3":  # training scores draft id i against the target row drafting maps it to (d2t)
            assert torch.equal(lm, head.lm_head.weight)
        for k in range(DEPTH):
            where = f"{kind}, row {r['row']}, round {n}, depth {k}"
            trained, drafted = outs[k][last - 1 + k], r["hidden"][k]
            torch.testing.assert_close(trained, drafted, rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: {m}")
            logits = head.target_vocab_logits(drafted)
            torch.testing.assert_close(head.target_vocab_logits(trained), logits, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{where}: {m}")
            # the token training's loss scores at that row (its softmax over `lm`'s rows) is drafting's argmax
            scored = (head.norm(trained) if head.cfg.version == 3 else trained) @ lm.T
            token = int(head.to_target_ids(scored.argmax()))
            assert token == int(logits.argmax()), where
            if k >= forced.get(r["row"], 0):
                assert token == r["drafts"][k], where
