"""auto with a GPU budget too small for the native engine's 16-bit non-expert weights and KV cache: a GGUF goes to
llama.cpp, which keeps the file's packed weights packed (GLM-4.5-Air's non-expert weights take ~12 GiB in 16 bits,
more than an 8 GiB budget); `--engine native` keeps its refusal, and a model llama.cpp cannot take keeps it too.
On the CPU the native engine's offload simulates the GPU tier, so its budget check runs as on a GPU."""
import shutil

import pytest

from moedesk.engine.offload.gpu_budget import ContextBudgetError
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.gguf_from_hf import build

TOO_SMALL = 1e-5  # GiB: ~10 KB, below any model's embeddings


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return build("qwen3moe", tmp_path_factory.mktemp("qwen3moe") / "hf").gguf


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))


def test_auto_takes_llama_cpp_where_the_native_weights_do_not_fit(tiny_gguf):
    engine = Engine.load(str(tiny_gguf), device="cpu", dtype="float32", offload=True, gpu_budget=TOO_SMALL,
                         context_length=128)
    try:
        assert engine.kind == "llama.cpp", engine.why
        assert "native engine does not fit the GPU" in engine.why and "GPU budget" in engine.why
        reply = engine.complete([Request([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0))])[0]
        assert len(reply.token_ids) == 4
    finally:
        engine.close()


def test_native_asked_for_keeps_its_refusal(tiny_gguf):
    with pytest.raises(ContextBudgetError, match="cannot hold the weights"):
        Engine.load(str(tiny_gguf), device="cpu", dtype="float32", offload=True, gpu_budget=TOO_SMALL,
                    context_length=128, engine="native")


def test_a_safetensors_model_keeps_the_native_refusal(tiny_gguf, tmp_path):
    # the transformers checkpoint the GGUF was written from, without the GGUF: llama.cpp reads GGUF files only
    folder = tmp_path / "safetensors"
    shutil.copytree(tiny_gguf.parent, folder, ignore=shutil.ignore_patterns("*.gguf"))
    with pytest.raises(ContextBudgetError, match="cannot hold the weights"):
        Engine.load(str(folder), device="cpu", dtype="float32", offload=True, gpu_budget=TOO_SMALL,
                    context_length=128)


def test_a_budget_that_fits_stays_native(tiny_gguf):
    engine = Engine.load(str(tiny_gguf), device="cpu", dtype="float32", offload=True, gpu_budget=1.0,
                         context_length=128)
    assert engine.kind == "native", engine.why


def test_without_a_budget_the_gpus_free_memory_is_checked_before_reading(tiny_gguf, monkeypatch):
    # No --gpu-budget: the GPU's free memory stands in for it (the CPU here plays a GPU with 1 KB free).
    import moedesk.engine.load.loader as loader
    import moedesk.engine.runtime as runtime

    monkeypatch.setattr(runtime, "_gpu_free_bytes", lambda device: 1000)
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("weights read before the refusal"))
    monkeypatch.setattr(runtime, "load_model", loader.load_model)
    with pytest.raises(ContextBudgetError, match=r"cpu has .* free, less than .* non-expert weights and the KV cache"):
        Engine.load(str(tiny_gguf), device="cpu", dtype="float32", offload=True, context_length=128,
                    engine="native")
    engine = Engine.load(str(tiny_gguf), device="cpu", dtype="float32", offload=True, context_length=128)
    try:
        assert engine.kind == "llama.cpp" and "free, less than" in engine.why, engine.why
    finally:
        engine.close()
