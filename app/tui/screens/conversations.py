"""Pick an older conversation (Enter) or delete one (Delete, after a yes). Dismisses with the chosen id or None.

A conversation another window has open is marked (it opens read-only here); the marks follow the other
windows, read from their locks every `WATCH_S` seconds.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Label, OptionList
from textual.widgets.option_list import Option

from moedesk.app.tui.storage import ConversationInfo, ConversationStore


ELSEWHERE = "open in another window"


def option_text(info: ConversationInfo, current: bool, elsewhere: bool = False) -> Text:
    text = Text("● " if current else "  ", style="green")
    text.append(info.title, style="bold")
    if elsewhere:
        text.append(f"  ({ELSEWHERE})", style="yellow")
    when = info.updated[:16].replace("T", " ")
    # turns counts the user's messages: each is one exchange (a question and its reply), not one message
    text.append(f"\n  {when} · {info.turns} exchange{'s' if info.turns != 1 else ''}", style="dim")
    if info.model:
        text.append(f" · {info.model.rstrip('/').rsplit('/', 1)[-1]}", style="dim")
    return text


class ConversationsScreen(ModalScreen[str | None]):
    WATCH_S = 1.0
    BINDINGS = [
        Binding("escape", "dismiss(None)", "Back"),
        Binding("delete,ctrl+d", "delete", "Delete"),
    ]

    def __init__(self, store: ConversationStore, current_id: str | None = None):
        super().__init__()
        self.store = store
        self.current_id = current_id
        self.infos: list[ConversationInfo] = []
        self.elsewhere: set[str] = set()

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations-box"):
            yield Label("Conversations", id="conversations-title")
            yield OptionList(id="conversations")
            yield Label("Enter open · Delete remove (asks first) · Esc back", classes="hint")
        yield Footer()

    def on_mount(self) -> None:
        self.reload()
        self.query_one(OptionList).focus()
        self.set_interval(self.WATCH_S, self.watch_other_windows)

    def reload(self) -> None:
        self.infos = self.store.list()
        self.elsewhere = self.store.held_elsewhere()
        options = self.query_one(OptionList)
        options.clear_options()
        if not self.infos:
            options.add_option(Option(Text("no saved conversations yet", style="dim"), disabled=True))
            return
        options.add_options(Option(self._text(i), id=i.id) for i in self.infos)
        current = next((n for n, i in enumerate(self.infos) if i.id == self.current_id), 0)
        options.highlighted = current

    def watch_other_windows(self) -> None:
        """Re-mark the conversations another window opened or let go of since the last look; the cursor stays."""
        elsewhere = self.store.held_elsewhere()
        if elsewhere == self.elsewhere or not self.infos:
            return
        changed, self.elsewhere = elsewhere ^ self.elsewhere, elsewhere
        options = self.query_one(OptionList)
        for info in self.infos:
            if info.id in changed:
                options.replace_option_prompt(info.id, self._text(info))

    def _text(self, info: ConversationInfo) -> Text:
        return option_text(info, info.id == self.current_id, info.id in self.elsewhere)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option.id:
            self.dismiss(event.option.id)

    def action_delete(self) -> None:
        from moedesk.app.tui.screens.dialogs import ConfirmScreen

        options = self.query_one(OptionList)
        if options.highlighted is None or not self.infos:
            return
        option = options.get_option_at_index(options.highlighted)
        info = next((i for i in self.infos if i.id == option.id), None)
        if info is None:
            return

        def answered(yes: bool | None) -> None:
            if yes:
                try:
                    self.store.delete(info.id)
                except OSError as e:
                    self.notify(f"Not deleted: {e}", severity="warning")
                    return
                self.notify(f"Deleted “{info.title}”.")
                self.reload()

        self.app.push_screen(ConfirmScreen(f"Delete “{info.title}” ({info.turns} exchange"
                                           f"{'s' if info.turns != 1 else ''})? This cannot be undone.",
                                           yes="Delete", no="Keep"), answered)
