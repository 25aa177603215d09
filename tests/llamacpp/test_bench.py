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
