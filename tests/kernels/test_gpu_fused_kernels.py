"""The fused Triton kernels compute what engine.model.transformer's torch chains compute.

On the CPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where
there is no GPU): float32 checks the indexing and the formulas. On the GPU box bfloat16
checks the rounding: the same bits as torch, except where a norm's summation order moves a
value across a rounding boundary.
"""
import os

import pytest
import torch

from moedesk.engine.model.norm import rms_norm
from moedesk.engine.model.routing import top_k_softmax
from moedesk.engine.model.transformer import MoE, apply_rope, top_k_route
from moedesk.kernels import gpu_fused

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")


@pytest.fixture
def interpreted():
    """kernels.gpu_fused, its kernels running in Triton's CPU interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    return gpu_fused


def _rope_inputs(b, t, heads, d, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, heads, d, generator=g).to(dtype)
    angles = torch.rand(b, t, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    weight = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    return [v.to(device) for v in (x, weight, cos, sin)]


def _combine_inputs(n, k, h, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n * k, h, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)
    return y.to(device), weights.to(device)


@pytest.mark.parametrize("rows,d", [(1, 64), (5, 576), (3, 2048)])  # 576: not a power of two
@pytest.mark.parametrize("weight_first,offset", [(False, False), (True, False), (False, True)])
def test_rms_norm_interpreted(interpreted, rows, d, weight_first, offset):
    """The weight applied where each architecture's reference applies it: after rounding the normalised row, before
    it (gpt-oss), or as 1 + weight (Qwen3-Next)."""
    g = torch.Generator().manual_seed(d)
    x, weight = torch.randn(rows, d, generator=g) * 3, torch.randn(d, generator=g)
    got = interpreted.rms_norm(x, weight, 1e-6, weight_first, offset)
    torch.testing.assert_close(got, rms_norm(x, weight, 1e-6, weight_first, offset), rtol=1e-6, atol=1e-6)
    if offset:  # the other rules would give a different row
        assert not torch.allclose(got, rms_norm(x, weight, 1e-6), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rotary_interpreted(interpreted, with_norm):
    x, weight, cos, sin = _rope_inputs(2, 3, 4, 64, torch.float32)
    expected = apply_rope(rms_norm(x, weight, 1e-6) if with_norm else x, cos, sin)
    got = interpreted.norm_rotary(x, weight if with_norm else None, 1e-6, cos, sin)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # A wrong token row for cos/sin (heads sharing it) would fail here as well as above.
    assert not torch.allclose(got[:, 1:], got[:, :-1])


@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rotary_takes_strided_tokens(interpreted, with_norm):
    """A slice of the fused q/k/v projection's output: heads dense, tokens strided."""
    x, weight, cos, sin = _rope_inputs(2, 3, 4, 64, torch.float32)
    fused = torch.cat([torch.randn(2, 3, 4 * 64), x.reshape(2, 3, -1), torch.randn(2, 3, 64)], -1)
    sliced = fused[..., 4 * 64:8 * 64].view(2, 3, 4, 64)
    assert not sliced.is_contiguous() and gpu_fused._dense_heads(sliced)
    got = interpreted.norm_rotary(sliced, weight if with_norm else None, 1e-6, cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, interpreted.norm_rotary(x, weight if with_norm else None, 1e-6, cos, sin),
                               rtol=0, atol=0)


@pytest.mark.parametrize("b,t,rows", [(1, 1, None), (3, 2, [4, 0, 2]), (2, 5, [1, 3])])
def test_write_cache_is_indexed_assignment(interpreted, b, t, rows):
    from moedesk.engine.model.cache.positional import write_rows

    g = torch.Generator().manual_seed(b * 10 + t)
    heads, d, length = 2, 32, 12
    cache_k, cache_v = torch.randn(5, length, heads, d, generator=g), torch.randn(5, length, heads, d, generator=g)
    k = torch.randn(b, t, heads, d, generator=g)
    v = torch.randn(b, t, 3 * heads, d, generator=g)[:, :, heads:2 * heads]  # strided tokens, as a fused slice
    slots = torch.stack([torch.randperm(length, generator=g)[:t] for _ in range(b)])
    index = write_rows(None if rows is None else torch.tensor(rows), b, "cpu")
    expected_k, expected_v = cache_k.clone(), cache_v.clone()
    expected_k[index, slots], expected_v[index, slots] = k, v
    interpreted.write_cache(cache_k, cache_v, k, v, index, slots)
    assert torch.equal(cache_k, expected_k) and torch.equal(cache_v, expected_v)


@pytest.mark.parametrize("n,k,h", [(1, 8, 2048), (3, 2, 2500)])  # 2500: a partial last block
def test_weighted_sum_interpreted(interpreted, n, k, h):
    y, weights = _combine_inputs(n, k, h, torch.float32)
    assert torch.equal(interpreted.weighted_sum(y, weights), MoE.combine(y, weights))


def _router_logits(n, e, dtype, device="cpu", seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g) * 2
    # Whole numbers: many experts tie, at the k-th place too, so the tie rule decides which are chosen.
    return (logits.round() if ties else logits).to(dtype).to(device)


@pytest.mark.parametrize("n,e,k,renormalise", [(1, 128, 8, True), (5, 8, 2, True), (3, 60, 6, False), (2, 256, 8, True)])
def test_route_interpreted(interpreted, n, e, k, renormalise):
    logits = _router_logits(n, e, torch.float32, seed=e)
    weights, ids = interpreted.route(logits, k, renormalise, torch.float32)
    expected_weights, expected_ids = top_k_route(logits, k, renormalise, torch.float32)
    assert ids.dtype == torch.int64 and torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n,e,k,renormalise", [(4, 256, 8, False), (3, 256, 8, True), (2, 1000, 10, True)])
def test_route_many_tied_experts_interpreted(interpreted, n, e, k, renormalise):
    """Whole-number logits: many experts tie, at the k-th place too, so the tie rule decides which are chosen
    (Qwen3.5's 256 experts, and more than one warp's 512 for the wider layout). torch.topk on the CPU breaks ties
    its own way, so the reference here is top_k_route's softmax with a stable sort: equals keep the lower id first,
    as torch.topk does on CUDA (the GPU test compares with it there)."""
    logits = _router_logits(n, e, torch.float32, seed=e + k, ties=True)
    weights, ids = interpreted.route(logits, k, renormalise, torch.float32)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    top, order = probs.sort(dim=-1, descending=True, stable=True)
    top, order = top[:, :k], order[:, :k]
    assert (top[:, -1] == probs.sort(-1, descending=True).values[:, k]).any()  # a tie at the k-th place decides
    if renormalise:
        top = top / top.sum(-1, keepdim=True)
    expected_ids, rank = order.sort(-1)
    expected_weights = top.gather(-1, rank)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("n,e,k", [(1, 32, 4), (5, 128, 4), (3, 60, 6), (2, 600, 8)])
def test_top_k_softmax_interpreted(interpreted, n, e, k):
    """gpt-oss's rule: the k largest logits, a softmax over those alone. Logits far below zero are ranked as they
    are (a rule ranking probabilities or marking the chosen with a finite value would misplace them)."""
    logits = _router_logits(n, e, torch.float32, seed=e) - 10
    weights, ids = interpreted.route(logits, k, False, torch.float32, softmax_of_top_k=True)
    expected_weights, expected_ids = top_k_softmax(logits, k)
    assert ids.dtype == torch.int64 and torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    assert torch.allclose(weights.sum(-1), torch.ones(n))


def test_top_k_softmax_ties_go_to_the_lower_id(interpreted):
    logits = torch.tensor([[-30.0, -20.0, -20.0, -40.0, -20.0], [-5.0, -9.0, -9.0, -9.0, -5.0]])
    weights, ids = interpreted.route(logits, 2, False, torch.float32, softmax_of_top_k=True)
    assert ids.tolist() == [[1, 2], [0, 4]]
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    weights, ids = interpreted.route(logits, 3, False, torch.float32, softmax_of_top_k=True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 4]]
    assert weights[1, 0] == weights[1, 2] > weights[1, 1] > 0


def _expected_arrangement(keys, groups, k):
    order = torch.argsort(keys, stable=True)
    return order, order // k, torch.bincount(keys, minlength=groups).cumsum(0).to(torch.int32)


# Pairs: one token's two, a batch's, and over 256 (the narrower chunks); groups beyond 256 (DeepSeek's experts).
@pytest.mark.parametrize("pairs,groups,k", [(1, 8, 1), (2, 8, 2), (37, 8, 1), (128, 128, 8), (300, 300, 4),
                                            (1024, 16, 8)])
def test_group_pairs_is_a_stable_sort_with_counts_interpreted(interpreted, pairs, groups, k):
    g = torch.Generator().manual_seed(pairs + groups)
    # Few distinct groups among many pairs: most groups hold several pairs, so the order within one is checked.
    keys = torch.randint(0, min(groups, 1 + pairs // 3), (pairs,), generator=g)
    tally = torch.randint(0, 5, (2, groups), generator=g)
    before = tally.clone()
    order, rows, ends, active = interpreted.group_pairs(keys, groups, k, tally)
    expected = _expected_arrangement(keys, groups, k)
    assert order.dtype == rows.dtype == torch.int64 and ends.dtype == active.dtype == torch.int32
    for got, want in zip((order, rows, ends), expected):
        assert torch.equal(got, want)
    counts = torch.bincount(keys, minlength=groups)
    assert torch.equal(tally, before + torch.stack([counts, (counts > 0).long()]))
    listed = counts.nonzero().view(-1).tolist()
    assert active.tolist() == listed + [-1] * (min(pairs, groups) - len(listed))


def test_group_pairs_without_a_tally_writes_only_its_results(interpreted):
    keys = torch.tensor([3, 0, 3, 1, 0, 3])
    order, rows, ends, active = interpreted.group_pairs(keys, 5, 2)
    assert order.tolist() == [1, 4, 3, 0, 2, 5]
    assert rows.tolist() == [0, 2, 1, 0, 1, 2]
    assert ends.tolist() == [2, 3, 3, 6, 6]
    assert active.tolist() == [0, 1, 3, -1, -1]


def test_route_ties_go_to_the_lower_id(interpreted):
    logits = torch.tensor([[0.0, 1.0, 1.0, -2.0, 1.0, 1.0], [5.0, 1.0, 1.0, 1.0, 1.0, 5.0]])
    weights, ids = interpreted.route(logits, 3, True, torch.float32)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 5]]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] and abs(weights[0].sum() - 1) < 1e-6
    assert weights[1, 0] == weights[1, 2] > weights[1, 1]
    # Probabilities that underflow to zero tie as well, as torch.topk ranks probabilities, not logits.
    weights, ids = interpreted.route(torch.tensor([[-200.0, 0.0, -300.0, -250.0]]), 3, False, torch.float32)
    assert ids.tolist() == [[0, 1, 2]] and weights.tolist() == [[0.0, 1.0, 0.0]]


def test_bfloat16_interpreted_is_close(interpreted):
    # The interpreter truncates to bfloat16 where GPUs round to nearest, and truncation errors add up
    # where a sum cancels, so only closeness holds here; the GPU test checks the rounding.
    x, weight, cos, sin = _rope_inputs(1, 2, 4, 128, torch.bfloat16)
    got = interpreted.norm_rotary(x, weight, 1e-6, cos, sin)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, apply_rope(rms_norm(x, weight, 1e-6), cos, sin), rtol=2 ** -4, atol=2 ** -3)
    y, weights = _combine_inputs(2, 8, 512, torch.bfloat16)
    got = interpreted.weighted_sum(y, weights)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, MoE.combine(y, weights), rtol=2 ** -4, atol=2 ** -3)


def test_only_for_cuda_tensors_and_can_be_turned_off(monkeypatch):
    x = torch.zeros(2, 8)
    assert not gpu_fused.applies(x, x)  # CPU tensors take torch's path
    assert gpu_fused.wanted()
    monkeypatch.setenv("MOEDESK_NO_FUSED_KERNELS", "1")
    assert not gpu_fused.wanted()
    assert gpu_fused.rotary_fits(128) and gpu_fused.rotary_fits(64) and not gpu_fused.rotary_fits(96)


def test_rows_need_dense_heads_only():
    on_cuda = lambda t: torch.Tensor._make_subclass(_OnCuda, t, False)
    cache = on_cuda(torch.zeros(2, 8, 2, 4))
    wide = torch.zeros(1, 3, 5, 4)
    if not gpu_fused.wanted():
        pytest.skip("the fused kernels are turned off")
    assert gpu_fused.cache_write_fits(cache, on_cuda(wide[:, :, 1:3]))  # strided tokens, dense heads
    assert not gpu_fused.cache_write_fits(cache, on_cuda(wide[:, :, 1:3].transpose(2, 3)))  # heads not dense
    assert not gpu_fused.cache_write_fits(cache, on_cuda(wide[:, :, :3]))  # three heads for a cache of two
    assert not gpu_fused.applies(on_cuda(wide[:, :, 1:3]))  # without rows=: contiguous only


@pytest.mark.gpu
def test_bfloat16_on_cuda_rounds_like_torch(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    dev = "cuda"
    fused = {}
    for with_norm in (False, True):
        x, weight, cos, sin = _rope_inputs(2, 5, 32, 128, torch.bfloat16, dev)
        assert gpu_fused.applies(x, weight, cos, sin)
        fused[with_norm] = gpu_fused.norm_rotary(x, weight if with_norm else None, 1e-6, cos, sin), (x, weight, cos, sin)
    y, weights = _combine_inputs(16, 8, 2048, torch.bfloat16, dev)
    x = torch.randn(7, 4096, device=dev, dtype=torch.bfloat16) * 4
    norm_weight = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    fused_sum, fused_norm = gpu_fused.weighted_sum(y, weights), gpu_fused.rms_norm(x, norm_weight, 1e-5)
    scaled_norms = {rule: gpu_fused.rms_norm(x, norm_weight, 1e-5, *rule) for rule in ((True, False), (False, True))}
    keys = torch.randint(0, 60, (512,), device=dev)
    tally = torch.zeros(2, 64, dtype=torch.int64, device=dev)
    arranged = gpu_fused.group_pairs(keys, 64, 8, tally)
    listed = torch.bincount(keys, minlength=64).nonzero().view(-1).tolist()
    assert arranged[3].tolist() == listed + [-1] * (64 - len(listed))  # 60 of the 64 groups at most
    for got, want in zip(arranged, _expected_arrangement(keys, 64, 8)):
        assert torch.equal(got, want)
    assert torch.equal(tally[0], torch.bincount(keys, minlength=64))
    routes = []
    for n, e, k, renormalise, ties in ((1, 128, 8, True, False), (512, 128, 8, True, True), (16, 8, 2, True, True),
                                       (64, 64, 8, False, False), (3, 256, 8, True, True)):
        logits = _router_logits(n, e, torch.bfloat16, dev, seed=n + e, ties=ties)
        routes.append(((logits, k, renormalise), gpu_fused.route(logits, k, renormalise, torch.bfloat16)))
    top_k_routes = []
    for n, e, k, ties in ((1, 32, 4, False), (64, 32, 4, True), (3, 128, 4, False), (16, 128, 4, True)):
        logits = _router_logits(n, e, torch.bfloat16, dev, seed=n + e + 1, ties=ties)
        top_k_routes.append((logits, k, top_k_softmax(logits, k)))  # the fused kernel while it is on

    monkeypatch.setenv("MOEDESK_NO_FUSED_KERNELS", "1")  # engine.model.transformer's torch chains from here
    got, (rx, rw, rcos, rsin) = fused[False]
    assert torch.equal(got, apply_rope(rx, rcos, rsin))  # elementwise chains: the same bits
    assert torch.equal(fused_sum, MoE.combine(y, weights))
    for args, (fused_weights, fused_ids) in routes:
        torch_weights, torch_ids = top_k_route(*args, torch.bfloat16)
        assert torch.equal(fused_ids, torch_ids)  # the same experts, ties included
        # Both exps are within an ulp of float32, below a 16-bit weight's rounding step, almost always.
        assert (fused_weights != torch_weights).float().mean() < 0.01
        torch.testing.assert_close(fused_weights, torch_weights, rtol=2 ** -7, atol=2 ** -9)
    for logits, k, (fused_weights, fused_ids) in top_k_routes:
        torch_weights, torch_ids = top_k_softmax(logits, k)
        assert torch.equal(fused_ids, torch_ids)
        assert fused_weights.dtype == torch.bfloat16 and (fused_weights != torch_weights).float().mean() < 0.01
        torch.testing.assert_close(fused_weights, torch_weights, rtol=2 ** -7, atol=2 ** -9)
    for rule, fused_scaled in scaled_norms.items():
        torch_scaled = rms_norm(x, norm_weight, 1e-5, *rule)
        assert (fused_scaled != torch_scaled).float().mean() < 0.01
        torch.testing.assert_close(fused_scaled, torch_scaled, rtol=2 ** -7, atol=2 ** -7)
    # A norm's summation order may move a value across a rounding boundary, rarely.
    got, (rx, rw, rcos, rsin) = fused[True]
    for a, b in ((got, apply_rope(rms_norm(rx, rw, 1e-6), rcos, rsin)), (fused_norm, rms_norm(x, norm_weight, 1e-5))):
        assert (a != b).float().mean() < 0.01
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=2 ** -7)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: `applies`'s other rules checked without a GPU."""

    @property
    def is_cuda(self):
        return True


def test_fused_kernels_step_aside_when_a_gradient_is_wanted():
    """The kernels have no backward: training a draft head on the GPU (its norms) must go through torch, or the
    norm's weight and everything before it get no gradient (a head trained that way lost them silently)."""
    x = torch.Tensor._make_subclass(_OnCuda, torch.ones(2, 8), True)  # requires grad
    w = torch.Tensor._make_subclass(_OnCuda, torch.ones(8), False)
    if not gpu_fused.wanted():
        pytest.skip("the fused kernels are turned off")
    assert not gpu_fused.applies(x, w)
    with torch.no_grad():
        assert gpu_fused.applies(x, w)  # decoding: no gradient, the kernel
    assert gpu_fused.applies(x.detach(), w)


@pytest.mark.gpu
def test_norm_trains_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from moedesk.engine.model.norm import RMSNorm

    norm = RMSNorm(64, 1e-6).cuda()
    x = torch.randn(3, 64, device="cuda", requires_grad=True)
    norm(x).pow(2).sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    assert x.grad is not None and x.grad.abs().sum() > 0
