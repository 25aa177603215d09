"""bench's report reads: three significant digits, columns that never run together, the profile in words, the
spread of its rounds, and a warning when other processes took the CPU while it ran (issue 46, item 8)."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil

from moedesk.bench.machine_load import BUSY_SHARE, CpuLoad, busy_warning, others_share
from moedesk.bench.report_text import profile_line, significant, text_table
from moedesk.bench.budget import budget_for_experts
from moedesk.bench.synthetic import bench_context, format_results, slowest, spread, stall_line
from moedesk.engine.load.synthetic import shape_config

# What the bench printed on this machine's CPU (issue 46): 17-digit floats in raw dicts.
PROFILE = {"cpu_expert_ms": {"1": 15.65594199928455, "4": 163.99032399931457, "256": 226.64315000110946},
           "gpu_expert_ms": {"1": 1.260761000594357, "4096": 1867.0337639996433}, "copy_expert_ms": 59.79,
           "cpu_read_gbs": 5.4, "h2d_gbs": 0.0}


def test_three_significant_digits_without_exponents():
    assert [significant(x) for x in (15.65594199928455, 1867.0337639996433, 0.0123456, 1.26076, 4576.6126, 0.0,
                                     None)] == ["15.7", "1870", "0.0123", "1.26", "4580", "0", "-"]
    assert significant(12628255.6) == "12600000"


def test_the_profile_line_has_no_raw_dicts_or_long_floats():
    line = profile_line(PROFILE)
    assert "{" not in line and "15655" not in line
    assert "1: 15.7 · 4: 164 · 256: 227 ms" in line and "4096: 1870 ms" in line and "copy 59.8 ms" in line


def test_columns_are_apart_however_long_the_numbers():
    lines = text_table(["mode", "tok/s", "bound"], [["prefill", "4576.6", "12628255.6"], ["decode", "2.4", "-"]])
    assert "4576.6  12628255.6" in lines[1]  # once "4576.612628255.6"
    assert len({len(line) for line in lines[:2]}) == 1
    rows = text_table(["tok/step", "γ used"], [["1.00", "plain path"]], left=0)
    assert rows[1] == "    1.00  plain path"  # once "1.00-plain path" under a 9-wide column


def report(**changes) -> dict:
    r = {"shape": "qwen3-30b-a3b", "layers": 1, "experts": 128, "gpu_budget_gib": 0.0, "experts_on_gpu": 0,
         "policy": "balanced", "other_cpu_share": 0.0,
         "results": [{"mode": "prefill", "tokens": 512, "batch": 1, "depth": 0, "tok_s": 4576.612628, "spread": 0.08,
                      "bound_tok_s": 255.6, "pct_of_bound": 1790.5},
                     {"mode": "decode", "tokens": 64, "batch": 1, "depth": 0, "tok_s": 2.4, "spread": None,
                      "bound_tok_s": None, "pct_of_bound": None}]}
    r.update(changes)
    return r


def test_the_results_table_shows_the_spread_and_warns_when_busy():
    text = format_results(report())
    header, prefill = text.splitlines()[1:3]
    assert header.split() == ["mode", "tokens", "batch", "depth", "tok/s", "spread", "bound", "%", "bound"]
    assert prefill.split() == ["prefill", "512", "1", "0", "4580", "±4%", "256", "1790"]
    assert "warning" not in text
    busy = format_results(report(other_cpu_share=0.35))
    assert busy.splitlines()[-1].startswith("warning: other processes took 35% of the CPU")


def test_spread_of_rounds():
    assert spread([1.0]) is None
    assert spread([1.0, 1.1, 1.2]) == (1.2 - 1.0) / 1.1
    assert abs(spread([2.0, 1.0, 1.0, 3.0]) - 2.0 / 1.5) < 1e-12


def test_the_slowest_rounds_say_where_a_spread_came_from_and_a_stall_gets_a_line():
    assert slowest([0.1]) is None
    steps = [0.15, 0.14, 1.3, 0.16, 0.15]
    assert slowest(steps) == {"median_ms": 150.0, "rounds": [[2, 1300.0], [3, 160.0], [0, 150.0]]}
    stalled = {"mode": "batched_decode", "slowest": slowest(steps)}
    assert stall_line(stalled) == "batched decode: timed step 3 took 1300 ms, 8.7x the median step's 150 ms"
    assert stall_line({"mode": "prefill", "slowest": slowest([0.3, 0.35, 0.5])}) is None  # within twice the median
    assert stall_line({"mode": "decode", "slowest": None}) is None
    text = format_results(report(results=[{**report()["results"][0], "slowest": slowest([0.1, 0.12, 2.5])}]))
    assert text.splitlines()[-1] == "prefill: timed prefill 3 took 2500 ms, 20.8x the median prefill's 120 ms"
    built = {"count": 2, "ms": 2301.5, "kernels": ["_packed_mm", "_q8_mm"]}
    assert stall_line({**stalled, "kernel_builds": built}) == (
        "batched decode: timed step 3 took 1300 ms, 8.7x the median step's 150 ms; Triton built 2 kernel variants in "
        "the timed steps, 2300 ms (_packed_mm, _q8_mm)")


def test_the_load_of_other_processes_is_measured():
    assert others_share(system_busy_s=3.0, own_s=1.0, wall_s=2.0, cores=2) == 0.5
    assert others_share(1.0, 2.0, 1.0, 2) == 0.0  # never negative
    assert busy_warning(BUSY_SHARE - 0.01) is None and busy_warning(BUSY_SHARE) is not None
    load = CpuLoad()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    try:
        time.sleep(1.5)
    finally:
        spinner.wait(10)
    # Another process spinning a whole core for the whole time (the machine's other load only adds to it).
    assert load.others() > 0.5 / psutil.cpu_count()


def test_a_real_bench_reports_its_spread_and_the_machines_load():
    from moedesk.bench.synthetic import run_bench

    lines = []
    budget = budget_for_experts(shape_config("tiny-moe", 2), 2, bench_context((16,), 6), "dense", "cpu")
    r = run_bench("tiny-moe", 2, budget, device="cpu", decode_tokens=6, prefill=(16,), batch=2, log=lines.append)
    assert all(x["spread"] is not None and x["spread"] >= 0 for x in r["results"])  # decode steps, prefill repeats
    assert 0 <= r["other_cpu_share"] <= 1
    assert any(line.startswith("profile: one expert on the CPU") and "{" not in line for line in lines)
    text = format_results(r)
    assert "±" in text and ("warning" in text) == (r["other_cpu_share"] >= BUSY_SHARE)
    e = r["results"][1]["experts"]  # the prefill's split, per run, in words
    assert f"prefill 16, per run: {e['experts_cpu'] / 3:.0f} experts on the CPU, {e['experts_copied'] / 3:.0f} copied" \
        in text
    for result in (r["results"][0], r["results"][2]):  # the decode runs' split, per timed step (6 tokens: 4 timed)
        e = result["experts"]
        assert e["experts_gpu"] + e["experts_cpu"] + e["experts_copied"] + e["experts_zero_copy"] > 0
        label = "decode of 1" if result["batch"] == 1 else "batched decode of 2"
        assert f"{label}, per step: {e['experts_cpu'] / 4:.0f} experts on the CPU" in text
        # the layers' host time besides the CPU's call and the wait: deciding, gathering, queueing the GPU's share
        assert 0 < e["queue_ms"] <= e["moe_ms"] - e["gpu_wait_ms"]
        assert f"{e['gpu_wait_ms'] / 4:.1f} waiting for the routing, {e['queue_ms'] / 4:.1f} queueing)" in text


def test_every_bench_mode_warns_when_the_machine_was_busy(monkeypatch, capsys):
    import moedesk.app.cli as cli
    import moedesk.bench.machine_load as machine_load

    ran = []
    monkeypatch.setattr(cli, "_run_decoding_bench", lambda args, log: ran.append("decoding") or 0)
    monkeypatch.setattr(machine_load.CpuLoad, "others", lambda self: 0.4)
    assert cli.main(["bench", "--speculative", "--device", "cpu"]) == 0
    assert ran == ["decoding"]
    assert "moedesk: warning: other processes took 40% of the CPU" in capsys.readouterr().err
    monkeypatch.setattr(machine_load.CpuLoad, "others", lambda self: 0.01)
    assert cli.main(["bench", "--beams", "4", "--device", "cpu"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_bench_spreads_the_layers_over_one_budget_per_device(capsys, monkeypatch, tmp_path):
    """`bench --gpu-budget A,B`: each figure a device's whole budget, the layers spread (on the CPU, the CPU twice);
    the report names each device's MoE layers and resident experts, and llama.cpp refuses several figures."""
    import json

    import moedesk.app.cli as cli

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    args = ["bench", "--shape", "tiny-moe", "--layers", "2", "--device", "cpu", "--decode-tokens", "4",
            "--prefill", "8", "--batch", "1"]
    assert cli.main([*args, "--gpu-budget", "0.0008,0.0008", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu_budget_gib"] == [0.0008, 0.0008]
    devices = report["devices"]
    assert [d["moe_layers"] for d in devices] == [[0, 0], [1, 1]]
    assert sum(d["experts_on_gpu"] for d in devices) == report["experts_on_gpu"] > 0
    assert all(0 < d["experts_on_gpu"] < d["experts_total"] for d in devices)  # both tiers on both devices
    assert "GPU 1 (cpu): MoE layers 1-1" in format_results(report)
    assert cli.main([*args, "--gpu-budget", "1,1", "--engine", "llama.cpp"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "one --gpu-budget figure per GPU is for the native engine" in err


def test_the_per_device_plan_counts_packed_weights_packed(capsys, monkeypatch, tmp_path):
    """`bench --gpu-budget A,B` with packed experts: the non-expert weights synthetic_model keeps packed are counted
    packed in each device's plan, so the same budgets hold more experts than with them in 16 bits."""
    import json

    import moedesk.app.cli as cli

    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    args = ["bench", "--shape", "tiny-moe", "--layers", "2", "--device", "cpu", "--decode-tokens", "4",
            "--prefill", "8", "--batch", "1", "--expert-format", "q8_0", "--gpu-budget", "0.0004,0.0004", "--json"]
    held = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("MOEDESK_PACKED_WEIGHTS", setting)
        assert cli.main(args) == 0
        held[setting] = json.loads(capsys.readouterr().out)["experts_on_gpu"]
    assert held["1"] > held["0"] > 0, held
