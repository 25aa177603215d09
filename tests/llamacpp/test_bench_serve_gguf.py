"""tests/perf/bench_serve.py on a GGUF, as the GPU box runs it for issue 40's serve target (`--model FILE.gguf
--engine llama.cpp`): it read the model's shape from a config.json inside --model, which a GGUF file has not."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "perf"))

from bench_serve import model_facts  # noqa: E402 -- a script's helpers, beside it


def test_a_gguf_s_layers_and_vocabulary_are_llama_cpp_s():
    from moedesk.engine.load.demo import source_gguf

    path = source_gguf()
    layers, vocab, files = model_facts(path)
    reference = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    arch = reference.metadata["general.architecture"]
    assert (layers, vocab) == (int(reference.metadata[f"{arch}.block_count"]), reference.n_vocab())
    assert files == [path]


def test_the_serve_bench_runs_on_a_gguf_with_the_llama_cpp_engine(tmp_path):
    """The whole script, as llamacpp_engine_gpu.sh calls it, on the demo's GGUF on the CPU: two streaming clients."""
    from moedesk.engine.load.demo import source_gguf

    report = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "tests/perf/bench_serve.py", "--model", str(source_gguf()), "--engine",
                           "llama.cpp", "--device", "cpu", "--clients", "2", "--prompt-tokens", "8", "--max-tokens",
                           "4", "--context", "256", "--port", "8793", "--json", str(report)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    numbers = json.loads(report.read_text())
    assert numbers["clients"] == 2 and numbers["alone_tok_s"] > 0 and numbers["together_tok_s"] > 0
    assert abs(numbers["checkpoint_gb"] - source_gguf().stat().st_size / 1e9) < 1e-9  # the file itself was read
