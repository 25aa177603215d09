"""The stats panel and its layer × expert heat map."""
from __future__ import annotations

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.widgets.heatmap import GPU_MARK, LABEL_WIDTH, ExpertHeatMap, layout, level_of, render_lines
from moedesk.app.tui.widgets.stats import StatsPanel
from moedesk.engine.runtime import Engine
from tests.tiny_models import budget_for_experts
from tests.tui.helpers import chat_ready, greedy_settings, wait_for, wait_idle


def test_layout_one_cell_per_expert_then_bins():
    on_gpu = [[e < 2 for e in range(8)] for _ in range(3)]
    popularity = [[e * (layer + 1) for e in range(8)] for layer in range(3)]
    wide = layout(on_gpu, popularity, width=40)
    assert len(wide.rows) == 3 and all(len(row) == 8 for row in wide.rows)
    assert wide.cell_width == 4 and wide.bin_size == 1 and wide.max_count == 21
    assert layout(on_gpu, popularity, width=LABEL_WIDTH + 16).cell_width == 2
    assert [c.on_gpu for c in wide.rows[0]] == [True, True] + [False] * 6
    assert wide.rows[0][0].level == 0 and wide.rows[2][7].level == 5  # never picked / the most picked

    narrow = layout(on_gpu, popularity, width=LABEL_WIDTH + 8)
    assert narrow.cell_width == 1 and all(len(row) == 8 for row in narrow.rows)

    binned = layout(on_gpu, popularity, width=LABEL_WIDTH + 3)
    assert binned.bin_size == 3 and all(len(row) == 3 for row in binned.rows)
    assert sum(c.count for c in binned.rows[1]) == sum(popularity[1])


def test_render_lines_marks_gpu_cells_and_has_a_legend():
    on_gpu = [[True, False], [False, True]]
    popularity = [[4, 1], [0, 2]]
    hm = layout(on_gpu, popularity, width=LABEL_WIDTH + 4, labels=["L0", "L3"])
    lines = render_lines(hm)
    assert len(lines) == 2 + 1 + 2  # two legend lines (first: 30 layers must not push it off screen), header, layers
    assert lines[3].plain.startswith(" L0 ") and lines[4].plain.startswith(" L3 ")
    assert lines[3].plain[LABEL_WIDTH:] == GPU_MARK + "   "  # GPU cell marked, RAM cell plain
    assert lines[4].plain[LABEL_WIDTH:] == "··" + GPU_MARK + " "  # unused expert as dots
    assert "on GPU" in lines[0].plain and "in RAM" in lines[0].plain and "4" in lines[1].plain
    assert [level_of(c, 10) for c in (0, 1, 2, 5, 10)] == [0, 1, 1, 3, 5]


def test_a_sampled_map_says_its_counts_are_estimates():
    """llama.cpp's engine counts one decode step in N (each pick N times): the legend says the top count is an
    estimate and how it was made; an exact map (the native engine's) says neither."""
    hm = layout([[True, False]], [[40, 8]], width=40, labels=["L0"])
    exact = [line.plain for line in render_lines(hm, width=40)]
    sampled = [line.plain for line in render_lines(hm, width=40, count_every=8)]
    assert any(line.endswith("few → 40") for line in exact) and not any("estimated" in line for line in exact)
    assert any(line.endswith("few → ~40") for line in sampled)
    assert "estimated: prompts and 1 decode step in 8 counted" in sampled
    assert len(sampled) == len(exact) + 1
    # llama.cpp's layers with experts on the GPU are sampled more thinly: the legend gives both
    thinner = [line.plain for line in render_lines(hm, width=40, count_every=8, gpu_count_every=64)]
    assert "estimated: prompts and 1 decode step in 8 counted (1 in 64 on the GPU)" in thinner
    # counting turned off (the Count expert picks setting): the map shows placement, and says why no use shows
    off = [line.plain for line in render_lines(layout([[True, False]], [[0, 0]], width=40, labels=["L0"]), width=40,
                                               counted=False)]
    assert "picks not counted: settings, Count expert picks" in off and not any("estimated" in x for x in off)


@pytest.mark.anyio
async def test_a_narrow_sampled_map_is_as_tall_as_its_wrapped_legend_and_keeps_its_last_layer():
    """In a panel narrower than the sampled counts' note (the stats panel at 80x24), the note wraps onto two rows:
    the map's height counts both, so its last layer stays on screen."""
    from textual.app import App

    class Narrow(App):
        CSS = "ExpertHeatMap { width: 30; height: auto; }"

        def compose(self):
            yield ExpertHeatMap()

    app = Narrow()
    async with app.run_test(size=(40, 14)) as pilot:
        heatmap = app.query_one(ExpertHeatMap)
        heatmap.count_every = 8
        heatmap.update_map([[False] * 8] * 4, [[3, 0, 5, 1, 0, 0, 2, 9]] * 4, ["L0", "L1", "L2", "L3"])
        await pilot.pause()
        lines = heatmap.render().plain.splitlines()
        assert any(len(line) > 30 for line in lines)  # the note does not fit one row
        assert heatmap.size.height == len(lines) + 1
        assert "L3" in app.export_screenshot()


@pytest.mark.anyio
async def test_panel_shows_the_engines_map_and_reply_numbers(engine):
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        heatmap = app.screen.query_one(ExpertHeatMap)
        cfg = engine.config
        hm = heatmap.current_layout()
        assert len(hm.rows) == cfg.num_layers and all(len(r) == cfg.num_experts for r in hm.rows)
        assert hm.max_count == 0  # nothing generated yet
        await pilot.click("#prompt")
        await pilot.press(*"Hi", "enter")
        await wait_idle(pilot, app)
        hm = heatmap.current_layout()
        on_gpu, popularity = engine.expert_map()
        assert [[c.count for c in row] for row in hm.rows] == popularity
        assert hm.max_count > 0 and not any(c.on_gpu for row in hm.rows for c in row)  # CPU only here
        rendered = heatmap.render().plain.splitlines()
        assert len(rendered) == 2 + 1 + cfg.num_layers
        assert [line.split()[0] for line in rendered[3:]] == ["L0", "L1", "L2"]

        panel = app.screen.query_one(StatsPanel)
        reply = app.chat.conversation.messages[-1]
        assert panel.reply["tokens"] == reply.meta["tokens"] > 0
        numbers = dict(panel.number_rows)
        assert numbers["speed"].endswith(" tok/s") and numbers["tokens"] == str(reply.meta["tokens"])
        assert panel.context_used == reply.meta["prompt_tokens"] + reply.meta["tokens"]

        await pilot.press("ctrl+t")
        assert not panel.display or panel.has_class("-hidden")
        await pilot.press("ctrl+t")
        await pilot.press("f4")
        assert app.screen.maximized is panel


def test_expert_rows_per_generated_token():
    from moedesk.app.tui.widgets.stats import expert_rows

    assert expert_rows(None, 5) == [] and expert_rows({}, 5) == []
    rows = expert_rows({"experts_gpu": 10, "experts_cpu": 5, "experts_copied": 0, "experts_zero_copy": 15,
                        "gpu_hit_rate": 0.625}, 5)
    assert rows == [("GPU hit rate", "62%"), ("experts on GPU", "2.0 per token"), ("experts on CPU", "1.0 per token"),
                    ("experts zero-copy", "3.0 per token")]  # none copied: no row
    rows = dict(expert_rows({"experts_gpu": 0, "experts_cpu": 4, "experts_copied": 6, "gpu_hit_rate": None}, 2))
    assert rows == {"GPU hit rate": "—", "experts on GPU": "0.0 per token", "experts on CPU": "2.0 per token",
                    "experts copied": "3.0 per token"}
    # The expert cache's swaps, per second of the reply, only when it moved experts.
    rows = dict(expert_rows({"experts_gpu": 4, "experts_cpu": 4, "expert_swaps": 6, "gpu_hit_rate": 0.5}, 4, 2.0))
    assert rows["expert swaps"] == "3.0 per s"
    assert "expert swaps" not in dict(expert_rows({"experts_gpu": 4, "expert_swaps": 0}, 4, 2.0))


@pytest.mark.anyio
async def test_offloaded_engine_shows_resident_experts_and_where_experts_ran(tiny_folder):
    engine = Engine.load(str(tiny_folder), device="cpu", dtype="float32", offload=True,
                         gpu_budget=budget_for_experts(tiny_folder, 2))
    resident = engine.expert_stats()["experts_on_gpu"]
    assert resident > 0
    app = MoedeskApp(engine, settings=greedy_settings())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        await pilot.click("#prompt")
        await pilot.press(*"Hi", "enter")
        await wait_idle(pilot, app)
        hm = app.screen.query_one(ExpertHeatMap).current_layout()
        assert sum(c.on_gpu for row in hm.rows for c in row) == resident
        numbers = dict(app.screen.query_one(StatsPanel).number_rows)
        assert numbers["GPU hit rate"].endswith("%") and numbers["experts on GPU"].endswith(" per token")
