"""MLA's absorbed decode through the split-key kernel (kernels.gpu_decode_attention.latent_decode_attention) against a
float64 reference, in Triton's CPU interpreter here and on the GPU box: one latent "head" shared by every query head,
keys the latent and the rotary key side by side, values the latent; rows picked by index, lengths that end mid-block,
mid-slice and at one position, one block of query heads and several."""
import pytest
import torch

from moedesk.kernels import gpu_decode_attention as kernel

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")


def reference(q_latent, q_rope, latent, rope, rows, lengths, scale):
    out = torch.empty(q_latent.shape, dtype=torch.float64)
    for b in range(q_latent.shape[0]):
        row = b if rows is None else int(rows[b])
        n = int(lengths[b])
        c, r = latent[row, :n].double().cpu(), rope[row, :n].double().cpu()
        scores = (q_latent[b].double().cpu() @ c.T + q_rope[b].double().cpu() @ r.T) * scale  # [H, n]
        out[b] = scores.softmax(-1) @ c
    return out


@pytest.mark.parametrize("heads", [4, 64])  # fewer heads than a block; two blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [kernel.COMBINE_COLUMNS, 16])  # 16: the combine's rank split over 4 programs
def test_latent_decode_attention_matches_the_reference(heads, dtype, columns, monkeypatch):
    monkeypatch.setattr(kernel, "COMBINE_COLUMNS", columns)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(heads)
    rank, rope_dim, length = 64, 16, kernel.SPLIT * 2 + 100  # three slices, the last one short
    latent = torch.randn(4, length, rank, generator=gen).to(device, dtype)
    rope = torch.randn(4, length, rope_dim, generator=gen).to(device, dtype)
    q_latent = (torch.randn(3, heads, rank, generator=gen) / 4).to(device, dtype)
    q_rope = torch.randn(3, heads, rope_dim, generator=gen).to(device, dtype)
    scale = 0.13
    for rows, lengths in ((torch.tensor([3, 0, 2]), torch.tensor([1, 700, length])),
                          (None, torch.tensor([kernel.SPLIT, 33, kernel.SPLIT + 1]))):
        rows_d = None if rows is None else rows.to(device)
        out = kernel.latent_decode_attention(q_latent, q_rope, latent, rope, rows_d, lengths.to(device), scale)
        assert out.shape == q_latent.shape and out.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double().cpu(), reference(q_latent, q_rope, latent, rope, rows, lengths, scale),
                                   rtol=tolerance, atol=tolerance)


def test_latent_slices_keep_the_grid_near_its_target_and_never_under_split():
    assert kernel.latent_split(600, 4) == kernel.SPLIT
    # DeepSeek-V3 at batch 1: 128 heads in 4 blocks; 32k reserved -> 1024 a slice, 128 programs.
    assert kernel.latent_split(32768, 4) == 1024
    assert kernel.latent_split(8192, 4) == kernel.SPLIT
    for length, per in ((32768, 4), (40000, 4), (131072, 16), (9000, 1)):
        split = kernel.latent_split(length, per)
        assert split & (split - 1) == 0 and split % kernel.LATENT_BLOCK == 0
        assert -(-length // split) * per <= 128 or split == kernel.SPLIT
