"""kernels/cpu_experts: the native kernel against float32 and torch's bf16 path, and the fallback.

The native tests run on each build of the kernel the CPU can run: AVX-512 (its default path, AMX where there is
AMX) and AVX2, which a CPU with AVX-512 runs too. They skip only where a build cannot exist (a CPU without its
instructions, no C compiler); a build failure on a machine that should build it fails them.
"""
import os
import select
import threading

import psutil
import pytest
import torch
import torch.nn.functional as F

from moedesk.kernels.cpu_experts import expert_forward
from moedesk.kernels import cpu_experts as ce
from moedesk.kernels.native_build import BuildError, build_library, find_compiler, missing_cpu_flags


def make_case(E, H, F, counts, extra_rows=3, repeat=False, seed=0, dtype=torch.bfloat16):
    """Inputs of one call: random x/weights scaled so activations stay O(1), groups of `counts` rows."""
    g = torch.Generator().manual_seed(seed)
    M = sum(counts)
    N = max(M, 1) + extra_rows
    x = torch.randn(N, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(dtype)
    rows = torch.randint(0, N, (M,), generator=g)
    if repeat and M > 1:
        rows[1::2] = rows[0]  # the same x row several times, also within one group
    expert_ids = torch.randperm(E, generator=g)[:len(counts)] if len(counts) <= E else torch.randint(0, E, (len(counts),), generator=g)
    offsets = torch.tensor([0, *torch.tensor(counts, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)
    return x, rows, expert_ids, offsets, gate_up, down


def per_expert_loop(x, rows, expert_ids, offsets, gate_up, down):
    """The engine's CPU path before the kernel: expert_forward on each group's rows."""
    out = x.new_empty((rows.shape[0], x.shape[1]))
    b = offsets.tolist()
    for g, e in enumerate(expert_ids.tolist()):
        if b[g + 1] > b[g]:
            out[b[g]:b[g + 1]] = expert_forward(x[rows[b[g]:b[g + 1]]], gate_up[e], down[e])
    return out


def rel_err(a, ref):
    return float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(scope="module", params=["avx512", "avx2"])
def native(request, tmp_path_factory):
    """The kernel's build named by the parameter, loaded as this process's; yields its name."""
    build = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MOEDESK_NO_NATIVE_KERNELS", raising=False)
        mp.setenv("MOEDESK_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        reason = missing_cpu_flags(ce.CPU_FLAGS if build == "avx512" else ce.AVX2_CPU_FLAGS, build)
        if reason is not None:
            pytest.skip(f"the {build} build of the native kernel cannot run here: {reason}")
        if find_compiler() is None:
            pytest.skip("no C compiler (cc, gcc, clang or $CC) to build the native kernel")
        if build == "avx2":
            mp.setenv("MOEDESK_EXPERTS_PATH", "avx2")
        before = dict(ce._state)
        ce._state.clear()
        assert ce.available(), ce.unavailable_reason()  # a failed build fails the tests, never skips them
        assert (ce.get_path() == "avx2") == (build == "avx2")
        yield build
        ce.set_num_threads(None)
    ce._state.clear()
    ce._state.update(before)


# bf16 rounds act to 8 bits before the down projection: relative errors of a few 1e-3 are what
# torch's own bf16 path shows against float32 on these shapes.
SHAPES = {
    "aligned": (4, 64, 32, [1, 2]),
    "tails": (6, 72, 40, [1, 2, 5]),          # H, F not multiples of 16 or 32
    "odd": (5, 33, 17, [16, 1, 2]),            # odd F: a last gate/up row alone
    "below-one-vector": (3, 16, 8, [2, 5]),
    "group-of-33": (8, 100, 300, [33, 1, 2, 16]),
    "single-group": (1, 96, 64, [5]),
    "many-groups": (64, 48, 80, [1, 2, 1, 3, 1, 1, 2, 5, 1, 1] * 4 + [0, 16]),
    "larger": (4, 1024, 352, [1, 4, 16]),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(SHAPES))
def test_native_close_to_float32_and_to_torch_bf16(native, name, threads):
    E, H, F, counts = SHAPES[name]
    args = make_case(E, H, F, counts, repeat=name in ("tails", "many-groups"))
    ce.set_num_threads(threads)
    got = ce.native_experts_forward(*args, native_max_tokens=64)
    x, rows, ids, offsets, gate_up, down = args
    exact = ce.reference_experts_forward(x.float(), rows, ids, offsets, gate_up.float(), down.float())
    torch_bf16 = ce.reference_experts_forward(*args)
    assert got.dtype == torch.bfloat16 and got.shape == (rows.shape[0], H)
    err, torch_err = rel_err(got, exact), rel_err(torch_bf16, exact)
    assert err < 1e-2, (err, torch_err)
    assert err <= 1.5 * torch_err + 1e-4, (err, torch_err)
    assert float((got.float() - exact).abs().max()) <= 0.03 * float(exact.abs().max())


@pytest.mark.parametrize("threads", [2, 5])
def test_result_does_not_depend_on_thread_count(native, threads):
    """The split of the work (x rows shared out, the last blocks handed out in quarters) changes with the thread
    count; the result must not."""
    args = make_case(8, 200, 136, [3, 1, 9, 2])
    ce.set_num_threads(1)
    one = ce.native_experts_forward(*args)
    ce.set_num_threads(threads)
    assert torch.equal(ce.native_experts_forward(*args), one)


def test_empty_calls(native):
    x, _, _, _, gate_up, down = make_case(4, 40, 24, [1])
    none = torch.empty(0, dtype=torch.long)
    for ids, offsets in [(none, torch.zeros(1, dtype=torch.long)), (torch.tensor([1, 2]), torch.zeros(3, dtype=torch.long))]:
        for fn in (ce.experts_forward, ce.reference_experts_forward):
            out = fn(x, none, ids, offsets, gate_up, down)
            assert out.shape == (0, 40) and out.dtype == x.dtype


@pytest.mark.parametrize("placed", ["in order", "at out_rows"])
def test_groups_above_threshold(native, placed):
    """The AVX-512 build leaves groups of more than max_native_tokens() to torch; the AVX2 build computes them itself,
    in slices of that many tokens, each row as one call of the whole group would (every row's sums are its own)."""
    limit = ce.max_native_tokens()
    args = make_case(4, 64, 48, [2, 2 * limit + 3, 1])
    M = args[1].shape[0]
    a, b = 2, 2 + 2 * limit + 3
    dest = torch.randperm(M + 2, generator=torch.Generator().manual_seed(1))[:M] if placed == "at out_rows" else None
    out = torch.zeros(M + 2 if dest is not None else M, 64, dtype=torch.bfloat16)
    got = ce.experts_forward(*args, out=out, out_rows=dest)
    got = got if dest is None else got[dest]
    ref = ce.reference_experts_forward(*args)
    if native == "avx2":
        assert torch.equal(got, ce.native_experts_forward(*args, native_max_tokens=1 << 30))
    else:
        assert torch.equal(got[a:b], ref[a:b])  # computed by torch itself
    assert rel_err(got, ref.float()) < 1e-2


def test_out_argument(native):
    args = make_case(4, 64, 48, [2, 3])
    want = ce.native_experts_forward(*args)
    out = torch.full((5, 64), float("nan"), dtype=torch.bfloat16)
    assert ce.experts_forward(*args, out=out) is out
    assert torch.equal(out, want)
    wide = torch.zeros(5, 80, dtype=torch.bfloat16)
    view = wide[:, 8:72]  # rows with a stride other than H
    assert ce.experts_forward(*args, out=view) is view
    assert torch.equal(view, want) and not wide[:, :8].any() and not wide[:, 72:].any()
    transposed = torch.empty(64, 5, dtype=torch.bfloat16).t()  # columns not contiguous: computed aside, copied
    assert torch.equal(ce.experts_forward(*args, out=transposed), want)


@pytest.mark.parametrize("fn", ["native", "torch"])
def test_out_rows_scatter_results(native, fn):
    """out_rows puts result i at out[out_rows[i]] and leaves the other rows alone, also for a group
    above the native limit (computed by torch inside the same call)."""
    args = make_case(5, 64, 48, [2, ce.max_native_tokens() + 1, 3])
    want = ce.reference_experts_forward(*args) if fn == "torch" else ce.experts_forward(*args)
    M = want.shape[0]
    dest = torch.randperm(M + 4, generator=torch.Generator().manual_seed(1))[:M]
    out = torch.full((M + 4, 64), 7.0, dtype=torch.bfloat16)
    call = ce.reference_experts_forward if fn == "torch" else ce.experts_forward
    assert call(*args, out=out, out_rows=dest) is out
    assert torch.equal(out[dest], want)
    untouched = torch.ones(M + 4, dtype=torch.bool)
    untouched[dest] = False
    assert (out[untouched] == 7.0).all()
    as_float = torch.full((M + 4, 64), 7.0)  # not bf16: computed aside; the unlisted rows must survive
    ce.experts_forward(*args, out=as_float, out_rows=dest)
    assert torch.equal(as_float[dest], want.float()) and (as_float[untouched] == 7.0).all()
    with pytest.raises(ValueError, match="out_rows"):
        call(*args, out=out, out_rows=dest + 4)
    with pytest.raises(ValueError, match="out_rows"):
        ce.experts_forward(*args, out_rows=dest)


def test_strided_x_and_narrow_index_types(native):
    x, rows, ids, offsets, gate_up, down = make_case(4, 64, 48, [2, 3])
    want = ce.native_experts_forward(x, rows, ids, offsets, gate_up, down)
    wide = torch.zeros(x.shape[0], 100, dtype=torch.bfloat16)
    wide[:, 20:84] = x
    got = ce.experts_forward(wide[:, 20:84], rows.int(), ids.int(), offsets.int(), gate_up, down)
    assert torch.equal(got, want)


def test_many_calls_sleeping_spinning_and_changing_threads(native):
    """Workers that sleep between calls, spin between calls, or sit out after a smaller thread count."""
    case = make_case(8, 96, 64, [1, 3, 2, 6])
    ce.set_num_threads(1)
    want = ce.native_experts_forward(*case)
    try:
        for spin in (0, 200, 5):
            ce.set_spin_us(spin)
            for i in range(60):
                ce.set_num_threads(1 + i % 3)
                assert torch.equal(ce.native_experts_forward(*case), want)
    finally:
        ce.set_spin_us(200)


def test_bad_inputs_raise(native):
    x, rows, ids, offsets, gate_up, down = make_case(4, 32, 16, [2, 2])
    with pytest.raises(ValueError, match="rows"):
        ce.native_experts_forward(x, rows + 100, ids, offsets, gate_up, down)
    with pytest.raises(ValueError, match="expert_ids"):
        ce.native_experts_forward(x, rows, ids + 4, offsets, gate_up, down)
    with pytest.raises(ValueError, match="offsets"):
        ce.native_experts_forward(x, rows, ids, offsets - 1, gate_up, down)
    with pytest.raises(ValueError, match="shapes"):
        ce.experts_forward(x[:, :16], rows, ids, offsets, gate_up, down)


def routed_case(N, k, E, H=64, F=48, seed=0):
    """x, routing [N, k] (distinct experts per token, as a router gives them) and stacks; expert 0 takes
    every token, so with N > max_native_tokens() one group goes to torch inside the call."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(E - 1, generator=g)[:k - 1]])
                       for _ in range(N)]).sort(dim=1).values
    return x, ids, gate_up, down


def grouped_by_hand(ids, chosen):
    """The calls experts_forward would get: pairs of the chosen experts grouped by expert, ascending pair."""
    flat = ids.flatten().tolist()
    experts = sorted({e for e in flat if chosen is None or e in chosen})
    pairs = [p for e in experts for p in range(len(flat)) if flat[p] == e]
    sizes = [flat.count(e) for e in experts]
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    pairs = torch.tensor(pairs, dtype=torch.long)
    return pairs // ids.shape[1], torch.tensor(experts, dtype=torch.long), offsets, pairs


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("chosen", [None, [0, 2, 5], [3]])
def test_routed_call_computes_the_chosen_pairs_at_their_rows(native, monkeypatch, kernel, chosen):
    """experts_forward_routed groups the router's pairs itself (in C, or numpy without the kernel) and equals
    experts_forward on a grouping made by hand; rows of pairs not chosen keep what they held."""
    if kernel == "torch":
        monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")
    k, E = 3, 7
    x, ids, gate_up, down = routed_case(ce.max_native_tokens() + 3, k, E)
    rows, experts, offsets, dest = grouped_by_hand(ids, chosen)
    want = torch.full((ids.numel() + 2, x.shape[1]), 5.0, dtype=torch.bfloat16)
    ce.experts_forward(x, rows, experts, offsets, gate_up, down, out=want, out_rows=dest)
    out = torch.full_like(want, 5.0)
    assert ce.experts_forward_routed(x, ids.flatten(), k, chosen, gate_up, down, out) is out
    assert torch.equal(out, want)
    if chosen is not None:
        others = ~torch.isin(ids.flatten(), torch.tensor(chosen))
        assert others.any() and (out[:ids.numel()][others] == 5.0).all()


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_routed_call_rejects_bad_routing(native, monkeypatch, kernel):
    if kernel == "torch":
        monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")
    x, ids, gate_up, down = routed_case(4, 2, 5)
    out = torch.empty(8, x.shape[1], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expert_ids"):
        ce.experts_forward_routed(x, ids.flatten() + 5, 2, None, gate_up, down, out)
    with pytest.raises(ValueError, match="rows"):
        ce.experts_forward_routed(x[:3], ids.flatten(), 2, None, gate_up, down, out)
    with pytest.raises(ValueError, match="out_rows"):
        ce.experts_forward_routed(x, ids.flatten(), 2, None, gate_up, down, out[:7])


def test_activation_at_the_edges_of_the_range(native):
    """With identity experts, a token holding one value v (zeros elsewhere) gets act(v, v) = bf16(bf16(silu(v)) * v)
    at v's place: the kernel's exp, silu and roundings against torch's bf16 ops where exp overflows (silu(-100) is
    0, v silu(v) infinite), on denormals and on signed zeros. Special values equal, the rest within one bf16 step.
    Each token is a group of its own, so every path computes it with the FMAs (AMX tiles flush denormals)."""
    big = [3e38, 1e30, 1e10, 200.0, 88.0, 87.0]
    small = [1e-38, 1e-40, 1e-45]
    grid = torch.linspace(-100, 100, 384).tolist()
    values = torch.tensor([*grid, *big, *[-v for v in big], *small, *[-v for v in small], 0.0, -0.0])
    T, H = len(values), 32
    x = torch.zeros(T, H)
    x[torch.arange(T), torch.arange(T) % H] = values
    x = x.to(torch.bfloat16)
    eye = torch.eye(H, dtype=torch.bfloat16)
    one_each = torch.arange(T), torch.zeros(T, dtype=torch.long), torch.arange(T + 1)
    got = ce.native_experts_forward(x, *one_each, torch.cat([eye, eye])[None], eye[None])
    got = got[torch.arange(T), torch.arange(T) % H]
    v = values.to(torch.bfloat16)
    want = F.silu(v) * v  # torch's bf16 ops, each rounded to bf16
    finite = torch.isfinite(want) & (want != 0)
    assert torch.equal(got[~finite], want[~finite]) and torch.equal(got.signbit(), want.signbit())
    step = want[finite].float().abs() * 2 ** -7
    assert bool(((got[finite].float() - want[finite].float()).abs() <= step).all())
    assert int((got != want).sum()) <= 4  # exp to about an ulp: a rounding tie or two may go the other way


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fallback_equals_per_expert_loop(dtype):
    args = make_case(5, 48, 40, [1, 3, 0, 7], dtype=dtype)
    assert torch.equal(ce.experts_forward(*args), per_expert_loop(*args))


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")
    assert not ce.available()
    assert "MOEDESK_NO_NATIVE_KERNELS" in ce.unavailable_reason()
    args = make_case(5, 48, 40, [1, 3, 7])
    assert torch.equal(ce.experts_forward(*args), per_expert_loop(*args))
    with pytest.raises(RuntimeError, match="unavailable"):
        ce.native_experts_forward(*args)


def test_kernel_interleaved_with_torch_and_from_other_threads(native):
    """One process: torch's OpenMP matmuls, the kernel's own pool, several calling threads."""
    cases = [make_case(8, 256, 160, [1, 4, 2], seed=s) for s in range(3)]
    ce.set_num_threads(2)
    want = [ce.native_experts_forward(*c) for c in cases]
    a = torch.randn(256, 256)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(3):
            for c, w in zip(cases, want):
                a = torch.tanh(a @ a.T / 256)
                assert torch.equal(ce.native_experts_forward(*c), w)
        errors = []

        def worker(k):
            try:
                for _ in range(5):
                    _ = a @ a
                    assert torch.equal(ce.native_experts_forward(*cases[k % 3]), want[k % 3])
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in pool), "a calling thread hangs"
        assert not errors, errors
    finally:
        torch.set_num_threads(threads_before)


def pool_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names


def test_forked_child_can_call_the_kernel(native):
    """The child of a fork has none of the parent's pool threads; the kernel must start new ones."""
    case = make_case(8, 128, 96, [2, 3])
    ce.set_num_threads(2)
    want = ce.native_experts_forward(*case)
    assert "moedesk-experts" in pool_threads()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report 1 for a correct result from a restarted pool, then leave without teardown
        try:
            ok = torch.equal(ce.native_experts_forward(*case), want) and "moedesk-experts" in pool_threads()
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 30)
    answer = os.read(read, 1) if ready else b""
    os.close(read)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert answer == b"1", "the forked child hung or computed a wrong result"


def test_build_failure_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    if find_compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv("MOEDESK_NO_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return missing_symbol; }\n")
    with pytest.raises(BuildError, match="compiling broken.c failed"):
        build_library(broken, ["-shared", "-fPIC"])
    monkeypatch.setattr(ce, "SOURCE", broken)
    monkeypatch.setattr(ce, "_state", {})
    if ce.cpu_reason() is None:
        assert not ce.available()
        assert "broken.c" in ce.unavailable_reason() and "\n" not in ce.unavailable_reason()
    args = make_case(3, 32, 16, [2, 1])
    assert torch.equal(ce.experts_forward(*args), per_expert_loop(*args))


def test_missing_compiler_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.delenv("MOEDESK_NO_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(ce, "_state", {})
    assert find_compiler() is None
    assert not ce.available()
    assert ce.unavailable_reason() in ("no C compiler found (install gcc or set CC)", ce.cpu_reason())


def test_library_is_cached_by_source_and_flags(monkeypatch, tmp_path):
    if find_compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))
    src = tmp_path / "one.c"
    src.write_text("int one(void) { return 1; }\n")
    first = build_library(src, ["-shared", "-fPIC"])
    assert build_library(src, ["-shared", "-fPIC"]) == first
    assert build_library(src, ["-shared", "-fPIC", "-O2"]) != first
    src.write_text("int one(void) { return 2; }\n")
    assert build_library(src, ["-shared", "-fPIC"]) != first
    src.write_text("int one(void) { return 3; }\n")
    built, threads = [], [threading.Thread(target=lambda: built.append(build_library(src, ["-shared", "-fPIC"])))
                          for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 3 and len(set(built)) == 1 and built[0].is_file()  # racing builds end with one library
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_thread_count_setting(monkeypatch):
    monkeypatch.delenv("MOEDESK_CPU_THREADS", raising=False)
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    expected = max(1, min(psutil.cpu_count(logical=False) or os.cpu_count(), allowed))
    assert ce.default_num_threads() == expected
    ce.set_num_threads(3)
    assert ce.get_num_threads() == 3
    ce.set_num_threads(None)
    monkeypatch.setenv("MOEDESK_CPU_THREADS", "5")  # a user's choice, e.g. to leave cores to other programs
    assert ce.default_num_threads() == 5
    monkeypatch.setenv("MOEDESK_CPU_THREADS", "none")  # not a count: the default
    assert ce.default_num_threads() == expected
    assert ce.get_num_threads() == expected
    with pytest.raises(ValueError):
        ce.set_num_threads(0)


def test_a_call_beside_the_caller_leaves_it_a_core(native):
    """The offload executor's CPU call on a worker thread while the caller queues copies: one thread fewer, and
    the setting back afterwards, also when the call raises."""
    lib = ce._lib()
    ce.set_num_threads(4)
    assert ce.call_beside_caller(lib.moe_get_threads) == 3
    assert lib.moe_get_threads() == 4

    def fails():
        raise RuntimeError("the call failed")
    with pytest.raises(RuntimeError):
        ce.call_beside_caller(fails)
    assert lib.moe_get_threads() == 4
    ce.set_num_threads(1)  # nothing to give up
    assert ce.call_beside_caller(lib.moe_get_threads) == 1


def cut(gate_up, down, lo, hi):
    """Stacks cut to intermediate rows [lo, hi): gate and up rows, down columns; the experts a call with rows
    computes are cut(..., 0, rows)."""
    F_ = down.shape[2]
    return torch.cat([gate_up[:, lo:hi], gate_up[:, F_ + lo:F_ + hi]], dim=1), down[:, :, lo:hi]


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("F_,choices", [(96, [32, 64, 96]), (100, [32, 64, 100])])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_routed_rows_computes_the_head_of_each_expert(native, monkeypatch, kernel, F_, choices, tokens):
    """rows = R (the GPU computes the tail rows at one token): the experts cut to intermediate rows [0, R),
    within the tolerances above of float64 and torch's bf16 path on the cut experts; R = F is the call without
    rows, bit for bit; the head plus the rest [R, F) in float64 is the whole expert."""
    if kernel == "torch":
        monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")
    k, E = 2, 4
    x, ids, gate_up, down = routed_case(tokens, k, E, F=F_, seed=tokens)
    x_rows, experts, offsets, dest = grouped_by_hand(ids, None)
    start = torch.full((ids.numel() + 1, x.shape[1]), 3.0, dtype=torch.bfloat16)
    whole = ce.experts_forward_routed(x, ids.flatten(), k, None, gate_up, down, start.clone())
    full = ce.reference_experts_forward(x.double(), x_rows, experts, offsets, gate_up.double(), down.double())
    for R in choices:
        out = ce.experts_forward_routed(x, ids.flatten(), k, None, gate_up, down, start.clone(), rows=R)
        assert out[-1].eq(3.0).all()  # the row of no pair is left alone
        if R == F_:
            assert torch.equal(out, whole)
            continue
        gu, dn = cut(gate_up, down, 0, R)
        exact = ce.reference_experts_forward(x.double(), x_rows, experts, offsets, gu.double(), dn.double())
        torch_bf16 = ce.reference_experts_forward(x, x_rows, experts, offsets, gu, dn)
        got = out[dest]
        err, torch_err = rel_err(got, exact), rel_err(torch_bf16, exact)
        assert err < 1e-2 and err <= 1.5 * torch_err + 1e-4, (err, torch_err)
        assert float((got.double() - exact).abs().max()) <= 0.03 * float(exact.abs().max())
        gu, dn = cut(gate_up, down, R, F_)
        tail = ce.reference_experts_forward(x.double(), x_rows, experts, offsets, gu.double(), dn.double())
        assert rel_err(got.double() + tail, full) < 1e-2


def test_routed_rows_with_a_group_above_the_native_limit(native):
    """A group the kernel leaves to torch (more than max_native_tokens()) is cut to the same rows; the kernel's
    groups equal the kernel on stacks cut beforehand, bit for bit (the same sums over the first R values)."""
    k, E, R = 2, 5, 32
    x, ids, gate_up, down = routed_case(ce.max_native_tokens() + 3, k, E, F=96)
    x_rows, experts, offsets, dest = grouped_by_hand(ids, None)
    out = ce.experts_forward_routed(x, ids.flatten(), k, None, gate_up, down,
                                    torch.zeros(ids.numel(), x.shape[1], dtype=torch.bfloat16), rows=R)
    gu, dn = cut(gate_up, down, 0, R)
    want = torch.zeros_like(out)
    ce.experts_forward(x, x_rows, experts, offsets, gu.contiguous(), dn.contiguous(), out=want, out_rows=dest)
    big = ids.flatten() == 0  # expert 0 takes every token: torch's group
    assert torch.equal(out[~big], want[~big])
    assert rel_err(out[big], want[big].double()) < 1e-2


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_bad_rows_raise(native, monkeypatch, kernel):
    if kernel == "torch":
        monkeypatch.setenv("MOEDESK_NO_NATIVE_KERNELS", "1")
    x, ids, gate_up, down = routed_case(3, 2, 4, F=100)
    out = torch.zeros(ids.numel(), x.shape[1], dtype=torch.bfloat16)
    for R in (0, -32, 132, 48, 99):
        with pytest.raises(ValueError, match="rows"):
            ce.experts_forward_routed(x, ids.flatten(), 2, None, gate_up, down, out, rows=R)
    assert not out.any()
