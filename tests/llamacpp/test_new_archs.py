"""llama.cpp runs 2026's MoE families as transformers does: tiny random checkpoints of gpt-oss, Qwen3.5-MoE,
GLM-4.x-MoE and DeepSeek-V3, written as GGUF by tests/gguf_from_hf.py, through llama-cpp-python's bundled
llama.cpp on the CPU.

For every family, on three prompts: llama.cpp tokenizes the prompt as the checkpoint's tokenizer does, its
greedy ids equal transformers' greedy ids exactly (all four families; none needs the looser top-1
agreement), and its logits along transformers' greedy path stay within LOGIT_TOLERANCE of transformers'
(float32 weights on both sides: what is left is summation order). The logit bound is what catches a
conversion that is almost right: a RoPE section layout that rotated one pair of Qwen3.5's rotary dims by
position 0 still gave the same greedy ids on two prompts of three, with logits 2e-2 apart.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_from_hf import FAMILIES, build
from tests.reference import hf_greedy

llama_cpp = pytest.importorskip("llama_cpp")

PROMPTS = [
    "The quick brown fox jumps over",
    "def add(a, b):\n    return",
    "Experts live in RAM; the most popular ones",  # with 16 new tokens, past gpt-oss's sliding window of 8
]
NEW_TOKENS = 16
LOGIT_TOLERANCE = 5e-3  # observed: at most 1.5e-3 on logits of standard deviation ~0.7


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    name = request.param
    built = build(name, tmp_path_factory.mktemp(name))
    # One thread: on two shared cores a second thread's barrier waits cost 30x the work of a model this small.
    llm = llama_cpp.Llama(str(built.gguf), n_ctx=128, n_threads=1, n_threads_batch=1, logits_all=True,
                          verbose=False)
    yield name, built, llm
    llm.close()


def llama_greedy(llm, prompt_ids: list[int], n: int) -> list[int]:
    llm.reset()
    out = []
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            return out
    return out


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
@pytest.mark.usefixtures("one_torch_thread")
def test_llamacpp_greedy_equals_transformers(family):
    from tokenizers import Tokenizer

    name, built, llm = family
    assert llm.metadata["general.architecture"] == FAMILIES[name].gguf_arch
    tokenizer = Tokenizer.from_file(str(built.folder / "tokenizer.json"))
    model = built.model
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        assert llm.tokenize(prompt.encode(), add_bos=False, special=False) == ids, prompt

        expected = hf_greedy(model, ids, NEW_TOKENS)
        assert len(expected) == NEW_TOKENS  # the tiny tokenizer's end token never wins here
        assert llama_greedy(llm, ids, NEW_TOKENS) == expected, f"{name}: {prompt!r}"

        path = ids + expected[:-1]
        with torch.no_grad():
            reference = model(torch.tensor([path])).logits[0].numpy()
        gap = np.abs(llama_logits(llm, path) - reference).max()
        assert gap < LOGIT_TOLERANCE, f"{name}: {prompt!r}: logits {gap:.2e} from transformers'"


def routed_expert_bytes(config) -> int:
    """The routed experts' float32 bytes, by hand from the transformers config."""
    h = config.hidden_size
    if config.model_type == "gpt_oss":  # every layer; biases on gate, up and down
        f, experts, moe_layers = config.intermediate_size, config.num_local_experts, config.num_hidden_layers
        return moe_layers * experts * (3 * h * f + 2 * f + h) * 4
    f = config.moe_intermediate_size
    experts = getattr(config, "n_routed_experts", None) or config.num_experts
    moe_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
    return moe_layers * experts * 3 * h * f * 4


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_memory_estimate_is_what_the_engine_auto_picks_holds(family):
    """The Models screen and the download wizard size a GGUF as the engine `auto` picks holds it. llama.cpp: the
    file's tensors as they are, the routed experts as counted by hand, the whole as llama.cpp's own
    llama_model_size, from the file or from its header's bytes alone. The native engine (once it runs the
    family): experts as the loader keeps them, 16-bit here."""
    from moedesk.app.tui.catalog import gguf_model
    from moedesk.engine.load.gguf_checkpoint import NATIVE_ARCHITECTURES
    from moedesk.engine.load.gguf_header import parse_header
    from moedesk.engine.load.size_estimate import FileWeights, summarize_gguf_header, summarize_path

    name, built, llm = family
    weights = summarize_path(built.gguf)
    estimate = weights.estimate("auto", "bfloat16")
    listed = gguf_model(built.gguf)
    assert (listed.arch, listed.estimate_error) == (FAMILIES[name].gguf_arch, "")
    assert listed.estimate("auto", "bfloat16") == estimate
    if name in NATIVE_ARCHITECTURES:
        assert not isinstance(weights, FileWeights)
        assert (estimate.expert_bytes, estimate.experts_as) == (routed_expert_bytes(built.model.config) // 2, "bf16")
        return

    assert estimate.expert_bytes == routed_expert_bytes(built.model.config)
    assert estimate.total_bytes == llama_cpp.llama_model_size(llm._model.model)
    assert estimate.experts_as == "f32"
    assert listed.estimate("int4", "float16") == estimate  # the file's own formats, whatever dtype is chosen

    data = built.gguf.read_bytes()
    header_only = summarize_gguf_header(parse_header(data[:len(data) - estimate.total_bytes], built.gguf), built.gguf)
    assert header_only.estimate() == estimate
