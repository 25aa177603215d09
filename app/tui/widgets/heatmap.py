"""Layer × expert heat map: how often each expert was picked, and whether it lives on the GPU or in RAM.

Each cell is one expert (or a bin of neighbouring experts when a row would not fit). Popularity
is a five-step colour ramp relative to the most-picked expert of the whole model; placement is a
colour family (blue on the GPU, orange in RAM: apart for colour-blind eyes too) and a glyph
(GPU cells carry a ◆, RAM cells are plain), so either cue alone tells them apart. Where the layers
run on several GPUs, each row also carries a tag naming the GPU its resident experts sit on ("G1").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rich.text import Text
from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget

GPU_RAMP = ("#173f73", "#1f5fa8", "#2f86d8", "#62b4f5", "#b9e3ff")
RAM_RAMP = ("#5e2c0c", "#8f4511", "#c86614", "#f4942c", "#ffd27a")
UNUSED_STYLE = "#5c5c5c"
GPU_MARK, UNUSED_GLYPH = "◆", "·"
LABEL_WIDTH = 4  # "L12 "
MAX_CELL_WIDTH = 4
DEVICE_TAG_WIDTH = 3  # "G1 ", after the label, where the layers run on several GPUs
# A colour per GPU for its tag (the tag's digit says it too): none of them the heat ramps' blue or orange.
DEVICE_COLOURS = ("#7b4fc9", "#2e8b57", "#c2185b", "#8d8d2a", "#00838f", "#6d4c41", "#5c6bc0", "#9e9d24")


@dataclass(frozen=True)
class Cell:
    experts: range  # which experts this cell stands for
    count: int  # selections summed over them
    on_gpu: bool  # most of them are on the GPU
    level: int  # 0 never picked, 1..5 popularity


@dataclass(frozen=True)
class HeatMapLayout:
    rows: list[list[Cell]]
    labels: list[str]
    cell_width: int  # characters per cell: 1 to MAX_CELL_WIDTH
    bin_size: int  # experts per cell
    max_count: int
    devices: list[int] | None = None  # per row, the GPU holding that layer (None: one device)
    device_names: tuple[str, ...] = ()  # per GPU, its torch device ("cuda:1"), for the legend

    @property
    def label_width(self) -> int:
        return LABEL_WIDTH + (DEVICE_TAG_WIDTH if self.devices else 0)


def level_of(count: int, max_count: int) -> int:
    if count <= 0 or max_count <= 0:
        return 0
    return min(5, 1 + int(5 * count / max_count - 1e-9))


def layout(on_gpu: list[list[bool]], popularity: list[list[int]], width: int,
           labels: list[str] | None = None, devices: list[int] | None = None,
           device_names: tuple[str, ...] = ()) -> HeatMapLayout:
    """Cells for a map `width` characters wide: up to MAX_CELL_WIDTH characters per expert, at least 1;
    when even 1 does not fit, neighbouring experts share a cell. `devices`: per row, the GPU that holds
    the layer, where the layers run on several (their tags take DEVICE_TAG_WIDTH of the width)."""
    devices = list(devices) if devices and len(devices) == len(popularity) else None
    num_experts = max((len(row) for row in popularity), default=0)
    room = max(1, width - LABEL_WIDTH - (DEVICE_TAG_WIDTH if devices else 0))
    if 2 * num_experts <= room:
        cell_width, bin_size = min(MAX_CELL_WIDTH, room // max(1, num_experts)), 1
    elif num_experts <= room:
        cell_width, bin_size = 1, 1
    else:
        cell_width, bin_size = 1, math.ceil(num_experts / room)
    binned = []
    for gpu_row, pop_row in zip(on_gpu, popularity):
        cells = []
        for start in range(0, len(pop_row), bin_size):
            experts = range(start, min(start + bin_size, len(pop_row)))
            gpu = sum(bool(gpu_row[e]) for e in experts if e < len(gpu_row))
            cells.append((experts, sum(int(pop_row[e]) for e in experts), 2 * gpu >= len(experts) and gpu > 0))
        binned.append(cells)
    max_count = max((count for row in binned for _, count, _ in row), default=0)
    rows = [[Cell(experts, count, gpu, level_of(count, max_count)) for experts, count, gpu in row] for row in binned]
    labels = labels if labels is not None else [f"L{i}" for i in range(len(rows))]
    return HeatMapLayout(rows, labels, cell_width, bin_size, max_count, devices, tuple(device_names))


def device_tag(device: int) -> Text:
    """A GPU's tag: its number on its own colour."""
    return Text(f"G{device}", style=f"#ffffff on {DEVICE_COLOURS[device % len(DEVICE_COLOURS)]}")


def cell_text(cell: Cell, width: int) -> Text:
    """A cell: its background is the heat; GPU cells also carry a mark."""
    if cell.level == 0:
        return Text(UNUSED_GLYPH * width, style=UNUSED_STYLE)
    ramp = GPU_RAMP if cell.on_gpu else RAM_RAMP
    ink = "#000000" if cell.level >= 4 else "#ffffff"
    glyphs = (GPU_MARK + " " * (width - 1)) if cell.on_gpu else " " * width
    return Text(glyphs, style=f"{ink} on {ramp[cell.level - 1]}")


def render_lines(hm: HeatMapLayout, legend: bool = True, *, device: str = "cuda", width: int = 80,
                 count_every: int | None = None, gpu_count_every: int | None = None,
                 counted: bool = True) -> list[Text]:
    """The map as lines of styled text: the legend (first, so that it is on screen however many layers
    follow), an expert-number header, then one line per layer. count_every: the counts are estimates from one
    decode step in this many (the legend says so); gpu_count_every: the same where the experts are on the GPU.
    counted False: the engine does not count picks (the setting), so the map shows where experts are and no use."""
    lines = legend_lines(hm, device, width, count_every, gpu_count_every, counted) if legend else []
    if hm.rows:
        cells = len(hm.rows[0])
        header = Text(" " * hm.label_width, style="dim")
        step = {1: 8, 2: 4}.get(hm.cell_width, 2)  # column numbers every few cells, never overlapping
        col = 0
        while col < cells:
            tag = str(col * hm.bin_size)
            span = step * hm.cell_width
            header.append(tag.ljust(span)[:span], style="dim")
            col += step
        lines.append(header)
    for i, (label, row) in enumerate(zip(hm.labels, hm.rows)):
        line = Text(label[: LABEL_WIDTH - 1].rjust(LABEL_WIDTH - 1) + " ", style="dim")
        if hm.devices:
            line.append_text(device_tag(hm.devices[i])).append(" " * (DEVICE_TAG_WIDTH - 2))
        for cell in row:
            line.append_text(cell_text(cell, hm.cell_width))
        lines.append(line)
    return lines


def legend_lines(hm: HeatMapLayout, device: str = "cuda", width: int = 80,
                 count_every: int | None = None, gpu_count_every: int | None = None,
                 counted: bool = True) -> list[Text]:
    """Only the places this map has, in words that are true of the machine: without a GPU the experts
    are in RAM, and a GPU tier there is the one `--device cpu` simulates. count_every: counts estimated from
    a sample of the decode steps, said in the legend."""
    cells = [cell for row in hm.rows for cell in row]
    any_gpu = any(c.on_gpu for c in cells)
    any_ram = any(not c.on_gpu for c in cells)
    items = []
    if any_gpu:
        words = "on GPU" if device == "cuda" else "GPU tier (simulated)"
        items.append(cell_text(Cell(range(1), 1, True, 4), 2).append(f" {words}"))
    if any_ram:
        words = "in RAM" if any_gpu or device == "cuda" else "in RAM (no GPU)"
        items.append(cell_text(Cell(range(1), 1, False, 4), 2).append(f" {words}"))
    items.append(Text(UNUSED_GLYPH * 2, style=UNUSED_STYLE).append(" unused"))
    lines = _flow(items, width)
    if hm.devices:  # which GPU each row's tag names, and what that GPU is on this machine
        tags = []
        for d in sorted(set(hm.devices)):
            name = hm.device_names[d] if d < len(hm.device_names) else ""
            where = f" ({name})" if name and device == "cuda" else f" (simulated on {name})" if name else ""
            tags.append(device_tag(d).append(f" layers on GPU {d}{where}"))
        lines += _flow(tags, width)
    ramp = Text("picked ")
    for ramp_colours, used in ((GPU_RAMP, any_gpu), (RAM_RAMP, any_ram)):
        if used:
            for level in range(1, 6):
                ramp.append(" ", style=f"on {ramp_colours[level - 1]}")
            ramp.append(" ")
    ramp.append(f"few → {'~' if count_every else ''}{hm.max_count:,}")
    lines.append(ramp)
    if not counted:
        lines.append(Text("picks not counted: settings, Count expert picks", style="dim"))
    if count_every:
        gpu = f" (1 in {gpu_count_every} on the GPU)" if gpu_count_every and gpu_count_every != count_every else ""
        lines.append(Text(f"estimated: prompts and 1 decode step in {count_every} counted{gpu}", style="dim"))
    if hm.bin_size > 1:
        lines.append(Text(f"one cell = {hm.bin_size} experts", style="dim"))
    return lines


def _flow(items: list[Text], width: int) -> list[Text]:
    """Items side by side, two spaces apart, on as few lines of `width` as they fit."""
    lines: list[Text] = []
    for item in items:
        if lines and lines[-1].cell_len + 2 + item.cell_len <= width:
            lines[-1].append("  ").append_text(item)
        else:
            lines.append(item.copy())
    return lines


class ExpertHeatMap(Widget):
    """The heat map for one model. Call `update_map` with Engine.expert_map()'s two lists."""

    DEFAULT_CSS = """
    ExpertHeatMap { height: auto; width: 1fr; }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None):
        super().__init__(name=name, id=id, classes=classes)
        self.on_gpu: list[list[bool]] = []
        self.popularity: list[list[int]] = []
        self.labels: list[str] | None = None
        self.device = "cuda"  # the engine's device type: the legend's words depend on it
        self.devices: list[int] | None = None  # per row, the GPU holding the layer, where there are several
        self.device_names: tuple[str, ...] = ()
        self.count_every: int | None = None  # the engine counts one decode step in this many (None: all)
        self.gpu_count_every: int | None = None  # the same where the experts are on the GPU (None: as count_every)
        self.counted = True  # False: the engine counts no picks (the setting), the map shows placement alone

    def update_map(self, on_gpu: list[list[bool]], popularity: list[list[int]],
                   labels: list[str] | None = None) -> None:
        changed = (on_gpu, popularity, labels) != (self.on_gpu, self.popularity, self.labels)
        self.on_gpu, self.popularity, self.labels = on_gpu, popularity, labels
        if changed:
            self.refresh(layout=True)

    def current_layout(self, width: int | None = None) -> HeatMapLayout:
        return layout(self.on_gpu, self.popularity, self.content_size.width if width is None else width, self.labels,
                      self.devices, self.device_names)

    def _lines(self, width: int) -> list[Text]:
        if not self.popularity:
            if self.device == "remote":  # a server does not say where its experts are nor which it picked
                return [Text("not available: the server runs the model", style="dim")]
            return [Text("dense model: no experts to map", style="dim")]
        return render_lines(self.current_layout(width), device=self.device, width=width,
                            count_every=self.count_every, gpu_count_every=self.gpu_count_every,
                            counted=self.counted)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        # Rows as Textual wraps them: a legend line wider than a narrow panel (the sampled counts' note) takes two,
        # and a height of one row a line cut the map's last layer off.
        lines = self._lines(width)
        return sum(len(Content.from_rich_text(line).wrap(width)) for line in lines) if width > 0 else len(lines)

    def render(self) -> Text:
        return Text("\n").join(self._lines(self.content_size.width))
