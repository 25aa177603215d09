"""The download wizard: a Hub repo id → its download choices with sizes → one choice into the HF cache.

A `moedesk pull` short name (app.pull_catalogue: `qwen3.5:35b`, `glm-4.5-air:q8_0`) lists the repo it names, with
the quantisation it names highlighted.

`app.download` does the work and knows nothing of Textual; here it runs in thread workers. Listing
answers with a message; download progress comes back through `call_from_thread`; every failure is
one line in the status. Cancelling keeps the partial files, and downloading the same choice again
resumes them, as it does after a crash or a dropped connection.

The fit view estimates the memory the highlighted choice takes once loaded, with the expert dtype in
force (F2 changes it), read from the Hub in a worker without the weights: for a safetensors checkpoint
from its config.json and its shards' headers, for a GGUF quantisation from its file's header (every
part's, for a split one), which holds its metadata and every tensor's type and shape.
A GGUF the engine setting (or auto) would load with llama.cpp shows that engine's plan instead, decided as the
Models screen decides it (catalog.gguf_engine_plan). A safetensors choice that setting would not load (llama.cpp
reads GGUF files only; the native engine refuses some architectures) shows the line its load would stop with
instead of an estimate (engine.selection.not_gguf); a screen too short for all of it shows its brief.

Progress, status and buttons are docked at the bottom, so the Download button stays on screen at 80x24 whatever
the lines above it say. A finished download's folder, a long path, has a line of its own below the status: a short
screen cuts it to one line (the whole in its tooltip), so the fit view above keeps its bottom border.

Dismisses with what the engine loads (a cached repo id, or a .gguf path inside the cache) once a
download finished and the person chose to load it; None otherwise.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import replace
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, OptionList, ProgressBar, Static
from textual.widgets.option_list import Option

from moedesk.app import download as dl
from moedesk.app import pull_catalogue
from moedesk.app.tui.catalog import estimate_line, gguf_engine_plan
from moedesk.app.tui.load_target import LoadTarget, load_target
from moedesk.app.tui.widgets.fit_view import FitView
from moedesk.app.tui.widgets.load_panel import one_line
from moedesk.engine.errors import MoedeskError, UnsupportedModelError
from moedesk.engine.selection import not_gguf


# The Hub's rule for a repo id: an optional owner and a name of letters, digits and - _ . (no -- or ..,
# not starting or ending with - or .), at most 96 characters each.
_REPO_PART = r"(?!.*(--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_ID = re.compile(rf"(?:{_REPO_PART}/)?{_REPO_PART}")


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` cannot be a Hub repo id, in our words (the Hub library's own message is a paragraph)."""
    if not repo_id:
        return "type a repo id first: OWNER/NAME, e.g. Qwen/Qwen3-30B-A3B"
    if re.search(r"\s", repo_id):
        return f"{repo_id!r} has a space in it: a repo id is OWNER/NAME, e.g. Qwen/Qwen3-30B-A3B"
    if ":" in repo_id and "/" not in repo_id:
        return (f"{repo_id!r} is neither a repo id (OWNER/NAME) nor a short name moedesk knows "
                f"({', '.join(pull_catalogue.CATALOGUE)})")
    if repo_id.count("/") > 1:
        return f"{repo_id!r} has more than one /: a repo id is OWNER/NAME (a path inside a repo cannot be listed)"
    if not REPO_ID.fullmatch(repo_id):
        return (f"{repo_id!r} is not a repo id: OWNER/NAME of letters, digits, - _ and . "
                "(e.g. Qwen/Qwen3-30B-A3B)")
    return None


def short_name(text: str) -> pull_catalogue.PullTarget | None:
    """The repo and tag a `moedesk pull` short name stands for (`qwen3.5:35b`, `glm-4.5-air:q8_0`), None for
    anything else (a repo id is listed as typed)."""
    if "/" in text:
        return None
    try:
        return pull_catalogue.resolve(text)
    except MoedeskError:
        return None


def _unreachable(error: BaseException) -> bool:
    import httpx2
    from huggingface_hub.errors import LocalEntryNotFoundError

    cause = error.__cause__
    return isinstance(cause, (httpx2.TransportError, LocalEntryNotFoundError, ConnectionError))


def listing_error(error: BaseException) -> str:
    """One line for a failed listing. Nothing was downloaded yet, so a message that the download
    "resumes where it stopped" would promise something that never started."""
    if isinstance(error, dl.DownloadError) and _unreachable(error):
        from huggingface_hub import constants

        reason = str(error.__cause__).strip().splitlines()
        detail = f" ({reason[0].strip()})" if reason and reason[0].strip() else ""
        return f"cannot reach {constants.ENDPOINT}{detail}: check the network connection, then press Enter to list again"
    return one_line(error)


def choice_label(choice: dl.DownloadChoice) -> Text:
    text = Text(choice.label.ljust(26), style="bold")
    text.append(choice.file_count.rjust(9), style="dim")
    text.append(dl.format_bytes(choice.total_bytes).rjust(12))
    return text


def load_stop(choice: dl.DownloadChoice, weights, target: LoadTarget) -> str | None:
    """Where loading a safetensors choice with the target's engine setting would stop, in Engine.load's own line
    (after the model's name); None where it would load, for a GGUF, and before its headers are read."""
    if weights is None or choice.kind == "gguf":
        return None
    refusal = weights.problem if isinstance(weights, UnsupportedModelError) else None
    return not_gguf(target.engine, refusal, read=not isinstance(weights, str))


def brief(line: str) -> str:
    """A line's first clause, its parenthesised asides left out: what a short screen shows of it. The clause ends at
    the first ; or : outside parentheses (before the advice that follows)."""
    depth, kept = 0, []
    for char in line:
        if char == "(":
            depth += 1
        elif char == ")" and depth:
            depth -= 1
        elif depth == 0:
            if char in ";:":
                break
            kept.append(char)
    return " ".join("".join(kept).replace(" ,", ",").split())


def loaded_estimate(choice: dl.DownloadChoice, weights, target: LoadTarget) -> tuple[str, int | None]:
    """(the memory the choice takes once loaded, in words; its bytes, or None when not known). `weights`: the
    choice's ModelWeights once its headers are read, the native engine's refusal of it (UnsupportedModelError), the
    one line saying why they could not be read, or None."""
    if weights is None:
        if choice.kind == "gguf":
            return f"reading the GGUF header{'s' if len(choice.files) > 1 else ''} for an estimate…", None
        return "reading config.json and the shards' headers for an estimate…", None
    if (stop := load_stop(choice, weights, target)) is not None:
        return stop, None
    if isinstance(weights, UnsupportedModelError):  # a GGUF the native engine refuses: no estimate, as any error
        weights = one_line(weights)
    if isinstance(weights, str):
        return f"no estimate before downloading: {weights}", None
    if choice.kind == "gguf":  # a GGUF the engine setting (or auto) loads with llama.cpp: planned as its load plans
        engine, fit = gguf_engine_plan(weights.arch or "?", weights.llama_shape, target)
        if isinstance(fit, str):
            return f"{fit} · {engine.why}", None
        if fit is not None:
            return f"{fit.line()} · {engine.why}", fit.ram_bytes + fit.gpu_total
    estimate = weights.estimate(target.expert_dtype, target.weights_dtype, target.gpu)
    text = estimate_line(estimate, target.gpu, dl.format_bytes)
    return f"{text} · expert dtype {target.expert_dtype} (F2)", estimate.total_bytes


def model_spec(listing: dl.RepoListing, choice: dl.DownloadChoice, snapshot: Path) -> str:
    """What `--model` takes for a finished download, as `moedesk download` prints it."""
    if choice.kind == "gguf":
        return str(snapshot / sorted(p for p in choice.files if p.endswith(".gguf"))[0])
    # A repo id finds the default branch's snapshot; another revision is only reachable by its folder.
    return listing.repo_id if listing.revision in (None, "main") else str(snapshot)


class DownloadScreen(Screen[str | None]):
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]  # -short: a load's stop shows its brief (FitView)
    BINDINGS = [
        Binding("escape", "back", "Back / cancel download"),
        Binding("ctrl+l", "focus_repo", "Repo id"),
        Binding("f2", "app.settings", "Settings"),
    ]

    class Listed(Message):
        def __init__(self, serial: int, listing: dl.RepoListing | None, fits: dict[str, dl.FitReport],
                     error: str = ""):
            super().__init__()
            self.serial, self.listing, self.fits, self.error = serial, listing, fits, error

    class Finished(Message):
        def __init__(self, choice: dl.DownloadChoice, spec: str, snapshot: Path):
            super().__init__()
            self.choice, self.spec, self.snapshot = choice, spec, snapshot

    class Stopped(Message):
        def __init__(self, error: str, cancelled: bool):
            super().__init__()
            self.error, self.cancelled = error, cancelled

    class HeadersRead(Message):
        def __init__(self, serial: int, name: str, weights):
            super().__init__()
            self.serial, self.name, self.weights = serial, name, weights  # ModelWeights, or why not in one line

    def __init__(self, repo_id: str = "", revision: str = ""):
        super().__init__()
        self.initial = (repo_id, revision)
        self.listing: dl.RepoListing | None = None
        self.fits: dict[str, dl.FitReport] = {}
        self.downloading = False
        self.spec: str | None = None  # set when a download finished: what "Load model" hands on
        self._cancel = threading.Event()
        self._serial = 0  # of the last listing asked for: an older one arriving late is dropped
        self.weights: dict[str, object] = {}  # choice name -> ModelWeights or why not; absent: not read (yet)
        self._reading: set[str] = set()
        self.target: LoadTarget | None = None  # what the estimate shown is for
        self.wanted: pull_catalogue.PullTarget | None = None  # what a short name typed asks for

    def compose(self) -> ComposeResult:
        repo_id, revision = self.initial
        yield Header()
        with Vertical(id="download-body"):
            with Horizontal(id="download-repo-row"):
                yield Input(repo_id, placeholder="repo id on the Hugging Face Hub, e.g. Qwen/Qwen3-30B-A3B, or a "
                                                 "short name: qwen3.5:35b", id="download-repo")
                yield Input(revision, placeholder="revision: main", id="download-revision")
                yield Button("List files", id="download-list")
            yield OptionList(id="download-choices")
            yield FitView(id="download-fit")
            with Vertical(id="download-foot"):
                yield ProgressBar(total=None, show_eta=False, id="download-bar")
                yield Static("", id="download-status", markup=False)
                yield Static("", id="download-where", markup=False)
                with Horizontal(id="download-buttons"):
                    yield Button("Download", variant="primary", id="download-start", disabled=True)
                    yield Button("Cancel", id="download-cancel", disabled=True)
                    yield Button("Load model", variant="success", id="download-load", disabled=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "download"
        self.target = load_target(self.app)
        self.query_one("#download-choices", OptionList).border_title = "choices"
        self.query_one("#download-repo", Input).focus()
        self._status(f"Enter lists the repo's files; downloads go to {dl.hf_cache_dir()}")

    def on_unmount(self) -> None:
        # Leaving (or quitting the app) stops a download at its next chunk; the partial file stays for next time.
        self._cancel.set()

    # -------------------------------------------------------------- helpers

    def _status(self, text: str, kind: str = "", where: Path | None = None) -> None:
        """`where`: the folder a finished download is in, shown below the status (hidden for any other status)."""
        status = self.query_one("#download-status", Static)
        status.update(text)
        for name in ("error", "warning", "ok"):
            status.set_class(kind == name, f"-{name}")
        folder = self.query_one("#download-where", Static)
        folder.update(f"files in {where}" if where is not None else "")
        folder.tooltip = str(where) if where is not None else None
        folder.set_class(where is not None, "-shown")

    @property
    def choices(self) -> OptionList:
        return self.query_one("#download-choices", OptionList)

    def highlighted_choice(self) -> dl.DownloadChoice | None:
        index = self.choices.highlighted
        if self.listing is None or index is None or not 0 <= index < len(self.listing.choices):
            return None
        return self.listing.choices[index]

    def _set_buttons(self) -> None:
        cancelling = self._cancel.is_set()
        self.query_one("#download-start", Button).disabled = self.downloading or self.highlighted_choice() is None
        self.query_one("#download-cancel", Button).disabled = not self.downloading or cancelling
        load = self.query_one("#download-load", Button)
        load.disabled = self.downloading or self.spec is None
        load.set_class(self.spec is not None, "-ready")
        for wid in ("#download-repo", "#download-revision", "#download-list"):
            self.query_one(wid).disabled = self.downloading

    def _forget_listing(self) -> None:
        self.listing, self.fits = None, {}
        self.weights, self._reading = {}, set()
        self.choices.clear_options()
        self.query_one(FitView).clear()
        self.query_one("#download-bar", ProgressBar).remove_class("-started")
        self._set_buttons()

    # -------------------------------------------------------------- listing

    @on(Input.Submitted, "#download-repo, #download-revision")
    @on(Button.Pressed, "#download-list")
    def list_files(self) -> None:
        if self.downloading:
            return
        repo_id = self.query_one("#download-repo", Input).value.strip()
        revision = self.query_one("#download-revision", Input).value.strip() or None
        self.wanted = short_name(repo_id)
        if self.wanted is not None:
            repo_id = self.wanted.repo_id
        problem = repo_id_problem(repo_id)
        if problem:
            self._status(problem, "error")
            self.query_one("#download-repo", Input).focus()
            return
        self._serial += 1
        self.spec = None
        self._forget_listing()
        self._status(f"listing the files of {repo_id}…")
        self._list(self._serial, repo_id, revision)

    @work(thread=True, exclusive=True, group="download-list", exit_on_error=False)
    def _list(self, serial: int, repo_id: str, revision: str | None) -> None:
        try:
            listing = dl.list_repo_files_with_sizes(repo_id, revision)
            fits = {}
            if listing.choices:
                # Disk, RAM and VRAM are measured once; only the size differs between choices.
                base = dl.check_fits(listing.choices[0].total_bytes)
                fits = {c.name: replace(base, needed_bytes=c.total_bytes, margin_bytes=dl.disk_margin(c.total_bytes))
                        for c in listing.choices}
        except Exception as e:  # noqa: BLE001 - every failure becomes one line on screen
            self.post_message(self.Listed(serial, None, {}, listing_error(e)))
            return
        self.post_message(self.Listed(serial, listing, fits))

    def on_download_screen_listed(self, message: Listed) -> None:
        if message.serial != self._serial:
            return
        if message.listing is None:
            self._status(message.error, "error")
            self.query_one("#download-repo", Input).focus()
            return
        listing = self.listing = message.listing
        self.fits = message.fits
        where = f"{listing.repo_id} @ {listing.commit[:12]}"
        if not listing.choices:
            self._status(f"{where}: no .safetensors or .gguf weights to download", "error")
            self._set_buttons()
            return
        self.choices.add_options(Option(choice_label(c), id=c.name) for c in listing.choices)
        default, missing = listing.default_choice(), ""
        if self.wanted is not None:
            try:
                default = pull_catalogue.pick_choice(listing, self.wanted.tag)
            except MoedeskError:
                missing = f" · no {self.wanted.tag} here"
        self.choices.highlighted = listing.choices.index(default) if default is not None else 0
        self.choices.focus()
        self._set_buttons()
        count = f"{len(listing.choices)} choice" + ("s" if len(listing.choices) != 1 else "") + missing
        if listing.gated:
            self._status(f"{where}: {count} · gated model: accept its licence on the Hub and log in with "
                         "`hf auth login` first, or the download is refused", "warning")
        else:
            self._status(f"{where}: {count} · ↑↓ pick one, Enter downloads it")

    @on(OptionList.OptionHighlighted, "#download-choices")
    def choice_highlighted(self) -> None:
        choice = self.highlighted_choice()
        unread = choice is not None and choice.name not in self.weights and choice.name not in self._reading
        if unread:
            self._reading.add(choice.name)
            self._read_headers(self._serial, self.listing, choice)
        self._show_fit()
        self._set_buttons()

    def _show_fit(self) -> None:
        choice = self.highlighted_choice()
        if choice is not None and choice.name in self.fits:
            weights = self.weights.get(choice.name)
            loaded, loaded_bytes = loaded_estimate(choice, weights, self.target)
            stop = load_stop(choice, weights, self.target)
            self.query_one(FitView).show(choice, self.fits[choice.name], loaded, loaded_bytes,
                                         brief(stop) if stop else "")

    @work(thread=True, group="download-headers", exit_on_error=False)
    def _read_headers(self, serial: int, listing: dl.RepoListing, choice: dl.DownloadChoice) -> None:
        try:
            weights = dl.read_choice_weights(listing, choice)
        except UnsupportedModelError as refusal:  # kept whole: what the engine setting makes of it (`loaded_estimate`)
            weights = refusal
        except Exception as e:  # noqa: BLE001 - an estimate is advice: one line says why there is none
            weights = one_line(e)
        self.post_message(self.HeadersRead(serial, choice.name, weights))

    def on_download_screen_headers_read(self, message: HeadersRead) -> None:
        if message.serial != self._serial:
            return
        self._reading.discard(message.name)
        self.weights[message.name] = message.weights
        self._show_fit()

    def on_screen_resume(self) -> None:
        """Back from the settings: the estimate follows a changed expert or weights dtype (see ModelsScreen)."""
        self.app.call_next(self._follow_settings)

    def _follow_settings(self) -> None:
        target = load_target(self.app)
        if target != self.target and self.is_attached:
            self.target = target
            self._show_fit()

    # -------------------------------------------------------------- downloading

    @on(OptionList.OptionSelected, "#download-choices")
    @on(Button.Pressed, "#download-start")
    def start_download(self) -> None:
        choice = self.highlighted_choice()
        if self.downloading:
            self.notify("A download is running: Esc cancels it.", severity="warning")
            return
        if self.listing is None or choice is None:
            return
        self.downloading = True
        self.spec = None
        self._cancel = threading.Event()
        self.choices.focus()  # not the buttons: they turn disabled, and a second Enter must not cancel
        self._set_buttons()
        bar = self.query_one("#download-bar", ProgressBar)
        bar.update(total=None, progress=0)
        bar.add_class("-started")
        self._status(f"downloading {choice.description}…")
        self._download(self.listing, choice, self._cancel)

    @work(thread=True, exclusive=True, group="download", exit_on_error=False)
    def _download(self, listing: dl.RepoListing, choice: dl.DownloadChoice, cancel: threading.Event) -> None:
        first: tuple[float, int] | None = None  # (time, bytes) of the first report: bytes found on disk are no speed

        def progress(done: int, total: int) -> None:
            nonlocal first
            if cancel.is_set():
                return  # the screen may be going away; download() raises DownloadCancelled at the next chunk
            now = time.monotonic()
            if first is None:
                first = (now, done)
            rate = (done - first[1]) / (now - first[0]) if now > first[0] else 0.0
            self.app.call_from_thread(self._show_progress, done, total, first[1], rate)

        try:
            snapshot = dl.download(listing.repo_id, listing.revision, list(choice.include), progress=progress,
                                   cancel=cancel)
        except dl.DownloadCancelled as e:
            self.post_message(self.Stopped(str(e), cancelled=True))
            return
        except Exception as e:  # noqa: BLE001 - every failure becomes one line on screen
            self.post_message(self.Stopped(one_line(e), cancelled=False))
            return
        self.post_message(self.Finished(choice, model_spec(listing, choice, snapshot), snapshot))

    def _show_progress(self, done: int, total: int, on_disk_before: int, rate: float) -> None:
        if not self.downloading or self._cancel.is_set():
            return
        self.query_one("#download-bar", ProgressBar).update(total=max(total, 1), progress=done)
        text = f"{dl.format_bytes(done)} of {dl.format_bytes(total)}"
        if rate > 0:
            text += f" · {dl.format_bytes(rate)}/s"
        if on_disk_before:
            text += f" · resumed: {dl.format_bytes(on_disk_before)} were on disk already"
        self._status(text + " · Esc cancels")

    def on_download_screen_finished(self, message: Finished) -> None:
        self.downloading = False
        self.spec = message.spec
        bar = self.query_one("#download-bar", ProgressBar)
        bar.update(total=max(message.choice.total_bytes, 1), progress=max(message.choice.total_bytes, 1))
        self._set_buttons()
        self.query_one("#download-load", Button).focus()
        self._status(f"downloaded {message.choice.description} · Enter loads it, Esc goes back", "ok",
                     where=message.snapshot)

    def on_download_screen_stopped(self, message: Stopped) -> None:
        self.downloading = False
        bar = self.query_one("#download-bar", ProgressBar)
        if bar.total is None:
            bar.remove_class("-started")  # stopped before a byte was counted: nothing to show
        self._set_buttons()
        self.query_one("#download-start", Button).focus()
        self._status(message.error, "warning" if message.cancelled else "error")

    def action_cancel_download(self) -> None:
        if not self.downloading or self._cancel.is_set():
            return
        self._cancel.set()
        self._set_buttons()
        self._status("cancelling… (the download stops after the chunk in flight)", "warning")

    @on(Button.Pressed, "#download-cancel")
    def cancel_pressed(self) -> None:
        self.choices.focus()
        self.action_cancel_download()

    # -------------------------------------------------------------- leaving

    @on(Button.Pressed, "#download-load")
    def load_pressed(self) -> None:
        if self.spec is not None and not self.downloading:
            self.dismiss(self.spec)

    def action_back(self) -> None:
        if self.downloading:
            self.action_cancel_download()  # a second Esc, once it stopped, leaves
            return
        self.dismiss(None)

    def action_focus_repo(self) -> None:
        self.query_one("#download-repo", Input).focus()
