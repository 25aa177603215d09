"""kernels/cpu_experts' AMX-BF16 path (groups of 8+ tokens on tiles) against float64, torch's bf16 path and the
AVX-512 path.

On any CPU with AVX-512 (the AVX2 build has no AMX path) the library built with -DMOE_AMX_EMULATE runs the AMX
code with its tile instructions (ldtilecfg, tilezero, tileloadd, tdpbf16ps, tilestored) done in C, so the token
tiles' pair layout, the staged row and K tails, the act epilogue and the work split are checked here; on a CPU with
AMX-BF16 every test runs a second time on the real instructions (the `hardware` cases):

    python -m pytest -q tests/kernels/test_cpu_experts_amx.py
"""
import ctypes

import pytest
import torch

from moedesk.kernels import cpu_experts as ce
from moedesk.kernels.native_build import find_compiler, missing_cpu_flags
from tests.kernels.test_cpu_experts_kernel import make_case, rel_err, routed_case

AMX_MIN = 8  # cpu_experts.c's default


@pytest.fixture(scope="module", params=["emulated", "hardware"])
def amx(request, tmp_path_factory):
    """The library whose AMX path the tests run, with that path on; yields the count of tdpbf16ps done so far
    (a function; None on hardware, which does not count them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MOEDESK_NO_NATIVE_KERNELS", raising=False)
        mp.delenv("MOEDESK_EXPERTS_PATH", raising=False)
        mp.setenv("MOEDESK_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        if ce.avx512_reason() is not None or find_compiler() is None:
            pytest.skip("the AVX-512 build of the native kernel cannot be built here")
        ce._state.clear()
        assert ce.available(), ce.unavailable_reason()  # a failed build fails the tests, never skips them
        if request.param == "hardware":
            if missing_cpu_flags(("amx_tile", "amx_bf16"), "AMX-BF16") is not None:
                pytest.skip("this CPU lacks AMX-BF16 (the emulated cases cover the logic)")
            assert ce.amx_supported(), ce.amx_reason()  # the CPU has it: a refusal fails, never skips
            before, dps = None, None
        else:
            lib = ce.build_variant(["-DMOE_AMX_EMULATE"])
            lib.moe_amx_emulated_dps.restype = ctypes.c_int64
            before, dps = ce.use_library(lib), lib.moe_amx_emulated_dps
        assert ce.set_path("amx") == "amx"
        yield dps
        ce.set_path(None)
        if before is not None:
            ce.use_library(before)
        ce.set_num_threads(None)
    ce._state.clear()  # the next user loads the library again, under its own environment


def both_paths(args, **kw):
    """(AMX path, AVX-512 path) results of one call."""
    amx = ce.native_experts_forward(*args, **kw)
    ce.set_path("avx512")
    try:
        fma = ce.native_experts_forward(*args, **kw)
    finally:
        ce.set_path("amx")
    return amx, fma


def check(got, fma, args):
    """test_cpu_experts_kernel's tolerances against float64 and torch's bf16 path, and close to the AVX-512 path
    (the same sums in another order: an act value may round to the neighbouring bf16)."""
    x, rows, ids, offsets, gate_up, down = args
    exact = ce.reference_experts_forward(x.double(), rows, ids, offsets, gate_up.double(), down.double())
    torch_bf16 = ce.reference_experts_forward(*args)
    assert got.dtype == torch.bfloat16 and got.shape == (rows.shape[0], x.shape[1])
    err, torch_err = rel_err(got, exact), rel_err(torch_bf16, exact)
    assert err < 1e-2, (err, torch_err)
    assert err <= 1.5 * torch_err + 1e-4, (err, torch_err)
    assert float((got.double() - exact).abs().max()) <= 0.03 * float(exact.abs().max())
    assert rel_err(got, fma.double()) < 2e-3, rel_err(got, fma.double())


# (E, H, F): H and F with no tail, K tails (% 32) in both projections, row tails (% 16) in both, an odd F whose
# last 32-block ends within its first 16 rows, both below one A tile, and rows long enough for several items.
SHAPES = {
    "aligned": (4, 64, 32),
    "tails": (6, 72, 40),
    "odd": (5, 33, 17),
    "below-one-tile": (3, 16, 8),
    "f-16-past-32": (4, 96, 80),
    "larger": (4, 1024, 352),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [8, 9, 17, 31, 32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_amx_group_beside_fma_groups(amx, name, n, threads):
    """One expert of n tokens on the tiles, in the same call as experts of 3 and 1 tokens (FMAs) and, n > 8, one
    of 8 (tiles too, a token tile of half its columns)."""
    E, H, F = SHAPES[name]
    counts = [n, 3, 1] + ([AMX_MIN] if n > AMX_MIN and E > 3 else [])
    args = make_case(E, H, F, counts, repeat=name == "tails", seed=n)
    ce.set_num_threads(threads)
    before = amx() if amx else None
    got, fma = both_paths(args)
    if amx:
        assert amx() > before  # the group went to the tiles
    check(got, fma, args)


@pytest.mark.parametrize("counts", [[1, 2, 7], [7, 7], [5]])
def test_groups_below_the_threshold_stay_on_fma(amx, counts):
    args = make_case(4, 72, 40, counts)
    before = amx() if amx else None
    got, fma = both_paths(args)
    assert torch.equal(got, fma)
    if amx:
        assert amx() == before


@pytest.mark.parametrize("counts", [[33], [48, 2], [64, 9]])
def test_more_than_two_token_tiles(amx, counts):
    """Groups above 32 tokens (native_max_tokens raised): passes of two token tiles over the same rows, the
    last with one."""
    args = make_case(4, 96, 80, counts, seed=len(counts))
    got, fma = both_paths(args, native_max_tokens=64)
    check(got, fma, args)


@pytest.mark.parametrize("threads", [2, 5])
def test_result_does_not_depend_on_thread_count(amx, threads):
    """Items, quarters and the phase-0 rows change hands with the thread count; the tiles' sums must not."""
    args = make_case(8, 200, 136, [9, 3, 17, 2, 32])
    ce.set_num_threads(1)
    one = ce.native_experts_forward(*args)
    ce.set_num_threads(threads)
    assert torch.equal(ce.native_experts_forward(*args), one)


def test_many_items_per_expert(amx):
    """Several phase-1 items per expert writing their own blocks of the act token tiles, several phase-2 items
    (and quarters of 16 rows) reading them, two threads."""
    args = make_case(3, 1024, 2048, [9, 20], seed=3)
    ce.set_num_threads(2)
    got, fma = both_paths(args)
    check(got, fma, args)


@pytest.mark.parametrize("H,F", [(72, 40), (33, 17), (64, 32)])
def test_no_tile_reads_past_a_matrix(amx, H, F):
    """The experts the call does not use are NaN: a tile reaching past the last row of a used expert's gate_up or
    down (rows past N % 16, values past K % 32) would meet them, and NaN * 0 is NaN."""
    E = 5
    x, rows, _, offsets, gate_up, down = make_case(E, H, F, [9, 17], seed=H)
    ids = torch.tensor([1, 3])
    unused = torch.tensor([0, 2, 4])
    gate_up[unused], down[unused] = float("nan"), float("nan")
    args = (x, rows, ids, offsets, gate_up, down)
    got, fma = both_paths(args)
    assert torch.isfinite(fma).all() and torch.isfinite(got).all()
    check(got, fma, args)


def test_routed_call_and_out_rows(amx):
    """The routed entry point (grouping in C, results at their pairs' rows, k = 2) with groups on both sides of
    the threshold, and a chosen subset."""
    k, E = 2, 5
    x, ids, gate_up, down = routed_case(24, k, E, H=72, F=40, seed=4)  # expert 0: all 24 tokens
    for chosen in (None, [0, 2]):
        out = torch.full((ids.numel() + 2, 72), 5.0, dtype=torch.bfloat16)
        ce.experts_forward_routed(x, ids.flatten(), k, chosen, gate_up, down, out)
        ce.set_path("avx512")
        try:
            want = torch.full_like(out, 5.0)
            ce.experts_forward_routed(x, ids.flatten(), k, chosen, gate_up, down, want)
        finally:
            ce.set_path("amx")
        assert rel_err(out, want.double()) < 2e-3
        untouched = (want == 5.0).all(dim=1)
        assert untouched.any() and (out[untouched] == 5.0).all()


def test_path_setting(amx, monkeypatch):
    assert ce.get_path() == "amx" and "AMX" in ce.describe()
    assert ce.set_path("avx512") == "avx512" and "AMX" not in ce.describe()
    assert ce.set_path("amx") == "amx"
    with pytest.raises(ValueError):
        ce.set_path("avx2")
    monkeypatch.setenv("MOEDESK_EXPERTS_PATH", "fast")
    with pytest.raises(ValueError, match="MOEDESK_EXPERTS_PATH"):
        ce.set_path(None)
    monkeypatch.setenv("MOEDESK_EXPERTS_PATH", "avx512")
    assert ce.set_path(None) == "avx512"
    monkeypatch.setenv("MOEDESK_EXPERTS_PATH", "amx")
    assert ce.set_path(None) == "amx"


def test_default_path_and_refusal(monkeypatch, tmp_path):
    """AMX where the CPU and OS have AMX-BF16, else AVX-512, whether by default or asked through the environment;
    asking set_path for AMX where it is missing raises."""
    if ce.avx512_reason() is not None or find_compiler() is None:
        pytest.skip("the AVX-512 build of the native kernel cannot be built here")
    monkeypatch.delenv("MOEDESK_NO_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MOEDESK_EXPERTS_PATH", raising=False)
    monkeypatch.setattr(ce, "_state", {})
    assert ce.get_path() == ("amx" if ce.amx_supported() else "avx512")
    assert ce.max_native_tokens() == (ce.AMX_MAX_TOKENS if ce.amx_supported() else ce.NATIVE_MAX_TOKENS)
    monkeypatch.setenv("MOEDESK_EXPERTS_PATH", "amx")
    monkeypatch.setattr(ce, "_state", {})
    if ce.amx_supported():
        assert ce.get_path() == "amx"
    else:
        assert ce.get_path() == "avx512"
        with pytest.raises(ValueError, match="AMX"):
            ce.set_path("amx")
    ce.set_path("avx512")


@pytest.mark.parametrize("H,F,R", [(72, 96, 32), (64, 100, 64), (33, 80, 64)])
def test_rows_on_the_tiles(amx, H, F, R):
    """f_rows = R < F (the routed call's rows; the GPU computes the rest at one token): A tiles of the down rows'
    first R values at the row stride of F, act token tiles of R values. Rows [R, F) of every expert are NaN: a
    tile reaching into them would show. Against float64 and the AVX-512 path on the experts cut to [0, R)."""
    x, rows, ids, offsets, gate_up, down = make_case(4, H, F, [9, 17, 3], seed=R)
    cut_gu = torch.cat([gate_up[:, :R], gate_up[:, F:F + R]], dim=1)
    cut_args = (x, rows, ids, offsets, cut_gu, down[:, :, :R].contiguous())
    gate_up[:, R:F], gate_up[:, F + R:], down[:, :, R:] = float("nan"), float("nan"), float("nan")
    before = amx() if amx else None
    got, fma = both_paths((x, rows, ids, offsets, gate_up, down), f_rows=R)
    if amx:
        assert amx() > before
    assert torch.isfinite(got).all() and torch.isfinite(fma).all()
    check(got, fma, cut_args)
