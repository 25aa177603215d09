"""Local models: the demo, the user's models folder, the Hugging Face cache. Enter loads one.

Listing runs in a thread worker (sizes need a walk over files, estimates a read of the headers);
loading goes through a `LoadPanel`. The memory column is what loading would take with the expert
dtype and weights dtype in force (F2 changes them; the estimate follows when the settings close).
F6 opens the download wizard over it, and a download finished there loads from here. Dismisses
with the new engine, or None when left without loading.
"""
from __future__ import annotations

from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Static

from moedesk.app.tui.catalog import LocalModel, estimate_line, find_models, human_size, llama_fit_line
from moedesk.app.tui.load_target import LoadTarget, load_target
from moedesk.app.tui.storage import models_dir
from moedesk.app.tui.widgets.load_panel import LoadPanel, one_line
from moedesk.engine.selection import preflight


def memory_cell(model: LocalModel, target: LoadTarget) -> str:
    estimate = model.estimate(target.expert_dtype, target.weights_dtype)
    return "—" if estimate is None else f"~{human_size(estimate.total_bytes)}"


def memory_note(model: LocalModel, target: LoadTarget, engine: str = "auto", available: int | None = None) -> str:
    """The estimate in full, with the file's size, and the engine it assumes (auto's choice, engine.selection):
    "~26.4 GiB in RAM as q4_0 experts + 3.0 GiB on the GPU (file 86.9 GiB) · native engine"; the file's size alone
    where there is no estimate (and why, when the headers said). A GGUF llama.cpp would run is planned as its load
    plans it (engine.llamacpp.fit: the same placement, figures and refusal). One bigger than the memory this
    process may use (`available`, default: the RAM available or the cgroup's limit) says that it will not load."""
    from moedesk.engine.selection import listed_engine

    choice = listed_engine(model.arch, model.source in ("gguf", "hf cache") and model.spec.endswith(".gguf"), engine)
    file = f"file {human_size(model.size_bytes)}" if model.size_bytes is not None else ""
    if choice.kind == "llama.cpp" and model.llama_shape is not None:
        return " · ".join(part for part in (llama_fit_line(model.llama_shape, target, available), file, choice.why)
                          if part)
    estimate = model.estimate(target.expert_dtype, target.weights_dtype)
    if estimate is None:
        why = f"no memory estimate: {model.estimate_error}" if model.estimate_error else ""
        return " · ".join(part for part in (file, why, choice.why) if part)
    return estimate_line(estimate, target.gpu, human_size) + (f" ({file})" if file else "") + \
        _too_big(estimate.ram_bytes(target.gpu), available) + f" · {choice.why}"


def _too_big(need: int, available: int | None) -> str:
    from moedesk.engine.host_memory import available_memory
    from moedesk.engine.memory_fit import usable

    available = available_memory() if available is None else available
    return "" if need <= usable(available) else f" · does not fit: {human_size(available)} of RAM is available"


MODEL_COLUMNS = {"mark": "", "name": "model", "source": "from", "arch": "architecture", "experts": "experts",
                 "size": "memory", "note": "note"}


def fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


class ModelsFound(Message):
    def __init__(self, models: list[LocalModel] | None, error: str = ""):
        super().__init__()
        self.models, self.error = models, error


class ModelsScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("f5,ctrl+r", "rescan", "Rescan"),
        Binding("ctrl+l", "focus_path", "Path…"),
        Binding("f6", "download", "Download…"),
        Binding("f2", "app.settings", "Settings"),
    ]

    def __init__(self, current: str | None = None):
        super().__init__()
        self.current = current
        self.models: list[LocalModel] = []
        self.target: LoadTarget | None = None  # what the estimates shown are for

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="models-body"):
            yield Input(placeholder="a model folder, a .gguf file or a cached repo id — Enter loads it",
                        id="model-path")
            yield DataTable(id="models-table", cursor_type="row", zebra_stripes=True)
            yield Static("", id="models-note", markup=False)
            yield Static("", id="models-status", markup=False)
            yield LoadPanel(id="models-load")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "models"
        self.target = load_target(self.app)
        table = self.query_one(DataTable)
        table.focus()
        self.query_one("#models-status", Static).update(f"looking in {models_dir()} and the Hugging Face cache…")
        self.scan()

    @work(thread=True, exclusive=True, group="scan", exit_on_error=False)
    def scan(self) -> None:
        try:
            self.post_message(ModelsFound(find_models()))
        except Exception as e:  # noqa: BLE001
            self.post_message(ModelsFound(None, one_line(e)))

    def on_models_found(self, message: ModelsFound) -> None:
        status = self.query_one("#models-status", Static)
        if message.models is None:
            status.update(f"could not list models: {message.error}")
            return
        self.models = message.models
        self._fill_table()
        self._show_status()

    def _show_status(self) -> None:
        count = f"{len(self.models)} model{'s' if len(self.models) != 1 else ''}"
        memory = f"memory with {self.target.describe()} (F2)"
        self.query_one("#models-status", Static).update(
            f"{count} · {memory} · put model folders or .gguf files in {models_dir()}")

    def on_screen_resume(self, event: events.ScreenResume) -> None:
        """Back from the settings (or the wizard): a changed expert or weights dtype changes every estimate. The
        settings screen's result reaches the app through the app's own queue, posted before this event: asking
        there runs after it."""
        self.app.call_next(self._follow_settings)

    def _follow_settings(self) -> None:
        target = load_target(self.app)
        if target == self.target or not self.is_attached:
            return
        self.target = target
        if self.models:
            self._fill_table()
            self._show_status()

    def _fill_table(self) -> None:
        """The rows, with the name and note columns sharing what the fixed columns leave of the width:
        at 80 columns a long repo id and its note pushed the other columns off screen."""
        table = self.query_one(DataTable)
        cursor = table.cursor_row
        rows = [("●" if m.spec == self.current else "", m.name, m.source, m.arch, m.experts,
                 memory_cell(m, self.target), m.note or ("architecture not supported" if m.supported is False else ""))
                for m in self.models]
        fixed = {"source": 8, "arch": 12, "experts": 9, "size": 8}
        for key, index in (("source", 2), ("arch", 3), ("experts", 4), ("size", 5)):
            fixed[key] = max([len(r[index]) for r in rows] + [len(MODEL_COLUMNS[key])])
        padding = 2 * table.cell_padding * len(MODEL_COLUMNS)
        room = max(20, self.size.width - 4 - padding - 1 - sum(fixed.values()))  # 4: body padding and scrollbar
        # The note gives way first (down to a word or so), since the highlighted row's note is shown in full below.
        note_need = max([len(r[6]) for r in rows] + [4])
        name_need = max([len(r[1]) for r in rows] + [5])
        note_width = min(note_need, max(10, room - name_need))
        name_width = min(name_need, max(16, room - note_width))
        widths = {"mark": 1, "name": name_width, **fixed, "note": note_width}
        table.clear(columns=True)
        for key, label in MODEL_COLUMNS.items():
            table.add_column(label, key=key, width=widths[key])
        for n, row in enumerate(rows):
            table.add_row(*row[:1], fit(row[1], name_width), *row[2:6], fit(row[6], note_width), key=str(n))
        if rows:
            table.move_cursor(row=min(max(cursor, 0), len(rows) - 1))
            self._show_note(table.cursor_row)

    def on_resize(self) -> None:
        if self.models:
            self._fill_table()

    @on(DataTable.RowHighlighted)
    def row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """The whole name and note of the highlighted model, which the columns may have shortened, and its memory
        estimate in full."""
        self._show_note(int(event.row_key.value) if event.row_key.value is not None else -1)

    def _show_note(self, index: int) -> None:
        if not 0 <= index < len(self.models):
            return
        m = self.models[index]
        note = m.note or ("architecture not supported" if m.supported is False else "")
        parts = [m.name, memory_note(m, self.target, self.app.load_options().get("engine") or "auto"
                                     if hasattr(self.app, "load_options") else "auto"), note]
        self.query_one("#models-note", Static).update(" · ".join(part for part in parts if part))

    # -------------------------------------------------------------- loading

    @on(DataTable.RowSelected)
    def row_chosen(self, event: DataTable.RowSelected) -> None:
        index = int(event.row_key.value)
        model = self.models[index]
        if model.supported is False:
            self._fail(f"{model.name}: architecture {model.arch!r} is not supported")
            return
        self.load(model.spec)

    @on(Input.Submitted, "#model-path")
    def path_entered(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.load(event.value.strip())

    def _fail(self, error: str) -> None:
        panel = self.query_one(LoadPanel)
        panel.add_class("-failed")
        panel.query_one(".load-error", Static).update(error)

    def load(self, spec: str) -> None:
        panel = self.query_one(LoadPanel)
        if panel.busy:
            self.notify("A model is loading already.", severity="warning")
            return
        # Big models do not fit twice: the loaded one goes once the new one has passed a quick check.
        engine = (self.app.load_options().get("engine") if hasattr(self.app, "load_options") else None) or "auto"
        panel.start(spec, preflight=lambda model: preflight(model, engine), before_load=self.app.release_engine)

    def on_load_panel_loaded(self, message: LoadPanel.Loaded) -> None:
        self.dismiss(message.engine)

    def action_back(self) -> None:
        panel = self.query_one(LoadPanel)
        if panel.busy:
            panel.cancel()
            return
        self.dismiss(None)

    def action_rescan(self) -> None:
        self.scan()

    def action_focus_path(self) -> None:
        self.query_one("#model-path", Input).focus()

    def action_download(self, repo_id: str = "") -> None:
        from moedesk.app.tui.screens.download import DownloadScreen

        self.app.push_screen(DownloadScreen(repo_id), self._download_closed)

    def _download_closed(self, spec: str | None) -> None:
        self.scan()  # a finished download joins the HF cache list
        if spec:
            self.load(spec)
