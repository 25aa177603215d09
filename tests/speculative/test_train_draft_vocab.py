"""`moedesk train-draft --head eagle3 --draft-vocab N`: an EAGLE-3 head over a reduced draft vocabulary.

The vocabulary is the N target tokens the answers most often ask the head to predict (ties by id, the lowest unused
ids where the answers hold fewer); d2t and t2d agree with it; the LM head is the target's rows for it; rows whose
target token lies outside it are left out of the loss, and training lowers the loss; the folder written loads, its
drafts are target ids inside the vocabulary, and speculation with it is plain greedy token for token (chains and
trees) and keeps the target's distribution when sampling (tokens the draft cannot propose come from the residual);
a resumed run keeps its checkpoint's vocabulary, whatever the data would choose now.
"""
import collections
import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from moedesk.app.cli import main
from moedesk.engine.errors import CheckpointError
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.speculative import eagle_drafter, rejection
from moedesk.training import train as T
from moedesk.engine.speculative.eagle import load_eagle_head
from tests.speculative.train_helpers import assert_speculation_is_plain_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 8  # of the ~21 distinct tokens the tiny model's answers hold: a third of the rows fall outside


def settings(**kw):
    return T.TrainSettings(**{**dict(steps=8, batch_size=3, max_new_tokens=12, lr=3e-3, warmup=2, head="eagle3",
                                     draft_vocab=N), **kw})


@pytest.fixture(scope="module")
def data(engine, prompts_file):
    return T.generate_data(engine, T.load_prompts(prompts_file), max_new_tokens=12, head="eagle3")


def reference_vocabulary(data, size, vocab_size):
    """Counted here the plain way: each answer's tokens after its first, most frequent first, ties by id."""
    counts = collections.Counter()
    for i in range(data.sequences):
        tokens = data.sequence(i)[0].tolist()
        counts.update(tokens[int(data.answer_start[i]) + 1:])
    ranked = sorted(range(vocab_size), key=lambda t: (-counts[t], t))
    return sorted(ranked[:size])


def test_vocabulary_is_the_most_frequent_predicted_tokens_ties_by_id():
    # two sequences: prompt [1, 2] answering [5, 5, 7, 3]; prompt [9] answering [7, 4, 4, 6]. The head predicts
    # each answer's tokens after its first: 5, 7, 3 and 4, 4, 6.
    tokens = torch.tensor([1, 2, 5, 5, 7, 3, 9, 7, 4, 4, 6])
    data = T.DraftData(tokens=tokens, offsets=torch.tensor([0, 6, 11]), answer_start=torch.tensor([2, 1]),
                       loss_end=torch.tensor([5, 4]), features=torch.zeros(len(tokens), 3))
    assert T.predicted_token_counts(data, 12).tolist() == [0, 0, 0, 1, 2, 1, 1, 1, 0, 0, 0, 0]
    # 4 twice, then the ties at one (3, 5, 6, 7) by id; counting the first answer tokens too would pick 4, 5, 7
    assert T.draft_vocabulary(data, 3, 12).tolist() == [3, 4, 5]
    # more than the answers hold: the lowest unused ids fill it
    assert T.draft_vocabulary(data, 7, 12).tolist() == [0, 1, 3, 4, 5, 6, 7]
    assert T.draft_vocabulary(data, 12, 12).tolist() == list(range(12))


@pytest.mark.parametrize("size", [N, 24])
def test_vocabulary_of_the_targets_answers(engine, data, size):
    vocab = engine.config.vocab_size
    got = T.draft_vocabulary(data, size, vocab)
    assert got.tolist() == reference_vocabulary(data, size, vocab)
    assert len(got) == size and bool((got[1:] > got[:-1]).all())


def test_d2t_and_t2d_agree_with_the_vocabulary(engine, data):
    ids = T.draft_vocabulary(data, N, engine.config.vocab_size)
    cfg = T.head_config(engine, "eagle3", N)
    assert cfg.draft_vocab_size == N and cfg.vocab_size == engine.config.vocab_size
    head = T.init_head(engine, cfg, "fit", 0, None, data, ids)
    assert torch.equal(torch.arange(N) + head.d2t, ids) and torch.equal(head.to_target_ids(torch.arange(N)), ids)
    assert bool(head.t2d[torch.arange(N) + head.d2t].all()) and int(head.t2d.sum()) == N
    assert torch.equal(head.lm_head.weight, engine.model.lm_head.weight[ids].float())  # the target's rows, frozen
    assert not head.lm_head.weight.requires_grad
    with pytest.raises(ValueError):
        T.init_head(engine, cfg, "fit", 0, None, data, ids.flip(0))  # draft ids follow target ids' order


def test_rows_whose_target_token_is_outside_the_vocabulary_are_not_trained(engine, data):
    ids = T.draft_vocabulary(data, N, engine.config.vocab_size)
    head = T.init_head(engine, T.head_config(engine, "eagle3", N), "fit", 0, None, data, ids)
    head.embed = engine.model.embed.weight.detach().float()
    lm = engine.model.lm_head.weight.detach()
    keep = T.target_in_draft_vocab(head, lm, data)
    # the mask, position by position: the target's argmax over its whole vocabulary is one of the N
    want = torch.zeros_like(keep)
    for i in range(data.sequences):
        a = int(data.offsets[i])
        for q in range(a + int(data.answer_start[i]), a + int(data.loss_end[i]) + 1):
            want[q] = int((data.final[q].float() @ lm.T).argmax()) in ids.tolist()
    assert torch.equal(keep, want)
    rows = sum(int(data.loss_end[i]) - int(data.answer_start[i]) + 1 for i in range(data.sequences))
    assert 0 < int(keep.sum()) < rows  # some rows in, some out: both paths taken here
    s, batch = settings(), list(range(data.sequences))
    with torch.no_grad():
        loss, figures = T.batch_losses(head, lm[ids], data, batch, s, None, "cpu", keep)
        unmasked, _ = T.batch_losses(head, lm[ids], data, batch, s, None, "cpu")
        none, nothing = T.batch_losses(head, lm[ids], data, batch, s, None, "cpu", torch.zeros_like(keep))
    assert float(loss) != float(unmasked)
    assert float(none) == 0 and nothing["agree"] == [0.0] * s.depths
    # training does the same: a vocabulary holding none of the target's argmax tokens leaves nothing to learn
    argmaxes = set((data.final.float() @ lm.T).argmax(-1).tolist())
    other = torch.tensor([t for t in range(engine.config.vocab_size) if t not in argmaxes][:N])
    head = T.init_head(engine, T.head_config(engine, "eagle3", N), "random", 0, None, data, other)
    head.embed = engine.model.embed.weight.detach().float()
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    T.train(head, lm, data, settings(steps=3), checkpoint=None)
    assert all(torch.equal(before[n], p) for n, p in head.named_parameters())


def test_training_lowers_the_loss_over_the_draft_vocabulary(engine, data):
    ids = T.draft_vocabulary(data, N, engine.config.vocab_size)
    s = settings(steps=30)
    head = T.init_head(engine, T.head_config(engine, "eagle3", N), "fit", 0, None, data, ids)
    head.embed = engine.model.embed.weight.detach().float()
    lm = engine.model.lm_head.weight.detach()
    keep = T.target_in_draft_vocab(head, lm, data)
    batch = list(range(data.sequences))

    def figures():
        with torch.no_grad():
            return T.batch_losses(head, lm[ids], data, batch, s, None, "cpu", keep)[1]

    before = figures()
    T.train(head, lm, data, s, checkpoint=None)
    after = figures()
    assert after["loss"] < before["loss"] and sum(after["agree"]) > sum(before["agree"])
    assert torch.equal(head.lm_head.weight, lm[ids].float()) and torch.equal(head.to_target_ids(torch.arange(N)), ids)


def test_head_loads_drafts_inside_its_vocabulary_and_speculation_is_plain_greedy(engine, data, prompts_file, tmp_path,
                                                                               monkeypatch):
    messages = []
    summary = T.train_draft(engine, tmp_path, prompts_file, settings(steps=12), log=messages.append)
    ids = T.draft_vocabulary(data, N, engine.config.vocab_size)
    assert 0 < summary["draft_vocab_coverage"] < 1 and any("draft vocabulary: 8 of" in m for m in messages)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (N, engine.config.hidden_size)
    head = load_eagle_head(tmp_path, target_embed=engine.model.embed.weight.detach())
    assert head.cfg.version == 3 and head.cfg.draft_vocab_size == N
    assert torch.equal(head.to_target_ids(torch.arange(N)), ids) and torch.equal(head.t2d.nonzero().flatten(), ids)
    # the drafting distribution, over the target's vocabulary: -inf wherever the draft cannot propose
    logits = head.target_vocab_logits(torch.randn(5, engine.config.hidden_size))
    assert logits.shape == (5, engine.config.vocab_size)
    assert bool(torch.isfinite(logits[:, ids]).all()) and bool(torch.isneginf(logits[:, ~head.t2d]).all())
    assert set(logits.argmax(-1).tolist()) <= set(ids.tolist())
    # every token drafted in chains and trees is a target id inside the vocabulary, and the output is greedy's
    drafted, propose = [], eagle_drafter.EagleDrafter.propose

    def recording(self, *args, **kw):
        proposal = propose(self, *args, **kw)
        drafted.extend(proposal.tokens[:, 1:].flatten().tolist())  # column 0 is the last token emitted
        return proposal

    monkeypatch.setattr(eagle_drafter.EagleDrafter, "propose", recording)
    assert_speculation_is_plain_greedy(engine, tmp_path)
    assert drafted and set(drafted) <= set(ids.tolist())


@pytest.mark.parametrize("mode,width", [("greedy", 1), ("beam", 2)], ids=["chain", "tree"])
def test_sampling_with_a_draft_vocabulary_keeps_the_targets_distribution(mode, width, engines, tmp_path):
    """The draft can propose only the target's 1st and 3rd most likely first tokens and one it excludes (top-k 4):
    its distribution is zero on the 2nd and 4th, which must still come, from the residual, as often as the target
    says."""
    from tests.speculative.test_speculative_decode import (PROMPTS, _logits, assert_two_tokens_follow_the_target,
                                                           random_head, speculate)

    engine = engines("mixtral")
    prompt = engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=4, ignore_eos=True)
    first = rejection.processed_probs(_logits(engine, prompt), params)
    ranked = first.argsort(descending=True).tolist()
    ids = torch.tensor(sorted([ranked[0], ranked[2], ranked[4]]))
    head = random_head(engine, 3, tmp_path / "head", seed=3, draft_ids=ids)
    n = 4000
    requests = [Request(prompt, dataclasses.replace(params, seed=s)) for s in range(n)]
    done, _ = speculate(engine, requests, eagle_drafter.eagle_factory(head, engine.config.num_layers), mode, length=2,
                        width=width)
    assert_two_tokens_follow_the_target(engine, done, prompt, params, n)
    firsts = collections.Counter(c.token_ids[0] for c in done)
    assert firsts[ranked[1]] > 0 and firsts[ranked[3]] > 0  # tokens the draft gave no mass
    assert sum(c.stats["speculative"]["accepted"] for c in done) > 0


def test_resume_keeps_the_checkpoints_vocabulary(engine, prompts_file, tmp_path, monkeypatch):
    whole, split = tmp_path / "whole", tmp_path / "split"
    T.train_draft(engine, whole, prompts_file, settings(), checkpoint_every=3)

    def stop_at_5(phase, done, total, figures):
        if phase == "train" and done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train_draft(engine, split, prompts_file, settings(), checkpoint_every=3, progress=stop_at_5)
    state = T.checkpoint_state(split / "training" / "checkpoint.safetensors")
    assert state["step"] == 3 and state["settings"]["draft_vocab"] == N
    first = load_file(str(whole / "model.safetensors"))
    assert torch.equal(T.checkpoint_draft_vocabulary(split / "training" / "checkpoint.safetensors"),
                       torch.arange(N) + first["d2t"])
    # were the vocabulary chosen again it would now be another: the checkpoint's is kept
    monkeypatch.setattr(T, "draft_vocabulary", lambda data, size, vocab_size: torch.arange(size))
    T.train_draft(engine, split, prompts_file, T.TrainSettings(), resume=True, checkpoint_every=3)
    for name in ("model.safetensors", "training/checkpoint.safetensors"):
        a, b = load_file(str(whole / name)), load_file(str(split / name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)


def test_cli_draft_vocab_flag(engine, prompts_file, tmp_path, capsys):
    base = ["train-draft", "--model", str(engine.name), "--prompts", str(prompts_file), "--device", "cpu"]
    out = tmp_path / "head"
    code = main(base + ["--out", str(out), "--head", "eagle3", "--draft-vocab", "8", "--steps", "1",
                        "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "draft vocabulary: 8 of" in err
    assert load_eagle_head(out, target_embed=engine.model.embed.weight.detach()).cfg.draft_vocab_size == 8
    for args, says in ((["--resume", "--draft-vocab", "9"], "draft_vocab=8"),
                       (["--draft-vocab", "8"], "--head eagle3"),
                       (["--head", "eagle3", "--draft-vocab", "0"], "must be >= 1"),
                       (["--head", "eagle3", "--draft-vocab", str(engine.config.vocab_size + 1), "--steps", "1",
                         "--max-new-tokens", "4"], "must be from 1 to")):
        code = main(base + ["--out", str(tmp_path / "other" if "--resume" not in args else out)] + args)
        err = capsys.readouterr().err.strip()
        assert code == 2 and says in err and "\n" not in err, (args, err)


def test_a_head_whose_d2t_leaves_the_vocabulary_is_refused(engine, data, tmp_path):
    ids = T.draft_vocabulary(data, N, engine.config.vocab_size)
    head = T.init_head(engine, T.head_config(engine, "eagle3", N), "fit", 0, None, data, ids)
    T.write_head(head, tmp_path, {})
    load_eagle_head(tmp_path, target_embed=engine.model.embed.weight.detach())  # as written: loads
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for bad in (engine.config.vocab_size,  # past the target's vocabulary
                int(ids[0]) - (N - 1)):  # the last draft id onto the first's target id
        t = dict(tensors, d2t=tensors["d2t"].clone())
        t["d2t"][-1] = bad
        save_file(t, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match="d2t"):
            load_eagle_head(tmp_path, target_embed=engine.model.embed.weight.detach())
