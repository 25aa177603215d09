"""tests/perf/profile_gpu_decode.py's step timeline, from a Chrome trace as torch.profiler writes it (no GPU)."""
from __future__ import annotations

from tests.perf import profile_gpu_decode as prof


def test_the_last_step_is_read_from_the_trace_with_its_idle_gaps():
    trace = {"traceEvents": [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},  # host work: not a kernel
        {"cat": "kernel", "name": "_q8_mm", "ts": 100, "dur": 30},
        {"cat": "kernel", "name": "_q8_mm", "ts": 10, "dur": 20},  # out of order: sorted by start
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 140, "dur": 5},
        {"cat": "kernel", "name": "triton_poi_fused_mul_0", "ts": 160, "dur": 4},
        {"cat": "kernel", "name": "flash_attention_decode", "ts": 164, "dur": 6},
        {"cat": "kernel", "name": "no duration", "ts": 200},
    ]}
    kernels = prof.kernels_of(trace)
    assert [k[2] for k in kernels] == ["_q8_mm", "_q8_mm", "Memcpy HtoD", "triton_poi_fused_mul_0",
                                       "flash_attention_decode"]
    rows = prof.last_step(kernels, 4)
    # offsets from the step's first start (100), idle time since the previous kernel ended
    assert rows == [(0.0, 30.0, 0.0, "_q8_mm"), (40.0, 5.0, 10.0, "Memcpy HtoD"),
                    (60.0, 4.0, 15.0, "triton_poi_fused_mul_0"), (64.0, 6.0, 0.0, "flash_attention_decode")]
    lines = prof.timeline_lines(rows, top=2)
    assert lines[0] == "  one step: 4 kernels over 70.0 µs, busy 45.0 µs, idle between them 25.0 µs (2 gaps over 5 µs)"
    assert len(lines) == 3 and "(packed experts): _q8_mm" in lines[1] and "(attention)" in lines[2]
    assert prof.last_step(kernels, 0) == [] and prof.timeline_lines([]) == ["  (no kernels in the step)"]


def test_overlapping_kernels_count_no_idle_time():
    """Kernels on two streams overlap: the idle gap runs from the latest end so far, never negative."""
    rows = prof.last_step([(0.0, 50.0, "a"), (10.0, 5.0, "b"), (55.0, 5.0, "c")], 3)
    assert [r[2] for r in rows] == [0.0, 0.0, 5.0]


def test_the_timeline_file_holds_the_long_runs_last_step(tmp_path, capsys):
    """Two steps more in the long run than the short one, 2 kernels a step: the file holds the last 2."""
    import json

    def trace(n):
        return {"traceEvents": [{"cat": "kernel", "name": f"k{i % 2}", "ts": 10 * i, "dur": 4} for i in range(n)]}

    path = tmp_path / "t.tsv"
    (tmp_path / "t.tsv.trace.json.short").write_text(json.dumps(trace(6)))
    (tmp_path / "t.tsv.trace.json").write_text(json.dumps(trace(10)))
    prof.write_timeline(str(tmp_path / "t.tsv.trace.json"), str(path), steps=2)
    lines = path.read_text().splitlines()
    assert [line.split("\t")[-1] for line in lines] == ["k0", "k1"]
    assert [float(line.split("\t")[2]) for line in lines] == [0.0, 6.0]  # idle: 10 µs apart, 4 µs long
    assert "one step: 2 kernels over 14.0 µs" in capsys.readouterr().out
