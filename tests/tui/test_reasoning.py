"""A thinking model's reasoning shows folded above its answer, and only the answer goes into the conversation."""
from __future__ import annotations

import pytest
from textual.widgets import Collapsible, Static

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.widgets.messages import AssistantMessage, visible
from moedesk.engine.requests import Completion, StreamChunk
from moedesk.engine.runtime import Engine
from tests import tiny_models
from tests.tui.helpers import chat_ready, greedy_settings, wait_for, wait_idle
from tests.tui.test_chat import SIZE, reference, say

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def thinking_folder(tmp_path_factory):
    return tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("thinking"), chat_template=tiny_models.TOOLS_TEMPLATE)


def reasoning_of(widget: AssistantMessage) -> tuple[Collapsible, str]:
    fold = widget.query_one(".reasoning", Collapsible)
    return fold, str(widget.query_one(".reasoning-text", Static).render())


async def test_a_reply_inside_an_open_think_block_is_all_reasoning(thinking_folder):
    engine = Engine.load(str(thinking_folder), device="cpu", dtype="float32")
    settings = greedy_settings(max_new_tokens=12)
    app = MoedeskApp(engine, settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "Why?")
        await wait_idle(pilot, app)
        reply = app.chat.conversation.messages[-1]
        expected = reference(engine, settings, [{"role": "user", "content": "Why?"}]).text.strip()
        widget = app.chat.query(AssistantMessage).last()
        fold, shown = reasoning_of(widget)
        assert reply.content == "" and reply.meta["reasoning"] == expected and expected
        assert fold.display and fold.collapsed and shown == visible(expected)
        assert widget.markdown.source == ""


async def test_reasoning_then_answer_stream_apart_and_the_fold_opens(thinking_folder, monkeypatch):
    from moedesk.app.tui.screens.chat import ChatScreen

    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)
    engine = Engine.load(str(thinking_folder), device="cpu", dtype="float32")
    # The template opened <think>: the model's text is reasoning until </think>, the answer after it.
    pieces = ["Two ", "and two", ".\n</thi", "nk>\n\n", "It is ", "**4**."]

    def stream(prompt_ids, params, cancel=None, **kwargs):
        for i, piece in enumerate(pieces):
            yield StreamChunk(piece, [i])
        yield StreamChunk("", [], Completion(None, list(range(len(pieces))), "".join(pieces), "stop", len(prompt_ids)))

    engine.stream = stream
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "2+2?")
        await wait_idle(pilot, app)
        reply = app.chat.conversation.messages[-1]
        assert reply.content == "It is **4**." and reply.meta["reasoning"] == "Two and two."
        assert "".join(app.chat.last_fragments) == "It is **4**."  # no tag piece ever reached the answer
        widget = app.chat.query(AssistantMessage).last()
        fold, shown = reasoning_of(widget)
        assert widget.markdown.source == "It is **4**." and shown == "Two and two." and fold.collapsed
        await pilot.click(fold.query_one("CollapsibleTitle"))
        await wait_for(pilot, lambda: not fold.collapsed, what="the fold to open")

    # Restored from disk, the reply keeps its reasoning folded above it.
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        fold, shown = reasoning_of(app.chat.query(AssistantMessage).last())
        assert fold.display and fold.collapsed and shown == "Two and two."


@pytest.fixture(scope="module")
def harmony_folder(tmp_path_factory):
    from tests.app.test_server_harmony import HARMONY_TOKENS, RETURN

    return tiny_models.build("gpt_oss", tmp_path_factory.mktemp("oss"), chat_template=None,
                             special_tokens=HARMONY_TOKENS, eos_token="<|return|>", eos_token_id=[RETURN])


async def test_harmonys_analysis_channel_is_the_folded_reasoning(harmony_folder, monkeypatch):
    from moedesk.app.tui.screens.chat import ChatScreen
    from tests.app.test_server_harmony import ANSWERED

    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)
    engine = Engine.load(str(harmony_folder), device="cpu", dtype="float32")
    ids = engine.tokenizer.encode(ANSWERED, add_special_tokens=False)  # its channels are special tokens

    def stream(prompt_ids, params, cancel=None, **kwargs):
        for i in ids:
            yield StreamChunk(engine.tokenizer.decode([i]), [i])  # the text a stream shows leaves specials out
        yield StreamChunk("", [], Completion(None, ids, engine.tokenizer.decode(ids), "stop", len(prompt_ids)))

    engine.stream = stream
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=SIZE) as pilot:
        await say(pilot, "Weather?")
        await wait_idle(pilot, app)
        reply = app.chat.conversation.messages[-1]
        assert reply.content == "Sunny, 21 C." and reply.meta["reasoning"] == "The user wants weather."
        assert "".join(app.chat.last_fragments) == "Sunny, 21 C."  # no channel marker reached the answer
        fold, shown = reasoning_of(app.chat.query(AssistantMessage).last())
        assert shown == "The user wants weather." and fold.collapsed


async def test_the_reasoning_effort_setting_reaches_the_chat_template(harmony_folder):
    engine = Engine.load(str(harmony_folder), device="cpu", dtype="float32")  # no template: harmony's, which reads it
    prompts = []

    def stream(prompt_ids, params, cancel=None, **kwargs):
        prompts.append(list(prompt_ids))
        yield StreamChunk("", [], Completion(None, [], "", "stop", len(prompt_ids)))

    engine.stream = stream
    for effort in ("high", "auto"):
        settings = greedy_settings(reasoning_effort=effort)
        app = MoedeskApp(engine, settings=settings)
        async with app.run_test(size=SIZE) as pilot:
            await say(pilot, "Why?")
            await wait_idle(pilot, app)
            asked = [{"role": m.role, "content": m.content} for m in app.chat.conversation.messages[:-1]]
        turns = [{"role": "system", "content": settings.system_prompt}, *asked]  # the conversation goes on
        text = engine.tokenizer.render_chat(turns, **({} if effort == "auto" else {"reasoning_effort": effort}))
        assert f"Reasoning: {'medium' if effort == 'auto' else effort}\n" in text
        assert prompts[-1] == engine.tokenizer.encode(text, add_special_tokens=False)
