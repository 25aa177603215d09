"""How the chat decodes: speculative decoding and beam search from the settings (F2) and `moedesk chat`'s flags,
through the engine's scheduler, on the tiny Qwen3-MoE with a random EAGLE head."""
from __future__ import annotations

import json

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.screens.chat import ChatScreen
from moedesk.app.tui.settings import FIELDS_BY_NAME, Settings, load_settings, settings_path
from moedesk.engine.requests import Request, SamplingParams
from tests.speculative.test_speculative_decode import random_head
from tests.tui.helpers import chat_ready, greedy_settings, open_settings, wait_for, wait_idle

SIZE = (100, 30)


@pytest.fixture
def head(engine, tmp_path):
    folder = tmp_path / "head"
    random_head(engine, 1, folder)
    return folder


def prompt_ids(engine, settings, text):
    return engine.tokenizer.chat_prompt([{"role": "system", "content": settings.system_prompt},
                                         {"role": "user", "content": text}])


def plain(engine, settings, text):
    params = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0)
    return next(engine.generate([Request(prompt_ids(engine, settings, text), params)]))


async def say(pilot, text: str):
    await wait_for(pilot, lambda: chat_ready(pilot.app), what="the chat")
    await pilot.click("#prompt")
    await pilot.press(*text)
    await pilot.press("enter")


def test_decoding_fields_and_options(engine, head):
    for name in ("speculative", "draft", "draft_length", "draft_width", "beams", "length_penalty"):
        assert FIELDS_BY_NAME[name].help
    assert FIELDS_BY_NAME["speculative"].choices == ("off", "greedy", "beam", "auto")
    assert "only the best hypothesis" in FIELDS_BY_NAME["beams"].help.lower()
    assert Settings().decoding(engine) is None
    spec = Settings(speculative="beam", draft=str(head), draft_length=3, draft_width=2).decoding(engine)
    assert (spec.mode, spec.draft, spec.draft_length, spec.draft_width) == ("beam", str(head), 3, 2)
    beam = Settings(beams=3, length_penalty=0.5, speculative="greedy").decoding(engine)  # beams win
    assert (beam.beams, beam.length_penalty) == (3, 0.5)
    with pytest.raises(Exception, match="draft") as caught:
        Settings(speculative="auto").decoding(engine)  # the tiny model has no head of its own
    assert "\n" not in str(caught.value)
    assert Settings(draft_length=0).problems() == {"draft_length": "must be ≥ 1 and ≤ 16"}


@pytest.mark.anyio
async def test_settings_screen_sets_speculation_and_beams(engine, head, tui_dirs):
    app = MoedeskApp(engine, settings=Settings())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        await open_settings(pilot)
        screen = app.screen
        screen.query_one("#setting-speculative").focus()
        await pilot.press("enter", "down", "down", "down", "enter")  # off, greedy, beam, auto
        await pilot.pause()
        assert screen.query_one("#setting-speculative").value == "auto"
        screen.query_one("#setting-draft").value = str(head)
        screen.query_one("#setting-draft_width").value = "0"
        await pilot.pause()
        assert "≥ 1" in str(screen.query_one("#error-draft_width").render())
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen and not settings_path().exists()  # refused to save
        screen.query_one("#setting-draft_width").value = "2"
        screen.query_one("#setting-draft_length").value = "3"
        screen.query_one("#setting-beams").value = "2"
        screen.query_one("#setting-length_penalty").value = "0.5"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat, what="the chat again")
        chosen = app.settings
        assert (chosen.speculative, chosen.draft, chosen.draft_length, chosen.draft_width) == ("auto", str(head), 3, 2)
        assert (chosen.beams, chosen.length_penalty) == (2, 0.5)
        assert load_settings() == chosen
        assert json.loads(settings_path().read_text())["speculative"] == "auto"


@pytest.mark.anyio
async def test_a_chat_streams_with_speculation_on(engine, head, monkeypatch):
    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)  # one UI message per token
    settings = greedy_settings(max_new_tokens=40, speculative="greedy", draft=str(head), draft_length=3)
    expected = plain(engine, settings, "Hello there")
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "Hello there")
        await wait_for(pilot, lambda: app.chat.generation is not None or app.chat.conversation.messages[-1].role
                       == "assistant", what="the reply to start")
        await wait_idle(pilot, app)
        chat = app.chat
        reply = chat.conversation.messages[-1]
        assert reply.content == expected.text  # lossless at temperature 0
        assert reply.meta["tokens"] == len(expected.token_ids)
        assert len(chat.last_fragments) > 1 and "".join(chat.last_fragments) == expected.text  # it streamed
        spec = reply.meta["stats"]["speculative"]
        assert spec["mode"] == "greedy" and spec["verify_steps"] >= 1
        assert "per model step" in dict(chat.stats.number_rows)


@pytest.mark.anyio
async def test_beam_mode_shows_the_best_hypothesis_whole(engine, monkeypatch):
    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)
    settings = greedy_settings(max_new_tokens=10, beams=3)
    ids = prompt_ids(engine, settings, "Hi")
    best = engine.beam_search(ids, beams=3, max_new_tokens=10)
    app = MoedeskApp(engine, settings=settings)
    statuses = []
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        real = app.chat.set_status
        monkeypatch.setattr(app.chat, "set_status", lambda text, error=False: statuses.append(text) or real(text, error))
        await say(pilot, "Hi")
        await wait_idle(pilot, app)
        reply = app.chat.conversation.messages[-1]
        assert reply.content == best.text and reply.meta["stats"]["beams"] == 3
        assert app.chat.last_fragments == [best.text]  # nothing streamed before the search ended
        assert any("searching 3 beams" in s for s in statuses)
        assert dict(app.chat.stats.number_rows)["beams"] == "3"


@pytest.mark.anyio
async def test_no_draft_head_says_so_in_one_line_and_replies_plainly(engine):
    settings = greedy_settings(max_new_tokens=8, speculative="greedy")
    expected = plain(engine, settings, "Hi")
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        status = str(app.chat.query_one("#chat-status").render())
        assert "draft" in status and "without speculation" in status and "\n" not in status
        await say(pilot, "Hi")
        await wait_idle(pilot, app)
        reply = app.chat.conversation.messages[-1]
        assert reply.content == expected.text and "speculative" not in reply.meta["stats"]


@pytest.mark.anyio
async def test_chat_flags_decide_over_the_settings_for_the_run(engine, head, monkeypatch):
    import moedesk.app.tui as tui_package
    from moedesk.app.cli import main

    runs = []
    monkeypatch.setattr(tui_package, "run_app", lambda *args, **kw: runs.append(kw) or 0)
    assert main(["chat", "--speculative", "beam", "--draft", str(head), "--draft-length", "3", "--draft-width", "2",
                 "--beams", "2", "--length-penalty", "0.5"]) == 0
    assert runs[-1]["decoding"] == {"speculative": "beam", "draft": str(head), "draft_length": 3, "draft_width": 2,
                                    "beams": 2, "length_penalty": 0.5}
    for bad in (["--draft-length", "0"], ["--beams", "x"], ["--speculative", "sideways"], ["--length-penalty", "nan"]):
        with pytest.raises(SystemExit) as stopped:
            main(["chat", *bad])
        assert stopped.value.code == 2

    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)
    settings = greedy_settings(max_new_tokens=12)  # speculation off in the settings; the flags turn it on
    expected = plain(engine, settings, "Hello")
    flagged = MoedeskApp(engine, settings=settings,
                         decoding={"speculative": "greedy", "draft": str(head), "draft_length": 2})
    async with flagged.run_test(size=SIZE) as pilot:
        await say(pilot, "Hello")
        await wait_idle(pilot, flagged)
        reply = flagged.chat.conversation.messages[-1]
        assert reply.content == expected.text and reply.meta["stats"]["speculative"]["mode"] == "greedy"
        assert flagged.settings.speculative == "off"  # the saved settings are untouched


@pytest.mark.anyio
async def test_autos_first_measurement_shows_its_progress_then_the_reply(engine, head, monkeypatch):
    statuses, measured = [], []
    real_status, real_times = ChatScreen.set_status, engine.speculation_step_times
    monkeypatch.setattr(ChatScreen, "set_status", lambda self, text, error=False: (statuses.append(text),
                                                                                  real_status(self, text, error)))
    monkeypatch.setattr(engine, "speculation_step_times", lambda n, measure=False, progress=None: (
        measured.append(measure), real_times(n, measure=measure, progress=progress))[1])
    settings = greedy_settings(max_new_tokens=12, speculative="auto", draft=str(head), draft_length=2)
    expected = plain(engine, settings, "Hello there")
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "Hello there")
        await wait_idle(pilot, app)
        progress = [s for s in statuses if "auto measures this machine's steps" in s]
        shares = [int(s.split(": ")[-1].split("%")[0]) for s in progress]
        assert all(len(s) <= 76 for s in progress)  # whole on an 80-column screen
        assert shares[0] == 0 and len(shares) >= 3 and shares == sorted(shares)  # from the start, as it went on
        assert statuses.index(progress[-1]) < len(statuses) - 1  # the writing status came back after it
        assert app.chat.conversation.messages[-1].content == expected.text
        assert measured.count(True) == 1

        await say(pilot, "Again")  # measured once per machine: the next reply goes straight to writing
        await wait_idle(pilot, app)
        assert measured.count(True) == 1
    assert engine.speculation_step_times(2) is not None
