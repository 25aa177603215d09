"""Static instruction counts of the integer route's mxfp4 kernel, its codes split by sign or looked up (prmt), on any
machine: the kernel compiled for sm90 (Triton's compiler, ptxas and cuobjdump need no GPU), then its SASS counted,
whole and in the first loop over a row's units (one projection's inner loop). Then the prefill route's mxfp4 dequant:
instructions a weight and the stores' widths, compiled with the integer arguments' divisibility by 16 that the JIT
sees in gpt-oss's launch (it decides whether stores are vectors).

Usage (repo root, TRITON_INTERPRET unset): python tests/perf/count_sass.py

A prediction's basis, not a timing: where the route's arithmetic bounds a launch, fewer instructions in the loop
are a shorter launch; where loads or latency bound it, less follows (docs/measurements.md, "Session 53").
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from moedesk.kernels import gpu_quant  # noqa: E402
from tests.kernels.compile_for_gpu import FUNCTIONS, TARGET  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
Q8 = {"xw_ptr": "*i32", "xw_stride": "i32", "xd_ptr": "*fp32", "s_ptr": "*fp32", "xd_stride": "i32", "w_ptr": "*u8",
      "expert_stride": "i64", "ends_ptr": "*i32", "active_ptr": "*i32", "out_ptr": "*fp32", "out_stride": "i32",
      "gather_ptr": "*i64", "scatter_ptr": "*i64", "R": "i32", "ROW_BYTES": "i32", "UNITS": "i32", "bias_ptr": "*bf16",
      "bias_stride": "i32", "alpha": "fp32", "limit": "fp32"}
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass(fmt: int, bt: int, rows: int, nb: int) -> list[tuple[int, str]]:
    """(address, instruction) of gpt-oss's gate/up launch at a decode step (the pairs' rows gathered)."""
    kernel = triton.compile(ASTSource(fn=gpu_quant._q8_mm, signature=Q8, constexprs=dict(
        FMT=fmt, W=4, ASM=True, ROWS=rows, NB=nb, BT=bt, ACTIVE=True, GATHER=True, SCATTER=False, **FUNCTIONS[1])),
        target=TARGET, options=dict(num_warps=1))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True, check=True).stdout
    return [(int(a, 16), ins) for a, ins in LINE.findall(text)]


def opcode(ins: str) -> str:
    words = ins.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def first_loop(code: list[tuple[int, str]]) -> list[str]:
    """The instructions from the first backward branch's target to that branch."""
    for address, ins in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < address:
            return [i for a, i in code if int(m.group(1), 16) <= a <= address]
    return []


DEQUANT = {"w_ptr": "*u8", "expert_stride": "i64", "ends_ptr": "*i32", "out_ptr": "*bf16", "R": "i32", "K": "i32",
           "ROW_BYTES": "i32", "UNITS": "i32"}
DIVISIBLE = {(i,): [["tt.divisibility", 16]] for i in range(6)}  # pointers, expert stride, R = 5760, K = 2880


def dequant_sass(fn, constexprs: dict, num_warps: int) -> list[str]:
    kernel = triton.compile(ASTSource(fn=fn, signature=DEQUANT, constexprs=constexprs, attrs=DIVISIBLE), target=TARGET,
                            options=dict(num_warps=num_warps))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True, check=True).stdout
    return [ins for _, ins in LINE.findall(text)]


def dequant_counts():
    for rows, nb in ((16, 4), (16, 8), (32, 8)):
        code = dequant_sass(gpu_quant._dequant, dict(SKIP=True, ROWS=rows, NB=nb, FMT=5, L=16), 4)
        weights = rows * nb * 32 // 128
        stores = collections.Counter(opcode(i) + i.split(opcode(i))[1].split()[0] for i in code if "STG" in i)
        print(f"mxfp4 dequant, {rows} x {nb} tile: {len(code)} instructions for {weights} weights a "
              f"thread ({len(code) / weights:.1f} a weight), stores {dict(stores)}", flush=True)


def main():
    dequant_counts()
    for bt, (rows, nb) in ((1, (1, 32)), (2, (2, 16))):
        for fmt, name in ((gpu_quant._FMT_ID["mxfp4"], "split by sign"), (gpu_quant._MXFP4_SIGNED_ID, "looked up")):
            code = sass(fmt, bt, rows, nb)
            loop = collections.Counter(opcode(i) for i in first_loop(code))
            common = ", ".join(f"{op} {n}" for op, n in loop.most_common(6))
            print(f"{bt} token(s) a step, {rows} x {nb} tile, codes {name}: {len(code)} instructions, "
                  f"{sum(loop.values())} in the units' loop ({common})", flush=True)


if __name__ == "__main__":
    main()
