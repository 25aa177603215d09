"""Compile the expert kernels' variants to a Hopper (sm90) cubin on a machine without a GPU.

Triton's interpreter, which CI runs the kernels under, executes their Python with numpy: code that only the
compiler rejects (a type it cannot lower, a shape it cannot lay out) passes there and fails on the GPU box. Triton's
compiler and ptxas need no GPU. Run as a module with TRITON_INTERPRET unset (tests/kernels/test_gpu_compile.py);
prints one line per kernel family and "compiled N".
"""
from __future__ import annotations

import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moedesk.kernels import gpu_fused, gpu_grouped, gpu_quant, gpu_zero_copy

TARGET = GPUTarget("cuda", 90, 32)
# gpt-oss's expert function as each launch takes it: none; biases and the clamped SwiGLU (gate/up); a bias (down).
FUNCTIONS = [dict(GATED=True, BIAS=False, CLAMPED=False), dict(GATED=True, BIAS=True, CLAMPED=True),
             dict(GATED=False, BIAS=True, CLAMPED=False)]


def build(fn, signature: dict, constexprs: dict, **options) -> None:
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                            options=options)
    if not kernel.asm.get("cubin"):
        raise RuntimeError(f"{fn.__name__}: no cubin")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET unset: the interpreter's kernels cannot be compiled")
    count = 0
    packed = {"x_ptr": "*bf16", "x_stride": "i32", "w_ptr": "*u8", "expert_stride": "i64", "ends_ptr": "*i32",
              "active_ptr": "*i32", "out_ptr": "*fp32", "out_stride": "i32", "R": "i32", "ROW_BYTES": "i32",
              "UNITS": "i32", "SPLIT": "i32",
              "bias_ptr": "*bf16", "bias_stride": "i32", "alpha": "fp32", "limit": "fp32"}
    tiles = [dict(NB=16, ROWS=4, BT=1, DOT=False), dict(NB=16, ROWS=4, BT=4, DOT=False),
             dict(NB=2, ROWS=64, BT=16, DOT=True)]
    for tile in tiles:
        for function in FUNCTIONS:
            build(gpu_quant._packed_mm, packed, dict(FMT=5, L=16, HALF=False, ACTIVE=False, **tile, **function),
                  num_warps=4)
            count += 1
    # A decode step's launch over the groups with rows alone (kernels.gpu_fused.group_pairs's list).
    build(gpu_quant._packed_mm, packed, dict(FMT=5, L=16, HALF=False, ACTIVE=True, **tiles[0], **FUNCTIONS[1]),
          num_warps=4)
    count += 1
    tile = dict(gpu_quant._DEQUANT_TILE)
    build(gpu_quant._dequant, {"w_ptr": "*u8", "expert_stride": "i64", "ends_ptr": "*i32", "out_ptr": "*bf16",
                               "R": "i32", "K": "i32", "ROW_BYTES": "i32", "UNITS": "i32"},
          dict(FMT=5, L=16, SKIP=True, ROWS=tile["ROWS"], NB=tile["NB"]), num_warps=tile["num_warps"])
    count += 1
    for gated in (True, False):  # the prefill route's fused epilogue (MOEDESK_FUSED_EPILOGUE): gpt-oss's gate/up, down
        build(gpu_quant._rows_epilogue, {"h_ptr": "*bf16", "h_stride": "i32", "group_ptr": "*i64", "bias_ptr": "*bf16",
                                         "bias_stride": "i32", "out_ptr": "*bf16", "out_stride": "i32", "M": "i32",
                                         "N": "i32", "alpha": "fp32", "limit": "fp32"},
              dict(GATED=gated, BIAS=True, CLAMPED=gated, ROWS=gpu_quant._EPILOGUE_TILE[0],
                   COLS=gpu_quant._EPILOGUE_TILE[1]))
        count += 1
    print("gpu_quant: mxfp4 tiles and functions", flush=True)
    for x_type in ("*bf16", "*fp32"):
        build(gpu_quant._q8_rows, {"x_ptr": x_type, "x_stride": "i32", "q_ptr": "*i8", "d_ptr": "*fp32",
                                   "s_ptr": "*fp32", "BLOCKS_ALL": "i32"}, dict(BLOCKS=8))
        count += 1
    q8 = {"xw_ptr": "*i32", "xw_stride": "i32", "xd_ptr": "*fp32", "s_ptr": "*fp32", "xd_stride": "i32", "w_ptr": "*u8",
          "expert_stride": "i64", "ends_ptr": "*i32", "active_ptr": "*i32", "out_ptr": "*fp32", "out_stride": "i32",
          "gather_ptr": "*i64", "scatter_ptr": "*i64", "R": "i32",
          "ROW_BYTES": "i32", "UNITS": "i32", "bias_ptr": "*bf16", "bias_stride": "i32", "alpha": "fp32",
          "limit": "fp32"}
    for tile in (dict(ROWS=2, NB=16, BT=1), dict(ROWS=2, NB=16, BT=2), dict(ROWS=2, NB=16, BT=4)):
        for function in FUNCTIONS:
            build(gpu_quant._q8_mm, q8, dict(FMT=2, W=8, ASM=True, ACTIVE=False, GATHER=False, SCATTER=False, **tile,
                                             **function), num_warps=1)
            count += 1
    for fmt in ("q5_k", "q4_0", "q8_0", "q6_k"):  # q5_k's fifth bits; the others' words joined from 16-bit halves
        for bt in (1, 4):
            build(gpu_quant._q8_mm, q8, dict(FMT=gpu_quant._FMT_ID[fmt], W=gpu_quant._Q8_WORDS.get(fmt, 4), ASM=True,
                                             ROWS=2, NB=16, BT=bt, ACTIVE=False, GATHER=False, SCATTER=False,
                                             **FUNCTIONS[0]), num_warps=1)
            count += 1
    for bt in (1, 2):  # mxfp4's codes split by sign (MOEDESK_Q8_MXFP4_LOOKUP=0), beside the default's prmt lookup
        build(gpu_quant._q8_mm, q8, dict(FMT=gpu_quant._FMT_ID["mxfp4"], W=4, ASM=True, ROWS=1, NB=32, BT=bt,
                                         ACTIVE=True, GATHER=True, SCATTER=False, **FUNCTIONS[1]), num_warps=1)
        count += 1
    for (fmt, bt), (rows, nb) in gpu_quant._Q8_TILES.items():  # the tiles chosen per format, as decode launches them
        for gathered in (True, False):  # gate_up reads the tokens' rows, down stores the pairs' rows
            build(gpu_quant._q8_mm, q8, dict(FMT=gpu_quant._q8_format_id(fmt), W=gpu_quant._Q8_WORDS.get(fmt, 4),
                                             ASM=True, ROWS=rows, NB=nb, BT=bt, ACTIVE=True, GATHER=gathered,
                                             SCATTER=not gathered, **FUNCTIONS[0]), num_warps=1)
            count += 1
    print("gpu_quant: the integer route (q4_k, q5_k, q6_k, q4_0, q8_0)", flush=True)
    grouped = {"x_ptr": "*bf16", "x_stride": "i32", "w_ptr": "*bf16", "expert_stride": "i64", "row_stride": "i32",
               "ends_ptr": "*i32", "active_ptr": "*i32", "out_ptr": "*bf16", "out_stride": "i32", "R": "i32",
               "K": "i32", "SPLIT": "i32",
               "bias_ptr": "*bf16", "bias_stride": "i32", "alpha": "fp32", "limit": "fp32"}
    for function in FUNCTIONS:
        build(gpu_grouped._grouped_mm, grouped, dict(FP32="", BT=16, BR=64, BK=64, ACTIVE=False, **function))
        count += 1
    build(gpu_grouped._grouped_mm, grouped, dict(FP32="", BT=16, BR=64, BK=64, ACTIVE=True, **FUNCTIONS[0]))
    count += 1
    print("gpu_grouped: functions", flush=True)
    shapes = dict(H=2880, F=2880, K=4, ROWS=8)
    for bias, clamped in ((False, False), (True, True)):
        build(gpu_zero_copy._gate_up, {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "act_ptr": "*bf16",
                                      "FIRST": "i32", "RANKS": "i32", "ROW0": "i32", "bias_ptr": "*bf16",
                                      "bias_stride": "i32", "alpha": "fp32", "limit": "fp32"},
              dict(BIAS=bias, CLAMPED=clamped, BLOCK_H=2048, **shapes), enable_fp_fusion=False)
        build(gpu_zero_copy._down, {"act_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16",
                                   "FIRST": "i32", "RANKS": "i32", "out_stride": "i32", "COL0": "i32",
                                   "bias_ptr": "*bf16", "bias_stride": "i32"},
              dict(BIAS=bias, BLOCK_F=1024, **shapes), enable_fp_fusion=False)
        count += 2
    pairs = {"x_ptr": "*bf16", "x_stride": "i32", "w_ptr": "*u8", "expert_stride": "i64", "ids_ptr": "*i64",
             "out_ptr": "*fp32", "out_stride": "i32", "FIRST": "i32", "RANKS": "i32", "R": "i32", "ROW0": "i32",
             "ROW_BYTES": "i32", "COL_BYTES": "i32", "UNITS": "i32", "bias_ptr": "*bf16", "bias_stride": "i32",
             "alpha": "fp32", "limit": "fp32"}
    for function in FUNCTIONS:
        build(gpu_zero_copy._packed_pairs, pairs, dict(K=4, FMT=5, L=16, NB=16, ROWS=4, **function), num_warps=2)
        count += 1
    print("gpu_zero_copy: dense and mxfp4 functions", flush=True)
    arrange = {"keys_ptr": "*i64", "order_ptr": "*i64", "rows_ptr": "*i64", "ends_ptr": "*i32",
               "active_ptr": "*i32", "tally_ptr": "*i64", "P": "i32", "G": "i32"}
    for block_p, chunk, tally in ((16, 16, True), (1024, 4, False)):
        build(gpu_fused._group_pairs, arrange, dict(K=2, TALLY=tally, BLOCK_P=block_p, BLOCK_G=256, CHUNK=chunk),
              num_warps=4 if block_p <= 256 else 8)
        count += 1
    # gpt-oss's norm (weight first), Qwen3-Next's (1 + weight) and the others'; gpt-oss's softmax of the top k.
    for weight_first, offset in ((False, False), (True, False), (False, True)):
        build(gpu_fused._rms_norm, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
              dict(D=2880, WEIGHT_FIRST=weight_first, OFFSET=offset, BLOCK=4096), num_warps=4, enable_fp_fusion=False)
        count += 1
    for of_top_k in (False, True):
        build(gpu_fused._route, {"logits_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "E": "i32"},
              dict(K=4, RENORMALISE=not of_top_k, OF_TOP_K=of_top_k, BLOCK=32), num_warps=1, enable_fp_fusion=False)
        count += 1
    print("gpu_fused: the pairs' arrangement, the norms and the routes", flush=True)
    print(f"compiled {count}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
