"""Decode and a speculative verify fold the query heads that share a key/value head into its rows (engine.model.
transformer.attention): the result is grouped-query attention's, token by token with each token's own mask row, and
on CUDA no copy of the keys and values is made for it (a copy of the whole cache a layer at depth)."""
import pytest
import torch
import torch.nn.functional as F

from moedesk.engine.model.transformer import FOLD_TOKENS, ForwardBatch, attention, fold_mask


def reference(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask)


@pytest.mark.parametrize("tokens", [1, 2, 5, FOLD_TOKENS, FOLD_TOKENS + 1])
def test_folded_heads_give_grouped_query_attention(tokens):
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(2, 12, tokens, 16, generator=gen)
    k, v = (torch.randn(2, 4, 40, 16, generator=gen) for _ in range(2))
    positions = torch.stack([torch.arange(30, 30 + tokens), torch.arange(3, 3 + tokens)])
    mask = ForwardBatch(positions, None, None, kv_len=40).mask
    torch.testing.assert_close(attention(q, k, v, mask, True), reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_a_folded_mask_repeats_each_tokens_row_per_head():
    mask = torch.rand(2, 1, 3, 21) > 0.5
    folded = fold_mask(mask, 4)
    assert folded.shape == (2, 1, 12, 21)
    for g in range(4):
        assert torch.equal(folded[:, :, g * 3:(g + 1) * 3], mask)
    one = mask[:, :, :1]
    assert fold_mask(one, 4) is one  # a decode step's row holds for every head as it is


@pytest.mark.gpu
@torch.no_grad()
def test_on_cuda_a_verify_step_copies_no_keys_and_matches(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 5, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 4000, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    batch = ForwardBatch(torch.arange(3995, 4000, device="cuda")[None], None, None, kv_len=4000)
    mask = batch.attention_mask(torch.bfloat16)
    expected = reference(q.float(), k.float(), v.float(), batch.mask)
    assert fold_mask(mask, 4).stride(-2) % 16 == 0
    repeats = []
    real = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **kw: repeats.append(1) or real(*a, **kw))
    out = attention(q, k, v, mask, True)
    assert not repeats
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
