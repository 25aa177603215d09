"""Small modal questions: yes or no (`ConfirmScreen`), and one line of text (`AskScreen`)."""
from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static


class ConfirmScreen(ModalScreen[bool]):
    """Dismisses with True for yes (y, or the yes button), False for no (n, Esc)."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", show=False),
        Binding("n,escape", "answer(False)", "No", show=False),
    ]

    def __init__(self, question: str, yes: str = "Yes", no: str = "No"):
        super().__init__(classes="dialog")
        self.question, self.yes, self.no = question, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Static(self.question, classes="dialog-question", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="dialog-yes", compact=True)
                yield Button(f"{self.no} (n)", id="dialog-no", compact=True)

    def on_mount(self) -> None:
        # No stays the default for Enter: a stray Enter must not delete anything.
        self.query_one("#dialog-no", Button).focus()

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "dialog-yes")


class AskScreen(ModalScreen[str | None]):
    """One line of text: Enter dismisses with it (stripped; empty is refused), Esc with None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", show=False)]

    def __init__(self, title: str, value: str = "", hint: str = ""):
        super().__init__(classes="dialog")
        self.title_text, self.value, self.hint = title, value, hint

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.title_text, classes="dialog-question")
            yield Input(self.value, id="dialog-input")
            yield Static(self.hint or "Enter confirms · Esc cancels", classes="hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if value:
            self.dismiss(value)
