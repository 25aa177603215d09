"""Multi-head latent attention (engine.model.mla) with its latent cache: DeepSeek-V3's and GLM-4.7-Flash's.

The cache holds kv_lora_rank + rope dims a token and layer; prompts attend expanded keys and values, decode
attends the latents directly (the absorbed form). Against references nobody here wrote: transformers' greedy
tokens and beam search on tiny random checkpoints; and against the model itself: speculation lossless at
temperature 0, a draft tree verified in one pass equal to each branch run alone, the two forms of attention equal
in float64.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moedesk.engine.model import mla
from moedesk.engine.model.cache.layers import LayerCaches
from moedesk.engine.model.cache.positional import LatentCache
from moedesk.engine.model.transformer import ForwardBatch, Rotary
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.model.forward_checks import assert_tree_equals_each_branch
from tests.reference import hf_greedy, hf_model

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog. " * 4, "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
NEW = 40


def count_forms(monkeypatch) -> dict[str, int]:
    """How many layer forwards took each form from here on."""
    calls = {"expanded": 0, "absorbed": 0}
    for form in calls:
        original = getattr(mla.LatentAttention, form)

        def counted(self, *args, _form=form, _original=original):
            calls[_form] += 1
            return _original(self, *args)

        monkeypatch.setattr(mla.LatentAttention, form, counted)
    return calls


def test_the_cache_holds_the_latent_and_rope_dims_a_token_and_layer(engines):
    engine = engines("deepseek_v3")
    cfg = engine.config
    list(engine.generate([Request(engine.tokenizer.encode(PROMPTS[1]), SamplingParams(max_new_tokens=4,
                                                                                       temperature=0))]))
    cache = engine.cache
    expected = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_layers * 4  # float32
    assert isinstance(cache, LatentCache) and cache.bytes_per_position() == expected
    per_token = cache.nbytes() / (cache.rows * cache.length)
    assert abs(per_token / expected - 1) < 0.05
    plain = 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers * 4  # every head's key and value
    assert per_token < plain / 4


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_greedy_tokens_over_many_decode_steps_are_transformers(arch, engines, tiny_checkpoint, monkeypatch):
    """Prompts of 1 to 40-odd tokens, two rows at a time (one reused mid-run), 40 tokens each: prompts expand the
    cache, every decode step after them attends the latents directly."""
    engine = engines(arch)
    forms = count_forms(monkeypatch)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=NEW, temperature=0)
    done = {c.tag: c.token_ids for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(prompts)],
                                                        batch_size=2)}
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    reference = hf_model(tiny_checkpoint(arch))
    for i, p in enumerate(prompts):
        assert done[i] == hf_greedy(reference, p, NEW, eos), i
    assert max(map(len, done.values())) > 30
    layers = engine.config.num_layers
    assert forms["absorbed"] >= 30 * layers and forms["expanded"] >= layers


def test_beam_search_forks_the_latent_cache_as_transformers_searches(engines, tiny_checkpoint):
    from tests.generation.test_beam import hf_beam

    engine = engines("deepseek_v3")
    reference = hf_model(tiny_checkpoint("deepseek_v3"))
    eos = set(engine.config.eos_token_ids) | engine.tokenizer.eos_token_ids
    for text in (PROMPTS[1], "Hi"):
        ids = engine.tokenizer.encode(text)
        for beams in (2, 4):
            assert engine.beam_search(ids, beams=beams, max_new_tokens=10).token_ids == hf_beam(
                reference, ids, beams, 10, eos), (text, beams)


def test_speculation_is_lossless_at_temperature_0(engines):
    """Oracle drafts (the model's own continuation, 30% corrupted): chains and trees, one row and three, accepted
    nodes off the first child compacted in the latent cache, rejected ones leaving no trace."""
    from moedesk.engine.speculative.oracle_drafter import oracle_factory
    from moedesk.engine.speculative.verification import Speculator

    engine = engines("deepseek_v3")
    params = SamplingParams(max_new_tokens=24, temperature=0)
    requests = [Request(engine.tokenizer.encode(p), params, tag=i) for i, p in enumerate(PROMPTS)]
    expected = [next(iter(engine.generate([r], batch_size=1))).token_ids for r in requests]
    factory = oracle_factory(expected, 0.3, engine.vocab_size, seed=1)
    for mode, width, budget in (("greedy", 1, None), ("beam", 3, 7)):
        for batch in (requests[:1], requests):
            sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length,
                            engine.config.eos_token_ids, engine.tokenizer)
            done, _ = sp.run(batch, engine.executor, factory, mode=mode, draft_length=4, draft_width=width,
                             budget=budget)
            for c, want in zip(done, expected):
                assert c.token_ids == want, (mode, len(batch), c.tag)
            spec = done[0].stats["speculative"]
            assert spec["accepted"] > 0 and spec["drafted"] > spec["accepted"]


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_a_tree_in_one_pass_equals_each_branch_alone(engines, absorb, monkeypatch):
    """A draft tree in the latent cache, each node seeing the prompt and its ancestors only
    (tests.model.forward_checks), in either form of attention."""
    engine = engines("deepseek_v3")
    for block in engine.model.layers:
        monkeypatch.setattr(block.attn, "absorb", absorb)
    assert_tree_equals_each_branch(engine)


def test_the_absorbed_form_computes_the_expanded_one(engines):
    """In float64, on several rows of a cache at different lengths, with a query bottleneck and without: the
    absorbed attention equals the expanded one to rounding."""
    base = engines("deepseek_v3").config
    for cfg in (base, dataclasses.replace(base, q_lora_rank=0, rope_interleave=False)):
        torch.manual_seed(0)
        attn = mla.LatentAttention(cfg).double()
        with torch.no_grad():
            for p in attn.parameters():
                p.normal_(0, 0.3)
        rotary = Rotary(cfg, 64)
        cache = LatentCache([0], 3, 40, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.float64, "cpu")
        rows = torch.tensor([2, 0])
        prompt = torch.randn(2, 30, cfg.hidden_size, dtype=torch.float64)
        positions = torch.arange(30).expand(2, 30)
        attn(prompt, rotary(positions, torch.float64), cache, 0, ForwardBatch(positions, rows, None))
        new = torch.randn(2, 3, cfg.hidden_size, dtype=torch.float64)
        positions = torch.tensor([[30, 31, 32], [20, 21, 22]])  # row 0 continues shorter: a stale tail masked
        outs = {}
        for form in (True, False):
            attn.absorb = form
            outs[form] = attn(new, rotary(positions, torch.float64), cache, 0, ForwardBatch(positions, rows, None))
        torch.testing.assert_close(outs[True], outs[False], atol=1e-10, rtol=1e-10)


def test_a_decode_step_through_the_split_kernel_is_the_eager_absorbed_form(engines, monkeypatch):
    """The decode path that takes kernels.gpu_decode_attention on the GPU, run here through Triton's interpreter (its
    applicability test forced): rows picked by index at different lengths, a cache reserved longer than either (as
    CUDA graphs reserve it) and held in a LayerCaches, and the output equal to the eager absorbed form's."""
    from moedesk.kernels import gpu_decode_attention
    if gpu_decode_attention.triton is None:
        pytest.skip("needs Triton")
    base = engines("deepseek_v3").config
    cfg = dataclasses.replace(base, kv_lora_rank=32, qk_rope_head_dim=16, rotary_dim=16, head_dim=32)  # the kernel's powers of two
    torch.manual_seed(0)
    attn = mla.LatentAttention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    rotary = Rotary(cfg, 800)
    latent = LatentCache([0], 3, 800, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.float32, "cpu")
    latent.tensors["latent"][0].normal_()
    latent.tensors["rope"][0].normal_()
    cache = LayerCaches([latent])  # as layers spread over devices hold it: the layer finds its own kind
    rows, positions = torch.tensor([2, 0]), torch.tensor([[600], [7]])
    x = torch.randn(2, 1, cfg.hidden_size)
    calls = []
    original = gpu_decode_attention.latent_decode_attention
    monkeypatch.setattr(gpu_decode_attention, "latent_decode_attention", lambda *a: calls.append(1) or original(*a))
    outs = {}
    attn.absorb = True
    with torch.no_grad():
        for kernel in (True, False):
            monkeypatch.setattr(gpu_decode_attention, "latent_applies", lambda *a, _k=kernel: _k)
            outs[kernel] = attn(x, rotary(positions, torch.float32), cache, 0,
                                ForwardBatch(positions, rows, None, kv_len=800))
    assert calls == [1]
    torch.testing.assert_close(outs[True], outs[False], atol=1e-4, rtol=1e-4)


def test_absorbing_pays_for_few_tokens_against_a_long_cache():
    from moedesk.engine.load.synthetic import SHAPES

    v3 = SHAPES["deepseek-v3"]
    assert mla.absorb_pays(1, 512, v3) and mla.absorb_pays(8, 8192, v3)  # decode, a speculative verify
    assert not mla.absorb_pays(512, 512, v3)  # a prompt
    assert not mla.absorb_pays(1, 1, v3)  # nothing cached yet: expanding one latent is cheaper


# --- deepseek2 GGUF, as llama.cpp's converter writes it ---------------------------------------------------------

def _whole_kv_b(cfg, tensors):
    """An older converter's tensors: kv_b_proj whole (attn_kv_b), not split into attn_k_b and attn_v_b."""
    from tests.gguf_from_hf import _renamed_correction_bias, _stack_experts

    yield from _renamed_correction_bias(_stack_experts(tensors)).items()


def _older_widths_and_yarn(w, cfg):
    """An older file's head widths (key/value_length per head, no *_mla keys), and DeepSeek-V3's yarn as llama.cpp's
    converter writes it: the factor, the original context, 0.1 x mscale_all_dim as the log multiplier."""
    import gguf

    from tests.gguf_from_hf import _routed_metadata

    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length(cfg["v_head_dim"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    _routed_metadata(w, cfg)


@pytest.mark.parametrize("variant", ["split-kv-b", "whole-kv-b-yarn"])
def test_deepseek2_gguf_runs_natively_with_transformers_tokens(variant, tmp_path, monkeypatch):
    """tests/gguf_from_hf.py's deepseek2 file (attn_kv_a_mqa, attn_k_b/attn_v_b, attn_q_a/q_b, exp_probs_b...) and
    an older converter's (attn_kv_b whole, per-head widths in key/value_length) with DeepSeek-V3's yarn: engine
    "auto" runs them natively, with the safetensors' config and transformers' greedy tokens."""
    from tests import gguf_from_hf

    if variant != "split-kv-b":
        family = gguf_from_hf.FAMILIES["deepseek2"]
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.7, "mscale_all_dim": 0.7}
        monkeypatch.setitem(gguf_from_hf.FAMILIES, "deepseek2", dataclasses.replace(
            family, config=dict(family.config, rope_parameters=yarn), metadata=_older_widths_and_yarn,
            tensors=_whole_kv_b))
    built = gguf_from_hf.build("deepseek2", tmp_path / "deepseek2")
    engine = Engine.load(str(built.gguf), device="cpu", dtype="float32")
    ours = Engine.load(str(built.folder), device="cpu", dtype="float32")
    assert engine.kind == "native" and isinstance(engine.cache, LatentCache)
    assert engine.config == ours.config
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
    assert [engine.tokenizer.encode(p) for p in PROMPTS] == prompts
    params = SamplingParams(max_new_tokens=24, temperature=0)
    done = {c.tag: c.token_ids for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(prompts)],
                                                        batch_size=2)}
    eos = ours.tokenizer.eos_token_ids | set(ours.config.eos_token_ids)
    assert [done[i] for i in range(len(prompts))] == [hf_greedy(built.model, p, 24, eos) for p in prompts]


def test_bench_depth_fills_the_latent_cache_as_one_forward_writes_it():
    """`moedesk bench --shape deepseek-v3 --context N`'s path at a size the CPU runs: the context prefilled in pieces
    into the latent cache holds what one forward over the same tokens writes, and decode runs over it."""
    from moedesk.bench.depth import measure_at_depth
    from moedesk.bench.synthetic import random_prompt
    from moedesk.engine.generation import runner as runner_module
    from moedesk.engine.load.synthetic import SHAPES, synthetic_model
    from moedesk.engine.offload.expert_executor import LocalExecutor

    v3 = SHAPES["deepseek-v3"]
    cfg = dataclasses.replace(v3, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4,
                              num_experts=8, moe_intermediate_size=64, intermediate_size=64,
                              moe_layers=v3.moe_layers[:4], n_group=4, topk_group=2, num_experts_per_tok=2,
                              shared_expert_intermediate_size=64, q_lora_rank=32, kv_lora_rank=32, v_head_dim=16)
    model, _ = synthetic_model(cfg, torch.float32, "cpu", pinned=False, context=256)
    executor, caches = LocalExecutor(), []
    made = runner_module.ModelRunner.reserve

    def keep(self, rows, length):
        made(self, rows, length)
        if self.cache not in caches:
            caches.append(self.cache)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_module.ModelRunner, "reserve", keep)
        prompt = random_prompt(100 + 16, cfg.vocab_size, 0)
        times = measure_at_depth(model, executor, "cpu", torch.float32, prompt, 100, decode_tokens=4, chunk=16,
                                 graphs=False, piece=24)
    assert times.depth == 100 and times.decode_s > 0
    whole = model.new_cache(1, 100, torch.float32, "cpu")
    model(torch.tensor([prompt[:100]]), torch.arange(100)[None], whole, executor)
    [cache] = caches
    assert isinstance(cache, LatentCache)
    for part in ("latent", "rope"):
        for mine, theirs in zip(cache.tensors[part], whole.tensors[part]):
            torch.testing.assert_close(mine[:, :100], theirs[:, :100], rtol=1e-4, atol=1e-5)


def test_glm4_moe_lite_is_sized_as_it_loads(engines, tiny_checkpoint):
    """The Models screen's estimate of a GLM-4.7-Flash folder (from its headers alone) is what loading allocates."""
    from moedesk.engine.load.size_estimate import summarize_path

    engine = engines("glm4_moe_lite")
    estimate = summarize_path(tiny_checkpoint("glm4_moe_lite")).estimate("auto", "float32")
    assert estimate.expert_bytes == sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
    assert estimate.other_bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert [hasattr(b, "moe") for b in engine.model.layers] == [False, True, True]  # mlp_layer_types
