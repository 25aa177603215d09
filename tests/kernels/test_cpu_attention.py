"""kernels/cpu_attention.py: a CPU decode step's attention on the native pool, against float64 softmax attention."""
import pytest
import torch

from moedesk.kernels import cpu_attention, cpu_experts

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the native attention kernel is not built here")


def reference(q, cache_k, cache_v, rows, lengths):
    b, heads, d = q.shape
    group = heads // cache_k.shape[2]
    out = torch.empty(b, heads, d, dtype=torch.float64)
    for i in range(b):
        row = i if rows is None else int(rows[i])
        k = cache_k[row, :int(lengths[i])].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = cache_v[row, :int(lengths[i])].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) / d ** 0.5
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kv_heads,group,d", [(4, 8, 128), (2, 5, 24), (1, 1, 64), (3, 16, 8), (8, 16, 16)])
def test_decode_attention_matches_float64_on_awkward_sizes(threads, kv_heads, group, d):
    """Rows of very different lengths (one key, a piece's worth and a little more, several pieces), cache rows out of
    order, every split the pool's thread count gives."""
    torch.manual_seed(kv_heads * 100 + group + d)
    before = cpu_experts.get_num_threads()
    cpu_experts.set_num_threads(threads)
    try:
        cache_k, cache_v = torch.randn(2, 5, 1500, kv_heads, d).unbind(0)
        cache_k[1] *= 4  # large scores: the merge's maxima matter
        rows, lengths = torch.tensor([3, 0, 4, 1]), torch.tensor([1, 513, 1500, 77])
        q = torch.randn(4, kv_heads * group, d)
        out = cpu_attention.decode_attention(q, cache_k, cache_v, rows, lengths)
        want = reference(q, cache_k, cache_v, rows, lengths)
        assert out.dtype is torch.float32 and out.shape == q.shape
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        lone = cpu_attention.decode_attention(q[:1], cache_k, cache_v, None, lengths[:1] + 40)  # rows None: row b
        torch.testing.assert_close(lone.double(), reference(q[:1], cache_k, cache_v, None, lengths[:1] + 40),
                                   rtol=1e-5, atol=1e-5)
    finally:
        cpu_experts.set_num_threads(before)


def test_what_it_takes():
    q, cache = torch.randn(1, 8, 64), torch.randn(2, 16, 2, 64)
    assert cpu_attention.applies(q, cache)
    assert not cpu_attention.applies(q.bfloat16(), cache)  # float32 only
    assert not cpu_attention.applies(torch.randn(1, 8, 60), torch.randn(2, 16, 2, 60))  # head_dim not a multiple of 8
    assert not cpu_attention.applies(torch.randn(1, 130, 64), torch.randn(2, 16, 2, 64))  # more than 128 query heads


def test_a_row_or_length_outside_the_cache_is_refused():
    """Read in place by native code: a length past the cache, or a row outside it, must not read out of bounds."""
    q, cache = torch.randn(2, 4, 8), torch.randn(3, 10, 2, 8)
    for rows, lengths in ((None, [4, 11]), (None, [0, 3]), (torch.tensor([0, 3]), [1, 1]), (None, [1])):
        with pytest.raises(ValueError, match="do not fit"):
            cpu_attention.decode_attention(q, cache, cache, rows, torch.tensor(lengths))
