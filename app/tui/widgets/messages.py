"""Chat bubbles: the user's text as typed, the model's reply as Markdown that can grow while it streams, its
reasoning (a thinking model's) folded above it."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream

FINISH_WORDS = {"stop": "", "length": "reached the token limit", "cancelled": "stopped"}

# Control characters would reach the terminal as they are (and make SVG screenshots invalid XML):
# show them as their Unicode "control picture" instead. Only the display changes, never the saved text.
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"} | {0x7F: 0x2421}


def visible(text: str) -> str:
    return text.translate(_CONTROL_PICTURES)


def meta_line(meta: dict) -> str:
    """'<n> tokens · <rate> tok/s · stopped' from a reply's saved meta (no wall-clock times: it is saved)."""
    parts = []
    tokens = meta.get("tokens")
    if isinstance(tokens, int):
        parts.append(f"{tokens} token{'s' if tokens != 1 else ''}")
    speed = (meta.get("stats") or {}).get("decode_tok_s")
    if isinstance(speed, (int, float)):
        parts.append(f"{speed:.1f} tok/s")
    finish = FINISH_WORDS.get(meta.get("finish_reason"), "")
    if finish:
        parts.append(finish)
    if meta.get("error"):
        parts.append(f"error: {meta['error']}")
    return " · ".join(parts)


class UserMessage(Static):
    DEFAULT_CLASSES = "message"

    def __init__(self, text: str):
        super().__init__(visible(text), markup=False)
        self.border_title = "you"


class AssistantMessage(Vertical):
    """A reply. While streaming, `append` adds text through a MarkdownStream, which folds fragments
    that arrive faster than the widget can re-parse into one update."""

    DEFAULT_CLASSES = "message"

    def __init__(self, text: str = "", meta: dict | None = None, *, title: str = "assistant",
                 streaming: bool = False):
        super().__init__()
        self.text = text
        self.meta = dict(meta or {})
        self.reasoning = self.meta.get("reasoning") or ""
        self.streaming = streaming
        self.border_title = title
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        # Folded: the answer is what the user reads; the reasoning is there to open.
        with Collapsible(title="reasoning", collapsed=True, classes="reasoning"):
            yield Static(visible(self.reasoning), classes="reasoning-text", markup=False)
        yield Markdown(visible(self.text), classes="reply")
        yield Static(self._meta_text(), classes="meta", markup=False)

    def _meta_text(self) -> str:
        return "thinking…" if self.streaming and not self.text else meta_line(self.meta)

    def _show_meta(self, text: str) -> None:
        meta = self.query_one(".meta", Static)
        meta.update(text)
        meta.display = bool(text)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def on_mount(self) -> None:
        self.set_class(self.streaming, "-streaming")
        self.query_one(".meta", Static).display = bool(self._meta_text())
        self.query_one(".reasoning", Collapsible).display = bool(self.reasoning)

    async def append_reasoning(self, fragment: str) -> None:
        if not fragment:
            return
        self.reasoning += fragment
        self.query_one(".reasoning-text", Static).update(visible(self.reasoning))
        self.query_one(".reasoning", Collapsible).display = True

    async def append(self, fragment: str) -> None:
        if not fragment:
            return
        first = not self.text
        self.text += fragment
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(visible(fragment))
        if first:
            self._show_meta("")

    async def finish(self, text: str, meta: dict) -> None:
        """The engine's final text replaces what was streamed (it may hold back a partial character)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.streaming = False
        self.remove_class("-streaming")
        self.meta = dict(meta)
        if meta.get("reasoning") is not None and meta["reasoning"] != self.reasoning:
            self.reasoning = meta["reasoning"]
            self.query_one(".reasoning-text", Static).update(visible(self.reasoning))
            self.query_one(".reasoning", Collapsible).display = bool(self.reasoning)
        if text != self.text or self.markdown.source != visible(text):
            self.text = text
            await self.markdown.update(visible(text))
        self._show_meta(self._meta_text())
        self.set_class(meta.get("finish_reason") == "cancelled", "-cancelled")
        self.set_class(bool(meta.get("error")), "-error")
