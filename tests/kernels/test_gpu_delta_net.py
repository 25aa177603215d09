"""kernels.gpu_delta_net's decode step computes what engine.model.delta_net's torch path computes, and leaves the
cache as it leaves it (in place, rows by index or 0..B-1, the kept history for speculation, fresh rows from zero).

On the CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no
GPU); `fits` is forced so the layer takes the fused path on CPU tensors.
"""
import os
from types import SimpleNamespace

import pytest
import torch

from moedesk.engine.model import delta_net
from moedesk.engine.model.cache.recurrent import RecurrentState
from moedesk.engine.model.delta_net import GatedDeltaNet
from moedesk.kernels import gpu_delta_net

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")


@pytest.fixture
def interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")


def layer(key_heads, value_heads, key_dim, value_dim, dtype, kernel=4, hidden=48, seed=0):
    cfg = SimpleNamespace(linear_key_heads=key_heads, linear_value_heads=value_heads, linear_key_dim=key_dim,
                          linear_value_dim=value_dim, hidden_size=hidden, linear_conv_kernel=kernel, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    net = GatedDeltaNet(cfg, 0)
    with torch.no_grad():  # the checkpoint's kind of values, not the constructor's zeros and ones
        net.conv.normal_(0, 0.5)
        net.A_log.uniform_(-1, 1)
        net.dt_bias.normal_(0, 1)
        net.norm.weight.normal_(1, 0.2)
        for p in (net.in_qkv, net.in_z, net.in_b, net.in_a, net.out):
            p.weight.normal_(0, 0.3)
    return net.to(dtype).eval(), cfg


def cache_for(cfg, rows, history, conv_dim, dtype, seed=1):
    cache = RecurrentState([0], rows, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim, conv_dim,
                           cfg.linear_conv_kernel, history, "cpu", conv_dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    cache._all_state.copy_(torch.randn(cache._all_state.shape, generator=g) * 0.3)
    cache._all_conv.copy_(torch.randn(cache._all_conv.shape, generator=g))
    return cache


def step(net, cache, x, positions, rows, fused, monkeypatch):
    monkeypatch.setattr(gpu_delta_net, "fits", lambda *a: fused)
    batch = SimpleNamespace(rows=rows, positions=positions, parents=None, keep_states=False)
    with torch.no_grad():
        return net(x, None, {0: cache}, 0, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dims,rows,history", [
    ((1, 1), (16, 16), None, 1),  # one head, rows 0..B-1
    ((2, 6), (16, 24), torch.tensor([3, 0, 2]), 1),  # three value heads a key head, explicit rows, dv not 2^n
    ((2, 4), (32, 48), None, 3),  # speculation keeps the history: its first entry is the step's state
    ((3, 3), (8, 40), torch.tensor([1, 2, 0]), 2),  # dv over one value block
])
def test_a_fused_decode_step_equals_the_torch_path(interpreted, monkeypatch, dtype, heads, dims, rows, history):
    net, cfg = layer(*heads, *dims, dtype)
    B = 3
    x = torch.randn(B, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    positions = torch.tensor([[7], [0], [3]])  # row 1 starts a new sequence: from a zero state and window
    reference, fused = (cache_for(cfg, 4, history, net.conv_dim, dtype) for _ in range(2))
    before = fused._all_state.clone()
    want = step(net, reference, x, positions, rows, False, monkeypatch)
    got = step(net, fused, x, positions, rows, True, monkeypatch)
    assert got.dtype == want.dtype == dtype
    if dtype == torch.float32:
        tolerance = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, **tolerance)
    else:  # the interpreter truncates to bfloat16 where torch rounds, and the out projection's sums cancel
        tolerance = dict(rtol=2 ** -5, atol=2 ** -4)
        assert (got - want).float().norm() < 2 ** -5 * want.float().norm()
    tensors = ["_all_state", "_all_conv"] + (["_all_kept_state", "_all_kept_conv"] if history > 1 else [])
    for name in tensors:
        ours, theirs = getattr(fused, name), getattr(reference, name)
        if name.startswith("_all_kept"):  # the torch path writes the history's first entry only
            ours, theirs = ours[:, :, :1], theirs[:, :, :1]
        torch.testing.assert_close(ours, theirs, **tolerance, msg=name)
    untouched = ({0, 1, 2, 3} - set(range(B) if rows is None else rows.tolist())).pop()  # the row not in the batch
    assert torch.equal(fused._all_state[:, untouched], before[:, untouched])
    assert not torch.equal(fused._all_state, before)


def test_a_second_fused_step_continues_the_first(interpreted, monkeypatch):
    """Two steps in place: the second reads the state and window the first wrote (the cache, not a copy)."""
    net, cfg = layer(2, 4, 16, 16, torch.float32)
    reference, fused = (cache_for(cfg, 2, 1, net.conv_dim, torch.float32) for _ in range(2))
    g = torch.Generator().manual_seed(5)
    for position in (0, 1):
        x = torch.randn(2, 1, cfg.hidden_size, generator=g)
        positions = torch.full((2, 1), position)
        want = step(net, reference, x, positions, None, False, monkeypatch)
        got = step(net, fused, x, positions, None, True, monkeypatch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused._all_state, reference._all_state, rtol=1e-5, atol=1e-6)


def test_fits_only_cuda_float32_states():
    net, cfg = layer(1, 1, 16, 16, torch.float32)
    cache = cache_for(cfg, 1, 1, net.conv_dim, torch.float32)
    state, conv, _, _ = cache.layer_tensors(0)
    assert not gpu_delta_net.fits(torch.zeros(1, 1, 4), state, conv, 16, 16, 4)  # a CPU tensor: the torch path
    assert delta_net.gpu_delta_net is gpu_delta_net


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_graphed_fused_step_equals_the_eager_torch_path(monkeypatch, dtype):
    """Qwen3.5's head layout (16 key heads, 32 value heads of 128): the fused step captured in a CUDA graph and
    replayed over four tokens (explicit rows, one of them fresh at the first) against the torch path run eagerly:
    outputs and the cache's states and windows. bfloat16 rounds the same places; the sums' order differs."""
    net, cfg = layer(16, 32, 128, 128, dtype, hidden=256)
    net = net.cuda()
    reference, fused = (cache_for(cfg, 4, 2, net.conv_dim, dtype) for _ in range(2))
    for cache in (reference, fused):
        cache.device = torch.device("cuda")
        cache._set(*(t.cuda() for t in (cache._all_state, cache._all_conv, cache._all_kept_state,
                                        cache._all_kept_conv)))
    rows = torch.tensor([2, 0, 3], device="cuda")
    x = torch.zeros(3, 1, cfg.hidden_size, dtype=dtype, device="cuda")
    positions = torch.zeros(3, 1, dtype=torch.int64, device="cuda")
    monkeypatch.setattr(gpu_delta_net, "fits", lambda *a: True)
    batch = SimpleNamespace(rows=rows, positions=positions, parents=None, keep_states=False)
    with torch.no_grad():
        net(x, None, {0: fused}, 0, batch)  # compiles the kernels outside the capture
        fused._all_state.copy_(reference._all_state)
        fused._all_conv.copy_(reference._all_conv)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = net(x, None, {0: fused}, 0, batch)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    g = torch.Generator().manual_seed(3)
    for n in range(4):
        x.copy_(torch.randn(3, 1, cfg.hidden_size, generator=g).to(dtype))
        positions.copy_(torch.tensor([[5 + n], [n], [9 + n]]))
        graph.replay()
        want = step(net, reference, x, positions, rows, False, monkeypatch)
        if dtype == torch.float32:
            torch.testing.assert_close(replayed, want, **tolerance)
        else:  # the out projection's sums cancel: a relative error over the whole output
            assert (replayed - want).float().norm() < 2 ** -6 * want.float().norm(), n
    for name in ("_all_state", "_all_conv"):
        torch.testing.assert_close(getattr(fused, name), getattr(reference, name), **tolerance, msg=name)
    torch.testing.assert_close(fused._all_kept_state[:, :, :1], reference._all_kept_state[:, :, :1], **tolerance)
