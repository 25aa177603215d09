"""The packed formats' arithmetic (kernels.quant_formats) against the gguf package's own numpy code, and
ExpertWeights' bookkeeping."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from moedesk.kernels.expert_weights import ExpertWeights
from moedesk.kernels.quant_formats import FORMATS, dequantize, quantize

# Where each format keeps its float16 scales (byte offsets in a block): random bytes there would make
# infinities and NaNs, which no quantiser writes.
_SCALE_OFFSETS = {"q4_0": (0,), "q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
                  "mxfp4": ()}  # an E8M0 exponent: every byte is one


def random_blocks(fmt: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // f.block, f.block_bytes), dtype=np.uint8)
    for at in _SCALE_OFFSETS[fmt]:
        scales = rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, at:at + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_equals_gguf(fmt):
    raw = random_blocks(fmt, rows=5, k=512)
    expected = gguf_dequantize(raw, GGMLQuantizationType(FORMATS[fmt].ggml_type))
    ours = dequantize(torch.from_numpy(raw), fmt, 512)
    assert ours.dtype == torch.float32 and ours.shape == (5, 512)
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_mxfp4_equals_gguf_at_every_exponent():
    """Each of the 256 E8M0 exponents (2^-127, a subnormal, to 2^128) with every FP4 code, bit for bit."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(256, 4, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    raw[:, 0, 1:9] = np.arange(16, dtype=np.uint8).reshape(8, 2) @ np.array([1, 16], dtype=np.uint8)  # all codes
    raw = raw.reshape(256, -1)
    expected = gguf_dequantize(raw, GGMLQuantizationType.MXFP4)
    ours = dequantize(torch.from_numpy(raw), "mxfp4", 128).numpy()
    np.testing.assert_array_equal(ours.view(np.uint32) & 0x7FFFFFFF, expected.view(np.uint32) & 0x7FFFFFFF)
    np.testing.assert_array_equal(ours, expected)  # and the signs, zeros aside (-0.0 == 0.0)


def test_mxfp4_from_a_hugging_face_checkpoint_equals_transformers_dequantisation():
    """gpt-oss's *_blocks / *_scales rearranged into packed rows dequantise to what transformers makes of them
    (bfloat16, as it loads them; every value is exact there too)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moedesk.kernels.quant_formats import mxfp4_from_hf

    rng = np.random.default_rng(4)
    E, rows, groups = 3, 10, 4  # [E, rows, K = 128]
    blocks = torch.from_numpy(rng.integers(0, 256, size=(E, rows, groups, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(100, 140, size=(E, rows, groups), dtype=np.uint8))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # back to [E, rows, K]
    packed = mxfp4_from_hf(blocks, scales)
    assert packed.shape == (E, rows, FORMATS["mxfp4"].row_bytes(128))
    assert torch.equal(dequantize(packed, "mxfp4", 128), theirs)
    bf16 = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2)
    assert torch.equal(dequantize(packed, "mxfp4", 128, torch.bfloat16), bf16)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantize_writes_the_bytes_gguf_writes(fmt):
    w = np.random.default_rng(1).standard_normal((7, 96)).astype(np.float32)
    w[0, :32] = 0  # an all-zero block: scale 0, no division by it
    w[1, 5] = 40.0  # an outlier owns its block's scale
    expected = gguf_quantize(w, GGMLQuantizationType(FORMATS[fmt].ggml_type))
    ours = quantize(torch.from_numpy(w), fmt)
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_quantize_refuses_k_quants_and_ragged_rows():
    with pytest.raises(ValueError, match="not supported"):
        quantize(torch.zeros(2, 256), "q4_k")
    with pytest.raises(ValueError, match="whole blocks"):
        quantize(torch.zeros(2, 40), "q8_0")


def test_expert_weights_sizes_views_and_dense():
    H, F, E = 64, 32, 3
    w = ExpertWeights.empty(E, H, F, dtype=torch.float32, gate_up_format="q8_0", down_format="q4_0")
    assert w.gate_up.shape == (E, 2 * F, 2 * 34) and w.down.shape == (E, H, 18)
    assert w.expert_bytes == 2 * F * 68 + H * 18 and w.nbytes == E * w.expert_bytes
    dense_gu = torch.randn(E, 2 * F, H)
    dense_d = torch.randn(E, H, F)
    w.gate_up.copy_(quantize(dense_gu, "q8_0"))
    w.down.copy_(quantize(dense_d, "q4_0"))
    one = w.expert(2)
    assert one.num_experts == 1 and one.gate_up.data_ptr() == w.gate_up[2].data_ptr()
    gu, d = w.dense()
    assert gu.shape == (E, 2 * F, H) and d.shape == (E, H, F)
    # int8 with a per-32 scale keeps ~2 decimal digits; 4 bits much less.
    assert (gu - dense_gu).abs().max() < 0.02 * dense_gu.abs().max()
    assert (d - dense_d).abs().max() < 0.2 * dense_d.abs().max()
    assert w.describe() == "q8_0/q4_0"
    picked = w.select([2, 0])
    assert torch.equal(picked.gate_up[0], w.gate_up[2])


def test_copy_experts_moves_a_span_with_its_biases_and_nothing_else():
    H, F = 64, 32
    src = ExpertWeights.empty(5, H, F, dtype=torch.float32, gate_up_format="q8_0", down_format="q4_0")
    src.gate_up.copy_(torch.randint(0, 256, src.gate_up.shape, dtype=torch.uint8))
    src.down.copy_(torch.randint(0, 256, src.down.shape, dtype=torch.uint8))
    src = src.with_function(torch.randn(5, 2 * F), torch.randn(5, H))
    dst = ExpertWeights.empty(4, H, F, dtype=torch.float32, gate_up_format="q8_0", down_format="q4_0")
    dst.gate_up.zero_(), dst.down.zero_()
    dst = dst.with_function(torch.zeros(4, 2 * F), torch.zeros(4, H))
    dst.copy_experts_(1, src, 2, 2)  # experts 2 and 3 into slots 1 and 2
    for name in ("gate_up", "down", "gate_up_bias", "down_bias"):
        got, expected = getattr(dst, name), getattr(src, name)
        assert torch.equal(got[1:3], expected[2:4]), name
        assert not got[0].any() and not got[3].any(), name


def test_expert_weights_checks_shapes_and_dtypes():
    with pytest.raises(ValueError, match="do not fit"):
        ExpertWeights(torch.zeros(2, 8, 4), torch.zeros(2, 4, 5), hidden=4, width=4)
    with pytest.raises(ValueError, match="cannot be"):
        ExpertWeights(torch.zeros(2, 8, 34, dtype=torch.float32), torch.zeros(2, 32, 4), hidden=32, width=4,
                      gate_up_format="q8_0")


def test_a_k_quant_that_does_not_tile_a_row_falls_back_as_llama_cpps_quantiser_does():
    """llama-quant.cpp: q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0 where 256-weight blocks do not tile the rows, 16
    bits where 32-weight ones do not either. Over these kernels' formats: q4_0 (q4_k's bits), q8_0, floats."""
    from moedesk.kernels.quant_formats import format_for_rows

    assert format_for_rows("q4_k", 4096) == "q4_k" and format_for_rows("q4_k", 1408) == "q4_0"  # GLM-4.5-Air
    assert format_for_rows("q5_k", 1408) == "q8_0" and format_for_rows("q6_k", 1408) == "q8_0"
    assert format_for_rows("q4_0", 1408) == "q4_0" and format_for_rows("mxfp4", 2880) == "mxfp4"
    assert format_for_rows("q4_k", 100) is None and format_for_rows("q8_0", 48) is None
    for fmt in ("q4_k", "q5_k", "q6_k"):  # a fallback keeps at least the bits asked for
        assert FORMATS[format_for_rows(fmt, 1408)].bits_per_weight() >= FORMATS[fmt].bits_per_weight() - 1e-9
