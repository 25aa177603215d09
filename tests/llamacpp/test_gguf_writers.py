"""tests/perf's GGUF writers for the llama-bench comparisons share bench/synthetic_gguf.py's: what they write,
llama.cpp loads and runs (at toy sizes here; the GPU box writes the real shapes)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LLAMA_OFF_CHILD

llama_cpp = pytest.importorskip("llama_cpp")
ROOT = Path(__file__).resolve().parents[2]


def test_the_qwen3_writer_is_the_bench_shape_and_llama_cpp_runs_it(tmp_path):
    from gguf import GGUFReader

    out = tmp_path / "qwen3.gguf"
    done = subprocess.run([sys.executable, str(ROOT / "tests/perf/make_qwen3_gguf.py"), str(out), "2", "--tiny"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reader = GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["qwen3moe.expert_used_count"].contents() == 2
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes["blk.1.ffn_gate_exps.weight"] == (64, 32, 8)  # GGUF order: hidden, expert rows, experts
    assert "blk.1.attn_k_norm.weight" in shapes and "blk.2.attn_norm.weight" not in shapes
    # logits_all: without it llama-cpp-python leaves `scores` unwritten (uninitialised memory, finite by luck)
    model = llama_cpp.Llama(str(out), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    assert model.n_vocab() == 512
    model.eval([1, 300, 301, 302])
    assert model.scores[3].shape == (512,) and np.isfinite(model.scores[:4]).all() and model.scores[3].std() > 0


# llama.cpp aborts the whole process on some malformed files (an F16 Gated DeltaNet convolution failed a GGML_ASSERT
# in llama-bench on the GPU box): the file is run in a child process, whose exit status the test reads.
RUN = """
import sys, numpy as np, llama_cpp
model = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, logits_all=True, verbose=False)
model.eval([1, 300, 301, 302])
scores = np.array(model.scores[:4])
print(model.metadata["general.architecture"], scores.shape[1], bool(np.isfinite(scores).all()), float(scores[3].std()))
"""


@pytest.mark.parametrize("shape, arch", [("qwen3.5-35b-a3b", "qwen35moe"), ("deepseek-v3", "deepseek2"),
                                         ("glm-4.5-air", "glm4moe"), ("gpt-oss-20b", "gpt-oss"),
                                         ("qwen3-30b-a3b", "qwen3moe")])
def test_the_family_writer_at_toy_sizes_writes_what_llama_cpp_runs(tmp_path, shape, arch, monkeypatch,
                                                                   llama_extra_buffers):
    """make_family_gguf.py's files for llama-bench, with --tiny dimensions: llama.cpp loads them and computes finite,
    varied logits. The tensors llama.cpp's converter keeps in F32 (routers, the DeltaNet convolution) stay F32."""
    from gguf import GGMLQuantizationType, GGUFReader

    from tests.perf import make_family_gguf

    out = tmp_path / f"{shape}.gguf"
    monkeypatch.setattr(sys, "argv", ["make_family_gguf.py", shape, str(out), "4", "--tiny"])
    make_family_gguf.main()  # in this process: a child would spend most of its time importing transformers
    types = {t.name: t.tensor_type for t in GGUFReader(out).tensors}
    kept = [n for n in types if n.endswith(("ffn_gate_inp.weight", "ssm_conv1d.weight"))]
    assert kept and all(types[n] == GGMLQuantizationType.F32 for n in kept)
    run = RUN if llama_extra_buffers else LLAMA_OFF_CHILD + RUN
    ran = subprocess.run([sys.executable, "-c", run, str(out)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, f"llama.cpp exited with {ran.returncode}: {ran.stderr[-1500:]}"
    name, vocab, finite, spread = ran.stdout.split()[-4:]
    assert (name, vocab, finite) == (arch, "512", "True") and float(spread) > 0


@pytest.mark.parametrize("shape", ["gpt-oss-20b", "glm-4.5-air"])
def test_the_family_writer_spreads_routing_where_the_family_has_biases(tmp_path, shape, monkeypatch):
    """The benches compare prefill against llama.cpp, which copies only the experts a prompt picks: its file must
    route random tokens over the experts as the native bench's model does. Biases near 1 in every dimension (gpt-oss's
    attention output and experts, GLM's q/k/v) gave each token the same residual, and tensors that all began at the
    same random value made a router's first row a bias: every token then picked expert 0 and one or two others."""
    from tests.perf import make_family_gguf
    from tests.perf.prompt_picks import prompt_picks

    out = tmp_path / f"{shape}.gguf"
    monkeypatch.setattr(sys, "argv", ["make_family_gguf.py", shape, str(out), "3", "--tiny"])
    make_family_gguf.main()
    picks = prompt_picks(str(out), tokens=128, seed=1)
    assert len(picks) >= 2
    for row in picks[:-1]:  # llama.cpp runs the last layer for the tokens whose logits it returns only (most families)
        assert row.sum() == 128 * 2  # every prompt token's top-2: the counts are whole
        assert (row > 0).sum() >= 6 and row.max() < 0.45 * row.sum(), row  # the old files: 2-3 of 8, one in every top-2
