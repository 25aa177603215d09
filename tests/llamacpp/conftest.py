import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture(scope="session")
def demo_llama():
    """The demo's source GGUF through moedesk's llama.cpp engine, one thread (two shared cores), loaded once."""
    from moedesk.engine.runtime import Engine

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the llama.cpp engine runs as many threads as the native one: torch's
    try:
        engine = Engine.load("demo", engine="llama.cpp", context_length=512)
    finally:
        torch.set_num_threads(before)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def demo_reference():
    """llama-cpp-python's own high-level Llama on the same file: the reference nobody here wrote."""
    from moedesk.engine.load.demo import source_gguf

    # flash_attn: the engine keeps llama.cpp's own default (auto, which takes flash attention here, as llama-bench
    # and llama-server do); Llama() turns it off unless asked, and the attention's sums then round differently.
    return llama_cpp.Llama(model_path=str(source_gguf()), n_ctx=512, n_threads=1, n_threads_batch=1,
                           flash_attn=True, verbose=False)
