"""Attention with sinks (engine.model.sinks): the sink's share applied after attention over the keys alone, from the
rows' log-sum-exp, against the plain softmax over keys and sink; the mask boolean or additive; on the GPU, torch's
memory-efficient attention so composed against the plain arithmetic, with grouped heads, a sliding window, rows of a
padded batch and a row that sees no key; and the forward's masks, windowed, made once."""
import pytest
import torch

from moedesk.engine.model.sinks import sink_attention, window_mask, with_sinks
from moedesk.engine.model.transformer import ForwardBatch, additive_mask as additive


def inputs(device, dtype, batch=2, heads=8, kv_heads=2, tokens=37, length=45, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, n, d, generator=gen).to(device, dtype)
               for h, n in ((heads, tokens), (kv_heads, length), (kv_heads, length)))
    positions = torch.arange(length - tokens, length).expand(batch, tokens).to(device)
    keys = torch.arange(length, device=device)
    mask = (keys.view(1, 1, 1, -1) <= positions.view(batch, 1, tokens, 1))
    mask[1, :, :, :5] = False  # the second row's first keys are padding
    mask[1, :, 3] = False  # and one of its queries sees nothing
    sinks = (torch.randn(heads, generator=gen) * 2).to(device, dtype)  # as large as the scores and beyond
    return q, k, v, mask, positions, sinks


def test_the_sinks_share_from_the_log_sum_exp_is_the_softmax_over_keys_and_sink():
    q, k, v, mask, positions, sinks = inputs("cpu", torch.float64)
    for m in (mask, window_mask(mask, positions, 8)):
        kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        scores = (q @ kr.transpose(-1, -2) / 8.0).masked_fill(~m, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = scores.softmax(dim=-1) @ vr  # NaN in the row that sees no key
        torch.testing.assert_close(with_sinks(out, lse, sinks), sink_attention(q, k, v, m, sinks))
        assert with_sinks(out, lse, sinks)[1, :, 3].abs().max() == 0
        assert torch.equal(sink_attention(q, k, v, additive(m, torch.float64), sinks), sink_attention(q, k, v, m, sinks))


def test_the_forwards_windowed_masks_are_made_once():
    positions = torch.arange(10, 16).view(2, 3)
    batch = ForwardBatch(positions, None, None, kv_len=16)
    windowed = batch.attention_mask(torch.float32, 4)
    assert torch.equal(windowed, window_mask(batch.mask, positions, 4)) and windowed.sum() == 6 * 4
    assert batch.attention_mask(torch.float32, 4) is windowed and batch.attention_mask(torch.float32) is batch.mask


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_efficient_attention_with_sinks_on_cuda(window, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q, k, v, mask, positions, sinks = inputs("cuda", dtype, seed=window)
    if window:
        mask = window_mask(mask, positions, window)
    got = sink_attention(q, k, v, additive(mask, dtype), sinks)  # 16-bit CUDA tensors, additive mask: the kernel
    assert got.dtype == dtype
    expected = sink_attention(*(t.float() for t in (q, k, v)), mask, sinks.float())  # float32: the plain path
    live = mask.any(-1, keepdim=True).expand_as(got)  # every query of row 0, all but one of row 1
    torch.testing.assert_close(got.float()[live], expected[live], atol=2e-2, rtol=2e-2)
    assert got[1, :, 3].abs().max() == 0
