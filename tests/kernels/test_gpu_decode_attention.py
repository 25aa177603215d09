"""The split-key decode attention kernel against a float64 reference, in Triton's CPU interpreter here and on the
GPU box: rows picked by index, lengths that end mid-block, mid-slice and at one key, grouped and plain heads."""
import pytest
import torch

from moedesk.kernels import gpu_decode_attention as kernel

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")


def reference(q, cache_k, cache_v, rows, lengths):
    batch, heads, d = q.shape
    groups = heads // cache_k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        row = b if rows is None else int(rows[b])
        n = int(lengths[b])
        for h in range(heads):
            k = cache_k[row, :n, h // groups].double().cpu()
            v = cache_v[row, :n, h // groups].double().cpu()
            weights = (k @ q[b, h].double().cpu() / d ** 0.5).softmax(0)
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


def test_it_applies_only_to_16_bit_cuda_tensors():
    q = torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    assert not kernel.applies(q, cache)  # on the CPU the model keeps SDPA
    if torch.cuda.is_available():
        assert kernel.applies(q.cuda(), cache.cuda())
        assert not kernel.applies(q.float().cuda(), cache.float().cuda())
