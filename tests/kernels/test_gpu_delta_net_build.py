"""The fused DeltaNet decode kernels, the prefill's chunk walk and the router as the H200 runs them, checked without
a GPU: Triton compiles them for sm_90 here (tests/kernels/test_gpu_decode_attention_build.py does the same for
attention), which catches what only the compiler rejects, and their machine code keeps everything in registers (no
stack: local memory is what made the every-pair router ~23 us a call for 256 experts).

The compile runs in a child process: the suite runs Triton's interpreter, whose functions do not compile."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.test_gpu_decode_attention_build import inspect, nvidia_backend

ROOT = Path(__file__).resolve().parents[2]


def stack_bytes(name: str, fn, signature: dict, constants: dict, num_warps: int) -> dict:
    """fn compiled for sm_90 with Qwen3.5's sizes: its registers and stack a thread, from cuobjdump."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{k: "constexpr" for k in constants}}
    names = list(signature)
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    binary = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "enable_fp_fusion": False})
    return inspect(binary)["resources"]


def build_all() -> dict:
    from moedesk.kernels import gpu_delta_chunks as dc
    from moedesk.kernels import gpu_delta_net as dn
    from moedesk.kernels import gpu_fused

    built = {}
    for keep, rows in ((False, False), (True, True)):
        built[f"conv keep={keep}"] = stack_bytes("conv", dn._conv_step, {
            "x_ptr": "*bf16", "w_ptr": "*bf16", "conv_ptr": "*bf16", "kept_ptr": "*bf16", "out_ptr": "*bf16",
            "pos_ptr": "*i64", "rows_ptr": "*i64", "C": "i32", "x_b": "i32", "pos_b": "i32", "conv_r": "i32",
            "kept_r": "i32"}, dict(K=4, KB=4, BLOCK=dn._BLOCK_CHANNELS, HAS_ROWS=rows, KEEP=keep), 4)
        built[f"delta keep={keep}"] = stack_bytes("delta", dn._delta_step, {
            "qkv_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "alog_ptr": "*bf16", "bias_ptr": "*bf16",
            "s_ptr": "*fp32", "kept_ptr": "*fp32", "out_ptr": "*fp32", "pos_ptr": "*i64", "rows_ptr": "*i64",
            "C": "i32", "a_b": "i32", "b_b": "i32", "pos_b": "i32", "s_r": "i32", "kept_r": "i32", "scale": "fp32"},
            dict(GROUP=2, DK=128, DV=128, KEYS=2048, BK=128, BV=dn._BLOCK_VALUES, HAS_ROWS=rows, KEEP=keep), 4)
    built["norm"] = stack_bytes("norm", dn._gated_norm, {
        "x_ptr": "*fp32", "z_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32", "z_b": "i32"},
        dict(D=128, BLOCK=128), 4)
    pointers = {f"{name}_ptr": "*fp32" for name in "uf up qd w ke e s out last".split()}
    sizes = ("H n uf_b uf_h up_b up_h qd_b qd_h w_b w_h ke_b ke_h s_b s_h uf_n uf_r uf_c up_n up_r up_c qd_n qd_r qd_c "
             "w_n w_r w_c ke_n ke_r ke_c s_r s_c e_b e_h e_n").split()
    built["prefill walk"] = stack_bytes("walk", dc._walk, {**pointers, **{name: "i32" for name in sizes}},
                                        dict(C=64, DK=128, DV=128, BC=64, BK=128, BKB=dc._BLOCK_KEYS,
                                             BV=dc._BLOCK_VALUES), dc._WARPS)
    built["route 256 top-8"] = stack_bytes("route", gpu_fused._route, {
        "logits_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64", "E": "i32"},
        dict(K=8, RENORMALISE=True, OF_TOP_K=False, BLOCK=256), 1)
    return built


@pytest.mark.skipif(not nvidia_backend(), reason="needs Triton's NVIDIA backend")
def test_the_decode_kernels_compile_for_the_h200_without_spilling():
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(built) == 7
    for name, used in built.items():
        assert used["STACK"] == 0, f"{name} spills: {used}"


if __name__ == "__main__":
    print(json.dumps(build_all()))
