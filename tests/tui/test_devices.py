"""Which GPU holds what, on screen (issue 45): the heat map tags each layer's row with the GPU its resident experts
sit on and says in its legend what each tag is; the stats panel gives each GPU's layers, experts and how much of its
budget it holds; the Models screen shows the per-GPU budgets the next load takes. The CPU listed twice stands for two
GPUs, as in tests/offload/test_device_orchestra.py; what is checked is the screen as exported (its SVG's text)."""
from __future__ import annotations

import re

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.catalog import human_size
from moedesk.app.tui.widgets.heatmap import LABEL_WIDTH, layout, render_lines
from moedesk.engine.runtime import Engine
from tests.offload.test_device_orchestra import _budgets_holding
from tests.tiny_models import build
from tests.tui.helpers import chat_ready, greedy_settings, open_models, screen_lines, wait_for, wait_idle


def test_rows_carry_their_gpus_tag_and_the_legend_names_each_gpu():
    on_gpu = [[True, False]] * 3
    popularity = [[3, 1]] * 3
    hm = layout(on_gpu, popularity, width=40, labels=["L0", "L1", "L5"], devices=[0, 0, 1],
                device_names=("cuda:0", "cuda:1"))
    lines = [line.plain for line in render_lines(hm, width=40)]
    assert [line[:LABEL_WIDTH + 3] for line in lines[-3:]] == [" L0 G0 ", " L1 G0 ", " L5 G1 "]
    assert "G0 layers on GPU 0 (cuda:0)" in lines[1] and "G1 layers on GPU 1 (cuda:1)" in lines[2]  # after the places
    one = [line.plain for line in render_lines(layout(on_gpu, popularity, width=40, labels=["L0", "L1", "L5"]))]
    assert one[-1].startswith(" L5 ") and "G0" not in "".join(one)  # one device: no tags, as before
    assert layout(on_gpu, popularity, 40, devices=[0, 1]).devices is None  # a list that does not fit the rows


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return build("mixtral", tmp_path_factory.mktemp("mixtral4"), num_hidden_layers=4)


@pytest.mark.anyio
async def test_the_heat_map_and_stats_say_which_gpu_holds_what(four_layers, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    budgets = _budgets_holding(four_layers, (3, 5))
    engine = Engine.load(str(four_layers), device="cpu", dtype="float32", offload=True, context_length=64,
                         gpu_budget=budgets, devices=("cpu", "cpu"))
    app = MoedeskApp(engine, settings=greedy_settings(max_new_tokens=4), gpu_budget=budgets)
    async with app.run_test(size=(160, 60)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        await pilot.click("#prompt")
        await pilot.press(*"Hi", "enter")
        await wait_idle(pilot, app)
        lines = screen_lines(app)
        text = "\n".join(lines)
        rows = {label: next(line for line in lines if re.search(rf"\b{label} G\d ", line)) for label in
                ("L0", "L1", "L2", "L3")}
        assert [re.search(r"\bL\d (G\d) ", rows[f"L{i}"]).group(1) for i in range(4)] == ["G0", "G0", "G1", "G1"]
        assert "G0 layers on GPU 0 (simulated on cpu)" in text and "G1 layers on GPU 1 (simulated on cpu)" in text
        devices = engine.expert_stats()["devices"]
        for d, (experts, layers) in enumerate(((3, "0-1"), (5, "2-3"))):
            held, budget = devices[d]["held_bytes"], devices[d]["budget_bytes"]
            assert budget == int(budgets[d] * 2**30) and 0 < held <= budget
            assert f"GPU {d}: MoE layers {layers} · {experts} experts · {human_size(held)} of {human_size(budget)}" \
                in text

        models = await open_models(pilot)
        status = "\n".join(screen_lines(app))
        assert f"GPU budgets {budgets[0]:g} + {budgets[1]:g} GiB" in status, status
        assert models.target.budgets == budgets
