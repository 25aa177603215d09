"""The moedesk terminal app (Textual).

    from moedesk.app.tui import run_app, MoedeskApp

`app.tui.settings`, `app.tui.storage` and `app.tui.catalog` do not import Textual, so the
command line can reuse the settings without paying for the UI.
"""
from __future__ import annotations

__all__ = ["MoedeskApp", "run_app"]


def __getattr__(name: str):
    if name in __all__:
        from moedesk.app.tui import app as _app

        return getattr(_app, name)
    raise AttributeError(f"module 'moedesk.app.tui' has no attribute {name!r}")
