"""Issue 18: the app as a daily tool — nothing typed is lost, it fits 80x24, it says what it is doing."""
from __future__ import annotations

from pathlib import Path

import pytest
from textual import events

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.storage import Conversation, ConversationStore
from moedesk.app.tui.widgets.messages import UserMessage
from tests.tui.helpers import chat_ready, greedy_settings, open_models, open_settings, wait_for, wait_idle

pytestmark = pytest.mark.anyio

CODE = "Fix this code:\ndef add(a, b):\n    return a - b\n"


async def open_chat(pilot):
    await wait_for(pilot, lambda: chat_ready(pilot.app), what="the chat")
    await pilot.click("#prompt")


# ---------------------------------------------------------------- 1. multi-line input


async def test_a_pasted_message_keeps_every_line(engine):
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=4))
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        app.post_message(events.Paste(CODE))  # as the terminal driver delivers a paste
        await pilot.pause()
        await pilot.press("enter")
        await wait_idle(pilot, app)
        sent = app.chat.conversation.messages[0]
        assert sent.role == "user" and sent.content == CODE.rstrip("\n")
        assert ConversationStore().load(app.chat.conversation.id).messages[0].content == CODE.rstrip("\n")
        assert "return a - b" in str(app.chat.query(UserMessage).first().render())
        assert app.chat.prompt.text == ""


async def test_new_line_keys_and_the_box_grows_then_scrolls(engine):
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=4))
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        prompt = app.chat.prompt
        one_line = prompt.outer_size.height
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        await pilot.pause()
        assert prompt.text == "a\nb\nc"
        assert prompt.outer_size.height == one_line + 2
        for n in range(20):
            await pilot.press("ctrl+j", "x")
        await pilot.pause()
        assert prompt.outer_size.height <= 8  # a few lines, then it scrolls
        assert prompt.max_scroll_y > 0
        assert not app.chat.conversation.messages  # nothing was sent by a new line
        await pilot.press("enter")
        await wait_idle(pilot, app)
        assert app.chat.conversation.messages[0].content == "a\nb\nc" + "\nx" * 20
        assert prompt.outer_size.height == one_line


# ---------------------------------------------------------------- 9. earlier prompts


async def test_up_in_an_empty_box_recalls_earlier_prompts(engine):
    store = ConversationStore()
    old = Conversation()
    old.add("user", "first question")
    old.add("assistant", "an answer")
    store.save(old)
    store.remember(old.id)
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=4))
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        await pilot.press(*"second", "enter")
        await wait_idle(pilot, app)
        prompt = app.chat.prompt
        await pilot.press("up")
        assert prompt.text == "second"
        await pilot.press("up")
        assert prompt.text == "first question"
        await pilot.press("up")
        assert prompt.text == "first question"  # the oldest stays
        await pilot.press("down")
        assert prompt.text == "second"
        await pilot.press("down")
        assert prompt.text == ""
        # ↑ inside a message being written moves the cursor, it does not replace the text.
        await pilot.press("a", "ctrl+j", "b", "up")
        assert prompt.text == "a\nb" and prompt.cursor_location[0] == 0


# ---------------------------------------------------------------- 7. stats panel


def test_legend_comes_first_and_names_only_places_the_machine_has():
    from moedesk.app.tui.widgets.heatmap import layout, render_lines

    layers = 30
    in_ram = layout([[False] * 8] * layers, [[1] * 8] * layers, width=40)
    lines = [line.plain for line in render_lines(in_ram, device="cpu", width=40)]
    first_layer = next(n for n, line in enumerate(lines) if line.split()[:1] == ["L0"])
    legend = "\n".join(lines[:first_layer])
    assert first_layer <= 3 and "in RAM (no GPU)" in legend and "picked" in legend
    assert "GPU" not in legend.replace("(no GPU)", "")
    mixed = layout([[True, False]], [[1, 2]], width=40)
    legend = "\n".join(line.plain for line in render_lines(mixed, device="cuda", width=40)[:2])
    assert "on GPU" in legend and "in RAM" in legend and "no GPU" not in legend
    assert all(len(line) <= 30 for line in (line.plain for line in render_lines(mixed, device="cpu", width=30)))


async def test_speed_scale_and_a_new_chat_clears_the_map(engine):
    from moedesk.app.tui.widgets.heatmap import ExpertHeatMap

    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=6))
    async with app.run_test(size=(160, 50)) as pilot:
        await open_chat(pilot)
        for prompt in ("Hi", "Again"):
            await pilot.press(*prompt, "enter")
            await wait_idle(pilot, app)
        speeds = [m.meta["stats"]["decode_tok_s"] for m in app.chat.conversation.messages if m.role == "assistant"]
        scale = str(app.chat.stats.query_one("#stats-speed-scale").render())
        assert f"{min(speeds):,.1f}" in scale and f"{max(speeds):,.1f} tok/s" in scale
        heatmap = app.chat.query_one(ExpertHeatMap)
        assert heatmap.current_layout().max_count > 0
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert heatmap.current_layout().max_count == 0  # the old chat's picks are gone
        await pilot.press(*"Hello", "enter")
        await wait_idle(pilot, app)
        total = sum(c.count for row in heatmap.current_layout().rows for c in row)
        assert total > 0
        on_gpu, popularity = engine.expert_map()
        assert total < sum(map(sum, popularity))  # only this chat's picks


# ---------------------------------------------------------------- 3. fits 80x24


LONG_LINE = "class Account:\n    def __init__(self, account_number, owner_name, balance=0, currency='EUR', overdraft=0):\n"


async def test_at_80x24_the_chat_has_the_width_and_nothing_is_cut(engine):
    from textual.widgets._footer import FooterKey
    from textual.widgets.markdown import MarkdownFence

    store = ConversationStore()
    c = Conversation()
    c.add("user", "code please")
    c.add("assistant", f"```python\n{LONG_LINE}```\n", tokens=5)
    store.save(c)
    store.remember(c.id)
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        await pilot.pause()
        chat = app.chat
        assert chat.stats.has_class("-hidden") and chat.query_one("#chat-column").size.width >= 78
        keys = {key.action: key for key in app.screen.query(FooterKey)}
        assert "quit" in keys and keys["quit"].region.right <= 80 and keys["quit"].region.width > 0
        fence = chat.query_one(MarkdownFence)
        assert fence.max_scroll_x > 0 and fence.scrollbar_size_horizontal == 1  # scrolls, and shows that it does

        await pilot.press("ctrl+t")  # asked for: shown even at 80 columns
        await pilot.pause()
        assert not chat.stats.has_class("-hidden")
        context = chat.stats.query_one("#stats-context")
        assert all(len(line) <= context.content_size.width for line in str(context.render()).splitlines())
        await pilot.resize_terminal(160, 50)
        await pilot.pause()
        assert not chat.stats.has_class("-hidden")
        await pilot.press("ctrl+t")
        assert chat.stats.has_class("-hidden")


async def test_wide_screens_show_the_stats_panel_unasked(engine):
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(160, 50)) as pilot:
        await open_chat(pilot)
        assert not app.chat.stats.has_class("-hidden")
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert app.chat.stats.has_class("-hidden")


async def test_models_table_fits_80_columns(engine, tui_dirs, tiny_folder):
    import shutil

    long_name = "a-rather-long-model-name-as-hub-repos-have-it-Instruct-2507"
    shutil.copytree(tiny_folder, tui_dirs["models"] / "acme" / long_name)
    (tui_dirs["models"] / "broken-with-a-long-name.gguf").write_bytes(b"not a gguf file at all")
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        await open_models(pilot)
        await pilot.pause()
        table = app.screen.query_one("#models-table")
        assert table.virtual_size.width <= table.scrollable_content_region.width
        names = [m.name for m in app.screen.models]
        table.move_cursor(row=names.index(f"acme/{long_name}"))
        await pilot.pause()
        assert f"acme/{long_name}" in str(app.screen.query_one("#models-note").render())


# ---------------------------------------------------------------- 4. deleting asks first; 9. exchanges


async def test_deleting_a_chat_asks_first(engine):
    from moedesk.app.tui.screens.conversations import ConversationsScreen
    from moedesk.app.tui.screens.dialogs import ConfirmScreen

    store = ConversationStore()
    older, current = Conversation(id="20250101-000000-aaaaaa"), Conversation(id="20250102-000000-bbbbbb")
    for n in range(3):
        older.add("user", f"question {n}")
        older.add("assistant", f"answer {n}")
    current.add("user", "current question")
    store.save(older)
    store.save(current)
    store.remember(current.id)
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen), what="the picker")
        picker = app.screen
        options = picker.query_one("#conversations")
        shown = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert any("question 0" in s and "3 exchanges" in s for s in shown)  # 6 messages, 3 exchanges
        options.highlighted = [i.id for i in picker.infos].index(older.id)
        for no in ("n", "escape", "enter"):  # Enter lands on Keep: a stray Enter deletes nothing
            await pilot.press("delete")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            assert "question 0" in str(app.screen.query_one(".dialog-question").render())
            await pilot.press(no)
            await wait_for(pilot, lambda: app.screen is picker, what="the picker again")
            assert store.path(older.id).exists() and options.option_count == 2
        await pilot.press("delete")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
        await pilot.press("y")
        await wait_for(pilot, lambda: options.option_count == 1, what="the deletion")
        assert not store.path(older.id).exists() and store.path(current.id).exists()


# ---------------------------------------------------------------- 6. settings


async def test_settings_show_focus_and_keep_bad_input_with_a_message(engine):
    from moedesk.app.tui.settings import Settings

    app = MoedeskApp(engine, settings=Settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        await open_settings(pilot)
        screen = app.screen
        top_k = screen.query_one("#setting-top_k")
        top_k.focus()
        await pilot.pause()
        focused_row, other_row = screen.query_one("#row-top_k"), screen.query_one("#row-temperature")
        assert focused_row.styles.background != other_row.styles.background
        assert focused_row.styles.border_left[1] != other_row.styles.border_left[1]
        assert screen.query_one("#row-top_k .setting-label").styles.color != \
            screen.query_one("#row-temperature .setting-label").styles.color

        top_k.value = ""
        await pilot.press("-", "5")
        await pilot.pause()
        assert top_k.value == "-5"  # kept as typed, not quietly turned into 5
        assert str(screen.query_one("#error-top_k").render()) == "must be ≥ 0 and ≤ 1,000,000"
        top_k.value = ""
        await pilot.press("1", "x")
        await pilot.pause()
        assert top_k.value == "1x" and "whole number" in str(screen.query_one("#error-top_k").render())
        temperature = screen.query_one("#setting-temperature")
        temperature.focus()
        temperature.value = ""
        await pilot.press("a", "b", "c")
        assert temperature.value == "abc" and "number" in str(screen.query_one("#error-temperature").render())
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen  # refused to save
        await pilot.press("ctrl+d")  # defaults, though an input box has the focus
        await pilot.pause()
        # Sampling defaults are the model's own now (#46.3): a blank box, its placeholder saying what it stands for.
        assert temperature.value == "" and top_k.value == ""


# ---------------------------------------------------------------- 8. load errors and the download wizard


async def test_a_failed_start_offers_what_works_and_old_chats_can_be_read(engine):
    from textual.widgets._footer import FooterKey

    from moedesk.app.tui.screens.download import DownloadScreen
    from moedesk.app.tui.screens.loading import LoadingScreen
    from moedesk.app.tui.screens.models import ModelsScreen

    store = ConversationStore()
    old = Conversation()
    old.add("user", "what did we say?")
    old.add("assistant", "something worth reading again")
    store.save(old)
    store.remember(old.id)

    def factory(model, progress):
        raise RuntimeError("no such model")

    app = MoedeskApp(factory, model="acme/missing-model")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen) and not app.screen.panel.busy,
                       what="the error")
        await pilot.pause()
        offered = {key.action for key in app.screen.query(FooterKey)}
        assert "cancel" not in offered and {"retry", "download", "read_chats"} <= offered
        hint = str(app.screen.query_one("#loading-hint").render())
        assert "F6 download it here" in hint and "old chats" in hint
        await pilot.press("f6")
        await wait_for(pilot, lambda: isinstance(app.screen, DownloadScreen), what="the download wizard")
        assert app.screen.query_one("#download-repo").value == "acme/missing-model"  # what failed to load
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen), what="the models screen")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen), what="the error again")
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: chat_ready(app), what="the chat without a model")
        assert app.engine is None and app.chat.conversation.id == old.id
        assert "something worth reading again" in app.chat.query_one("AssistantMessage").text
        await pilot.press(*"hello", "enter")
        await pilot.pause()
        assert "No model loaded" in str(app.chat.query_one("#chat-status").render())
        assert len(app.chat.conversation.messages) == 2


def test_repo_id_problems_in_plain_words():
    from moedesk.app.tui.screens.download import repo_id_problem

    assert repo_id_problem("Qwen/Qwen3-30B-A3B") is None and repo_id_problem("gpt2") is None
    for bad in ("qwen 3", "a/b/c", "bad!/name", "owner/", "-x/y", "x/y--z"):
        problem = repo_id_problem(bad)
        assert problem and "OWNER/NAME" in problem and "Repo id must" not in problem


async def test_wizard_listing_errors_say_what_happened(engine, monkeypatch, tui_dirs):
    import socket

    from huggingface_hub import constants

    from moedesk.app.tui.screens.download import DownloadScreen

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        app.action_download()
        await wait_for(pilot, lambda: isinstance(app.screen, DownloadScreen), what="the wizard")
        screen = app.screen

        def status() -> str:
            return str(screen.query_one("#download-status").render())

        for repo_id in ("bad repo!", "moe/tiny"):
            screen.query_one("#download-repo").value = repo_id
            screen.query_one("#download-repo").focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: "-error" in screen.query_one("#download-status").classes,
                           what="the error")
            if repo_id == "bad repo!":
                assert "OWNER/NAME" in status() and "alphanumeric" not in status()
                screen.query_one("#download-status").remove_class("-error")
        assert status().startswith(f"cannot reach {dead}") and "resume" not in status()
        assert "Enter to list again" in status()


# ---------------------------------------------------------------- 9. the command palette


async def run_command(pilot, words: str) -> None:
    """Through the palette as a person would: ctrl+p, type, wait for the match, Enter."""
    from textual.command import CommandList, CommandPalette

    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, CommandPalette), what="the palette")
    await pilot.press(*words)
    palette = pilot.app.screen

    def top_match() -> str:
        commands = palette.query_one(CommandList)
        return str(commands.get_option_at_index(0).prompt) if commands.option_count else ""

    await wait_for(pilot, lambda: words.lower() in top_match().lower(), what=f"the command {words!r}")
    await pilot.press("enter")
    await pilot.pause()


async def test_palette_renames_exports_and_deletes_the_chat(engine, tmp_path):
    from moedesk.app.tui.screens.dialogs import AskScreen, ConfirmScreen

    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=6))
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)
        await pilot.press(*"Hello", "enter")
        await wait_idle(pilot, app)
        chat = app.chat
        first_reply = chat.conversation.messages[-1].content

        await run_command(pilot, "Rename this chat")
        await wait_for(pilot, lambda: isinstance(app.screen, AskScreen), what="the rename box")
        app.screen.query_one("#dialog-input").value = "Greetings"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is chat, what="the chat")
        assert ConversationStore().load(chat.conversation.id).title == "Greetings"

        await run_command(pilot, "Export this chat")
        await wait_for(pilot, lambda: isinstance(app.screen, AskScreen), what="the export box")
        from moedesk.app.tui.storage import export_folder

        # the documents folder, not the folder the app was started in (issue 46, item 8)
        assert app.screen.query_one("#dialog-input").value == str(export_folder() / "Greetings.md")
        assert export_folder() != Path.cwd()
        target = tmp_path / "out" / "chat.md"
        app.screen.query_one("#dialog-input").value = str(target)
        await pilot.press("enter")
        await wait_for(pilot, lambda: target.exists(), what="the file")
        text = target.read_text()
        assert text.startswith("# Greetings\n") and "## You\n\nHello\n" in text and first_reply.strip() in text

        await run_command(pilot, "Regenerate")
        await wait_idle(pilot, app)
        assert [m.role for m in chat.conversation.messages] == ["user", "assistant"]

        await run_command(pilot, "Delete this chat")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
        await pilot.press("y")
        await wait_for(pilot, lambda: app.screen is chat and not chat.conversation.messages, what="a new chat")
        assert ConversationStore().list() == []


# ---------------------------------------------------------------- 2. loading says what it does; cancel acts at once


async def test_first_run_says_the_demo_is_being_built_and_cancel_acts_at_once():
    import threading
    import time

    from moedesk.app.tui.screens.loading import LoadingScreen

    finished = threading.Event()

    def factory(model, progress):  # like the demo's build: a long step that reports nothing
        time.sleep(3)
        finished.set()
        progress("load", 0.1)  # the first call after a cancel raises
        raise AssertionError("not cancelled")

    app = MoedeskApp(factory, model="demo")  # tui_dirs gives an empty cache: the demo is not built
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadingScreen) and app.screen.panel.busy, what="loading")
        panel = app.screen.panel
        stage = str(panel.query_one(".load-stage").render())
        assert "Building the demo model" in stage and "first run" in stage and "Esc cancels" in stage
        assert panel.query_one("ProgressBar").total is None  # moving, not "0%"
        await wait_for(pilot, lambda: "1 s" in str(panel.query_one(".load-stage").render()), timeout=2,
                       what="the clock that shows it is alive")
        pressed = time.monotonic()
        await pilot.press("escape")
        # At once: before the step's 3 s end (`finished` still unset), with room for a busy 2-core CI machine's
        # render cycles (1.2 s seen there).
        await wait_for(pilot, lambda: not panel.busy, timeout=1.5, what="the cancel")
        assert time.monotonic() - pressed < 1.5 and not finished.is_set()
        assert panel.has_class("-cancelled") and not panel.has_class("-failed")
        assert str(panel.query_one(".load-title").render()) == "Loading cancelled: demo"
        await wait_for(pilot, lambda: finished.is_set(), timeout=5, what="the thread")
        await pilot.pause(0.2)
        assert str(panel.query_one(".load-error").render()) == "loading cancelled"  # no late failure shown


async def test_each_stage_in_words(tiny_folder):
    import threading

    import torch

    from moedesk.app.tui.screens.loading import LoadingScreen
    from moedesk.app.tui.widgets.load_panel import stage_words

    steps = [("load", 0.5), ("load", 1.0), ("profile", 1.0), ("calibrate", 1.0)]
    go_on = threading.Event()
    at = []

    def factory(model, progress):
        for stage, fraction in steps:
            progress(stage, fraction)
            at.append(stage)
            go_on.wait(60)  # the test moves it on; a short wait let a busy machine's slow screen miss a stage
            go_on.clear()
        from moedesk.engine.runtime import Engine
        return Engine.load(model, device="cpu", dtype="float32")

    app = MoedeskApp(factory, model=str(tiny_folder))
    async with app.run_test(size=(80, 24)) as pilot:
        expected = ["Loading weights", "Preparing the model", "Counting which experts", "Placing the most picked"]
        for n, words in enumerate(expected):
            await wait_for(pilot, lambda: len(at) > n and isinstance(app.screen, LoadingScreen)
                           and words in str(app.screen.panel.query_one(".load-stage").render()), what=words)
            if words == "Preparing the model":  # the GPU's steps only where the load goes to one
                shown = str(app.screen.panel.query_one(".load-stage").render())
                assert shown.startswith(stage_words("loaded", gpu=torch.cuda.is_available()) + "…")
            go_on.set()
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")


def test_a_machine_without_a_gpu_is_not_told_its_gpu_is_measured():
    from moedesk.app.tui.widgets.load_panel import stage_words

    # Found on a fresh CPU-only machine: the first load said "measuring CPU, GPU and copy speed".
    assert stage_words("loaded", gpu=False) == "Preparing the model"
    assert "GPU and copy speed" in stage_words("loaded", gpu=True)
    assert stage_words("profile", gpu=False) == stage_words("profile", gpu=True)
    assert stage_words("something new", gpu=True) == "Something new"


# ---------------------------------------------------------------- 5. copying


def test_last_code_block_is_the_code_alone():
    from moedesk.app.tui.clipboard import candidate_tools, last_code_block

    reply = "Here:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nand\n\n~~~\nlast = 1\n~~~\n\nDone."
    assert last_code_block(reply) == "last = 1\n"
    assert last_code_block("no code here") is None
    names = [t.name for t in candidate_tools({"WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0"}, "linux")]
    assert names == ["wl-copy", "xclip", "xsel"]
    assert [t.name for t in candidate_tools({}, "linux")] == []  # over SSH, say: the terminal is the way
    assert [t.name for t in candidate_tools({}, "darwin")] == ["pbcopy"]


async def test_copy_says_which_way_it_went(engine, monkeypatch, tmp_path):
    import moedesk.app.tui.clipboard as clipboard

    store = ConversationStore()
    c = Conversation()
    c.add("user", "code please")
    c.add("assistant", "Sure:\n\n```python\nprint('hi')\n```\n", tokens=5)
    store.save(c)
    store.remember(c.id)
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(80, 24)) as pilot:
        await open_chat(pilot)

        def last_note() -> str:
            return str(list(app._notifications)[-1].message)

        await pilot.press("ctrl+y")  # no clipboard tool here (the conftest removes them)
        await pilot.pause()
        assert app.clipboard == c.messages[-1].content
        assert "OSC 52" in last_note() and "may ignore it" in last_note() and "Copied" not in last_note()

        received = tmp_path / "clipboard.txt"
        tool = tmp_path / "fake-copy"
        tool.write_text(f"#!/bin/sh\ncat > {received}\n")
        tool.chmod(0o755)
        monkeypatch.setattr(clipboard, "tools_here", lambda: [clipboard.Tool("fake-copy", (str(tool),))])
        await run_command(pilot, "Copy the last code block")
        await wait_for(pilot, lambda: received.exists() and received.read_text(), what="the tool")
        assert received.read_text() == "print('hi')\n"
        assert "Copied the last code block" in last_note() and "(fake-copy)" in last_note()
