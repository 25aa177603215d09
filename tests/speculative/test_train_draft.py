"""`moedesk train-draft` (training.train) and the demo's shipped draft head.

On a tiny random Mixtral: training lowers the loss on a fixed batch; a run interrupted and resumed from its
checkpoint ends with the same weights, bit for bit, as an uninterrupted one; the folder written loads with
eagle.py, and speculative decoding with it is plain greedy token for token (chains and trees). The shipped
demo head loads and its acceptance length on a few prompts written here (not from an evaluation set) is above a
bound. Bad inputs (a missing model, an --out that cannot be written, a prompts file with a bad line, --resume
without a checkpoint, a head trained for another demo version) end in one line.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from moedesk.app.cli import main
from moedesk.engine.errors import MoedeskError
from moedesk.training import train as T
from moedesk.engine.speculative.demo_draft import check_demo_head, resolve_draft
from moedesk.engine.speculative.eagle import load_eagle_head
from tests.speculative.train_helpers import (assert_speculation_is_plain_greedy, figures_before_and_after_training,
                                             write_prompts)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    # one raw-text prompt beside the chats: train-draft reads both
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl",
                         extra=[{"prompt": "raw text, no template"}])


def settings(**kw):
    return T.TrainSettings(**{**dict(steps=8, batch_size=3, max_new_tokens=12, lr=3e-3, warmup=2), **kw})


@pytest.fixture(scope="module")
def data(engine, prompts_file):
    return T.generate_data(engine, T.load_prompts(prompts_file), max_new_tokens=12)


def test_data_is_the_targets_greedy_answers(engine, data):
    # each answer row's next token is the target's argmax there: its features predict its own tokens
    lm = engine.model.lm_head.weight.detach()
    for i in range(data.sequences):
        tokens, feats = data.sequence(i)
        start, end = int(data.answer_start[i]), int(data.loss_end[i])
        predicted = (feats[start - 1:end] @ lm.T).argmax(dim=-1)
        assert torch.equal(predicted, tokens[start:end + 1])


def test_sampled_answers_follow_the_greedy_one(engine, data, prompts_file):
    more = T.generate_data(engine, T.load_prompts(prompts_file), max_new_tokens=12, samples=2, sample_temperature=1.0)
    assert more.sequences == 2 * data.sequences
    for i in range(data.sequences):
        assert torch.equal(more.sequence(2 * i)[0], data.sequence(i)[0])  # the greedy answer comes first
    sampled = [more.sequence(2 * i + 1)[0] for i in range(data.sequences)]
    assert any(not torch.equal(a, data.sequence(i)[0]) for i, a in enumerate(sampled))
    # the same settings give the same data (seeded samples): --resume can reuse it
    again = T.generate_data(engine, T.load_prompts(prompts_file), max_new_tokens=12, samples=2, sample_temperature=1.0)
    assert torch.equal(again.tokens, more.tokens)


@pytest.mark.parametrize("init", ["random", "fit"])
def test_training_lowers_the_loss(engine, data, init):
    # the tiny random target's logits are nearly flat, so its cross-entropy barely moves: the feature loss and
    # the agreement with the target's tokens are what training must improve
    s = settings(steps=30, init=init)
    head = T.init_head(engine, T.head_config(engine), s.init, s.seed, data.sequence(0)[0].tolist(), data)
    before, after = figures_before_and_after_training(engine, head, data, s)
    assert after["loss"] < before["loss"]
    assert sum(after["feature"]) < 0.9 * sum(before["feature"])
    assert sum(after["agree"]) > sum(before["agree"])


def test_fit_init_starts_nearer_the_target_than_random(engine, data):
    # the least-squares fc predicts the next feature better than random weights before any step
    s = settings()
    lm = engine.model.lm_head.weight.detach()
    batch = list(range(data.sequences))
    losses = {}
    for init in ("fit", "random"):
        head = T.init_head(engine, T.head_config(engine), init, s.seed, data.sequence(0)[0].tolist(), data)
        head.embed = engine.model.embed.weight.detach().float()
        with torch.no_grad():
            losses[init] = sum(T.batch_losses(head, lm, data, batch, s, None, "cpu")[1]["feature"])
    assert losses["fit"] < losses["random"]


@pytest.mark.parametrize("head", T.HEADS)
def test_resume_ends_where_an_uninterrupted_run_ends(engine, prompts_file, tmp_path, head):
    whole, split = tmp_path / "whole", tmp_path / "split"
    T.train_draft(engine, whole, prompts_file, settings(head=head), checkpoint_every=3)

    def stop_at_5(phase, done, total, figures):
        if phase == "train" and done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train_draft(engine, split, prompts_file, settings(head=head), checkpoint_every=3, progress=stop_at_5)
    state = T.checkpoint_state(split / "training" / "checkpoint.safetensors")
    assert state["step"] == 3 and state["settings"]["head"] == head
    messages = []
    # resumed with the default head kind: the checkpoint's settings, its kind included, are kept
    T.train_draft(engine, split, prompts_file, settings(), resume=True, checkpoint_every=3, log=messages.append)
    assert any("reusing" in m for m in messages)  # the target's answers are not generated again
    for name in ("model.safetensors", "training/checkpoint.safetensors"):
        a, b = load_file(str(whole / name)), load_file(str(split / name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)


def test_resume_refuses_other_settings(engine, prompts_file, tmp_path):
    T.train_draft(engine, tmp_path, prompts_file, settings(steps=2))
    code = main(["train-draft", "--model", str(engine.name), "--out", str(tmp_path), "--prompts", str(prompts_file),
                 "--lr", "0.5", "--resume", "--device", "cpu"])
    assert code == 2


@pytest.mark.parametrize("width", [0, 72])
def test_head_loads_and_speculation_with_it_is_lossless(engine, prompts_file, tmp_path, width):
    summary = T.train_draft(engine, tmp_path, prompts_file, settings(steps=20, head_width=width))
    assert summary["steps"] == 20
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["moedesk"]["target"] == engine.name and "demo_recipe_version" not in cfg["moedesk"]
    head = load_eagle_head(tmp_path, target_embed=engine.model.embed.weight.detach(),
                           target_lm_head=engine.model.lm_head.weight.detach())
    assert head.cfg.version == 1 and head.cfg.hidden_size == engine.config.hidden_size
    default = T.head_config(engine).intermediate_size
    assert default != 72 and head.cfg.intermediate_size == (width or default)
    assert_speculation_is_plain_greedy(engine, tmp_path)


def test_a_head_for_another_demo_version_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"moedesk": {"demo_recipe_version": -1}}))
    with pytest.raises(MoedeskError, match="trained for demo model version -1") as e:
        check_demo_head(folder)
    assert "\n" not in str(e.value)

    class Demo:
        name = "demo"

    with pytest.raises(MoedeskError):
        resolve_draft(Demo(), folder)
    # With no head in assets, the demo's default draft is refused in one line rather than failing later.
    import moedesk.engine.speculative.demo_draft as demo_draft

    monkeypatch.setattr(demo_draft, "demo_head_folder", lambda: tmp_path / "absent")
    with pytest.raises(MoedeskError, match="draft head is missing") as e:
        resolve_draft(Demo(), None)
    assert "\n" not in str(e.value)


def one_line_error(capsys, argv) -> str:
    capsys.readouterr()  # what came before (a fixture building the tiny checkpoint writes a progress bar)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moedesk: ") and "\n" not in err, err
    return err


def test_bad_inputs_end_in_one_line(capsys, tmp_path, prompts_file, tiny_checkpoint):
    model = str(tiny_checkpoint("mixtral"))
    err = one_line_error(capsys, ["train-draft", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "nope" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = one_line_error(capsys, ["train-draft", "--model", model, "--out", str(blocker / "sub")])
    assert err.endswith(f"{blocker / 'sub'}: cannot write the draft head there (a part of its path is a file, not a folder)")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(prompts_file.read_text().splitlines()[0] + "\n{not json\n")
    err = one_line_error(capsys, ["train-draft", "--model", model, "--out", str(tmp_path / "o"), "--prompts", str(bad)])
    assert f"{bad}:2:" in err
    bad.write_text('{"messages": "hi"}\n')
    err = one_line_error(capsys, ["train-draft", "--model", model, "--out", str(tmp_path / "o"), "--prompts", str(bad)])
    assert f"{bad}:1:" in err
    err = one_line_error(capsys, ["train-draft", "--model", model, "--out", str(tmp_path / "fresh"), "--resume"])
    assert "no checkpoint" in err
    err = one_line_error(capsys, ["train-draft", "--model", model, "--out", str(tmp_path / "o"), "--steps", "0"])
    assert "--steps" in err
    err = one_line_error(capsys, ["train-draft", "--model", model, "--out", str(tmp_path / "o"),
                                  "--self-prompts", "-1"])
    assert "--self-prompts -1" in err
    err = one_line_error(capsys, ["train-draft", "--model", model, "--out", str(tmp_path / "o"), "--holdout", "1"])
    assert "--holdout 1.0" in err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("head", T.HEADS)
def test_training_moves_every_trainable_weight(head, device, engine, tiny_checkpoint, prompts_file, tmp_path,
                                               monkeypatch):
    """Each weight the head trains gets a gradient, on the GPU too: there the fused kernels (no backward) once cut
    the gradient through the head's norms, leaving them untrained (EAGLE-1) or the loss without one (EAGLE-3)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU")
        from moedesk.engine.runtime import Engine

        engine = Engine.load(str(tiny_checkpoint("mixtral")), device="cuda", dtype="float32", offload=False)
    moved, train = {}, T.train

    def train_and_compare(h, *args, **kwargs):
        before = {n: p.detach().clone() for n, p in h.named_parameters() if p.requires_grad}
        figures = train(h, *args, **kwargs)
        moved.update((n, not torch.equal(before[n], p.detach())) for n, p in h.named_parameters() if n in before)
        return figures

    monkeypatch.setattr(T, "train", train_and_compare)
    T.train_draft(engine, tmp_path / head, prompts_file, settings(head=head, steps=4))
    assert moved and [n for n, m in moved.items() if not m] == []


def test_held_out_prompts_are_chosen_by_their_own_digest():
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(200)]
    held = T.held_out_sequences(prompts, 3, 0.25)
    assert held and len(held) % 3 == 0 and 0.1 < len(held) / 600 < 0.4
    assert all(held[j] // 3 == held[j - j % 3] // 3 and held[j] % 3 == j % 3 for j in range(len(held)))
    chosen = {prompts[i // 3][0]["content"] for i in held}
    # another order and more prompts: the same ones held out, and some of the new ones
    grown = prompts[::-1] + [[{"role": "user", "content": f"more {i}"}] for i in range(100)]
    again = {grown[i][0]["content"] for i in T.held_out_sequences(grown, 1, 0.25)}
    assert chosen == {t for t in again if t.startswith("question")} and again - chosen
    assert T.held_out_sequences(prompts, 3, 0) == []


def test_held_out_answers_are_never_trained_on_and_the_head_is_measured_on_them(engine, prompts_file, tmp_path,
                                                                                monkeypatch):
    trained = set()
    real = T.batch_losses

    def recording(head, lm, data, batch, *args, **kw):
        if torch.is_grad_enabled():
            trained.update(batch)
        return real(head, lm, data, batch, *args, **kw)

    monkeypatch.setattr(T, "batch_losses", recording)
    s = settings(steps=6, samples=2, holdout=0.4)
    held = T.held_out_sequences(T.load_prompts(prompts_file), 2, 0.4)
    assert held and len(held) < 2 * len(T.load_prompts(prompts_file))  # this file holds some out, not all
    summary = T.train_draft(engine, tmp_path, prompts_file, s)
    assert trained and not trained & set(held) and summary["held_out"] == len(held)
    agree = summary["figures"]["held_out_agree"]
    assert len(agree) == s.depths and all(0 <= a <= 1 for a in agree)
    meta = json.loads((tmp_path / "config.json").read_text())["moedesk"]
    assert meta["held_out_prompts"] == len(held) // 2 and len(meta["held_out_agree"]) == s.depths
    # beside it, as many trained sequences, measured the same way
    own = summary["figures"]["train_agree"]
    assert len(own) == s.depths and meta["train_agree"] == [round(a, 4) for a in own]


def test_the_command_reports_both_agreements(engine, prompts_file, tmp_path, capsys):
    code = main(["train-draft", "--model", str(engine.name), "--out", str(tmp_path), "--prompts", str(prompts_file),
                 "--steps", "3", "--samples", "2", "--holdout", "0.4", "--device", "cpu", "--max-new-tokens", "8"])
    assert code == 0
    meta = json.loads((tmp_path / "config.json").read_text())["moedesk"]
    line = next(x for x in capsys.readouterr().err.splitlines() if "held-out prompts" in x)
    held, own = ("/".join(f"{a:.2f}" for a in meta[k]) for k in ("held_out_agree", "train_agree"))
    assert f"{meta['held_out_prompts']} held-out prompts {held}, to as many training prompts {own}" in line
    advice = T.holdout_advice(meta["train_agree"], meta["held_out_agree"])
    assert line.endswith(advice) if advice else line.endswith(own)


def test_the_trained_sample_is_spread_over_the_trained_sequences():
    trained = [i for i in range(40) if i % 5]  # 32 trained, 8 held out
    sample = T.comparison_sample(trained, 8)
    assert sample == [trained[4 * i] for i in range(8)] and set(sample) <= set(trained)
    assert T.comparison_sample(trained, 50) == trained


def test_holdout_advice_tells_under_training_from_memorising():
    assert "more steps" in T.holdout_advice([0.63, 0.60, 0.59, 0.57], [0.64, 0.61, 0.59, 0.58])  # the demo at 5 epochs
    assert "more prompts" in T.holdout_advice([0.80, 0.78, 0.77, 0.76], [0.67, 0.64, 0.62, 0.62])
    assert T.holdout_advice([0.70, 0.67, 0.66, 0.65], [0.67, 0.64, 0.63, 0.62]) == ""  # 0.03 behind: nothing to say
