"""The expert computations callers use, for every `ExpertWeights` format and device.

Dense (16-bit or float32) stacks go to the kernels that exist for them: kernels.cpu_experts (the
native AVX-512 call and torch) and kernels.gpu_experts (torch's grouped GEMM). Packed stacks go to
the packed kernels where they apply (kernels.cpu_quant, kernels.gpu_quant) and otherwise to
`reference_packed_forward`: dequantise each expert it needs, then compute in float32. That path is
slow but exact to the formats' definition, so every device and format computes something right.

Experts that are not plain SwiGLU (gpt-oss's biases and clamped activation, ExpertWeights.plain) take the
GPU's kernels (gpu_quant, gpu_experts) and the CPU's packed kernel (kernels.cpu_quant), which compute them too;
16-bit ones on the CPU take the reference path.

Packed experts compute in float32 inside the expert (the packed kernels accumulate in float32 and
may quantise activations to 8 bits, as llama.cpp does) and round the output to x's dtype.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moedesk.kernels import cpu_experts, cpu_quant, gpu_experts, gpu_fused, gpu_quant
from moedesk.kernels.expert_weights import ExpertWeights


def expert_forward(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """A one-expert stack `w` applied to x [N, H]: [N, H] in x's dtype."""
    if not w.packed and w.plain:
        return cpu_experts.expert_forward(x, w.gate_up[0], w.down[0])
    if not w.packed and x.is_cuda:
        return gpu_experts.biased_expert_forward(x, w.gate_up[0], w.down[0], *_function(w, 0))
    if gpu_quant.applies(x, w):
        return gpu_quant.expert_forward(x, w)
    return _reference_one(x, w, 0)


def experts_forward_routed(x, pair_expert, k: int, cpu_experts_ids, w: ExpertWeights, out, index=None, *,
                           rows: int | None = None):
    """kernels.cpu_experts.experts_forward_routed for any format: each (token, rank) pair of the chosen
    experts computed into its pair's row of `out` (pair p = token p // k's rank p % k).

    rows: only intermediate rows [0, rows) of F, each expert's output head (the GPU computes the tail at one
    token, kernels/gpu_zero_copy.py); None: all F. Its granularity is the path's: cpu_experts.check_rows (dense),
    cpu_quant.check_rows (packed)."""
    if w.packed and cpu_quant.applies(x, w):  # gpt-oss's expert function included
        return cpu_quant.experts_forward_routed(x, pair_expert, k, cpu_experts_ids, w, out, index, rows=rows)
    if w.plain and not w.packed:
        return cpu_experts.experts_forward_routed(x, pair_expert, k, cpu_experts_ids, w.gate_up, w.down, out, index,
                                                  rows=rows)
    return reference_routed(x, pair_expert, k, cpu_experts_ids, w, out, rows=rows)


def cpu_path(w: ExpertWeights) -> str:
    """What `experts_forward_routed` computes experts of w's format with on this machine, in words: the native
    kernel only where its dispatch takes them (the 16-bit kernel takes bfloat16, not a float32 model's experts)."""
    if w.packed:
        native = w.gate_up_format in cpu_quant.FORMAT_CODES and w.down_format in cpu_quant.FORMAT_CODES
        if native and not cpu_quant.computes_function(w):
            return "dequantise + torch (an expert activation the native kernel does not compute)"
        return cpu_quant.describe() if native else f"dequantise + torch ({w.describe()} has no native kernel)"
    if not w.plain:
        return "torch (experts with biases or another activation than SiLU)"
    if w.dense_dtype is not torch.bfloat16:
        return f"torch ({w.describe()} experts; the native kernel computes bfloat16 ones)"
    return cpu_experts.describe()


def prepare_routed(x, pair_expert, k: int, cpu_experts_ids, w: ExpertWeights, out, index, *, rows: int | None = None):
    """`experts_forward_routed` prepared once for buffers a caller reuses (kernels.cpu_quant.prepare_routed): a
    function of no arguments, or None where only the unprepared call applies (16-bit experts, whose native
    call has its own fallbacks, or no native packed kernel)."""
    if not w.packed or not cpu_quant.applies(x, w):
        return None
    return cpu_quant.prepare_routed(x, pair_expert, k, cpu_experts_ids, w, out, index, rows=rows)


def grouped_supported(x: torch.Tensor, w: ExpertWeights) -> bool:
    """Whether `grouped_experts_forward` runs the experts in a few launches rather than one by one, for x and
    experts of w's formats and shapes on x's device (w itself may still be in host memory: placement asks
    before any expert is on the GPU)."""
    if not w.packed:
        return gpu_experts.grouped_supported(x, w.gate_up)
    if w.device != x.device:  # asked before placement: would a resident copy of w take the packed kernels?
        return (x.is_cuda and gpu_fused.wanted()
                and {w.gate_up_format, w.down_format} <= set(gpu_quant.supported_formats()))
    return gpu_quant.applies(x, w)


def grouped_alike(x: torch.Tensor, w: ExpertWeights, sizes) -> bool:
    """Whether one `grouped_experts_forward` over groups of `sizes` rows computes each group as `expert_forward`
    computes it alone (packed experts on the GPU, where both take the same route: kernels.gpu_quant.groups_alike),
    so that one call may replace one an expert whatever their sizes."""
    return w.packed and gpu_quant.groups_alike(x, w, sizes)


def grouped_experts_forward(x: torch.Tensor, w: ExpertWeights, ends: torch.Tensor,
                            active: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of x grouped by expert: group g is x[ends[g-1]:ends[g]] and uses expert g of `w` (see
    kernels.gpu_experts.grouped_experts_forward). active: the groups with rows, where known on the device
    (kernels.gpu_fused.group_pairs): the Triton kernels launch for those alone."""
    if not w.packed:
        return gpu_experts.grouped_experts_forward(x, w.gate_up, w.down, ends, gate_up_bias=w.gate_up_bias,
                                                   down_bias=w.down_bias, glu=w.glu, active=active)
    if gpu_quant.applies(x, w):
        return gpu_quant.grouped_experts_forward(x, w, ends, active=active)
    out = torch.empty_like(x)
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = _reference_one(x[start:end], w, g)
        start = end
    return out


def grouped_pairs_forward(x: torch.Tensor, w: ExpertWeights, gather: torch.Tensor, scatter: torch.Tensor,
                          ends: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped_experts_forward` of the rows x[gather] (x [N, H]), grouped row t returned as row scatter[t]: the
    (token, expert) pairs of a step arranged by kernels.gpu_fused.group_pairs. Packed experts on the integer route
    read and store those rows in their kernels; the others gather and scatter around the grouped call."""
    if w.packed and gpu_quant.applies(x, w):
        return gpu_quant.grouped_experts_forward(x, w, ends, active=active, gather=gather, scatter=scatter)
    ys = grouped_experts_forward(x.index_select(0, gather), w, ends, active)
    return torch.empty_like(ys).index_copy_(0, scatter, ys)


def _function(w: ExpertWeights, e: int) -> tuple:
    """Expert e's (gate_up bias, down bias, activation), None where it has none."""
    return (None if w.gate_up_bias is None else w.gate_up_bias[e],
            None if w.down_bias is None else w.down_bias[e], w.glu)


# ---------------------------------------------------------------- the reference for packed experts

def _reference_one(x: torch.Tensor, w: ExpertWeights, e: int, rows: int | None = None) -> torch.Tensor:
    """Expert e of w on x, in float32; rows: its intermediate rows [0, rows) only (gate / up rows, down columns,
    and no down bias: that belongs to whoever computes the other rows)."""
    one = w.expert(e)
    gate_up, down = one.dense(torch.float32)
    gate_up, down = gate_up[0], down[0]
    gate_up_bias = None if one.gate_up_bias is None else one.gate_up_bias[0].float()
    down_bias = None if one.down_bias is None else one.down_bias[0].float()
    if rows is not None and rows != w.width:
        keep = torch.cat([torch.arange(rows), torch.arange(w.width, w.width + rows)]).to(gate_up.device)
        gate_up, down = gate_up[keep], down[:, :rows]
        gate_up_bias, down_bias = None if gate_up_bias is None else gate_up_bias[keep], None
    gate, up = F.linear(x.float(), gate_up, gate_up_bias).chunk(2, dim=-1)
    act = w.glu(gate, up) if w.glu is not None else F.silu(gate) * up
    return F.linear(act, down, down_bias).to(x.dtype)


def reference_routed(x, pair_expert, k: int, chosen, w: ExpertWeights, out, *, rows: int | None = None):
    """`experts_forward_routed` one expert at a time through `dequantize`: the packed kernels' reference.
    rows: intermediate rows [0, rows) only, checked as the packed kernel checks it (cpu_quant.check_rows)."""
    rows = cpu_quant.check_rows(rows, w)
    experts_of = pair_expert.to("cpu", torch.int64).numpy()
    if len(experts_of) > x.shape[0] * k or len(experts_of) > out.shape[0]:
        raise ValueError("more pairs than tokens * k or than rows of out")
    if len(experts_of) and not 0 <= experts_of.min() <= experts_of.max() < w.num_experts:
        raise ValueError("pair_expert holds an index outside the expert stack")
    wanted = np.unique(experts_of) if chosen is None else np.intersect1d(np.unique(experts_of), np.asarray(chosen))
    for e in wanted.tolist():
        pairs = torch.from_numpy(np.flatnonzero(experts_of == e)).to(out.device)
        out[pairs] = _reference_one(x[pairs.to(x.device) // k], w, e, rows).to(out.dtype)
    return out
