"""The settings screen's geometry (issue 46, item 8): the settings file's line does not wrap mid-word at 80
columns, and an opened list (Speculative decoding) never covers the buttons or the footer."""
from __future__ import annotations

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.screens.settings import home_short
from tests.tui.helpers import chat_ready, greedy_settings, open_settings, wait_for

pytestmark = pytest.mark.anyio


def overlaps(a, b) -> bool:
    return a.x < b.right and b.x < a.right and a.y < b.bottom and b.y < a.bottom


@pytest.mark.parametrize("size", [(120, 40), (80, 24), (160, 50)])
async def test_an_opened_list_stays_above_the_buttons_and_the_footer(engine, size):
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        await open_settings(pilot)
        screen = app.screen
        form, select = screen.query_one("#settings-form"), screen.query_one("#setting-speculative")
        # The field near the bottom of the form, as scrolling leaves it, then a click opens its list.
        form.scroll_to(y=form.scroll_y + select.region.y - (form.region.bottom - 3), animate=False, immediate=True)
        await pilot.pause()
        assert form.region.bottom - 4 <= select.region.y < form.region.bottom
        await pilot.click(select, offset=(2, 0))
        await wait_for(pilot, lambda: select.expanded, what="the list")
        await pilot.pause()
        overlay = select.query_one("SelectOverlay")
        assert overlay.region.height >= 4  # off, greedy, beam, auto
        for other in ("#settings-buttons", "Footer"):
            assert not overlaps(overlay.region, screen.query_one(other).region), (other, overlay.region)
        assert overlay.region.bottom <= screen.query_one("#settings-form").region.bottom
        await pilot.press("down", "enter")  # ...and the list still works: greedy chosen
        await pilot.pause()
        assert select.value == "greedy"


async def test_the_settings_files_line_is_one_line_at_80_columns(engine, tui_dirs):
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        await open_settings(pilot)
        line = app.screen.query_one("#settings-file")
        assert line.region.height == 1  # wrapped, it broke "settin / gs.json" over three lines
        shown = str(line.render())
        assert shown.startswith("saved in ") and line.region.width >= 30


def test_the_home_folder_is_a_tilde(tmp_path):
    from pathlib import Path

    assert home_short(Path.home() / ".config" / "moedesk" / "settings.json") == "~/.config/moedesk/settings.json"
    assert home_short(Path("/etc/moedesk.json")) == "/etc/moedesk.json"
