"""The expert kernels' gpt-oss and MXFP4 variants compile for a Hopper GPU, here on the CPU (tests/kernels/
compile_for_gpu.py says why the interpreter is not enough)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")


def test_kernels_compile_for_sm90(tmp_path):
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # compile afresh: a cached cubin would prove nothing
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "tests.kernels.compile_for_gpu"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("compiled 66"), run.stdout
