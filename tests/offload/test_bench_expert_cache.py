"""tests/perf/bench_expert_cache.py within a device command's time: the targets' cases first, a time limit that ends
the run with the finished cases written, and tests/perf/issue42_summary.py reading a file cut short."""
from __future__ import annotations

import json
import sys

import pytest

from tests.perf import bench_expert_cache as bench
from tests.perf.issue42_summary import summary


def test_the_targets_four_cases_come_first_then_the_other_intervals_then_the_cache_started_per_expert():
    plan = [(c.trace, c.placement, c.interval, c.whole_layers) for c in bench.case_plan([16, 1])]
    assert plan[:4] == [("conversation", "fixed", None, True), ("conversation", "cache every 16", 16, True),
                        ("no locality", "fixed", None, True), ("no locality", "cache every 16", 16, True)]
    assert plan[4:] == [("conversation", "cache every 1", 1, True), ("no locality", "cache every 1", 1, True),
                        ("conversation", "cache every 16, per expert", 16, False),
                        ("no locality", "cache every 16, per expert", 16, False)]


def test_a_case_starts_only_where_the_slowest_so_far_still_ends_in_time():
    assert bench.fits(50.0, None, [30.0])
    assert bench.fits(50.0, 100.0, [])  # the first case: whenever time is left
    assert not bench.fits(100.0, 100.0, [])
    assert bench.fits(50.0, 100.0, [20.0, 40.0])  # 50 + 40 + 5 < 100
    assert not bench.fits(60.0, 100.0, [20.0, 40.0])
    assert bench.ratio_noise(0.03, 0.04) == pytest.approx(0.05)


def test_a_run_cut_by_its_time_limit_keeps_what_it_finished(tmp_path, monkeypatch, capsys):
    """Three cases fit (the limit's decision replaced, so that the test does not hang on this machine's speed):
    the file holds them in the plan's order, each timed over the same steps of the same trace, and names the rest."""
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path / "cache"))
    from moedesk.engine.offload.expert_cache import SwapPrice

    monkeypatch.setattr(bench, "fits", lambda elapsed, limit, durations: len(durations) < 3)
    # Free copies and no noise margin: this machine's profile must not decide whether the cache moves experts.
    monkeypatch.setattr(SwapPrice, "from_model", classmethod(lambda cls, costs: cls(1.0, 0.0, 0.0)))
    out = tmp_path / "expert_cache.json"
    monkeypatch.setattr(sys, "argv", ["bench_expert_cache.py", "--shape", "tiny-moe", "--device", "cpu",
                                      "--gpu-budget", "0.003", "--decode-tokens", "24", "--warmup", "4",
                                      "--time-limit", "1", "--json", str(out)])
    assert bench.main() == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["trace"], r["placement"]) for r in rows] == [
        ("conversation", "fixed"), ("conversation", "cache every 16"), ("no locality", "fixed")]
    assert report["skipped"] == ["no locality, cache every 16", "conversation, cache every 1",
                                 "no locality, cache every 1", "conversation, cache every 16, per expert",
                                 "no locality, cache every 16, per expert"]
    assert report["complete"] is False and report["warmup_steps"] == 4
    # tiny-moe: 4 MoE layers, top-2; 24 tokens = the prompt's + 4 untimed + 19 timed decode steps (a swap round at 16)
    assert all(r["timed_steps"] == 19 and r["selections"] == 19 * 4 * 2 for r in rows)
    assert 0 < rows[0]["experts_on_gpu"] == rows[1]["experts_on_gpu"] < 32  # one budget, the experts partly resident
    assert rows[0]["whole_layers"] == rows[1]["whole_layers"]  # the cache starts from the fixed placement
    assert rows[0]["swaps_per_step"] == 0 and rows[1]["swaps_per_step"] > 0  # the cache moved experts
    assert rows[0]["vs_fixed"] == 1.0 and rows[0]["vs_fixed_noise"] is None and rows[1]["vs_fixed_noise"] > 0
    assert "skipped at the time limit: no locality, cache every 16, per expert" in capsys.readouterr().out


def _row(trace, placement, vs_fixed):
    return {"trace": trace, "placement": placement, "experts_on_gpu": 131, "whole_layers": 0, "tok_s": 10 * vs_fixed,
            "vs_fixed": vs_fixed, "vs_fixed_noise": None if placement == "fixed" else 0.012, "gpu_hit_rate": 0.5,
            "swaps_per_step": 0.0}


def test_the_summary_judges_each_interval_on_both_traces_and_says_what_was_not_measured(tmp_path):
    (tmp_path / "expert_cache.json").write_text(json.dumps({
        "experts_on_gpu": 131, "experts": "q4_k", "complete": False,
        "skipped": ["no locality, cache every 16", "no locality, fixed, per expert"],
        "rows": [_row("conversation", "fixed", 1.0), _row("conversation", "cache every 16", 1.3),
                 _row("no locality", "fixed", 1.0), _row("conversation", "cache every 16, per expert", 0.9)]}))
    text = summary(str(tmp_path))
    assert "per expert / fixed" not in text  # shown in the table, not judged: the engine's cache keeps whole layers
    assert "cut at the time limit after 4 cases; not run: no locality, cache every 16" in text
    lines = {line.split("  ")[0]: line for line in text.splitlines() if line.startswith("cache every")}
    assert lines["cache every 16 / fixed, conversation trace"].endswith("1.30x  1.25x  yes")
    assert lines["cache every 16 / fixed, no locality trace"].endswith("-  0.98x  not measured")
    assert "1.30x ±1.2%" in text
    assert summary(str(tmp_path / "absent")).endswith("nothing measured: see issue42_targets.log and the logs in the "
                                                      "archive")
