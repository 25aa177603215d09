"""Profiler measurements that need the GPU box."""
import math

import pytest
import torch

from engine.profiler import contention


@pytest.mark.gpu
def test_contention_measures_both_sides_while_they_overlap():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    factors = contention(torch.device("cuda"), megabytes=128)
    assert set(factors) == {"cpu_slowdown_during_copy", "copy_slowdown_during_cpu"}
    # Reading host memory on both sides can only slow each down, within reason (noise allowed below 1).
    assert all(math.isfinite(v) and 0.7 < v < 6 for v in factors.values()), factors
