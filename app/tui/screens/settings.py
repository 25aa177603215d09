"""The settings form, built from `app.tui.settings.FIELDS`: one row per field, checked as you type.

Dismisses with the saved `Settings`, or None when cancelled. Esc over changes that are not saved warns
first and leaves at the second Esc in a row, so one stray key does not throw away a system prompt.
"""
from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Button, Footer, Header, Input, Label, Select, Static, Switch, TextArea

from moedesk.app.tui.settings import (FIELDS, FIELDS_BY_NAME, SAMPLING_FALLBACKS, SettingField, Settings, save_settings,
                                      settings_path)


def home_short(path) -> str:
    """A path with the home folder as ~: the settings file's place fits the buttons' line at 80 columns."""
    from pathlib import Path

    path, home = Path(path), Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


def blank_means(field: SettingField, model_defaults: dict | None) -> str:
    """An empty box's placeholder: what a blank value stands for (a sampling value: the model's own default)."""
    if field.name in SAMPLING_FALLBACKS:
        if model_defaults and field.name in model_defaults:
            return f"blank: {field.format(model_defaults[field.name])}, the model's default"
        return f"blank: {field.format(SAMPLING_FALLBACKS[field.name])}"
    return "blank: automatic" if field.optional else field.format(field.default)


def editor_for(field: SettingField, value, model_defaults: dict | None = None) -> Widget:
    """The widget that edits one field; its id is `setting-<name>`."""
    wid = f"setting-{field.name}"
    kind = field.kind
    if kind == "bool":
        return Switch(value=bool(value), id=wid)
    if kind == "choice":
        return Select([(str(c), c) for c in field.choices], value=value, allow_blank=field.optional, id=wid,
                      compact=True)
    if kind == "text":
        return TextArea(field.format(value), id=wid, soft_wrap=True, classes="setting-text", compact=True)
    placeholder = blank_means(field, model_defaults)
    # No `restrict`: it dropped what did not match without a word ("-5" became "5"); what is typed stays,
    # and the check under the field says what is wrong with it.
    return Input(field.format(value), placeholder=placeholder, id=wid, compact=True)


class SettingsScreen(Screen[Settings | None]):
    BINDINGS = [
        Binding("ctrl+s", "save", "Save"),
        Binding("escape", "cancel", "Cancel"),
        # priority: the focused Input or TextArea takes ctrl+d as "delete right" otherwise
        Binding("ctrl+d", "defaults", "Defaults", priority=True),
    ]

    def __init__(self, settings: Settings, path=None, model_defaults: dict | None = None,
                 notes: dict[str, str] | None = None):
        """notes: a line about this machine under a field's help (the Speculative setting: whether it can pay)."""
        super().__init__()
        self.notes = notes or {}
        self.initial = settings
        self.path = path
        self.model_defaults = model_defaults  # the loaded model's sampling defaults, shown in blank boxes
        self.errors: dict[str, str] = {}
        self.shown: dict[str, object] = {}  # each field's editor value as the form opened
        self.cancel_warned = False  # Esc said there are unsaved changes, and nothing changed since

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="settings-form"):
            for field in FIELDS:
                with Horizontal(classes="setting-row", id=f"row-{field.name}"):
                    yield Label(field.label, classes="setting-label")
                    with Vertical(classes="setting-body"):
                        yield editor_for(field, getattr(self.initial, field.name), self.model_defaults)
                        yield Static(field.help, classes="setting-help", markup=False)
                        if self.notes.get(field.name):
                            yield Static(self.notes[field.name], classes="setting-note", id=f"note-{field.name}",
                                         markup=False)
                        yield Static("", classes="setting-error", id=f"error-{field.name}", markup=False)
        with Horizontal(id="settings-buttons"):
            yield Static(f"saved in {home_short(self.path or settings_path())}", classes="setting-help",
                         id="settings-file", markup=False)
            yield Button("Save", variant="primary", id="save", compact=True)
            yield Button("Cancel", id="cancel", compact=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "settings"
        first = self.query_one(f"#setting-{FIELDS[0].name}")
        first.focus()
        self.shown = {field.name: self.raw_value(field) for field in FIELDS}
        for select in self.query("#settings-form Select"):
            self.watch(select, "expanded", self._on_list_toggled(select), init=False)

    def _on_list_toggled(self, select: Select):
        def toggled(expanded: bool) -> None:  # one parameter: Textual passes (old, new) to a callback taking two
            if expanded:
                self.call_after_refresh(self._room_for, select)
        return toggled

    def _room_for(self, select: Select) -> None:
        """Scroll the form so that an opened list fits above the buttons: it floats over the screen and, on a
        field near the bottom, covered the buttons and the footer."""
        form = self.query_one("#settings-form", VerticalScroll)
        overlay = select.query_one("SelectOverlay")
        below = overlay.region.bottom - form.region.bottom
        if below > 0:
            form.scroll_relative(y=below, animate=False, immediate=True)

    def changed(self) -> bool:
        """The form holds something other than what it opened with."""
        return bool(self.shown) and any(self.raw_value(field) != self.shown[field.name] for field in FIELDS)

    # -------------------------------------------------------------- reading the form

    def raw_value(self, field: SettingField):
        widget = self.query_one(f"#setting-{field.name}")
        if isinstance(widget, Switch):
            return widget.value
        if isinstance(widget, Select):
            return None if widget.is_blank() else widget.value
        if isinstance(widget, TextArea):
            return widget.text
        return widget.value

    def check(self, field: SettingField):
        """Parse one field, show or clear its error; returns (ok, value)."""
        raw = self.raw_value(field)
        try:
            value = field.parse(raw) if isinstance(raw, str) else field.coerce(raw)
            self.errors.pop(field.name, None)
            ok = True
        except ValueError as e:
            self.errors[field.name] = str(e)
            value, ok = None, False
        error = self.query_one(f"#error-{field.name}", Static)
        error.update(self.errors.get(field.name, ""))
        error.display = not ok
        self.query_one(f"#row-{field.name}").set_class(not ok, "-invalid")
        return ok, value

    def collect(self) -> Settings | None:
        values = {}
        for field in FIELDS:
            ok, value = self.check(field)
            if ok:
                values[field.name] = value
        if self.errors:
            return None
        return Settings(**values)

    @on(Input.Changed)
    @on(TextArea.Changed)
    @on(Switch.Changed)
    @on(Select.Changed)
    def field_changed(self, event) -> None:
        widget = getattr(event, "input", None) or getattr(event, "text_area", None) \
            or getattr(event, "switch", None) or getattr(event, "select", None) or event.control
        name = (widget.id or "").removeprefix("setting-")
        if name in FIELDS_BY_NAME:
            self.check(FIELDS_BY_NAME[name])
            self.cancel_warned = False

    # -------------------------------------------------------------- actions

    def action_save(self) -> None:
        settings = self.collect()
        if settings is None:
            name = next(iter(self.errors))
            self.notify(f"{FIELDS_BY_NAME[name].label}: {self.errors[name]}", severity="error")
            self.query_one(f"#setting-{name}").focus()
            return
        problems: list[str] = []
        try:
            save_settings(settings, self.path, problems)
        except OSError as e:
            self.notify(f"could not save settings: {e}", severity="error")
            return
        for problem in problems:
            self.notify(problem, title="settings", severity="warning", timeout=10)
        self.dismiss(settings)

    def action_cancel(self) -> None:
        if self.changed() and not self.cancel_warned:
            self.cancel_warned = True
            self.notify("The changes are not saved: Esc again leaves without them, ctrl+s saves them.",
                        severity="warning")
            return
        self.dismiss(None)

    def action_defaults(self) -> None:
        defaults = Settings()
        for field in FIELDS:
            widget = self.query_one(f"#setting-{field.name}")
            value = getattr(defaults, field.name)
            if isinstance(widget, (Switch, Select)):
                widget.value = value
            elif isinstance(widget, TextArea):
                widget.text = field.format(value)
            else:
                widget.value = field.format(value)

    @on(Button.Pressed, "#save")
    def _save_pressed(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel_pressed(self) -> None:
        self.dismiss(None)  # the button says what it does; only Esc, easy to press by mistake, asks twice
