"""llama.cpp's AMX buffers where they crash the machine: a child process probes once per machine, and the engine
loads without them where it died (engine/llamacpp/amx_probe.py)."""
from __future__ import annotations

import pytest

from moedesk.engine.llamacpp import amx_probe

pytest.importorskip("llama_cpp")

FLAGS = "processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile{}\nbogomips\t: 4000\n"


def test_amx_int8_in_the_flags_is_what_counts():
    assert amx_probe.cpu_advertises_amx(FLAGS.format(" amx_int8"))
    assert not amx_probe.cpu_advertises_amx(FLAGS.format(""))
    assert not amx_probe.cpu_advertises_amx("model name\t: amx_int8 in a name, not a flag\n")


@pytest.mark.parametrize("status, safe", [(0, True), (1, True), (-11, False), (-4, False)])
def test_a_child_that_died_of_a_signal_turns_the_buffers_off_once_per_machine(tmp_path, monkeypatch, status, safe):
    monkeypatch.setattr(amx_probe, "cpu_advertises_amx", lambda: True)
    runs = []
    probe = lambda: runs.append(status) or status  # noqa: E731
    assert amx_probe.extra_buffers_safe(tmp_path, "9.9", run=probe) is safe
    assert amx_probe.extra_buffers_safe(tmp_path, "9.9", run=probe) is safe and len(runs) == 1  # cached
    assert amx_probe.extra_buffers_safe(tmp_path, "9.10", run=probe) is safe and len(runs) == 2  # another version


def test_no_probe_where_the_cpu_has_no_amx(tmp_path, monkeypatch):
    monkeypatch.setattr(amx_probe, "cpu_advertises_amx", lambda: False)
    assert amx_probe.extra_buffers_safe(tmp_path, "9.9", run=lambda: pytest.fail("probed"))


def test_the_engine_loads_without_extra_buffers_where_the_probe_says_so(monkeypatch):
    from moedesk.engine.llamacpp import engine as llamacpp_engine
    from moedesk.engine.llamacpp.library import library
    from moedesk.engine.requests import Request, SamplingParams
    from moedesk.engine.runtime import Engine

    monkeypatch.setattr(llamacpp_engine, "extra_buffers_safe", lambda cache, version: False)
    lib = library()
    mark = lib.log_mark()
    engine = Engine.load("demo", engine="llama.cpp", context_length=64)
    try:
        log = "\n".join(lib.log_since(mark))
        assert "model buffer size" in log and "AMX model buffer" not in log and "REPACK" not in log
        assert any("AMX kernels crashed in a probe" in w for w in engine.warnings)
        [done] = engine.complete([Request([1, 504, 3575, 282], SamplingParams(max_new_tokens=4, temperature=0))])
        assert len(done.token_ids) == 4
    finally:
        engine.close()
