"""A model's layers over several devices (engine.model.layer_devices): the same logits as on one device, the hidden
state copied once at each cut the plan makes, each run of layers with its own cache part on its device.

Devices may repeat: two or three "cpu" entries stand for GPUs here, where every move is a no-op but still counted;
tests/model/test_layer_devices_gpu.py runs the same on two CUDA devices.
"""
import pytest
import torch

from moedesk.engine.generation.cuda_graphs import GraphedDecode, Segment, plan_segments
from moedesk.engine.load.synthetic import SHAPES, synthetic_model
from moedesk.engine.model.cache.kv import KVCache
from moedesk.engine.model.cache.layers import LayerCaches
from moedesk.engine.model.layer_devices import LayerDevices, spread_model
from moedesk.engine.offload.expert_executor import LocalExecutor


@pytest.fixture(scope="module")
def built():
    """built(shape) -> a synthetic model of that tiny shape, made once (a build takes seconds), on one device again."""
    models = {}

    def get(shape: str):
        if shape not in models:
            models[shape] = synthetic_model(SHAPES[shape], torch.float32, "cpu", pinned=False, context=64)[0]
        models[shape].spread = None
        return models[shape]

    return get


def _decode(model, device, steps: int = 4, prompt=(5, 17, 3, 99, 42, 7), features: tuple = ()):
    """Logits of a two-row prompt (one row right-padded) and of `steps` greedy steps after it, one forward each."""
    executor = LocalExecutor()
    cache = model.new_cache(2, 32, torch.float32, device)
    tokens = torch.tensor([list(prompt), list(prompt[:4]) + [0, 0]], device=device)
    positions = torch.arange(len(prompt), device=device).expand(2, -1)
    last = torch.tensor([len(prompt) - 1, 3], device=device)
    out = [model(tokens, positions, cache, executor, logits_at=last)]
    at = last.clone()
    for _ in range(steps):
        token = out[-1][:, -1].argmax(-1, keepdim=True)
        at = at + 1
        step = model(token, at[:, None], cache, executor, features=features)
        if features:
            step, hidden = step
            out += [hidden[f] for f in features]
        out.append(step)
    return out


@pytest.mark.parametrize("shape, owner", [("tiny-moe", (0, 0, 1, 1)), ("tiny-moe", (0, 1, 1, 2)),
                                          ("tiny-moe", (0, 0, 0, 1)), ("tiny-glm", (0, 1, 1, 1)),
                                          ("tiny-qwen35", (0, 0, 1, 1))])
def test_spread_layers_give_one_devices_logits_with_one_copy_per_cut(built, shape, owner):
    """Mixtral's layers, GLM's dense first layer and sigmoid routing, Qwen3.5's recurrent layers beside attention."""
    model = built(shape)
    expected = _decode(model, "cpu")
    spread = spread_model(model, ["cpu"] * (max(owner) + 1), owner)
    assert model.supports_graphs  # a graph per device's stretch of layers (engine.generation.cuda_graphs)
    got = _decode(model, "cpu")
    assert spread.crossings == len(got) * spread.cuts() == len(got) * (max(owner))  # one copy per cut, per forward
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_latent_caches_and_sinks_spread_too(arch, tiny_checkpoint):
    """MLA's latent cache in parts, and gpt-oss's sinks and sliding layers, from real (tiny) checkpoints."""
    from moedesk.engine.runtime import Engine

    model = Engine.load(str(tiny_checkpoint(arch)), device="cpu", dtype="float32", offload=False).model
    expected = _decode(model, "cpu")
    spread = spread_model(model, ["cpu", "cpu"], (0, 1, 1))
    got = _decode(model, "cpu")
    assert spread.crossings == len(got)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_each_run_of_layers_has_its_own_cache_part_on_its_device(built):
    model = built("tiny-qwen35")  # three Gated DeltaNet layers, then a full-attention one
    spread_model(model, ["cpu", "cpu"], (0, 0, 1, 1))
    cache = model.new_cache(2, 16, torch.float32, "cpu")
    assert isinstance(cache, LayerCaches) and [part.layers for part in cache.kinds] == [[0, 1], [2, 3]]
    assert cache[0] is cache[1] and cache[2] is cache[3] and cache[1] is not cache[2]
    assert cache.bytes_per_position() == model.layers_cache(2, 16, torch.float32, "cpu").bytes_per_position()
    mixtral = built("tiny-moe")
    spread_model(mixtral, ["cpu", "cpu"], (0, 1, 1, 1))
    parts = mixtral.new_cache(1, 8, torch.float32, "cpu").kinds
    assert all(isinstance(p, KVCache) for p in parts) and [p.layers for p in parts] == [[0], [1, 2, 3]]


def test_features_come_back_to_the_first_device_unchanged(built):
    """EAGLE heads read hidden states of several layers and the final norm: they come back as on one device."""
    model = built("tiny-moe")
    features = (1, 3, "final")
    expected = _decode(model, "cpu", steps=2, features=features)
    spread_model(model, ["cpu", "cpu"], (0, 0, 1, 1))
    for a, b in zip(expected, _decode(model, "cpu", steps=2, features=features)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_runs_and_cuts_follow_the_device_of_each_layer():
    spread = LayerDevices(["cpu", "cpu", "cpu"], (0, 0, 1, 1, 1, 2))
    assert spread.runs == ((0, 0, 2), (1, 2, 5), (2, 5, 6)) and spread.cuts() == 2
    assert LayerDevices(["cpu", "cpu"], (1, 1)).cuts() == 1  # the embeddings sit on the first device
    with pytest.raises(ValueError):
        LayerDevices(["cpu"], (0, 1))


@pytest.mark.gpu
def test_two_cuda_devices_give_one_devices_logits():
    """On the two-GPU box: the blocks, their cache parts and the head really sit on their GPUs, and the logits are
    cuda:0's alone."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the GPU box's two-GPU kind)")
    model = synthetic_model(SHAPES["tiny-moe"], torch.float32, "cuda:0", pinned=False, context=64)[0]
    for moe in model.moe_blocks():
        moe.experts = moe.experts.to("cuda:0")  # beside the block's weights: spread_model moves them with it
    expected = _decode(model, "cuda:0")
    spread = spread_model(model, ["cuda:0", "cuda:1"], (0, 0, 1, 1))
    devices = [{p.device for p in block.parameters()} for block in model.layers]
    assert devices == [{torch.device("cuda:0")}] * 2 + [{torch.device("cuda:1")}] * 2
    assert model.lm_head.weight.device == torch.device("cuda:1") and model.embed.weight.device == torch.device("cuda:0")
    assert [part.device for part in model.new_cache(1, 8, torch.float32, "cuda:0").kinds] == [
        torch.device("cuda:0"), torch.device("cuda:1")]
    got = _decode(model, "cuda:0")
    assert spread.crossings == len(got) and all(t.device == torch.device("cuda:0") for t in got)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)
        assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))


def _graphed_decode(model, device, graphs_of, steps: int = 4, prompt=(5, 17, 3, 99, 42, 7), features: tuple = ()):
    """`_decode`'s prompt forward, then its steps through GraphedDecode's segments (graphs_of(model, cache))."""
    executor = LocalExecutor()  # every MoE layer's experts through the host's hands: a segment cut at each
    cache = model.new_cache(2, 32, torch.float32, device)
    graphs = graphs_of(model, cache)
    tokens = torch.tensor([list(prompt), list(prompt[:4]) + [0, 0]], device=device)
    positions = torch.arange(len(prompt), device=device).expand(2, -1)
    last = torch.tensor([len(prompt) - 1, 3], device=device)
    out = [model(tokens, positions, cache, executor, logits_at=last)]
    at = last.clone()
    for _ in range(steps):
        token = out[-1][:, -1].argmax(-1, keepdim=True)
        at = at + 1
        step = graphs.forward(token, at[:, None], executor, features=features)
        if features:
            step, hidden = step
            out += [hidden[f] for f in features]
        out.append(step)
    return out, graphs


def test_segments_cut_at_host_run_layers_and_at_each_change_of_device():
    assert plan_segments((0, 0, 0, 0), (1, 3)) == [  # one device: exactly the cuts at host-run layers
        Segment(0, 0, 1, False, True), Segment(0, 1, 3, True, True), Segment(0, 3, 4, True, False)]
    assert plan_segments((0, 0, 0), ()) == [Segment(0, 0, 3, False, False)]
    # The residual after layer 1's experts is finished on device 0, then handed to device 1 for layers 2 and 3.
    assert plan_segments((0, 0, 1, 1), (1, 3)) == [
        Segment(0, 0, 1, False, True), Segment(0, 1, 2, True, False), Segment(1, 2, 3, False, True),
        Segment(1, 3, 4, True, False)]
    assert plan_segments((0, 1, 1, 2), ()) == [
        Segment(0, 0, 1, False, False), Segment(1, 1, 3, False, False), Segment(2, 3, 4, False, False)]
    # Layers all on device 1: the embeddings alone on device 0, then everything on device 1.
    assert plan_segments((1, 1), (0,)) == [
        Segment(0, 0, 0, False, False), Segment(1, 0, 0, False, True), Segment(1, 0, 2, True, False)]
    for owner, host in (((0, 0, 1, 1), (0, 1, 2, 3)), ((0, 1, 1, 2), (2,)), ((0, 0, 0, 1), (3,))):
        segments = plan_segments(owner, host)
        assert all(seg.device == owner[seg.start] or (seg.start, seg.end) == (0, 0) for seg in segments)
        # No segment holds layers of two devices; a layer runs whole in one segment, or (host-run) is routed at the
        # end of one and finished at the start of the next, on the same device.
        whole = [i for seg in segments for i in range(seg.start + seg.resumes, seg.end)]
        routed = [seg.end for seg in segments if seg.routes]
        assert routed == list(host) and sorted(whole + routed) == list(range(len(owner)))
        for seg, after in zip(segments, segments[1:]):
            assert not seg.routes or (after.resumes, after.start, after.device) == (True, seg.end, seg.device)


@pytest.mark.parametrize("shape, owner", [("tiny-moe", (0, 0, 1, 1)), ("tiny-moe", (0, 1, 1, 2)),
                                          ("tiny-moe", (1, 1, 1, 1)), ("tiny-glm", (0, 1, 1, 1)),
                                          ("tiny-qwen35", (0, 0, 1, 1))])
def test_graph_segments_over_several_devices_decode_as_one_device_eagerly(built, shape, owner):
    """The segments CUDA graphs replay (capture=False: run as they would be captured), cut at each device change and
    the hidden state handed over between them: the eager forward's logits and greedy ids, its features too."""
    model = built(shape)
    features = (1, "final")
    expected = _decode(model, "cpu", features=features)
    spread = spread_model(model, ["cpu"] * (max(owner) + 1), owner)
    got, graphs = _graphed_decode(model, "cpu", lambda m, c: GraphedDecode(m, c, capture=False), features=features)
    (captured,) = graphs.captured.values()
    moe = [i for i, block in enumerate(model.layers) if hasattr(block, "moe")]
    assert captured.segments == plan_segments(owner, moe)
    assert len(captured.segments) == len(moe) + 1 + spread.cuts()
    assert spread.crossings == 1 * spread.cuts()  # the prompt's eager forward; the steps cross between segments
    assert graphs.broken is None and graphs.captures == 1
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)
    ids = [step[:, -1].argmax(-1).tolist() for step in expected[::len(features) + 1]]
    assert ids == [step[:, -1].argmax(-1).tolist() for step in got[::len(features) + 1]]


@pytest.mark.parametrize("shape, owner", [("tiny-moe", (0, 0, 1, 1)), ("tiny-moe", (0, 1, 1, 2)),
                                          ("tiny-qwen35", (0, 0, 1, 1))])
def test_every_layer_and_expert_call_runs_under_its_own_devices_on_device(built, shape, owner, monkeypatch):
    """Triton kernels launch on the current device, not on their tensors' (the two-GPU box refused cuda:1 pointers
    launched from cuda:0): each layer, each call for its experts and the head run inside on_device of the device that
    holds them, eager and in the graphs' segments, prompt and steps. The "cpu" devices here are equal, so each is told
    apart by identity (the spread's own device objects)."""
    import contextlib

    from moedesk.engine.generation import cuda_graphs
    from moedesk.engine.model import layer_devices

    model = built(shape)
    spread = spread_model(model, ["cpu"] * (max(owner) + 1), owner)
    current, seen = [], []

    @contextlib.contextmanager
    def recording(device):
        current.append(device)
        try:
            yield
        finally:
            current.pop()

    def under(what, layer, fn):
        def call(*args, **kwargs):
            seen.append((what, layer, current[-1] if current else None))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(layer_devices, "on_device", recording)
    monkeypatch.setattr(cuda_graphs, "on_device", recording)
    for i, block in enumerate(model.layers):
        for name in ("forward", "before_experts", "after_experts"):
            if hasattr(block, name):
                monkeypatch.setattr(block, name, under(name, i, getattr(block, name)))
    monkeypatch.setattr(model, "head", under("head", len(owner) - 1, model.head))
    monkeypatch.setattr(LocalExecutor, "expert_outputs", lambda self, moe, *a, _run=LocalExecutor.expert_outputs, **k:
                        under("experts", moe.layer, _run)(self, moe, *a, **k))
    _decode(model, "cpu", steps=2)
    _graphed_decode(model, "cpu", lambda m, c: GraphedDecode(m, c, capture=False), steps=2)
    assert {what for what, _, _ in seen} >= {"forward", "head"} | ({"experts", "before_experts", "after_experts"}
                                                                  if shape == "tiny-moe" else set())
    wrong = [(what, layer) for what, layer, device in seen if device is not spread.devices[owner[layer]]]
    assert wrong == []


@pytest.mark.parametrize("shape, tree", [("tiny-moe", False), ("tiny-moe", True), ("tiny-qwen35", False)])
def test_a_verify_forward_with_rows_and_a_tree_crosses_devices_in_segments(built, shape, tree):
    """A speculative verify forward through the segments over two devices: explicit cache rows, several tokens a
    row and a tree's mask and slots reach the second device's layers as the eager spread forward gives them."""
    from moedesk.engine.speculative.proposal import tree_mask

    model = built(shape)
    spread_model(model, ["cpu", "cpu"], (0, 0, 1, 1))
    executor = LocalExecutor()
    prompt = torch.tensor([[5, 17, 3, 99, 42], [7, 8, 9, 10, 11]])
    rows = torch.tensor([1, 0])
    tokens, extra = torch.tensor([[3, 4, 5], [6, 7, 8]]), {}
    positions = (5 + torch.arange(3)).expand(2, 3)
    if tree:  # the root and two children, in slots 5, 6, 7
        mask = torch.zeros(2, 1, 3, 8, dtype=torch.bool)
        mask[..., :5] = True
        mask[..., 5:] = tree_mask([-1, 0, 0])
        positions = (5 + torch.tensor([0, 1, 1])).expand(2, 3)
        extra = dict(mask=mask, slots=(5 + torch.arange(3)).expand(2, 3))
    results = []
    for graphed in (False, True):
        cache = model.new_cache(2, 16, torch.float32, "cpu")
        model(prompt, torch.arange(5).expand(2, -1), cache, executor)
        if graphed:
            graphs = GraphedDecode(model, cache, capture=False, capture_after=1)
            results.append(graphs.forward(tokens, positions, executor, rows, **extra))
            assert graphs.captures == 1 and len(next(iter(graphs.captured.values())).inputs) == 2
        else:
            results.append(model(tokens, positions, cache, executor, rows=rows, drafts=True, **extra))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.gpu
@pytest.mark.parametrize("owner", [(0, 0, 1, 1), (1, 1, 1, 1)])
def test_two_cuda_devices_replay_a_graph_per_device(monkeypatch, owner):
    """On the two-GPU box: decode replayed from CUDA graphs captured on each GPU, into each GPU's pool, gives the eager
    forward's logits and greedy ids, and every step replays graphs of both GPUs. Every layer on cuda:1: the step's
    inputs stay with the embeddings on cuda:0, not with the cache's first part."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the GPU box's two-GPU kind)")
    model = synthetic_model(SHAPES["tiny-moe"], torch.float32, "cuda:0", pinned=False, context=64)[0]
    for moe in model.moe_blocks():
        moe.experts = moe.experts.to("cuda:0")  # beside the block's weights: spread_model moves them with it
    expected = _decode(model, "cuda:0")
    spread_model(model, ["cuda:0", "cuda:1"], owner)
    replayed = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replayed.append(self) or replay(self))
    got, graphs = _graphed_decode(model, "cuda:0", GraphedDecode)
    (captured,) = graphs.captured.values()
    both = {torch.device("cuda:0"), torch.device("cuda:1")}
    assert graphs.broken is None and set(captured.pool) == both and len(captured.graphs) == len(captured.segments)
    # The first step is the eager warm-up; each later one replays every segment's graph, on its own GPU.
    assert len(replayed) == 3 * len(captured.graphs)
    assert {captured.devices[seg.device] for graph, seg in zip(captured.graphs, captured.segments)
            if any(graph is r for r in replayed)} == both
    assert all(t.device == torch.device("cuda:0") for t in got)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)
        assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))
