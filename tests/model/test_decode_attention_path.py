"""The model's decode step through the split-key attention kernel (kernels.gpu_decode_attention, which the model
takes for 16-bit CUDA tensors): run here in Triton's interpreter on the CPU, its logits are the SDPA path's (and,
with gpt-oss's sinks and sliding windows, the sink path's), for rows picked out of order and of different lengths,
one token a row and a verify's chain of three."""
import dataclasses

import pytest
import torch

from moedesk.engine.load.synthetic import SHAPES, shape_config, synthetic_model
from moedesk.engine.offload.expert_executor import LocalExecutor
from moedesk.kernels import gpu_decode_attention


def tiny_gpt_oss():
    """gpt-oss at a CPU size: sinks in every layer, a window of 8 in every other one (prompts run past it)."""
    real = SHAPES["gpt-oss-120b"]
    return dataclasses.replace(real, vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                               head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                               intermediate_size=64, moe_layers=real.moe_layers[:2],
                               sliding_layers=real.sliding_layers[:2], sliding_window=8)


def decoder(model, cfg, dtype, gen):
    """A function that prefills two rows (picked out of order, of different lengths), then decodes one token a row
    and a verify's chain of three: the logits of the last two forwards."""
    executor = LocalExecutor()
    prompts = {2: torch.randint(3, cfg.vocab_size, (1, 40), generator=gen),
               0: torch.randint(3, cfg.vocab_size, (1, 9), generator=gen)}
    step = torch.randint(3, cfg.vocab_size, (2, 1), generator=gen)
    chain = torch.randint(3, cfg.vocab_size, (2, 3), generator=gen)  # a verify forward's three tokens a row

    def decode():
        cache = model.new_cache(3, 128, dtype, "cpu")
        for row, tokens in prompts.items():
            model(tokens, torch.arange(tokens.shape[1])[None], cache, executor, rows=torch.tensor([row]))
        one = model(step, torch.tensor([[40], [9]]), cache, executor, rows=torch.tensor([2, 0]))
        three = model(chain, torch.tensor([[41, 42, 43], [10, 11, 12]]), cache, executor, rows=torch.tensor([2, 0]))
        return torch.cat([one, three], dim=1)

    return decode


def through_the_kernel(monkeypatch, decode) -> tuple[torch.Tensor, int]:
    """decode()'s logits with the kernel taking every attention layer's decode and verify, and its calls."""
    calls = []
    real = gpu_decode_attention.decode_attention
    monkeypatch.setattr(gpu_decode_attention, "applies", lambda q, cache_k: True)  # takes asks it too
    monkeypatch.setattr(gpu_decode_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    return decode(), len(calls)


def sinks_that_weigh(model, cfg, gen, dtype):
    """Zero sinks would hide a sink left out of the softmax."""
    assert any(b.attn.window for b in model.layers) and not all(b.attn.window for b in model.layers)
    for block in model.layers:
        block.attn.sinks.data = (torch.randn(cfg.num_heads, generator=gen) * 2).to(dtype)


@pytest.mark.parametrize("shape", ["tiny-moe", "gpt-oss", "tiny-qwen35"])
def test_decode_through_the_kernel_gives_the_sdpa_logits(monkeypatch, shape):
    """tiny-qwen35: gated attention layers whose KV cache sits inside a LayerCaches beside the recurrent state (the
    kernel was passed over there until it looked for the layer's own kind)."""
    cfg = tiny_gpt_oss() if shape == "gpt-oss" else shape_config(shape, 2 if shape == "tiny-moe" else None)
    model, _ = synthetic_model(cfg, torch.float32, "cpu", pinned=False, context=128)
    gen = torch.Generator().manual_seed(0)
    if cfg.attention_sinks:
        sinks_that_weigh(model, cfg, gen, torch.float32)
    decode = decoder(model, cfg, torch.float32, gen)
    expected = decode()
    got, calls = through_the_kernel(monkeypatch, decode)
    attention_layers = sum(not cfg.is_linear_layer(i) for i in range(cfg.num_layers))
    assert attention_layers and calls == 2 * attention_layers  # every attention layer's decode and verify
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_gpt_oss_bf16_decode_through_the_kernel_gives_the_sink_paths_logits_bit_for_bit(monkeypatch):
    """In bf16 the sink path (engine.model.sinks, transformers' eager arithmetic) rounds scores and weights to 16
    bits; the kernel rounds them where it does (tests/kernels/test_gpu_decode_attention.py), so a decode's logits
    are the same bits: rows this short are one slice and 16-term dots, no float32 sum whose order could show.
    With float32 scores and weights the kernel parted from them in 3 of 4 logits (session 36)."""
    cfg = tiny_gpt_oss()
    model, _ = synthetic_model(cfg, torch.bfloat16, "cpu", pinned=False, context=128)
    gen = torch.Generator().manual_seed(0)
    sinks_that_weigh(model, cfg, gen, torch.bfloat16)
    decode = decoder(model, cfg, torch.bfloat16, gen)
    expected = decode()
    got, calls = through_the_kernel(monkeypatch, decode)
    assert calls == 2 * cfg.num_layers
    assert torch.equal(got, expected), f"{(got != expected).float().mean():.0%} of the logits differ"
