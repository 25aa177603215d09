"""Loading a model in a thread worker, with a progress bar, what is being done, and a one-line error.

Used by the start-up loading screen and the models screen. The engine factory runs in a
thread; its progress callback posts (throttled) messages back to the UI, and raises
`LoadCancelled` once `cancel()` was called, which is how a load stops early (the engine's
load has no cancel switch of its own).

The engine reports a stage when it is done with it ("profile" once profiling finished), so the
words shown are those of the stage that comes next. Some steps report nothing for a while
(building the demo model takes ~20 s without a call), so cancelling does not wait for the
thread: the panel says "cancelled" at once and ignores what that load reports later; the thread
itself stops at its next progress call.
"""
from __future__ import annotations

import threading
import time

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import ProgressBar, Static

STAGE_WORDS = {
    "open": "Opening the model files",
    "build": "Building the demo model (first run only, about 20 s)",
    "load": "Loading weights",
    "loaded": "Preparing the model",
    "profile": "Counting which experts the router picks on sample prompts (once per model)",
    "calibrate": "Placing the most picked experts on the GPU",
    "place": "Ready",
    "done": "Ready",
}


# With a GPU the experts are offloaded after the weights load, which measures the machine first.
GPU_STAGE_WORDS = {
    "loaded": "Preparing the model (with experts offloaded: measuring CPU, GPU and copy speed, once per machine)",
}


def stage_words(stage: str, gpu: bool) -> str:
    """What the screen says of a stage; the GPU's steps are not promised on a machine without one."""
    return (gpu and GPU_STAGE_WORDS.get(stage)) or STAGE_WORDS.get(stage) or stage.capitalize()


def stage_now(stage: str, fraction: float) -> str:
    """The step under way, from the engine's report of where it is: "load" at 1.0 means the weights are in."""
    if stage == "load" and fraction >= 1.0:
        return "loaded"
    return stage


def demo_needs_building() -> bool:
    """True before the demo model's first use: opening it builds it, which reports no progress."""
    try:
        from moedesk.engine.listing import demo_built

        return not demo_built()
    except Exception:  # noqa: BLE001 - only chooses the words shown
        return False


def _loads_on_gpu(app) -> bool:
    try:
        from moedesk.app.tui.load_target import load_target

        return load_target(app).gpu
    except Exception:  # noqa: BLE001 - only chooses the words shown
        return False


class LoadCancelled(Exception):
    pass


def one_line(error: BaseException) -> str:
    """What a person sees of an error: the engine's own one-line message, else type and first line."""
    from moedesk.engine.errors import MoedeskError

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
        def __init__(self, stage: str, fraction: float, attempt: int = 0):
            super().__init__()
            self.stage, self.fraction, self.attempt = stage, fraction, attempt

    class Loaded(Message):
        def __init__(self, model: str, engine, attempt: int = 0):
            super().__init__()
            self.model, self.engine, self.attempt = model, engine, attempt

    class Failed(Message):
        def __init__(self, model: str, error: str, attempt: int = 0):
            super().__init__()
            self.model, self.error, self.attempt = model, error, attempt

    PROGRESS_INTERVAL_S = 0.05

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes)
        self.model: str | None = None
        self.busy = False
        self.stage = ""
        self._cancel = threading.Event()
        self._attempt = 0  # messages of an earlier, cancelled load are dropped
        self._started = 0.0
        self._gpu = False  # whether this load goes to a GPU: only the words shown depend on it

    def compose(self) -> ComposeResult:
        yield Static("", classes="load-title", markup=False)
        yield ProgressBar(total=1.0, show_eta=False, id="load-bar")
        yield Static("", classes="load-stage", markup=False)
        yield Static("", classes="load-error", markup=False)

    def on_mount(self) -> None:
        self.set_interval(0.5, self._tick)

    def start(self, model: str, *, preflight=None, before_load=None) -> None:
        """Load `model` in a thread. `preflight(model)` runs first in the thread (raise to refuse
        quickly, before anything is released); `before_load()` then runs on the UI thread."""
        self.model = model
        self.busy = True
        self._cancel = threading.Event()
        self._attempt += 1
        self._started = time.monotonic()
        self._gpu = _loads_on_gpu(self.app)
        self.query_one(".load-title", Static).update(f"Loading {short_model_name(model)}")
        self.query_one(".load-error", Static).update("")
        self.remove_class("-failed", "-cancelled")
        self.add_class("-loading")
        # No fraction until the weights load: the bar moves back and forth so that it does not look stuck at 0%.
        self.query_one(ProgressBar).update(total=None, progress=0.0)
        self._show_stage("build" if model == "demo" and demo_needs_building() else "open")
        self._load(model, self._cancel, self._attempt, preflight, before_load)

    def cancel(self) -> None:
        """Stop loading now, as far as the person can tell: the thread stops at its next progress call."""
        self._cancel.set()
        if self.busy:
            self.post_message(self.Failed(self.model or "", "loading cancelled", self._attempt))

    @work(thread=True, group="load", exit_on_error=False)
    def _load(self, model: str, cancel: threading.Event, attempt: int, preflight=None, before_load=None) -> None:
        last = 0.0

        def progress(stage: str, fraction: float) -> None:
            nonlocal last
            if cancel.is_set():
                raise LoadCancelled()
            now = time.monotonic()
            if now - last >= self.PROGRESS_INTERVAL_S or fraction >= 1.0:
                last = now
                self.post_message(self.Progress(stage, fraction, attempt))

        try:
            if preflight is not None:
                preflight(model)
            if cancel.is_set():
                raise LoadCancelled()
            if before_load is not None:
                self.app.call_from_thread(before_load)
            engine = self.app.engine_factory(model, progress)
        except LoadCancelled:
            return  # cancel() has said so already
        except BaseException as e:  # noqa: BLE001 - every failure becomes one line on screen
            self.post_message(self.Failed(model, one_line(e), attempt))
            return
        if cancel.is_set():
            return  # finished after the person gave up on it; the engine is dropped
        self.post_message(self.Loaded(model, engine, attempt))

    def _show_stage(self, stage: str) -> None:
        self.stage = stage
        self._tick()

    def _tick(self) -> None:
        """The stage's words and the seconds so far, so that a long step still shows the app is alive."""
        if not self.busy:
            return
        words = stage_words(self.stage, self._gpu)
        seconds = int(time.monotonic() - self._started)
        self.query_one(".load-stage", Static).update(f"{words}… {seconds} s · Esc cancels")

    def on_load_panel_progress(self, message: Progress) -> None:
        if message.attempt != self._attempt or not self.busy:
            return
        bar = self.query_one(ProgressBar)
        if message.stage == "load":
            bar.update(total=1.0, progress=max(0.0, min(1.0, message.fraction)))
        self._show_stage(stage_now(message.stage, message.fraction))

    def on_load_panel_loaded(self, message: Loaded) -> None:
        if message.attempt != self._attempt:
            message.stop()  # a cancelled load that finished anyway: not for the screens either
            return
        self.busy = False
        self.remove_class("-loading")
        self.query_one(ProgressBar).update(total=1.0, progress=1.0)
        self.query_one(".load-stage", Static).update(f"{STAGE_WORDS['done']}.")

    def on_load_panel_failed(self, message: Failed) -> None:
        if message.attempt != self._attempt or not self.busy:
            message.stop()
            return
        self.busy = False
        cancelled = message.error == "loading cancelled"
        self.remove_class("-loading")
        self.add_class("-cancelled" if cancelled else "-failed")
        title = "Loading cancelled:" if cancelled else "Could not load"
        self.query_one(".load-title", Static).update(f"{title} {short_model_name(message.model)}")
        self.query_one(".load-stage", Static).update("")
        self.query_one(".load-error", Static).update(message.error)
