"""Screenshots of the chat and the stats panel, compared with the accepted SVGs in __snapshots__/.

Deterministic by construction: a saved conversation with fixed numbers (no timings measured
now), the real engine renamed to a fixed name, a fixed expert map (with some experts marked
as on the GPU, which this CPU-only machine cannot show otherwise), and a cursor that does not
blink. Update after an intended change with `pytest tests/tui --snapshot-update` and look at
the report before committing the new SVGs.
"""
from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot", reason="snapshot tests need pytest-textual-snapshot")

from moedesk.app.tui import MoedeskApp  # noqa: E402
from moedesk.app.tui.settings import Settings  # noqa: E402
from moedesk.app.tui.storage import Conversation, ConversationStore  # noqa: E402
from moedesk.engine.runtime import Engine  # noqa: E402
from tests.tui.helpers import chat_ready, wait_for  # noqa: E402

REPLY = """Experts are small feed-forward networks; a **router** picks a few of them for every token.

## Why it helps

- only the picked experts run, so a token costs a fraction of the model
- the popular experts can live on the GPU, the rest in RAM

```python
top_k = router(x).topk(2)
```
"""

SIZES = [(80, 24), (160, 50)]


def fixed_conversation() -> Conversation:
    c = Conversation(id="20260101-120000-abcdef")
    c.add("user", "What is a mixture of experts?")
    c.add("assistant", "A model made of many small experts.", finish_reason="stop", tokens=9, prompt_tokens=31,
          stats={"ttft_s": 0.21, "decode_tok_s": 24.5, "total_s": 0.58}, model="tiny-qwen3-moe")
    c.add("user", "Explain it with a list, please.")
    c.add("assistant", REPLY, finish_reason="length", tokens=64, prompt_tokens=52,
          stats={"ttft_s": 0.12, "decode_tok_s": 31.5, "total_s": 2.16}, model="tiny-qwen3-moe")
    return c


def fixed_map(engine):
    """Every kind of cell: on the GPU and in RAM, each popularity level, and experts never picked."""
    cfg = engine.config
    on_gpu = [[e in (layer, 5) for e in range(cfg.num_experts)] for layer in range(cfg.num_layers)]
    popularity = [[(0 if (layer + e) % 5 == 4 else 1 + (3 * layer + 7 * e) % 10) for e in range(cfg.num_experts)]
                  for layer in range(cfg.num_layers)]
    return on_gpu, popularity


@pytest.fixture
def snapshot_app(tiny_folder):
    engine = Engine.load(str(tiny_folder), device="cpu", dtype="float32")
    engine.name = "tiny-qwen3-moe"  # not the temporary folder's name
    store = ConversationStore()
    conversation = fixed_conversation()
    store.save(conversation)
    store.remember(conversation.id)
    return MoedeskApp(engine, settings=Settings()), engine


def settle(engine, maximize_stats: bool):
    async def run_before(pilot):
        app = pilot.app
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        app.chat.query_one("#prompt").cursor_blink = False
        app.chat.stats.update_map(*fixed_map(engine))
        if maximize_stats:
            await pilot.press("f4")
        await pilot.pause()
    return run_before


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_chat_snapshot(snap_compare, snapshot_app, size):
    app, engine = snapshot_app
    assert snap_compare(app, terminal_size=size, run_before=settle(engine, maximize_stats=False))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_stats_snapshot(snap_compare, snapshot_app, size):
    app, engine = snapshot_app
    assert snap_compare(app, terminal_size=size, run_before=settle(engine, maximize_stats=True))
