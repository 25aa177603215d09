"""Issue 18: the app as a daily tool — nothing typed is lost, it fits 80x24, it says what it is doing."""
from __future__ import annotations

import pytest
from textual import events

from app.tui import MoedeskApp
from app.tui.storage import Conversation, ConversationStore
from app.tui.widgets.messages import UserMessage
from tests.tui.helpers import chat_ready, greedy_settings, wait_for, wait_idle

pytestmark = pytest.mark.anyio

CODE = "Fix this code:\ndef add(a, b):\n    return a - b\n"


async def open_chat(pilot):
    await wait_for(pilot, lambda: chat_ready(pilot.app), what="the chat")
    await pilot.click("#prompt")


# ---------------------------------------------------------------- 1. multi-line input


async def test_a_pasted_message_keeps_every_line(engine):
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=4))
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        app.post_message(events.Paste(CODE))  # as the terminal driver delivers a paste
        await pilot.pause()
        await pilot.press("enter")
        await wait_idle(pilot, app)
        sent = app.chat.conversation.messages[0]
        assert sent.role == "user" and sent.content == CODE.rstrip("\n")
        assert ConversationStore().load(app.chat.conversation.id).messages[0].content == CODE.rstrip("\n")
        assert "return a - b" in str(app.chat.query(UserMessage).first().render())
        assert app.chat.prompt.text == ""


async def test_new_line_keys_and_the_box_grows_then_scrolls(engine):
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=4))
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        prompt = app.chat.prompt
        one_line = prompt.outer_size.height
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        await pilot.pause()
        assert prompt.text == "a\nb\nc"
        assert prompt.outer_size.height == one_line + 2
        for n in range(20):
            await pilot.press("ctrl+j", "x")
        await pilot.pause()
        assert prompt.outer_size.height <= 8  # a few lines, then it scrolls
        assert prompt.max_scroll_y > 0
        assert not app.chat.conversation.messages  # nothing was sent by a new line
        await pilot.press("enter")
        await wait_idle(pilot, app)
        assert app.chat.conversation.messages[0].content == "a\nb\nc" + "\nx" * 20
        assert prompt.outer_size.height == one_line


# ---------------------------------------------------------------- 9. earlier prompts


async def test_up_in_an_empty_box_recalls_earlier_prompts(engine):
    store = ConversationStore()
    old = Conversation()
    old.add("user", "first question")
    old.add("assistant", "an answer")
    store.save(old)
    store.remember(old.id)
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=4))
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        await pilot.press(*"second", "enter")
        await wait_idle(pilot, app)
        prompt = app.chat.prompt
        await pilot.press("up")
        assert prompt.text == "second"
        await pilot.press("up")
        assert prompt.text == "first question"
        await pilot.press("up")
        assert prompt.text == "first question"  # the oldest stays
        await pilot.press("down")
        assert prompt.text == "second"
        await pilot.press("down")
        assert prompt.text == ""
        # ↑ inside a message being written moves the cursor, it does not replace the text.
        await pilot.press("a", "ctrl+j", "b", "up")
        assert prompt.text == "a\nb" and prompt.cursor_location[0] == 0
