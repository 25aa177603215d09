"""Listing local models, and loading one from the models screen."""
from __future__ import annotations

import json
import shutil

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.catalog import estimate_line, find_models, folder_size, human_size, scan_hf_cache
from moedesk.app.tui.load_target import LoadTarget, load_target
from moedesk.app.tui.settings import Settings
from moedesk.engine.load.size_estimate import MemoryEstimate
from moedesk.engine.runtime import Engine
from tests.tui.helpers import apply_setting, chat_ready, open_models, wait_for


def loaded_bytes(engine) -> int:
    """The weights of a loaded engine: its expert stacks and its parameters (a tied embedding once)."""
    return (sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
            + sum(p.numel() * p.element_size() for p in engine.model.parameters()))


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


async def models_table(pilot):
    """The chat once ready, then the models screen (F3): (that screen, its table, the rows' names in order)."""
    await wait_for(pilot, lambda: chat_ready(pilot.app), what="the chat")
    screen = await open_models(pilot)
    table = screen.query_one("#models-table")
    return screen, table, [table.get_row_at(i)[1] for i in range(table.row_count)]


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
        screen, table, names = await models_table(pilot)
        assert "acme/tiny-moe" in names and "broken.gguf" in names
        row = names.index("acme/tiny-moe")
        # The memory column: what loading takes (on this CPU: float32, experts as the file holds them).
        assert table.get_row_at(row)[3:6] == ["qwen3_moe", "8 × top-2", f"~{human_size(loaded_bytes(engine))}"]

        # An unsupported architecture is refused at once, without unloading the current model.
        table.move_cursor(row=names.index("dense-thing"))
        await pilot.press("enter")
        await pilot.pause()
        error = str(screen.query_one(".load-error").render())
        assert error.startswith("dense-thing: unsupported architecture 'gpt2'") and app.engine is engine
        assert error.endswith("the llama.cpp engine reads GGUF files only: use a GGUF of this model")

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
        await open_models(pilot)
        table = app.screen.query_one("#models-table")
        names = [table.get_row_at(i)[1] for i in range(table.row_count)]
        table.move_cursor(row=names.index("acme/tiny-moe"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        assert [type(s).__name__ for s in app.screen_stack][1:] == ["ChatScreen"]
        assert app.engine.name.endswith("tiny-moe")


@pytest.mark.anyio
async def test_models_screen_estimates_memory_with_the_expert_dtype_in_force(models_folder, engine):
    """The tiny model is float32 on disk: as int4 its experts' gate/up rows (64 wide) become q4_0 blocks, 18 bytes
    per 32 weights, and its down rows (48 wide, not whole blocks) stay float32. F2 changes the setting from here,
    and the estimate follows once the settings close."""
    folder = models_folder / "acme" / "tiny-moe"
    cfg = engine.config
    E, H, F, L = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers
    auto_experts = sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
    other = loaded_bytes(engine) - auto_experts
    int4_experts = L * E * (2 * F * H // 32 * 18 + H * F * 4)
    app = MoedeskApp(engine, settings=Settings())
    async with app.run_test(size=(120, 30)) as pilot:
        screen, table, names = await models_table(pilot)
        row = names.index("acme/tiny-moe")
        table.move_cursor(row=row)
        await pilot.pause()
        note = lambda: str(screen.query_one("#models-note").render())  # noqa: E731
        status = lambda: str(screen.query_one("#models-status").render())  # noqa: E731
        assert note() == (f"acme/tiny-moe · ~{human_size(auto_experts + other)} in RAM, {human_size(auto_experts)} "
                          f"of it f32 experts (file {human_size(folder_size(folder))}) · native engine")
        assert "memory with expert dtype auto, f32 weights (F2)" in status()
        # No estimate without readable headers (nor for the demo before its first build): the file's size, below.
        assert table.get_row_at(names.index("broken.gguf"))[5] == "—" and table.get_row_at(0)[5] == "—"
        table.move_cursor(row=names.index("broken.gguf"))
        await pilot.pause()
        assert note() == "broken.gguf · file 22 B · native engine · unreadable header (ValueError)"
        table.move_cursor(row=row)
        await pilot.pause()

        await apply_setting(pilot, "expert_dtype", "int4")
        await wait_for(pilot, lambda: "int4" in status(), what="the new estimate")
        assert table.get_row_at(row)[5] == f"~{human_size(int4_experts + other)}"
        assert note() == (f"acme/tiny-moe · ~{human_size(int4_experts + other)} in RAM, {human_size(int4_experts)} "
                          f"of it q4_0/f32 experts (file {human_size(folder_size(folder))}) · native engine")
        assert "memory with expert dtype int4, f32 weights (F2)" in status()


@pytest.mark.anyio
async def test_a_safetensors_row_says_what_the_engine_setting_would_do(models_folder, engine):
    """llama.cpp reads GGUF files only: with the engine set to llama.cpp, the tiny safetensors model's row says it
    would not load (memory column), its note and the line below the table give the line Engine.load stops with,
    and Enter refuses it at once, in those words, keeping the loaded model. Set back to auto, it is the native
    engine's again."""
    from moedesk.engine.errors import MoedeskError
    from moedesk.engine.selection import not_gguf
    from moedesk.app.tui.screens.models import WONT_LOAD

    folder = models_folder / "acme" / "tiny-moe"
    stop = not_gguf("llama.cpp")
    with pytest.raises(MoedeskError) as refused:
        Engine.load(str(folder), engine="llama.cpp")
    assert str(refused.value) == f"{folder}: {stop}"

    app = MoedeskApp(engine, settings=Settings(engine="llama.cpp"))
    async with app.run_test(size=(160, 40)) as pilot:
        screen, table, names = await models_table(pilot)
        row = names.index("acme/tiny-moe")
        note = lambda: str(screen.query_one("#models-note").render())  # noqa: E731
        cells = table.get_row_at(row)
        assert cells[5] == WONT_LOAD and cells[6] == stop[:len(cells[6]) - 1] + "…"  # the note column, cut
        table.move_cursor(row=row)
        await pilot.pause()
        assert note() == f"acme/tiny-moe · file {human_size(folder_size(folder))} · {stop}"
        await pilot.press("enter")
        await pilot.pause()
        assert str(screen.query_one(".load-error").render()) == f"acme/tiny-moe: {stop}" and app.engine is engine

        await apply_setting(pilot, "engine", "auto")
        await wait_for(pilot, lambda: screen.target.engine == "auto", what="auto")
        assert table.get_row_at(row)[5] == f"~{human_size(loaded_bytes(engine))}"
        assert note().endswith(" · native engine")


def test_the_flags_of_this_run_win_over_the_settings_and_a_gpu_holds_the_rest(engine):
    app = MoedeskApp(engine, settings=Settings(expert_dtype="int4", dtype="bfloat16"), expert_dtype="int8")
    # the engine's device, the CPU: later loads are asked for it too
    assert load_target(app) == LoadTarget("int8", "bfloat16", gpu=False, device="cpu")
    assert load_target(MoedeskApp(engine, settings=Settings())) == LoadTarget("auto", "float32", gpu=False,
                                                                              device="cpu")
    estimate = MemoryEstimate(expert_bytes=26_400 * 2**20, other_bytes=3 * 2**30, expert_formats=("q4_0",),
                              weights_dtype="bfloat16")
    assert estimate_line(estimate, True, human_size) == "~25.8 GiB in RAM as q4_0 experts + 3.0 GiB on the GPU"
    assert estimate_line(estimate, False, human_size) == "~28.8 GiB in RAM, 25.8 GiB of it q4_0 experts"
    dense = MemoryEstimate(0, 2**30, (), "bfloat16")
    assert estimate_line(dense, True, human_size) == "~1.0 GiB on the GPU"
