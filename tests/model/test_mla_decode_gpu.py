"""MLA's decode at depth on the GPU (issue 41: decode at 8k >= 0.8x decode at 512): one DeepSeek-V3-shaped layer
(128 heads, kv_lora_rank 512, rope dim 64), bf16, a 32k latent cache reserved as CUDA graphs reserve it. The step
goes through the split-key kernel and equals the eager absorbed form (its speed: tests/perf/probe_decode_kernels.py)."""
import pytest
import torch

from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.model import mla
from moedesk.engine.model.cache.positional import LatentCache
from moedesk.engine.model.transformer import ForwardBatch, Rotary
from moedesk.kernels import gpu_decode_attention

pytestmark = pytest.mark.gpu

CONTEXT = 32768


def _layer():
    cfg = shape_config("deepseek-v3")
    torch.manual_seed(0)
    attn = mla.LatentAttention(cfg).to("cuda", torch.bfloat16)
    for p in attn.parameters():
        p.data.normal_(0, 0.02)
    attn.absorb = True
    cache = LatentCache([0], 2, CONTEXT, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.bfloat16, "cuda")
    cache.tensors["latent"][0].normal_()
    cache.tensors["rope"][0].normal_()
    return cfg, attn, cache, Rotary(cfg, CONTEXT).to("cuda")


@torch.no_grad()
def test_deepseek_v3_decode_at_32k_goes_through_the_kernel_and_equals_the_eager_form(monkeypatch):
    cfg, attn, cache, rotary = _layer()
    rows, positions = torch.tensor([1, 0], device="cuda"), torch.tensor([[CONTEXT - 1], [5000]], device="cuda")
    x = torch.randn(2, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    rope = rotary(positions, torch.bfloat16)
    calls = []
    original = gpu_decode_attention.latent_decode_attention
    monkeypatch.setattr(gpu_decode_attention, "latent_decode_attention", lambda *a: calls.append(1) or original(*a))
    fast = attn(x, rope, cache, 0, ForwardBatch(positions, rows, None, kv_len=CONTEXT))
    assert calls == [1], "the decode step did not take the split kernel"
    monkeypatch.setenv("MOEDESK_NO_SPLIT_DECODE", "1")
    eager = attn(x, rope, cache, 0, ForwardBatch(positions, rows, None, kv_len=CONTEXT))
    assert calls == [1]
    torch.testing.assert_close(fast.float(), eager.float(), rtol=3e-2, atol=3e-2)
