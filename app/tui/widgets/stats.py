"""The stats panel beside the chat: the last reply's numbers, speed per reply, context use, the expert map.

The panel only shows what it is given (no engine, no clock), so a test can give it fixed numbers.
"""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Sparkline, Static

from moedesk.app.tui.widgets.heatmap import ExpertHeatMap

BAR_WIDTH = 20


def fmt(value, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value:,}{unit}"


def context_bar(used: int, total: int, width: int = BAR_WIDTH) -> Text:
    frac = 0.0 if total <= 0 else min(1.0, used / total)
    filled = round(frac * width)
    style = "green" if frac < 0.7 else ("yellow" if frac < 0.9 else "red")
    bar = Text("▰" * filled, style=style)
    bar.append("▱" * (width - filled), style="dim")
    bar.append(f" {frac:.0%}")
    return bar


def expert_rows(experts: dict | None, tokens: int | None, seconds: float | None = None) -> list[tuple[str, str]]:
    """Where the reply's experts ran (engine stats under "experts"), per generated token; none without offload.

    A row per place, each short enough for the panel (one row of all four was cut off at 100 columns);
    copied and zero-copy (read by the GPU from RAM) only when some were: most replies have neither."""
    if not experts:
        return []
    steps = max(1, tokens or 1)
    hit = experts.get("gpu_hit_rate")
    rows = [("GPU hit rate", "—" if hit is None else f"{hit:.0%}")]
    for label, key, always in (("experts on GPU", "experts_gpu", True), ("experts on CPU", "experts_cpu", True),
                               ("experts copied", "experts_copied", False),
                               ("experts zero-copy", "experts_zero_copy", False)):
        count = experts.get(key, 0)
        if always or count:
            rows.append((label, f"{count / steps:.1f} per token"))
    swaps = experts.get("expert_swaps", 0)
    if swaps and seconds:  # the expert cache moved experts onto the GPU during the reply
        rows.append(("expert swaps", f"{swaps / seconds:.1f} per s"))
    return rows


def speed_scale(speeds: list[float]) -> Text:
    """What the sparkline's lowest and highest bars stand for: it scales its bars to the data, not from 0."""
    if not speeds:
        return Text("")
    text = Text("▁ ", style="dim")
    text.append(f"{min(speeds):,.1f}")
    text.append("  █ ", style="dim")
    text.append(f"{max(speeds):,.1f} tok/s")
    return text


def decoding_rows(stats: dict) -> list[tuple[str, str]]:
    """How a reply was decoded, when not plainly: beam search's width, speculation's tokens per model step and
    the share of drafted tokens the model accepted."""
    if stats.get("beams"):
        return [("beams", fmt(stats["beams"]))]
    spec = stats.get("speculative") or {}
    if spec.get("plain"):
        return [("speculative", "off (would not pay)")]
    if not spec.get("verify_steps"):
        return []
    drafted = spec.get("drafted") or 0
    return [("per model step", fmt(spec.get("tokens_per_step"), " tokens", 2)),
            ("drafts accepted", f"{100 * spec.get('accepted', 0) / drafted:.0f}%" if drafted else "—")]


class StatsPanel(VerticalScroll):
    """Numbers of the last reply, a sparkline of decode speed per reply, context use, and the heat map."""

    ALLOW_MAXIMIZE = True

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes)
        self.border_title = "stats"
        self.reply: dict = {}
        self.live: tuple[int, float] | None = None  # tokens so far, seconds so far
        self.context_length = 0
        self.context_used = 0
        self.number_rows: list[tuple[str, str]] = []  # what the numbers table shows, as text

    def compose(self) -> ComposeResult:
        yield Static("no model", id="stats-model", markup=False)
        yield Static(id="stats-numbers")
        with Vertical(id="stats-speed-box"):
            yield Label("decode speed per reply", classes="stats-heading")
            yield Sparkline([], id="stats-speed")
            yield Static("", id="stats-speed-scale")
        yield Static(id="stats-context")
        yield Label("experts picked · layer × expert", classes="stats-heading")
        yield ExpertHeatMap(id="heatmap")

    def on_mount(self) -> None:
        self._show_numbers()
        self._show_context()

    @property
    def heatmap(self) -> ExpertHeatMap:
        return self.query_one(ExpertHeatMap)

    def set_model(self, summary: str, context_length: int, layer_labels: list[str] | None,
                  device: str = "cuda", row_devices: list[int] | None = None,
                  device_names: tuple[str, ...] = ()) -> None:
        """row_devices: per heat-map row, the GPU holding that layer, where the layers run on several."""
        self.query_one("#stats-model", Static).update(summary)
        self.context_length = context_length
        self.heatmap.labels = layer_labels
        self.heatmap.device = device
        self.heatmap.devices, self.heatmap.device_names = row_devices, device_names
        self.heatmap.refresh(layout=True)
        self._show_context()

    def show_reply(self, meta: dict | None, context_used: int | None = None) -> None:
        """The finished reply's numbers (its saved meta); None clears them."""
        self.reply = dict(meta or {})
        self.live = None
        if context_used is not None:
            self.context_used = context_used
        self._show_numbers()
        self._show_context()

    def show_live(self, tokens: int, seconds: float, context_used: int | None = None) -> None:
        self.live = (tokens, seconds)
        if context_used is not None:
            self.context_used = context_used
        self._show_numbers()
        self._show_context()

    def set_speed_history(self, speeds: list[float]) -> None:
        sparkline = self.query_one(Sparkline)
        sparkline.data = list(speeds) if speeds else []
        self.query_one("#stats-speed-box").set_class(len(speeds) < 2, "-empty")
        self.query_one("#stats-speed-scale", Static).update(speed_scale(speeds))

    def update_map(self, on_gpu, popularity) -> None:
        self.heatmap.update_map(on_gpu, popularity, self.heatmap.labels)

    def _show_numbers(self) -> None:
        if self.live is not None:
            tokens, seconds = self.live
            rows = [("generating", f"{fmt(tokens)} tokens"),
                    ("speed", fmt(tokens / seconds if seconds > 0 else None, " tok/s"))]
        else:
            stats = self.reply.get("stats") or {}
            rows = [("speed", fmt(stats.get("decode_tok_s"), " tok/s")),
                    ("first token", fmt(stats.get("ttft_s"), " s", 2)),
                    ("tokens", fmt(self.reply.get("tokens"))),
                    ("prompt", fmt(self.reply.get("prompt_tokens"))),
                    ("total time", fmt(stats.get("total_s"), " s", 2))]
            rows += decoding_rows(stats)
            rows += expert_rows(stats.get("experts"), self.reply.get("tokens"), stats.get("total_s"))
        self.number_rows = rows
        table = Table.grid(padding=(0, 1))
        table.add_column(style="dim", no_wrap=True)
        table.add_column(justify="right", no_wrap=True)
        for n, (label, value) in enumerate(rows):
            table.add_row(label, Text(value, style="bold" if n < 1 else ""))
        self.query_one("#stats-numbers", Static).update(table)

    def _show_context(self) -> None:
        # The bar on a line of its own: after a "context " label it wrapped in a narrow panel.
        text = context_bar(self.context_used, self.context_length)
        text.append(f"\n{self.context_used:,} of {self.context_length:,} tokens of context", style="dim")
        self.query_one("#stats-context", Static).update(text)
