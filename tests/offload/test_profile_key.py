"""engine.offload.profiler.profile_key: a cached start-up profile is reused only with the CPU kernels it was timed
with (an update that changes a kernel, or MOEDESK_QUANT_PATH picking another path, measures again)."""
import pytest
import torch

from moedesk.engine.offload import profiler
from moedesk.kernels import cpu_experts, cpu_quant


def key(dtype: str) -> str:
    return profiler.profile_key("model fingerprint", (4, 8), dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", ["q4_k/q6_k", "q8_0"])
def test_another_build_or_path_of_the_packed_kernel_is_profiled_again(monkeypatch, dtype):
    before = key(dtype)
    assert key(dtype) == before
    monkeypatch.setattr(cpu_quant, "build_id", lambda: "cpu_quant-another-build")
    rebuilt = key(dtype)
    assert rebuilt != before
    monkeypatch.setattr(cpu_quant, "describe", lambda: "native packed kernel (another path), 1 threads")
    assert key(dtype) not in (before, rebuilt)


def test_another_build_of_the_bf16_kernel_is_profiled_again(monkeypatch):
    before = key("bfloat16")
    monkeypatch.setattr(cpu_experts, "build_id", lambda: "cpu_experts-another-build")
    assert key("bfloat16") != before


def test_dense_experts_leave_the_packed_kernel_alone(monkeypatch):
    """Asking the packed kernel builds it (a compile on first use): dense models never pay for that."""
    def asked():
        raise AssertionError("the packed kernel was asked about dense experts")
    monkeypatch.setattr(cpu_quant, "describe", asked)
    monkeypatch.setattr(cpu_quant, "build_id", asked)
    assert key("bfloat16") != key("float32")
