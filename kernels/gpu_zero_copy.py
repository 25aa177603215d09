"""Experts computed on the GPU from weights left in pinned RAM, read over PCIe as the kernel runs (zero-copy).

At decode the CPU computes a layer's offloaded experts one token at a time, bound by its read bandwidth, while the
PCIe link idles: copying an expert costs the host more queueing than the CPU takes to compute it. A kernel can instead
read the weights straight from pinned memory (UVA makes a pinned host address valid on the device): SMs read them
about as fast as the copy engine does, and slow the CPU's reads of the other experts only a little
(tests/perf/probe_zero_copy.py; docs/measurements.md, "The GPU kernels"). Which experts to read comes from the routing
on the device, so the launch needs no host decision and CUDA graphs capture it.

The arithmetic rounds where engine.offload.offload_executor.expert_forward's torch ops round (gate and up, the activation,
their product, the output), each dot product summed in float32. TRITON_INTERPRET=1 runs it on the CPU,
which is how CI checks it.

Packed (GGUF-quantised) stacks are read this way too, as they lie, a quarter of the bf16 bytes at 4 bits: the packed CPU
kernel is bound by unpacking instructions, not by RAM (docs/measurements.md, "The GPU kernels"), so RAM and PCIe have
room for the GPU's share. Their arithmetic is kernels.gpu_quant's one-row path (the same `_row_dot`), so a zero-copy
packed expert equals a resident one.

At top-2 (Mixtral) one whole expert over PCIe takes longer than both on the CPU, so reading whole experts
this way never pays; splitting every expert's intermediate rows does: with `first_row` the kernels compute only rows
[first_row, F) (gate and up rows, down columns) into a partial output, the CPU kernels rows [0, first_row),
and the decode graph adds the two (engine.offload.offload_executor.OffloadExecutor.width_split).

gpt-oss's experts (biases, the clamped SwiGLU: kernels.expert_weights) are read so too, their biases read where they lie
(pinned or on the device) and computed as the resident kernels compute them (kernels.gpu_grouped's roundings for
dense stacks, gpu_quant's float32 for packed ones). The down bias belongs to the GPU's part of a split: the CPU
kernels add it only to a whole expert.
"""
from __future__ import annotations

import math
import os

import torch

from moedesk.kernels import gpu_fused, gpu_quant
from moedesk.kernels.expert_weights import ExpertWeights
from moedesk.kernels.quant_formats import packed_format

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

_ROWS = 8  # rows of a weight per program: enough programs for two experts to fill the SMs' reads


def wanted() -> bool:
    """Whether zero-copy reads may be used: MOEDESK_NO_ZERO_COPY=1 turns them off (the profile then measures no split
    and every offloaded expert of a lone token runs on the CPU), to compare decode with and without them."""
    return os.environ.get("MOEDESK_NO_ZERO_COPY", "").strip().lower() in ("", "0", "false", "no")


def applies(device: torch.device, w: ExpertWeights) -> bool:
    """Whether `zero_copy_experts` takes inputs on `device` and the stacks `w`: a CUDA device, the stacks in pinned
    host memory, dense (inputs in the stacks' dtype) or both halves in a format kernels.gpu_quant reads, Triton
    there and neither the fused kernels nor zero-copy reads turned off."""
    if not (gpu_fused.wanted() and wanted() and device.type == "cuda" and not w.gate_up.is_cuda and w.is_pinned()):
        return False
    if any(b is not None and not (b.is_contiguous() and (b.is_cuda or b.is_pinned()))
           for b in (w.gate_up_bias, w.down_bias)):
        return False  # the kernels read gpt-oss's biases where they lie
    return not w.packed or (w.gate_up_format in gpu_quant._FMT_ID and w.down_format in gpu_quant._FMT_ID)


def zero_copy_experts(x: torch.Tensor, ids: torch.Tensor, first_rank: int, w: ExpertWeights,
                     out: torch.Tensor, first_row: int = 0) -> None:
    """out[t*K + r] = expert ids[t, r] of `w` applied to x[t] for every token t and rank r >= first_rank.

    x [N, H]; ids [N, K] (int64) on x's device; w the layer's stacks in pinned host memory (on the CPU
    interpreter: any CPU tensors), dense in x's dtype or packed; out [>= N*K, H] in x's dtype, or any float
    dtype where first_row > 0. Rows of ranks below first_rank are left as they are.

    first_row > 0: only the expert's intermediate rows [first_row, F) (gate and up rows, down columns), a
    partial output the CPU's rows [0, first_row) complete by addition (`split_width`); a multiple of
    `row_granule(w)`.
    """
    if first_row and (first_row % row_granule(w) or not 0 < first_row < w.width):
        raise ValueError(f"first_row {first_row} must be a multiple of {row_granule(w)} below {w.width}")
    if w.packed:
        return _zero_copy_packed(x, ids, first_rank, w, out, first_row)
    n, k = ids.shape
    ranks = k - first_rank
    gate_up, down = w.gate_up, w.down
    _, two_f, h = gate_up.shape
    f = two_f // 2
    act = torch.empty(n * ranks, f - first_row, dtype=x.dtype, device=x.device)
    block_h = min(triton.next_power_of_2(h), 2048)
    _gate_up[(triton.cdiv(f - first_row, _ROWS), n * ranks)](
        x, pointer_arg(gate_up), ids, act, first_rank, ranks, first_row, *_bias_args(w.gate_up_bias, act),
        *_glu_args(w.glu), H=h, F=f, K=k, ROWS=_ROWS, BLOCK_H=block_h, **_EXACT)
    block_f = min(triton.next_power_of_2(f - first_row), 1024)
    _down[(triton.cdiv(h, _ROWS), n * ranks)](
        act, pointer_arg(down), ids, out, first_rank, ranks, out.stride(0), first_row, *_bias_args(w.down_bias, out),
        H=h, F=f, K=k, ROWS=_ROWS, BLOCK_F=block_f, **_EXACT)


def _bias_args(bias, dummy) -> tuple:
    """(pointer, its expert stride, BIAS) for a kernel reading `bias` [E, n] where it lies; `dummy` stands in
    for no bias."""
    if bias is None:
        return dummy, 0, False
    return pointer_arg(bias), bias.stride(0), True


def _glu_args(glu) -> tuple:
    """(alpha, limit, CLAMPED): gpt-oss's ClampedSwiGLU, or SwiGLU for None."""
    return (glu.alpha, glu.limit, True) if glu is not None else (0.0, 0.0, False)


def row_granule(w: ExpertWeights) -> int:
    """What a split of the intermediate rows between the CPU and the GPU must be a multiple of: the down
    format's block (a packed row's columns come in blocks) and the CPU kernels' 32-row work items."""
    return math.lcm(32, packed_format(w.down_format).block) if w.packed else 32


def _zero_copy_packed(x, ids, first_rank, w: ExpertWeights, out, first_row: int) -> None:
    n, k = ids.shape
    ranks = k - first_rank
    x = x.contiguous()
    width = w.width - first_row
    act = torch.empty(n * ranks, width, dtype=torch.float32, device=x.device)  # as gpu_quant keeps it
    # The down rows' first `first_row` columns are whole blocks: skipping their bytes starts each row at column
    # first_row, which the activation's column 0 meets.
    skip = packed_format(w.down_format).row_bytes(first_row)
    for src, stack, fmt, dst, rows, cols, gated, row0, col_bytes, bias in (
            (x, w.gate_up, w.gate_up_format, act, w.width, w.hidden, True, first_row, 0, w.gate_up_bias),
            (act, w.down, w.down_format, out, w.hidden, width, False, 0, skip, w.down_bias)):
        lanes = gpu_quant._LANES[fmt]
        cfg = _PACKED_TILES_INTERPRETED if os.environ.get("TRITON_INTERPRET") == "1" else _PACKED_TILES
        _packed_pairs[(triton.cdiv(rows - row0, cfg["ROWS"]), n * ranks)](
            src, src.stride(0), pointer_arg(stack), stack.stride(0), ids, dst, dst.stride(0), first_rank, ranks, rows,
            row0, stack.shape[-1], col_bytes, cols // (2 * lanes), *_bias_args(bias, dst),
            *_glu_args(w.glu if gated else None), K=k, FMT=gpu_quant._FMT_ID[fmt], L=lanes, GATED=gated, **cfg)


# gpu_quant's tiles for one row per expert (4 rows x 16 units, 2 warps): many small programs keep many reads in
# flight, which PCIe's latency needs more than device memory does. Not yet tuned for reads over PCIe.
_PACKED_TILES = dict(ROWS=4, NB=16, num_warps=2)
_PACKED_TILES_INTERPRETED = dict(ROWS=64, NB=8, num_warps=1)  # the interpreter pays per program


class _HostPointer:
    """A pinned CPU tensor as Triton takes a pointer argument: its address, valid on the device under UVA."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def pointer_arg(t: torch.Tensor):
    """`t` as a Triton kernel's pointer argument: a launch takes only CUDA tensors (or objects with data_ptr),
    so a pinned host tensor goes as its address, valid on the device under UVA; the CPU interpreter needs the
    tensor itself."""
    return t if t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" else _HostPointer(t)


_EXACT = dict(enable_fp_fusion=False)  # two roundings where torch has two (kernels.gpu_fused)

if triton is not None:
    from moedesk.kernels.gpu_grouped import _gated_rounded
    from moedesk.kernels.gpu_quant import _gated, _row_dot

    @triton.jit
    def _gate_up(x_ptr, w_ptr, ids_ptr, act_ptr, FIRST, RANKS, ROW0, bias_ptr, bias_stride, BIAS: tl.constexpr,
                 alpha, limit, CLAMPED: tl.constexpr, H: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        """Intermediate rows [ROW0, F) of each pair, into act [pairs, F - ROW0]; gpt-oss's biases and clamped
        SwiGLU where BIAS and CLAMPED, rounding as kernels.gpu_grouped does."""
        pair = tl.program_id(1)  # the pair's index among the zero-copy ones: token pair // RANKS
        token = pair // RANKS
        e = tl.load(ids_ptr + token * K + FIRST + pair % RANKS).to(tl.int64)
        rows = ROW0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = rows < F
        base = w_ptr + e * 2 * F * H
        gate = tl.zeros([ROWS], dtype=tl.float32)
        up = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, H, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            inside = cols < H
            x = tl.load(x_ptr + token * H + cols, mask=inside, other=0.0).to(tl.float32)
            both = live[:, None] & inside[None, :]
            g = tl.load(base + rows[:, None] * H + cols[None, :], mask=both, other=0.0).to(tl.float32)
            u = tl.load(base + (rows[:, None] + F) * H + cols[None, :], mask=both, other=0.0).to(tl.float32)
            gate += tl.sum(g * x[None, :], axis=1)
            up += tl.sum(u * x[None, :], axis=1)
        dtype = act_ptr.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        if BIAS:
            bias = bias_ptr + e * bias_stride + rows
            gate = (gate + tl.load(bias, mask=live, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            up = (up + tl.load(bias + F, mask=live, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        act = _gated_rounded(gate, up, alpha, limit, dtype, CLAMPED)
        tl.store(act_ptr + pair * (F - ROW0) + rows - ROW0, act.to(dtype), mask=live)

    @triton.jit
    def _down(act_ptr, w_ptr, ids_ptr, out_ptr, FIRST, RANKS, out_stride, COL0, bias_ptr, bias_stride,
              BIAS: tl.constexpr, H: tl.constexpr, F: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_F: tl.constexpr):
        """out rows from act [pairs, F - COL0] and the down columns [COL0, F), plus the down bias where BIAS."""
        pair = tl.program_id(1)
        token = pair // RANKS
        rank = FIRST + pair % RANKS
        e = tl.load(ids_ptr + token * K + rank).to(tl.int64)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = rows < H
        base = w_ptr + e * H * F
        acc = tl.zeros([ROWS], dtype=tl.float32)
        for f0 in range(COL0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            inside = cols < F
            a = tl.load(act_ptr + pair * (F - COL0) + cols - COL0, mask=inside, other=0.0).to(tl.float32)
            w = tl.load(base + rows[:, None] * F + cols[None, :], mask=live[:, None] & inside[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        if BIAS:  # rounded first, as a torch product then its bias would be
            dtype = act_ptr.dtype.element_ty
            acc = acc.to(dtype).to(tl.float32) + tl.load(bias_ptr + e * bias_stride + rows, mask=live,
                                                          other=0.0).to(tl.float32)
        tl.store(out_ptr + (token * K + rank) * out_stride + rows, acc.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _packed_pairs(x_ptr, x_stride, w_ptr, expert_stride, ids_ptr, out_ptr, out_stride, FIRST, RANKS, R, ROW0,
                      ROW_BYTES, COL_BYTES, UNITS, bias_ptr, bias_stride, BIAS: tl.constexpr, alpha, limit,
                      CLAMPED: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, L: tl.constexpr,
                      NB: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr):
        """One (token, rank) pair per program column, its expert from the routing on the device. GATED: the
        pair's x row is its token's and out[pair, r - ROW0] = silu(x . gate_r) * (x . up_r) for rows r in
        [ROW0, R); otherwise x is the activation of the pair, each row read from byte COL_BYTES on (UNITS units),
        and the result goes to out[token * K + rank]. BIAS adds the expert's bias to each float32 dot product
        (gate's rows then up's where GATED); CLAMPED: gpt-oss's activation (kernels.gpu_quant._packed_mm)."""
        pair = tl.program_id(1)
        token = pair // RANKS
        rank = FIRST + pair % RANKS
        e = tl.load(ids_ptr + token * K + rank).to(tl.int64)
        rows = ROW0 + tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rlive = rows < R
        row = (w_ptr + e * expert_stride + COL_BYTES + rows.to(tl.int64) * ROW_BYTES)[:, None, None]
        source = token if GATED else pair
        toks = source + tl.arange(0, 1)
        tlive = toks >= 0
        acc = _row_dot(x_ptr, x_stride, toks, tlive, row, rlive, UNITS, L, NB, 1, ROWS, False, False, FMT)
        bias = bias_ptr + e * bias_stride + rows
        if BIAS:
            acc += tl.load(bias, mask=rlive, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up = _row_dot(x_ptr, x_stride, toks, tlive, row + R * ROW_BYTES, rlive, UNITS, L, NB, 1, ROWS,
                                    False, False, FMT)
            if BIAS:
                up += tl.load(bias + R, mask=rlive, other=0.0).to(tl.float32)[None, :]
            acc = _gated(acc, up, alpha, limit, CLAMPED)
            dst = pair
        else:
            dst = token * K + rank
        tl.store(out_ptr + dst.to(tl.int64) * out_stride + rows[None, :] - ROW0, acc.to(out_ptr.dtype.element_ty),
                 mask=rlive[None, :])
