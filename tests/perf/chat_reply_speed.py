"""The chat app, headless, on the demo: one 48-token reply's tok/s over its wall time (the CPU threads probe).

Run from the checkout: `PROBE=label python3 tests/perf/chat_reply_speed.py`; tests/perf/cpu_share_matrix.sh runs it.
"""
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moedesk.app.tui import MoedeskApp  # noqa: E402
from moedesk.engine.runtime import Engine  # noqa: E402
from tests.tui.helpers import chat_ready, greedy_settings, wait_for, wait_idle  # noqa: E402


async def main():
    engine = Engine.load("demo", device="cpu")
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=48, system_prompt=""))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(pilot.app), 60, "the chat")
        await pilot.click("#prompt")
        await pilot.press(*"Write a long story about the sea.")
        start = time.perf_counter()
        await pilot.press("enter")
        await wait_idle(pilot, app, timeout=600)
        took = time.perf_counter() - start
        meta = app.chat.conversation.messages[-1].meta
        print(f"{os.environ.get('PROBE', '-'):<28} tokens {meta['tokens']} in {took:.1f}s: "
              f"{meta['tokens'] / took:.2f} tok/s (stats {meta.get('stats', {}).get('decode_tok_s')})")


asyncio.run(main())
