"""The first screen: the model loads in a worker while a progress bar moves; errors stay on screen."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from moedesk.app.tui.widgets.load_panel import LoadPanel

LOGO = "[b]moedesk[/b]\n[dim]Mixture-of-Experts models on one PC[/dim]"


class LoadingScreen(Screen):
    BINDINGS = [
        Binding("r", "retry", "Retry"),
        Binding("f3", "app.models", "Models"),
        Binding("f6", "download", "Download"),
        Binding("ctrl+o", "read_chats", "Old chats"),
        Binding("escape", "cancel", "Cancel loading"),
    ]

    def __init__(self, model: str):
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        yield Header()
        with Middle():
            with Center():
                yield Static(LOGO, id="logo")
            with Center():
                yield LoadPanel(id="startup-load")
            with Center():
                yield Static("", id="loading-hint")
        yield Footer()

    @property
    def panel(self) -> LoadPanel:
        return self.query_one(LoadPanel)

    def on_mount(self) -> None:
        self.panel.start(self.model)

    def on_load_panel_loaded(self, message: LoadPanel.Loaded) -> None:
        self.app.engine_ready(message.engine)

    def on_load_panel_failed(self, message: LoadPanel.Failed) -> None:
        # The engine's message names the command line (`moedesk download ...`); here the wizard does it.
        download = "[b]F6[/] download it here" if self._repo_id() else "[b]F6[/] download one"
        self.query_one("#loading-hint", Static).update(
            f"[b]r[/] try again  ·  [b]F3[/] another model  ·  {download}\n"
            "[b]ctrl+o[/] read old chats without a model  ·  [b]ctrl+q[/] quit")
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # Hidden, not dimmed, when it cannot act: a footer offering "Esc cancel loading" after the load
        # had failed read as a promise that did nothing.
        loading = self.panel.busy if self.is_mounted else True
        if action in ("retry", "read_chats", "download"):
            return not loading
        if action == "cancel":
            return loading
        return True

    def action_retry(self) -> None:
        if not self.panel.busy:
            self.query_one("#loading-hint", Static).update("")
            self.panel.start(self.model)
            self.refresh_bindings()

    def action_cancel(self) -> None:
        self.panel.cancel()

    def _repo_id(self) -> str:
        """The model asked for, when it reads as a Hub repo id (not a path, not the demo)."""
        from pathlib import Path

        from moedesk.app.tui.screens.download import repo_id_problem

        model = self.model
        if model == "demo" or "/" not in model or Path(model).expanduser().exists() or repo_id_problem(model):
            return ""
        return model

    def action_download(self) -> None:
        self.app.action_download(self._repo_id())

    def action_read_chats(self) -> None:
        if not self.panel.busy:
            self.app.open_chat_without_model()
