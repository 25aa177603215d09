"""Attention over a 32k-position cache on the GPU: the flash-style (memory-efficient) kernel runs it, it matches a
float32 reference, and what it allocates stays within the workspace the GPU budget sets aside for it
(engine.offload.gpu_budget.prefill_workspace_bytes)."""
import pytest
import torch

from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.model.transformer import ForwardBatch, attention
from moedesk.engine.offload.gpu_budget import prefill_workspace_bytes
from moedesk.kernels import gpu_decode_attention

pytestmark = pytest.mark.gpu

CONTEXT = 32768


def reference(q, k, v, positions):
    """softmax(q·kᵀ/√d) v in float32, one query head at a time, each query seeing keys up to its position."""
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    keys = torch.arange(k.shape[2], device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(heads):
        scores = q[0, h].float() @ k[0, h // groups].float().T / q.shape[-1] ** 0.5
        scores.masked_fill_(keys[None] > positions[0][:, None], float("-inf"))
        out[0, h] = scores.softmax(-1) @ v[0, h // groups].float()
    return out


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("tokens", [1, 2048])  # a decode step, and a prefill piece at the end of the context
def test_attention_at_32k_is_flash_style_and_right(shape, tokens):
    cfg = shape_config(shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, cfg.num_kv_heads, CONTEXT, cfg.head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(k.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, cfg.num_heads, tokens, cfg.head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(CONTEXT - tokens, CONTEXT, device="cuda")[None]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # Only the memory-efficient kernel is enabled inside `attention`: were it unable to run this, SDPA would raise.
    mask = ForwardBatch(positions, None, None, kv_len=CONTEXT).attention_mask(torch.bfloat16)
    out = attention(q, k, v, mask, gqa=True)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - before
    budgeted = prefill_workspace_bytes(cfg, tokens, CONTEXT, 2)
    assert used <= budgeted, f"{shape}, {tokens} tokens at {CONTEXT}: attention took {used} bytes, budget {budgeted}"
    expected = reference(q, k, v, positions)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen3-30b-a3b"])
@torch.no_grad()  # as the engine decodes: the kernel leaves autograd's work to SDPA
def test_decode_at_32k_goes_through_the_split_kernel_and_is_right(shape):
    """The model's decode path at depth (kernels.gpu_decode_attention, reading the cache in place): rows of
    different lengths, one of them the whole 32k context."""
    cfg = shape_config(shape)
    gen = torch.Generator(device="cuda").manual_seed(1)
    cache_k = torch.randn(2, CONTEXT, cfg.num_kv_heads, cfg.head_dim, generator=gen, device="cuda",
                          dtype=torch.bfloat16)
    cache_v = torch.randn(cache_k.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    assert gpu_decode_attention.applies(q, cache_k)
    lengths = torch.tensor([CONTEXT, 5000], device="cuda")
    out = gpu_decode_attention.decode_attention(q, cache_k, cache_v, None, lengths)
    for b in range(2):
        expected = reference(q[b:b + 1, :, None], cache_k[b:b + 1].transpose(1, 2), cache_v[b:b + 1].transpose(1, 2),
                             torch.tensor([[int(lengths[b]) - 1]], device="cuda"))
        torch.testing.assert_close(out[b].float(), expected[0, :, 0], rtol=2e-2, atol=2e-2)
