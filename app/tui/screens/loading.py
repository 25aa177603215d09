"""The first screen: the model loads in a worker while a progress bar moves; errors stay on screen."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from app.tui.widgets.load_panel import LoadPanel

LOGO = "[b]moedesk[/b]\n[dim]Mixture-of-Experts models on one PC[/dim]"


class LoadingScreen(Screen):
    BINDINGS = [
        Binding("r", "retry", "Retry"),
        Binding("f3", "app.models", "Models"),
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
        self.query_one("#loading-hint", Static).update(
            "[dim]r[/] try again  ·  [dim]F3[/] choose another model  ·  [dim]ctrl+q[/] quit")
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        loading = self.panel.busy if self.is_mounted else True
        if action == "retry":
            return None if loading else True
        if action == "cancel":
            return True if loading else None
        return True

    def action_retry(self) -> None:
        if not self.panel.busy:
            self.query_one("#loading-hint", Static).update("")
            self.panel.start(self.model)
            self.refresh_bindings()

    def action_cancel(self) -> None:
        self.panel.cancel()
