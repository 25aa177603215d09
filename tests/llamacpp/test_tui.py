"""The chat app on the llama.cpp engine: a reply streams and equals the engine's own greedy reply, Esc stops one and
Ctrl+R regenerates it, the stats panel says which engine runs the model and why, load warnings are shown, and a MoE
model's heat map holds the picks llama.cpp made."""
from __future__ import annotations

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.screens.chat import ChatScreen
from moedesk.engine.requests import Request, SamplingParams
from tests.tui.conftest import tui_dirs  # noqa: F401 -- private data, config and cache folders for the app
from tests.tui.helpers import greedy_settings, hold_first_reply, wait_for, wait_idle
from tests.tui.test_chat import reference, say

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_a_reply_on_llama_cpp_streams_and_equals_the_engines_greedy_reply(demo_llama, monkeypatch):
    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)
    settings = greedy_settings(max_new_tokens=16)
    monkeypatch.setattr(demo_llama, "warnings", ["llama.cpp was built without CUDA and runs on the CPU only"])
    app = MoedeskApp(demo_llama, settings=settings)
    async with app.run_test(size=(120, 40)) as pilot:
        await say(pilot, "Hello there")
        await wait_idle(pilot, app)
        messages = [{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": "Hello there"}]
        expected = demo_llama.complete([Request(demo_llama.tokenizer.chat_prompt(messages),
                                                SamplingParams(max_new_tokens=16, temperature=0,
                                                               top_p=settings.top_p))])[0]
        reply = app.chat.conversation.messages[-1]
        assert reply.content == expected.text and len(app.chat.last_fragments) > 1
        summary = str(app.chat.stats.query_one("#stats-model").render())
        assert "llama.cpp engine, as asked" in summary
        assert any("without CUDA" in str(n.message) for n in app._notifications)


async def test_the_heat_map_shows_the_picks_llama_cpp_counted(tmp_path):
    """A MoE GGUF on llama.cpp: after a reply, the chat's heat map holds every pick the engine counted for it, and
    says they are estimates from a sample of the decode steps."""
    from moedesk.app.tui.widgets.heatmap import ExpertHeatMap
    from moedesk.engine.runtime import Engine
    from tests.gguf_from_hf import build

    built = build("qwen3moe", tmp_path / "q")
    engine = Engine.load(str(built.gguf), engine="llama.cpp", context_length=256)
    try:
        app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=6))
        async with app.run_test(size=(160, 50)) as pilot:
            await say(pilot, "Hi")
            await wait_idle(pilot, app)
            app.chat.refresh_map()
            heatmap = app.chat.query_one(ExpertHeatMap)
            shown = [[c.count for c in row] for row in heatmap.current_layout().rows]
            counted = engine.expert_map()[1]
            assert sum(map(sum, counted)) > 0 and sum(map(sum, shown)) == sum(map(sum, counted))
            every = engine.expert_stats()["count_every"]  # a sample: the legend says so
            assert any(f"1 decode step in {every}" in line for line in heatmap.render().plain.splitlines())
    finally:
        engine.close()


async def test_with_counting_off_the_heat_map_says_so_and_shows_no_picks(tmp_path):
    """The Count expert picks setting off, its default: the engine loads without the eval callback (no cost to
    decode), the map shows which layers' experts are where and no pick, and its legend says why."""
    from moedesk.app.tui.widgets.heatmap import ExpertHeatMap
    from tests.gguf_from_hf import build

    built = build("qwen3moe", tmp_path / "q")
    settings = greedy_settings(max_new_tokens=4, engine="llama.cpp")
    app = MoedeskApp(model=str(built.gguf), device="cpu", settings=settings, context_length=256)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None and app.chat is not None and app.chat.ready)
        try:
            assert app.engine.kind == "llama.cpp" and app.engine.llama.counter is None
            await say(pilot, "Hi")
            await wait_idle(pilot, app)
            app.chat.refresh_map()
            heatmap = app.chat.query_one(ExpertHeatMap)
            assert sum(c.count for row in heatmap.current_layout().rows for c in row) == 0
            lines = heatmap.render().plain.splitlines()
            assert "picks not counted: settings, Count expert picks" in lines
            assert not any("estimated" in line for line in lines)
        finally:
            app.engine.close()


async def test_escape_stops_a_reply_and_regenerate_gives_the_greedy_one(demo_llama, monkeypatch):
    monkeypatch.setattr(ChatScreen, "STREAM_INTERVAL_S", 0.0)
    monkeypatch.setattr(demo_llama, "stream", demo_llama.stream)  # undone after: the engine is the session's
    settings = greedy_settings(max_new_tokens=32)
    prompt = "Tell me about the sea"
    full = reference(demo_llama, settings, [{"role": "user", "content": prompt}])
    assert len(full.token_ids) > 8, "the demo must talk long enough to be interrupted"
    app = MoedeskApp(hold_first_reply(demo_llama), settings=settings)
    async with app.run_test(size=(120, 40)) as pilot:
        await say(pilot, prompt)
        await wait_for(pilot, lambda: app.chat.generation is not None and app.chat.generation.tokens > 0,
                       what="the first token")
        await pilot.press("escape")
        await wait_idle(pilot, app)
        stopped = app.chat.conversation.messages[-1]
        assert stopped.meta["finish_reason"] == "cancelled" and 0 < stopped.meta["tokens"] < len(full.token_ids)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.chat.generation is None and app.chat.conversation.messages[-1] is not stopped,
                       what="the regenerated reply")
        await pilot.pause()
        messages = app.chat.conversation.messages
        assert [m.role for m in messages] == ["user", "assistant"] and messages[-1].content == full.text
