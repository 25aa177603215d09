"""`moedesk bench --engine llama.cpp`: a benchmark shape written as GGUF in the format asked, run through the
llama.cpp engine, every mode reported."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp")


def test_bench_writes_the_shape_as_gguf_in_the_format_and_measures_each_mode(capsys, monkeypatch):
    from gguf import GGMLQuantizationType, GGUFReader

    from moedesk.app.cli import main
    from moedesk.engine.load.demo import cache_root

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["bench", "--engine", "llama.cpp", "--shape", "tiny-moe", "--layers", "2", "--expert-format", "q4_0",
                 "--batch", "2", "--prefill", "16", "--decode-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "llama.cpp"
    assert [(r["mode"], r["batch"]) for r in report["results"]] == [("decode", 1), ("prefill", 1), ("batched_decode", 2)]
    assert all(r["tok_s"] > 0 for r in report["results"])
    tensors = {t.name: t for t in GGUFReader(cache_root() / "bench-gguf" / "tiny-moe-2L-q4_0.gguf").tensors}
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == GGMLQuantizationType.Q4_0
    assert report["expert_stats"]["experts_total"] == 2 * 8


@pytest.fixture(scope="module")
def f16_gguf(tmp_path_factory):
    from dataclasses import replace

    from moedesk.bench.synthetic_gguf import write_f16
    from moedesk.engine.load.synthetic import shape_config

    # Rows of 256 values: K-quants' super-block (narrower rows get llama.cpp's fallback types).
    cfg = replace(shape_config("tiny-moe", 2), hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
                  head_dim=64)
    path = tmp_path_factory.mktemp("f16") / "moe-2L-dense.gguf"
    write_f16(cfg, path)
    return path


def expert_types(path) -> set:
    from gguf import GGUFReader

    return {t.tensor_type.name for t in GGUFReader(path).tensors if "_exps." in t.name}


def test_the_quantiser_writes_q4_k_m_in_a_child_process(f16_gguf, tmp_path):
    """Q4_K_M as llama.cpp makes it: its experts' gate and up in Q4_K (down in Q4_K or Q6_K, its mix)."""
    from moedesk.bench.gguf_quantize import quantize

    out = tmp_path / "q4_k_m.gguf"
    quantize(f16_gguf, out, 15, log=lambda line: pytest.fail(f"no fallback expected: {line}"))
    assert expert_types(out) <= {"Q4_K", "Q6_K"} and "Q4_K" in expert_types(out)
    assert not out.with_suffix(".partial").exists()


def crash_first_child(monkeypatch):
    """The next child the quantiser starts dies of SIGSEGV, as the CUDA build's did on the GPU box."""
    import subprocess
    import sys

    from moedesk.bench import gguf_quantize

    real = subprocess.run
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        if len(calls) == 1:
            command = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
        return real(command, **kwargs)

    monkeypatch.setattr(gguf_quantize.subprocess, "run", run)
    return calls


def test_a_crashed_quantiser_falls_back_to_llama_quantize_on_path(f16_gguf, tmp_path, monkeypatch):
    """llama-quantize on PATH takes over with one line said: here a script that checks its arguments as
    llama-quantize reads them (input, output, a type name llama.h knows for that file type, threads) and quantises
    through llama.cpp's library."""
    import stat
    import sys

    from moedesk.bench.gguf_quantize import quantize, usable_cpus

    calls = crash_first_child(monkeypatch)
    tools = tmp_path / "bin"
    tools.mkdir()
    tool = tools / "llama-quantize"
    tool.write_text(f"""#!{sys.executable}
import sys
import llama_cpp
from moedesk.bench.gguf_quantize import quantize_here
source, out, name, threads = sys.argv[1:]
sys.exit(quantize_here(source, out, getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + name), int(threads)))
""")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tools}:{__import__('os').environ['PATH']}")
    said = []
    out = tmp_path / "q8.gguf"
    quantize(f16_gguf, out, 7, log=said.append)
    assert said == [f"llama.cpp's quantiser failed in Python (killed by SIGSEGV); quantising with {tool}"]
    assert calls[1] == [str(tool), str(f16_gguf), str(out.with_suffix(".partial")), "Q8_0", str(usable_cpus())]
    assert expert_types(out) == {"Q8_0"}


def test_a_crashed_quantiser_without_llama_quantize_is_one_line(f16_gguf, tmp_path, monkeypatch):
    from moedesk.bench.gguf_quantize import quantize
    from moedesk.engine.errors import MoedeskError

    crash_first_child(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    out = tmp_path / "q4.gguf"
    with pytest.raises(MoedeskError) as e:
        quantize(f16_gguf, out, 2, log=lambda line: pytest.fail(line))
    assert "\n" not in str(e.value) and "killed by SIGSEGV" in str(e.value) and "llama-quantize on PATH" in str(e.value)
    assert not out.exists() and not out.with_suffix(".partial").exists()
