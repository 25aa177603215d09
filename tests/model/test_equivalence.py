"""moedesk computes what transformers computes, for every supported architecture."""
import pytest
import torch

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.model.test_gpu_equivalence import check_greedy
from tests.reference import hf_greedy, hf_last_logits, hf_model
from tests.tiny_models import ARCHS

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b\n\nprint(add(2, 3)) Experts"]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tiny_checkpoint):
    folder = tiny_checkpoint(request.param)
    return Engine.load(str(folder), device="cpu", dtype="float32"), hf_model(folder)


def test_rotary_width_is_the_references(pair):
    # Where transformers versions read a config differently (MiniMax-M2's rotary_dim before
    # huggingface/transformers#48241), this fails by name rather than as logits far apart.
    engine, ref = pair
    assert engine.config.rope_dims == 2 * ref.model.rotary_emb.inv_freq.numel()


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


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_on_the_cpu_is_as_exact_as_transformers_bf16(arch, tiny_checkpoint):
    """tests/model/test_gpu_equivalence.py's bf16 check on the CPU: logits along transformers' greedy tokens no further
    from its float32 ones than its own bf16 are, and greedy tokens equal unless the reference was tied."""
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cpu", dtype="bfloat16")
    check_greedy(engine, hf_model(folder, torch.bfloat16), [engine.tokenizer.encode(p) for p in PROMPTS],
                 ref32=hf_model(folder))
