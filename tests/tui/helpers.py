"""Helpers for driving the app in tests."""
from __future__ import annotations

import html
import re
import time


def greedy_settings(**changes):
    from moedesk.app.tui.settings import Settings

    values = dict(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=24, system_prompt="Be brief.")
    values.update(changes)
    return Settings(**values)


async def wait_for(pilot, condition, timeout: float = 20.0, what: str = "condition"):
    """Let the app run until condition() holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)
    await pilot.pause()  # let what the change queued run (Textual queues header title updates on the app)


async def open_settings(pilot):
    """F2, then the settings screen once it shows."""
    await pilot.press("f2")
    await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "SettingsScreen", what="settings")
    return pilot.app.screen


async def apply_setting(pilot, name: str, value) -> None:
    """F2, setting `name` (its field #setting-NAME) to `value`, ctrl+s, and back on the screen it was opened from."""
    back = pilot.app.screen
    await open_settings(pilot)
    pilot.app.screen.query_one(f"#setting-{name}").value = value
    await pilot.pause()
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: pilot.app.screen is back, what=f"the screen again after {name} {value}")


async def open_models(pilot):
    """F3, then the models screen once it lists what it found."""
    await pilot.press("f3")
    await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "ModelsScreen" and pilot.app.screen.models,
                   what="the list")
    return pilot.app.screen


async def wait_idle(pilot, app, timeout: float = 20.0):
    """Until the chat has no reply running, then one more pause so the UI settles."""
    await wait_for(pilot, lambda: app.chat is not None and app.chat.generation is None, timeout, "the reply")
    await pilot.pause()


def hold_first_reply(engine):
    """Make the engine's first reply wait after its first piece of text until it is cancelled, so a test can
    act while a reply is running however fast the machine is (a per-token delay raced Pilot's key presses)."""
    real_stream = engine.stream
    calls = 0

    def stream(*args, cancel=None, **kwargs):
        nonlocal calls
        calls += 1
        held = calls == 1 and cancel is not None
        for chunk in real_stream(*args, cancel=cancel, **kwargs):
            yield chunk
            if held and chunk.text:
                cancel.wait(timeout=30)  # bounded, so a failing test cannot leave the worker thread hanging
                held = False

    engine.stream = stream
    return engine


def chat_ready(app) -> bool:
    """The chat screen is the one showing and has put the saved conversation on screen."""
    return app.chat is not None and app.screen is app.chat and app.chat.ready


def screen_lines(app) -> list[str]:
    """The exported screenshot's text, a string per screen row. Textual writes each run of text as a <text> at its
    row's y and its first column's x (runs of plain spaces are left out: gaps), textLength wide."""
    runs = [(float(x), float(y), float(length), html.unescape(text).replace("\xa0", " "))
            for x, y, length, text in re.findall(
                r'<text[^>]*? x="([\d.]+)" y="([\d.]+)" textLength="([\d.]+)"[^>]*>(.*?)</text>',
                app.export_screenshot())]
    cell = next(length / len(text) for _, _, length, text in runs if text)
    rows: dict[float, list[str]] = {}
    for x, y, _, text in runs:
        row, col = rows.setdefault(y, []), round(x / cell)
        row.extend(" " * (col + len(text) - len(row)))
        row[col:col + len(text)] = text
    return ["".join(row).rstrip() for _, row in sorted(rows.items())]
