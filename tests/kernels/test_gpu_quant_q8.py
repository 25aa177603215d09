"""kernels.gpu_quant's integer route: x rounded to 8 bits per block of 32 (quantize_rows), q4_0, q8_0, k-quant and
mxfp4 weights read a word of four bytes at a time and multiplied into four int8 x at once.

The route computes W @ (d * q) for x's rounding (d * q), so against a float64 product with that rounded x it errs
only by float32 summation order (1e-4 of the output's scale in the interpreter, where x and the output are float32).
Against the exact x it errs by the rounding: each x within max|x| / 254 of its block, the dot products within about
half a percent of their size, so the bf16 bound below (Q8_TOLERANCE) is looser than the float paths' norm-wise.
"""
import warnings

import pytest
import torch

from moedesk.kernels.quant_formats import dequantize
from tests.kernels.test_gpu_quant_kernel import Q8_TOLERANCE, assert_close, ends_of, interpreted, random_experts
from tests.kernels.test_gpu_quant_kernel import random_stack
from tests.kernels.test_gpu_quant_kernel import reference as experts_reference

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")
from moedesk.kernels import gpu_quant  # noqa: E402

def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as quantize_rows rounds it, computed here in torch: d * round-half-up(x / d), d = max|x| / 127 a block."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.floor(blocks * inv + 0.5).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(x.shape)


def linear_reference(x, stack, k, fmt="q4_k"):
    """x [M, k] times the packed matrix stack [1, R, bytes] in float64."""
    return x.double() @ dequantize(stack[0], fmt, k).double().T


@interpreted
def test_quantize_rows_rounds_each_block_of_32():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)) * torch.tensor([1.0, 20.0, 0.01])[:, None]
    x[1, 32:64] = 0.0  # a block of zeros: scale 0, no division by it
    q, d, sums = gpu_quant.quantize_rows(x)
    assert q.dtype == torch.int8 and d.shape == sums.shape == (3, 3)
    assert (q.abs().reshape(3, 3, 32).amax(-1)[d > 0] == 127).all()  # each block's largest |x| maps to 127
    assert torch.equal(d[1, 1], torch.tensor(0.0)) and not q[1, 32:64].any()
    assert torch.equal((q.float().reshape(3, 3, 32) * d[..., None]).reshape(3, 96), rounded(x))
    torch.testing.assert_close(sums, q.float().reshape(3, 3, 32).sum(-1) * d)


@interpreted
@pytest.mark.parametrize("fmt,m,k,rows", [("q4_k", 1, 256, 96), ("q4_k", 2, 256, 40), ("q4_k", 3, 512, 70),
                                          ("q4_k", 8, 768, 64), ("q4_0", 1, 96, 50), ("q4_0", 3, 160, 33),
                                          ("q8_0", 2, 96, 50), ("q8_0", 4, 224, 40), ("q5_k", 1, 256, 48),
                                          ("q5_k", 4, 512, 33), ("q6_k", 1, 256, 48), ("q6_k", 3, 768, 37),
                                          ("mxfp4", 1, 96, 50), ("mxfp4", 4, 160, 33)])
def test_integer_route_is_the_product_with_rounded_x(fmt, m, k, rows, monkeypatch):
    """One matrix, float32 x and output so that only the summation order differs: 1 to 8 tokens (BT 1, 2, 4 and 4
    twice), rows not a multiple of the tile, several units a step and a partial one; q4_0's, q8_0's and q6_k's
    blocks of 18, 34 and 210 bytes, every other one 2 bytes off a word; q5_k's fifth bits, q6_k's less 32; mxfp4's
    17-byte blocks at every offset, its codes' signs and magnitudes (random bytes hold all 16)."""
    monkeypatch.setattr(gpu_quant, "_Q8_MXFP4", True)  # on unless MOEDESK_Q8_MXFP4=0
    stack = random_stack(1, rows, k, fmt, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    out = torch.empty(m, rows)
    assert gpu_quant._q8_route(x, stack, fmt, torch.bfloat16)
    gpu_quant._launch_q8(x, stack, fmt, ends_of([m]), out, rows=rows, k=k, gated=False, m=m, groups=1, bias=None,
                         glu=None, config=None)
    assert_close(out, linear_reference(rounded(x), stack, k, fmt), 1e-4, 1e-5)
    exact = linear_reference(x, stack, k, fmt)
    assert (out.double() - exact).norm() > 1e-4 * exact.norm()  # the rounding is there: not the float path


@interpreted
def test_gpt_oss_experts_on_the_integer_route(monkeypatch):
    """mxfp4 experts with gpt-oss's biases and clamped SwiGLU at a limit that clips, a few rows each, through the
    grouped call: both projections on the integer route, within its bound of the float64 reference."""
    from tests.kernels.test_gpu_quant_kernel import gpt_oss_function

    calls = []
    launch = gpu_quant._launch_q8
    monkeypatch.setattr(gpu_quant, "_launch_q8", lambda *a, **kw: calls.append(kw["gated"]) or launch(*a, **kw))
    monkeypatch.setattr(gpu_quant, "_Q8_MXFP4", True)
    sizes = [1, 0, 2, 1]
    w = gpt_oss_function(random_experts(len(sizes), 96, 160, "mxfp4", seed=41), limit=0.75, dtype=torch.float16,
                         seed=42)
    x = torch.randn(sum(sizes), 96, generator=torch.Generator().manual_seed(43)).to(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = gpu_quant.grouped_experts_forward(x, w, ends_of(sizes))
    assert calls == [True, False]
    assert_close(got, experts_reference(x, w, sizes), *Q8_TOLERANCE)


@interpreted
def test_integer_route_adds_the_bias_in_float32():
    stack = random_stack(1, 80, 256, "q4_k", seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 256, generator=g)
    bias = torch.randn(1, 80, generator=g)
    out = torch.empty(2, 80)
    gpu_quant._launch_q8(x, stack, "q4_k", ends_of([2]), out, rows=80, k=256, gated=False, m=2, groups=1, bias=bias,
                         glu=None, config=None)
    assert_close(out, linear_reference(rounded(x), stack, 256) + bias.double(), 1e-4, 1e-5)


@interpreted
def test_grouped_experts_take_the_integer_route_for_few_rows_of_16_bit_x(monkeypatch):
    calls = []
    launch = gpu_quant._launch_q8
    monkeypatch.setattr(gpu_quant, "_launch_q8", lambda *a, **kw: calls.append(kw["gated"]) or launch(*a, **kw))
    sizes = [1, 0, 3, 2]
    w = random_experts(4, 256, 256, "q4_k", seed=21)
    x = torch.randn(sum(sizes), 256, generator=torch.Generator().manual_seed(22)).to(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = gpu_quant.grouped_experts_forward(x, w, ends_of(sizes))
    assert calls == [True, False]  # both projections
    assert got.dtype == torch.float16
    assert_close(got, experts_reference(x, w, sizes), *Q8_TOLERANCE)
    calls.clear()
    monkeypatch.setattr(gpu_quant, "_Q8_WANTED", False)
    gpu_quant.grouped_experts_forward(x, w, ends_of(sizes))
    assert not calls



class _GridsOf:
    """A kernel whose launches' grids are recorded."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@interpreted
@pytest.mark.parametrize("kernel,dtype", [("_q8_mm", torch.float16), ("_packed_mm", torch.float32)])
def test_a_launch_over_the_active_groups_alone_computes_the_same(monkeypatch, kernel, dtype):
    """A decode step's launch with programs for the groups that have rows only (kernels.gpu_fused.group_pairs's
    list): the same result as programs for every group, from fewer programs. float32 x takes the float path."""
    grids = []
    monkeypatch.setattr(gpu_quant, kernel, _GridsOf(getattr(gpu_quant, kernel), grids))
    sizes = [1, 0, 3, 2, 0, 0]
    w = random_experts(len(sizes), 256, 256, "q4_k", seed=23)
    x = torch.randn(sum(sizes), 256, generator=torch.Generator().manual_seed(24)).to(dtype)
    active = torch.tensor([0, 2, 3, -1, -1, -1], dtype=torch.int32)  # min(pairs, groups) places
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        every = gpu_quant.grouped_experts_forward(x, w, ends_of(sizes))
        listed = gpu_quant.grouped_experts_forward(x, w, ends_of(sizes), active=active)
    assert torch.equal(listed, every)
    assert [grid[1] for grid in grids] == [6, 6, 6, 6]  # both projections, each way
    grids.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gpu_quant.grouped_experts_forward(x[:1], w, ends_of([1, 0, 0, 0, 0, 0]), active=active[:1])
    assert [grid[1] for grid in grids] == [1, 1]


@interpreted
@pytest.mark.parametrize("dtype,tokens", [(torch.float16, 3), (torch.float16, 7), (torch.float32, 3)])
def test_gathered_and_scattered_rows_are_the_arranged_pairs_rows(monkeypatch, dtype, tokens):
    """A decode step's (token, expert) pairs arranged by expert: the integer route's kernels read each pair's token
    row and store its output at the pair's place themselves, and round each token's x once, not once a pair; the
    same result as gathering and scattering around the call. float32 x takes the float path, gathered outside."""
    grids = []
    monkeypatch.setattr(gpu_quant, "_q8_rows", _GridsOf(gpu_quant._q8_rows, grids))
    k, experts = 2, 4
    keys = torch.randint(0, experts, (tokens * k,), generator=torch.Generator().manual_seed(tokens))
    order = torch.argsort(keys, stable=True)
    ends = torch.bincount(keys, minlength=experts).cumsum(0).to(torch.int32)
    w = random_experts(experts, 256, 256, "q4_k", seed=25)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(26)).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        arranged = gpu_quant.grouped_experts_forward(x.index_select(0, order // k), w, ends)
        got = gpu_quant.grouped_experts_forward(x, w, ends, gather=order // k, scatter=order)
    assert torch.equal(got, torch.empty_like(arranged).index_copy_(0, order, arranged))
    if dtype == torch.float16:  # gathered, the gate_up launch rounds x's tokens; down the pairs' activations
        assert [grid[0] for grid in grids] == [tokens * k, tokens * k, tokens, tokens * k]


def test_one_group_ends_are_views_of_a_count_made_once():
    device = torch.device("cpu")
    gpu_quant._COUNTS.pop(device, None)
    first, again = gpu_quant._one_group_ends(3, device), gpu_quant._one_group_ends(70, device)
    assert first.tolist() == [3] and again.tolist() == [70] and first.dtype == torch.int32
    assert first.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()
    assert gpu_quant._one_group_ends(gpu_quant._COUNTED + 1, device).tolist() == [gpu_quant._COUNTED + 1]
    gpu_quant._COUNTS.pop(device)


@interpreted
def test_e2m1_codes_become_twice_their_values_split_by_sign():
    """Every code 0..15 in every byte of a word: the positive bytes minus the negative ones are twice E2M1's values
    (kernels.quant_formats' table), and no byte carries into the next."""
    import triton
    import triton.language as tl

    from moedesk.kernels.quant_formats import _FP4_TWICE

    @triton.jit
    def split(c_ptr, pos_ptr, neg_ptr):
        i = tl.arange(0, 16)
        pos, neg = gpu_quant._e2m1_bytes(tl.load(c_ptr + i))
        tl.store(pos_ptr + i, pos)
        tl.store(neg_ptr + i, neg)

    codes = torch.arange(16, dtype=torch.int32)
    words = codes | (codes.roll(5) << 8) | (codes.roll(11) << 16) | (codes.roll(3) << 24)  # each code in each byte
    pos, neg = torch.empty_like(words), torch.empty_like(words)
    split[(1,)](words, pos, neg)
    twice = torch.tensor(_FP4_TWICE)
    for byte, shift in enumerate((0, 5, 11, 3)):
        p, n = (pos >> (8 * byte)) & 0xFF, (neg >> (8 * byte)) & 0xFF
        assert torch.equal((p - n).float(), twice[codes.roll(shift)]), byte
        assert not (p.bool() & n.bool()).any()


@interpreted
def test_e2m1_codes_looked_up_as_signed_bytes():
    """`_e2m1_signed` (the interpreter's side of the prmt lookup): every code in every nibble of a word, the low
    nibbles' word and the high nibbles' as signed bytes equal to twice E2M1's values."""
    import triton
    import triton.language as tl

    from moedesk.kernels.quant_formats import _FP4_TWICE

    @triton.jit
    def look_up(w_ptr, lo_ptr, hi_ptr):
        i = tl.arange(0, 16)
        lo, hi = gpu_quant._e2m1_signed(tl.load(w_ptr + i), False)
        tl.store(lo_ptr + i, lo)
        tl.store(hi_ptr + i, hi)

    codes = torch.arange(16, dtype=torch.int32)
    shifts = (0, 9, 5, 14, 11, 2, 3, 7)  # nibble n of word i holds code (i - shift) mod 16
    words = sum(codes.roll(shift) << (4 * n) for n, shift in enumerate(shifts)).to(torch.int32)
    lo, hi = torch.empty_like(words), torch.empty_like(words)
    look_up[(1,)](words, lo, hi)
    twice = torch.tensor(_FP4_TWICE)
    for n, shift in enumerate(shifts):
        half = lo if n % 2 == 0 else hi
        byte = ((half >> (8 * (n // 2))) & 0xFF).to(torch.uint8).view(torch.int8)
        assert torch.equal(byte.float(), twice[codes.roll(shift)]), n


@interpreted
@pytest.mark.parametrize("m", [1, 3])
def test_mxfp4_looked_up_sums_as_the_split_ones(m, monkeypatch):
    """The integer route's mxfp4 read with its codes as signed bytes: the same integer sums, so the same bits out,
    as the read that splits them by sign (mxfp4's 17-byte blocks at every offset, random codes of both signs)."""
    monkeypatch.setattr(gpu_quant, "_Q8_MXFP4", True)
    stack = random_stack(1, 40, 160, "mxfp4", seed=m)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m + 50))
    outs = []
    for lookup in (False, True):
        monkeypatch.setattr(gpu_quant, "_MXFP4_LOOKUP", lookup)
        out = torch.empty(m, 40)
        gpu_quant._launch_q8(x, stack, "mxfp4", ends_of([m]), out, rows=40, k=160, gated=False, m=m, groups=1,
                             bias=None, glu=None, config=None)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[1], linear_reference(rounded(x), stack, 160, "mxfp4"), 1e-4, 1e-5)


def test_route_only_where_words_are_aligned(monkeypatch):
    stack = torch.zeros(2, 8, 144, dtype=torch.uint8)
    x = torch.zeros(4, 256)
    assert gpu_quant._q8_route(x, stack, "q4_k", torch.bfloat16)
    assert not gpu_quant._q8_route(x, stack, "q4_k", torch.float32)  # float32 layers stay exact
    monkeypatch.setattr(gpu_quant, "_Q8_MXFP4", False)  # MOEDESK_Q8_MXFP4=0: mxfp4 off the route
    odd_mxfp4 = torch.zeros(1 + 2 * 8 * 17, dtype=torch.uint8)[1:].view(2, 8, 17)
    assert not gpu_quant._q8_route(x, odd_mxfp4, "mxfp4", torch.bfloat16)
    monkeypatch.setattr(gpu_quant, "_Q8_MXFP4", True)
    assert gpu_quant._q8_route(x, odd_mxfp4, "mxfp4", torch.bfloat16)  # read a byte at a time: any alignment
    odd = torch.zeros(1 + 2 * 8 * 18, dtype=torch.uint8)[1:].view(2, 8, 18)
    assert not gpu_quant._q8_route(x, odd, "q4_0", torch.bfloat16)  # halves need 2-byte alignment
    assert gpu_quant._q8_route(x, torch.zeros(2, 8, 18, dtype=torch.uint8), "q4_0", torch.bfloat16)
    shifted = torch.zeros(4 + 2 * 8 * 144, dtype=torch.uint8)[4:].view(2, 8, 144)
    assert not gpu_quant._q8_route(x, shifted, "q4_k", torch.bfloat16)  # not 16-byte aligned


# ---------------------------------------------------------------- the GPU box: the dp4a assembly

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q4_0", "q8_0", "mxfp4"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 13])  # BT 1, 2 and 4; 13: four passes of 4, the last of one
def test_integer_route_on_cuda_is_the_product_with_rounded_x(fmt, m, monkeypatch):
    dev = _cuda()
    monkeypatch.setattr(gpu_quant, "_Q8_MXFP4", True)  # on unless MOEDESK_Q8_MXFP4=0
    k, rows = 4096, 6144
    stack = random_stack(1, rows, k, fmt, device=dev, seed=m)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    assert gpu_quant.takes_q8(x, stack, fmt, m, 1, linear=True)  # 13 rows: a matrix the float tiles leave idle SMs
    got = gpu_quant.packed_linear(x, stack[0], fmt)
    # Only the bf16 output's rounding (2^-9 of each element) and float32 order against the rounded x.
    assert_close(got, linear_reference(rounded(x), stack, k, fmt), 2 ** -8, 2 ** -8, 2 ** -8)
    assert_close(got, linear_reference(x, stack, k, fmt), *Q8_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
def test_mxfp4_looked_up_on_cuda_as_the_split_read(m, monkeypatch):
    """The prmt lookup of mxfp4's codes (kernels.gpu_quant._E2M1_LOOKUP): the split read's bits, a launch of gpt-oss's
    expert shape with 32 groups."""
    dev = _cuda()
    monkeypatch.setattr(gpu_quant, "_Q8_MXFP4", True)
    sizes = [m if g % 3 == 0 else 0 for g in range(32)]
    w = random_experts(32, 2880, 2880, "mxfp4", device=dev, seed=m)
    x = torch.randn(sum(sizes), 2880, device=dev).to(torch.bfloat16)
    outs = []
    for lookup in (False, True):
        monkeypatch.setattr(gpu_quant, "_MXFP4_LOOKUP", lookup)
        outs.append(gpu_quant.grouped_experts_forward(x, w, ends_of(sizes, dev)))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("formats", [("q4_k",), ("q4_k", "q6_k"), ("q5_k",), ("q4_0",), ("q8_0",)])
def test_mixtral_experts_on_cuda_one_and_four_rows(formats):
    dev = _cuda()
    for sizes in ([1, 0, 1, 1, 2, 1, 1, 1], [4, 4, 0, 4, 4, 4, 4, 4]):
        w = random_experts(len(sizes), 4096, 14336, *formats, device=dev, seed=31)
        x = torch.randn(sum(sizes), 4096, device=dev).to(torch.bfloat16)
        assert_close(gpu_quant.grouped_experts_forward(x, w, ends_of(sizes, dev)), experts_reference(x, w, sizes),
                     *Q8_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_qwen3_pairs_on_cuda_gathered_and_scattered_in_the_kernels(tokens):
    """The compiled gather and scatter (Qwen3's 128 experts, 8 a token): the same as around the call, bit for bit;
    and the prefill route (Hopper), which gathers and scatters around its GEMMs, given the same arguments."""
    dev = _cuda()
    k, experts = 8, 128
    keys = torch.stack([torch.randperm(experts, device=dev)[:k] for _ in range(tokens)]).view(-1)
    order = torch.argsort(keys, stable=True)
    ends = torch.bincount(keys, minlength=experts).cumsum(0).to(torch.int32)
    w = random_experts(experts, 2048, 768, "q4_k", "q6_k", device=dev, seed=33)
    x = torch.randn(tokens, 2048, device=dev).to(torch.bfloat16)
    for route in ("fused", "dequant") if gpu_quant._dequant_route_works(x) else ("fused",):
        arranged = gpu_quant.grouped_experts_forward(x.index_select(0, order // k), w, ends, route=route)
        got = gpu_quant.grouped_experts_forward(x, w, ends, route=route, gather=order // k, scatter=order)
        assert torch.equal(got, torch.empty_like(arranged).index_copy_(0, order, arranged)), route


def test_the_tiles_are_chosen_per_format_and_tokens_a_step(monkeypatch):
    """On the GPU (not the interpreter's one big tile): the sweep's fastest tile where it named one, else 2 x 16; the
    tokens a step rounded up to 1, 2 or 4."""
    monkeypatch.setattr(gpu_quant, "_interpreted", lambda: False)
    tile = lambda per_group, fmt: {k: gpu_quant._q8_config(per_group, fmt)[k] for k in ("ROWS", "NB", "BT")}  # noqa: E731
    assert tile(1, "q4_0") == tile(1, "q6_k") == tile(1, "q8_0") == dict(ROWS=1, NB=32, BT=1)
    assert tile(1, "q4_k") == tile(1, "q5_k") == dict(ROWS=2, NB=16, BT=1)
    assert tile(3, "q4_k") == tile(4, "q5_k") == dict(ROWS=1, NB=16, BT=4)
    assert tile(2, "q4_0") == tile(2, "q4_k") == dict(ROWS=2, NB=16, BT=2)
    assert tile(1, "mxfp4") == dict(ROWS=1, NB=32, BT=1) and tile(2, "mxfp4") == dict(ROWS=2, NB=32, BT=2)
    assert tile(4, "q4_0") == tile(9, "q8_0") == dict(ROWS=2, NB=16, BT=4)
    assert gpu_quant._q8_config(1, "q4_0")["num_warps"] == 1
