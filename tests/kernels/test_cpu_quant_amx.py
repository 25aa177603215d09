"""kernels/cpu_quant's AMX-INT8 path on any CPU with AVX512-VNNI: the library built with -DMQ_AMX_EMULATE runs
the AMX code with its five tile instructions (ldtilecfg, tilezero, tileloadd, tdpbssd, tilestored) done in C,
so the B-tile order of the quantised rows, the unpacked A rows, the partial token tiles and the epilogue are
checked here against float64 as the other paths are (test_cpu_quant_kernel.check). On a CPU with AMX,
test_cpu_quant_kernel.py's `amx` cases run the real instructions:

    MOEDESK_QUANT_PATH=amx python -m pytest -q tests/kernels/test_cpu_quant_kernel.py -k amx

Experts with 8 or more tokens (AMX_MIN) go to the tiles, fewer stay on VNNI; q6_k stays on VNNI.
"""
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from moedesk.kernels import cpu_quant as cq
from moedesk.kernels.native_build import find_compiler
from tests.kernels.test_cpu_quant_kernel import check, make_case, poison_tail


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MOEDESK_NO_NATIVE_KERNELS", raising=False)
        mp.delenv("MOEDESK_QUANT_PATH", raising=False)
        mp.setenv("MOEDESK_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        if cq.cpu_reason() is not None or find_compiler() is None:
            pytest.skip("the packed kernel cannot be built here")
        cq._state.clear()
        assert cq.available(), cq.unavailable_reason()
        if not cq.vnni_supported():
            pytest.skip("the AMX path's epilogue needs AVX512-VNNI")
        before = cq.use_library(cq.build_variant(["-DMQ_AMX_EMULATE"]))
        assert cq.set_path("amx") == "amx"
        yield
        cq.use_library(before)
        cq.set_path(None)


# (gate_up format, down format, H, F): every format AMX takes, a q6_k half (which stays on VNNI: the other half
# on tiles, the act rows in the VNNI layout or the other way round), rows of a whole and a partial segment
# (q4_0 / q8_0 / mxfp4: 288 = 256 + 32; mxfp4 320 = 256 + 64, the two blocks of gpt-oss's 2880 = 11 * 256 + 64),
# k-quant rows of 1 and 2 super-blocks.
SHAPES = [("q4_0", "q4_0", 288, 160), ("q8_0", "q8_0", 96, 288), ("q4_k", "q4_k", 256, 512),
          ("q5_k", "q5_k", 512, 256), ("q4_k", "q6_k", 256, 256), ("q6_k", "q4_0", 256, 96), ("q8_0", "q4_k", 64, 256),
          ("mxfp4", "mxfp4", 288, 160), ("q4_k", "mxfp4", 256, 96), ("mxfp4", "mxfp4", 320, 96)]


@pytest.mark.parametrize("fu,fd,H,F_", SHAPES)
@pytest.mark.parametrize("n", [8, 16, 17, 33])
def test_amx_against_float64(emulated, fu, fd, H, F_, n):
    """One expert with n tokens (full and partial token tiles) beside one with 3 (VNNI) in the same call."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((fu, fd, n)).encode()))
    w, _, _ = make_case(fu, fd, H, F_, 3, 1, 1, g)
    x = torch.randn(n + 3, H, generator=g)
    pe = torch.tensor([1] * n + [2] * 3)
    out = torch.randn(n + 3, H, generator=g)
    before = out.clone()
    cq.experts_forward_routed(x, pe, 1, None, w, out)
    check(out, x, pe, 1, None, w, before)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
def test_amx_bf16_routed_and_chosen(emulated, fmt):
    """bf16 x and out, k = 2 (a token's two ranks on different experts), a chosen subset, and an out row order
    that is the pairs', not the group's."""
    g = torch.Generator().manual_seed(5)
    H, F_ = (288, 96) if fmt == "q4_0" else (256, 256)
    w, x, pe = make_case(fmt, fmt, H, F_, 4, 40, 2, g, dtype=torch.bfloat16)
    chosen = [0, 1, 3]
    out = torch.randn(pe.numel(), H, generator=g).to(torch.bfloat16)
    before = out.clone()
    cq.experts_forward_routed(x, pe, 2, chosen, w, out)
    check(out, x, pe, 2, chosen, w, before)


def test_amx_many_items(emulated, monkeypatch):
    """Several work items per expert and two threads: the act rows' token tiles are written by the phase-1
    items that own their blocks, and read by phase 2 only after all of them."""
    from moedesk.kernels import cpu_experts
    threads = cpu_experts.get_num_threads()
    cq.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(8)
        w, _, _ = make_case("q4_0", "q4_k", 1024, 2048, 2, 1, 1, g)
        x = torch.randn(20, 1024, generator=g)
        pe = torch.tensor([0] * 9 + [1] * 11)
        out = torch.zeros(20, 1024)
        cq.experts_forward_routed(x, pe, 1, None, w, out)
        check(out, x, pe, 1, None, w, torch.zeros(20, 1024))
    finally:
        cq.set_num_threads(threads)


@pytest.mark.parametrize("fu,fd,H,F_,R", [("q4_0", "q4_0", 288, 160, 96), ("q8_0", "q4_k", 64, 768, 256),
                                          ("q4_k", "q8_0", 256, 544, 288)])
def test_amx_rows(emulated, fu, fd, H, F_, R):
    """rows = R < F on the tiles (act token tiles of R values, each down row's first R weights; the GPU computes
    the rest at one token): against float64 on the experts cut to rows [0, R), with NaN scales in every block of
    rows [R, F) changing nothing."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(("rows", fu, fd, R)).encode()))
    w, _, _ = make_case(fu, fd, H, F_, 3, 1, 1, g)
    x = torch.randn(20, H, generator=g)
    pe = torch.tensor([1] * 17 + [2] * 3)
    before = torch.randn(20, H, generator=g)
    out = cq.experts_forward_routed(x, pe, 1, None, w, before.clone(), rows=R)
    check(out, x, pe, 1, None, w, before, f_rows=R)
    assert torch.equal(cq.experts_forward_routed(x, pe, 1, None, poison_tail(w, R), before.clone(), rows=R), out)


def test_amx_rows_of_mxfp4(emulated):
    """rows = R < F of MXFP4 experts on the tiles, against float64 on the experts cut to rows [0, R)."""
    g = torch.Generator().manual_seed(11)
    w, _, _ = make_case("mxfp4", "mxfp4", 320, 160, 3, 1, 1, g)
    x = torch.randn(20, 320, generator=g)
    pe = torch.tensor([1] * 17 + [2] * 3)
    before = torch.randn(20, 320, generator=g)
    out = cq.experts_forward_routed(x, pe, 1, None, w, before.clone(), rows=64)
    check(out, x, pe, 1, None, w, before, f_rows=64)


@pytest.mark.parametrize("fmt,k", [("q4_0", 288), ("q4_k", 512), ("mxfp4", 320), ("q6_k", 256)])
def test_amx_linear(emulated, fmt, k):
    """cpu_quant.linear's rows quantised straight into token tiles (q6_k's into the VNNI layout), 20 rows: one full
    tile and a partial one, against float64 (test_cpu_quant_linear.check)."""
    from tests.kernels.test_cpu_quant_linear import case
    from tests.kernels.test_cpu_quant_linear import check as check_linear

    x, rows, bias = case(fmt, k, 36, 20, seed=("amx",))
    check_linear(cq.linear(x, rows, fmt, bias), x, rows, fmt, bias)


def test_the_amx_segments_probe_computes_what_the_vnni_tiles_do(tmp_path):
    """tests/perf/probe_amx_segments.c (an AMX-INT8 layout measured against the VNNI tiles and not kept) builds
    against this kernel's internals; emulated, its tiles give the VNNI tiles' results (it exits 1 when not)."""
    if cq.cpu_reason() is not None or not cq.vnni_supported():
        pytest.skip("the probe compares against the VNNI tiles")
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    source = Path(__file__).resolve().parents[1] / "perf" / "probe_amx_segments.c"
    binary = tmp_path / "probe"
    subprocess.run([*compiler, "-O2", "-std=gnu11", "-mavx2", "-mfma", "-mf16c", "-DMQ_AMX_EMULATE", "-o",
                    str(binary), str(source), "-lpthread", "-lm"], check=True, capture_output=True)
    run = subprocess.run([str(binary), "32", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("max err") == 4


@pytest.mark.parametrize("n", [8, 17])
def test_amx_gpt_oss_experts(emulated, n):
    """gpt-oss's function on the tiles: the gate_up bias and clamped SwiGLU before the act rows go to token tiles,
    the down bias in the AMX epilogue's output, beside an expert of 3 tokens on VNNI."""
    from tests.kernels.test_cpu_quant_mxfp4 import check as check_gpt_oss, gpt_oss_case

    g = torch.Generator().manual_seed(n)
    w = gpt_oss_case(288, 160, 3, g, torch.bfloat16)
    x = torch.randn(n + 3, 288, generator=g) * 1.5
    pe = torch.tensor([1] * n + [2] * 3)
    out = torch.randn(n + 3, 288, generator=g)
    before = out.clone()
    cq.experts_forward_routed(x, pe, 1, None, w, out)
    check_gpt_oss(out, x, pe, 1, None, w, before)


def test_the_profile_times_amx_beside_vnni_where_it_agrees_and_leaves_the_path_as_found(emulated):
    """engine.offload.profiler.profile_prefill_cpu on gpt-oss's experts: both paths timed at prefill loads, one of
    them chosen, and the kernel back on the path it was on."""
    from moedesk.engine.offload.profiler import amx_agrees, profile_prefill_cpu
    from tests.kernels.test_cpu_quant_mxfp4 import gpt_oss_case

    w = gpt_oss_case(288, 160, 6, torch.Generator().manual_seed(3), torch.bfloat16)
    cq.set_path("vnni")
    try:
        assert amx_agrees(w, torch.bfloat16) and cq.get_path() == "vnni"
        points = profile_prefill_cpu(w, torch.bfloat16, tokens=(8, 16), experts=2, repeat=1)
        assert cq.get_path() == "vnni"
    finally:
        cq.set_path("amx")
    assert set(points["cpu_prefill_ms"]) == {"vnni", "amx"} and points["cpu_prefill_experts"] == 2
    assert all(set(t) == {8, 16} and min(t.values()) > 0 for t in points["cpu_prefill_ms"].values())
    assert points["cpu_path"] in ("vnni", "amx")


def test_an_amx_path_that_computes_otherwise_is_never_timed(emulated, monkeypatch):
    """The safeguard before AMX is first timed on a new CPU: tiles whose results differ from VNNI's (here made to)
    leave the profile on VNNI alone."""
    from moedesk.engine.offload import profiler
    from tests.kernels.test_cpu_quant_mxfp4 import gpt_oss_case

    routed = profiler.experts_forward_routed

    def off_on_amx(x, pe, k, chosen, w, out, *rest, **kw):
        result = routed(x, pe, k, chosen, w, out, *rest, **kw)
        if cq.get_path() == "amx":
            out[0, 0] += 0.01 * out.abs().max() + 1
        return result

    monkeypatch.setattr(profiler, "experts_forward_routed", off_on_amx)
    w = gpt_oss_case(288, 160, 4, torch.Generator().manual_seed(4), torch.bfloat16)
    cq.set_path("vnni")
    try:
        assert not profiler.amx_agrees(w, torch.bfloat16)
        points = profiler.profile_prefill_cpu(w, torch.bfloat16, tokens=(8,), experts=2, repeat=1)
    finally:
        cq.set_path("amx")
    assert set(points["cpu_prefill_ms"]) == {"vnni"} and points["cpu_path"] == "vnni"
