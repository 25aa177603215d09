"""kernels/cpu_quant with gpt-oss's experts: MXFP4 blocks read as they lie, the gate_up bias before the clamped
SwiGLU, the down bias after, in the one native call, against float64 from `dequantize`d weights.

The two references are test_cpu_quant_kernel's (`exact`, and `emulated`: x and the act rows quantised to int8 as
the kernel does), with the biases and ClampedSwiGLU computed in float64; `exact` is itself checked against
transformers' GptOssExperts on the same dequantised weights (tests/kernels/gpt_oss_reference.py). The limit is small enough that the clamps
really clip (each case asserts a share of clipped gate and up values), so a missing or misplaced clamp, bias or
alpha shows as O(1). Every path the CPU has runs them (the `path` fixture: VNNI, AVX2 with and without AVX-VNNI,
AMX where present); tests/kernels/test_cpu_quant_amx.py runs MXFP4 through the emulated AMX build.
"""
import zlib

import numpy as np
import pytest
import torch

from moedesk.kernels import cpu_quant as cq
from moedesk.kernels import experts
from moedesk.kernels.expert_weights import ClampedSwiGLU, ExpertWeights
from tests.kernels.gpt_oss_reference import gpt_oss_experts
from tests.kernels.test_cpu_quant_kernel import (ERR_EMULATED, ERR_EXACT, built, maddubs_build, path,  # noqa: F401
                                                 q8_emulated, random_packed)

GLU = ClampedSwiGLU(alpha=1.702, limit=0.8)  # gpt-oss's alpha; a limit that clips O(1) gate and up values


def gpt_oss_case(H, F_, E, g, bias_dtype=torch.float32, fu="mxfp4", fd="mxfp4"):
    w = ExpertWeights(random_packed(fu, E, 2 * F_, H, g), random_packed(fd, E, H, F_, g), H, F_, fu, fd)
    return w.with_function((torch.randn(E, 2 * F_, generator=g) * 0.5).to(bias_dtype),
                           (torch.randn(E, H, generator=g) * 0.5).to(bias_dtype), GLU)


def reference(x, pe, k, chosen, w, out, emulate, rows=None):
    """out (float64) with the chosen pairs' rows computed as gpt-oss's experts, from dequantised weights; rows:
    intermediate rows [0, rows) only, and then no down bias (kernels.experts._reference_one's rule). Also the
    shares of gate and up values the clamps clipped."""
    gu, dn = w.dense(torch.float64)
    bg, bd = w.gate_up_bias.double(), w.down_bias.double()
    F_ = w.width
    R = rows or F_
    ref = out.double().clone()
    xs = q8_emulated(x) if emulate else x.double()
    clipped = []
    for e in np.unique(pe.numpy()).tolist():
        if chosen is not None and e not in chosen:
            continue
        pairs = torch.from_numpy(np.flatnonzero(pe.numpy() == e))
        h = xs[pairs // k]
        gate = h @ gu[e, :R].T + bg[e, :R]
        up = h @ gu[e, F_:F_ + R].T + bg[e, F_:F_ + R]
        clipped.append(torch.stack([(gate > GLU.limit).double().mean(), (up.abs() > GLU.limit).double().mean()]))
        act = GLU(gate, up)
        if emulate:
            act = q8_emulated(act.float())
        ref[pairs] = act @ dn[e, :, :R].T + (bd[e] if R == F_ else 0)
    return ref, torch.stack(clipped).mean(0)


def check(out, x, pe, k, chosen, w, before, rows=None):
    computed = [p for p, e in enumerate(pe.tolist()) if chosen is None or e in chosen]
    exact, clipped = reference(x, pe, k, chosen, w, before, emulate=False, rows=rows)
    emulated, _ = reference(x, pe, k, chosen, w, before, emulate=True, rows=rows)
    exact, emulated, got = exact[computed], emulated[computed], out.double()[computed]
    if rows is None:  # the float64 reference is transformers' function
        order = sorted(computed, key=lambda p: pe[p])
        sizes = torch.bincount(pe[order], minlength=w.num_experts).tolist()
        gu, dn = w.dense(torch.float64)
        theirs = gpt_oss_experts(x[torch.tensor(order) // k].double(), gu, dn, w.gate_up_bias, w.down_bias, GLU, sizes)
        mine = exact[[computed.index(p) for p in order]]
        assert torch.allclose(theirs, mine, rtol=1e-9, atol=1e-9 * float(mine.abs().max()))
    rounding = 2 ** -7 if out.dtype == torch.bfloat16 else 0.0
    assert clipped.min() > 0.1, clipped  # the clamps are exercised on both gate and up
    assert float((got - exact).norm() / exact.norm()) < ERR_EXACT + rounding
    assert float((got - emulated).abs().max() / emulated.pow(2).mean().sqrt()) < ERR_EMULATED + 4 * rounding
    untouched = [p for p in range(out.shape[0]) if p not in computed]
    assert torch.equal(out[untouched], before[untouched])


# (H, F): one block short of a 64-weight chunk (96), whole 256-weight segments and a half chunk after them (288) or
# a whole one (544), gpt-oss's own hidden size (2880 = 11 segments and a chunk).
SHAPES = [(96, 160), (288, 544), (2880, 320)]
# tokens on each expert of a call, k = 1: one token; several experts with uneven counts (register tiles of 1-4,
# 5-8 and a remainder past the 8-token tile; 17 and 33 also take AMX tiles where there are some)
COUNTS = [(1,), (3, 0, 1, 17), (33, 5, 0, 2)]


@pytest.mark.parametrize("H,F_", SHAPES)
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_gpt_oss_experts_against_float64(path, H, F_, counts):
    g = torch.Generator().manual_seed(zlib.crc32(repr((H, F_, counts)).encode()))
    w = gpt_oss_case(H, F_, len(counts), g)
    pe = torch.tensor([e for e, n in enumerate(counts) for _ in range(n)])[torch.randperm(sum(counts), generator=g)]
    x = torch.randn(len(pe), H, generator=g) * 1.5
    out = torch.randn(len(pe) + 1, H, generator=g)
    before = out.clone()
    cq.experts_forward_routed(x, pe, 1, None, w, out)
    check(out, x, pe, 1, None, w, before)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_bf16_top4_chosen_subset_and_bias_dtypes(path, bias_dtype):
    """gpt-oss's top-4 routing (a token's four ranks on different experts), bf16 x and out, a chosen subset, and
    biases as a model keeps them (bf16 or float32; float16, not the kernel's, is copied to float32)."""
    g = torch.Generator().manual_seed(3)
    H, F_, E, k = 288, 160, 6, 4
    w = gpt_oss_case(H, F_, E, g, bias_dtype)
    x = (torch.randn(7, H, generator=g) * 1.5).bfloat16()
    pe = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(7)]).flatten()
    chosen = [0, 2, 3, 5]
    out = torch.randn(pe.numel(), H, generator=g).bfloat16()
    before = out.clone()
    cq.experts_forward_routed(x, pe, k, chosen, w, out)
    check(out, x, pe, k, chosen, w, before)


def test_mixed_formats_and_rows(path):
    """The expert function with other packed formats (q4_k gate_up, q8_0 down), and `rows`: the head of each expert,
    without the down bias (the part's owner adds it), as kernels.experts.reference_routed computes it."""
    g = torch.Generator().manual_seed(8)
    H, F_ = 256, 256
    w = gpt_oss_case(H, F_, 3, g, fu="q4_k", fd="q8_0")
    x = torch.randn(6, H, generator=g) * 1.5
    pe = torch.tensor([0, 2, 2, 1, 0, 2])
    before = torch.zeros(6, H)
    out = cq.experts_forward_routed(x, pe, 1, None, w, before.clone())
    check(out, x, pe, 1, None, w, before)
    head = cq.experts_forward_routed(x, pe, 1, None, w, before.clone(), rows=96)
    check(head, x, pe, 1, None, w, before, rows=96)
    theirs = experts.reference_routed(x, pe, 1, None, w, before.clone(), rows=96)
    assert (head - theirs).norm() < ERR_EXACT * theirs.norm()


def test_dispatch_takes_the_kernel_for_gpt_oss_experts(path, monkeypatch):
    """kernels.experts sends packed experts with gpt-oss's function to the native kernel (the reference path is
    never called), prepared calls included; an activation the kernel does not know goes to the reference."""
    g = torch.Generator().manual_seed(4)
    w = gpt_oss_case(96, 64, 3, g)
    x = torch.randn(4, 96, generator=g) * 1.5
    pe = torch.tensor([0, 2, 1, 2])
    expected = experts.reference_routed(x, pe, 1, None, w, torch.zeros(4, 96))
    assert not w.plain and cq.applies(x, w)

    def refused(*args, **kwargs):
        raise AssertionError("the reference path was taken")

    monkeypatch.setattr(experts, "reference_routed", refused)
    out = experts.experts_forward_routed(x, pe, 1, None, w, torch.zeros(4, 96))
    assert (out - expected).norm() < ERR_EXACT * expected.norm()
    index, prepared_out = torch.empty(2 * 4 + 2 * 3 + 1, dtype=torch.int64), torch.zeros(4, 96)
    run = experts.prepare_routed(x, pe, 1, None, w, prepared_out, index)
    assert run is not None
    run()
    assert torch.equal(prepared_out, out)
    monkeypatch.undo()

    class OtherGLU(ClampedSwiGLU):  # any other activation is the reference's to compute
        pass

    other = w.with_function(w.gate_up_bias, w.down_bias, OtherGLU(GLU.alpha, GLU.limit))
    assert experts.cpu_path(w) == cq.describe() and experts.cpu_path(other).startswith("dequantise + torch")
    assert not cq.applies(x, other) and experts.prepare_routed(x, pe, 1, None, other, torch.zeros(4, 96), index) is None
    assert torch.equal(experts.experts_forward_routed(x, pe, 1, None, other, torch.zeros(4, 96)), expected)
    with pytest.raises(ValueError, match="biases"):
        cq.experts_forward_routed(x, pe, 1, None, w.with_function(w.gate_up_bias[:, :64], w.down_bias, GLU),
                                  torch.zeros(4, 96))


def test_the_two_gathers_of_the_vnni_path_agree(path):
    """The VNNI path gathers MXFP4's odd-aligned blocks with AVX512-VBMI's byte permute where the CPU has it, and
    with 16-byte loads otherwise: the same bytes, so the same results bit for bit, on a row of whole segments and a
    chunk after them."""
    if path != "vnni":
        pytest.skip("the gathers are the VNNI path's")
    g = torch.Generator().manual_seed(9)
    w = gpt_oss_case(2880, 320, 3, g)
    x = torch.randn(9, 2880, generator=g) * 1.5
    pe = torch.tensor([0, 1, 1, 2, 2, 2, 0, 1, 2])
    results = []
    for allow in (True, False):
        uses = cq.allow_vbmi(allow)
        assert not uses or allow
        results.append(cq.experts_forward_routed(x, pe, 1, None, w, torch.zeros(9, 2880)))
    cq.allow_vbmi(True)
    check(results[0], x, pe, 1, None, w, torch.zeros(9, 2880))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("exponent", [0, 1, 2, 127, 245])
def test_scales_at_the_ends_of_e8m0(path, exponent):
    """Down rows whose every block has one exponent: 2^-128 and 2^-127 (subnormal floats, which the kernel's scales
    build apart), 2^-126, 1 and 2^117, each path against float64 (plain SwiGLU: only the scale is under test)."""
    g = torch.Generator().manual_seed(exponent)
    H, F_ = 288, 96
    w = ExpertWeights(random_packed("mxfp4", 2, 2 * F_, H, g), random_packed("mxfp4", 2, H, F_, g), H, F_,
                      "mxfp4", "mxfp4")
    w.down.view(-1, 17)[:, 0] = exponent
    x = torch.randn(5, H, generator=g)
    pe = torch.tensor([0, 1, 1, 0, 1])
    out = cq.experts_forward_routed(x, pe, 1, None, w, torch.zeros(5, H))
    gu, dn = w.dense(torch.float64)
    gate, up = torch.einsum("nh,nfh->nf", x.double(), gu[pe]).chunk(2, dim=-1)
    exact = torch.einsum("nf,nhf->nh", torch.nn.functional.silu(gate) * up, dn[pe])
    assert torch.isfinite(out).all() and exact.abs().max() > 0
    assert float((out.double() - exact).norm() / exact.norm()) < ERR_EXACT
