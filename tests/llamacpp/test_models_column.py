"""The Models screen's memory column for a GGUF the llama.cpp engine would load (issue 40): the RAM and GPU of the plan
that engine's load makes, read from the exported screenshot as a person reads it, equal to what the load then
planned and to the bytes the file's header holds where they go; following the GPU budget set in the app; and "✗"
where the load refuses the model. The table stays whole at 80x24 and 160x50 with such cells in it."""
from __future__ import annotations

import re
import shutil

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.screens.models import brief, column_layout, plan_cell
from moedesk.app.tui.settings import Settings
from moedesk.engine.errors import MoedeskError
from moedesk.engine.runtime import Engine
from tests.llamacpp.test_fit_agreement import GIB, Sizes, ggufs, machine, refusal, usable_between  # noqa: F401
from tests.tui.conftest import tui_dirs  # noqa: F401 -- private data, config, cache and models folders
from tests.tui.helpers import open_models, open_settings, wait_for
from tests.tui.test_devices import screen_lines

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

CONTEXT = 512


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    """A GGUF the native engine runs too: llama.cpp's plan sizes it only where the engine setting says llama.cpp."""
    from tests.gguf_from_hf import build

    return build("qwen3moe", tmp_path_factory.mktemp("q") / "hf").gguf


def no_model(model, progress):
    raise MoedeskError("no model yet")


async def models_screen(pilot):
    app = pilot.app
    await wait_for(pilot, lambda: type(app.screen).__name__ == "LoadingScreen"
                   and str(app.screen.query_one(".load-error").render()), what="the failed start")
    return await open_models(pilot)


async def row_on_screen(pilot, name: str) -> str:
    """The table's row for `name` (highlighted), as the exported screenshot shows it."""
    screen = pilot.app.screen
    table = screen.query_one("#models-table")
    index = [m.name for m in screen.models].index(name)
    table.move_cursor(row=index)
    await pilot.pause()
    return next(line for line in screen_lines(pilot.app) if table.get_row_at(index)[1] in line)


def cell(row: str) -> str:
    """The memory cell of a screen row: after the experts column ("8 × top-2")."""
    return re.split(r"× top-\d+\s+", row, maxsplit=1)[1].split("  ")[0].strip()


def note(app) -> str:
    return str(app.screen.query_one("#models-note").render())


def loaded_fit(path, **options):
    engine = Engine.load(str(path), context_length=CONTEXT, **options)
    try:
        assert engine.kind == "llama.cpp"
        return engine.fit
    finally:
        engine.close()


async def test_the_cell_is_the_loads_plan_and_follows_the_gpu_budget(ggufs, tui_dirs, tmp_path, monkeypatch):
    """A GPU with room (faked: llama.cpp here is a CPU build). With a GPU budget that holds the other weights, the
    cache and one and a half layers' experts, the first three layers' experts stay in RAM; set to 4 GiB in the app's
    settings, every expert goes to the GPU and only the token embeddings stay in RAM. Each time the cell is the
    RAM and GPU bytes of the plan the load then made, and those are the header's bytes where they go."""
    path, sizes = ggufs["long"][0], Sizes(ggufs["long"])
    layer = max(sizes.experts.values())
    budget = round((sizes.before_experts(CONTEXT) + 1.5 * layer) / GIB, 6)
    machine(monkeypatch, tmp_path, 16 * GIB, gpu_free=8 * GIB)
    shutil.copy(path, tui_dirs["models"] / path.name)
    app = MoedeskApp(no_model, model="nothing", settings=Settings(gpu_budget_gib=budget), context_length=CONTEXT)
    async with app.run_test(size=(160, 50)) as pilot:
        await models_screen(pilot)
        first = cell(await row_on_screen(pilot, path.name))
        planned = loaded_fit(path, gpu_budget=budget)
        in_ram = sizes.in_ram(3)  # the embeddings and three layers' experts
        assert planned.fits and planned.ram_bytes == in_ram and planned.placement.cpu_moe == 3
        assert first == f"{brief(in_ram)}+{brief(planned.gpu_total)} GPU" == plan_cell(planned)
        assert planned.summary() in note(app)  # the note below says the same plan in words

        await open_settings(pilot)
        app.screen.query_one("#setting-gpu_budget_gib").value = "4"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ModelsScreen"
                       and "GPU budget 4 GiB" in str(app.screen.query_one("#models-status").render()),
                       what="the models screen with the new budget")
        second = cell(await row_on_screen(pilot, path.name))
        planned = loaded_fit(path, gpu_budget=4)
        assert planned.ram_bytes == sizes.embeddings and planned.placement.cpu_moe == 0
        assert second == f"{brief(sizes.embeddings)}+{brief(planned.gpu_total)} GPU" == plan_cell(planned)
        assert second != first and planned.summary() in note(app)


async def test_a_model_that_does_not_fit_says_so_in_its_cell(ggufs, tui_dirs, tmp_path, monkeypatch):
    """No GPU and room for less than the weights and the cache: the load refuses it, and the cell marks it with
    the RAM it would need; a GPU budget too small for the other weights leaves no plan: the cell names the budget,
    as the load refuses it."""
    path, sizes = ggufs["long"][0], Sizes(ggufs["long"])
    need = sizes.total + CONTEXT * sizes.kv_per_position
    machine(monkeypatch, tmp_path, usable_between(sizes.embeddings, need), gpu_free=None)
    said = refusal([path], context_length=CONTEXT)
    shutil.copy(path, tui_dirs["models"] / path.name)
    app = MoedeskApp(no_model, model="nothing", context_length=CONTEXT)
    async with app.run_test(size=(160, 50)) as pilot:
        await models_screen(pilot)
        assert cell(await row_on_screen(pilot, path.name)) == f"✗ {brief(need)} RAM"
        assert f"does not fit: {said}" in note(app)

    machine(monkeypatch, tmp_path, 16 * GIB, gpu_free=8 * GIB)
    with pytest.raises(MoedeskError):
        loaded_fit(path, gpu_budget=0.0001)
    app = MoedeskApp(no_model, model="nothing", context_length=CONTEXT, gpu_budget=0.0001)
    async with app.run_test(size=(160, 50)) as pilot:
        await models_screen(pilot)
        assert cell(await row_on_screen(pilot, path.name)) == "✗ GPU budget"
        assert "does not fit: " in note(app)


async def test_the_engine_setting_llama_cpp_plans_a_gguf_the_native_engine_runs(qwen3moe, tui_dirs, tmp_path,
                                                                               monkeypatch):
    """A Qwen3-MoE GGUF: the native estimate under auto; the llama.cpp load's plan with --engine llama.cpp."""
    machine(monkeypatch, tmp_path, 16 * GIB, gpu_free=None)
    name = "qwen3moe.gguf"
    shutil.copy(qwen3moe, tui_dirs["models"] / name)
    cells = {}
    for kind in ("auto", "llama.cpp"):
        app = MoedeskApp(no_model, model="nothing", context_length=CONTEXT, engine_kind=kind)
        async with app.run_test(size=(160, 50)) as pilot:
            await models_screen(pilot)
            cells[kind] = cell(await row_on_screen(pilot, name))
    assert cells["auto"].startswith("~")
    assert cells["llama.cpp"] == plan_cell(loaded_fit(qwen3moe, engine="llama.cpp")) != cells["auto"]


@pytest.mark.parametrize("size", [(80, 24), (160, 50)])
async def test_the_table_stays_whole_with_plans_in_it(size, ggufs, qwen3moe, tui_dirs, tmp_path, monkeypatch):
    """Long names, a cached repo's "hf cache" and a plan with GPU figures in the memory column: every column on
    screen (none scrolled off), each row's memory cell whole, the highlighted row's note whole below."""
    from tests.tui.test_models import fake_hf_cache

    machine(monkeypatch, tmp_path, 16 * GIB, gpu_free=8 * GIB)
    models = tui_dirs["models"]
    long = "gpt-oss-120b-a-rather-long-file-name-as-releases-have-it-MXFP4.gguf"
    shutil.copy(ggufs["long"][0], models / long)
    shutil.copy(qwen3moe, models / "Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf")
    (models / "broken-with-a-long-name.gguf").write_bytes(b"not a gguf file at all")
    fake_hf_cache(tui_dirs["hf-cache"], qwen3moe.parent, repo="acme/a-cached-repo-with-a-long-name")
    app = MoedeskApp(no_model, model="nothing", context_length=CONTEXT)
    async with app.run_test(size=size) as pilot:
        screen = await models_screen(pilot)
        table = screen.query_one("#models-table")
        assert table.virtual_size.width <= table.scrollable_content_region.width
        for n, model in enumerate(screen.models):
            shown, plan = table.get_row_at(n)[5], screen.plans[n]
            assert shown == plan_cell(plan) if plan is not None else shown.startswith(("~", "—")), shown
            assert shown in await row_on_screen(pilot, model.name)
        assert "GPU" in table.get_row_at([m.name for m in screen.models].index(long))[5]
        await row_on_screen(pilot, long)
        text = re.sub(r"\s+", " ", " ".join(screen_lines(app)))
        assert f"{long} · {screen.plans[table.cursor_row].line()} · " in text


def test_the_columns_give_way_in_order():
    """The note gives way first, then the name down to 16 characters, then "architecture" is headed "arch", then the
    note column goes, then the name goes down to 12; the fixed columns are never cut."""
    row = ("", "n" * 40, "hf cache", "qwen3moe", "128 × top-8", "✗ 123.4G+16.3G GPU", "built on first use")

    def widths(width):
        return {key: w for key, (_, w) in column_layout([row], width, 2).items()}

    assert widths(156) == {"mark": 1, "name": 40, "source": 8, "arch": 12, "experts": 11, "size": 18, "note": 18}
    for width in range(130, 60, -1):
        shown = widths(width)
        assert (shown["source"], shown["arch"] in (8, 12), shown["experts"], shown["size"]) == (8, True, 11, 18)
        assert sum(shown.values()) + 2 * len(shown) <= width or shown["name"] == 12, width
    assert widths(95) == {"mark": 1, "name": 23, "source": 8, "arch": 12, "experts": 11, "size": 18, "note": 8}
    assert widths(88)["name"] == 16 and widths(88)["arch"] == 12 and widths(87)["arch"] == 8  # "arch" first
    assert widths(84)["note"] == 8 and "note" not in widths(83) and widths(83)["name"] == 25
    assert widths(70)["name"] == 12 and column_layout([row], 90, 2)["arch"] == ("architecture", 12)


@pytest.mark.gpu
async def test_on_the_gpu_box_the_cell_is_what_the_load_then_plans(qwen3moe, tui_dirs):
    """On the GPU box, with llama-cpp-python built with CUDA and nothing faked: a budget that keeps some layers'
    experts in RAM; the cell before loading is the plan of the load that follows (test_fit_agreement checks that
    plan against llama.cpp's own buffers)."""
    from moedesk.engine.llamacpp.library import library

    if not library().gpu_offload():
        pytest.skip("llama-cpp-python here is a CPU build (rebuild it with CUDA on the GPU box)")
    sizes = Sizes([qwen3moe])
    budget = round((sizes.before_experts(CONTEXT) + 1.5 * max(sizes.experts.values())) / GIB, 6)
    shutil.copy(qwen3moe, tui_dirs["models"] / "qwen3moe.gguf")
    app = MoedeskApp(no_model, model="nothing", context_length=CONTEXT, gpu_budget=budget, engine_kind="llama.cpp")
    async with app.run_test(size=(160, 50)) as pilot:
        await models_screen(pilot)
        shown = cell(await row_on_screen(pilot, "qwen3moe.gguf"))
    planned = loaded_fit(qwen3moe, engine="llama.cpp", gpu_budget=budget)
    assert 0 < planned.placement.cpu_moe < len(sizes.experts) and shown == plan_cell(planned), (shown, planned)
