"""All CPU-resident packed experts of one MoE layer for one step, in one native call (cpu_quant.c).

kernels/experts.py sends packed `ExpertWeights` here when `applies` says so; the contract is
kernels.experts.reference_routed's: pair p = token p // k's rank p % k, routed to expert
pair_expert[p]; the chosen experts' pairs are computed into out's row p, other rows left alone.

The arithmetic is the formats' own (kernels/quant_formats.py) with two differences from dequantising
to float: activations and act rows are quantised to int8 per 32 values for integer dot products,
and act = silu(gate) * up is fp32; the header of cpu_quant.c says why. Both gate_up and down must
be packed (any of q4_0, q8_0, q4_k, q5_k, q6_k, mxfp4, the two may differ); x and out bf16 or float32.
gpt-oss's expert function (ExpertWeights' gate_up_bias, down_bias and ClampedSwiGLU) is computed in the
same call: the biases in fp32 around the dot products, the clamped activation in place of silu.

Paths: AVX512-VNNI where the CPU has it, AVX2 otherwise (the library needs AVX2, FMA and F16C; where the CPU
has AVX-VNNI, as Intel's desktop cores since Alder Lake do, the library is built to use it on the AVX2 path).
MOEDESK_QUANT_PATH=avx2 (or `set_path("avx2")`) forces the fallback; MOEDESK_QUANT_PATH=amx (or
`set_path("amx")`) computes the experts with 8 or more tokens with AMX-INT8 tiles (Sapphire Rapids and
later, Linux granting the tile state), the rest with VNNI. The engine's start-up profile takes it where its
results match VNNI's and it measured faster at prefill loads (engine.offload.cpu_paths); it has not yet run on
such a CPU. MOEDESK_NO_NATIVE_KERNELS=1 turns the kernel off (kernels/experts.py then uses its dequantising
reference).
"""
from __future__ import annotations

import ctypes
import os
import threading
from functools import lru_cache, partial
from pathlib import Path

import numpy as np
import torch

from moedesk.kernels import cpu_experts
from moedesk.kernels.expert_weights import ClampedSwiGLU, ExpertWeights
from moedesk.kernels.native_build import build_name, missing_cpu_flags, open_library
from moedesk.kernels.quant_formats import FORMATS

SOURCE = Path(__file__).with_name("cpu_quant.c")
FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-Wall", "-mavx2", "-mfma", "-mf16c",
         cpu_experts.header_flag()]
CPU_FLAGS = ("avx2", "fma", "f16c")
AVXVNNI = "-DMQ_AVXVNNI"  # the AVX2 path's dot products in AVX-VNNI; `build_variant(["-UMQ_AVXVNNI"])` builds without
FORMAT_CODES = {"q4_0": 0, "q8_0": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4, "mxfp4": 5}
PATHS = ("avx2", "vnni", "amx")  # mq_get_path's codes
_ERRORS = {-2: "more pairs than tokens * k", -3: "pair_expert or chosen holds an index outside the expert stack",
           -4: "out of memory for the kernel's scratch buffers", -5: "more pairs than rows of out",
           -6: "unsupported packed format",
           -7: "H and F must be whole blocks of their formats, rows a multiple of 32 and of the down format's block"}
_FLOATS = (torch.bfloat16, torch.float32)

_lock = threading.Lock()
_state: dict = {}  # "lib" or "reason", once the library was loaded or found impossible


def _disabled() -> bool:
    return os.environ.get("MOEDESK_NO_NATIVE_KERNELS", "").strip().lower() not in ("", "0", "false", "no")


def applies(x: torch.Tensor, w: ExpertWeights) -> bool:
    """Whether `experts_forward_routed` runs natively for x and w: CPU tensors, both halves packed in a
    supported format, x bf16 or float32, no expert function but gpt-oss's (biases on the CPU, ClampedSwiGLU),
    and the library built for this CPU. Runs per layer per token, so it uses the cheap accessors."""
    if (w.gate_up_format not in FORMAT_CODES or w.down_format not in FORMAT_CODES or x.dtype not in _FLOATS
            or not x.is_cpu or not w.gate_up.is_cpu or not w.down.is_cpu or _disabled()):
        return False
    if not computes_function(w) or not all(b is None or b.is_cpu for b in (w.gate_up_bias, w.down_bias)):
        return False
    return "lib" in _state or (not _state and available())


def computes_function(w: ExpertWeights) -> bool:
    """Whether the kernel computes w's expert function: SwiGLU, or gpt-oss's ClampedSwiGLU, biases or not."""
    return w.glu is None or type(w.glu) is ClampedSwiGLU


def check_rows(rows: int | None, w: ExpertWeights) -> int:
    """`rows` of a routed call on packed stacks w, checked: the intermediate rows to compute, [0, rows) of
    F = w.width (None: F). 0 < rows <= F, a multiple of 32 and of the down format's block (the kernel quantises
    act rows per 32 and reads each down row's first rows / block blocks); ValueError otherwise."""
    F = w.width
    if rows is None:
        return F
    step = max(32, FORMATS[w.down_format].block) if w.down_format in FORMATS else 32
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or not 0 < rows <= F or rows % step:
        raise ValueError(f"rows must be a multiple of {step} in (0, {F}] (the intermediate rows computed), "
                         f"not {rows!r}")
    return int(rows)


def experts_forward_routed(x, pair_expert, k: int, chosen, w: ExpertWeights, out, index=None, *,
                           rows: int | None = None):
    """Each (token, rank) pair of the chosen experts computed into its pair's row of `out`.

    x [N, H] bf16/float32; pair_expert int64 [P], P <= N * k; chosen: expert ids (None: all); out [>= P, H]
    bf16 or float32 (another float dtype goes through a float32 copy). index: int64 CPU scratch of at least
    2P + 2E + 1 entries, reused across calls (the decode path passes one), allocated when None or too small.
    rows: compute only intermediate rows [0, rows) of F, i.e. each expert's output head act[:rows] @
    down[:, :rows].T (the GPU computes the rest at one token, kernels/gpu_zero_copy.py); None: all F. A multiple
    of 32 and of the down format's block (`check_rows`).
    Raises ValueError on bad indices or rows.
    """
    lib = _loaded()
    if x.dim() == 2 and x.stride(1) != 1:
        x = x.contiguous()
    pe = pair_expert
    if not (pe.dtype is torch.int64 and pe.is_cpu and pe.is_contiguous()):
        pe = pe.to("cpu", torch.int64).contiguous()
    target = out
    if out.dtype not in _FLOATS or not out.is_cpu or out.stride(1) != 1:
        out = target.to("cpu", torch.float32, copy=True).contiguous()  # a copy: rows not computed stay as they are
    if not _index_fits(index, pe.shape[0], w.num_experts):
        index = torch.empty(2 * pe.shape[0] + 2 * w.num_experts + 1, dtype=torch.int64)
    args, keep = _routed_args(x, pe, k, chosen, w, out, index, rows)  # keep: alive until the call returns
    _check_rc(lib.mq_routed_forward(*args))
    del keep
    if target is not out:
        target.copy_(out)
    return target


def linear_applies(x: torch.Tensor, rows: torch.Tensor, fmt: str) -> bool:
    """Whether `linear` takes x and the packed matrix `rows` [M, row_bytes]: CPU tensors, x bf16 or float32, a
    format of the kernel's, the library built for this CPU (as `applies`)."""
    return (fmt in FORMAT_CODES and x.dtype in _FLOATS and x.is_cpu and rows.is_cpu and rows.dtype == torch.uint8
            and not _disabled() and ("lib" in _state or (not _state and available())))


def linear(x: torch.Tensor, rows: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for one packed matrix W [M, K] held as its rows [M, row_bytes(K)] (a CPU load's
    attention projection, shared expert, head): x [N, K] -> [N, M] in x's dtype, in one native call that reads
    each weight once for all N rows. The arithmetic is the experts' (x quantised to int8 per 32 values)."""
    lib = _loaded()
    k = x.shape[-1]
    if x.dim() != 2 or rows.dim() != 2 or fmt not in FORMAT_CODES or k % max(32, FORMATS[fmt].block) \
            or rows.shape[1] != FORMATS[fmt].row_bytes(k):
        raise ValueError(f"{fmt} rows {tuple(rows.shape)} cannot multiply x {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if not rows.is_contiguous():
        rows = rows.contiguous()
    n, m = x.shape[0], rows.shape[0]
    if bias is not None and (bias.dtype not in _FLOATS or not bias.is_contiguous() or not bias.is_cpu):
        bias = bias.to("cpu", torch.float32).contiguous()
    out = torch.empty(n, m, dtype=x.dtype)
    index = torch.empty(2 * n + 3, dtype=torch.int64)
    f32, bias_f32 = int(x.dtype is torch.float32), int(bias is not None and bias.dtype is torch.float32)
    _check_rc(lib.mq_linear(x.data_ptr(), n, x.stride(0), f32, k, rows.data_ptr(), m, FORMAT_CODES[fmt],
                            None if bias is None else bias.data_ptr(), bias_f32, out.data_ptr(), m, f32,
                            index.data_ptr()))
    return out


def prepare_routed(x, pair_expert, k: int, chosen, w: ExpertWeights, out, index, *, rows: int | None = None):
    """`experts_forward_routed` checked and its arguments built once, as a function of no arguments that makes
    the call: for a caller that repeats it on the same buffers (a handed-over decode step's layers), whose
    contents it reads at each call. The tensors must be what the kernel takes as they are: x and out bf16 or
    float32 CPU rows, pair_expert int64 contiguous, index big enough (ValueError otherwise). The checks, in
    Python, are paid here once instead of at every layer of every token."""
    lib = _loaded()
    args, keep = _routed_args(x, pair_expert, k, chosen, w, out, index, rows)
    pe = pair_expert
    if x.stride(1) != 1 or out.dtype not in _FLOATS or not out.is_cpu or out.stride(1) != 1 \
            or not (pe.dtype is torch.int64 and pe.is_cpu and pe.is_contiguous()):
        raise ValueError("prepare_routed takes x, out and pair_expert only as the kernel reads them")
    if not _index_fits(index, pe.shape[0], w.num_experts):
        raise ValueError(f"index must be int64 CPU scratch of at least {2 * pe.shape[0] + 2 * w.num_experts + 1} "
                         "entries")
    call = partial(lib.mq_routed_forward, *args)

    def run() -> None:
        _check_rc(call())

    run.keep = keep  # the memory the pointers point into
    return run


def _loaded():
    """The kernel's library, loaded; RuntimeError saying why where it cannot be."""
    lib = _state.get("lib")
    if lib is None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"native packed-experts kernel unavailable: {reason}")
        lib = _state["lib"]
    return lib


def _index_fits(index, pairs: int, experts: int) -> bool:
    return index is not None and index.numel() >= 2 * pairs + 2 * experts + 1 and index.dtype is torch.int64 \
        and index.is_contiguous() and index.is_cpu


def _routed_args(x, pe, k: int, chosen, w: ExpertWeights, out, index, rows) -> tuple[tuple, tuple]:
    """mq_routed_forward's arguments for tensors laid out as it reads them (the callers see to that), after the
    checks of shapes, dtype and rows; and the tensors whose memory they point into."""
    H, F = w.hidden, w.width
    R = check_rows(rows, w)
    if x.dim() != 2 or x.shape[1] != H or out.dim() != 2 or out.shape[1] != H:
        raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} must be [*, {H}]")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be bfloat16 or float32, not {x.dtype}")
    picked = None if chosen is None else np.ascontiguousarray(np.asarray(
        chosen.cpu() if isinstance(chosen, torch.Tensor) else chosen, dtype=np.int64).reshape(-1))
    gate_up, down = w.gate_up, w.down
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        gate_up, down = gate_up.contiguous(), down.contiguous()
    gu_bias, d_bias, bias_f32 = _biases(w)
    glu = w.glu
    args = (x.data_ptr(), x.shape[0], x.stride(0), int(x.dtype is torch.float32), H, pe.data_ptr(), pe.shape[0], k,
            None if picked is None else picked.ctypes.data, 0 if picked is None else len(picked),
            gate_up.data_ptr(), down.data_ptr(), w.num_experts, F, FORMAT_CODES[w.gate_up_format],
            FORMAT_CODES[w.down_format], out.data_ptr(), out.stride(0), out.shape[0], int(out.dtype is torch.float32),
            index.data_ptr(), R, None if gu_bias is None else gu_bias.data_ptr(),
            None if d_bias is None else d_bias.data_ptr(), bias_f32, int(glu is not None),
            0.0 if glu is None else float(glu.alpha), 0.0 if glu is None else float(glu.limit))
    return args, (x, pe, picked, gate_up, down, out, index, gu_bias, d_bias)


def _biases(w: ExpertWeights):
    """(gate_up bias, down bias, whether they are float32): as the kernel reads them, contiguous and of one dtype,
    bf16 or float32 (as a model keeps them they are already; anything else is copied to float32)."""
    biases = [w.gate_up_bias, w.down_bias]
    present = [b for b in biases if b is not None]
    if not present:
        return None, None, 0
    shapes = ((w.num_experts, 2 * w.width), (w.num_experts, w.hidden))
    if any(b is not None and tuple(b.shape) != shape for b, shape in zip(biases, shapes)):
        raise ValueError(f"expert biases must be [E, 2F] and [E, H] for E={w.num_experts}, F={w.width}, "
                         f"H={w.hidden}")
    dtype = present[0].dtype if present[0].dtype in _FLOATS and all(b.dtype == present[0].dtype for b in present) \
        else torch.float32
    biases = [None if b is None else b.to("cpu", dtype).contiguous() for b in biases]
    return biases[0], biases[1], int(dtype is torch.float32)


def _check_rc(rc: int) -> None:
    if rc != 0:
        raise ValueError(_ERRORS.get(rc, f"native kernel error {rc}"))


# ---------------------------------------------------------------- availability and settings

@lru_cache(maxsize=1)
def cpu_reason() -> str | None:
    """Why this CPU cannot run the kernel at all, or None when it can (AVX2 is the least it needs)."""
    return missing_cpu_flags(CPU_FLAGS, "AVX2")


def unavailable_reason() -> str | None:
    """One line saying why the kernel is not used, or None when it is."""
    if _disabled():
        return "disabled by MOEDESK_NO_NATIVE_KERNELS"
    if not _state:
        _load()
    return _state.get("reason")


def available() -> bool:
    return unavailable_reason() is None


def _load() -> None:
    with _lock:
        if _state:
            return
        lib, reason = open_library(SOURCE, _flags(), cpu_reason(), "mq_cpu_supported",
                                   "the CPU or OS lacks AVX2, FMA or F16C")
        if reason is not None:
            _state["reason"] = reason
            return
        _configure(lib)
        lib.mq_set_path(_wanted_path(lib))
        _state["lib"] = lib


def _flags() -> list[str]:
    """FLAGS, and AVXVNNI where every core has AVX-VNNI (same register state as AVX2, so nothing more to check)."""
    return [*FLAGS, AVXVNNI] if missing_cpu_flags(("avx_vnni",), "AVX-VNNI") is None else FLAGS


def _configure(lib) -> None:
    """Argument types, and the process's one pool: cpu_experts' where its library runs here, so threads and
    spinning are shared."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.mq_routed_forward.argtypes = [ptr, i64, i64, c_int, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64,
                                      c_int, c_int, ptr, i64, i64, c_int, ptr, i64, ptr, ptr, c_int, c_int,
                                      ctypes.c_float, ctypes.c_float]
    lib.mq_routed_forward.restype = c_int
    lib.mq_linear.argtypes = [ptr, i64, i64, c_int, i64, ptr, i64, c_int, ptr, c_int, ptr, i64, c_int, ptr]
    lib.mq_linear.restype = c_int
    lib.mq_set_path.argtypes = [c_int]
    lib.mq_set_path.restype = c_int
    lib.mq_get_path.restype = c_int
    lib.mq_vnni_supported.restype = c_int
    lib.mq_amx_supported.restype = c_int
    lib.mq_allow_vbmi.argtypes = [c_int]
    lib.mq_allow_vbmi.restype = c_int
    lib.mq_lane_vnni.restype = c_int
    lib.mq_set_threads.argtypes = [c_int]
    lib.mq_set_spin_us.argtypes = [i64]
    lib.mq_use_pool.argtypes = [ptr, ptr]
    if not cpu_experts._disabled() and cpu_experts.available():
        bf16 = cpu_experts._state["lib"]
        lib.mq_use_pool(ctypes.cast(bf16.moe_pool_run, ptr), ctypes.cast(bf16.moe_get_threads, ptr))
    else:
        lib.mq_set_threads(cpu_experts.get_num_threads())


def set_num_threads(n: int) -> None:
    """The packed kernel's threads: cpu_experts' pool, which it runs on where that library is loaded, else its own
    (the library in use; a `build_variant` routed through later keeps the count it was built with)."""
    cpu_experts.set_num_threads(n)
    lib = _state.get("lib")
    if lib is not None and (cpu_experts._disabled() or not cpu_experts.available()):
        lib.mq_set_threads(n)


def build_variant(defines: list[str]):
    """This kernel built with extra compiler flags (e.g. ["-DPREFETCH=2048"]) and configured like the one in
    use, for measuring alternatives side by side (tests/perf/bench_cpu_quant.py --define). Hand it to
    `use_library` to route calls through it."""
    from moedesk.kernels.native_build import build_library
    if not available():
        raise RuntimeError(f"native packed-experts kernel unavailable: {unavailable_reason()}")
    lib = ctypes.CDLL(str(build_library(SOURCE, [*_flags(), *defines])))
    _configure(lib)
    lib.mq_set_path(_state["lib"].mq_get_path())
    return lib


def use_library(lib):
    """Route calls through `lib` (a `build_variant`, or the library returned before); returns the one replaced."""
    if not available():
        raise RuntimeError(f"native packed-experts kernel unavailable: {unavailable_reason()}")
    before, _state["lib"] = _state["lib"], lib
    return before


def _wanted_path(lib) -> int:
    """MOEDESK_QUANT_PATH's path code (mq_set_path falls back from a path the CPU lacks); unset: VNNI."""
    wanted = os.environ.get("MOEDESK_QUANT_PATH", "").strip().lower()
    if wanted and wanted not in PATHS:
        raise ValueError(f"MOEDESK_QUANT_PATH must be one of {', '.join(PATHS)}, not {wanted!r}")
    return PATHS.index(wanted or "vnni")


def vnni_supported() -> bool:
    return available() and bool(_state["lib"].mq_vnni_supported())


def amx_supported() -> bool:
    """AMX-INT8 usable here (CPU, OS state and the process's tile permission), or emulated by the build in use."""
    return available() and bool(_state["lib"].mq_amx_supported())


def set_path(name: str | None) -> str:
    """Pick the dot-product path: "amx" (AMX-INT8 tiles for experts with 8+ tokens, VNNI for the rest), "vnni",
    "avx2", or None for the default (VNNI where the CPU has it). Returns the path in use; asking for one the
    CPU lacks raises ValueError."""
    if name is not None and name not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)} or None, not {name!r}")
    if not available():
        raise RuntimeError(f"native packed-experts kernel unavailable: {unavailable_reason()}")
    lib = _state["lib"]
    if name == "vnni" and not lib.mq_vnni_supported():
        raise ValueError("this CPU lacks AVX512-VNNI")
    if name == "amx" and not lib.mq_amx_supported():
        raise ValueError("this CPU or OS lacks AMX-INT8 (or Linux refused the tile state)")
    lib.mq_set_path(PATHS.index(name or "vnni"))
    return get_path()


def allow_vbmi(allow: bool) -> bool:
    """Whether the VNNI path may gather MXFP4's bytes with AVX512-VBMI where the CPU has it (the default), or must
    take the gather without it (the tests run both); returns whether it uses VBMI now."""
    if not available():
        raise RuntimeError(f"native packed-experts kernel unavailable: {unavailable_reason()}")
    return bool(_state["lib"].mq_allow_vbmi(int(allow)))


def get_path() -> str:
    if not available():
        raise RuntimeError(f"native packed-experts kernel unavailable: {unavailable_reason()}")
    return PATHS[_state["lib"].mq_get_path()]


def build_id() -> str:
    """native_build.build_name of the library in use; "" without one."""
    return build_name(_state["lib"]) if available() else ""


def lane_vnni() -> bool:
    """Whether the library in use takes the AVX2 path's dot products in AVX-VNNI."""
    return available() and bool(_state["lib"].mq_lane_vnni())


def describe() -> str:
    reason = unavailable_reason()
    if reason is None:
        path = get_path()
        if path == "avx2" and lane_vnni():
            path += "+avx-vnni"
        return f"native packed kernel ({path}), {cpu_experts.get_num_threads()} threads"
    return f"dequantise + torch ({reason})"
