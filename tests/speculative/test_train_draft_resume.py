"""`moedesk train-draft`'s answers saved as they complete (training.train.AnswerLog).

A generation interrupted after some answers and resumed gives the same data, token for token and feature for
feature, as an uninterrupted run, and the same head bit for bit; a partial last line of the answers file (a kill
mid-write) is dropped and that answer made again; answers made for other settings are not reused. That rests on
each request's answer not depending on which others share its batch: checked for the sampler alone and through
the engine.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from moedesk.app.cli import main
from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.sampling import sample_tokens
from moedesk.engine.requests import Request, SamplingParams
from moedesk.training import train as T
from tests.speculative.train_helpers import PROMPTS, write_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def settings(**kw):
    return T.TrainSettings(**{**dict(steps=4, batch_size=3, max_new_tokens=10, lr=3e-3, warmup=2, samples=3,
                                     sample_temperature=1.0), **kw})


def test_sampling_a_row_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95, seed=1),
              SamplingParams(temperature=1.0, seed=2), SamplingParams(temperature=0.7, top_k=20, seed=3),
              SamplingParams(temperature=0.8, top_p=0.95, seed=1), SamplingParams(temperature=1.3, top_p=0.5, seed=4)]

    def gens(idx):
        return [torch.Generator().manual_seed(params[i].seed) if params[i].temperature > 0 else None for i in idx]

    alone = [sample_tokens(logits[i:i + 1], [params[i]], gens([i]))[0] for i in range(6)]
    together = sample_tokens(logits, params, gens(range(6)))
    order = [5, 2, 0, 4, 1, 3]
    shuffled = sample_tokens(logits[order], [params[i] for i in order], gens(order))
    assert together == alone
    assert [shuffled[order.index(i)] for i in range(6)] == alone
    # rows 1 and 4 share params and seed: the same draw from the same row
    assert sample_tokens(logits[[1, 1]], [params[1], params[4]], gens([1, 4])) == [alone[1], alone[1]]


def test_an_answer_does_not_depend_on_which_requests_share_its_batch(engine):
    ids = [engine.tokenizer.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    requests = [Request(ids[i % len(ids)], SamplingParams(max_new_tokens=10, temperature=0 if i < 3 else 1.0,
                                                          top_p=1.0 if i < 3 else 0.95, seed=i % 2), tag=i)
                for i in range(8)]
    alone = {}
    for r in requests:
        alone[r.tag] = next(iter(engine.generate([r], batch_size=1))).token_ids
    for batch, order in ((8, list(range(8))), (3, [7, 2, 5, 0, 3, 6, 1, 4])):
        together = {c.tag: c.token_ids for c in engine.generate([requests[i] for i in order], batch_size=batch)}
        assert together == alone, batch


def test_generation_interrupted_and_resumed_gives_the_same_data_and_head(engine, prompts_file, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    T.train_draft(engine, whole, prompts_file, settings(), gen_batch_size=4, checkpoint_every=2)

    def stop_after_7(phase, done, total, figures):
        if phase == "generate" and done == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train_draft(engine, split, prompts_file, settings(), gen_batch_size=4, checkpoint_every=2,
                      progress=stop_after_7)
    answers = split / "training" / T.ANSWERS_FILE
    lines = answers.read_text().splitlines()
    assert len(lines) == 1 + 7 and not (split / "training" / "data.safetensors").exists()
    assert not (split / "training" / "checkpoint.safetensors").exists()
    # a kill in the middle of writing the eighth answer: half a line, no newline
    with open(answers, "a") as f:
        f.write(lines[-1][:len(lines[-1]) // 2])
    messages = []
    # resumed with other flags on the command line: the saved answers' settings win, as a checkpoint's do
    T.train_draft(engine, split, prompts_file, settings(lr=0.5), resume=True, gen_batch_size=3, gen_refill=2,
                  checkpoint_every=2, log=messages.append)
    assert any("continuing from the 7 of 18 answers" in m and "1 unreadable" in m for m in messages), messages
    lines = answers.read_text().splitlines()
    assert len(lines) == 1 + 18 and len({json.loads(x)["i"] for x in lines[1:]}) == 18
    a, b = load_file(str(whole / "training" / "data.safetensors")), load_file(str(split / "training" / "data.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for name in ("model.safetensors", "training/checkpoint.safetensors"):
        a, b = load_file(str(whole / name)), load_file(str(split / name))
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)


def test_answers_of_other_settings_are_not_reused(engine, prompts_file, tmp_path):
    def stop_after_2(phase, done, total, figures):
        if phase == "generate" and done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train_draft(engine, tmp_path, prompts_file, settings(), progress=stop_after_2)
    messages = []
    T.train_draft(engine, tmp_path, prompts_file, settings(max_new_tokens=6, samples=1, steps=1), log=messages.append)
    assert not any("continuing" in m for m in messages)
    lines = (tmp_path / "training" / T.ANSWERS_FILE).read_text().splitlines()
    assert len(lines) == 1 + len(PROMPTS)
    assert all(len(json.loads(x)["ids"]) <= 6 for x in lines[1:])


def test_a_file_cut_anywhere_reads_as_a_prefix_of_its_answers(tmp_path):
    path = tmp_path / "answers.jsonl"
    log = T.AnswerLog(path, "k", 5, 8, {"steps": 3})
    log.load()
    log.open()
    done = {3: ([1, 2, 3], True), 0: ([], False), 4: ([7] * 8, False)}
    for i, (ids, stop) in done.items():
        log.add(i, ids, stop)
    log.close()
    whole = path.read_bytes()
    assert T.AnswerLog.header(path)["settings"] == {"steps": 3}
    ends = [n + 1 for n, byte in enumerate(whole) if byte == ord("\n")]
    for cut in range(len(whole) + 1):
        path.write_bytes(whole[:cut])
        again = T.AnswerLog(path, "k", 5, 8, {"steps": 3})
        complete = sum(e <= cut for e in ends) - 1  # whole answer lines
        assert again.load() == max(0, complete)
        assert list(again.answers) == list(done)[:max(0, complete)]
        again.open()  # appending after a partial line rewrites the file first
        again.add(1, [5], False)
        again.close()
        third = T.AnswerLog(path, "k", 5, 8, {"steps": 3})
        assert third.load() == max(0, complete) + 1 and third.dropped == 0
        assert third.answers[1] == ([5], False)
    # another key, or answers that cannot belong to it, are not read
    path.write_bytes(whole)
    assert T.AnswerLog(path, "other", 5, 8).load() == 0
    assert T.AnswerLog(path, "k", 4, 8).load() == 0  # another number of requests
    short = T.AnswerLog(path, "k", 5, 7)  # answer 4 is longer than 7 tokens: dropped
    assert short.load() == 2 and short.dropped == 1


def test_answers_of_prompts_still_in_a_changed_set_move_to_their_new_requests(tmp_path):
    path = tmp_path / "answers.jsonl"
    log = T.AnswerLog(path, "k1", 4, 8, {}, "base", ["a", "b"], samples=2)  # prompt p's sample k: request 2p + k
    log.load()
    log.open()
    made = {0: ([1], True), 1: ([2], False), 2: ([3, 3], True), 3: ([4], False)}
    for i, (ids, stop) in made.items():
        log.add(i, ids, stop)
    log.close()
    grown = T.AnswerLog(path, "k2", 6, 8, {}, "base", ["c", "a", "b"], samples=2)  # a prompt in front
    assert grown.load() == 4 and grown.moved == 4
    assert grown.answers == {2: made[0], 3: made[1], 4: made[2], 5: made[3]}
    grown.open()  # rewritten for the grown set, which the next run reads as its own
    grown.add(0, [9], True)
    grown.close()
    again = T.AnswerLog(path, "k2", 6, 8, {}, "base", ["c", "a", "b"], samples=2)
    assert again.load() == 5 and again.moved == 0 and again.answers[0] == ([9], True)
    assert T.AnswerLog.header(path)["prompts"] == ["c", "a", "b"]
    kept = T.AnswerLog(path, "k3", 2, 8, {}, "base", ["b"], samples=2)  # a and c gone
    assert kept.load() == 2 and kept.answers == {0: made[2], 1: made[3]}
    # fewer samples: each kept prompt's first ones; more: the saved ones, the new sample numbers to make
    fewer = T.AnswerLog(path, "k4", 2, 8, {}, "base", ["a", "b"], samples=1)
    assert fewer.load() == 2 and fewer.answers == {0: made[0], 1: made[2]}
    more = T.AnswerLog(path, "k5", 6, 8, {}, "base", ["b", "a"], samples=3)
    assert more.load() == 4 and more.answers == {0: made[2], 1: made[3], 3: made[0], 4: made[1]}
    # another model, answer length or temperature (base key), or no prompt digests: nothing
    assert T.AnswerLog(path, "k3", 2, 8, {}, "other", ["b"], samples=2).load() == 0
    assert T.AnswerLog(path, "k3", 2, 8, {}).load() == 0


def test_a_grown_prompt_set_answers_only_its_new_prompts_and_gives_a_fresh_runs_data(engine, tmp_path):
    small = write_prompts(tmp_path / "small.jsonl", texts=PROMPTS[2:4])
    grown = write_prompts(tmp_path / "grown.jsonl", texts=[PROMPTS[0]] + PROMPTS[2:5])
    T.train_draft(engine, tmp_path / "run", small, settings(steps=1), gen_batch_size=4)
    generated = []
    messages = []
    T.train_draft(engine, tmp_path / "run", grown, settings(), gen_batch_size=4, log=messages.append,
                  progress=lambda phase, done, total, figures: generated.append(figures.get("new_tokens"))
                  if phase == "generate" else None)
    assert any("continuing from the 6 of 12 answers" in m and "another prompt set" in m for m in messages), messages
    lines = (tmp_path / "run" / "training" / T.ANSWERS_FILE).read_text().splitlines()
    assert len(lines) == 1 + 12 and len(generated) == 6  # the two new prompts' three samples each, no more
    T.train_draft(engine, tmp_path / "fresh", grown, settings(), gen_batch_size=4)
    a = load_file(str(tmp_path / "run" / "training" / "data.safetensors"))
    b = load_file(str(tmp_path / "fresh" / "training" / "data.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_fewer_samples_reuse_the_saved_ones_and_give_a_fresh_runs_data(engine, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", texts=PROMPTS[:2])
    T.train_draft(engine, tmp_path / "run", prompts, settings(steps=1), gen_batch_size=4)
    generated = []
    T.train_draft(engine, tmp_path / "run", prompts, settings(samples=2), gen_batch_size=4,
                  progress=lambda phase, *_: generated.append(1) if phase == "generate" else None)
    assert generated == []  # every answer asked for was saved
    T.train_draft(engine, tmp_path / "fresh", prompts, settings(samples=2), gen_batch_size=4)
    a = load_file(str(tmp_path / "run" / "training" / "data.safetensors"))
    b = load_file(str(tmp_path / "fresh" / "training" / "data.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_before_any_checkpoint_from_the_command_line(engine, prompts_file, tmp_path, capsys):
    def stop_after_3(phase, done, total, figures):
        if phase == "generate" and done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        T.train_draft(engine, tmp_path, prompts_file, settings(steps=2), progress=stop_after_3)
    assert T.resume_settings(tmp_path)["steps"] == 2
    code = main(["train-draft", "--model", str(engine.name), "--out", str(tmp_path), "--prompts", str(prompts_file),
                 "--resume", "--device", "cpu", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "continuing from the 3 of 18 answers" in err
    assert T.checkpoint_state(tmp_path / "training" / "checkpoint.safetensors")["step"] == 2
    with pytest.raises(MoedeskError, match="no checkpoint"):
        T.resume_settings(tmp_path / "empty")
    assert main(["train-draft", "--model", str(engine.name), "--out", str(tmp_path / "o"), "--gen-refill", "0"]) == 2
    assert "--gen-refill" in capsys.readouterr().err
