"""A decode step of the Gated DeltaNet layers issues no host sync and few kernels (issue 41: on the GPU its layers
were launch bound, and CUDA graphs can only replay a step that never waits for the host).

The aten ops of the step are recorded on the CPU with a TorchDispatchMode: what would sync the host on CUDA (reading
a value back, a data-dependent shape) must not appear, in plain decoding, with explicit cache rows, and where drafts
are kept for speculation; and the ops that compute (views and no-op casts left out) stay few per layer.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moedesk.engine.model.delta_net import GatedDeltaNet
from moedesk.engine.runtime import Engine
from moedesk.engine.speculative.proposal import tree_mask

# Ops that read a device value back to the host, or whose output shape depends on the data.
SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "unique", "_unique2",
         "allclose", "tolist", "repeat_interleave"}
VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes", "transpose", "t",
         "expand", "permute", "as_strided", "alias", "detach", "_unsafe_view", "unbind"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recorder(TorchDispatchMode):
    """The ops that run inside GatedDeltaNet.forward, per call: (name, computes) pairs."""

    def __init__(self):
        super().__init__()
        self.calls: list[list[tuple[str, bool]]] = []
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:
            name = func.overloadpacket.__name__
            computes = name not in VIEWS and not (name in ("to", "_to_copy", "contiguous") and out is args[0])
            self.calls[-1].append((name, computes))
        return out


def recorded_step(model, cache, executor, tokens, positions, rows=None, drafts=False) -> list[list[tuple[str, bool]]]:
    recorder = Recorder()
    forward = GatedDeltaNet.forward

    def watched(self, *args, **kwargs):
        recorder.calls.append([])
        recorder.inside = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            recorder.inside = False

    GatedDeltaNet.forward = watched
    try:
        with recorder:
            model(tokens, positions, cache, executor, rows=rows, drafts=drafts)
    finally:
        GatedDeltaNet.forward = forward
    return recorder.calls


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.gguf_from_hf import build

    return Engine.load(str(build("qwen35moe", tmp_path_factory.mktemp("qwen35moe")).folder), device="cpu",
                       dtype="float32")


def prefilled(engine, history: int = 1):
    model = engine.model
    cache = model.new_cache(3, 32, torch.float32, "cpu")
    if history > 1:
        cache.kinds[1]._keep_more(history)
    prompt = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]])
    model(prompt, torch.arange(5).expand(3, 5), cache, engine.executor)
    return cache


@pytest.mark.parametrize("case", ["rows-0-to-B", "explicit-rows", "speculating", "verify-chain"])
def test_a_decode_step_of_the_recurrent_layers_never_syncs_the_host(engine, case):
    model = engine.model
    cache = prefilled(engine, history=4 if case in ("speculating", "verify-chain") else 1)
    T = 3 if case == "verify-chain" else 1
    tokens = torch.tensor([[3, 4, 5][:T], [6, 7, 8][:T]])
    positions = (5 + torch.arange(T)).expand(2, T)
    rows = torch.tensor([2, 0]) if case == "explicit-rows" else None
    calls = recorded_step(model, cache, engine.executor, tokens, positions, rows, drafts=T > 1)
    assert len(calls) == sum(model.cfg.linear_layers)  # every DeltaNet layer was recorded
    for ops in calls:
        assert not SYNCS & {name for name, _ in ops}, sorted(SYNCS & {name for name, _ in ops})
    if case in ("rows-0-to-B", "speculating"):
        # A handful of kernels for the projections, the convolution's shift, the delta rule's update, the norm and
        # the cache's update (docs/measurements.md has the count before and after).
        computing = [sum(c for _, c in ops) for ops in calls]
        assert max(computing) <= (44 if case == "rows-0-to-B" else 46), computing


def test_decoding_in_place_continues_the_state_as_explicit_rows_do(engine):
    """Rows 0..B-1 are updated through views of the cache, explicit rows by index: the same states and logits."""
    model = engine.model
    tokens, positions = torch.tensor([[3], [4]]), torch.tensor([[5], [5]])
    views, indexed = prefilled(engine), prefilled(engine)
    a = model(tokens, positions, views, engine.executor)
    b = model(tokens, positions, indexed, engine.executor, rows=torch.tensor([0, 1]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(views.kinds[1].state + views.kinds[1].conv, indexed.kinds[1].state + indexed.kinds[1].conv):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.equal(views.kinds[1].state[0][:2], prefilled(engine).kinds[1].state[0][:2])  # it moved on


@pytest.mark.parametrize("tokens,tree", [(1, False), (3, False), (3, True)])
def test_what_cuda_graphs_capture_of_a_qwen35_step_never_syncs_the_host(engine, tokens, tree):
    """The segments a graph captures (everything but the host-run experts: embedding, DeltaNet and gated attention
    layers, routing, head), a decode step and a verify forward: no op that would sync, which capture refuses."""
    from moedesk.engine.generation import cuda_graphs
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    model = engine.model
    cache = prefilled(engine, history=4)
    graphs = GraphedDecode(model, cache, capture=False, capture_after=1)
    seen: list[str] = []
    segment = cuda_graphs._Captured._segment

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def watched(self, *args, **kwargs):
        with Syncs():
            return segment(self, *args, **kwargs)

    cuda_graphs._Captured._segment = watched
    try:
        ids = torch.tensor([[3, 4, 5][:tokens], [6, 7, 8][:tokens]])
        extra = {}
        if tree:  # the root and two children, in slots 5, 6, 7
            mask = torch.zeros(2, 1, 3, 8, dtype=torch.bool)
            mask[..., :5] = True
            mask[..., 5:] = tree_mask([-1, 0, 0])
            extra = dict(mask=mask, slots=(5 + torch.arange(3)).expand(2, 3))
        positions = (5 + torch.tensor([0, 1, 1] if tree else list(range(tokens)))).expand(2, tokens)
        for _ in range(2):  # the warm-up, then a replay (here the segments again)
            assert graphs.forward(ids, positions, engine.executor, torch.tensor([1, 0]), **extra) is not None
    finally:
        cuda_graphs._Captured._segment = segment
    assert seen and not SYNCS & set(seen), sorted(SYNCS & set(seen))


@pytest.mark.parametrize("failure", ["out of memory", "capture refused"])
def test_a_failed_capture_still_feeds_the_step_once(engine, monkeypatch, failure):
    """A new shape's step runs once eagerly before its capture; when the capture then fails, that run is the step's
    result. Running it again (the out-of-memory retry, the eager fallback) would feed the tokens to the recurrent
    state twice: the logits and the state equal one eager forward's."""
    from moedesk.engine.generation import cuda_graphs
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    def fail(self, executor, pool):
        raise torch.OutOfMemoryError("CUDA out of memory") if failure == "out of memory" else RuntimeError("no graphs")

    monkeypatch.setattr(cuda_graphs._Captured, "capture", fail)
    model = engine.model
    reference, graphed = prefilled(engine), prefilled(engine)
    assert graphed.stateful and not getattr(graphed.kinds[0], "stateful", False)  # the KV cache's kind is not
    graphs = GraphedDecode(model, graphed, capture=True)
    tokens, positions = torch.tensor([[3], [4]]), torch.tensor([[5], [5]])
    got = graphs.forward(tokens, positions, engine.executor)
    want = model(tokens, positions, reference, engine.executor)
    # The segments' attention reads the cache's whole length (rounding apart); a second feed would move far more.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(graphed.kinds[1].state, reference.kinds[1].state):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert not graphs.captured and (graphs.broken is None) == (failure == "out of memory")


class Launches:
    """A Triton kernel whose launches the recorder counts as one op each, its interpreted insides unrecorded."""

    def __init__(self, kernel, recorder: Recorder):
        self.kernel, self.recorder = kernel, recorder

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.recorder.calls[-1].append((f"triton:{self.kernel.fn.__name__}", True))
            inside, self.recorder.inside = self.recorder.inside, False
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.recorder.inside = inside
        return launch


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter on the CPU")
def test_the_fused_decode_step_is_five_kernels_a_layer(engine, monkeypatch):
    """kernels.gpu_delta_net (CUDA's path, run here by Triton's interpreter): the projection's matmul, the
    convolution's step, the delta rule's step, the gated norm and the output's matmul; no sync. The torch path's
    count beside it is what it replaces (docs/measurements.md)."""
    from moedesk.kernels import gpu_delta_net

    model = engine.model
    for module in model.modules():  # one input matmul, as CUDA loads it (views: same numbers)
        if isinstance(module, GatedDeltaNet) and not hasattr(module, "in_weight"):
            module.fuse_projections()
    tokens, positions = torch.tensor([[3], [4]]), torch.tensor([[5], [5]])
    torch_calls = recorded_step(model, prefilled(engine), engine.executor, tokens, positions)
    monkeypatch.setattr(gpu_delta_net, "fits", lambda *a: True)
    recorder_holder: list[Recorder] = []
    original = Recorder.__init__

    def init(self):
        original(self)
        recorder_holder.append(self)
        for name in ("_conv_step", "_delta_step", "_gated_norm"):
            monkeypatch.setattr(gpu_delta_net, name, Launches(getattr(gpu_delta_net, name).kernel
                                                              if isinstance(getattr(gpu_delta_net, name), Launches)
                                                              else getattr(gpu_delta_net, name), self))

    monkeypatch.setattr(Recorder, "__init__", init)
    fused_cache, torch_cache = prefilled(engine), prefilled(engine)
    fused_calls = recorded_step(model, fused_cache, engine.executor, tokens, positions)
    matmuls = {"linear", "mm", "addmm", "matmul"}
    computing = lambda ops: ["matmul" if name in matmuls else name  # noqa: E731
                             for name, computes in ops if computes and name != "empty"]
    for ops in fused_calls:
        assert not SYNCS & {name for name, _ in ops}
        assert computing(ops) == ["matmul", "triton:_conv_step", "triton:_delta_step", "triton:_gated_norm",
                                  "matmul"], ops
    assert min(len(computing(ops)) for ops in torch_calls) > 30  # what the torch path issues for the same step
    # And the same step: logits and states as the torch path leaves them.
    monkeypatch.setattr(gpu_delta_net, "fits", lambda *a: False)
    want = model(tokens, positions, torch_cache, engine.executor)
    monkeypatch.setattr(gpu_delta_net, "fits", lambda *a: True)
    got = model(tokens, positions, prefilled(engine), engine.executor)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(fused_cache.kinds[1].state, torch_cache.kinds[1].state):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
