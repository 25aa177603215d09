"""kernels.gpu_delta_chunks walks a prefill's chunks as engine.model.delta_net's torch loop does: the outputs and the
state after the last chunk, on awkward sizes (heads not powers of two, a part-filled last block of value columns,
strided inputs), and through chunked_delta_rule the state at every chunk boundary equals the token-by-token
recurrence's in float64.

On the CPU the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no
GPU); `fits` is forced so chunked_delta_rule takes it on CPU tensors. On the GPU box, the compiled kernel at Qwen3.5's
sizes.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from moedesk.engine.model import delta_net
from moedesk.engine.model.delta_net import chunked_delta_rule, l2_normalise, recurrent_delta_rule
from moedesk.kernels import gpu_delta_chunks

pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")


@pytest.fixture
def interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")


def walk_inputs(B, H, n, C, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    solved = randn(B, H, n, C, dv + dk)  # split as the layer splits its solve: strided views
    u_fixed, u_per_state = solved.split([dv, dk], dim=-1)
    within = randn(B, H, n, C, C).tril()
    return dict(u_fixed=u_fixed, u_per_state=u_per_state * 0.1, q_decayed=randn(B, H, n, C, dk) * 0.2,
                within=within * 0.2, k_to_end=randn(B, H, n, C, dk) * 0.1, ends=torch.rand(B, H, n, generator=g),
                state=randn(B, H, dk, dv) * 0.3)


@pytest.mark.parametrize("B,H,n,C,dk,dv", [
    (1, 1, 1, 16, 16, 16),  # one program, one chunk
    (2, 3, 3, 64, 24, 40),  # dk padded to 32, dv in two blocks (the second part-filled)
    (1, 2, 2, 64, 128, 128),  # Qwen3.5's head sizes
])
def test_the_kernel_walks_the_chunks_as_the_torch_loop_does(interpreted, B, H, n, C, dk, dv):
    x = walk_inputs(B, H, n, C, dk, dv)
    assert not x["u_fixed"].is_contiguous()
    out, last = gpu_delta_chunks.walk_chunks(**x)
    want_out, want_last = delta_net.walk_chunks(**x)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, want_last, rtol=1e-5, atol=1e-5)
    assert not torch.equal(last, x["state"])  # the walk moved the state


@pytest.mark.parametrize("tokens,chunk", [(70, 64), (131, 64), (40, 16)])
def test_chunked_rule_through_the_kernel_keeps_every_chunk_boundarys_state(interpreted, tokens, chunk, monkeypatch):
    """The kernel in float32 against the token-by-token recurrence in float64: the final state, every output, and
    the state handed back after each chunk boundary (a prompt cut there continues from it)."""
    g = torch.Generator().manual_seed(3)
    B, H, dk, dv = 2, 3, 24, 20
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    x = dict(q=l2_normalise(randn(B, tokens, H, dk)) * dk ** -0.5, k=l2_normalise(randn(B, tokens, H, dk)),
             v=randn(B, tokens, H, dv), g=-F.softplus(randn(B, tokens, H)) * 0.5,
             beta=torch.sigmoid(randn(B, tokens, H)))
    state = randn(B, H, dk, dv) * 0.3
    want_out, want_states = recurrent_delta_rule(**x, state=state)
    called = []
    monkeypatch.setattr(gpu_delta_chunks, "fits", lambda *a: called.append(a) or True)
    single = {k: t.float() for k, t in x.items()}
    close = dict(rtol=1e-4, atol=1e-5)
    for end in range(chunk, tokens + chunk, chunk):
        end = min(end, tokens)
        out, last = chunked_delta_rule(**{k: t[:, :end] for k, t in single.items()}, state=state.float(), chunk=chunk)
        torch.testing.assert_close(last.double(), want_states[:, end - 1], **close)
        torch.testing.assert_close(out.double(), want_out[:, :end], **close)
    assert called  # the kernel did the walks


def test_fits_only_cuda_float32_states():
    assert not gpu_delta_chunks.fits(torch.zeros(1, 1, 16, 16), 64, 16)  # a CPU tensor: the torch loop


@pytest.mark.gpu
def test_on_cuda_the_compiled_kernel_walks_as_the_torch_loop_does(monkeypatch):
    """Qwen3.5's heads (32 value heads, key and value dims 128), 8 chunks of 64, column-major solves as cuBLAS hands
    them back: the walk taken by `fits` itself, against the loop (float32 FMA on both sides, no TF32)."""
    torch.manual_seed(0)
    B, H, T, dk, dv = 2, 32, 512, 128, 128
    q, k = (l2_normalise(torch.randn(B, T, H, dk, device="cuda")) for _ in range(2))
    x = dict(q=q * dk ** -0.5, k=k, v=torch.randn(B, T, H, dv, device="cuda"),
             g=-torch.rand(B, T, H, device="cuda") * 0.05, beta=torch.rand(B, T, H, device="cuda"),
             state=torch.randn(B, H, dk, dv, device="cuda") * 0.3)
    with torch.inference_mode():  # as the engine's forwards run: `fits` takes no walk that autograd would record
        assert gpu_delta_chunks.fits(x["state"], 64, dk)
        out, last = chunked_delta_rule(**x)
        monkeypatch.setattr(gpu_delta_chunks, "fits", lambda *a: False)
        want_out, want_last = chunked_delta_rule(**x)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, want_last, rtol=1e-4, atol=1e-4)
