"""Local models: the demo, the user's models folder, the Hugging Face cache. Enter loads one.

Listing runs in a thread worker (sizes need a walk over files, estimates a read of the headers);
loading goes through a `LoadPanel`. The memory column is what loading would take with the expert
dtype and weights dtype in force (F2 changes them; the estimate follows when the settings close);
for a GGUF the llama.cpp engine would load, the RAM and GPU of the plan that engine's load makes
for the GPU budget and context in force, marked where the load would refuse it. A checkpoint the engine setting
would not load at all (llama.cpp reads GGUF files only; the native engine refuses some architectures) is marked
so, its note the line the load would stop with (catalog.row_engine, as `moedesk list` decides).
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

from moedesk.app.tui.catalog import LocalModel, estimate_line, find_models, gguf_engine_plan, human_size, row_engine
from moedesk.app.tui.load_target import LoadTarget, load_target
from moedesk.app.tui.storage import models_dir
from moedesk.app.tui.widgets.load_panel import LoadPanel, one_line
from moedesk.engine.selection import preflight


ASK = object()  # memory_cell's and memory_note's `plan` when the caller has not planned the row


WONT_LOAD = "✗ won't load"  # the memory column of a row the engine setting would not load: its note says why


def llama_plan(model: LocalModel, target: LoadTarget, available: int | None = None):
    """For a row the llama.cpp engine would load (with `target.engine`): the plan its load makes on this machine
    (catalog.llama_fit: a Fit, or the line saying why the load stops before placing anything). None for a row the
    native engine loads. `available` stands in for the memory this process may use."""
    if row_engine(model, target.engine).kind != "llama.cpp":
        return None
    return gguf_engine_plan(model.arch, model.llama_shape, target, available)[1]


def memory_cell(model: LocalModel, target: LoadTarget, plan=ASK) -> str:
    """The memory column: the llama.cpp plan (`plan_cell`) for a row that engine loads, else the native estimate's
    total. `plan`: the row's `llama_plan` where the caller has it (the screen plans each row once, for this cell
    and the note alike)."""
    plan = llama_plan(model, target) if plan is ASK else plan
    if plan is not None:
        return plan_cell(plan)
    if row_engine(model, target.engine).kind == "none":
        return WONT_LOAD
    estimate = model.estimate(target.expert_dtype, target.weights_dtype, target.gpu)
    return "—" if estimate is None else f"~{human_size(estimate.total_bytes)}"


def plan_cell(plan) -> str:
    """A llama.cpp plan in a few columns, in the figures its note and the load's line give: "1.1M RAM" all in RAM,
    "0.3G+16.3G GPU" with layers on the GPU, "✗ " before either where the load would refuse it, "✗ GPU budget"
    where the budget leaves no plan at all."""
    if isinstance(plan, str):
        return "✗ GPU budget"
    where = f"{brief(plan.ram_bytes)}+{brief(plan.gpu_total)} GPU" if plan.placement.gpu_layers \
        else f"{brief(plan.ram_bytes)} RAM"
    return where if plan.fits else f"✗ {where}"


def brief(n: int) -> str:
    """engine.memory_fit.gib's figure with its unit's letter: "16.3G", "0.3M"."""
    from moedesk.engine.memory_fit import gib

    return gib(n).replace(" GiB", "G").replace(" MiB", "M")


def memory_note(model: LocalModel, target: LoadTarget, available: int | None = None, plan=ASK) -> str:
    """The estimate in full, with the file's size, and the engine it assumes (the target's engine setting; auto's
    choice, engine.selection): "~26.4 GiB in RAM as q4_0 experts + 3.0 GiB on the GPU (file 86.9 GiB) ·
    native engine"; the file's size alone where there is no estimate (and why, when the headers said). A GGUF
    llama.cpp would run is planned as its load plans it (`llama_plan`: the same placement, figures and refusal).
    One bigger than the memory this process may use (`available`, default: the RAM available or the cgroup's
    limit) says that it will not load."""
    choice = row_engine(model, target.engine)
    file = f"file {human_size(model.size_bytes)}" if model.size_bytes is not None else ""
    if choice.kind == "none":  # where the load would stop, in its own words (engine.selection.not_gguf)
        return " · ".join(part for part in (file, choice.why) if part)
    plan = llama_plan(model, target, available) if plan is ASK else plan
    if plan is not None:
        line = plan if isinstance(plan, str) else plan.line()
        return " · ".join(part for part in (line, file, choice.why) if part)
    estimate = model.estimate(target.expert_dtype, target.weights_dtype, target.gpu)
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
FIXED = ("source", "arch", "experts", "size")  # as wide as their widest value
NAME_SHORT, NAME_SHORTEST, NOTE_SHORTEST = 16, 12, 8


def column_layout(rows: list[tuple[str, ...]], width: int, padding: int) -> dict[str, tuple[str, int]]:
    """(label, width) of each column shown, for `rows` (a value per MODEL_COLUMNS key) in `width` columns where
    each cell takes `padding` beside its text. The fixed columns take their widest value; the name and the note
    share the rest, the note giving way first (the highlighted row's is shown whole below the table), then the
    name down to NAME_SHORT. Where that is not enough (80 columns, a llama.cpp plan's cell, an "hf cache" row) the
    architecture is headed "arch", then the note column is left out (a name cut shorter tells models apart no
    more), and only then is the name cut down to NAME_SHORTEST."""
    keys = list(MODEL_COLUMNS)
    labels = dict(MODEL_COLUMNS)

    def need(key: str) -> int:
        return max([len(row[keys.index(key)]) for row in rows] + [len(labels[key])])

    name_need, note_need = max(need("name"), 5), need("note")
    for short_arch, with_note, shortest in ((False, True, NAME_SHORT), (True, True, NAME_SHORT),
                                            (True, False, NAME_SHORTEST)):
        labels = {**MODEL_COLUMNS, "arch": "arch" if short_arch else MODEL_COLUMNS["arch"]}
        if not with_note:
            del labels["note"]
        fixed = {key: need(key) for key in FIXED}
        room = width - padding * len(labels) - 1 - sum(fixed.values())  # 1: the mark
        note = min(note_need, max(NOTE_SHORTEST, room - name_need)) if with_note else 0
        name = min(name_need, max(shortest, room - note))
        if name + note <= room:
            break
    widths = {"mark": 1, "name": name, **fixed, "note": note}
    return {key: (label, widths[key]) for key, label in labels.items()}


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
        self.plans: list = []  # each model's llama_plan for self.target

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
        self._plan_rows()
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
            self._plan_rows()
            self._fill_table()
            self._show_status()

    def _plan_rows(self) -> None:
        """Each row's llama.cpp plan (None for rows the native engine loads), made once for its cell and its note."""
        self.plans = [llama_plan(m, self.target) for m in self.models]

    def _fill_table(self) -> None:
        """The rows, in columns that fit the width (`column_layout`): at 80 columns a long repo id and its note
        pushed the other columns off screen."""
        table = self.query_one(DataTable)
        cursor = table.cursor_row
        rows = [("●" if m.spec == self.current else "", m.name, m.source, m.arch, m.experts,
                 memory_cell(m, self.target, plan), m.note or self._stop(m))
                for m, plan in zip(self.models, self.plans)]
        layout = column_layout(rows, self.size.width - 4, 2 * table.cell_padding)  # 4: body padding, scrollbar
        table.clear(columns=True)
        for key, (label, width) in layout.items():
            table.add_column(label, key=key, width=width)
        for n, row in enumerate(rows):
            values = dict(zip(MODEL_COLUMNS, row))
            table.add_row(*(fit(values[key], width) for key, (_, width) in layout.items()), key=str(n))
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
        parts = [m.name, memory_note(m, self.target, plan=self.plans[index]), m.note]
        self.query_one("#models-note", Static).update(" · ".join(part for part in parts if part))

    # -------------------------------------------------------------- loading

    @on(DataTable.RowSelected)
    def row_chosen(self, event: DataTable.RowSelected) -> None:
        index = int(event.row_key.value)
        model = self.models[index]
        if stop := self._stop(model):  # refused at once, as the load would, without unloading the current model
            self._fail(f"{model.name}: {stop}")
            return
        self.load(model.spec)

    def _stop(self, model: LocalModel) -> str:
        """The line loading `model` with the engine setting would stop with; "" where it would load."""
        choice = row_engine(model, self.target.engine)
        return choice.why if choice.kind == "none" else ""

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
