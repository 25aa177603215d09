"""Will a download fit? One `FitReport` as a few lines: what is downloaded, free disk, RAM and VRAM,
and what the model takes once loaded (the screen's estimate: packed experts are smaller than the file).

Running out of disk stops a download, so that line turns into a warning; memory is only advice (the
engine keeps the experts that miss the GPU in RAM, so a model larger than RAM + VRAM may still be
worth having on disk), so it never looks like an error.

A long `loaded` line (where a load would stop, and why) can come with a brief: a screen too short for the whole
shows the brief, the whole in its tooltip (the stylesheet swaps them on the screen's `-short` class).
"""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from moedesk.app.download import DownloadChoice, FitReport, format_bytes


def size_line(choice: DownloadChoice) -> str:
    return f"{choice.label} · {choice.file_count} · {format_bytes(choice.total_bytes)} to download"


def disk_line(report: FitReport) -> str:
    free = f"disk    {format_bytes(report.free_disk_bytes)} free for the HF cache"
    if report.fits_on_disk:
        return f"{free} · fits, leaving {format_bytes(report.margin_bytes)} spare"
    return (f"{free} · NOT enough: needs {format_bytes(report.needed_bytes + report.margin_bytes)} "
            f"({format_bytes(report.margin_bytes)} of it spare)")


def memory_line(report: FitReport) -> str:
    ram = f"RAM {format_bytes(report.ram_available_bytes)} free of {format_bytes(report.ram_total_bytes)}"
    vram = "VRAM: no CUDA GPU" if report.vram_total_bytes is None else \
        f"VRAM {format_bytes(report.vram_free_bytes or 0)} free of {format_bytes(report.vram_total_bytes)}"
    return f"memory  {ram} · {vram}"


def fits_in_memory(report: FitReport, loaded_bytes: int | None = None) -> bool:
    """The weights once loaded (the file's size when there is no estimate) against RAM + VRAM together."""
    if loaded_bytes is None:
        return report.fits_in_memory
    return loaded_bytes <= report.ram_total_bytes + (report.vram_total_bytes or 0)


def memory_note(report: FitReport, loaded_bytes: int | None = None) -> str:
    together = format_bytes(report.ram_total_bytes + (report.vram_total_bytes or 0))
    if fits_in_memory(report, loaded_bytes):
        return f"the weights fit in RAM + VRAM together ({together})"
    return f"larger than RAM + VRAM together ({together}): it may not load on this computer"


class FitView(Vertical):
    """`show(choice, report)` / `clear()`. Carries `-no-room` while the shown choice does not fit on disk."""

    def compose(self) -> ComposeResult:
        yield Static("", classes="fit-size", markup=False)
        yield Static("", classes="fit-disk", markup=False)
        yield Static("", classes="fit-memory", markup=False)
        yield Static("", classes="fit-loaded", markup=False)
        yield Static("", classes="fit-brief", markup=False)
        yield Static("", classes="fit-note", markup=False)

    def on_mount(self) -> None:
        self.border_title = "will it fit?"
        self.clear()

    def clear(self) -> None:
        self.add_class("-empty")
        self.remove_class("-no-room", "-too-big", "-briefed", "-unloaded")
        for line in self.query(Static):
            line.update("")
            line.tooltip = None

    def show(self, choice: DownloadChoice, report: FitReport, loaded: str = "",
             loaded_bytes: int | None = None, brief: str = "") -> None:
        """`loaded`: the memory estimate in words (its line is left out when empty); `loaded_bytes`: its total, which
        the RAM + VRAM note weighs instead of the file's size; `brief`: what a short screen shows of `loaded`."""
        self.remove_class("-empty")
        self.set_class(not report.fits_on_disk, "-no-room")
        self.set_class(not fits_in_memory(report, loaded_bytes), "-too-big")
        self.query_one(".fit-size", Static).update(size_line(choice))
        self.query_one(".fit-disk", Static).update(disk_line(report))
        self.query_one(".fit-memory", Static).update(memory_line(report))
        line = self.query_one(".fit-loaded", Static)
        line.update(f"loaded  {loaded}" if loaded else "")
        self.set_class(not loaded, "-unloaded")  # a class, not `display`: an inline style would beat the brief's swap
        short = self.query_one(".fit-brief", Static)
        briefed = bool(loaded and brief and brief != loaded)
        self.set_class(briefed, "-briefed")
        short.update(f"loaded  {brief}" if briefed else "")
        short.tooltip = loaded if briefed else None
        self.query_one(".fit-note", Static).update(memory_note(report, loaded_bytes))
