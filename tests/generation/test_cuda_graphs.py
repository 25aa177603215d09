"""Decode through the graph segments: the same tokens as eager decode and as transformers.

On the CPU the segments run eagerly (capture=False): that checks the split at MoE layers (dense
layers between, shared experts), the fixed-length attention under the mask, and explicit cache
rows. Capture and replay themselves are checked on the GPU box (tests/model/test_gpu_equivalence.py).
"""
import inspect

import pytest

from moedesk.engine.generation.cuda_graphs import GraphedDecode, graphs_wanted, shared_early_wanted
from moedesk.engine.generation.runner import ModelRunner
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy, hf_model

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):\n    return a + b", "Once"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "llama", "deepseek_v3"])
def test_segments_decode_the_reference_tokens(arch, tiny_checkpoint, monkeypatch):
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    lengths = [12, 5, 12, 3]  # row 1 frees first, then the last prompt (row 0) ends before the third (row 1)
    expected = [hf_greedy(hf_model(folder), p, n, eos) for p, n in zip(prompts, lengths)]
    graphs = GraphedDecode(engine.model, engine.cache, capture=False)
    calls = []
    forward = graphs.forward
    monkeypatch.setattr(graphs, "forward", lambda *a, **k: calls.append(a[3] is not None) or forward(*a, **k))
    engine.runner.graphs = graphs
    # Batch 2 over 4 prompts: later prompts take freed rows, and at the end row 1 decodes alone
    # (explicit cache rows).
    requests = [Request(p, SamplingParams(max_new_tokens=n, temperature=0), tag=i)
                for i, (p, n) in enumerate(zip(prompts, lengths))]
    done = {c.tag: c.token_ids for c in engine.generate(requests, batch_size=2)}
    assert [done[i] for i in range(len(prompts))] == expected
    assert calls and graphs.broken is None
    assert any(calls) and not all(calls)  # steps with and without explicit rows went through the segments
    assert len(graphs.captured) >= 2  # one per batch shape seen


def test_graphs_only_on_cuda_and_can_be_turned_off(monkeypatch):
    import torch

    assert not graphs_wanted(torch.device("cpu"))
    assert graphs_wanted(torch.device("cuda"))
    monkeypatch.setenv("MOEDESK_NO_CUDA_GRAPHS", "1")
    assert not graphs_wanted(torch.device("cuda"))
    assert inspect.signature(ModelRunner).parameters["graphs"].default is False  # eager unless asked


def test_shared_experts_run_beside_the_host_unless_turned_off(monkeypatch):
    monkeypatch.delenv("MOEDESK_SHARED_EARLY", raising=False)
    assert shared_early_wanted()  # measured faster on the box (docs/measurements.md, "Session 56")
    for off in ("0", "false", "no"):
        monkeypatch.setenv("MOEDESK_SHARED_EARLY", off)
        assert not shared_early_wanted()
    monkeypatch.setenv("MOEDESK_SHARED_EARLY", "1")
    assert shared_early_wanted()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_layers_with_every_expert_resident_run_inside_the_segments(arch, tiny_checkpoint, monkeypatch):
    """A layer whose experts all live on the "GPU" is computed from device tensors (no host round trip), inside
    the segments and in eager steps alike: same tokens as transformers, and the same popularity and stats."""
    from moedesk.engine.offload.offload_executor import OffloadExecutor, stack_experts

    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    expected = [hf_greedy(hf_model(folder), p, 10, eos) for p in prompts]
    banks = stack_experts(engine.model, pinned=False)
    layers = sorted(banks)
    # First MoE layer all resident, the others half resident: only the first may skip the host.
    on_gpu = [[True] * banks[layer].num_experts if i == 0 else [e % 2 == 0 for e in range(banks[layer].num_experts)]
              for i, layer in enumerate(layers)]
    runs = {}
    for name, graphs in (("host", None), ("eager", None),
                         ("segments", GraphedDecode(engine.model, engine.cache, capture=False))):
        executor = OffloadExecutor(banks, on_gpu, "cpu", lambda loads: (sorted(loads), []))
        assert [executor.runs_on_device(layer) for layer in layers] == [True] + [False] * (len(layers) - 1)
        if name == "host":  # the reference: every layer through the host's decisions
            monkeypatch.setattr(executor, "runs_on_device", lambda layer: False)
        on_device = []
        device_outputs = executor.device_expert_outputs
        monkeypatch.setattr(executor, "device_expert_outputs",
                            lambda moe, *a: on_device.append(moe.layer) or device_outputs(moe, *a))
        engine.executor, engine.runner.graphs = executor, graphs
        requests = [Request(p, SamplingParams(max_new_tokens=10, temperature=0), tag=i) for i, p in enumerate(prompts)]
        done = {c.tag: c.token_ids for c in engine.generate(requests, batch_size=2)}
        assert [done[i] for i in range(len(prompts))] == expected, name
        assert set(on_device) == (set() if name == "host" else {layers[0]}), name
        runs[name] = (executor.stats.copy(), {layer: counts.tolist() for layer, counts in executor.selections.items()})
    assert len(graphs.captured) >= 2
    executor.set_placement(on_gpu)  # new resident weights: every capture is stale, and dropped at the next one
    list(engine.generate([Request(prompts[0], SamplingParams(max_new_tokens=3, temperature=0))]))
    assert len(graphs.captured) == 1
    host_stats, host_counts = runs["host"]
    for name in ("eager", "segments"):
        stats, counts = runs[name]
        assert counts == host_counts, name
        for field in ("selections", "gpu_hits", "gpu_experts", "cpu_experts"):
            assert getattr(stats, field) == getattr(host_stats, field), (name, field)


def test_segments_run_the_models_own_layer_loop(tiny_checkpoint, monkeypatch):
    """The graphs' segments are the model's forward cut at its host-run MoE layers: Transformer.run_layers over
    the layers between them, not a loop of their own, and the same logits."""
    import torch

    from moedesk.engine.model.transformer import Transformer

    engine = Engine.load(str(tiny_checkpoint("qwen2_moe")), device="cpu", dtype="float32")
    model = engine.model
    moe = [i for i, block in enumerate(model.layers) if hasattr(block, "moe")]
    spans = []
    run_layers = Transformer.run_layers
    monkeypatch.setattr(Transformer, "run_layers",
                        lambda self, x, rope, cache, step, start, end, *rest:
                        spans.append((start, end)) or run_layers(self, x, rope, cache, step, start, end, *rest))
    tokens, positions = torch.tensor([[5, 7, 9]]), torch.arange(3)[None]
    eager = model(tokens, positions, model.new_cache(1, 8, torch.float32, "cpu"), engine.executor)
    assert spans == [(0, len(model.layers))]
    spans.clear()
    cache = model.new_cache(1, 8, torch.float32, "cpu")
    graphs = GraphedDecode(model, cache, capture=False, capture_after=1)
    segmented = graphs.forward(tokens, positions, engine.executor)
    ends = moe + [len(model.layers)]
    assert spans == list(zip([0] + [i + 1 for i in moe], ends))
    torch.testing.assert_close(segmented, eager)


def test_a_handed_over_capture_first_runs_each_resident_share_outside_it():
    """The handed-over graph computes resident experts with a grouped launch that the eager warm-up step does not
    make; its first launch (Triton compiling and loading the kernel) cannot fall inside a capture. So each layer
    with resident experts runs `device_share` once, on the warm-up's routing, before the capture."""
    from types import SimpleNamespace

    from moedesk.engine.generation.cuda_graphs import _Captured

    calls = []
    executor = SimpleNamespace(has_resident=lambda layer: layer != 7,
                               device_share=lambda moe, flat, ids: calls.append((moe.layer, flat, ids)))
    layers = {2: SimpleNamespace(moe=SimpleNamespace(layer=5)), 4: SimpleNamespace(moe=SimpleNamespace(layer=7))}
    captured = SimpleNamespace(moe_at=[2, 4], model=SimpleNamespace(layers=layers),
                               outputs=[("x0", "flat0", "w0", "ids0"), ("x1", "flat1", "w1", "ids1"), ("logits",)])
    _Captured._warm_device_shares(captured, executor)
    assert calls == [(5, "flat0", "ids0")]  # layer 7 has nothing resident
