"""The chat's input box: several lines, Enter sends, and ↑ in an empty box brings back earlier prompts.

A single-line Input kept only the first line of a paste, so pasted code and logs were cut
without a word; a TextArea keeps every line. Enter sends because that is what chat users
expect; a new line is shift+enter where the terminal reports it (kitty keyboard protocol) and
ctrl+j everywhere (the terminal sends a line feed for it), alt+enter for terminals that send
ESC before Enter.
"""
from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


class PromptArea(TextArea):
    """`Submitted(text)` on Enter. `prompts` (oldest first) is what ↑/↓ walk through."""

    class Submitted(Message):
        def __init__(self, prompt_area: "PromptArea", text: str):
            super().__init__()
            self.prompt_area, self.text = prompt_area, text

        @property
        def control(self) -> "PromptArea":
            return self.prompt_area

    def __init__(self, *, placeholder: str = "", id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes, soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         placeholder=placeholder, compact=True, highlight_cursor_line=False)
        self.prompts: list[str] = []
        self._recalled: int | None = None  # index into history of the prompt on show, while it is unedited

    def remember(self, prompt: str) -> None:
        if prompt and (not self.prompts or self.prompts[-1] != prompt):
            self.prompts.append(prompt)

    def _browsing(self) -> bool:
        return self._recalled is not None and self._recalled < len(self.prompts) \
            and self.text == self.prompts[self._recalled]

    def _recall(self, index: int | None) -> None:
        self._recalled = index
        self.text = "" if index is None else self.prompts[index]
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        key = event.key
        if key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self._replace_via_keyboard("\n", *self.selection)
            return
        browsing = self._browsing()
        # ↑ recalls only from an empty box or while a recalled prompt is unedited, so that ↑ inside a
        # message being written still moves the cursor up a line.
        if key == "up" and self.prompts and (not self.text or (browsing and self.cursor_at_first_line)):
            event.stop()
            event.prevent_default()
            self._recall(max(0, self._recalled - 1) if browsing else len(self.prompts) - 1)
            return
        if key == "down" and browsing and self.cursor_at_last_line:
            event.stop()
            event.prevent_default()
            self._recall(self._recalled + 1 if self._recalled + 1 < len(self.prompts) else None)
            return
        await super()._on_key(event)
