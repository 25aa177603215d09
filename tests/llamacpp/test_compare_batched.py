"""tests/perf/compare_llamacpp_engine.py's llama-batched-bench line: llama.cpp's own 4-over-1 decode ratio, printed
beside serve's on the GPU box. Here its output is parsed from a stand-in that writes what the tool writes. And the
placement sweep cut to the least fitting -ncmoe values (--sweep-span), for the whole model's budgets."""
import importlib.util
import json
import stat
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "compare_llamacpp_engine.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_llamacpp_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(pl: int, speed_tg: float) -> str:
    # the fields llama-batched-bench's --output-format jsonl writes (tools/batched-bench), a few of them
    return json.dumps({"n_kv_max": 768, "pp": 128, "tg": 64, "pl": pl, "n_kv": pl * 192, "t_tg": 64 * pl / speed_tg,
                       "speed_tg": speed_tg, "speed": speed_tg})


def test_rates_come_from_the_jsonl_lines_only(compare):
    text = "\n".join(["main: n_kv_max = 768, n_batch = 2048", "|    PP |     TG |    B |", _row(1, 190.5),
                      "{not json", _row(4, 402.25), "llama_perf_context_print: total time"])
    assert compare.batched_rates(text) == {1: 190.5, 4: 402.25}


def test_the_line_gives_four_over_one(compare):
    line = compare.batched_line({1: 200.0, 4: 500.0}, 128, 64)
    assert "1 sequence 200.0, 4 sequences 500.0 tok/s" in line and "4 over one 2.50x" in line
    assert "no rates" in compare.batched_line({4: 500.0}, 128, 64)


def test_the_tool_is_asked_for_one_and_four_sequences_on_the_gpu(compare, tmp_path):
    args = tmp_path / "args.txt"
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args}\necho 'main: loading'\n"
                    f"echo '{_row(1, 150.0)}'\necho '{_row(4, 330.0)}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    rates = compare.batched_bench(str(fake), "model.gguf", 16)
    assert rates == {1: 150.0, 4: 330.0}
    asked = args.read_text().split()
    value = lambda flag: asked[asked.index(flag) + 1]  # noqa: E731
    assert value("-npl") == "1,4" and value("-ngl") == "99" and value("-m") == "model.gguf"
    assert value("--output-format") == "jsonl" and value("-t") == "16"
    assert int(value("-c")) >= 4 * (int(value("-npp")) + int(value("-ntg")))  # room for four sequences
    assert "-ncmoe" not in asked  # every expert on the GPU, as serve's 10 GiB run


def test_the_sweep_span_times_the_least_fitting_ncmoe_and_the_next_n(compare, monkeypatch, capsys):
    # --sweep-span 1 on a budget that fits -ncmoe 2 to 8: llama-bench at 2 and 3 only, the engine once
    totals = {m: (10 - m) * 1e9 for m in range(9)}  # GPU bytes llama.cpp takes at each -ncmoe
    monkeypatch.setattr(compare, "needs", lambda *a: {m: {"llama_cpp": {"total": t}} for m, t in totals.items()})
    assert not compare.swept_enough({m: {"llama_cpp": {"total": totals[m]}} for m in range(3)}, [int(8e9)], 1)
    timed = []
    monkeypatch.setattr(compare, "llama_bench", lambda binary, gguf, m, *a: timed.append(m) or {"tg": 50.0 - m})
    engine_runs = []

    def ours(*a, count_experts=True, decodes=1):
        engine_runs.append((count_experts, decodes))
        tg = 47.0 if count_experts else 48.0
        return {"ncmoe": 2, "tg": tg, "tg_runs": [tg] * decodes, "why": "w", "gpu_bytes": 7e9}

    monkeypatch.setattr(compare, "ours", ours)
    args = type("Args", (), dict(budgets="8", prompt=512, tokens=64, threads=4, llama_bench="lb", sweep_span=1,
                                 reps=3))
    report = {}
    compare.placement_lines(args, "m.gguf", None, report)
    assert timed == [2, 3]
    # the engine's choice timed as the wrapper's lines are (the median of --reps decodes), counted and not
    assert engine_runs == [(True, 3), (False, 3)]
    line = report["placement"][0]
    assert line["best_ncmoe"] == 2 and line["ratio"] == round(47 / 48, 3) and line["uncounted_ratio"] == 1.0
    out = capsys.readouterr().out
    assert "best -ncmoe 2" in out and "expert counts off 48.0 = 1.000x" in out


def test_the_sweep_span_stops_the_loads_once_every_budget_has_its_values(compare, monkeypatch, capsys):
    """needs() reads the whole file for each -ncmoe it loads (about ten seconds a load for a whole Mixtral): with a
    span it loads from the least -ncmoe up until each budget has span + 1 values that fit, and no further."""
    class Sizes:
        expert_bytes = [1e9] * 8

    shape = type("Shape", (), {"sizes": Sizes, "other_on_gpu": 1e9})
    loads = []

    def loaded(gguf, n, budget, context, threads, count_experts):
        loads.append(n)
        fit = type("Fit", (), {"gpu_bytes": 1, "compute_bytes": 1, "gpu_total": 2})
        return type("Engine", (), {"fit": fit, "close": lambda self: None})(), {"model": (9 - n) * 1e9 + 5e8}

    monkeypatch.setattr(compare, "loaded", loaded)
    # totals 9.5 GB at -ncmoe 0 down to 1.5 at 8; n = 0's weights alone (9 GB) are over 8.5 GB: not loaded
    found = compare.needs("m.gguf", shape, int(8.5e9), 512, 4, [int(8e9), int(5e9)], 1)
    assert loads == [1, 2, 3, 4, 5, 6]  # 8 GB fits from n = 2 (2 and 3), 5 GB from n = 5 (5 and 6)
    assert sorted(found) == list(range(7)) and found[0]["llama_cpp"]["not_loaded"]
    assert compare.needs("m.gguf", shape, int(8.5e9), 512, 4) and loads[6:] == list(range(1, 9))  # no span: all
