"""The split decode kernel as the H200 runs it, checked without a GPU: Triton compiles it for sm_90 here (its NVIDIA
backend and cuobjdump come with the wheel), and the machine code must keep its tiles in registers (no stack, which
is local memory: the IEEE float32 version spilled 3,440 bytes a thread and took ~0.5 ms for a 512-key slice) and
multiply 16-bit caches on the tensor cores. The same for MLA's latent kernel at DeepSeek-V3's shape (128 heads,
kv_lora_rank 512, rope dim 64), whose [heads, 512] float32 sums are what could spill.

The compile runs in a child process: the suite runs Triton's interpreter, whose functions do not compile."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POINTERS = ("q_ptr", "k_ptr", "v_ptr", "rows_ptr", "lengths_ptr", "acc_ptr", "top_ptr", "total_ptr")
STRIDES = ("stride_qb", "stride_qt", "stride_qh", "stride_kr", "stride_kl", "stride_kh", "stride_vr", "stride_vl", "stride_vh")
# kv heads, query heads a group, head_dim, window, tokens a row (a decode step; a verify's chain at most rows)
SHAPES = {"mixtral": (8, 4, 128, 0, 1), "gpt-oss": (8, 8, 64, 128, 1), "mixtral-verify": (8, 4, 128, 0, 8),
          "gpt-oss-verify": (8, 8, 64, 128, 8)}
LATENT = "deepseek-v3-latent"
# gpt-oss's sinks take _split_sink_attention, three passes over the keys: each one compiled
SINKS = [f"{shape}+sinks{phase}" for shape in ("gpt-oss", "gpt-oss-verify") for phase in range(3)]


def build(shape: str) -> dict:
    """The kernel compiled for sm_90 as the JIT specialises a real call (pointers and strides divisible by 16: a
    cache's strides are multiples of head_dim): its resource usage, and its tensor-core and FMA instructions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moedesk.kernels import gpu_decode_attention as kernel

    shape, _, phase = shape.partition("+sinks")
    kv_heads, groups, d, window, tokens = SHAPES[shape]
    assert kernel.rows_fit(kv_heads * groups, kv_heads, tokens, d)
    constants = dict(KV_HEADS=kv_heads, GROUPS=groups, TOKENS=tokens, PADDED=max(16, groups * tokens), D=d,
                     SPLIT=kernel.SPLIT, BLOCK=kernel.BLOCK, ROWS=True, WINDOW=window, TENSOR_CORES=True,
                     INTERPRETED=False, **({"PHASE": int(phase)} if phase else {}))
    signature = {**{p: "*bf16" for p in POINTERS[:3]}, "rows_ptr": "*i64", "lengths_ptr": "*i64",
                 **{p: "*fp32" for p in POINTERS[5:]}, **{s: "i32" for s in STRIDES}, "scale": "fp32",
                 **({"sinks_ptr": "*bf16"} if phase else {}), **{name: "constexpr" for name in constants}}
    names = list(signature)
    source = ASTSource(fn=kernel._split_sink_attention if phase else kernel._split_attention, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in POINTERS + STRIDES})
    return inspect(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}))


LATENT_POINTERS = ("q_ptr", "qr_ptr", "c_ptr", "r_ptr", "rows_ptr", "lengths_ptr", "acc_ptr", "top_ptr", "total_ptr")
LATENT_STRIDES = ("stride_qb", "stride_qh", "stride_qrb", "stride_qrh", "stride_cr", "stride_cl", "stride_rr",
                  "stride_rl")


def build_latent() -> dict:
    """MLA's latent kernel compiled for sm_90 at DeepSeek-V3's shape, with the block of heads and warps it runs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moedesk.kernels import gpu_decode_attention as kernel

    groups = kernel.LATENT_HEADS
    constants = dict(BLOCKS=128 // groups, GROUPS=groups, PADDED=max(16, groups), C=512, R=64,
                     SPLIT=kernel.latent_split(32768, 128 // groups), BLOCK=kernel.LATENT_BLOCK, ROWS=True,
                     TENSOR_CORES=True, INTERPRETED=False)
    signature = {**{p: "*bf16" for p in LATENT_POINTERS[:4]}, "rows_ptr": "*i64", "lengths_ptr": "*i64",
                 **{p: "*fp32" for p in LATENT_POINTERS[6:]}, **{s: "i32" for s in LATENT_STRIDES}, "scale": "fp32",
                 **{name: "constexpr" for name in constants}}
    names = list(signature)
    source = ASTSource(fn=kernel._split_latent_attention, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in LATENT_POINTERS + LATENT_STRIDES})
    return inspect(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": kernel.LATENT_WARPS}))


def inspect(binary) -> dict:
    """A compiled kernel's resource usage (cuobjdump), and its tensor-core and FMA instructions."""
    import tempfile

    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary.asm["cubin"])
        cubin.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    used = {k: int(v) for k, v in (f.split(":") for f in line.split() if f.count(":") == 1 and f.split(":")[1].isdigit())}
    ptx = binary.asm["ptx"]
    return {"resources": used, "mma": ptx.count("mma.sync") + ptx.count("wgmma"), "fma": ptx.count("fma.rn.f32")}


def nvidia_backend() -> bool:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))


@pytest.mark.skipif(not nvidia_backend(), reason="needs Triton's NVIDIA backend")
@pytest.mark.parametrize("shape", [*SHAPES, *SINKS, LATENT])
def test_the_kernel_compiles_for_the_h200_without_spilling_on_tensor_cores(shape):
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, shape], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert built["resources"]["STACK"] == 0, f"{shape}: the kernel spills ({built})"
    assert built["mma"] > 0, f"{shape}: no tensor-core instruction in the kernel ({built})"
    assert built["fma"] < 100, f"{shape}: the dots went to FMA ({built})"


if __name__ == "__main__":
    print(json.dumps(build_latent() if sys.argv[1] == LATENT else build(sys.argv[1])))
