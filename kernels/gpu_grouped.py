"""Dense experts grouped in one Triton launch a projection, where torch's grouped GEMM does not run.

`torch._grouped_mm` computes every resident expert of a layer in one launch, reading the groups' ends
on the device, but only for bf16 on Hopper (sm90). Elsewhere torch falls back to a loop that reads the
ends on the host: the RTX cards people run moedesk on (sm86, sm89, sm120), and float32 or float16
models on any GPU. There a layer whose experts are all on the GPU still waited for its routing on the
host every step, and CUDA graphs could not capture it. These kernels take the same arguments and
need no host: group g is rows ends[g-1]:ends[g] of x, a program computes a tile of one group's output
columns for a tile of its tokens (`tl.dot`), and programs past a group's last token return at once.

Rounding is torch's: the gate and up products are rounded to x's dtype, SiLU is rounded, then their
product, then the down projection's output, as `kernels.cpu_experts.expert_forward` does. gpt-oss's experts
round as kernels.gpu_experts.biased_expert_forward's torch ops do: each bias added to the rounded product and
rounded, then each step of the clamped SwiGLU. Float32 x
multiplies with float32's accuracy (`FP32_DOT`), not TF32's, as torch's matmul does by default.
"""
from __future__ import annotations

import os

import torch

from moedesk.kernels import gpu_fused

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# How float32 tiles multiply: "tf32x3" (tensor cores, each operand split into two TF32 halves, three products)
# or "ieee" (FMAs). 3xTF32 ran faster than the FMAs and its results were as close to torch's float32 products
# (tests/perf/bench_gpu_grouped.py; docs/measurements.md, "The GPU kernels").
FP32_DOT = "tf32x3"


def applies(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether `grouped_experts_forward` takes x and stacks like gate_up: a CUDA device, a float dtype shared
    by both, Triton present and the fused kernels not turned off."""
    return (gpu_fused.wanted() and x.is_cuda and x.dtype in _DTYPES and gate_up.dtype == x.dtype
            and x.dim() == 2)


def grouped_experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ends: torch.Tensor, *,
                            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                            glu=None, active: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.gpu_experts.grouped_experts_forward's contract: x [M, H] grouped by expert, gate_up [G', 2F, H],
    down [G', H, F] (G' >= G), ends [G] int32 on x's device, cumulative, and gpt-oss's biases [G', 2F] / [G', H]
    and ClampedSwiGLU where given; active: the groups with rows (kernels.gpu_quant.grouped_experts_forward), the
    only ones given programs. Returns [M, H] in x's dtype."""
    x = x.contiguous()
    m, h = x.shape
    groups, f = ends.shape[0], down.shape[-1]
    out = torch.empty_like(x)
    if m == 0 or groups == 0:
        return out
    act = torch.empty(m, f, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, ends, act, rows=f, k=h, gated=True, m=m, groups=groups, bias=gate_up_bias, glu=glu,
            active=active)
    _launch(act, down, ends, out, rows=h, k=f, gated=False, m=m, groups=groups, bias=down_bias, active=active)
    return out


def _config(m: int, groups: int, interpreted: bool) -> dict:
    """Tiles: BT tokens x BR output columns a program, BK along k per step, SPLIT programs sharing a group's
    tokens. A decode step gives each expert a token or two, so the weights' tiles are wide and the token tile
    is tl.dot's least; prefill splits a group's tokens over programs."""
    per_group = -(-m // groups)
    if interpreted:  # few, large programs: the interpreter pays per program and per operation
        return dict(BT=16, BR=64, BK=64, SPLIT=1, num_warps=1)
    if per_group <= 16:
        return dict(BT=16, BR=64, BK=64, SPLIT=1, num_warps=4)
    bt = 64
    # twice the mean group's tiles: the programs of an uneven routing's big groups still find work
    return dict(BT=bt, BR=64, BK=32, SPLIT=max(1, min(-(-m // bt), -(-2 * per_group // bt))), num_warps=4,
                num_stages=3)


def _launch(x, stack, ends, out, *, rows, k, gated, m, groups, bias=None, glu=None, active=None):
    cfg = _config(m, groups, os.environ.get("TRITON_INTERPRET") == "1")
    split = cfg.pop("SPLIT")
    grid = (triton.cdiv(rows, cfg["BR"]), groups if active is None else active.shape[0], split)
    bias = None if bias is None else bias.contiguous()
    _grouped_mm[grid](x, x.stride(0), stack, stack.stride(0), stack.stride(1), ends,
                      ends if active is None else active, out, out.stride(0), rows, k, split,
                      out if bias is None else bias, 0 if bias is None else bias.stride(0),
                      glu.alpha if glu is not None else 0.0, glu.limit if glu is not None else 0.0, GATED=gated,
                      FP32=FP32_DOT if x.dtype == torch.float32 else "", BIAS=bias is not None,
                      CLAMPED=glu is not None, ACTIVE=active is not None, **cfg)


if triton is not None:
    @triton.jit
    def group_span(ends_ptr, g):
        """[start, end) of group g's rows, from the groups' cumulative ends (kernels.gpu_quant's launches too)."""
        end = tl.load(ends_ptr + g)
        start = tl.where(g > 0, tl.load(ends_ptr + tl.maximum(g - 1, 0)), 0)
        return start, end

    @triton.jit
    def launched_group(active_ptr, ends_ptr, ACTIVE: tl.constexpr):
        """(group, start, end) of this program's group: program_id(1) itself, or where ACTIVE the group at that
        place of the launch's list of groups with rows (-1 past its end: an empty span)."""
        if ACTIVE:
            listed = tl.load(active_ptr + tl.program_id(1))
            g = tl.maximum(listed, 0)
            start, end = group_span(ends_ptr, g)
            end = tl.where(listed < 0, start, end)
        else:
            g = tl.program_id(1)
            start, end = group_span(ends_ptr, g)
        return g, start, end

    @triton.jit
    def _gated_rounded(gate, up, alpha, limit, DTYPE: tl.constexpr, CLAMPED: tl.constexpr):
        """The activation between a dense expert's projections, gate and up already rounded to DTYPE and each
        step rounded to it as torch's ops round: silu(gate) * up, or where CLAMPED gpt-oss's
        (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). The last product
        stays float32 for the caller's store to round."""
        if CLAMPED:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            sig = (1.0 / (1.0 + tl.exp(-(gate * alpha).to(DTYPE).to(tl.float32)))).to(DTYPE).to(tl.float32)
            return (up + 1.0).to(DTYPE).to(tl.float32) * (gate * sig).to(DTYPE).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32) * up

    @triton.jit
    def _tile_dot(x_ptr, x_stride, toks, tlive, w_row, rlive, K, BT: tl.constexpr, BR: tl.constexpr,
                  BK: tl.constexpr, FP32: tl.constexpr):
        """[BT, BR]: tokens `toks` of x against the weight rows at `w_row` ([BR, 1] pointers), float32 sums."""
        acc = tl.zeros([BT, BR], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            klive = ks < K
            xa = tl.load(x_ptr + toks[:, None].to(tl.int64) * x_stride + ks[None, :],
                         mask=tlive[:, None] & klive[None, :], other=0.0)
            wa = tl.load(w_row + ks[None, :], mask=rlive[:, None] & klive[None, :], other=0.0)
            if FP32 != "":
                acc = tl.dot(xa, tl.trans(wa), acc, input_precision=FP32)
            else:
                acc = tl.dot(xa, tl.trans(wa), acc)
        return acc

    @triton.jit
    def _grouped_mm(x_ptr, x_stride, w_ptr, expert_stride, row_stride, ends_ptr, active_ptr, out_ptr, out_stride, R,
                    K, SPLIT, bias_ptr, bias_stride, alpha, limit, GATED: tl.constexpr, FP32: tl.constexpr,
                    BIAS: tl.constexpr, CLAMPED: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                    ACTIVE: tl.constexpr):
        """out[t, r] = x[t] . W_g[r] (+ bias_g[r]) for the tokens t of group g; GATED: W_g is [gate; up] (2R rows,
        the bias likewise) and out[t, r] = _gated_rounded(gate, up), rounded at each step to out's dtype. ACTIVE:
        programs only for the groups active_ptr lists (launched_group)."""
        g, start, end = launched_group(active_ptr, ends_ptr, ACTIVE)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rlive = rows < R
        w_row = (w_ptr + g.to(tl.int64) * expert_stride + rows.to(tl.int64) * row_stride)[:, None]
        bias = bias_ptr + g.to(tl.int64) * bias_stride + rows
        dtype = out_ptr.dtype.element_ty
        for t0 in range(start + tl.program_id(2) * BT, end, SPLIT * BT):
            toks = t0 + tl.arange(0, BT)
            tlive = toks < end
            acc = _tile_dot(x_ptr, x_stride, toks, tlive, w_row, rlive, K, BT, BR, BK, FP32)
            if BIAS:
                acc = acc.to(dtype).to(tl.float32) + tl.load(bias, mask=rlive, other=0.0).to(tl.float32)[None, :]
            if GATED:
                up = _tile_dot(x_ptr, x_stride, toks, tlive, w_row + R * row_stride, rlive, K, BT, BR, BK, FP32)
                if BIAS:
                    up = up.to(dtype).to(tl.float32) + tl.load(bias + R, mask=rlive, other=0.0).to(tl.float32)[None, :]
                acc = _gated_rounded(acc.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), alpha, limit, dtype,
                                     CLAMPED)
            dst = out_ptr + toks[:, None].to(tl.int64) * out_stride + rows[None, :]
            tl.store(dst, acc.to(dtype), mask=tlive[:, None] & rlive[None, :])
