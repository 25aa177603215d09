"""Requests the target writes itself for `moedesk train-draft --self-prompts N` (training.self_prompts):
which are kept, that they do not depend on the batch, that they are saved and reused, and that train-draft trains on
them beside the prompts file's."""
import json
from types import SimpleNamespace

import pytest

from moedesk.engine.errors import MoedeskError
from moedesk.engine.requests import Completion
from moedesk.training import self_prompts as S
from moedesk.training import train as T
from tests.speculative.train_helpers import PROMPTS, write_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def demo_engine():
    from moedesk.engine.runtime import Engine

    return Engine.load("demo", device="cpu", dtype="float32")


def test_the_prefix_is_the_template_up_to_a_users_text(engine):
    prefix, stop = S.user_turn_prefix(engine.tokenizer)
    whole = engine.tokenizer.render_chat([{"role": "user", "content": "Hi there"}], add_generation_prompt=False)
    assert engine.tokenizer.decode(prefix, skip_special_tokens=False) + "Hi there" + "<|im_end|>\n" == whole
    assert stop == ("<|im_end|>",)


class Written:
    """An engine whose generate answers request seed s with texts[s] (ended by the model unless it starts with
    '~', cut at the limit), recording the seeds and batch sizes asked for."""

    def __init__(self, engine, texts):
        self.tokenizer, self.name, self.texts, self.asked = engine.tokenizer, "fake", texts, []

    def generate(self, requests, batch_size):
        requests = list(requests)
        self.asked.append(([r.params.seed for r in requests], batch_size))
        for r in reversed(requests):  # out of order, as a batch finishes
            text = self.texts.get(r.params.seed, "")
            ids = self.tokenizer.encode(text.lstrip("~"), add_special_tokens=False)
            yield Completion(r.tag, ids, text.lstrip("~"), "length" if text.startswith("~") else "stop", len(ids))


def test_kept_requests_are_ended_by_the_model_long_enough_and_new(engine):
    long = "Please explain how a mixture of experts routes every token"
    texts = {10: long, 11: "~" + long + " and then rambles on", 12: "Hi", 13: "  PLEASE explain how a mixture of "
             "experts   routes every token ", 14: PROMPTS[1], 15: "Write a poem about the sea in four short lines",
             16: "Name three rivers of Europe and say where each one starts", 17: "List five prime numbers above fifty"}
    fake = Written(engine, texts)
    got = S.write_prompts(fake, 3, seed=10, batch_size=5, given=[[{"role": "user", "content": PROMPTS[1]}], "x"])
    # 11 cut at the limit, 12 too short, 13 a repeat of 10 (case and spacing aside), 14 already given
    assert got == [[{"role": "user", "content": t}] for t in (long, texts[15], texts[16])]
    # first round: 3 missing and half as much again (5); second: 2 missing, 3 asked from the next seed on
    assert fake.asked == [([10, 11, 12, 13, 14], 5), ([15, 16, 17], 5)]


def test_a_model_that_keeps_repeating_itself_gives_fewer(engine):
    fake = Written(engine, {s: "The same request every single time" for s in range(100)})
    assert len(S.write_prompts(fake, 5, seed=0)) == 1
    assert len(fake.asked) == 4  # rounds, then it gives up


def test_a_template_without_the_users_text_is_refused(engine):
    tok = SimpleNamespace(render_chat=lambda messages, add_generation_prompt: "<s>fixed</s>", source="m")
    with pytest.raises(MoedeskError, match="does not show a user's text"):
        S.user_turn_prefix(tok)


def test_saved_prompts_are_reused_for_the_same_settings_only(engine, tmp_path, monkeypatch):
    texts = {s: f"Tell me a fact about the number {s} please" for s in range(20)}
    fake = Written(engine, texts)
    fake.config, fake.dtype = engine.config, engine.dtype
    first = S.self_written_prompts(fake, 4, 0, tmp_path, batch_size=8)
    assert len(first) == 4 and len(fake.asked) == 1
    lines = (tmp_path / S.FILE).read_text().splitlines()
    assert [json.loads(line)["messages"] for line in lines[1:]] == first
    assert S.self_written_prompts(fake, 4, 0, tmp_path) == first and len(fake.asked) == 1
    S.self_written_prompts(fake, 4, 1, tmp_path)  # another seed: written again
    assert len(fake.asked) == 2
    (tmp_path / S.FILE).write_text(lines[0] + "\n" + lines[1] + "\n")  # a header promising more than there is
    assert S.load_saved(tmp_path / S.FILE, S.settings_key(fake, 4, 1)) is None


def test_the_demo_writes_requests_that_do_not_depend_on_the_batch(demo_engine, monkeypatch):
    monkeypatch.setattr(S, "MAX_TOKENS", 48)
    alone = S.write_prompts(demo_engine, 3, seed=0, batch_size=1)
    assert alone == S.write_prompts(demo_engine, 3, seed=0, batch_size=5)
    assert len(alone) == 3
    for [message] in alone:
        assert message["role"] == "user" and len(message["content"].split()) >= 3
        assert "<|im_" not in message["content"]


def test_train_draft_answers_the_written_prompts_beside_the_files(engine, tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", texts=PROMPTS[:2])
    written = [[{"role": "user", "content": t}] for t in ("Count to five.", "Name a colour.")]
    calls = []

    def fake_write(engine_, count, seed, batch_size, given, progress):
        calls.append((count, seed, [T.prompt_ids(engine.tokenizer, g) for g in given]))
        return written

    monkeypatch.setattr(S, "write_prompts", fake_write)
    settings = T.TrainSettings(steps=1, batch_size=2, max_new_tokens=4, self_prompts=2, seed=3)
    summary = T.train_draft(engine, tmp_path / "run", prompts, settings, gen_batch_size=4)
    assert summary["sequences"] == 4 and summary["self_prompts"] == 2
    assert [c[:2] for c in calls] == [(2, 3)] and len(calls[0][2]) == 2  # told the file's prompts
    data = T.load_data(tmp_path / "run" / "training" / "data.safetensors",
                       T.data_key(engine, T.load_prompts(prompts) + written, 4))
    assert data is not None and data.sequences == 4
    T.train_draft(engine, tmp_path / "run", prompts, settings, resume=True)
    assert len(calls) == 1  # resumed: the saved prompts
