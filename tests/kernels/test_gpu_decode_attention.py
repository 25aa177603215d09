"""The split-key decode attention kernel against a float64 reference, in Triton's CPU interpreter here and on the
GPU box: rows picked by index, lengths that end mid-block, mid-slice and at one key, grouped and plain heads, sliding
windows and sinks (gpt-oss's)."""
import pytest
import torch

from moedesk.kernels import gpu_decode_attention as kernel

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")


def reference(q, cache_k, cache_v, rows, lengths, window=0, sinks=None):
    batch, heads, d = q.shape
    groups = heads // cache_k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        row = b if rows is None else int(rows[b])
        n = int(lengths[b])
        first = max(n - window, 0) if window else 0
        for h in range(heads):
            k = cache_k[row, first:n, h // groups].double().cpu()
            v = cache_v[row, first:n, h // groups].double().cpu()
            scores = k @ q[b, h].double().cpu() / d ** 0.5
            if sinks is not None:  # a logit that joins the softmax and weighs no value
                scores = torch.cat([scores, sinks[h].double().cpu()[None]])
            weights = scores.softmax(0)[:n - first]
            out[b, h] = weights @ v
    return out


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (12, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_attention_matches_the_reference(heads, kv_heads, dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(heads + kv_heads)
    d, length = 32, kernel.SPLIT * 2 + 100  # three slices, the last one short
    cache_k = torch.randn(5, length, kv_heads, d, generator=gen).to(device, dtype)
    cache_v = torch.randn(5, length, kv_heads, d, generator=gen).to(device, dtype)
    q = torch.randn(3, heads, d, generator=gen).to(device, dtype)
    for rows, lengths in ((torch.tensor([4, 0, 2]), torch.tensor([1, 700, length])),
                          (None, torch.tensor([kernel.SPLIT, 65, kernel.SPLIT + 1]))):
        rows_d = None if rows is None else rows.to(device)
        out = kernel.decode_attention(q, cache_k, cache_v, rows_d, lengths.to(device))
        assert out.shape == q.shape and out.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double().cpu(), reference(q, cache_k, cache_v, rows, lengths),
                                   rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window", [0, 100, kernel.SPLIT + 30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_and_sinks_match_the_reference(window, dtype):
    """A window that starts mid-slice or slices before the row's end, and rows shorter than it; sinks as large as
    the scores (a weight to take) and far above them (the weights of the keys nearly vanish)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(window)
    heads, kv_heads, d, length = 8, 2, 32, kernel.SPLIT * 2 + 100
    cache_k = torch.randn(3, length, kv_heads, d, generator=gen).to(device, dtype)
    cache_v = torch.randn(3, length, kv_heads, d, generator=gen).to(device, dtype)
    q = torch.randn(3, heads, d, generator=gen).to(device, dtype)
    lengths = torch.tensor([length, 90, kernel.SPLIT + 7])
    for sinks in (None, torch.randn(heads, generator=gen), torch.full((heads,), 40.0)):
        sinks_d = None if sinks is None else sinks.to(device, dtype)
        out = kernel.decode_attention(q, cache_k, cache_v, None, lengths.to(device), window, sinks_d)
        expected = reference(q, cache_k, cache_v, None, lengths, window, None if sinks is None else sinks_d.cpu())
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double().cpu(), expected, rtol=tolerance, atol=tolerance)
    if window:  # the window is what changed the result, not something else
        windowed = kernel.decode_attention(q, cache_k, cache_v, None, lengths.to(device), window)
        whole = kernel.decode_attention(q, cache_k, cache_v, None, lengths.to(device))
        assert (whole[0] - windowed[0]).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_combine_split_over_columns_writes_every_column(monkeypatch, dtype):
    """Each combine program merges COMBINE_COLUMNS of head_dim: with fewer columns a program than head_dim (as
    MLA's 512 are on the GPU), every program's columns land in their place: sinks and a window, and a verify's chain."""
    monkeypatch.setattr(kernel, "COMBINE_COLUMNS", 8)  # head_dim 32: four programs a head
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, d, length = 8, 2, 32, kernel.SPLIT + 100
    cache_k = torch.randn(2, length, kv_heads, d, generator=gen).to(device, dtype)
    cache_v = torch.randn(2, length, kv_heads, d, generator=gen).to(device, dtype)
    q = torch.randn(2, heads, d, generator=gen).to(device, dtype)
    lengths, sinks = torch.tensor([length, 90]), torch.randn(heads, generator=gen).to(device, dtype)
    out = kernel.decode_attention(q, cache_k, cache_v, None, lengths.to(device), 300, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), reference(q, cache_k, cache_v, None, lengths, 300, sinks.cpu()),
                               rtol=tolerance, atol=tolerance)
    # A verify's chain of 3 tokens a row, rows picked by index: each token's columns land in its own place too.
    chain = torch.randn(2, 3, heads, d, generator=gen).to(device, dtype)
    ends, rows = torch.tensor([[kernel.SPLIT - 1], [40]]) + torch.arange(1, 4)[None], torch.tensor([1, 0])
    out = kernel.decode_attention(chain, cache_k, cache_v, rows.to(device), ends.to(device))
    for t in range(3):
        torch.testing.assert_close(out[:, t].double().cpu(), reference(chain[:, t], cache_k, cache_v, rows, ends[:, t]),
                                   rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("tokens, window, sinks", [(2, 0, False), (5, 0, True), (4, 130, True), (8, 0, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_tokens_a_row_see_each_their_own_positions(tokens, window, sinks, dtype):
    """A speculative verify's chain: token t of a row sees up to its own position, so its rows in a program stop
    at different keys (one of them at a slice's edge), with windows and sinks as one token would."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d, length = 8, 2, 32, kernel.SPLIT * 2 + 100
    cache_k = torch.randn(4, length, kv_heads, d, generator=gen).to(device, dtype)
    cache_v = torch.randn(4, length, kv_heads, d, generator=gen).to(device, dtype)
    q = torch.randn(2, tokens, heads, d, generator=gen).to(device, dtype)
    ends = torch.tensor([kernel.SPLIT - 2, 40])  # row 0's chain crosses into the second slice
    lengths = ends[:, None] + torch.arange(1, tokens + 1)[None]
    rows = torch.tensor([3, 1])
    sink = torch.randn(heads, generator=gen).to(device, dtype) if sinks else None
    out = kernel.decode_attention(q, cache_k, cache_v, rows.to(device), lengths.to(device), window, sink)
    assert out.shape == q.shape
    for t in range(tokens):
        expected = reference(q[:, t], cache_k, cache_v, rows, lengths[:, t], window,
                             None if sink is None else sink.cpu())
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[:, t].double().cpu(), expected, rtol=tolerance, atol=tolerance)


def test_it_applies_only_to_16_bit_cuda_tensors():
    q = torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    assert not kernel.applies(q, cache)  # on the CPU the model keeps SDPA
    if torch.cuda.is_available():
        assert kernel.applies(q.cuda(), cache.cuda())
        assert not kernel.applies(q.float().cuda(), cache.float().cuda())
