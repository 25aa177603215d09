"""The settings screen says when speculation loses on this machine, from the step times auto measured here."""
from __future__ import annotations

import pytest

from moedesk.app.tui import MoedeskApp
from moedesk.app.tui.speculation_outlook import UNMEASURED, outlook_note, speculation_note
from moedesk.engine.speculative.auto import batch_one_outlook
from tests.tui.helpers import chat_ready, greedy_settings, open_settings, wait_for

# T(B, k) in ms. On a CPU a verify step of k tokens reads about k tokens' experts: k plain steps' worth.
CPU_LIKE = {(b, k): 10.0 * b * k for b in (1, 2, 4) for k in range(1, 6)}
# On a GPU holding the experts, 5 tokens at once cost little more than one.
GPU_LIKE = {(b, k): 10.0 * b * (1 + 0.05 * (k - 1)) for b in (1, 2, 4) for k in range(1, 6)}


def test_the_outlook_tells_a_losing_machine_from_a_paying_one():
    cpu = batch_one_outlook(CPU_LIKE, 4)
    assert cpu.loses and cpu.speedup < 1
    assert cpu.verify_cost == pytest.approx(cpu.gamma + 1)
    gpu = batch_one_outlook(GPU_LIKE, 4)
    assert not gpu.loses and gpu.gamma == 4 and gpu.speedup > 2
    assert batch_one_outlook({(2, 1): 1.0, (2, 2): 1.1}, 4) is None  # batch 1 never measured

    assert "loses" in outlook_note(cpu) and "greedy and beam are slower" in outlook_note(cpu)
    assert cpu.break_even is None  # 5 tokens for the price of 5 plain steps: not even all guesses right pays
    assert 0.1 < gpu.break_even < 0.5  # a verify step of 5 tokens costs 1.2 plain steps
    assert "at least" in outlook_note(gpu) and f"{gpu.speedup:.2f}x" in outlook_note(gpu)
    middle = batch_one_outlook({(1, k): 10.0 * (1 + 0.45 * (k - 1)) for k in range(1, 6)}, 4)  # a middle case: a verify step of 5 tokens at 2.8 plain steps
    assert not middle.loses and 0.5 < middle.break_even < 0.9
    assert f"at least {middle.break_even:.0%} of tokens right" in outlook_note(middle)
    assert outlook_note(None) == UNMEASURED


def test_the_engine_measures_once_with_progress_then_reads_its_cache(engine):
    assert engine.speculation_step_times(2) is None  # never measures unasked: the settings screen only reads
    seen = []
    table = engine.speculation_step_times(2, measure=True, progress=seen.append)
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) > 1
    assert set(table) >= {(1, 1), (1, 2), (1, 3)} and all(ms > 0 for ms in table.values())
    assert engine.speculation_step_times(2) == table
    assert engine.speculation_outlook(2) == batch_one_outlook(table, 2)
    assert "speculation" in speculation_note(engine, 2) or "draft head" in speculation_note(engine, 2)
    assert speculation_note(object(), 2) == ""  # an engine that does not measure step times: no note


@pytest.mark.anyio
async def test_the_settings_screen_says_speculation_loses_here(engine, monkeypatch):
    lengths = []
    monkeypatch.setattr(engine, "speculation_step_times", lambda n, **kw: lengths.append(n) or CPU_LIKE)
    app = MoedeskApp(engine, settings=greedy_settings(draft_length=3))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: chat_ready(app), what="the chat")
        await open_settings(pilot)
        note = app.screen.query_one("#note-speculative")
        assert "On this machine speculation loses" in str(note.render())
        assert note.region.height >= 1  # on screen, under the field
    assert lengths == [3]
