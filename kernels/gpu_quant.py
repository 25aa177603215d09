"""Packed (GGUF-quantised) experts on the GPU: the weights stay packed in GPU memory and are dequantised inside the kernel.

Decode gives each resident expert a handful of tokens, so an expert's cost is reading its weights: a
4-bit expert read packed costs a quarter of the bf16 one. `grouped_experts_forward` runs every expert
of a layer in two launches (gate/up with the SwiGLU, then down), each program reading a tile of packed
rows once for all of its group's tokens. Nothing on the host depends on the routing (the groups' ends
are read on the device), so CUDA graphs capture it.

How a tile is read. Every format is walked in units of 2 x L weights that share a byte run: L bytes (16
for q4_0, q8_0 and mxfp4, 32 for the k-quants) give two planes of L weights each, e.g. a q4_0 block's low and
high nibbles. A plane's weights are not consecutive columns of the matrix (a q4_0 byte holds columns j
and j + 16), so rather than shuffling the weights into column order, the kernel gathers the matching
elements of x, which are few and sit in L1. The bytes are read as they lie, in runs the hardware
coalesces, and each byte is read once. MXFP4 (gpt-oss) is q4_0's layout with an 8-bit exponent for the
float16 scale and E2M1 codes for the integer nibbles.

gpt-oss's experts (biases after both projections, the clamped SwiGLU: kernels.expert_weights) run in the same
two launches: the bias is added to each float32 dot product and the activation is chosen at compile time.

A few 16-bit rows against q4_0, q8_0 or k-quant weights take an integer route instead (`_q8_mm`): x rounded to 8
bits per block of 32 as llama.cpp's decode kernels round it (`quantize_rows`), each 32-bit word of packed nibbles
split into two words of four weights by two mask operations (q8_0's bytes as they are; q5_k's and q6_k's high bits
joined in) and multiplied into four int8 x by one dp4a. The float32 path spends several instructions on every
weight (unpack, convert, scale, multiply), which kept decode below the memory's rate.

Many tokens per expert (prefill, copied experts) take the same kernel with tensor-core tiles (`tl.dot`)
and the tokens split over programs, or, where measured faster, the experts dequantised to bf16 scratch
and torch's grouped GEMM (`_PREFILL_ROUTE`).

Arithmetic: the weights are dequantised in float32 exactly as kernels.quant_formats.dequantize does,
the activation between the projections stays float32, the output is rounded to x's dtype. The
tensor-core tiles take their operands in bf16 (x in bf16 is exact, the weights and the float32
activation round to 8 bits of mantissa), which stays inside what kernels.experts allows packed kernels
(llama.cpp rounds the activations to 8-bit integers), as does the integer route's rounding of x to 8 bits.
Float32 x always takes the float32 path.
TRITON_INTERPRET=1 runs the kernels on the CPU, which is how CI checks them.
"""
from __future__ import annotations

import os

import torch

from moedesk.kernels import gpu_fused
from moedesk.kernels.expert_weights import ExpertWeights
from moedesk.kernels.quant_formats import FORMATS

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None
else:
    from moedesk.kernels.gpu_grouped import launched_group

_FMT_ID = {"q4_0": 0, "q8_0": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4, "mxfp4": 5}
_LANES = {"q4_0": 16, "q8_0": 16, "q4_k": 32, "q5_k": 32, "q6_k": 16, "mxfp4": 16}  # L: bytes of a unit's run
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def applies(x: torch.Tensor, w: ExpertWeights) -> bool:
    """Whether `grouped_experts_forward` takes x and w: one CUDA device, both halves in a packed format
    this module knows, x in bf16/fp16/fp32, Triton present and the fused kernels not turned off.

    CPU tensors never apply, even under TRITON_INTERPRET=1, so the engine never sends CPU work to the
    interpreter; the tests call the kernels there directly."""
    return (gpu_fused.wanted() and x.is_cuda and x.device == w.gate_up.device == w.down.device
            and all(b is None or b.device == x.device for b in (w.gate_up_bias, w.down_bias))
            and w.gate_up_format in _FMT_ID and w.down_format in _FMT_ID and x.dtype in _DTYPES
            and x.dim() == 2 and x.shape[-1] == w.hidden)


def expert_forward(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """A one-expert stack `w` (e.g. a copied expert) applied to all rows of x [N, H]: [N, H] in x's dtype."""
    if w.num_experts != 1:
        raise ValueError(f"expert_forward takes a one-expert stack, not {w.num_experts} experts")
    ends = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
    return grouped_experts_forward(x, w, ends)


def grouped_experts_forward(x: torch.Tensor, w: ExpertWeights, ends: torch.Tensor,
                            route: str | None = None, active: torch.Tensor | None = None,
                            gather: torch.Tensor | None = None, scatter: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of x grouped by expert: group g is x[ends[g-1]:ends[g]] and uses expert g of `w`.

    x [M, H] (bf16, fp16 or fp32); ends [G] int32 on x's device, cumulative (empty groups repeat the
    previous end), G <= w.num_experts. Returns [M, H] in x's dtype. `route` forces "fused" or "dequant"
    (tests and the benchmark); by default it follows the rows per group the shapes allow. active: int32 on x's
    device, every group with rows in ascending order and then -1s (kernels.gpu_fused.group_pairs): the packed
    kernels launch programs for those alone, where a decode step's few tokens leave most of the G groups empty.
    gather, scatter (int64 [M'] on x's device, where given): the grouped rows are x[gather] (M' of them, x then
    [N, H]), and grouped row t is returned as row scatter[t] (a permutation of M' rows), as though x.index_select
    and index_copy_ were around the call; the integer route's kernels read and store those rows themselves."""
    x = x.contiguous()
    h = x.shape[1]
    m = x.shape[0] if gather is None else gather.shape[0]
    g = ends.shape[0]
    out = x.new_empty(m, h)
    if m == 0 or g == 0:
        return out
    route = route or _route(x, m, g)
    if route == "dequant":
        y = _dequant_route(x if gather is None else x.index_select(0, gather), w, ends, torch.empty_like(out))
        return y if scatter is None else out.index_copy_(0, scatter, y)
    f = w.width
    act = torch.empty(m, f, dtype=torch.float32, device=x.device)
    # Both launches take the tiles of x's dtype: the float32 activation is an intermediate, not a float32 layer.
    _launch(x, w.gate_up, w.gate_up_format, ends, act, rows=f, k=h, gated=True, m=m, groups=g, dtype=x.dtype,
            bias=w.gate_up_bias, glu=w.glu, active=active, gather=gather)
    _launch(act, w.down, w.down_format, ends, out, rows=h, k=f, gated=False, m=m, groups=g, dtype=x.dtype,
            bias=w.down_bias, active=active, scatter=scatter)
    return out


def linear_applies(x: torch.Tensor, rows: torch.Tensor, fmt: str) -> bool:
    """Whether `packed_linear` takes x and the packed matrix `rows` [R, row_bytes]: as `applies` for one expert
    (one CUDA device, a format this module knows, x's dtype, Triton present, the fused kernels not turned off)."""
    return (triton is not None and gpu_fused.wanted() and x.is_cuda and x.device == rows.device
            and fmt in _FMT_ID and x.dtype in _DTYPES and rows.dtype == torch.uint8 and rows.dim() == 2)


def packed_linear(x: torch.Tensor, rows: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for one packed matrix W [R, k] held as its rows [R, row_bytes(k)] (a GGUF's attention
    projection, shared expert, head): x [M, k] -> [M, R] in x's dtype, W read packed by the experts' kernel as a
    one-expert group, each weight dequantised in float32 as kernels.quant_formats.dequantize does.

    Meant for few rows of x (decode): the weights are read once for all M rows, in BT-token steps. Many rows
    (prefill) are cheaper dequantised once and multiplied by cuBLAS (`dequantize_experts` then F.linear)."""
    x = x.contiguous()
    m, k = x.shape
    r = rows.shape[0]
    if rows.shape[1] != FORMATS[fmt].row_bytes(k):
        raise ValueError(f"packed {fmt} rows of {rows.shape[1]} bytes do not hold {k} weights")
    out = torch.empty(m, r, dtype=x.dtype, device=x.device)
    if m == 0 or r == 0:
        return out
    ends = _one_group_ends(m, x.device)
    stack = rows.unsqueeze(0)
    _launch(x, stack, fmt, ends, out, rows=r, k=k, gated=False, m=m, groups=1, dtype=x.dtype,
            bias=None if bias is None else bias.unsqueeze(0), linear=True)
    return out


_COUNTS: dict[torch.device, torch.Tensor] = {}  # device -> 1, 2, ..., _COUNTED (int32)
_COUNTED = 4096


def _one_group_ends(m: int, device: torch.device) -> torch.Tensor:
    """ends [1] = m of a one-group launch: a view into a count kept on the device rather than a fill launched for
    every packed matrix of every decode step. The count is made outside graph capture, whose pool would own it."""
    counts = _COUNTS.get(device)
    if counts is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counts = _COUNTS[device] = torch.arange(1, _COUNTED + 1, dtype=torch.int32, device=device)
    if counts is None or m > _COUNTED:
        return torch.full((1,), m, dtype=torch.int32, device=device)
    return counts[m - 1:m]


# ---------------------------------------------------------------- choosing tiles

# Rows per group (on average) from which prefill tiles and their route take over.
_MANY = 32
# Rows of x from which one packed matrix is cheaper dequantised and multiplied by cuBLAS than read by packed_linear.
LINEAR_ROWS = _MANY
# "fused": the tensor-core tiles of _packed_mm; "dequant": bf16 scratch and torch's grouped GEMM, the faster for
# prefill (docs/measurements.md, "The GPU kernels").
_PREFILL_ROUTE = "dequant"


def groups_alike(x: torch.Tensor, w: ExpertWeights, sizes) -> bool:
    """Whether one `grouped_experts_forward` over groups of `sizes` rows of x computes each group as a call of
    its own would: both take the dequant route (bf16 weights per group, one grouped GEMM a projection, the rest
    row by row), so one call replaces len(sizes) and their launches. Empty groups count toward the route."""
    if not (sizes and applies(x, w)) or _route(x, sum(sizes), len(sizes)) != "dequant":
        return False
    return all(_route(x, n, 1) == "dequant" for n in sizes if n)


def _route(x: torch.Tensor, m: int, g: int) -> str:
    if m < _MANY * g or _PREFILL_ROUTE == "fused" or not _dequant_route_works(x):
        return "fused"
    return "dequant"


def _config(dtype: torch.dtype, m: int, g: int, units: int) -> dict:
    """Tile sizes for one launch of a layer whose x has `dtype`: ROWS weight rows per program, NB units along
    k per step, BT tokens per step, DOT (tensor cores) or float32 FMAs, SPLIT programs sharing a group's tokens.

    The sizes are the fastest tests/perf/bench_gpu_quant.py found on a Mixtral shape: 4 weight rows x 16 units a
    program and 2 warps for groups of one row, tensor-core tiles of 64 rows x 2 units for groups of 4 or 16 rows,
    far ahead of float32 FMAs (docs/measurements.md, "The GPU kernels")."""
    per_group = -(-m // g)
    if _interpreted():  # few programs and big steps: the interpreter pays per program and per operation
        dot = dtype != torch.float32 and per_group > 4
        return dict(ROWS=128, NB=min(16, triton.next_power_of_2(units)),
                    BT=16 if dot else min(4, triton.next_power_of_2(per_group)), DOT=dot, SPLIT=1, num_warps=1)
    if per_group <= 1 or dtype == torch.float32:
        return dict(ROWS=4, NB=16, BT=min(4, triton.next_power_of_2(per_group)), DOT=False, SPLIT=1, num_warps=2)
    if per_group >= _MANY:
        return dict(ROWS=128, NB=2, BT=128, DOT=True, SPLIT=max(1, -(-m // 128)), num_warps=8, num_stages=3)
    return dict(ROWS=64, NB=2, BT=16, DOT=True, SPLIT=1, num_warps=4)


_OVERRIDE: dict | None = None  # the benchmark's tile sweep sets this


def _launch(x, stack, fmt, ends, out, *, rows, k, gated, m, groups, dtype, bias=None, glu=None, config=None,
            active=None, gather=None, scatter=None, linear=False):
    """One projection of every group: m launch rows. bias: [>=groups, rows (x2 where gated)], added before the
    activation (gated) or to the output; glu: the clamped activation of kernels.expert_weights.ClampedSwiGLU instead
    of SwiGLU; active: the groups with rows (`grouped_experts_forward`), the only ones given programs; gather: launch
    row t is x's row gather[t] (else x's row t); scatter: launch row t goes to out's row scatter[t] (else row t);
    linear: one packed matrix (`packed_linear`), whose route also weighs its size (`linear_takes_q8`)."""
    lanes = _LANES[fmt]
    units = k // (2 * lanes)  # along a row: units of 2 x L weights
    chosen = config or _OVERRIDE
    # By default few rows per group take the integer route; a given tile takes it where it says Q8.
    if _q8_route(x, stack, fmt, dtype) and (chosen.get("Q8", False) if chosen else
                                            _q8_by_default(x, m, groups, rows, linear)):
        return _launch_q8(x, stack, fmt, ends, out, rows=rows, k=k, gated=gated, m=m, groups=groups, bias=bias,
                          glu=glu, config=chosen, active=active, gather=gather, scatter=scatter)
    # The float kernels read and store rows in launch order: gather x before them, scatter their rows after.
    if gather is not None:
        x = x.index_select(0, gather)
    target = out if scatter is None else out.new_empty(m, out.shape[1])
    cfg = dict(chosen or _config(dtype, m, groups, units))
    nb = cfg.pop("NB")
    split = cfg.pop("SPLIT")
    row_bytes = stack.shape[-1]
    grid = (triton.cdiv(rows, cfg["ROWS"]), groups if active is None else active.shape[0], split)
    bias = None if bias is None else bias.contiguous()
    args = (x, x.stride(0), stack, stack.stride(0), ends, ends if active is None else active, target,
            target.stride(0), rows, row_bytes, units, split,
            target if bias is None else bias, 0 if bias is None else bias.stride(0),
            glu.alpha if glu is not None else 0.0, glu.limit if glu is not None else 0.0)
    consts = dict(FMT=_FMT_ID[fmt], L=lanes, NB=nb, HALF=_half_operands(x, target), GATED=gated,
                  BIAS=bias is not None, CLAMPED=glu is not None, ACTIVE=active is not None)
    try:
        _packed_mm[grid](*args, **consts, **cfg)
    except triton.CompilationError:
        if cfg["DOT"] or cfg["BT"] == 1:
            raise
        # Insurance for Triton versions that cannot lay out the rank-4 products of several tokens: one
        # token per pass computes the same, re-reading the program's rows from L1.
        cfg["BT"] = 1
        _packed_mm[grid](*args, **consts, **cfg)
    if scatter is not None:
        out.index_copy_(0, scatter, target)


def _half_operands(x, out) -> bool:
    # fp16 inputs keep fp16 on the tensor cores; the interpreter computes bf16 dots wrongly (numpy has no
    # bf16), so it checks that path's indexing in fp16.
    return x.dtype == torch.float16 or out.dtype == torch.float16 or _interpreted()


# ---------------------------------------------------------------- few rows: x in 8-bit integers

# Formats the integer route reads, and the byte alignment their loads need: q4_k's and q5_k's quants are read as
# words (their 144- and 176-byte blocks keep them aligned), q4_0's, q8_0's and q6_k's as 16-bit halves joined into
# words (their 18-, 34- and 210-byte blocks leave every other block's quants 2 bytes off a word), mxfp4's a byte at
# a time (its 17-byte blocks leave them at any offset).
_Q8_FORMATS = {"q4_k": 16, "q5_k": 16, "q4_0": 2, "q8_0": 2, "q6_k": 2, "mxfp4": 1}
_Q8_WORDS = {"q4_k": 8, "q5_k": 8}  # words a half unit (64-weight units); the others 4 (32-weight units)
# Rows per group up to which the integer route takes a launch (its steps hold up to 4 tokens): beyond, the weights
# unpacked again every step cost more than the tensor-core tiles (docs/measurements.md, "Session 40").
_Q8_ROWS = 4
# MOEDESK_Q8_ACTIVATIONS=0 keeps few-row launches on the float32 FMAs (for a side-by-side measurement).
_Q8_WANTED = os.environ.get("MOEDESK_Q8_ACTIVATIONS", "1") != "0"
# MOEDESK_Q8_MXFP4=0 keeps mxfp4 (gpt-oss) off the route alone, for a side-by-side measurement of that format.
_Q8_MXFP4 = os.environ.get("MOEDESK_Q8_MXFP4", "1") != "0"


def _few_rows(m: int, groups: int) -> bool:
    return -(-m // groups) <= _Q8_ROWS


# One packed matrix (`packed_linear`) beyond _Q8_ROWS rows: the integer route's passes of 4 tokens beat the float
# tiles up to _Q8_LINEAR_ROWS rows on any matrix, and below LINEAR_ROWS where those tiles' programs (a 64-row slice of
# the matrix each, the whole row's length in sequence) number less than two per SM: the q/k/v and output projections
# at 16 sequences, though not a head (docs/measurements.md, "Session 53").
_Q8_LINEAR_ROWS = 8
_FLOAT_TILE_ROWS = 64
_PROGRAMS_PER_SM = 2


def linear_takes_q8(m: int, rows: int, sms: int) -> bool:
    """Whether `packed_linear` of m rows of x through a matrix of `rows` rows takes the integer route on a GPU of
    `sms` SMs (x 16-bit, the format one the route reads)."""
    return m <= _Q8_LINEAR_ROWS or m < LINEAR_ROWS and -(-rows // _FLOAT_TILE_ROWS) < _PROGRAMS_PER_SM * sms


_SMS: dict[torch.device, int] = {}


def _linear_q8(x: torch.Tensor, m: int, rows: int) -> bool:
    if not x.is_cuda:  # the interpreter: the rows alone decide
        return linear_takes_q8(m, rows, 0)
    if x.device not in _SMS:
        _SMS[x.device] = torch.cuda.get_device_properties(x.device).multi_processor_count
    return linear_takes_q8(m, rows, _SMS[x.device])


def _q8_by_default(x: torch.Tensor, m: int, groups: int, rows: int, linear: bool) -> bool:
    """Whether rows of a launch the integer route can take are few enough that it does, untold by a tile."""
    return _few_rows(m, groups) or linear and _linear_q8(x, m, rows)


def takes_q8(x, stack, fmt, m, groups, linear: bool = False) -> bool:
    """Whether a launch of m rows over `groups` groups takes the integer route by default (tests, benchmarks);
    linear: the one matrix of `packed_linear`, stack its rows [R, row_bytes] or [1, R, row_bytes]."""
    return _q8_route(x, stack, fmt, x.dtype) and _q8_by_default(x, m, groups, stack.shape[-2], linear)


def _q8_route(x, stack, fmt, dtype) -> bool:
    """Whether a launch can take the integer route: a format it reads, a 16-bit layer (float32 layers keep the
    float32 path, exactly as the reference) and experts aligned as the format's loads need."""
    align = _Q8_FORMATS.get(fmt)
    if fmt == "mxfp4" and not _Q8_MXFP4:
        return False
    return (_Q8_WANTED and align is not None and dtype != torch.float32
            and all(n % align == 0 for n in (stack.data_ptr(), stack.stride(0), stack.shape[-1])))


# One warp of ROWS rows x NB units a step, by (format, tokens a step): the fastest of tests/perf/bench_gpu_quant.py's
# sweep on the Mixtral shape (docs/measurements.md, "Session 41"; mxfp4's on gpt-oss's, "Sessions 52 and 54"); 2 x 16
# where no other was faster. The formats of 32-weight units (q4_0, q8_0, q6_k, mxfp4) take one row of 32 units at one
# token, mxfp4 two rows at two tokens; q4_k and q5_k one row at four.
_Q8_TILES = {("q4_0", 1): (1, 32), ("q8_0", 1): (1, 32), ("q6_k", 1): (1, 32), ("mxfp4", 1): (1, 32),
             ("mxfp4", 2): (2, 32), ("q4_k", 4): (1, 16), ("q5_k", 4): (1, 16)}


def _q8_config(per_group: int, fmt: str) -> dict:
    bt = min(_Q8_ROWS, triton.next_power_of_2(max(per_group, 1)))
    if _interpreted():
        return dict(ROWS=64, NB=4, BT=bt, num_warps=1)
    rows, nb = _Q8_TILES.get((fmt, bt), (2, 16))
    return dict(ROWS=rows, NB=nb, BT=bt, num_warps=1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) as llama.cpp's q8_1 keeps activations: per block of 32, int8 q = round(x / d)
    with d = max|x| / 127, and the block's sum d * sum(q) (what the k-quants' minimums multiply), so that a packed
    product computes W @ (d * q) exactly as dequantising both would.
    Returns (q [M, K] int8, d [M, K/32] float32, sums [M, K/32] float32)."""
    m, k = x.shape
    blocks = k // 32
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    d = torch.empty(m, blocks, dtype=torch.float32, device=x.device)
    sums = torch.empty_like(d)
    if m:
        per = 64 if _interpreted() else 8
        _q8_rows[(m, triton.cdiv(blocks, per))](x, x.stride(0), q, d, sums, blocks, BLOCKS=per)
    return q, d, sums


def _q8_format_id(fmt: str) -> int:
    return _MXFP4_SIGNED_ID if fmt == "mxfp4" and _MXFP4_LOOKUP else _FMT_ID[fmt]


def _launch_q8(x, stack, fmt, ends, out, *, rows, k, gated, m, groups, bias, glu, config, active=None, gather=None,
               scatter=None):
    """`_launch` for few rows of x: x rounded to 8-bit integers per block of 32 (as llama.cpp's decode kernels do),
    each word of four packed weight bytes unpacked with two mask operations and multiplied into four int8 x at once
    (dp4a): an instruction or so a weight where the float32 path spends several. gather, scatter: as `_launch`'s,
    read and stored by the kernel itself (x's rows are rounded once however many pairs read them)."""
    q, d, sums = quantize_rows(x)
    words = _Q8_WORDS.get(fmt, 4)
    cfg = {key: v for key, v in (config or _q8_config(-(-m // groups), fmt)).items() if key != "Q8"}
    grid = (triton.cdiv(rows, cfg["ROWS"]), groups if active is None else active.shape[0])
    bias = None if bias is None else bias.contiguous()
    _q8_mm[grid](q.view(torch.int32), k // 4, d, sums, k // 32, stack, stack.stride(0), ends,
                 ends if active is None else active, out, out.stride(0), ends if gather is None else gather,
                 ends if scatter is None else scatter, rows, stack.shape[-1], k // (8 * words),
                 out if bias is None else bias, 0 if bias is None else bias.stride(0),
                 glu.alpha if glu is not None else 0.0, glu.limit if glu is not None else 0.0, FMT=_q8_format_id(fmt),
                 W=words, GATED=gated, BIAS=bias is not None, CLAMPED=glu is not None, ASM=not _interpreted(),
                 ACTIVE=active is not None, GATHER=gather is not None, SCATTER=scatter is not None, **cfg)


# ---------------------------------------------------------------- many rows: bf16 scratch and a grouped GEMM

_grouped_mm = getattr(torch, "_grouped_mm", None)


# _dequant's tile, ROWS weight rows x NB units a program: the fastest of tests/perf/bench_dequant.py's sweep on
# gpt-oss-20b's experts, 4% ahead of the 16 x 8 before it (docs/measurements.md, "Session 54").
_DEQUANT_TILE = dict(ROWS=16, NB=4, num_warps=4)
_DEQUANT_OVERRIDE: dict | None = None  # bench_dequant's sweep sets this


def _dequant_route_works(x: torch.Tensor) -> bool:
    return (_grouped_mm is not None and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) == (9, 0))


def dequantize_experts(stack: torch.Tensor, fmt: str, k: int, ends: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[G, R, k] weights in `dtype` from packed stack rows [>=G, R, row_bytes(k)], G = len(ends) (all when
    None); experts whose group is empty are skipped and left unwritten, since nothing reads them."""
    g = stack.shape[0] if ends is None else ends.shape[0]
    r = stack.shape[1]
    out = torch.empty(g, r, k, dtype=dtype, device=stack.device)
    lanes = _LANES[fmt]
    units = k // (2 * lanes)
    tile = dict(ROWS=32, NB=16) if _interpreted() else _DEQUANT_OVERRIDE or _DEQUANT_TILE
    grid = (triton.cdiv(r, tile["ROWS"]), triton.cdiv(units, tile["NB"]), g)
    _dequant[grid](stack, stack.stride(0), ends if ends is not None else stack, out, r, k, stack.shape[-1], units,
                   FMT=_FMT_ID[fmt], L=lanes, SKIP=ends is not None, **tile)
    return out


def _dequant_route(x, w: ExpertWeights, ends, out):
    # Each row's group, for the biases: found on the device, so that nothing waits for the routing on the host.
    group = None if w.plain else torch.searchsorted(ends, torch.arange(x.shape[0], dtype=ends.dtype,
                                                                       device=ends.device), right=True)
    gate_up = dequantize_experts(w.gate_up, w.gate_up_format, w.hidden, ends, x.dtype)
    h = _grouped_mm(x, gate_up.transpose(1, 2), offs=ends)
    del gate_up
    if _FUSED_EPILOGUE:
        act = x.new_empty(x.shape[0], w.width)
        _epilogue(h, group, w.gate_up_bias, act, w.glu, gated=True)
    else:
        h = h.float()
        if w.gate_up_bias is not None:
            h += w.gate_up_bias[group].float()
        gate, up = h.chunk(2, dim=-1)
        act = (w.glu(gate, up) if w.glu is not None else torch.nn.functional.silu(gate) * up).to(x.dtype)
    down = dequantize_experts(w.down, w.down_format, w.width, ends, x.dtype)
    y = _grouped_mm(act, down.transpose(1, 2), offs=ends)
    if w.down_bias is None:
        out.copy_(y)
    elif _FUSED_EPILOGUE:
        _epilogue(y, group, w.down_bias, out, None, gated=False)
    else:
        out.copy_(y.float() + w.down_bias[group].float())
    return out


# The dequant route's work between and after its GEMMs (the biases by each row's expert, the activation, the casts) in
# one kernel a projection, where torch takes eight or so passes over [rows, 2F] in float32 (docs/measurements.md,
# "Session 56"). MOEDESK_FUSED_EPILOGUE=0 takes torch's passes, for a side-by-side measurement.
_FUSED_EPILOGUE = os.environ.get("MOEDESK_FUSED_EPILOGUE", "1") != "0"
_EPILOGUE_TILE = (8, 256)  # rows x columns a program: 8 KB of 16-bit outputs


def _epilogue(h: torch.Tensor, group: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor, glu,
              gated: bool) -> None:
    """out [M, N] = act(h + bias[group]) in float32, cast to out's dtype: with `gated`, h [M, 2N] is gate then up
    and act silu(gate) * up (or glu, gpt-oss's clamped form); else h [M, N] and act the identity."""
    m, n = out.shape
    rows, cols = (16, 64) if _interpreted() else _EPILOGUE_TILE
    _rows_epilogue[(triton.cdiv(m, rows), triton.cdiv(n, cols))](
        h, h.stride(0), h if group is None else group, h if bias is None else bias,
        0 if bias is None else bias.stride(0), out, out.stride(0), m, n,
        glu.alpha if glu is not None else 0.0, glu.limit if glu is not None else 0.0,
        GATED=gated, BIAS=bias is not None, CLAMPED=glu is not None, ROWS=rows, COLS=cols)


# ---------------------------------------------------------------- the kernels

# The integer route's mxfp4 read with its codes looked up as signed bytes (`_e2m1_signed`) rather than split by sign
# (`_e2m1_bytes`): a fifth fewer instructions a weight, and whole gpt-oss-20b's step at 16 sequences a tenth shorter
# (docs/measurements.md, "Session 54"); MOEDESK_Q8_MXFP4_LOOKUP=0 keeps the split read, for a side-by-side run.
_MXFP4_LOOKUP = os.environ.get("MOEDESK_Q8_MXFP4_LOOKUP", "1") != "0"
_MXFP4_SIGNED_ID = 6  # the kernels' FMT for that read

if triton is not None:
    _MXFP4_SIGNED = tl.constexpr(_MXFP4_SIGNED_ID)
    # Twice the E2M1 values of codes 0-7 (0, 1, 2, 3 | 4, 6, 8, 12) and of 8-15 (their negatives) in four registers;
    # each prmt picks four bytes by the low three bits of four selector nibbles (bit 3 clear: copied as they are).
    # The codes' sign bits choose, per byte, the positive or the negative lookup; then the low nibbles' bytes and the
    # high nibbles' are gathered into a word each.
    _E2M1_LOOKUP = tl.constexpr("""{
        .reg .b32 c0, c1, c2, c3, m, s, p, n, t0, t1;
        mov.b32 c0, 0x03020100;
        mov.b32 c1, 0x0C080604;
        mov.b32 c2, 0xFDFEFF00;
        mov.b32 c3, 0xF4F8FAFC;
        and.b32 m, $2, 0x77777777;
        and.b32 s, $2, 0x88888888;
        shr.u32 s, s, 1;
        or.b32 s, s, 0x32103210;
        prmt.b32 p, c0, c1, m;
        prmt.b32 n, c2, c3, m;
        prmt.b32 t0, p, n, s;
        shr.u32 m, m, 16;
        shr.u32 s, s, 16;
        prmt.b32 p, c0, c1, m;
        prmt.b32 n, c2, c3, m;
        prmt.b32 t1, p, n, s;
        prmt.b32 $0, t0, t1, 0x6420;
        prmt.b32 $1, t0, t1, 0x7531;
    }""")

    @triton.jit
    def _gated(gate, up, alpha, limit, CLAMPED: tl.constexpr):
        """The activation between a packed expert's projections, in float32: silu(gate) * up, or where CLAMPED
        gpt-oss's (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)."""
        if CLAMPED:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        return gate * tl.sigmoid(gate) * up

    @triton.jit
    def _rows_epilogue(h_ptr, h_stride, group_ptr, bias_ptr, bias_stride, out_ptr, out_stride, M, N, alpha, limit,
                       GATED: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr, ROWS: tl.constexpr,
                       COLS: tl.constexpr):
        """`_epilogue`: a tile of ROWS x COLS outputs, its rows' biases picked by group_ptr's expert per row."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        live = (rows < M)[:, None] & (cols < N)[None, :]
        src = h_ptr + rows.to(tl.int64)[:, None] * h_stride + cols[None, :]
        acc = tl.load(src, mask=live, other=0.0).to(tl.float32)
        if BIAS:
            g = tl.load(group_ptr + rows, mask=rows < M, other=0).to(tl.int64)
            b = bias_ptr + g[:, None] * bias_stride + cols[None, :]
            acc += tl.load(b, mask=live, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(src + N, mask=live, other=0.0).to(tl.float32)
            if BIAS:
                up += tl.load(b + N, mask=live, other=0.0).to(tl.float32)
            acc = _gated(acc, up, alpha, limit, CLAMPED)
        dst = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _f16(p, mask):
        """Little-endian float16s at byte addresses p (every format keeps them 2-byte aligned), as float32."""
        return tl.load(p.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _k_scale_min(sp, s, mask):
        """The 6-bit (scale, min) of sub-block s of a q4_k/q5_k block whose 12 scale bytes start at sp."""
        a = tl.load(sp + s, mask=mask, other=0).to(tl.int32)
        c = tl.load(sp + s + 4, mask=mask, other=0).to(tl.int32)
        e = tl.load(sp + tl.maximum(s - 4, 0), mask=mask, other=0).to(tl.int32)
        low = s < 4
        sc = tl.where(low, a & 63, (c & 15) | ((e >> 6) << 4))
        mn = tl.where(low, c & 63, (c >> 4) | ((a >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _e2m1_twice(c):
        """Twice the E2M1 value of 4-bit codes c (int32): 0, 1, 2, 3, 4, 6, 8, 12 and their negatives, as float32.
        Twice, so that every value is an integer and the block's scale 2^(e - 128) a float32 for every exponent
        (kernels.quant_formats._mxfp4). Computed from the bits rather than looked up: no table load per weight."""
        mag = c & 7
        twice = tl.where(mag < 2, mag, (2 + (mag & 1)) << tl.maximum((mag >> 1) - 1, 0)).to(tl.float32)
        return tl.where(c >= 8, -twice, twice)

    @triton.jit
    def _e8m0_half(e):
        """2^(e - 128) for E8M0 exponents e (int32, 0..255) as float32, built from its bits: exact for every e,
        e = 0 and 1 giving the subnormals 2^-128 and 2^-127, e = 255 the finite 2^127 (no NaN, as the reference)."""
        bits = tl.where(e >= 2, (e - 1) << 23, (e + 1) << 21)  # biased exponent e - 1, else the subnormals' bit
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _planes(row, u, l, umask, mask, FMT: tl.constexpr):
        """Unit u's two planes in rows `row`: weight = scale * q - offset, with q [R, NB, L] and scale,
        offset [R, NB, 1] (one per unit, so their decoding is paid once per L weights), and the matrix
        columns of each plane [1, NB, L]: (q0, s0, o0, col0, q1, s1, o1, col1). row: byte pointers
        [R, 1, 1]; u [1, NB, 1]; l [1, 1, L]; umask [R, NB, 1] and mask [R, NB, L] the live ones."""
        if FMT == 5:  # mxfp4: 17-byte blocks of 32, an exponent then q4_0's nibble layout of E2M1 codes
            base = row + u * 17
            s0 = _e8m0_half(tl.load(base, mask=umask, other=0).to(tl.int32))
            b = tl.load(base + 1 + l, mask=mask, other=0).to(tl.int32)
            q0 = _e2m1_twice(b & 15)
            q1 = _e2m1_twice(b >> 4)
            s1 = s0
            o0 = 0.0
            o1 = 0.0
            col0 = u * 32 + l
            col1 = col0 + 16
        elif FMT == 0:  # q4_0: 18-byte blocks of 32; byte l: columns l (low nibble) and l + 16 (high)
            base = row + u * 18
            s0 = _f16(base, umask)
            b = tl.load(base + 2 + l, mask=mask, other=0).to(tl.int32)
            q0 = ((b & 15) - 8).to(tl.float32)
            q1 = ((b >> 4) - 8).to(tl.float32)
            s1 = s0
            o0 = 0.0
            o1 = 0.0
            col0 = u * 32 + l
            col1 = col0 + 16
        elif FMT == 1:  # q8_0: 34-byte blocks of 32, the two halves as the planes
            base = row + u * 34
            s0 = _f16(base, umask)
            q = (base + 2 + l).to(tl.pointer_type(tl.int8))
            q0 = tl.load(q, mask=mask, other=0).to(tl.float32)
            q1 = tl.load(q + 16, mask=mask, other=0).to(tl.float32)
            s1 = s0
            o0 = 0.0
            o1 = 0.0
            col0 = u * 32 + l
            col1 = col0 + 16
        elif FMT == 4:
            # q6_k: a unit is 16 bytes of low nibbles, (block, half, part p, sub): its low nibbles are
            # quarter p of the half, its high ones quarter p + 2, each 16 weights under one scale.
            blk = u // 8
            half = (u // 4) % 2
            p = (u // 2) % 2
            sub = u % 2
            base = row + blk * 210
            ql = tl.load(base + half * 64 + p * 32 + sub * 16 + l, mask=mask, other=0).to(tl.int32)
            qh = tl.load(base + 128 + half * 32 + sub * 16 + l, mask=mask, other=0).to(tl.int32)
            sp = (base + 192 + half * 8 + 2 * p + sub).to(tl.pointer_type(tl.int8))
            d = _f16(base + 208, umask)
            s0 = d * tl.load(sp, mask=umask, other=0).to(tl.float32)
            s1 = d * tl.load(sp + 4, mask=umask, other=0).to(tl.float32)
            q0 = (((ql & 15) | (((qh >> (2 * p)) & 3) << 4)) - 32).to(tl.float32)
            q1 = (((ql >> 4) | (((qh >> (2 * p + 4)) & 3) << 4)) - 32).to(tl.float32)
            o0 = 0.0
            o1 = 0.0
            col0 = blk * 256 + half * 128 + p * 32 + sub * 16 + l
            col1 = col0 + 64
        else:  # q4_k (2) / q5_k (3): unit = (block, pair j of sub-blocks 2j, 2j + 1) sharing 32 bytes
            blk = u // 4
            j = u % 4
            if FMT == 2:
                base = row + blk * 144
                b = tl.load(base + 16 + j * 32 + l, mask=mask, other=0).to(tl.int32)
                q0 = (b & 15).to(tl.float32)
                q1 = (b >> 4).to(tl.float32)
            else:
                base = row + blk * 176
                b = tl.load(base + 48 + j * 32 + l, mask=mask, other=0).to(tl.int32)
                qh = tl.load(base + 16 + l, mask=mask, other=0).to(tl.int32)
                q0 = ((b & 15) | (((qh >> (2 * j)) & 1) << 4)).to(tl.float32)
                q1 = ((b >> 4) | (((qh >> (2 * j + 1)) & 1) << 4)).to(tl.float32)
            d = _f16(base, umask)
            dmin = _f16(base + 2, umask)
            sc0, m0 = _k_scale_min(base + 4, 2 * j, umask)
            sc1, m1 = _k_scale_min(base + 4, 2 * j + 1, umask)
            s0 = d * sc0
            s1 = d * sc1
            o0 = dmin * m0
            o1 = dmin * m1
            col0 = blk * 256 + j * 64 + l
            col1 = col0 + 32
        return q0, s0, o0, col0, q1, s1, o1, col1

    @triton.jit
    def _row_dot(x_ptr, x_stride, toks, tlive, row, rlive, UNITS, L: tl.constexpr, NB: tl.constexpr,
                 BT: tl.constexpr, ROWS: tl.constexpr, DOT: tl.constexpr, HALF: tl.constexpr, FMT: tl.constexpr):
        """[BT, ROWS] dot products of tokens `toks` of x with packed rows `row` ([ROWS, 1, 1] byte pointers).

        DOT: the weights are formed in float32, rounded to 16 bits (bf16, or fp16 where HALF) and fed to the
        tensor cores with the tokens. Otherwise each plane's products are summed before its unit's scale
        multiplies them: per token one float32 FMA a weight besides unpacking it once."""
        nb = tl.arange(0, NB)[None, :, None]
        l = tl.arange(0, L)[None, None, :]
        rl = rlive[:, None, None]
        acc = tl.zeros([BT, ROWS], dtype=tl.float32)
        for u0 in range(0, UNITS, NB):
            u = u0 + nb
            ulive = u < UNITS
            q0, s0, o0, c0, q1, s1, o1, c1 = _planes(row, u, l, rl & ulive, rl & ulive & (l < L), FMT)
            xrow = x_ptr + toks[:, None, None].to(tl.int64) * x_stride
            xm = tlive[:, None, None] & ulive & (l < L)
            if DOT:
                op = tl.float16 if HALF else tl.bfloat16
                x0 = tl.reshape(tl.load(xrow + c0, mask=xm, other=0.0).to(op), [BT, NB * L])
                x1 = tl.reshape(tl.load(xrow + c1, mask=xm, other=0.0).to(op), [BT, NB * L])
                w0 = tl.reshape((s0 * q0 - o0).to(op), [ROWS, NB * L])
                w1 = tl.reshape((s1 * q1 - o1).to(op), [ROWS, NB * L])
                acc = tl.dot(x0, tl.trans(w0), acc)
                acc = tl.dot(x1, tl.trans(w1), acc)
            elif BT == 1:  # x0, x1 [1, NB, L]; kept apart from the rank-4 form below, which ran at half the speed
                x0 = tl.load(xrow + c0, mask=xm, other=0.0).to(tl.float32)
                x1 = tl.load(xrow + c1, mask=xm, other=0.0).to(tl.float32)
                part = s0 * tl.sum(q0 * x0, axis=2, keep_dims=True) + s1 * tl.sum(q1 * x1, axis=2, keep_dims=True)
                if FMT == 2 or FMT == 3:  # the k-quants' minimum: -min * (sum of x over the sub-block)
                    part -= o0 * tl.sum(x0, axis=2, keep_dims=True) + o1 * tl.sum(x1, axis=2, keep_dims=True)
                acc += tl.reshape(tl.sum(tl.sum(part, axis=2), axis=1), [BT, ROWS])
            else:  # a few tokens (float32 x): each weight unpacked once, then BT float32 FMAs
                x0 = tl.load(xrow + c0, mask=xm, other=0.0).to(tl.float32)  # [BT, NB, L]
                x1 = tl.load(xrow + c1, mask=xm, other=0.0).to(tl.float32)
                d0 = tl.sum(q0[None, :, :, :] * x0[:, None, :, :], axis=3)  # [BT, ROWS, NB]
                d1 = tl.sum(q1[None, :, :, :] * x1[:, None, :, :], axis=3)
                part = tl.sum(s0, axis=2)[None, :, :] * d0 + tl.sum(s1, axis=2)[None, :, :] * d1
                if FMT == 2 or FMT == 3:
                    part -= (tl.sum(o0, axis=2)[None, :, :] * tl.sum(x0, axis=2)[:, None, :]
                             + tl.sum(o1, axis=2)[None, :, :] * tl.sum(x1, axis=2)[:, None, :])
                acc += tl.sum(part, axis=2)
        return acc

    @triton.jit
    def _packed_mm(x_ptr, x_stride, w_ptr, expert_stride, ends_ptr, active_ptr, out_ptr, out_stride, R, ROW_BYTES,
                   UNITS, SPLIT, bias_ptr, bias_stride, alpha, limit, FMT: tl.constexpr, L: tl.constexpr,
                   NB: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr, DOT: tl.constexpr, HALF: tl.constexpr,
                   GATED: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr, ACTIVE: tl.constexpr):
        """out[t, r] = x[t] . W_g[r] (+ bias_g[r] where BIAS) for the tokens t of group g. GATED: W_g is [gate; up]
        (2R rows, the bias likewise) and out[t, r] = silu(gate) * up in float32, or where CLAMPED gpt-oss's
        (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). ACTIVE: programs
        only for the groups active_ptr lists (launched_group)."""
        g, start, end = launched_group(active_ptr, ends_ptr, ACTIVE)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rlive = rows < R
        expert = w_ptr + g.to(tl.int64) * expert_stride
        row = (expert + rows.to(tl.int64) * ROW_BYTES)[:, None, None]
        bias = bias_ptr + g.to(tl.int64) * bias_stride + rows
        for t0 in range(start + tl.program_id(2) * BT, end, SPLIT * BT):
            toks = t0 + tl.arange(0, BT)
            tlive = toks < end
            acc = _row_dot(x_ptr, x_stride, toks, tlive, row, rlive, UNITS, L, NB, BT, ROWS, DOT, HALF, FMT)
            if BIAS:
                acc += tl.load(bias, mask=rlive, other=0.0).to(tl.float32)[None, :]
            if GATED:
                up = _row_dot(x_ptr, x_stride, toks, tlive, row + R * ROW_BYTES, rlive, UNITS, L, NB, BT, ROWS,
                              DOT, HALF, FMT)
                if BIAS:
                    up += tl.load(bias + R, mask=rlive, other=0.0).to(tl.float32)[None, :]
                acc = _gated(acc, up, alpha, limit, CLAMPED)
            dst = out_ptr + toks[:, None].to(tl.int64) * out_stride + rows[None, :]
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=tlive[:, None] & rlive[None, :])

    @triton.jit
    def _group_empty(ends_ptr, g):
        """Whether group g of the groups ending at ends_ptr's counts has no rows (`dequantize_experts` skips it)."""
        start = tl.where(g > 0, tl.load(ends_ptr + tl.maximum(g - 1, 0)), 0)
        return tl.load(ends_ptr + g) == start

    @triton.jit
    def _dequant(w_ptr, expert_stride, ends_ptr, out_ptr, R, K, ROW_BYTES, UNITS, FMT: tl.constexpr,
                 L: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, SKIP: tl.constexpr):
        g = tl.program_id(2)
        if SKIP:
            if _group_empty(ends_ptr, g):
                return
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rl = (rows < R)[:, None, None]
        l = tl.arange(0, L)[None, None, :]
        u = tl.program_id(1) * NB + tl.arange(0, NB)[None, :, None]
        umask = rl & (u < UNITS)
        mask = umask & (l < L)
        row = (w_ptr + g.to(tl.int64) * expert_stride + rows.to(tl.int64) * ROW_BYTES)[:, None, None]
        q0, s0, o0, c0, q1, s1, o1, c1 = _planes(row, u, l, umask, mask, FMT)
        dst = (out_ptr + g.to(tl.int64) * R * K + rows.to(tl.int64) * K)[:, None, None]
        dtype = out_ptr.dtype.element_ty
        tl.store(dst + c0, (s0 * q0 - o0).to(dtype), mask=mask)
        tl.store(dst + c1, (s1 * q1 - o1).to(dtype), mask=mask)

    @triton.jit
    def _q8_rows(x_ptr, x_stride, q_ptr, d_ptr, s_ptr, BLOCKS_ALL, BLOCKS: tl.constexpr):
        r = tl.program_id(0)
        b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        live = b < BLOCKS_ALL
        cols = b[:, None] * 32 + tl.arange(0, 32)[None, :]
        v = tl.load(x_ptr + r.to(tl.int64) * x_stride + cols, mask=live[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
        q = tl.minimum(tl.maximum(tl.floor(v * inv[:, None] + 0.5), -127.0), 127.0)
        tl.store(q_ptr + r.to(tl.int64) * BLOCKS_ALL * 32 + cols, q.to(tl.int8), mask=live[:, None])
        tl.store(d_ptr + r.to(tl.int64) * BLOCKS_ALL + b, amax / 127.0, mask=live)
        tl.store(s_ptr + r.to(tl.int64) * BLOCKS_ALL + b, tl.sum(q, axis=1) * (amax / 127.0), mask=live)

    @triton.jit
    def _dp4a(a, b, ASM: tl.constexpr):
        """The sum of the four signed byte products of int32 words a and b: one dp4a on the GPU; in the
        interpreter (which runs no assembly) from the bytes."""
        a, b = tl.broadcast(a, b)
        if ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                             is_pure=True, pack=1)
        s = tl.zeros(a.shape, dtype=tl.int32)
        for byte in tl.static_range(4):
            s += ((a << (24 - 8 * byte)) >> 24) * ((b << (24 - 8 * byte)) >> 24)
        return s

    @triton.jit
    def _halves(p, i, zero, mask):
        """Words i of 16-bit-aligned bytes at p, each joined from two 16-bit halves (little-endian)."""
        h = p.to(tl.pointer_type(tl.int16)) + 2 * i + zero
        low = tl.load(h, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return low | (tl.load(h + 1, mask=mask, other=0).to(tl.int32) << 16)

    @triton.jit
    def _bytes_word(p, i, zero, mask):
        """Words i of bytes at p, at any alignment: four byte loads joined (little-endian)."""
        b = p + 4 * i + zero
        w = tl.load(b, mask=mask, other=0).to(tl.int32)
        w |= tl.load(b + 1, mask=mask, other=0).to(tl.int32) << 8
        w |= tl.load(b + 2, mask=mask, other=0).to(tl.int32) << 16
        return w | (tl.load(b + 3, mask=mask, other=0).to(tl.int32) << 24)

    @triton.jit
    def _e2m1_bytes(c):
        """Words of four E2M1 codes (a byte each, 0..15) as twice their values in bytes, split by sign: (the positive
        values, 0 where negative; the negative ones' magnitudes, 0 where positive), so that a signed dot product is
        the difference of two dp4a. Magnitude codes 0..7 give 0, 1, 2, 3, 4, 6, 8, 12: the code, plus its low two
        bits from 4 on, plus 2 at 7. Bytes stay under 16, so no sum carries into the next byte."""
        m = c & 0x07070707
        from4 = ((m >> 2) & 0x01010101) * 255  # 0xFF in the bytes whose code is 4 or more
        at7 = m & (m >> 1) & (m >> 2) & 0x01010101
        v = m + ((m & 0x03030303) & from4) + (at7 << 1)
        negative = v & (((c >> 3) & 0x01010101) * 255)
        return v ^ negative, negative

    @triton.jit
    def _e2m1_signed(w, ASM: tl.constexpr):
        """Words w of eight E2M1 codes (each byte's low nibble, then its high one) as two words of four signed bytes,
        twice the codes' values: (the low nibbles', the high nibbles'), so that one dp4a takes a half's signs too.
        On the GPU byte permutes (prmt) look the codes up in the 16 values held in four registers, as llama.cpp's
        MXFP4 kernels do (_E2M1_LOOKUP); in the interpreter, from `_e2m1_bytes` a byte at a time."""
        if ASM:
            return tl.inline_asm_elementwise(_E2M1_LOOKUP, "=r,=r,r", [w], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)
        lo, lo_neg = _e2m1_bytes(w & 0x0F0F0F0F)
        hi, hi_neg = _e2m1_bytes((w >> 4) & 0x0F0F0F0F)
        return _signed_bytes(lo, lo_neg), _signed_bytes(hi, hi_neg)

    @triton.jit
    def _signed_bytes(positive, negative):
        """positive - negative byte by byte (each byte of one of them zero), as bytes in two's complement."""
        word = positive * 0
        for byte in tl.static_range(4):
            b = ((positive >> (8 * byte)) & 255) - ((negative >> (8 * byte)) & 255)
            word |= (b & 255) << (8 * byte)
        return word

    @triton.jit
    def _q8_unit(row, u, i, zero, mask, FMT: tl.constexpr, ASM: tl.constexpr):
        """Unit u of rows `row` ([ROWS, 1, 1] byte pointers) as two halves of W words of four signed bytes each
        (lo, hi), each half's scale and offset ([ROWS, NB, 1]) and the column of lo's first weight ([1, NB, 1];
        hi's sits `_q8_span(FMT)` columns on): a half's dot product with x is scale * (x's scale * its integer sum)
        - offset * (x's block sum). Last, mxfp4's negative weights' magnitudes (lo_neg, hi_neg; zero for the other
        formats), whose products `_q8_token` takes off.
        - q4_k, q5_k: a block's sub-blocks 2j and 2j + 1 (j = u % 4), 8 words whose low nibbles are sub-block 2j's
          weights and high ones 2j + 1's (q5_k: each with its fifth bit from the block's high-bit bytes).
        - q4_0: a block, whose 4 words' low nibbles are its first 16 columns and high ones its last 16, less 8 (an
          offset of 8 scales, all on the first half). q8_0: a block, its first and last 16 bytes.
        - q6_k: 16 weights of a 128-column half (part p, sub-block s) and the 16 of the quarter two on, each 16
          under a scale of its own, less 32 (taken off in integers: `_q8_token`).
        - mxfp4: a block, laid out as q4_0's, its codes as twice their E2M1 values (`_e2m1_bytes`; where FMT is
          _MXFP4_SIGNED, `_e2m1_signed`) under the scale 2^(e - 128), as the float path reads them."""
        if FMT == 2 or FMT == 3:
            j = u % 4
            blk = u // 4
            base = row + blk * (144 if FMT == 2 else 176)
            w = tl.load((base + (16 if FMT == 2 else 48) + j * 32).to(tl.pointer_type(tl.int32)) + i + zero,
                        mask=mask, other=0)
            lo = w & 0x0F0F0F0F
            hi = (w >> 4) & 0x0F0F0F0F
            if FMT == 3:
                h = tl.load((base + 16).to(tl.pointer_type(tl.int32)) + i + zero, mask=mask, other=0)
                lo |= ((h >> (2 * j)) & 0x01010101) << 4
                hi |= ((h >> (2 * j + 1)) & 0x01010101) << 4
            d = _f16(base, mask)
            dmin = _f16(base + 2, mask)
            sc0, m0 = _k_scale_min(base + 4, 2 * j, mask)
            sc1, m1 = _k_scale_min(base + 4, 2 * j + 1, mask)
            return lo, hi, d * sc0, d * sc1, dmin * m0, dmin * m1, blk * 256 + j * 64, zero, zero
        elif FMT == 0:
            base = row + u * 18
            w = _halves(base + 2, i, zero, mask)
            d = _f16(base, mask)
            return w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F, d, d, 8.0 * d, 0.0 * d, u * 32, zero, zero
        elif FMT == 1:
            base = row + u * 34
            d = _f16(base, mask)
            return (_halves(base + 2, i, zero, mask), _halves(base + 18, i, zero, mask), d, d, 0.0 * d, 0.0 * d,
                    u * 32, zero, zero)
        elif FMT == 5 or FMT == _MXFP4_SIGNED:  # mxfp4: q4_0's nibble layout of E2M1 codes after an exponent
            base = row + u * 17
            w = _bytes_word(base + 1, i, zero, mask)
            s = _e8m0_half(tl.load(base, mask=mask, other=0).to(tl.int32))
            if FMT == 5:  # twice the values in integers, the negative ones apart
                lo, lo_neg = _e2m1_bytes(w & 0x0F0F0F0F)
                hi, hi_neg = _e2m1_bytes((w >> 4) & 0x0F0F0F0F)
            else:  # twice the values in signed bytes
                lo, hi = _e2m1_signed(w, ASM)
                lo_neg = zero
                hi_neg = zero
            return lo, hi, s, s, 0.0 * s, 0.0 * s, u * 32, lo_neg, hi_neg
        else:  # q6_k: the float path's units (`_planes`), read as words
            blk = u // 8
            half = (u // 4) % 2
            p = (u // 2) % 2
            sub = u % 2
            base = row + blk * 210
            ql = _halves(base + half * 64 + p * 32 + sub * 16, i, zero, mask)
            qh = _halves(base + 128 + half * 32 + sub * 16, i, zero, mask)
            lo = (ql & 0x0F0F0F0F) | (((qh >> (2 * p)) & 0x03030303) << 4)
            hi = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * p + 4)) & 0x03030303) << 4)
            sp = (base + 192 + half * 8 + 2 * p + sub).to(tl.pointer_type(tl.int8))
            d = _f16(base + 208, mask)
            s0 = d * tl.load(sp, mask=mask, other=0).to(tl.float32)
            s1 = d * tl.load(sp + 4, mask=mask, other=0).to(tl.float32)
            return lo, hi, s0, s1, 0.0 * d, 0.0 * d, blk * 256 + half * 128 + p * 32 + sub * 16, zero, zero

    @triton.jit
    def _q8_span(FMT: tl.constexpr):
        """Columns from a unit's lo half to its hi half (`_q8_unit`)."""
        return 32 if FMT == 2 or FMT == 3 else 64 if FMT == 4 else 16

    @triton.jit
    def _q8_source(gather_ptr, t, end, GATHER: tl.constexpr):
        """x's row of launch row t ([1, 1, 1]): gather[t] where GATHER (row 0 past `end`, where nothing is read),
        else t itself."""
        t = tl.zeros([1, 1, 1], dtype=tl.int64) + t  # a loop counter, or a Python int in the interpreter
        src = t
        if GATHER:
            src = tl.load(gather_ptr + t, mask=t < end, other=0).to(tl.int64)
        return src

    @triton.jit
    def _q8_token(xw_ptr, xw_stride, xd_ptr, xd_stride, s_ptr, t, src, end, mask, c0, i, zero, lo, hi, s0, s1, o0,
                  o1, lo_neg, hi_neg, FMT: tl.constexpr, ASM: tl.constexpr):
        """One token's share of a unit step ([ROWS, NB, 1]): its x words (x's row src, launch row t) met with the
        unit's halves lo and hi (`_q8_unit`, lo's first column c0), its block scales and sums with theirs. x's
        pointers take the weights' shape (zero), so that x and the weights share a layout and nothing is shuffled
        between them."""
        t = tl.zeros([1, 1, 1], dtype=tl.int64) + t
        live = mask & (t < end)  # [ROWS, NB, 1]: the unit's and the token's
        span = _q8_span(FMT)
        xw = xw_ptr + src * xw_stride + (c0 >> 2) + i + zero
        x0 = tl.load(xw, mask=live, other=0)
        x1 = tl.load(xw + span // 4, mask=live, other=0)
        d0 = _dp4a(lo, x0, ASM)
        d1 = _dp4a(hi, x1, ASM)
        if FMT == 4:  # q6_k's quants less 32: 32 x the half's sum of x, in the same integers
            d0 -= _dp4a(zero + 0x20202020, x0, ASM)
            d1 -= _dp4a(zero + 0x20202020, x1, ASM)
        if FMT == 5:  # mxfp4's negative weights
            d0 -= _dp4a(lo_neg, x0, ASM)
            d1 -= _dp4a(hi_neg, x1, ASM)
        d0 = tl.sum(d0, axis=2, keep_dims=True).to(tl.float32)
        d1 = tl.sum(d1, axis=2, keep_dims=True).to(tl.float32)
        b0 = c0 >> 5  # x's blocks of 32 (c0 >= 0: shifts, not signed division)
        b1 = (c0 + span) >> 5
        xd = xd_ptr + src * xd_stride
        xs = s_ptr + src * xd_stride
        return (s0 * tl.load(xd + b0, mask=live, other=0.0) * d0 + s1 * tl.load(xd + b1, mask=live, other=0.0) * d1
                - o0 * tl.load(xs + b0, mask=live, other=0.0) - o1 * tl.load(xs + b1, mask=live, other=0.0))

    @triton.jit
    def _q8_rows_dot(xw_ptr, xw_stride, xd_ptr, xd_stride, s_ptr, t0, end, src0, src1, src2, src3, row, rlive, UNITS,
                     FMT: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr,
                     ASM: tl.constexpr):
        """Dot products of the 8-bit tokens of launch rows t0 .. t0 + BT - 1 (those below `end`; x's rows src0 ..
        src3, words at xw_ptr, block scales and sums at xd_ptr, s_ptr) with packed rows `row` ([ROWS, 1, 1] byte
        pointers): four [ROWS] float32 vectors, the ones past BT zero. Each unit's weights and scales are
        unpacked once (`_q8_unit`) for all of the step's tokens."""
        nb = tl.arange(0, NB)[None, :, None]
        i = tl.arange(0, W)[None, None, :]
        rl = rlive[:, None, None]
        zero = tl.zeros([ROWS, NB, W], dtype=tl.int32)
        acc0 = tl.zeros([ROWS, NB, 1], dtype=tl.float32)  # per token, summed over the units after the loop
        acc1 = tl.zeros([ROWS, NB, 1], dtype=tl.float32)
        acc2 = tl.zeros([ROWS, NB, 1], dtype=tl.float32)
        acc3 = tl.zeros([ROWS, NB, 1], dtype=tl.float32)
        for u0 in range(0, UNITS, NB):
            u = u0 + nb
            wmask = rl & (u < UNITS)
            lo, hi, s0, s1, o0, o1, c0, lo_neg, hi_neg = _q8_unit(row, u, i, zero, wmask, FMT, ASM)
            acc0 += _q8_token(xw_ptr, xw_stride, xd_ptr, xd_stride, s_ptr, t0, src0, end, wmask, c0, i, zero, lo,
                              hi, s0, s1, o0, o1, lo_neg, hi_neg, FMT, ASM)
            if BT > 1:
                acc1 += _q8_token(xw_ptr, xw_stride, xd_ptr, xd_stride, s_ptr, t0 + 1, src1, end, wmask, c0, i, zero,
                                  lo, hi, s0, s1, o0, o1, lo_neg, hi_neg, FMT, ASM)
            if BT > 2:
                acc2 += _q8_token(xw_ptr, xw_stride, xd_ptr, xd_stride, s_ptr, t0 + 2, src2, end, wmask, c0, i, zero,
                                  lo, hi, s0, s1, o0, o1, lo_neg, hi_neg, FMT, ASM)
                acc3 += _q8_token(xw_ptr, xw_stride, xd_ptr, xd_stride, s_ptr, t0 + 3, src3, end, wmask, c0, i, zero,
                                  lo, hi, s0, s1, o0, o1, lo_neg, hi_neg, FMT, ASM)
        return (tl.sum(tl.sum(acc0, axis=2), axis=1), tl.sum(tl.sum(acc1, axis=2), axis=1),
                tl.sum(tl.sum(acc2, axis=2), axis=1), tl.sum(tl.sum(acc3, axis=2), axis=1))

    @triton.jit
    def _q8_out(acc, up, t, end, rows, rlive, bias, R, out_ptr, out_stride, scatter_ptr, alpha, limit,
                GATED: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr, SCATTER: tl.constexpr):
        """Launch row t's outputs: the bias, the activation between gate and up where GATED, stored in out's dtype
        at out's row t, or where SCATTER at row scatter[t]."""
        if BIAS:
            acc += tl.load(bias, mask=rlive, other=0.0).to(tl.float32)
        if GATED:
            if BIAS:
                up += tl.load(bias + R, mask=rlive, other=0.0).to(tl.float32)
            acc = _gated(acc, up, alpha, limit, CLAMPED)
        t = tl.zeros([1], dtype=tl.int64) + t
        dst = t
        if SCATTER:
            dst = tl.load(scatter_ptr + t, mask=t < end, other=0).to(tl.int64)
        tl.store(out_ptr + dst * out_stride + rows, acc.to(out_ptr.dtype.element_ty), mask=rlive & (t < end))

    @triton.jit
    def _q8_mm(xw_ptr, xw_stride, xd_ptr, s_ptr, xd_stride, w_ptr, expert_stride, ends_ptr, active_ptr, out_ptr,
               out_stride, gather_ptr, scatter_ptr, R, ROW_BYTES, UNITS, bias_ptr, bias_stride, alpha, limit,
               FMT: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr,
               GATED: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr, ASM: tl.constexpr,
               ACTIVE: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr):
        """_packed_mm for weights of a format `_q8_unit` reads (FMT; W words a half unit) and x rounded to 8 bits
        (quantize_rows), BT (1, 2 or 4) tokens a step. Where GATHER, launch row t reads x's row gather[t]; where
        SCATTER, it is stored at out's row scatter[t] (`_launch_q8`)."""
        tl.static_assert(BT == 1 or BT == 2 or BT == 4)
        g, start, end = launched_group(active_ptr, ends_ptr, ACTIVE)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rlive = rows < R
        row = (w_ptr + g.to(tl.int64) * expert_stride + rows.to(tl.int64) * ROW_BYTES)[:, None, None]
        bias = bias_ptr + g.to(tl.int64) * bias_stride + rows
        for t0 in range(start, end, BT):
            # x's rows of the step's tokens, looked up once for both projections and every unit (the step's BT)
            src0 = _q8_source(gather_ptr, t0, end, GATHER)
            src1, src2, src3 = src0, src0, src0
            if BT > 1:
                src1 = _q8_source(gather_ptr, t0 + 1, end, GATHER)
            if BT > 2:
                src2 = _q8_source(gather_ptr, t0 + 2, end, GATHER)
                src3 = _q8_source(gather_ptr, t0 + 3, end, GATHER)
            a0, a1, a2, a3 = _q8_rows_dot(xw_ptr, xw_stride, xd_ptr, xd_stride, s_ptr, t0, end, src0, src1, src2,
                                          src3, row, rlive, UNITS, FMT, W, NB, BT, ROWS, ASM)
            u0, u1, u2, u3 = a0, a1, a2, a3  # the up projection's, where GATED
            if GATED:
                u0, u1, u2, u3 = _q8_rows_dot(xw_ptr, xw_stride, xd_ptr, xd_stride, s_ptr, t0, end, src0, src1,
                                              src2, src3, row + R * ROW_BYTES, rlive, UNITS, FMT, W, NB, BT, ROWS,
                                              ASM)
            _q8_out(a0, u0, t0, end, rows, rlive, bias, R, out_ptr, out_stride, scatter_ptr, alpha, limit, GATED,
                    BIAS, CLAMPED, SCATTER)
            if BT > 1:
                _q8_out(a1, u1, t0 + 1, end, rows, rlive, bias, R, out_ptr, out_stride, scatter_ptr, alpha, limit,
                        GATED, BIAS, CLAMPED, SCATTER)
            if BT > 2:
                _q8_out(a2, u2, t0 + 2, end, rows, rlive, bias, R, out_ptr, out_stride, scatter_ptr, alpha, limit,
                        GATED, BIAS, CLAMPED, SCATTER)
                _q8_out(a3, u3, t0 + 3, end, rows, rlive, bias, R, out_ptr, out_stride, scatter_ptr, alpha, limit,
                        GATED, BIAS, CLAMPED, SCATTER)


def supported_formats() -> tuple[str, ...]:
    return tuple(f for f in FORMATS if f in _FMT_ID)
