"""The chat app, headless, on the demo: one 48-token reply's tok/s over its wall time (the CPU threads probe).

Run from the checkout: `PROBE=label python3 tests/perf/chat_reply_speed.py`; tests/perf/cpu_share_matrix.sh runs it.
"""
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moedesk.app.tui import MoedeskApp  # noqa: E402
from moedesk.engine.runtime import Engine  # noqa: E402
from tests.tui.helpers import chat_ready, greedy_settings, wait_for  # noqa: E402


async def main():
    # A fresh data and settings folder: the app reopens the last conversation, whose history would lengthen each
    # run's prompt.
    scratch = tempfile.mkdtemp(prefix="moedesk-probe-")
    os.environ["MOEDESK_DATA_DIR"], os.environ["MOEDESK_CONFIG_DIR"] = f"{scratch}/data", f"{scratch}/config"
    engine = Engine.load("demo", device="cpu")
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=48, system_prompt=""))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(pilot.app), 60, "the chat")
        await pilot.click("#prompt")
        await pilot.press(*"Write a long story about the sea.")
        start = time.perf_counter()
        await pilot.press("enter")
        # Polled without Pilot.pause, which posts a callback to every widget each time: at a pause every 20 ms that
        # took a core of its own, which the app alone does not.
        while app.chat.generation is None and time.perf_counter() - start < 5:
            await asyncio.sleep(0.05)
        while app.chat.generation is not None:
            await asyncio.sleep(0.05)
        took = time.perf_counter() - start
        meta = app.chat.conversation.messages[-1].meta
        print(f"{os.environ.get('PROBE', '-'):<28} tokens {meta['tokens']} in {took:.1f}s: "
              f"{meta['tokens'] / took:.2f} tok/s (stats {meta.get('stats', {}).get('decode_tok_s')}, "
              f"first token {meta.get('stats', {}).get('ttft_s')} s)")


asyncio.run(main())
