"""moedesk computes what transformers computes, for every supported architecture."""
import pytest
import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy, hf_last_logits, hf_model
from tests.tiny_models import ARCHS

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b\n\nprint(add(2, 3)) Experts"]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tiny_checkpoint):
    folder = tiny_checkpoint(request.param)
    return Engine.load(str(folder), device="cpu", dtype="float32"), hf_model(folder)


def test_last_position_logits_match(pair):
    engine, ref = pair
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        cache = engine.model.new_cache(1, len(ids), torch.float32, "cpu")
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, engine.executor)[0, -1]
        theirs = hf_last_logits(ref, ids)
        assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-4


def test_batched_greedy_generation_matches(pair):
    engine, ref = pair
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    # batch_size 2 of 3 prompts: right padding, and a slot reused mid-run (continuous batching).
    done = {c.tag: c for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(ids)], batch_size=2)}
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    for i, prompt_ids in enumerate(ids):
        expected = hf_greedy(ref, prompt_ids, 24, eos)
        assert done[i].token_ids == expected
        assert done[i].finish_reason == ("length" if len(expected) == 24 else "stop")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "gpt_oss", "deepseek_v3",
                                  "minimax_m2"])
def test_moe_layers_are_routed(arch, tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint(arch)), device="cpu", dtype="float32")
    engine.executor.selections.clear()
    list(engine.generate([Request(engine.tokenizer.encode(PROMPTS[1]), SamplingParams(max_new_tokens=4, temperature=0))]))
    moe_layers = [i for i in range(engine.config.num_layers) if engine.config.is_moe_layer(i)]
    assert sorted(engine.executor.selections) == moe_layers
    for counts in engine.executor.selections.values():
        # every token picks exactly top-k experts
        assert counts.sum().item() % engine.config.num_experts_per_tok == 0
        assert (counts > 0).sum().item() >= engine.config.num_experts_per_tok
