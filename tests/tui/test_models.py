"""Listing local models, and loading one from the models screen."""
from __future__ import annotations

import json
import shutil

import pytest

from app.tui import MoedeskApp
from app.tui.catalog import find_models, folder_size, human_size, scan_hf_cache
from app.tui.screens.models import ModelsScreen
from engine.runtime import Engine
from tests.tui.helpers import chat_ready, wait_for


def cpu_factory(model, progress):
    return Engine.load(model, device="cpu", dtype="float32", progress=progress)


def fake_hf_cache(root, tiny_folder, repo="acme/cached-moe"):
    """The layout huggingface_hub writes: blobs, refs/main, snapshots/<commit>/ with links to blobs."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    (repo_dir / "blobs").mkdir()
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for n, name in enumerate(["config.json"]):
        blob = repo_dir / "blobs" / f"blob{n}"
        shutil.copy(tiny_folder / name, blob)
        (snapshot / name).symlink_to(blob)
    return repo


@pytest.fixture
def models_folder(tui_dirs, tiny_folder):
    models = tui_dirs["models"]
    shutil.copytree(tiny_folder, models / "acme" / "tiny-moe")
    (models / "broken.gguf").write_bytes(b"not a gguf file at all")
    (models / "notes").mkdir()  # no config.json: not a model
    (models / "notes" / "readme.txt").write_text("hello")
    dense = models / "dense-thing"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return models


def test_find_models_lists_demo_folders_gguf_and_hf_cache(models_folder, tui_dirs, tiny_folder):
    repo = fake_hf_cache(tui_dirs["hf-cache"], tiny_folder)
    models = {m.name: m for m in find_models()}
    assert list(models)[0].startswith("demo")
    tiny = models["acme/tiny-moe"]
    assert (tiny.source, tiny.arch, tiny.experts, tiny.supported) == ("folder", "qwen3_moe", "8 × top-2", True)
    assert tiny.spec == str(models_folder / "acme" / "tiny-moe")
    assert tiny.size_bytes == folder_size(models_folder / "acme" / "tiny-moe") > 0
    assert models["broken.gguf"].source == "gguf" and "unreadable" in models["broken.gguf"].note
    assert models["dense-thing"].supported is False and models["dense-thing"].experts == "dense"
    assert "notes" not in models
    cached = models[repo]
    assert (cached.source, cached.spec, cached.arch) == ("hf cache", repo, "qwen3_moe")
    assert scan_hf_cache(tui_dirs["hf-cache"] / "missing") == []
    assert human_size(1536) == "1.5 KiB" and human_size(None) == "—"


@pytest.mark.anyio
async def test_models_screen_lists_and_loads_a_model(models_folder, engine):
    app = MoedeskApp(engine)  # the factory follows the engine's device: cpu, so float32 (the auto dtype)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.models, what="the list")
        screen = app.screen
        table = screen.query_one("#models-table")
        names = [table.get_row_at(i)[1] for i in range(table.row_count)]
        assert "acme/tiny-moe" in names and "broken.gguf" in names
        row = names.index("acme/tiny-moe")
        assert table.get_row_at(row)[3:6] == ["qwen3_moe", "8 × top-2",
                                               human_size(folder_size(models_folder / "acme" / "tiny-moe"))]

        # An unsupported architecture is refused at once, without unloading the current model.
        table.move_cursor(row=names.index("dense-thing"))
        await pilot.press("enter")
        await pilot.pause()
        assert "not supported" in str(screen.query_one(".load-error").render()) and app.engine is engine

        # A path that is not a model: one line, and the loaded model stays.
        screen.query_one("#model-path").value = str(models_folder / "nowhere.gguf")
        screen.query_one("#model-path").focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: not screen.query_one("LoadPanel").busy
                       and str(screen.query_one(".load-error").render()), what="the error")
        error = str(screen.query_one(".load-error").render())
        assert "nowhere.gguf" in error and "\n" not in error and app.engine is engine

        table.focus()
        table.move_cursor(row=row)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is app.chat, what="back to the chat")
        assert app.engine is not engine and app.engine.name == str(models_folder / "acme" / "tiny-moe")
        assert app.chat.sub_title == "tiny-moe"
        assert "tiny-moe" in str(app.chat.stats.query_one("#stats-model").render())


@pytest.mark.anyio
async def test_models_screen_from_a_failed_start(models_folder):
    app = MoedeskApp(cpu_factory, model=str(models_folder / "broken.gguf"))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: "LoadingScreen" == type(app.screen).__name__
                       and str(app.screen.query_one(".load-error").render()), what="the start-up error")
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.models, what="the list")
        table = app.screen.query_one("#models-table")
        names = [table.get_row_at(i)[1] for i in range(table.row_count)]
        table.move_cursor(row=names.index("acme/tiny-moe"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        assert [type(s).__name__ for s in app.screen_stack][1:] == ["ChatScreen"]
        assert app.engine.name.endswith("tiny-moe")
