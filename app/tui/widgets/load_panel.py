"""Loading a model in a thread worker, with a progress bar and a one-line error.

Used by the start-up loading screen and the models screen. The engine factory runs in a
thread; its progress callback posts (throttled) messages back to the UI, and raises
`LoadCancelled` once `cancel()` was called, which is how a load stops early (the engine's
load has no cancel switch of its own).
"""
from __future__ import annotations

import threading
import time

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import ProgressBar, Static

STAGE_WORDS = {"open": "Opening", "load": "Loading weights", "build": "Building the demo model", "done": "Ready"}


class LoadCancelled(Exception):
    pass


def one_line(error: BaseException) -> str:
    """What a person sees of an error: the engine's own one-line message, else type and first line."""
    from engine.errors import MoedeskError

    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(error, MoedeskError):
        return first or type(error).__name__
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def short_model_name(model: str) -> str:
    """The last part of a path; repo ids and 'demo' as they are."""
    if "/" in model or "\\" in model:
        from pathlib import Path

        p = Path(model)
        if p.is_absolute() or p.exists() or model.startswith((".", "~")):
            return p.name or model
    return model


class LoadPanel(Vertical):
    """Title, progress bar, stage, error. `start(model)` loads through `app.engine_factory`."""

    class Progress(Message):
        def __init__(self, stage: str, fraction: float):
            super().__init__()
            self.stage, self.fraction = stage, fraction

    class Loaded(Message):
        def __init__(self, model: str, engine):
            super().__init__()
            self.model, self.engine = model, engine

    class Failed(Message):
        def __init__(self, model: str, error: str):
            super().__init__()
            self.model, self.error = model, error

    PROGRESS_INTERVAL_S = 0.05

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes)
        self.model: str | None = None
        self.busy = False
        self._cancel = threading.Event()

    def compose(self) -> ComposeResult:
        yield Static("", classes="load-title", markup=False)
        yield ProgressBar(total=1.0, show_eta=False, id="load-bar")
        yield Static("", classes="load-stage", markup=False)
        yield Static("", classes="load-error", markup=False)

    def start(self, model: str, *, preflight=None, before_load=None) -> None:
        """Load `model` in a thread. `preflight(model)` runs first in the thread (raise to refuse
        quickly, before anything is released); `before_load()` then runs on the UI thread."""
        self.model = model
        self.busy = True
        self._cancel = threading.Event()
        self.query_one(".load-title", Static).update(f"Loading {short_model_name(model)}")
        self.query_one(".load-error", Static).update("")
        self.remove_class("-failed")
        self.add_class("-loading")
        self.query_one(ProgressBar).update(progress=0.0)
        self._show_stage("open", 0.0)
        self._load(model, self._cancel, preflight, before_load)

    def cancel(self) -> None:
        self._cancel.set()

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, model: str, cancel: threading.Event, preflight=None, before_load=None) -> None:
        last = 0.0

        def progress(stage: str, fraction: float) -> None:
            nonlocal last
            if cancel.is_set():
                raise LoadCancelled()
            now = time.monotonic()
            if now - last >= self.PROGRESS_INTERVAL_S or fraction >= 1.0:
                last = now
                self.post_message(self.Progress(stage, fraction))

        try:
            if preflight is not None:
                preflight(model)
            if before_load is not None:
                self.app.call_from_thread(before_load)
            engine = self.app.engine_factory(model, progress)
        except LoadCancelled:
            self.post_message(self.Failed(model, "loading cancelled"))
            return
        except BaseException as e:  # noqa: BLE001 - every failure becomes one line on screen
            self.post_message(self.Failed(model, one_line(e)))
            return
        if cancel.is_set():
            self.post_message(self.Failed(model, "loading cancelled"))
            return
        self.post_message(self.Loaded(model, engine))

    def _show_stage(self, stage: str, fraction: float) -> None:
        words = STAGE_WORDS.get(stage, stage.capitalize())
        self.query_one(".load-stage", Static).update(f"{words}…")

    def on_load_panel_progress(self, message: Progress) -> None:
        self.query_one(ProgressBar).update(progress=max(0.0, min(1.0, message.fraction)))
        self._show_stage(message.stage, message.fraction)

    def on_load_panel_loaded(self, message: Loaded) -> None:
        self.busy = False
        self.remove_class("-loading")
        self.query_one(ProgressBar).update(progress=1.0)
        self._show_stage("done", 1.0)

    def on_load_panel_failed(self, message: Failed) -> None:
        self.busy = False
        self.remove_class("-loading")
        self.add_class("-failed")
        self.query_one(".load-title", Static).update(f"Could not load {short_model_name(message.model)}")
        self.query_one(".load-stage", Static).update("")
        self.query_one(".load-error", Static).update(message.error)
