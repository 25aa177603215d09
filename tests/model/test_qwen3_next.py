"""Qwen3-Next and Qwen3.5-MoE natively, against transformers on tiny random checkpoints (tests/gguf_from_hf.py:
Gated DeltaNet layers with twice as many value heads as key heads, a gated full-attention layer, 8 experts and a
gated shared expert, every constant-initialised weight perturbed).

Several prompts of different lengths in one batch (one longer than a 64-token chunk), rows reused mid-run,
prompts prefilled in pieces, experts in RAM and offloaded: transformers' greedy tokens, each prompt run alone.
Beam search, and speculation in chains and trees (a rejected draft must leave no trace in the recurrent state),
give what plain decoding gives.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy
from tests.tiny_models import budget_for_experts

FAMILIES = ["qwen3next", "qwen35moe"]
TEXTS = ["Hi", "The quick brown fox jumps over the lazy",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3)) " + "Experts live in RAM; the most popular ones live on "
         "the GPU. Mixture of experts models route every token to a few experts out of many."]
NEW = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from tests.gguf_from_hf import build

    made = {}

    def get(family):
        if family not in made:
            made[family] = build(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


def prompts(engine) -> list[list[int]]:
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[2]) > 64  # past one chunk of the chunked form
    return ids


def expected(built, engine, ids, new=NEW) -> list[list[int]]:
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    return [hf_greedy(built.model, p, new, eos) for p in ids]


def greedy(engine, ids, new=NEW, batch_size=2) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new, temperature=0)
    done = {c.tag: c.token_ids for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(ids)],
                                                        batch_size=batch_size)}
    return [done[i] for i in range(len(ids))]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_equals_transformers_in_ram_and_offloaded(family, built):
    b = built(family)
    engine = Engine.load(str(b.folder), device="cpu", dtype="float32")
    cfg = engine.config
    assert cfg.linear_layers == (True, True, True, False) and cfg.attention_gate and cfg.rope_dims == 4
    ids = prompts(engine)
    want = expected(b, engine, ids)
    assert greedy(engine, ids) == want  # 3 prompts, 2 rows: right padding, and a row reused mid-run
    engine.scheduler.prefill_chunk = 7  # prompts prefilled in pieces that continue the recurrent state
    assert greedy(engine, ids, batch_size=3) == want
    offloaded = Engine.load(str(b.folder), device="cpu", dtype="float32", offload=True,
                            gpu_budget=budget_for_experts(b.folder, 2))
    for policy in ("copy", "cpu"):
        offloaded.executor.decide = {"copy": lambda loads: ([], sorted(loads)),
                                     "cpu": lambda loads: (sorted(loads), [])}[policy]
        offloaded.executor.stats = type(offloaded.executor.stats)()
        assert greedy(offloaded, ids) == want, policy
        stats = offloaded.executor.stats
        assert stats.gpu_experts > 0 and (stats.cpu_experts > 0) == (policy == "cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_through_the_chunk_walk_kernel_equals_transformers(family, built, monkeypatch):
    """What CUDA runs: each prompt's walk over its chunks in kernels.gpu_delta_chunks (here under Triton's
    interpreter), rows of different lengths in one batch and prompts prefilled in pieces; transformers' tokens."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU; tests/perf covers CUDA")
    from moedesk.kernels import gpu_delta_chunks

    b = built(family)
    engine = Engine.load(str(b.folder), device="cpu", dtype="float32")
    ids = prompts(engine)
    longest = torch.tensor([ids[2]])  # two chunks: the logits and states the torch loop leaves, through the kernel

    def prefill():
        cache = engine.model.new_cache(1, 128, torch.float32, "cpu")
        logits = engine.model(longest, torch.arange(longest.shape[1])[None], cache, engine.executor)
        return logits, [cache.kinds[1].state[layer].clone() for layer in (0, 1, 2)]

    torch_loop = prefill()
    walks = []
    monkeypatch.setattr(gpu_delta_chunks, "fits", lambda *a: walks.append(a) or True)
    torch.testing.assert_close(prefill(), torch_loop, rtol=1e-4, atol=1e-5)
    want = expected(b, engine, ids)
    assert greedy(engine, ids, batch_size=3) == want
    engine.scheduler.prefill_chunk = 40  # a prompt's pieces continue the state the kernel handed back
    assert greedy(engine, ids, batch_size=3) == want
    assert walks


def test_every_way_the_engine_runs_a_prompt_asks_for_the_chunk_walk_with_gradients_off(built, monkeypatch):
    """kernels.gpu_delta_chunks takes a prefill's walk only where no gradient is wanted (`fits`): were a path to run
    its forward with autograd on, CUDA would silently take the torch loop. Plain batches (the decode thread), beam
    search and speculation all ask with gradients off."""
    from moedesk.kernels import gpu_delta_chunks

    real, asked = gpu_delta_chunks.fits, []
    monkeypatch.setattr(gpu_delta_chunks, "fits", lambda *a: asked.append(torch.is_grad_enabled()) or real(*a))
    engine = Engine.load(str(built("qwen35moe").folder), device="cpu", dtype="float32")
    ids = prompts(engine)[1:]
    greedy(engine, ids, new=2)
    plain = len(asked)
    engine.beam_search(ids[0], beams=2, max_new_tokens=2)
    beam = len(asked) - plain
    mode, done, _ = next(speculate("qwen35moe", built))
    assert mode == "greedy" and done
    assert plain and beam and len(asked) > plain + beam
    assert not any(asked), f"{sum(asked)} of {len(asked)} prefill walks were asked for with autograd on"


def test_the_cache_is_keys_and_values_for_full_layers_and_a_state_for_the_rest(built):
    engine = Engine.load(str(built("qwen3next").folder), device="cpu", dtype="float32")
    cache = engine.model.new_cache(2, 32, torch.float32, "cpu")
    kv, state = cache.kinds
    assert kv.layers == [3] and state.layers == [0, 1, 2]
    assert state.state[0].shape == (2, 4, 16, 16) and state.conv[0].shape == (2, 2 * 2 * 16 + 4 * 16, 3)
    assert cache.bytes_per_position() == kv.bytes_per_position() == 2 * 2 * 16 * 4  # keys and values of one layer
    # Plain decoding keeps no per-token states: a row's state is its matrix and its convolution's inputs, per layer.
    assert not state.kept_state and cache.bytes_per_row() == 3 * (4 * 16 * 16 + (2 * 2 * 16 + 4 * 16) * 3) * 4
    assert engine.model.supports_graphs  # CUDA graphs update the state in place (engine.generation.cuda_graphs)
    # What CUDA loads do: the full-attention layer's q (with its gate), k and v in one matmul, and a DeltaNet layer's
    # four input projections in one. The logits do not change.
    from moedesk.engine.model.transformer import fuse_attention_projections

    ids = torch.tensor([prompts(engine)[1]])
    positions = torch.arange(ids.shape[1])[None]
    before = engine.model(ids, positions, engine.model.new_cache(1, 64, torch.float32, "cpu"), engine.executor)
    assert fuse_attention_projections(engine.model.layers) == 4 and hasattr(engine.model.layers[3].attn, "qkv_weight")
    for i in range(3):  # a DeltaNet's projections are views of the fused weight, not a second copy
        mixer = engine.model.layers[i].attn
        assert mixer.in_qkv.weight.data_ptr() == mixer.in_weight.data_ptr()
        assert mixer.in_a.weight.untyped_storage().data_ptr() == mixer.in_weight.untyped_storage().data_ptr()
    after = engine.model(ids, positions, engine.model.new_cache(1, 64, torch.float32, "cpu"), engine.executor)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def speculate(family, built, graphs=None):
    """(mode, the Speculator's completions, plain greedy's tokens) of an oracle draft (the greedy continuation, a
    third of it corrupted) verified in chains ("greedy") and trees ("beam"), rows of several lengths; graphs(): the
    Speculator's graphs for each mode (None: eager)."""
    from moedesk.engine.speculative.oracle_drafter import oracle_factory
    from moedesk.engine.speculative.verification import Speculator

    engine = Engine.load(str(built(family).folder), device="cpu", dtype="float32")
    ids = prompts(engine)
    params = SamplingParams(max_new_tokens=NEW, temperature=0)
    requests = [Request(p, params, tag=i) for i, p in enumerate(ids)]
    plain = [next(iter(engine.generate([r], batch_size=1))).token_ids for r in requests]
    for mode, width, budget in (("greedy", 1, None), ("beam", 3, 7)):
        extra = {} if graphs is None else {"graphs": graphs()}
        sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                        engine.tokenizer, **extra)
        done, _ = sp.run(requests, engine.executor, oracle_factory(plain, 0.3, engine.vocab_size, seed=1), mode=mode,
                         draft_length=4, draft_width=width, budget=budget)
        yield mode, done, plain


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_in_chains_and_trees_is_lossless(family, built):
    """Chains and trees verified in one pass, rejected drafts rolled back out of the recurrent state, equal plain
    greedy decoding."""
    for mode, done, plain in speculate(family, built):
        assert [c.token_ids for c in done] == plain, mode
        spec = done[0].stats["speculative"]
        assert spec["accepted"] > 0 and spec["drafted"] > spec["accepted"]  # some drafts taken, some rejected


def segments(made: list, after: int = 2):
    """A factory of CUDA graphs' segments run eagerly (capture=False: the CPU's stand-in for capture and replay),
    each kept in `made`; multi-token shapes go through them once seen `after` times."""
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    def make(model, cache):
        made.append(GraphedDecode(model, cache, capture=False, capture_after=after))
        return made[-1]

    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_segments_decode_the_reference_tokens(family, built, monkeypatch):
    """Decode steps through the fixed-shape segments CUDA graphs replay: each recurrent layer reads and writes its
    rows' state in place in the cache, the attention reads the cache's whole length under the mask. Rows of
    different lengths, rows reused mid-run, explicit rows: transformers' tokens, and no step left to eager."""
    b = built(family)
    engine = Engine.load(str(b.folder), device="cpu", dtype="float32")
    assert engine.model.supports_graphs
    ids = prompts(engine)
    want = expected(b, engine, ids)
    made = []
    engine.runner.graphs = segments(made)(engine.model, engine.cache)
    graphs = made[0]
    answered = []
    forward = graphs.forward
    monkeypatch.setattr(graphs, "forward",
                        lambda *a, **k: answered.append((a[3] is not None, forward(*a, **k))) or answered[-1][1])
    assert greedy(engine, ids) == want
    assert answered and all(out is not None for _, out in answered) and graphs.broken is None


def test_graph_segments_step_explicit_rows_of_different_lengths_as_the_eager_forward(built):
    """Explicit cache rows (a subset, out of order) at different positions, after a right-padded prompt batch: the
    segments' logits and the recurrent states they leave equal the eager forward's, step after step."""
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    engine = Engine.load(str(built("qwen35moe").folder), device="cpu", dtype="float32")
    model, run = engine.model, engine.executor
    ids = prompts(engine)
    lengths = torch.tensor([len(p) for p in ids])
    padded = torch.tensor([p + [0] * (int(lengths.max()) - len(p)) for p in ids])

    def prefilled():
        cache = model.new_cache(3, int(lengths.max()) + 8, torch.float32, "cpu")
        model(padded, torch.arange(padded.shape[1]).expand(3, -1), cache, run, logits_at=lengths - 1)
        return cache

    eager, replayed = prefilled(), prefilled()
    graphs = GraphedDecode(model, replayed, capture=False)
    rows = torch.tensor([2, 0])
    for step, tokens in enumerate(([[7], [9]], [[11], [13]], [[5], [3]])):
        positions = (lengths[rows] + step).unsqueeze(1)
        want = model(torch.tensor(tokens), positions, eager, run, rows=rows, drafts=True)
        torch.testing.assert_close(graphs.forward(torch.tensor(tokens), positions, run, rows), want, rtol=1e-5,
                                   atol=1e-5)
    ours, theirs = replayed.kinds[1], eager.kinds[1]
    for ours, theirs in zip(ours.state + ours.conv, theirs.state + theirs.conv):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert graphs.captures == 1 and graphs.broken is None


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_through_graph_segments_rolls_rejected_drafts_back(family, built):
    """Verify forwards of chains and trees replayed from the segments (every shape from its first sighting): each
    token's state kept in place for `accept`, a rejected draft leaving no trace; plain greedy decoding's tokens."""
    made = []

    def fresh():
        made.clear()
        return segments(made, after=1)

    for mode, done, plain in speculate(family, built, graphs=fresh):
        assert [c.token_ids for c in done] == plain, mode
        spec = done[0].stats["speculative"]
        assert spec["accepted"] > 0 and spec["drafted"] > spec["accepted"]
        shapes = [key for graphs in made for key in graphs.captured]
        assert any(key[1] > 1 for key in shapes), shapes  # verify forwards went through the segments
        assert any(key[3] for key in shapes) == (mode == "beam")  # trees, with their mask and slots


def test_a_tree_verified_in_one_pass_equals_each_branch_run_alone(built):
    """The model's forward over a draft tree (its mask and slots as verification builds them): every node's logits
    are those of its root-to-node branch fed after the prompt as a plain chain, through the recurrent layers (each
    node from its parent's state) and the full-attention layer (each node seeing its ancestors); accepting a branch
    leaves the state that branch alone leaves."""
    from moedesk.engine.speculative.proposal import node_depths, tree_mask

    engine = Engine.load(str(built("qwen35moe").folder), device="cpu", dtype="float32")
    model, run = engine.model, engine.executor
    prompt = prompts(engine)[1]
    parents, tokens = [-1, 0, 0, 1, 2, 2, 4], [11, 57, 90, 13, 200, 7, 42]
    L, n = len(prompt), len(parents)

    def prefilled():
        cache = model.new_cache(1, L + n, torch.float32, "cpu")
        model(torch.tensor([prompt]), torch.arange(L)[None], cache, run)
        return cache

    cache = prefilled()
    mask = torch.zeros(1, 1, n, L + n, dtype=torch.bool)
    mask[0, 0, :, :L] = True
    mask[0, 0, :, L:] = tree_mask(parents)
    positions = (L + torch.tensor(node_depths(parents)))[None]
    tree = model(torch.tensor([tokens]), positions, cache, run, mask=mask, slots=(L + torch.arange(n))[None],
                 drafts=True)[0]
    for node in range(n):
        branch = [node]
        while parents[branch[0]] >= 0:
            branch.insert(0, parents[branch[0]])
        alone = model(torch.tensor([[tokens[i] for i in branch]]), torch.arange(L, L + len(branch))[None],
                      prefilled(), run, drafts=True)[0, -1]
        torch.testing.assert_close(tree[node], alone, rtol=1e-5, atol=1e-5)
    # Accept the branch root -> 2 -> 4 -> 6: the recurrent state is that branch's alone.
    cache.accept([0], [L], [[2, 4, 6]])
    chain = prefilled()
    model(torch.tensor([[tokens[i] for i in (0, 2, 4, 6)]]), torch.arange(L, L + 4)[None], chain, run)
    for ours, theirs in zip(cache.kinds[1].state, chain.kinds[1].state):
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_equals_transformers(family, built):
    b = built(family)
    engine = Engine.load(str(b.folder), device="cpu", dtype="float32")
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    for ids in prompts(engine)[1:]:
        for beams in (2, 4):
            done = engine.beam_search(ids, beams=beams, max_new_tokens=8)
            with torch.no_grad():
                out = b.model.generate(torch.tensor([ids]), max_new_tokens=8, num_beams=beams, do_sample=False,
                                       eos_token_id=sorted(eos), pad_token_id=0)
            new = out[0, len(ids):].tolist()
            end = next((i for i, t in enumerate(new) if t in eos), len(new))
            assert done.token_ids == new[:end], beams


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_through_graph_segments_equals_transformers(family, built):
    """Beam search's steps replayed from the segments: its forks reorder the recurrent state in place (rows
    gathered within each search's block), where the graphs read it."""
    from moedesk.engine.generation.beam import BeamSearch

    b = built(family)
    engine = Engine.load(str(b.folder), device="cpu", dtype="float32")
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    ids = prompts(engine)[1]
    made = []
    search = BeamSearch(engine.model, engine.device, engine.dtype, engine.context_length, graphs=segments(made))
    done = search.run(ids, engine.executor, 3, 8, eos)
    with torch.no_grad():
        out = b.model.generate(torch.tensor([ids]), max_new_tokens=8, num_beams=3, do_sample=False,
                               eos_token_id=sorted(eos), pad_token_id=0)
    new = out[0, len(ids):].tolist()
    end = next((i for i, t in enumerate(new) if t in eos), len(new))
    assert done.tokens[:len(done.tokens) - done.ended_by_eos] == new[:end]
    assert made and made[0].captured and made[0].broken is None


def fuse_experts(tensors: dict) -> dict:
    """Each layer's experts as the released Qwen3.5-MoE checkpoints hold them (their index names
    model.language_model.layers.N.mlp.experts.gate_up_proj [256, 1024, 2048] and down_proj [256, 2048, 512] for the
    35B-A3B): gate_up_proj [E, 2F, H], gate's rows then up's, and down_proj [E, H, F]; transformers fuses them so too
    (its qwen2_moe conversion: MergeModulelist, then Concatenate on dim 1)."""
    out, layers = {}, {}
    for name, t in tensors.items():
        if m := re.fullmatch(r"(model\.language_model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight", name):
            layers.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            out[name] = t
    for stem, parts in layers.items():
        stack = {part: torch.stack([experts[e] for e in sorted(experts)]) for part, experts in parts.items()}
        out[f"{stem}.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        out[f"{stem}.down_proj"] = stack["down"]
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["experts-apart", "experts-fused"])
def test_a_multimodal_qwen35_checkpoint_loads_its_text_model_and_says_images_are_not_supported(built, tmp_path,
                                                                                             caplog, fused):
    """The released layout: the config nests the text model's as text_config beside a vision_config, the text
    model's tensors live under model.language_model., a vision tower and an MTP layer beside them; each layer's
    experts fused into two tensors (`fuse_experts`), the MTP layer's apart, as released; or every expert apart."""
    b = built("qwen35moe")
    folder = tmp_path / "multimodal"
    shutil.copytree(b.folder, folder)
    text = json.loads((b.folder / "config.json").read_text())
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": {**text, "model_type": "qwen3_5_moe_text"}, "vision_config": {"depth": 1},
              "image_token_id": 300, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(b.folder / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)
    if fused:
        tensors = fuse_experts(tensors)
        assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
        assert not any(".mlp.experts.0." in n for n in tensors if n.startswith("model."))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    assert engine.config.arch == "qwen3_5_moe"
    assert any("images are not supported" in w for w in engine.warnings)
    from moedesk.engine.load.size_estimate import summarize_path

    estimate = summarize_path(folder).estimate("auto", "float32")  # the Models screen: the text model alone
    assert estimate.other_bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert estimate.expert_bytes == sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
    ids = prompts(engine)[1:2]
    assert greedy(engine, ids) == expected(b, engine, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_runs_natively_with_the_reference_tokens_and_its_size_estimated(family, built):
    """llama.cpp's tensor names and layouts (tests/gguf_from_hf.py: q/k/v and the gate split, A as -exp(A_log), norms
    plus one, qwen35moe's value heads tiled): `auto` runs the file natively, with the safetensors' config and
    transformers' tokens; the Models screen's estimate from the header is what loading allocates."""
    from moedesk.engine.load.size_estimate import summarize_path

    from moedesk.engine.selection import listed_engine

    b = built(family)
    assert listed_engine(family, gguf=True).kind == "native"  # what the Models screen says will run it
    engine = Engine.load(str(b.gguf), device="cpu", dtype="float32")
    ours = Engine.load(str(b.folder), device="cpu", dtype="float32")
    assert engine.kind == "native" and engine.config == ours.config
    ids = prompts(ours)
    assert [engine.tokenizer.encode(t) for t in TEXTS] == ids
    assert greedy(engine, ids) == expected(b, ours, ids)
    for path in (b.gguf, b.folder):
        estimate = summarize_path(path).estimate("auto", "float32")
        assert estimate.expert_bytes == sum(moe.experts.nbytes for moe in engine.model.moe_blocks())
        assert estimate.other_bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())


def test_bench_runs_a_qwen35_shape_on_the_simulated_tier():
    """`moedesk bench --shape qwen3.5-35b-a3b`'s path (recurrent layers, a gated full-attention layer, a gated shared
    expert) at a size the CPU runs; the real shape's switches as its public config sets them."""
    from moedesk.bench.budget import budget_for_experts
    from moedesk.bench.synthetic import bench_context, run_bench
    from moedesk.engine.load.synthetic import SHAPES, shape_config

    budget = budget_for_experts(shape_config("tiny-qwen35", 4), 4, bench_context((80,), 6), "dense", "cpu")
    report = run_bench("tiny-qwen35", 4, budget, device="cpu", decode_tokens=6, prefill=(80,), batch=2,
                       log=lambda *a: None)
    assert [r["mode"] for r in report["results"]] == ["decode", "prefill", "batched_decode"]
    assert all(r["tok_s"] > 0 for r in report["results"])
    real = shape_config("qwen3.5-35b-a3b", layers=8)
    assert real.linear_layers == (True, True, True, False) * 2 and real.rope_dims == 64
    assert (real.num_experts, real.num_experts_per_tok, real.linear_value_heads) == (256, 8, 32)
    assert SHAPES["qwen3.5-35b-a3b"].num_layers == 40 and real.attention_gate and real.norm_offset


def test_a_gguf_whose_decay_rate_is_not_negative_is_refused_in_one_line(built):
    """llama.cpp keeps A = -exp(A_log); a file holding A >= 0 would turn every later token into NaN."""
    from moedesk.engine.errors import CheckpointError
    from moedesk.engine.load.gguf_checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(built("qwen3next").gguf)
    with pytest.raises(CheckpointError, match="must be negative"):
        checkpoint._delta_net_layout("blk.0.ssm_a", "ssm_a", torch.tensor([-1.0, 0.5, -2.0, -0.1]))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_float32_in_place_and_offloaded_and_bf16(family, built):
    """On the GPU: float32 all on the GPU and with experts offloaded give transformers' tokens; bf16 within what
    bf16 rounding allows (tests/model/test_gpu_equivalence.py's rule)."""
    from tests.model.test_gpu_equivalence import check_greedy
    from tests.reference import hf_model

    b = built(family)
    cpu = Engine.load(str(b.folder), device="cpu", dtype="float32")
    ids = prompts(cpu)
    want = expected(b, cpu, ids)
    for kw in ({}, dict(offload=True, gpu_budget=budget_for_experts(b.folder, 2, "cuda"))):
        engine = Engine.load(str(b.folder), device="cuda", dtype="float32", **kw)
        assert engine.runner.graphs is not None  # recurrent layers replay CUDA graphs too
        assert greedy(engine, ids) == want, kw
    engine = Engine.load(str(b.folder), device="cuda", dtype="bfloat16")
    check_greedy(engine, hf_model(b.folder, torch.bfloat16, "cuda"), ids, NEW, ref32=hf_model(b.folder, torch.float32,
                                                                                              "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_graphs_replay_what_eager_decoding_computes(family, built, monkeypatch):
    """Captured CUDA graphs against the eager forward on CUDA, float32: the greedy ids of rows of different lengths
    (rows reused mid-run); every step's logits and the recurrent states left, over explicit rows after a padded
    prompt batch; speculation's verify forwards replayed, chains and trees, rejected drafts rolled back; beam search's
    forks."""
    from moedesk.engine.generation.cuda_graphs import GraphedDecode
    from moedesk.engine.speculative.oracle_drafter import oracle_factory
    from moedesk.engine.speculative.verification import Speculator

    b = built(family)
    graphed = Engine.load(str(b.folder), device="cuda", dtype="float32")
    assert isinstance(graphed.runner.graphs, GraphedDecode) and graphed.runner.graphs.capture
    monkeypatch.setenv("MOEDESK_NO_CUDA_GRAPHS", "1")
    eager = Engine.load(str(b.folder), device="cuda", dtype="float32")
    monkeypatch.delenv("MOEDESK_NO_CUDA_GRAPHS")
    assert eager.runner.graphs is None
    ids = prompts(graphed)
    plain = greedy(eager, ids)
    assert greedy(graphed, ids) == plain
    assert graphed.runner.graphs.broken is None and graphed.runner.graphs.captures > 0

    model, run = graphed.model, graphed.executor
    lengths = torch.tensor([len(p) for p in ids], device="cuda")
    padded = torch.tensor([p + [0] * (int(lengths.max()) - len(p)) for p in ids], device="cuda")

    def prefilled():
        cache = model.new_cache(3, int(lengths.max()) + 16, torch.float32, "cuda")
        model(padded, torch.arange(padded.shape[1], device="cuda").expand(3, -1), cache, run, logits_at=lengths - 1)
        return cache

    reference, replayed = prefilled(), prefilled()
    from moedesk.engine.model.delta_net import GatedDeltaNet
    from moedesk.kernels import gpu_delta_net

    mixer = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    state, conv, _, _ = replayed.kinds[1].layer_tensors(replayed.kinds[1].layers[0])
    probe = torch.zeros(1, 1, 1, device="cuda")
    # the decode steps below go through kernels.gpu_delta_net, graphed and eager
    assert gpu_delta_net.fits(probe, state, conv, mixer.key_dim, mixer.value_dim, mixer.conv.shape[-1])
    graphs = GraphedDecode(model, replayed)
    rows = torch.tensor([2, 0], device="cuda")
    token = torch.tensor([[7], [9]], device="cuda")
    for step in range(6):
        positions = (lengths[rows] + step).unsqueeze(1)
        want = model(token, positions, reference, run, rows=rows, drafts=True)
        got = graphs.forward(token, positions, run, rows)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        token = want[:, -1].argmax(-1, keepdim=True)
    assert graphs.broken is None and all(c.graphs for c in graphs.captured.values())
    for ours, theirs in zip(replayed.kinds[1].state, reference.kinds[1].state):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)

    params = SamplingParams(max_new_tokens=NEW, temperature=0)
    requests = [Request(p, params, tag=i) for i, p in enumerate(ids)]
    alone = [next(iter(eager.generate([r], batch_size=1))).token_ids for r in requests]
    for mode, width, budget in (("greedy", 1, None), ("beam", 3, 7)):
        made = []
        sp = Speculator(model, graphed.device, graphed.dtype, graphed.context_length, graphed.config.eos_token_ids,
                        graphed.tokenizer,
                        graphs=lambda m, c: made.append(GraphedDecode(m, c, capture_after=1)) or made[-1])
        done, _ = sp.run(requests, run, oracle_factory(alone, 0.3, graphed.vocab_size, seed=1), mode=mode,
                         draft_length=4, draft_width=width, budget=budget)
        assert [c.token_ids for c in done] == alone, mode
        assert any(key[1] > 1 and c.graphs for g in made for key, c in g.captured.items()), mode

    from moedesk.engine.generation.beam import BeamSearch

    eos = graphed.tokenizer.eos_token_ids | set(graphed.config.eos_token_ids)
    searches = [BeamSearch(model, graphed.device, graphed.dtype, graphed.context_length, graphs=on)
                for on in (True, False)]
    for prompt in ids[1:]:
        assert searches[0].run(prompt, run, 3, 8, eos).tokens == searches[1].run(prompt, run, 3, 8, eos).tokens
    assert searches[0].runner.graphs.captures and searches[0].runner.graphs.broken is None


def test_memory_sums_count_deltanet_layers_and_the_kv_cache_of_full_layers_only(built, tmp_path):
    """The bench's fit check and the GPU budget's split size a layer as the model holds it (DeltaNet projections and
    convolution, the gated query), and the KV cache by the full-attention layers alone; a checkpoint's multi-token
    prediction layer (Qwen3-Next ships one under mtp.) is read past."""
    from moedesk.engine.memory_fit import layer_weights
    from moedesk.engine.offload.gpu_budget import kv_bytes_per_position

    b = built("qwen3next")
    folder = tmp_path / "with-mtp"
    shutil.copytree(b.folder, folder)
    tensors = load_file(b.folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    cfg = engine.config
    for i, block in enumerate(engine.model.layers):
        held = sum(p.numel() for name, p in block.named_parameters() if p.dim() > 1 and "shared_gate" not in name)
        assert layer_weights(cfg, i)[1] == held, i
    cache = engine.model.new_cache(1, 8, torch.float32, "cpu")
    assert kv_bytes_per_position(cfg, 4) == cache.bytes_per_position() == 2 * 2 * 16 * 4


def test_auto_speculations_step_times_are_measured_through_graphs_as_the_runner_decodes_them(built):
    """Auto speculation times T(B, k) of the verify forwards it would run; for a recurrent model too those replay
    CUDA graphs (here their segments, eagerly), so the graphs factory asked for is used, and every k is timed."""
    from moedesk.engine.speculative.step_times import measure_step_times

    engine = Engine.load(str(built("qwen3next").folder), device="cpu", dtype="float32")
    made = []
    times = measure_step_times(engine.model, engine.executor, engine.config, torch.device("cpu"), torch.float32,
                               [1, 2], 3, prompt=8, repeat=1, graphs=segments(made))
    assert sorted(times) == ["1,1", "1,2", "1,3", "2,1", "2,2", "2,3"] and all(t > 0 for t in times.values())
    assert len(made) == 2 and all(graphs.captures == 3 and graphs.broken is None for graphs in made)  # k = 1, 2, 3
