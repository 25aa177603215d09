"""The chat app on the llama.cpp engine: a reply streams and equals the engine's own greedy reply, Esc stops one,
the stats panel says which engine runs the model and why, and load warnings are shown."""
from __future__ import annotations

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.screens.chat import ChatScreen
from moedesk.engine.requests import Request, SamplingParams
from tests.tui.conftest import tui_dirs  # noqa: F401 -- private data, config and cache folders for the app
from tests.tui.helpers import greedy_settings, wait_idle
from tests.tui.test_chat import say

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
