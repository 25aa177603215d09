"""kernels/cpu_quant: the native packed-experts kernel against dequantise-then-float64 matmul.

Two references, both float64 from `dequantize`d weights:
- `exact`: the experts as the formats define them. The kernel quantises x and the act rows to int8
  per 32 values (cpu_quant.c says why), which costs about 0.4% of each row's scale per
  quantisation (a step of max|v| / 127, uniform rounding error: max/127/sqrt(12) ~ 0.5-1% of the rms
  for Gaussian-like rows); two of them in series give ~1% of the output's norm. Tolerance: the
  output's error norm within 4% of the reference's norm (ERR_EXACT), measured up to 2% on these
  cases.
- `emulated`: the same with x and act quantised in float32 as the kernel does. What is left is the
  order of float32 sums and, rarely, an act value that rounds to the other int8 step (a change of
  ~1e-3 of that row's scale), so this is tight: max |error| within 1.5% of the output's rms
  (ERR_EMULATED). One such step, times a down column of mxfp4's heavy-tailed weights (largest 6 at an
  rms of 2.9) in a short row (F = 96), measured 1.1% on the AMX path. A wrong nibble, scale or lane
  anywhere shows as O(1) here.
The native tests skip only where the kernel cannot exist (no AVX2, no C compiler); a build failure
fails them.
"""
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moedesk.kernels import cpu_experts
from moedesk.kernels import cpu_quant as cq
from moedesk.kernels.expert_weights import ExpertWeights
from moedesk.kernels.quant_formats import dequantize, packed_format, quantize
from moedesk.kernels.native_build import find_compiler

ERR_EXACT = 0.04
ERR_EMULATED = 0.015
FORMATS = ["q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4"]
# where each format's float16 scales sit in its block, and a typical |q| * scale to size them by
_SCALES = {"q4_0": ([0], 8), "q8_0": ([0], 64), "q4_k": ([0, 2], 32 * 8), "q5_k": ([0, 2], 32 * 16),
           "q6_k": ([208], 32 * 32)}


def random_packed(fmt, E, R, K, g):
    """[E, R, row_bytes(K)] random blocks: random quants and 6-bit scales, float16 scales sized so that a
    row's dot with an O(1) vector is O(1) (mins smaller than scales, as a quantiser leaves them)."""
    f = packed_format(fmt)
    if fmt in ("q4_0", "q8_0"):  # through the quantiser: real blocks
        return quantize(torch.randn(E, R, K, generator=g) / K ** 0.5, fmt)
    b = torch.randint(0, 256, (E * R * K // f.block, f.block_bytes), generator=g, dtype=torch.uint8)
    if fmt == "mxfp4":  # exponents around the one that makes a row's dot O(1) (the codes' rms is 2.9), +-1
        base = round(127 - np.log2(2.9 * K ** 0.5))
        b[:, 0] = torch.randint(base - 1, base + 2, (b.shape[0],), generator=g, dtype=torch.uint8)
        return b.view(E, R, f.row_bytes(K))
    at, typical = _SCALES[fmt]
    for i, a in enumerate(at):
        d = (torch.rand(b.shape[0], generator=g) + 0.5) / typical / K ** 0.5 * (0.2 if i else 1.0)
        b[:, a:a + 2] = d.half().view(torch.uint8).view(-1, 2)
    return b.view(E, R, f.row_bytes(K))


def make_case(fu, fd, H, F_, E, tokens, k, g, dtype=torch.float32):
    w = ExpertWeights(random_packed(fu, E, 2 * F_, H, g), random_packed(fd, E, H, F_, g), H, F_, fu, fd)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    pair_expert = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).flatten()
    return w, x, pair_expert


def q8_emulated(v: torch.Tensor) -> torch.Tensor:
    """v [..., K] quantised per 32 and back, in float32 exactly as cpu_quant.c's quantize_block."""
    b = v.float().reshape(*v.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv).clamp(-127, 127)  # torch.round: ties to even, as cvtps2dq
    return (q.double() * d.double()).reshape(v.shape)


def reference(x, pair_expert, k, chosen, dense, out, emulate):
    """out (float64) with each chosen pair's row computed from the `dequantize`d weights `dense`
    (ExpertWeights.dense), one expert at a time."""
    gu, dn = dense
    ref = out.double().clone()
    xs = q8_emulated(x) if emulate else x.double()
    experts_of = pair_expert.numpy()
    for e in np.unique(experts_of).tolist():
        if chosen is not None and e not in chosen:
            continue
        pairs = torch.from_numpy(np.flatnonzero(experts_of == e))
        gate, up = (xs[pairs // k] @ gu[e].T).chunk(2, dim=-1)
        act = F.silu(gate) * up
        if emulate:
            act = q8_emulated(act.float())
        ref[pairs] = act @ dn[e].T
    return ref


def cut(dense, F_, lo, hi):
    """dense (gate_up [E, 2F, H], down [E, H, F]) cut to intermediate rows [lo, hi): gate and up rows, down
    columns; the expert a call with rows computes is cut(..., 0, rows)."""
    gu, dn = dense
    return torch.cat([gu[:, lo:hi], gu[:, F_ + lo:F_ + hi]], dim=1), dn[:, :, lo:hi]


def check(out, x, pair_expert, k, chosen, w, before, f_rows=None):
    """out against both references; f_rows: the call computed intermediate rows [0, f_rows) only."""
    rows = [p for p, e in enumerate(pair_expert.tolist()) if chosen is None or e in chosen]
    dense = w.dense(torch.float64)
    if f_rows is not None:
        dense = cut(dense, w.width, 0, f_rows)
    exact = reference(x, pair_expert, k, chosen, dense, before, emulate=False)[rows]
    emulated = reference(x, pair_expert, k, chosen, dense, before, emulate=True)[rows]
    got = out.double()[rows]
    rounding = 2 ** -7 if out.dtype == torch.bfloat16 else 0.0  # bf16 output: half an ulp of 2^-8 relative
    err_exact = float((got - exact).norm() / exact.norm())
    err_emulated = float((got - emulated).abs().max() / emulated.pow(2).mean().sqrt())
    assert err_exact < ERR_EXACT + rounding, err_exact
    assert err_emulated < ERR_EMULATED + 4 * rounding, err_emulated
    untouched = [p for p in range(out.shape[0]) if p not in rows]
    assert torch.equal(out[untouched], before[untouched])  # rows outside the computed pairs stay as they were


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MOEDESK_NO_NATIVE_KERNELS", raising=False)
        mp.delenv("MOEDESK_QUANT_PATH", raising=False)
        mp.setenv("MOEDESK_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        if cq.cpu_reason() is not None:
            pytest.skip(f"the packed kernel needs AVX2: {cq.cpu_reason()}")
        if find_compiler() is None:
            pytest.skip("no C compiler (cc, gcc, clang or $CC) to build the native kernel")
        cq._state.clear()
        assert cq.available(), cq.unavailable_reason()  # a failed build fails the tests, never skips them
        yield
        cq.set_path(None)


@pytest.fixture(scope="module")
def maddubs_build(built):
    """The library with the AVX2 path's maddubs dot products, where the default one takes them in AVX-VNNI (so
    both run here); None where the CPU lacks AVX-VNNI and the default build is that library."""
    return cq.build_variant(["-UMQ_AVXVNNI"]) if cq.lane_vnni() else None


@pytest.fixture(params=["vnni", "avx2", "avx2-maddubs", "amx"])
def path(request, built, maddubs_build):
    """Each test on every dot-product path the CPU has: VNNI, AVX2 (with AVX-VNNI where the CPU has it, and
    without: avx2-maddubs), and AMX (experts with 8+ tokens on AMX-INT8 tiles, the rest on VNNI;
    tests/kernels/test_cpu_quant_amx.py runs the same checks on an emulated build)."""
    if request.param == "vnni" and not cq.vnni_supported():
        pytest.skip("this CPU lacks AVX512-VNNI")
    if request.param == "amx" and not cq.amx_supported():
        pytest.skip("this CPU or OS lacks AMX-INT8")
    if request.param == "avx2-maddubs":
        if maddubs_build is None:
            pytest.skip("no AVX-VNNI here: the avx2 cases run the maddubs build")
        before = cq.use_library(maddubs_build)
        assert cq.set_path("avx2") == "avx2" and not cq.lane_vnni()
        yield "avx2"
        cq._state["lib"] = before  # directly: a test may have turned the kernels off by now (MOEDESK_NO_NATIVE_KERNELS)
        return
    assert cq.set_path(request.param) == request.param
    yield request.param


# (gate_up format, down format, H, F): H and F whole blocks but not multiples of 64 where the format
# allows (96 = 3 blocks of 32), and k-quant rows of 1 and 3 super-blocks. The VNNI path computes whole
# 256-weight segments in a layout of their own and the rest of a q4_0 row (K % 256) in order: 288 and
# 800 are segments and half a 64-weight chunk after them, 320 and 544 segments and a whole chunk or block.
SHAPES = [(f, f, 96, 160) if f in ("q4_0", "q8_0", "mxfp4") else (f, f, 256, 768) for f in FORMATS] + [
    ("mxfp4", "mxfp4", 288, 544), ("mxfp4", "q4_0", 320, 800), ("q4_k", "mxfp4", 256, 96),
    ("q4_k", "q6_k", 512, 256), ("q8_0", "q4_0", 64, 32), ("q5_k", "q8_0", 256, 288),
    ("q4_0", "q4_0", 288, 544), ("q8_0", "q4_0", 320, 800)]


@pytest.mark.parametrize("fu,fd,H,F_", SHAPES)
@pytest.mark.parametrize("tokens_per_expert", [1, 3, 17, 33])
def test_against_float64(path, fu, fd, H, F_, tokens_per_expert):
    """Every format and a few mixed pairs, 1..33 tokens on each expert, several experts per call, in float32."""
    # a seed that does not depend on PYTHONHASHSEED (hash() of strings does): a failure reproduces
    g = torch.Generator().manual_seed(zlib.crc32(repr((fu, fd, tokens_per_expert)).encode()))
    E, k = 5, 3
    tokens = max(1, tokens_per_expert * E // k)  # about tokens_per_expert pairs per expert
    w, x, pe = make_case(fu, fd, H, F_, E, tokens, k, g)
    if tokens_per_expert == 1:
        pe = torch.tensor([0, 2, 4])  # exactly one pair on each of three experts
    out = torch.randn(pe.numel() + 2, H, generator=g)
    before = out.clone()
    cq.experts_forward_routed(x, pe, k, None, w, out)
    check(out, x, pe, k, None, w, before)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k", "q6_k"])
def test_bf16_and_chosen_subset(path, fmt):
    """bf16 x and out; only the chosen experts' pairs are written."""
    g = torch.Generator().manual_seed(7)
    H, F_ = (96, 64) if fmt == "q4_0" else (256, 256)
    w, x, pe = make_case(fmt, fmt, H, F_, 6, 9, 2, g, dtype=torch.bfloat16)
    chosen = [1, 4, 5]
    out = torch.randn(pe.numel() + 1, H, generator=g).to(torch.bfloat16)
    before = out.clone()
    cq.experts_forward_routed(x, pe, 2, chosen, w, out)
    check(out, x, pe, 2, chosen, w, before)
    # float32 x into a bf16 out and bf16 x into a float32 out
    for xd, od in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        out = torch.zeros(pe.numel(), H, dtype=od)
        cq.experts_forward_routed(x.to(xd), pe, 2, None, w, out)
        check(out, x.to(xd), pe, 2, None, w, torch.zeros_like(out))


# bytes of each format's block that hold quants (high bits included), and the byte that makes every weight its
# format's largest in magnitude (q8_0: -128)
_QUANT_BYTES = {"q4_0": (slice(2, 18), 255), "q4_k": (slice(16, 144), 255), "q5_k": (slice(16, 176), 255),
                "q6_k": (slice(0, 192), 255), "q8_0": (slice(2, 34), 128),
                "mxfp4": (slice(1, 17), 0x77)}  # mxfp4: +6, 24 as the dot products' unsigned bytes


@pytest.mark.parametrize("fmt", sorted(_QUANT_BYTES))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_weights_against_a_constant_x(path, fmt, sign):
    """Every weight its format's largest (15; 31 for q5_k, 63 for q6_k, -128 for q8_0) and x constant, so every
    quantised x is +-127: the largest products the integer sums take (the AVX2 path adds runs of chunks' products
    in 16 bits)."""
    g = torch.Generator().manual_seed(5)
    H, F_ = (544, 256) if fmt in ("q4_0", "q8_0", "mxfp4") else (512, 256)  # whole segments and a block after them
    w, _, _ = make_case(fmt, fmt, H, F_, 2, 1, 1, g)
    f = packed_format(fmt)
    for stack in (w.gate_up, w.down):
        where, byte = _QUANT_BYTES[fmt]
        stack.view(-1, f.block_bytes)[:, where] = byte
    n = 3
    x = torch.full((n, H), sign)
    pe = torch.ones(n, dtype=torch.long)
    out = torch.zeros(n, H)
    cq.experts_forward_routed(x, pe, 1, None, w, out)
    check(out, x, pe, 1, None, w, torch.zeros(n, H))


def test_paths_agree_and_env_var(path, monkeypatch):
    """The two paths give the same results up to float32 sums; MOEDESK_QUANT_PATH=avx2 picks the fallback."""
    g = torch.Generator().manual_seed(3)
    w, x, pe = make_case("q8_0", "q4_k", 256, 256, 4, 5, 2, g)
    results = {}
    for p in (["vnni", "avx2"] if cq.vnni_supported() else ["avx2"]):  # 5 tokens: AMX would not take them
        cq.set_path(p)
        results[p] = cq.experts_forward_routed(x, pe, 2, None, w, torch.zeros(pe.numel(), 256))
    if len(results) == 2:
        assert torch.allclose(results["vnni"], results["avx2"], rtol=1e-4, atol=1e-4 * float(results["avx2"].abs().max()))
    monkeypatch.setenv("MOEDESK_QUANT_PATH", "avx2")
    assert cq._wanted_path(cq._state["lib"]) == 0
    monkeypatch.setenv("MOEDESK_QUANT_PATH", "amx")  # the library falls back to VNNI where AMX is missing
    assert cq._wanted_path(cq._state["lib"]) == 2
    assert cq._state["lib"].mq_set_path(2) == (2 if cq.amx_supported() else 1 if cq.vnni_supported() else 0)
    monkeypatch.setenv("MOEDESK_QUANT_PATH", "bogus")
    with pytest.raises(ValueError):
        cq._wanted_path(cq._state["lib"])
    with pytest.raises(ValueError):
        cq.set_path("sse")
    cq.set_path(path)


def test_bad_indices(path):
    g = torch.Generator().manual_seed(1)
    w, x, pe = make_case("q4_0", "q4_0", 64, 64, 3, 2, 2, g)
    out = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="outside the expert stack"):
        cq.experts_forward_routed(x, torch.tensor([0, 3, 1, 1]), 2, None, w, out)
    with pytest.raises(ValueError, match="outside the expert stack"):
        cq.experts_forward_routed(x, torch.tensor([0, -1, 1, 1]), 2, None, w, out)
    with pytest.raises(ValueError, match="outside the expert stack"):
        cq.experts_forward_routed(x, pe, 2, [0, 7], w, out)
    with pytest.raises(ValueError, match="tokens"):
        cq.experts_forward_routed(x, torch.zeros(5, dtype=torch.long), 2, None, w, torch.zeros(6, 64))
    with pytest.raises(ValueError, match="rows of out"):
        cq.experts_forward_routed(x, pe, 2, None, w, torch.zeros(3, 64))
    assert torch.equal(out, torch.zeros(4, 64))  # nothing written by a refused call


def test_applies_and_dispatch(path, monkeypatch):
    """applies() for packed CPU stacks of supported formats; kernels.experts routes through it."""
    from moedesk.kernels import experts
    g = torch.Generator().manual_seed(2)
    w, x, pe = make_case("q6_k", "q6_k", 256, 256, 3, 2, 2, g)
    assert cq.applies(x, w) and cq.applies(x.bfloat16(), w)
    assert not cq.applies(x.half(), w)
    dense = ExpertWeights(torch.zeros(3, 8, 4), torch.zeros(3, 4, 4), 4, 4)
    assert not cq.applies(x, dense)
    out = experts.experts_forward_routed(x, pe, 2, None, w, torch.zeros(pe.numel(), 256))
    check(out, x, pe, 2, None, w, torch.zeros(pe.numel(), 256))
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")
    assert not cq.applies(x, w)


@pytest.mark.parametrize("fu,fd,H,F_", [("q4_0", "q8_0", 96, 160), ("q4_k", "q6_k", 256, 256), ("q5_k", "q4_0", 256, 96),
                                         ("q4_0", "q4_0", 544, 288)])
def test_every_token_count(path, fu, fd, H, F_):
    """One expert with n = 1..20 tokens: every register tile shape of the kernel (4 rows x 1-4 tokens,
    2 x 5-8, 1 x 9-16, and a 16-token tile with a remainder)."""
    g = torch.Generator().manual_seed(11)
    w, _, _ = make_case(fu, fd, H, F_, 2, 1, 1, g)
    for n in range(1, 21):
        x = torch.randn(n, H, generator=g)
        pe = torch.ones(n, dtype=torch.long)
        out = torch.zeros(n, H)
        cq.experts_forward_routed(x, pe, 1, None, w, out)
        check(out, x, pe, 1, None, w, torch.zeros(n, H))


@pytest.mark.parametrize("threads", [3, 16])
def test_result_does_not_depend_on_thread_count(path, threads):
    """Items, the last round's quarters and the phase-0 rows change hands with the thread count; each output is one
    thread's sums whoever computes it, so the results are equal bit for bit. H = 256 makes the phase-2 blocks short:
    with 16 threads quarters of one 4-row tile, with 3 a last block of 4 rows whose quarters are one tile and three
    empty ones."""
    g = torch.Generator().manual_seed(12)
    w, x, pe = make_case("q4_k", "q4_0", 256, 544, 4, 6, 2, g)
    before = cpu_experts.get_num_threads()
    try:
        results = []
        for n in (1, threads):
            cq.set_num_threads(n)
            out = torch.zeros(x.shape[0] * 2, 256)
            cq.experts_forward_routed(x, pe, 2, None, w, out)
            results.append(out)
    finally:
        cq.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    check(results[1], x, pe, 2, None, w, torch.zeros(x.shape[0] * 2, 256))


def test_the_busiest_experts_handed_out_first_give_the_same_bits(path):
    """Groups are handed out by descending tokens (BUSIEST_FIRST), not in expert order: a skewed call (1 to 20 tokens
    an expert, the busiest neither first nor last, some past AMX_MIN) equals the expert-order build bit for bit, and
    so does the build that hands out the busiest and the idlest in turns (BUSIEST_FIRST=2)."""
    g = torch.Generator().manual_seed(13)
    w, _, _ = make_case("q4_k", "q6_k", 512, 256, 6, 1, 1, g)
    loads = [2, 20, 1, 9, 3, 12]  # tokens of experts 0..5
    pe = torch.tensor([e for e, n in enumerate(loads) for _ in range(n)])[torch.randperm(sum(loads), generator=g)]
    x = torch.randn(pe.numel(), 512, generator=g)
    results = []
    for lib in (None, cq.build_variant(["-DBUSIEST_FIRST=0"]), cq.build_variant(["-DBUSIEST_FIRST=2"])):
        before = cq.use_library(lib) if lib is not None else None
        try:
            if lib is not None:
                assert cq.set_path(path) == path
            out = torch.zeros(pe.numel(), 512)
            cq.experts_forward_routed(x, pe, 1, None, w, out)
            results.append(out)
        finally:
            if lib is not None:
                cq._state["lib"] = before
                cq.set_path(path)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    check(results[0], x, pe, 1, None, w, torch.zeros(pe.numel(), 512))


def test_a_callers_index_scratch_is_used_and_too_small_ones_are_not(path):
    """The decode path hands every call the same index buffer (no allocation per layer and token)."""
    g = torch.Generator().manual_seed(9)
    w, x, pe = make_case("q4_0", "q4_0", 96, 64, 6, 5, 2, g)
    need = 2 * pe.numel() + 2 * w.num_experts + 1
    index = torch.full((need + 3,), -7, dtype=torch.int64)
    out = torch.zeros(pe.numel(), 96)
    cq.experts_forward_routed(x, pe, 2, None, w, out, index)
    assert (index[:need] != -7).any() and (index[need:] == -7).all()
    check(out, x, pe, 2, None, w, torch.zeros_like(out))
    small = torch.full((need - 1,), -7, dtype=torch.int64)
    again = torch.zeros_like(out)
    cq.experts_forward_routed(x, pe, 2, None, w, again, small)
    assert (small == -7).all() and torch.equal(again, out)


# (gate_up format, down format, H, F) for calls with `rows` (the GPU computes the tail rows at one token): every
# down format, F of several blocks so that one block, a middle multiple and F can be asked for
ROWS_SHAPES = [("q4_0", "q4_0", 96, 160), ("q8_0", "q8_0", 64, 288), ("q4_k", "q4_k", 256, 768),
               ("q5_k", "q5_k", 256, 768), ("q6_k", "q6_k", 256, 768), ("q4_k", "q4_0", 256, 544)]


def rows_choices(fd, F_):
    """One down block (at least 32), a middle multiple of it, and F."""
    step = max(32, packed_format(fd).block)
    return [step, (F_ // step // 2) * step, F_]


def poison_tail(w, R):
    """w with NaN scales in every block of intermediate rows [R, F): gate and up rows, down blocks past R (a call
    with rows = R must not read them: NaN would reach its results)."""
    gu, dn = w.gate_up.clone(), w.down.clone()
    F_, fu, fd = w.width, packed_format(w.gate_up_format), packed_format(w.down_format)
    for t, f, view in ((gu, fu, gu.view(gu.shape[0], 2, F_, -1, fu.block_bytes)[:, :, R:]),
                       (dn, fd, dn.view(dn.shape[0], dn.shape[1], -1, fd.block_bytes)[:, :, R // fd.block:])):
        for a in _SCALES[f.name][0]:
            view[..., a:a + 2] = 0xFF  # float16 0xffff: NaN
    return ExpertWeights(gu, dn, w.hidden, F_, w.gate_up_format, w.down_format)


@pytest.mark.parametrize("fu,fd,H,F_", ROWS_SHAPES)
@pytest.mark.parametrize("tokens_per_expert", [1, 3, 17])
def test_rows_computes_the_head_of_each_expert(path, fu, fd, H, F_, tokens_per_expert):
    """rows = R: the experts cut to intermediate rows [0, R) (gate / up rows, down columns), against both
    float64 references on the cut experts; R = F is the call without rows, bit for bit; the head plus the rest
    [R, F) computed in float64 is the whole expert."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(("rows", fu, fd, tokens_per_expert)).encode()))
    E, k = 3, 2
    tokens = max(1, tokens_per_expert * E // k)
    w, x, pe = make_case(fu, fd, H, F_, E, tokens, k, g)
    if tokens_per_expert == 1:
        pe = torch.tensor([0, 2])
    before = torch.randn(pe.numel() + 1, H, generator=g)
    whole = cq.experts_forward_routed(x, pe, k, None, w, before.clone())
    dense = w.dense(torch.float64)
    for R in rows_choices(fd, F_):
        out = cq.experts_forward_routed(x, pe, k, None, w, before.clone(), rows=R)
        check(out, x, pe, k, None, w, before, f_rows=R)
        if R < F_:  # nothing of rows [R, F) is used
            assert torch.equal(cq.experts_forward_routed(x, pe, k, None, poison_tail(w, R), before.clone(), rows=R),
                               out)
        if R == F_:
            assert torch.equal(out, whole)
            continue
        tail = reference(x, pe, k, None, cut(dense, F_, R, F_), torch.zeros_like(before), emulate=False)
        exact = reference(x, pe, k, None, dense, torch.zeros_like(before), emulate=False)
        n = pe.numel()
        err = float((out.double()[:n] + tail[:n] - exact[:n]).norm() / exact[:n].norm())
        assert err < ERR_EXACT, err


def test_rows_bf16_and_dispatch(path, monkeypatch):
    """rows through kernels.experts (the kernel, and the dequantising reference without it), bf16 x and out."""
    from moedesk.kernels import experts
    g = torch.Generator().manual_seed(21)
    w, x, pe = make_case("q4_k", "q6_k", 256, 512, 3, 4, 2, g, dtype=torch.bfloat16)
    out = experts.experts_forward_routed(x, pe, 2, None, w, torch.zeros(pe.numel(), 256, dtype=torch.bfloat16),
                                         rows=256)
    check(out, x, pe, 2, None, w, torch.zeros_like(out), f_rows=256)
    ref = experts.reference_routed(x.float(), pe, 2, None, w, torch.zeros(pe.numel(), 256), rows=256)
    exact = reference(x, pe, 2, None, cut(w.dense(torch.float64), 512, 0, 256), torch.zeros_like(ref), emulate=False)
    assert float((ref.double() - exact).norm() / exact.norm()) < 1e-5
    whole = experts.reference_routed(x.float(), pe, 2, None, w, torch.zeros(pe.numel(), 256))
    assert torch.equal(experts.reference_routed(x.float(), pe, 2, None, w, torch.zeros(pe.numel(), 256), rows=512),
                       whole)
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")  # the dispatcher's fallback honours rows too
    assert torch.equal(experts.experts_forward_routed(x.float(), pe, 2, None, w, torch.zeros(pe.numel(), 256),
                                                      rows=256), ref)


@pytest.mark.parametrize("fd,F_,bad", [("q4_0", 160, [0, -32, 192, 48, 100]), ("q4_k", 768, [0, 1024, 128, 300])])
def test_bad_rows_raise(path, fd, F_, bad):
    """rows outside (0, F] or not a multiple of 32 and of the down format's block: ValueError, nothing written."""
    from moedesk.kernels import experts
    g = torch.Generator().manual_seed(4)
    w, x, pe = make_case(fd, fd, 256, F_, 2, 2, 1, g)
    out = torch.zeros(pe.numel(), 256)
    for R in bad:
        with pytest.raises(ValueError, match="rows"):
            cq.experts_forward_routed(x, pe, 1, None, w, out, rows=R)
        with pytest.raises(ValueError, match="rows"):
            experts.reference_routed(x, pe, 1, None, w, out, rows=R)
    assert not out.any()
