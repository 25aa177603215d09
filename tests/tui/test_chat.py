"""The chat screen with the real engine on a tiny Qwen3-MoE checkpoint."""
from __future__ import annotations

import json

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.screens.chat import ChatScreen
from moedesk.app.tui.storage import Conversation, ConversationStore
from moedesk.app.tui.widgets.messages import AssistantMessage, UserMessage, visible
from moedesk.engine.requests import Request, SamplingParams
from tests.tui.helpers import chat_ready, greedy_settings, hold_first_reply, wait_for, wait_idle

pytestmark = pytest.mark.anyio
SIZE = (100, 30)


def reference(engine, settings, turns):
    """engine.generation.decoder on the same conversation and settings: what the chat must show."""
    system = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
    messages = system + turns
    ids = engine.tokenizer.chat_prompt(messages)
    params = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0, top_p=settings.top_p)
    return next(engine.generate([Request(ids, params)]))


async def say(pilot, text: str):
    await wait_for(pilot, lambda: chat_ready(pilot.app), what="the chat")
    await pilot.click("#prompt")
    await pilot.press(*text)
    await pilot.press("enter")


async def test_reply_streams_token_by_token_and_equals_generate(engine, monkeypatch):
    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)  # one UI message per token
    settings = greedy_settings()
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "Hello there")
        await wait_idle(pilot, app)
        chat = app.chat
        expected = reference(engine, settings, [{"role": "user", "content": "Hello there"}])
        reply = chat.conversation.messages[-1]
        assert [m.role for m in chat.conversation.messages] == ["user", "assistant"]
        assert reply.content == expected.text
        assert reply.meta["tokens"] == len(expected.token_ids)
        assert reply.meta["finish_reason"] == expected.finish_reason
        assert len(chat.last_fragments) > 1  # it streamed, not one block at the end
        assert "".join(chat.last_fragments) == expected.text
        widget = chat.query(AssistantMessage).last()
        assert widget.markdown.source == visible(expected.text)
        assert not widget.has_class("-streaming")
        assert app.screen.query_one("#prompt").text == ""

        # The second turn goes through the chat template with the whole history.
        await say(pilot, "And then?")
        await wait_idle(pilot, app)
        second = reference(engine, settings, [{"role": "user", "content": "Hello there"},
                                              {"role": "assistant", "content": expected.text},
                                              {"role": "user", "content": "And then?"}])
        assert chat.conversation.messages[-1].content == second.text
        assert len(chat.query(UserMessage)) == 2 and len(chat.query(AssistantMessage)) == 2


async def test_escape_stops_the_reply(engine, monkeypatch):
    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)
    settings = greedy_settings(max_new_tokens=400, system_prompt="")
    prompt = "Tell me everything"
    full = reference(engine, settings, [{"role": "user", "content": prompt}])
    assert len(full.token_ids) > 50, "the tiny model must talk long enough to be interrupted"
    app = MoedeskApp(hold_first_reply(engine), settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, prompt)
        await wait_for(pilot, lambda: app.chat.generation is not None and app.chat.generation.tokens > 0,
                       what="the first token")
        await pilot.press("escape")
        await wait_idle(pilot, app)
        reply = app.chat.conversation.messages[-1]
        assert reply.meta["finish_reason"] == "cancelled"
        assert 0 < reply.meta["tokens"] < len(full.token_ids)
        assert full.text.startswith(reply.content[:10])
        widget = app.chat.query(AssistantMessage).last()
        assert widget.has_class("-cancelled") and "stopped" in str(widget.query_one(".meta").render())
        # Esc with nothing running does nothing.
        await pilot.press("escape")
        assert app.chat.generation is None


async def test_regenerate_replaces_the_last_reply(engine):
    settings = greedy_settings()
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "Hello")
        await wait_idle(pilot, app)
        old = app.chat.conversation.messages[-1]
        first = old.content
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.chat.generation is None and app.chat.conversation.messages[-1] is not old,
                       what="the new reply")
        await pilot.pause()
        messages = app.chat.conversation.messages
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[-1].content == first  # greedy: the same reply again
        assert len(app.chat.query(AssistantMessage)) == 1
        saved = ConversationStore().load(app.chat.conversation.id)
        assert [m.role for m in saved.messages] == ["user", "assistant"]


async def test_regenerate_while_streaming_restarts(engine):
    settings = greedy_settings(max_new_tokens=400, system_prompt="")
    app = MoedeskApp(hold_first_reply(engine), settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "Tell me everything")
        await wait_for(pilot, lambda: app.chat.generation is not None and app.chat.generation.tokens > 0,
                       what="the first token")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.chat.generation is None and len(app.chat.conversation.messages) == 2
                       and app.chat.conversation.messages[-1].meta["finish_reason"] != "cancelled",
                       timeout=90, what="the restarted reply")  # up to 400 tokens, on a CPU that may be shared
        await pilot.pause()
        messages = app.chat.conversation.messages
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[-1].meta["finish_reason"] != "cancelled"
        assert len(app.chat.query(AssistantMessage)) == 1


async def test_new_chat_copy_and_conversation_restored(engine, tui_dirs):
    settings = greedy_settings()
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "Hello")
        await wait_idle(pilot, app)
        first = app.chat.conversation
        await pilot.press("ctrl+y")
        assert app.clipboard == first.messages[-1].content

        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.chat.conversation.messages == [] and app.chat.conversation.id != first.id
        assert not app.chat.query(AssistantMessage) and app.screen.query_one("#empty-hint").display
        await say(pilot, "Second chat")
        await wait_idle(pilot, app)
        second_id = app.chat.conversation.id

    files = sorted(p.name for p in (tui_dirs["data"] / "conversations").glob("*.json"))
    assert files == sorted([f"{first.id}.json", f"{second_id}.json"])
    saved = json.loads((tui_dirs["data"] / "conversations" / f"{first.id}.json").read_text())
    assert [m["content"] for m in saved["messages"]] == [m.content for m in first.messages]
    assert saved["title"] == "Hello" and saved["messages"][1]["meta"]["tokens"] > 0

    # A new app comes back to the last conversation; ctrl+o opens the older one.
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        assert app.chat.conversation.id == second_id
        assert [str(w.render()) for w in app.chat.query(UserMessage)] == ["Second chat"]
        assert dict(app.chat.stats.number_rows)["tokens"] != "—"  # the last reply's numbers
        await pilot.press("ctrl+o")
        await pilot.pause()
        options = app.screen.query_one("#conversations")
        assert options.option_count == 2
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        assert app.chat.conversation.id == first.id
        assert app.chat.conversation.messages[-1].content == first.messages[-1].content
        assert len(app.chat.query(AssistantMessage)) == 1

    # ...and the one it was left on next time.
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        assert app.chat.conversation.id == first.id


async def test_context_overflow_leaves_out_old_turns_and_errors_are_one_line(engine):
    settings = greedy_settings(max_new_tokens=8)
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        chat = app.chat
        long_text = "experts " * 150  # ~150+ tokens each; the tiny model's context is 512
        for n in range(4):
            chat.conversation.add("user", f"{n} {long_text}")
            chat.conversation.add("assistant", "ok")
        chat.conversation.add("user", "last question")
        ids, left_out = chat._prompt_ids(engine)
        assert left_out > 0 and len(ids) <= engine.context_length - 8

        app.screen.query_one("#prompt").text = "x " * 2000  # alone longer than the context
        await pilot.press("enter")
        await pilot.pause()
        status = str(app.screen.query_one("#chat-status").render())
        assert "context" in status and "\n" not in status


async def test_deleting_the_open_conversation_starts_a_new_one(engine, tui_dirs):
    store = ConversationStore()
    older, current = Conversation(id="20250101-000000-aaaaaa"), Conversation(id="20250102-000000-bbbbbb")
    older.add("user", "older question")
    current.add("user", "current question")
    store.save(older)
    store.save(current)
    store.remember(current.id)
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        assert app.chat.conversation.id == current.id
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConversationsScreen", what="the picker")
        options = app.screen.query_one("#conversations")
        assert options.highlighted == [i.id for i in app.screen.infos].index(current.id)
        await pilot.press("delete", "y")
        await pilot.pause()
        assert options.option_count == 1 and not store.path(current.id).exists()
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat and not app.chat.conversation.messages,
                       what="a new chat")
        assert [i.id for i in store.list()] == [older.id]
