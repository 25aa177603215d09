"""`MoedeskApp`: holds the engine, the settings and the conversation store; screens do the rest.

The app starts on the loading screen (the engine loads in a thread worker) unless it was given
an engine already, then lives on the chat screen; settings and models are pushed on top.
"""
from __future__ import annotations

import dataclasses
import gc
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from moedesk.app.tui.screens.chat import ChatScreen
from moedesk.app.tui.screens.loading import LoadingScreen
from moedesk.app.tui.settings import Settings, load_settings
from moedesk.app.tui.storage import ConversationStore

ProgressFn = Callable[[str, float], None]
EngineFactory = Callable[[str, ProgressFn], Any]  # (model, progress) -> Engine


def stylesheet_path() -> str:
    return str(Path(str(resources.files("moedesk.assets").joinpath("moedesk.tcss"))))


def default_factory(device: str = "auto", context_length: int | None = None, options=dict) -> EngineFactory:
    """Engine.load with a fixed device and context; the model and progress callback vary.

    options() gives the other Engine.load options (GPU budget, dtype) and is asked at each load, so
    settings changed in the app apply to the next model loaded.
    """

    def load(model: str, progress: ProgressFn):
        from moedesk.engine.runtime import Engine

        return Engine.load(model, device=device, context_length=context_length, progress=progress, **options())

    return load


def _is_engine(value) -> bool:
    return hasattr(value, "stream") and hasattr(value, "expert_map")


class MoedeskApp(App[int]):
    """The moedesk terminal app.

    `engine` is an Engine that is loaded already, or an engine factory `(model, progress) -> Engine`
    (the models screen loads others through it), or None for `Engine.load` with `device`/`dtype`.
    """

    CSS_PATH = stylesheet_path()
    TITLE = "moedesk"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, engine=None, *, model: str = "demo", device: str = "auto", dtype: str | None = None,
                 settings: Settings | None = None, store: ConversationStore | None = None,
                 gpu_budget: float | None = None, context_length: int | None = None, reprofile: bool = False,
                 expert_dtype: str | None = None, decoding: dict | None = None, engine_kind: str | None = None,
                 url: str | None = None, api_key: str | None = None):
        """gpu_budget (GiB), dtype and expert_dtype override the settings of the same meaning for this run (the
        --gpu-budget, --dtype and --expert-dtype flags); context_length and reprofile (--context, --reprofile)
        apply to every model this run loads. decoding: settings of how replies are decoded (speculative, draft,
        draft_length, draft_width, beams, length_penalty) that this run's flags set over the saved ones. url and
        api_key: the remote engine's server and key (--url, --api-key) over the settings'."""
        super().__init__()
        self.decoding_flags = {k: v for k, v in (decoding or {}).items() if v is not None}
        flags = {"gpu_budget": gpu_budget, "dtype": dtype, "reprofile": reprofile or None, "expert_dtype": expert_dtype,
                 "engine": engine_kind, "url": url, "api_key": api_key}

        def load_options() -> dict:
            return {**self.settings.load_options(), **{k: v for k, v in flags.items() if v is not None}}

        self.load_options = load_options  # what the next load gets: the models screen's memory estimate follows it
        # The same, for what load_options leaves out: the device and context every load of this run is asked for
        self.load_device = engine.device.type if _is_engine(engine) and hasattr(engine, "device") else device
        self.context_length = context_length

        if engine is not None and _is_engine(engine):
            self.engine = engine
            # Later loads keep its device; its dtype is not carried over, or the dtype setting could never apply.
            self.engine_factory: EngineFactory = default_factory(
                engine.device.type if hasattr(engine, "device") else device, context_length, load_options)
            self.model = engine.name
        else:
            self.engine = None
            self.engine_factory = (engine if engine is not None
                                   else default_factory(device, context_length, load_options))
            self.model = model
        self.settings_problems: list[str] = []
        self.settings = settings if settings is not None else load_settings(problems=self.settings_problems)
        self.store = store if store is not None else ConversationStore()
        self.chat: ChatScreen | None = None

    def on_mount(self) -> None:
        for problem in self.settings_problems:
            self.notify(problem, title="settings", severity="warning", timeout=8)
        if self.engine is not None:
            self.engine_ready(self.engine)
        else:
            self.push_screen(LoadingScreen(self.model))

    def reply_settings(self) -> Settings:
        """The settings a reply is written with: the saved ones, with this run's decoding flags over them."""
        return dataclasses.replace(self.settings, **self.decoding_flags) if self.decoding_flags else self.settings

    # -------------------------------------------------------------- the engine

    def engine_ready(self, engine) -> None:
        """A loaded engine: open the chat, or tell the open chat about the new model."""
        if engine is None:  # a models screen left without loading
            if self.chat is not None:
                self.chat.engine_changed()
            return
        self.engine = engine
        self.model = engine.name
        for warning in engine.warnings:  # what went less well than asked at load, e.g. llama.cpp without CUDA
            self.notify(warning, title="model", severity="warning", timeout=15)
        if self.chat is None:
            self.chat = ChatScreen()
            if isinstance(self.screen, LoadingScreen):
                self.switch_screen(self.chat)
            else:
                self.push_screen(self.chat)
        else:
            self.chat.engine_changed()

    def open_chat_without_model(self) -> None:
        """The chat with no model (after a failed load): old conversations can be read, F3 loads one."""
        if self.chat is not None:
            return
        self.chat = ChatScreen()
        if isinstance(self.screen, LoadingScreen):
            self.switch_screen(self.chat)
        else:
            self.push_screen(self.chat)

    def release_engine(self) -> None:
        """Drop the loaded model (before loading another): stop any reply, free its memory."""
        if self.chat is not None:
            self.chat.stop_generation()
        self.engine = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - freeing is best effort
            pass
        if self.chat is not None:
            self.chat.engine_changed()

    # -------------------------------------------------------------- screens

    def action_settings(self) -> None:
        from moedesk.app.tui.screens.settings import SettingsScreen

        from moedesk.app.tui.speculation_outlook import speculation_note

        notes = {"speculative": speculation_note(self.engine, self.reply_settings().draft_length)}
        self.push_screen(SettingsScreen(self.settings, model_defaults=getattr(self.engine, "generation_defaults", None),
                                        notes=notes), self._settings_closed)

    def _settings_closed(self, settings: Settings | None) -> None:
        if settings is not None:
            self.settings = settings
            overridden = sorted(k for k in self.decoding_flags if getattr(settings, k) != self.decoding_flags[k])
            self.notify("Settings saved." + (f" This run's flags still decide {', '.join(overridden)}."
                                             if overridden else ""))
            if self.chat is not None:
                self.chat.show_decoding()

    def action_models(self) -> None:
        from moedesk.app.tui.screens.models import ModelsScreen

        if isinstance(self.screen, ModelsScreen):
            return
        self.push_screen(ModelsScreen(current=self.model if self.engine is not None else None), self.engine_ready)

    def action_download(self, repo_id: str = "") -> None:
        """The download wizard, over the models screen: that is where a finished download is loaded."""
        from moedesk.app.tui.screens.download import DownloadScreen
        from moedesk.app.tui.screens.models import ModelsScreen

        if isinstance(self.screen, DownloadScreen):
            return
        self.action_models()
        if isinstance(self.screen, ModelsScreen):
            self.screen.action_download(repo_id)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Settings", "Sampling, system prompt, GPU budget (F2)", self.action_settings)
        yield SystemCommand("Models", "List local models and load one (F3)", self.action_models)
        yield SystemCommand("Download a model", "From the Hugging Face Hub into its cache (F3, then F6)",
                            self.action_download)
        if self.chat is not None and screen is self.chat:
            chat = self.chat
            yield SystemCommand("New chat", "Start an empty conversation (ctrl+n)", chat.action_new_chat)
            yield SystemCommand("Conversations", "Open an older conversation (ctrl+o)", chat.action_conversations)
            yield SystemCommand("Regenerate", "Write the last reply again (ctrl+r)", chat.action_regenerate)
            yield SystemCommand("Copy the last reply", "To the clipboard (ctrl+y)", chat.action_copy_reply)
            yield SystemCommand("Copy the last code block", "Only the code, without the ``` fence",
                                chat.action_copy_code)
            yield SystemCommand("Rename this chat", "Give the conversation another title", chat.action_rename)
            yield SystemCommand("Export this chat", "Write it to a Markdown file", chat.action_export)
            yield SystemCommand("Delete this chat", "Remove the conversation (asks first)", chat.action_delete_chat)
            yield SystemCommand("Toggle stats", "Show or hide the stats panel (ctrl+t)", chat.action_toggle_stats)

    async def action_quit(self) -> None:
        if self.chat is not None:
            self.chat.keep_reply_so_far()
            self.chat.save_draft()
        self.store.close()  # at once: another window may take this conversation over while this one closes
        for screen in self.screen_stack:
            for panel in screen.query("LoadPanel"):
                panel.cancel()
        self.exit(0)


def run_app(model: str = "demo", device: str = "auto", dtype: str | None = None, gpu_budget: float | None = None,
            context_length: int | None = None, reprofile: bool = False, expert_dtype: str | None = None,
            decoding: dict | None = None, engine: str | None = None, url: str | None = None,
            api_key: str | None = None) -> int:
    """Run the terminal app until the user quits; returns the exit status."""
    app = MoedeskApp(model=model, device=device, dtype=dtype, gpu_budget=gpu_budget, context_length=context_length,
                     reprofile=reprofile, expert_dtype=expert_dtype, decoding=decoding, engine_kind=engine,
                     url=url, api_key=api_key)
    app.run()
    return app.return_code or 0
