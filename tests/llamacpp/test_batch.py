"""`moedesk batch --engine llama.cpp`: per-line sampling, and a rerun resumes, on the demo's GGUF."""
from __future__ import annotations

import pytest

from tests.app.test_batch import read_jsonl, write_jsonl

pytest.importorskip("llama_cpp")


def test_batch_on_llama_cpp_samples_per_line_and_resumes(tmp_path, monkeypatch, demo_reference):
    from moedesk.app.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    lines = [{"id": "greedy", "prompt": "The capital of France is", "temperature": 0, "max_new_tokens": 12},
             {"id": "seeded", "prompt": "Once upon a time", "temperature": 0.9, "seed": 5, "max_new_tokens": 12}]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines[:1]), tmp_path / "out.jsonl"
    flags = ["--engine", "llama.cpp", "--model", "demo", "--context", "128", "--device", "cpu"]
    assert main(["batch", str(src), "-o", str(out), *flags]) == 0
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    assert main(["batch", str(src), "-o", str(out), *flags]) == 0  # resumes: only the new line runs
    results = read_jsonl(out)
    assert [r["id"] for r in results] == ["greedy", "seeded"]
    demo_reference.reset()
    expected = demo_reference.create_completion("The capital of France is", max_tokens=12, temperature=0.0,
                                                repeat_penalty=1.0)["choices"][0]["text"]
    assert results[0]["text"] == expected
    again = tmp_path / "again.jsonl"
    assert main(["batch", str(src), "-o", str(again), *flags]) == 0
    assert read_jsonl(again)[1]["text"] == results[1]["text"]  # a line's seed gives its text, whatever ran beside
