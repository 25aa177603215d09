"""All CPU-resident experts of one MoE layer for one step, in one native call.

Decoding puts a handful of tokens on each expert, so computing them is a matter of streaming
the experts' weights from RAM once at full bandwidth. torch runs one matmul after another, each
its own parallel region (overhead per small expert, and never the whole memory bandwidth); cpu_experts.c
computes every group of one call in one parallel region.

Layout of a call: `rows` lists indices into `x`, grouped by expert; group g is
rows[offsets[g]:offsets[g+1]] and uses expert expert_ids[g]; result row i is
down_e @ (silu(gate_e @ x[rows[i]]) * (up_e @ x[rows[i]])) with gate_up[e] = [gate; up].

Dispatch: the native kernel takes bf16 CPU tensors on an x86-64 CPU with AVX512F/BW/VL, or with AVX2 and FMA (most
desktop CPUs: the AVX2 build, the same arithmetic in 8 lanes from the same source), for groups of at most
max_native_tokens() tokens; everything else goes to `reference_experts_forward`, the engine's per-expert torch
arithmetic, except on the AVX2 build, which computes larger groups itself in slices of that many tokens (torch's bf16
matmuls without AVX-512 are slower at every size; docs/measurements.md, "The CPU experts kernel on AVX2"). Why 32 on
the AVX-512 FMA path: the kernel's FMAs read fewer bytes a second the more tokens share each weight, and past about 32
tokens torch's AMX matmuls, which keep their rate with more tokens, overtake them (docs/measurements.md, "The CPU
experts kernel"). tests/perf/bench_cpu_experts.py prints the crossover measured. Set MOEDESK_NO_NATIVE_KERNELS=1 to
force the torch path.

Paths inside the kernel: "amx" (the default where the CPU has AMX-BF16 and Linux grants the tile state) computes the
groups of 8 or more tokens (AMX_MIN in cpu_experts.c) with AMX-BF16 tiles, the same sums of exact bf16 products in
fp32, and the rest with the FMAs; "avx512" uses the FMAs for every group. On AMX a group of 8 to 32 tokens takes about
what one token does, the memory's speed (docs/measurements.md, "The CPU experts kernel"), so with AMX groups of up to
AMX_MAX_TOKENS stay native. `amx_reason()` says what is missing where AMX is not used; MOEDESK_EXPERTS_PATH=avx512 (or
`set_path("avx512")`) forces the FMAs, and set_path("amx") raises where AMX is missing. "avx2" is the AVX2 build's one
path: MOEDESK_EXPERTS_PATH=avx2 loads that build where AVX-512 is there too.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from moedesk.kernels.native_build import build_library, build_name, missing_cpu_flags, open_library

NATIVE_MAX_TOKENS = 32  # the FMA path's limit
# The AVX2 build outruns torch's bf16 matmuls, which lack AVX-512 there, at every size measured (docs/measurements.md,
# "The CPU experts kernel on AVX2"): larger groups go through it in slices of this many tokens, bounding its scratch.
AVX2_MAX_TOKENS = 64
# With AMX-BF16 an expert stays near memory speed to 24-32 tokens and beats torch to 64 (docs/measurements.md, "The
# CPU experts kernel")
AMX_MAX_TOKENS = 64
SOURCE = Path(__file__).with_name("cpu_experts.c")
HEADERS = [Path(__file__).with_name(name) for name in ("native_pool.h", "native_call.h", "routed_pairs.h",
                                                        "native_amx.h", "native_exp.h")]


def header_flag(paths: list[Path] = HEADERS) -> str:
    """A define naming the shared headers' content: build_library keys its cache on the source and the
    flags, so this makes an edit of a header build the libraries again."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in paths)).hexdigest()[:16]
    return f"-DMOEDESK_HEADERS={digest}"


_COMMON_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-Wall", header_flag()]
FLAGS = [*_COMMON_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]
AVX2_FLAGS = [*_COMMON_FLAGS, "-mavx2", "-mfma", "-DMOE_AVX2"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")
AVX2_CPU_FLAGS = ("avx2", "fma")
PATHS = ("avx512", "amx", "avx2")  # moe_get_path's codes
_ERRORS = {-1: "offsets must start at 0, end at len(rows) and not decrease",
           -2: "rows holds an index outside x", -3: "expert_ids holds an index outside the expert stack",
           -4: "out of memory for the kernel's scratch buffers", -5: "out_rows holds an index outside out",
           -6: "rows must be in (0, F] and a multiple of 32 unless F itself"}


def check_rows(rows: int | None, F: int) -> int:
    """The intermediate rows [0, rows) of F to compute (None: F), checked: 0 < rows <= F, and a multiple of 32
    unless it is F (the kernel's phase-1 blocks and split act rows go by 32); ValueError otherwise."""
    if rows is None:
        return F
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or not 0 < rows <= F \
            or (rows != F and rows % 32):
        raise ValueError(f"rows must be {F} or a multiple of 32 in (0, {F}) (the intermediate rows computed), "
                         f"not {rows!r}")
    return int(rows)


def _head(gate_up: torch.Tensor, down: torch.Tensor, rows: int | None):
    """One expert's gate_up [2F, H] and down [H, F] cut to intermediate rows [0, rows) (None or F: as they are)."""
    F_ = down.shape[-1]
    if rows is None or rows == F_:
        return gate_up, down
    return torch.cat([gate_up[:rows], gate_up[F_:F_ + rows]]), down[:, :rows]


def expert_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert with gate and up stacked in one [2F, H] weight: the engine's expert arithmetic
    on every device, and the native kernel's reference."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def reference_experts_forward(x, rows, expert_ids, offsets, gate_up, down, out=None, groups=None, out_rows=None,
                              f_rows=None):
    """The pure-torch path: one expert after another, as the engine computes a single expert.

    groups: only these group indices (the others' rows of `out` are left as they are). f_rows: only
    intermediate rows [0, f_rows) of F (see experts_forward_routed's `rows`).
    """
    _check_shapes(x, rows, expert_ids, offsets, gate_up, down)
    f_rows = check_rows(f_rows, down.shape[2])
    out = _output(out, out_rows, rows, x)
    if out_rows is not None and out_rows.numel() and not 0 <= int(out_rows.min()) <= int(out_rows.max()) < out.shape[0]:
        raise ValueError(_ERRORS[-5])
    bounds = offsets.tolist()
    ids = expert_ids.tolist()
    for g in range(len(ids)) if groups is None else groups:
        a, b = bounds[g], bounds[g + 1]
        if b > a:
            at = slice(a, b) if out_rows is None else out_rows[a:b]
            out[at] = expert_forward(x[rows[a:b]], *_head(gate_up[ids[g]], down[ids[g]], f_rows))
    return out


def _output(out, out_rows, rows, x):
    """The result tensor: `out` checked, or a new [len(rows), H] one."""
    if out_rows is not None:
        if out is None:
            raise ValueError("out_rows needs out")
        if out_rows.shape != rows.shape:
            raise ValueError(f"out_rows has shape {tuple(out_rows.shape)}, expected {tuple(rows.shape)}")
    elif out is None:
        return x.new_empty((rows.shape[0], x.shape[1]))
    elif out.shape[0] != rows.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, expected {rows.shape[0]}")
    if out.dim() != 2 or out.shape[1] != x.shape[1]:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected [*, {x.shape[1]}]")
    return out


def experts_forward(x, rows, expert_ids, offsets, gate_up, down, out=None, *, out_rows=None, native_max_tokens=None,
                    f_rows=None):
    """Result [len(rows), H] in x's dtype: the native kernel where it applies, torch elsewhere.

    out_rows: where each result row goes in `out` (then required), instead of row i at row i. f_rows: only
    intermediate rows [0, f_rows) of F (see experts_forward_routed's `rows`).
    """
    lib = _state.get("lib") if not _disabled() else None
    if lib is None and available():
        lib = _state["lib"]
    if (lib is not None and x.dtype == gate_up.dtype == down.dtype == torch.bfloat16 and x.device.type == "cpu"
            and gate_up.device.type == "cpu" and down.device.type == "cpu"):
        return _native(lib, x, rows, expert_ids, offsets, gate_up, down, out, out_rows, native_max_tokens, f_rows)
    return reference_experts_forward(x, rows, expert_ids, offsets, gate_up, down, out, out_rows=out_rows,
                                     f_rows=f_rows)


def experts_forward_routed(x, pair_expert, k: int, cpu_experts, gate_up, down, out, index=None, *,
                           rows: int | None = None):
    """Each (token, rank) pair of the chosen experts computed into its pair's row of `out`, from the routing
    as the router gives it: pair p = token p // k's rank p % k, routed to expert pair_expert[p].

    pair_expert: int64 CPU tensor [P], P <= len(x) * k; cpu_experts: the experts to compute here (None: all);
    out: [>= P, H]; rows of pairs not computed are left as they are. index: int64 CPU scratch of at least
    2P + 2E + 1 entries (E experts in the stacks), allocated when None. rows: compute only intermediate rows
    [0, rows) of F, i.e. each expert's output head act[:rows] @ down[:, :rows].T (the GPU computes the rest at
    one token, kernels/gpu_zero_copy.py); None: all F; a multiple of 32 unless F (`check_rows`).

    The decode path calls this for every MoE layer of every token. Where the native kernel applies, it groups the
    pairs itself and checks every index, so the call goes straight to it: grouping in numpy and `experts_forward`'s
    checks would cost a good share of a small-expert layer's time (docs/measurements.md, "The CPU experts kernel").
    Elsewhere numpy groups the pairs for `experts_forward`.
    """
    P, E = pair_expert.shape[0], gate_up.shape[0]
    R = check_rows(rows, gate_up.shape[1] // 2) if gate_up.dim() == 3 else rows
    if index is None or index.shape[0] < 2 * P + 2 * E + 1:
        index = torch.empty(2 * P + 2 * E + 1, dtype=torch.int64)
    lib = _state.get("lib")
    if (lib is not None and not _disabled() and pair_expert.dtype is torch.int64 and pair_expert.is_cpu
            and pair_expert.is_contiguous() and _fast_call_fits(x, index, gate_up, down, out)):
        chosen = None if cpu_experts is None else np.asarray(cpu_experts, dtype=np.int64)
        shape, skipped = (ctypes.c_int64 * 2)(), ctypes.c_int64(0)
        _, two_f, H = gate_up.shape
        limit = max_native_tokens(lib)
        rc = lib.moe_routed_experts_forward(
            x.data_ptr(), x.shape[0], x.stride(0), H, pair_expert.data_ptr(), P, k,
            None if chosen is None else chosen.ctypes.data, 0 if chosen is None else len(chosen),
            gate_up.data_ptr(), down.data_ptr(), E, two_f // 2, out.data_ptr(), out.stride(0), out.shape[0],
            limit, index.data_ptr(), shape, ctypes.byref(skipped), R)
        if rc != 0:
            raise ValueError(_ERRORS.get(rc, f"native kernel error {rc}"))
        if skipped.value:
            out_rows, x_rows, expert_ids, offsets = _index_parts(index, shape[0], shape[1])
            _large_groups(lib, x, x_rows, expert_ids, offsets, gate_up, down, out, out_rows, limit, R)
        return out
    experts_of = pair_expert.to("cpu", torch.int64).numpy()
    if P > x.shape[0] * k:
        raise ValueError(_ERRORS[-2])
    if P and not 0 <= experts_of.min() <= experts_of.max() < E:
        raise ValueError(_ERRORS[-3])
    if P > out.shape[0]:
        raise ValueError(_ERRORS[-5])
    chosen = np.flatnonzero(np.ones(P, dtype=bool) if cpu_experts is None else np.isin(experts_of, cpu_experts))
    order = chosen[np.argsort(experts_of[chosen], kind="stable")]
    experts, counts = np.unique(experts_of[order], return_counts=True)
    m, g = len(order), len(experts)
    words = index.numpy()
    words[:m], words[m:2 * m], words[2 * m:2 * m + g] = order, order // k, experts
    words[2 * m + g] = 0
    np.cumsum(counts, out=words[2 * m + g + 1:2 * m + 2 * g + 1])
    out_rows, x_rows, expert_ids, offsets = _index_parts(index, m, g)
    return experts_forward(x, x_rows, expert_ids, offsets, gate_up, down, out=out, out_rows=out_rows, f_rows=R)


def _large_groups(lib, x, rows, expert_ids, offsets, gate_up, down, out, out_rows, limit: int, f_rows=None) -> None:
    """The groups the kernel (`lib`) left alone, of more than `limit` tokens: through torch's matmuls, or with the AVX2
    build through the kernel again, in slices of `limit` tokens."""
    big = [g for g, n in enumerate(offsets.diff().tolist()) if n > limit]
    if PATHS[lib.moe_get_path()] == "avx2":
        bounds = offsets.tolist()
        for g in big:
            for a in range(bounds[g], bounds[g + 1], limit):
                b = min(a + limit, bounds[g + 1])
                one = torch.tensor([0, b - a])
                at = out[a:b] if out_rows is None else out
                _native(lib, x, rows[a:b], expert_ids[g:g + 1], one, gate_up, down, at,
                        None if out_rows is None else out_rows[a:b], limit, f_rows)
        return
    reference_experts_forward(x, rows, expert_ids, offsets, gate_up, down, out, groups=big, out_rows=out_rows,
                              f_rows=f_rows)


def _index_parts(index, m: int, groups: int):
    """out_rows, rows, expert_ids and offsets of m pairs in `groups` groups: views of a routed call's index."""
    return index[:m], index[m:2 * m], index[2 * m:2 * m + groups], index[2 * m + groups:2 * m + 2 * groups + 1]


def _fast_call_fits(x, index, gate_up, down, out) -> bool:
    """Everything the native kernel assumes and does not check itself: dtypes, devices, layouts, shapes.
    It runs for every MoE layer of every token, so it uses the cheap accessors (`is_cpu`, not `t.device.type`),
    and costs more right after a kernel call, whose streaming leaves the caller's caches cold
    (docs/measurements.md, "The CPU experts kernel")."""
    bf16 = torch.bfloat16
    if not (x.dtype is bf16 and gate_up.dtype is bf16 and down.dtype is bf16 and out.dtype is bf16
            and index.dtype is torch.int64 and x.is_cpu and gate_up.is_cpu and down.is_cpu and out.is_cpu
            and index.is_cpu and index.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()):
        return False
    xs, os_, gs, ds = x.shape, out.shape, gate_up.shape, down.shape
    return (len(xs) == len(os_) == 2 and len(gs) == len(ds) == 3 and x.stride(1) == out.stride(1) == 1
            and gs[2] == xs[1] == os_[1] == ds[1] > 0 and gs[1] == 2 * ds[2] > 0 and gs[0] == ds[0])


def native_experts_forward(x, rows, expert_ids, offsets, gate_up, down, out=None, *, out_rows=None,
                           native_max_tokens=None, f_rows=None):
    """The native kernel for groups of at most native_max_tokens (default max_native_tokens()), torch for
    larger ones; raises RuntimeError where the kernel is unavailable. f_rows: see `experts_forward`."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"native CPU experts kernel unavailable: {reason}")
    if not (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        raise TypeError("the native kernel takes bfloat16 x, gate_up and down")
    if not (x.device.type == gate_up.device.type == down.device.type == "cpu"):
        raise TypeError("the native kernel takes CPU tensors")
    return _native(_state["lib"], x, rows, expert_ids, offsets, gate_up, down, out, out_rows, native_max_tokens,
                   f_rows)


def _index(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to("cpu", torch.int64).contiguous()


def _native(lib, x, rows, expert_ids, offsets, gate_up, down, out, out_rows, native_max_tokens, f_rows=None):
    _check_shapes(x, rows, expert_ids, offsets, gate_up, down)
    f_rows = check_rows(f_rows, down.shape[2])
    target = _output(out, out_rows, rows, x)
    if gate_up.shape[1] == 0 or x.shape[1] == 0:  # degenerate experts: nothing to stream
        return reference_experts_forward(x, rows, expert_ids, offsets, gate_up, down, target, out_rows=out_rows)
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("gate_up and down must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, expert_ids, offsets = _index(rows), _index(expert_ids), _index(offsets)
    if out_rows is not None:
        out_rows = _index(out_rows)
    out = target
    if out.dtype != torch.bfloat16 or out.device.type != "cpu" or out.stride(1) != 1:
        # A bf16 stand-in; with out_rows it starts as a copy, since only the listed rows are written.
        out = (torch.empty(target.shape, dtype=torch.bfloat16) if out_rows is None
               else target.to("cpu", torch.bfloat16, copy=True).contiguous())
    limit = max_native_tokens(lib) if native_max_tokens is None else native_max_tokens
    skipped = ctypes.c_int64(0)
    E, two_f = gate_up.shape[0], gate_up.shape[1]
    rc = lib.moe_experts_forward(
        x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], rows.data_ptr(), rows.shape[0], expert_ids.data_ptr(),
        offsets.data_ptr(), expert_ids.shape[0], gate_up.data_ptr(), down.data_ptr(), E, two_f // 2,
        out.data_ptr(), out.stride(0), None if out_rows is None else out_rows.data_ptr(), out.shape[0], limit,
        ctypes.byref(skipped), f_rows)
    if rc != 0:
        raise ValueError(_ERRORS.get(rc, f"native kernel error {rc}"))
    if skipped.value:
        _large_groups(lib, x, rows, expert_ids, offsets, gate_up, down, out, out_rows, limit, f_rows)
    if target is not out:
        target.copy_(out)
    return target


def _check_shapes(x, rows, expert_ids, offsets, gate_up, down) -> None:
    if x.dim() != 2 or rows.dim() != 1 or expert_ids.dim() != 1 or offsets.shape != (expert_ids.shape[0] + 1,):
        raise ValueError("expected x [N, H], rows [M], expert_ids [G], offsets [G+1]")
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError("expected gate_up [E, 2F, H] and down [E, H, F]")
    E, two_f, H = gate_up.shape
    if two_f % 2 or H != x.shape[1] or tuple(down.shape) != (E, H, two_f // 2):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)}")


# ---------------------------------------------------------------- availability and settings

_lock = threading.Lock()
_state: dict = {}  # "lib" or "reason", once the library was loaded or found impossible
_threads: int | None = None
_spin_us: int | None = None
DEFAULT_SPIN_US = 20_000  # native_pool.h's spin_ns


def _disabled() -> bool:
    return os.environ.get("MOEDESK_NO_NATIVE_KERNELS", "").strip().lower() not in ("", "0", "false", "no")


@lru_cache(maxsize=1)
def cpu_reason() -> str | None:
    """Why this CPU cannot run the kernel (neither build), or None when it can."""
    if avx512_reason() is None:
        return None
    return missing_cpu_flags(AVX2_CPU_FLAGS, "AVX2 and FMA")


def avx512_reason() -> str | None:
    """Why this CPU cannot run the AVX-512 build (nor its AMX path), or None when it can."""
    return missing_cpu_flags(CPU_FLAGS, "AVX-512")


def _build_flags() -> list[str]:
    """The build this process loads: AVX-512 where the CPU has it, unless MOEDESK_EXPERTS_PATH=avx2 asks for the
    other; AVX2 elsewhere."""
    wanted = os.environ.get("MOEDESK_EXPERTS_PATH", "").strip().lower()
    return AVX2_FLAGS if wanted == "avx2" or avx512_reason() else FLAGS


def unavailable_reason() -> str | None:
    """One line saying why the native kernel is not used, or None when it is."""
    if _disabled():
        return "disabled by MOEDESK_NO_NATIVE_KERNELS"
    if "lib" not in _state and "reason" not in _state:
        _load()
    return _state.get("reason")


def available() -> bool:
    return unavailable_reason() is None


def cpu_runs_it() -> bool:
    """Whether this CPU can run a build of the kernel and it is not disabled, asked before any build: what a load
    asks before keeping experts in bfloat16 for it (engine.load.loader.expert_stack_dtype)."""
    return cpu_reason() is None and not _disabled()


def build_id() -> str:
    """native_build.build_name of the library in use; "" without one."""
    return build_name(_state["lib"]) if available() else ""


def describe() -> str:
    """What computes CPU experts here, for profiles' cache keys and `moedesk profile`."""
    reason = unavailable_reason()
    if reason is None:
        path = get_path()
        isa = "AVX2" if path == "avx2" else "AVX-512"
        amx = ", AMX-BF16 from 8 tokens" if path == "amx" else ""
        return (f"native {isa} kernel{amx}, {get_num_threads()} threads "
                f"(bf16, up to {max_native_tokens()} tokens per expert)")
    return f"torch ({reason})"


def _load() -> None:
    with _lock:
        if _state:
            return
        flags = _build_flags()
        lib, reason = open_library(SOURCE, flags, cpu_reason(), "moe_cpu_supported",
                                   f"the OS does not enable {'AVX' if flags is AVX2_FLAGS else 'AVX-512'} state (XCR0)")
        if reason is not None:
            _state["reason"] = reason
            return
        _configure(lib)
        lib.moe_set_path(_wanted_path())
        _state["lib"] = lib


def _configure(lib) -> None:
    """Argument types, and this process's thread and spin settings."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.moe_experts_forward.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64,
                                        ptr, i64, ptr, i64, i64, ctypes.POINTER(i64), i64]
    lib.moe_experts_forward.restype = ctypes.c_int
    lib.moe_routed_experts_forward.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64,
                                               ptr, i64, i64, i64, ptr, ctypes.POINTER(i64), ctypes.POINTER(i64), i64]
    lib.moe_routed_experts_forward.restype = ctypes.c_int
    lib.moe_set_threads.argtypes = [ctypes.c_int]
    lib.moe_set_spin_us.argtypes = [i64]
    lib.moe_get_threads.restype = ctypes.c_int
    lib.moe_set_path.argtypes = [c_int]
    lib.moe_set_path.restype = c_int
    lib.moe_get_path.restype = c_int
    lib.moe_amx_supported.restype = c_int
    lib.moe_amx_status.restype = c_int
    lib.moe_set_threads(_threads or default_num_threads())
    if _spin_us is not None:
        lib.moe_set_spin_us(_spin_us)


def _wanted_path() -> int:
    """MOEDESK_EXPERTS_PATH's path code; unset: amx (moe_set_path falls back to avx512 where AMX is missing; the
    AVX2 build has its one path whatever it is asked)."""
    wanted = os.environ.get("MOEDESK_EXPERTS_PATH", "").strip().lower()
    if wanted and wanted not in PATHS:
        raise ValueError(f"MOEDESK_EXPERTS_PATH must be one of {', '.join(PATHS)}, not {wanted!r}")
    return PATHS.index(wanted or "amx")


def max_native_tokens(lib=None) -> int:
    """The most tokens of one expert the kernel computes; larger groups go to torch. lib: the loaded library,
    where the caller has it (the per-layer calls), so asking costs one read of its path."""
    if lib is None:
        if not available():
            return NATIVE_MAX_TOKENS
        lib = _state["lib"]
    return {"amx": AMX_MAX_TOKENS, "avx2": AVX2_MAX_TOKENS}.get(PATHS[lib.moe_get_path()], NATIVE_MAX_TOKENS)


def _lib():
    if not available():
        raise RuntimeError(f"native CPU experts kernel unavailable: {unavailable_reason()}")
    return _state["lib"]


def amx_supported() -> bool:
    """AMX-BF16 usable here (CPU, OS state and the process's tile permission), or emulated by the build in use."""
    return available() and bool(_state["lib"].moe_amx_supported())


def amx_reason() -> str | None:
    """Why the AMX path cannot run here, or None when it can."""
    if not available():
        return unavailable_reason()
    status = _state["lib"].moe_amx_status()
    reasons = {0: None, -1: "the CPU lacks AMX-BF16", -2: "the OS does not enable the AMX tile state (XCR0)",
               -3: "the CPU or OS lacks AVX-512"}
    if status in reasons:
        return reasons[status]
    return f"Linux refused this process the AMX tile state: {os.strerror(status)}" + (
        " (a thread's signal stack is too small for it)" if status == errno.ENOSPC else "")


def set_path(name: str | None) -> str:
    """Pick the kernel's path: "amx" (AMX-BF16 tiles for experts with 8+ tokens, the FMAs for the rest),
    "avx512" (the FMAs only), or None for the default (MOEDESK_EXPERTS_PATH, else "amx" where it can run). Returns the path
    in use; asking for AMX where the CPU or OS lacks it raises ValueError. The AVX2 build (MOEDESK_EXPERTS_PATH=avx2 at
    the first call, or a CPU without AVX-512) has one path, "avx2"; the others are refused there, and "avx2" on the
    AVX-512 build."""
    if name is not None and name not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)} or None, not {name!r}")
    lib = _lib()
    if name is not None and (name == "avx2") != (get_path() == "avx2"):
        raise ValueError(f"the {get_path()} build of the kernel is loaded: path {name!r} is the other build's")
    if name == "amx" and not lib.moe_amx_supported():
        raise ValueError(f"no AMX here: {amx_reason()}")
    lib.moe_set_path(_wanted_path() if name is None else PATHS.index(name))
    return get_path()


def get_path() -> str:
    return PATHS[_lib().moe_get_path()]


def build_variant(defines: list[str]):
    """This kernel built with extra compiler flags (e.g. ["-DMOE_AMX_EMULATE"], ["-DAMX_MIN=4"]) and configured
    like the one in use, for tests and for measuring alternatives side by side. Hand it to `use_library` to route
    calls through it. Its thread pool is its own."""
    lib = ctypes.CDLL(str(build_library(SOURCE, [*(AVX2_FLAGS if get_path() == "avx2" else FLAGS), *defines])))
    _configure(lib)
    lib.moe_set_path(_lib().moe_get_path())
    return lib


def use_library(lib):
    """Route calls through `lib` (a `build_variant`, or the library returned before); returns the one replaced."""
    before, _state["lib"] = _lib(), lib
    return before


def default_num_threads() -> int:
    """One per physical core (of those this process may use): workers on all cores but one, plus the calling
    thread, which drives the GPU. The workers leave it that core; it computes its share only while it has
    nothing to queue on the GPU (the executor queues copies and resident experts first). Against one worker fewer,
    batched decode and prefill gained and decode held (docs/measurements.md, "The CPU experts kernel")."""
    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = os.cpu_count() or physical
    chosen = os.environ.get("MOEDESK_CPU_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return max(1, min(physical, allowed))


def set_num_threads(n: int | None) -> None:
    """Threads per call, the calling thread included; None restores the default."""
    global _threads
    if n is not None and n < 1:
        raise ValueError("thread count must be at least 1")
    _threads = n
    if "lib" in _state:
        _state["lib"].moe_set_threads(n or default_num_threads())


def get_num_threads() -> int:
    return _threads or default_num_threads()


def call_beside_caller(fn):
    """fn(), a call into these kernels made on a worker thread while the calling thread keeps busy (the offload
    executor queueing a step's copies, `overlap_copies`): one thread fewer, so the two do not share a core."""
    lib = _state.get("lib")
    n = lib.moe_get_threads() if lib is not None else 1
    if n < 2:
        return fn()
    lib.moe_set_threads(n - 1)
    try:
        return fn()
    finally:
        lib.moe_set_threads(n)


@contextmanager
def not_spinning():
    """Idle workers sleep at once for the block, then spin as set again: for work whose torch ops between the calls
    need every core (a long prompt's attention on a CPU-only load)."""
    before = _spin_us
    set_spin_us(0)
    try:
        yield
    finally:
        set_spin_us(DEFAULT_SPIN_US if before is None else before)


def set_spin_us(us: int) -> None:
    """How long idle workers keep spinning for the next call before they sleep (default 20 ms).

    It must bridge the GPU work between two layers' calls (1-2 ms per layer in eager decode), or
    every call starts by waking sleeping threads (tests/perf/profile_decode.py --spin measures it;
    docs/measurements.md, "The CPU experts kernel").
    The workers never spin while torch computes large groups, and sleep once a generation ends."""
    global _spin_us
    _spin_us = int(us)
    if "lib" in _state:
        _state["lib"].moe_set_spin_us(_spin_us)
