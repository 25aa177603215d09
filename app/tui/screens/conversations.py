"""Pick an older conversation (Enter) or delete one (Delete, after a yes). Dismisses with the chosen id or None."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Label, OptionList
from textual.widgets.option_list import Option

from moedesk.app.tui.storage import ConversationInfo, ConversationStore


def option_text(info: ConversationInfo, current: bool) -> Text:
    text = Text("● " if current else "  ", style="green")
    text.append(info.title, style="bold")
    when = info.updated[:16].replace("T", " ")
    # turns counts the user's messages: each is one exchange (a question and its reply), not one message
    text.append(f"\n  {when} · {info.turns} exchange{'s' if info.turns != 1 else ''}", style="dim")
    if info.model:
        text.append(f" · {info.model.rstrip('/').rsplit('/', 1)[-1]}", style="dim")
    return text


class ConversationsScreen(ModalScreen[str | None]):
    BINDINGS = [
        Binding("escape", "dismiss(None)", "Back"),
        Binding("delete,ctrl+d", "delete", "Delete"),
    ]

    def __init__(self, store: ConversationStore, current_id: str | None = None):
        super().__init__()
        self.store = store
        self.current_id = current_id
        self.infos: list[ConversationInfo] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations-box"):
            yield Label("Conversations", id="conversations-title")
            yield OptionList(id="conversations")
            yield Label("Enter open · Delete remove (asks first) · Esc back", classes="hint")
        yield Footer()

    def on_mount(self) -> None:
        self.reload()
        self.query_one(OptionList).focus()

    def reload(self) -> None:
        self.infos = self.store.list()
        options = self.query_one(OptionList)
        options.clear_options()
        if not self.infos:
            options.add_option(Option(Text("no saved conversations yet", style="dim"), disabled=True))
            return
        options.add_options(Option(option_text(i, i.id == self.current_id), id=i.id) for i in self.infos)
        current = next((n for n, i in enumerate(self.infos) if i.id == self.current_id), 0)
        options.highlighted = current

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
