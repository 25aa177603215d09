"""The start-up loading screen: progress from Engine.load's callback, one-line errors, retry, cancel."""
from __future__ import annotations

import threading
import time

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.screens.loading import LoadingScreen
from moedesk.engine.runtime import Engine
from tests.tui.helpers import chat_ready, wait_for

pytestmark = pytest.mark.anyio


def on_loading(app) -> bool:
    return isinstance(app.screen, LoadingScreen)


async def test_progress_then_chat(tiny_folder):
    halfway, go_on = threading.Event(), threading.Event()
    calls = []

    def factory(model, progress):
        progress("load", 0.5)
        halfway.set()
        go_on.wait(10)
        engine = Engine.load(model, device="cpu", dtype="float32",
                             progress=lambda stage, f: (calls.append((stage, f)), progress(stage, f)))
        return engine

    app = MoedeskApp(factory, model=str(tiny_folder))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: halfway.is_set() and on_loading(app), what="the load to start")
        screen = app.screen
        await wait_for(pilot, lambda: screen.query_one("ProgressBar").progress == 0.5, what="progress")
        assert str(screen.query_one(".load-stage").render()).startswith("Loading weights…")
        assert str(screen.query_one(".load-title").render()) == f"Loading {tiny_folder.name}"
        go_on.set()
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        assert calls and calls[-1] == ("load", 1.0)
        assert app.engine.name == str(tiny_folder) and app.chat.sub_title == tiny_folder.name
        assert [type(s).__name__ for s in app.screen_stack][1:] == ["ChatScreen"]


async def test_error_is_one_line_and_retry_works(tiny_folder):
    attempts = []

    def factory(model, progress):
        attempts.append(model)
        if len(attempts) == 1:
            raise RuntimeError("CUDA out of memory\nTried to allocate 20.00 GiB")
        return Engine.load(model, device="cpu", dtype="float32", progress=progress)

    app = MoedeskApp(factory, model=str(tiny_folder))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: on_loading(app) and str(app.screen.query_one(".load-error").render()),
                       what="the error")
        assert str(app.screen.query_one(".load-error").render()) == "RuntimeError: CUDA out of memory"
        await pilot.press("r")
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        assert len(attempts) == 2


async def test_engine_errors_are_shown_as_they_are(tmp_path):
    def factory(model, progress):
        return Engine.load(model, device="cpu", dtype="float32", progress=progress)

    folder = tmp_path / "empty-model"
    folder.mkdir()
    app = MoedeskApp(factory, model=str(folder))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: on_loading(app) and str(app.screen.query_one(".load-error").render()),
                       what="the error")
        assert str(app.screen.query_one(".load-error").render()) == f"{folder}: no config.json in this folder"


async def test_escape_cancels_a_load():
    def factory(model, progress):
        for _ in range(1000):  # a load that would take 10 s; progress raises once cancelled
            progress("load", 0.1)
            time.sleep(0.01)
        raise AssertionError("not cancelled")

    app = MoedeskApp(factory, model="huge-model")
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: on_loading(app) and app.screen.query_one("LoadPanel").busy, what="loading")
        await pilot.pause(0.1)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.screen.query_one("LoadPanel").busy, timeout=5, what="the cancel")
        assert str(app.screen.query_one(".load-error").render()) == "loading cancelled"
