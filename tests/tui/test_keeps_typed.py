"""The app never loses what the user typed: the unsent message across screens, restarts and crashes, a message
sent while a reply runs, a reply that fails half way, and conversation files that cannot be read."""
from __future__ import annotations

import json

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.screens.chat import ChatScreen
from moedesk.app.tui.storage import Conversation, ConversationStore, atomic_write_json
from moedesk.app.tui.widgets.messages import AssistantMessage, UserMessage, visible
from tests.tui.helpers import chat_ready, greedy_settings, hold_first_reply, open_settings, wait_for, wait_idle

pytestmark = pytest.mark.anyio
SIZE = (100, 30)
DRAFT = "line one\n    code\nnot sent"


@pytest.fixture(autouse=True)
def quick_draft_saves(monkeypatch):
    monkeypatch.setattr(ChatScreen, "DRAFT_SAVE_S", 0.05)


async def open_chat(pilot):
    await wait_for(pilot, lambda: chat_ready(pilot.app), what="the chat")


def notices(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


def draft_on_disk(tui_dirs) -> str:
    return json.loads((tui_dirs["data"] / "draft.json").read_text(encoding="utf-8"))["text"]


async def test_the_unsent_message_survives_every_other_screen(engine):
    from moedesk.app.tui.screens.conversations import ConversationsScreen
    from moedesk.app.tui.screens.download import DownloadScreen
    from moedesk.app.tui.screens.models import ModelsScreen
    from moedesk.app.tui.screens.settings import SettingsScreen

    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        chat = app.chat
        await pilot.press(*"line one", "ctrl+j", *"    code", "ctrl+j", *"not sent")
        assert chat.prompt.text == DRAFT
        for keys, screen_type in ((("f2",), SettingsScreen), (("f3",), ModelsScreen),
                                  (("f3", "f6"), DownloadScreen), (("ctrl+o",), ConversationsScreen)):
            await pilot.press(*keys)
            await wait_for(pilot, lambda: isinstance(app.screen, screen_type), what=screen_type.__name__)
            while app.screen is not chat:
                await pilot.press("escape")
                await pilot.pause()
            assert chat.prompt.text == DRAFT, screen_type.__name__
        for key in ("ctrl+t", "ctrl+t", "f4", "f4", "ctrl+n"):
            await pilot.press(key)
            await pilot.pause()
            assert chat.prompt.text == DRAFT, key


async def test_the_unsent_message_survives_a_restart_and_a_kill(engine, tui_dirs):
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        app.chat.prompt.focus()
        await pilot.press(*"line one", "ctrl+j", *"    code", "ctrl+j", *"not sent")
        # What a kill leaves: the draft is on disk within the save interval, while the app still runs.
        await wait_for(pilot, lambda: (tui_dirs["data"] / "draft.json").exists()
                       and draft_on_disk(tui_dirs) == DRAFT, timeout=5, what="the draft on disk")
        await pilot.press(*" and more")
        await pilot.press("ctrl+q")  # quitting writes what the interval has not yet
    assert draft_on_disk(tui_dirs) == DRAFT + " and more"
    assert not list(tui_dirs["data"].glob(".*.tmp"))

    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        assert app.chat.prompt.text == DRAFT + " and more"
        await pilot.press("enter")  # sent: the draft goes, the message is in the conversation
        await wait_idle(pilot, app)
        assert draft_on_disk(tui_dirs) == ""
        assert app.chat.conversation.messages[0].content == DRAFT + " and more"

    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        assert app.chat.prompt.text == ""


async def test_a_very_long_draft_is_kept_whole_when_the_app_closes_any_way(engine, tui_dirs, monkeypatch):
    monkeypatch.setattr(ChatScreen, "DRAFT_SAVE_S", 60)  # only closing can have written it
    text = "\n".join(f"line {n}: " + "x" * 200 for n in range(500))  # ~100k characters
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        app.chat.prompt.text = text
        await pilot.pause()
        assert not (tui_dirs["data"] / "draft.json").exists()
    assert draft_on_disk(tui_dirs) == text
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        assert app.chat.prompt.text == text


async def test_a_write_cut_short_keeps_the_previous_draft_and_a_bad_file_is_set_aside(engine, tui_dirs,
                                                                                      monkeypatch):
    store = ConversationStore()
    store.save_draft("the previous draft")
    # A write that dies half way (the process killed in json.dump) leaves the old file whole...
    import moedesk.app.tui.storage as storage

    def dump_half(value, f, **kwargs):
        f.write('{"version": 1, "text": "the new dra')
        raise KeyboardInterrupt

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(storage.json, "dump", dump_half)
        store.save_draft("the new draft")
    assert store.load_draft() == ("the previous draft", "")
    # ...and a temporary file left by a kill, or a state file that is not JSON, stops nothing.
    (tui_dirs["data"] / ".draft.json.abc123.tmp").write_text('{"text": "half', encoding="utf-8")
    (tui_dirs["data"] / "state.json").write_text("{not json", encoding="utf-8")
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        assert app.chat.prompt.text == "the previous draft"

    # A draft file that is not JSON: the app starts with an empty box, says so, and keeps the file aside.
    bad = b'{"version": 1, "text": "cut sh'
    (tui_dirs["data"] / "draft.json").write_bytes(bad)
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        assert app.chat.prompt.text == ""
        await wait_for(pilot, lambda: any("draft" in n for n in notices(app)), timeout=5, what="the notice")
    aside = list(tui_dirs["data"].glob("draft.json.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == bad


async def test_a_message_sent_while_a_reply_runs_stays_in_the_box(engine):
    app = MoedeskApp(hold_first_reply(engine), settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        chat = app.chat
        chat.prompt.focus()
        await pilot.press(*"one", "enter")
        await wait_for(pilot, lambda: chat.generation is not None and chat.generation.fragments,
                       what="the reply running")
        await pilot.press(*"two", "enter")
        await pilot.pause()
        assert chat.prompt.text == "two"
        assert [m.content for m in chat.conversation.messages] == ["one"]
        assert any("still being written" in n for n in notices(app))
        await pilot.press("escape")
        await wait_idle(pilot, app)
        await pilot.press("enter")
        await wait_idle(pilot, app)
        assert chat.prompt.text == ""
        assert [m.content for m in chat.conversation.messages if m.role == "user"] == ["one", "two"]


async def test_no_model_keeps_the_message_in_the_box(engine):
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        app.release_engine()
        app.chat.prompt.focus()
        await pilot.press(*"hello", "enter")
        await pilot.pause()
        assert app.chat.prompt.text == "hello" and not app.chat.conversation.messages
        assert "No model loaded" in str(app.chat.query_one("#chat-status").render())


async def test_a_reply_that_fails_half_way_keeps_both_texts_and_can_be_retried(engine, tui_dirs):
    real_stream = engine.stream
    calls = 0

    def failing_stream(*args, **kwargs):
        nonlocal calls
        calls += 1
        pieces = 0
        for chunk in real_stream(*args, **kwargs):
            yield chunk
            pieces += bool(chunk.text)
            if calls == 1 and pieces == 3:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.stream = failing_stream
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=12))
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        chat = app.chat
        chat.prompt.focus()
        await pilot.press(*"Hello", "enter")
        await wait_idle(pilot, app)
        failed = chat.query_one(AssistantMessage)
        assert failed.has_class("-error") and len(failed.text) > 0  # the partial reply stays on screen
        assert failed.text == "".join(chat.last_fragments)
        assert failed.markdown.source == visible(failed.text)
        status = str(chat.query_one("#chat-status").render())
        assert "illegal memory access" in status and "ctrl+r" in status
        assert [str(w.render()) for w in chat.query(UserMessage)] == ["Hello"]
        assert [m.role for m in chat.conversation.messages] == ["user"]
        assert [m["role"] for m in json.loads(ConversationStore().path(chat.conversation.id).read_text())
                ["messages"]] == ["user"]

        await pilot.press("ctrl+r")
        await wait_idle(pilot, app)
        assert [m.role for m in chat.conversation.messages] == ["user", "assistant"]
        replies = chat.query(AssistantMessage)
        assert len(replies) == 1 and not replies.first().has_class("-error")


async def test_an_unreadable_conversation_is_reported_and_set_aside(engine, tui_dirs):
    store = ConversationStore()
    good = Conversation(id="20250101-000000-aaaaaa")
    good.add("user", "a question worth keeping")
    store.save(good)
    broken = b'{"version": 1, "id": "20250102-000000-bbbbbb", "messages": [{"role": "user", "cont'
    broken_path = store.path("20250102-000000-bbbbbb")
    broken_path.write_bytes(broken)
    store.remember("20250102-000000-bbbbbb")

    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        assert app.chat.conversation.id == good.id  # the next readable one opens
        await wait_for(pilot, lambda: any("20250102-000000-bbbbbb" in n for n in notices(app)), timeout=5,
                       what="the report")
        await pilot.press(*"new chat text")
    assert not broken_path.exists()
    aside = list(store.folder.glob("20250102-000000-bbbbbb.json.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == broken  # kept byte for byte, never overwritten
    assert [i.id for i in store.list()] == [good.id]


def test_atomic_write_keeps_the_old_file_when_the_rename_fails(tmp_path, monkeypatch):
    import os

    path = tmp_path / "atomic" / "value.json"
    atomic_write_json(path, {"old": True})
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        atomic_write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True} and [p.name for p in path.parent.iterdir()] == ["value.json"]


async def test_settings_typed_and_not_saved_need_a_second_escape(engine, tui_dirs):
    from moedesk.app.tui.settings import load_settings

    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        await open_settings(pilot)  # nothing changed: Esc leaves at once
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat, what="the chat")

        await open_settings(pilot)
        screen = app.screen
        prompt = screen.query_one("#setting-system_prompt")
        prompt.focus()
        prompt.text = ""
        await pilot.press(*"A long system prompt", "enter", *"typed with care")
        top_k = screen.query_one("#setting-top_k")
        top_k.focus()
        top_k.value = ""
        await pilot.press("-", "5")  # invalid: kept as typed, with its message
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is screen and any("Esc again" in n for n in notices(app))
        assert prompt.text == "A long system prompt\ntyped with care" and top_k.value == "-5"
        assert "≥ 0" in str(screen.query_one("#error-top_k").render())
        await pilot.press("1")  # a change after the warning: the next Esc warns again
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is screen and top_k.value == "-51"
        await pilot.press("escape")  # the second Esc in a row leaves without saving
        await wait_for(pilot, lambda: app.screen is app.chat, what="the chat")
        assert app.settings.system_prompt == "Be brief." and load_settings().system_prompt != prompt.text


async def test_a_settings_file_that_cannot_be_read_is_set_aside_not_overwritten(engine, tui_dirs):
    from moedesk.app.tui.settings import load_settings, settings_path

    hand_edited = b'{"temperature": 0.2, "system_prompt": "my long prompt",}\n'  # a trailing comma
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_bytes(hand_edited)
    app = MoedeskApp(engine)
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        assert any("unreadable" in n for n in notices(app))
        await open_settings(pilot)
        app.screen.query_one("#setting-max_new_tokens").value = "33"
        await pilot.pause()
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat, what="the chat")
        assert any("kept as" in n for n in notices(app))
    assert load_settings().max_new_tokens == 33
    aside = list(settings_path().parent.glob(f"{settings_path().name}.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == hand_edited


async def test_a_message_too_long_for_the_context_stays_in_the_box(engine):
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        chat = app.chat
        too_long = "x " * 2000  # alone longer than the tiny model's 512-token context
        chat.prompt.text = too_long
        chat.prompt.focus()
        await pilot.press("enter")
        await pilot.pause()
        status = str(chat.query_one("#chat-status").render())
        assert "context" in status and "\n" not in status
        assert chat.prompt.text == too_long and not chat.conversation.messages and not chat.query(UserMessage)
        chat.prompt.text = "short now"
        await pilot.press("enter")
        await wait_idle(pilot, app)
        assert [m.role for m in chat.conversation.messages] == ["user", "assistant"]


async def test_quitting_mid_reply_keeps_the_reply_so_far_as_stopped(engine):
    import time

    real_stream = engine.stream

    def slow_step_stream(*args, cancel=None, **kwargs):
        held = True
        for chunk in real_stream(*args, cancel=cancel, **kwargs):
            yield chunk
            if held and chunk.text:
                held = False
                cancel.wait(timeout=30)
                time.sleep(1.0)  # a big model's step: the app has gone before the engine says it stopped

    engine.stream = slow_step_stream
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        app.chat.prompt.focus()
        await pilot.press(*"Hello", "enter")
        await wait_for(pilot, lambda: app.chat.generation is not None and app.chat.generation.fragments,
                       what="the reply running")
        shown = app.chat.generation.widget.text
        conversation_id = app.chat.conversation.id
        await pilot.press("ctrl+q")
    saved = ConversationStore().load(conversation_id)
    assert [m.role for m in saved.messages] == ["user", "assistant"]
    assert saved.messages[1].content == shown and saved.messages[1].meta["finish_reason"] == "cancelled"


async def test_typing_after_a_panel_or_screen_closes_reaches_the_message_box(engine):
    # Issue 46, item 4: ctrl+n, F4, F4, then "hello" reached nothing; nor did keys typed after a Tab.
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        chat = app.chat
        await pilot.press("ctrl+n", "f4", "f4", *"hello")
        await pilot.pause()
        assert chat.prompt.text == "hello" and app.focused is chat.prompt
        await pilot.press("tab", *" there")
        await pilot.pause()
        assert chat.prompt.text == "hello there"
        await pilot.press("f2")
        await wait_for(pilot, lambda: app.screen is not chat, what="the settings")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is chat, what="the chat again")
        await pilot.press("shift+tab", "shift+tab", *"!")
        await pilot.pause()
        assert chat.prompt.text == "hello there!" and app.focused is chat.prompt
