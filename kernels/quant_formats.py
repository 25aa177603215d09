"""Packed weight formats: GGUF's block quantisations, byte for byte, and their arithmetic in torch.

A packed matrix [R, K] is stored as R rows of K / block weights' blocks each, every block the bytes
GGUF (and llama.cpp) write for it, so experts read from a .gguf file are used as they are, never
through float. Every kernel that computes from packed weights is tested against `dequantize`
here, which is itself tested against the gguf package's numpy implementation
(tests/kernels/test_quant_formats.py).

Layouts (all little-endian; d, dmin are float16):
- q8_0: 32 weights in 34 bytes: d, then 32 int8. w = d * q.
- q4_0: 32 weights in 18 bytes: d, then 16 bytes; byte j holds weight j in its low nibble and weight
  j + 16 in its high one. w = d * (q - 8).
- q4_k: 256 weights in 144 bytes: d, dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of
  nibbles. Sub-block s (32 weights) has w = d * scale_s * q - dmin * min_s; the 64 weights of pair
  j = s // 2 share 32 bytes, low nibbles first.
- q5_k: 256 weights in 176 bytes: as q4_k, with 32 bytes of fifth bits (qh) before the nibbles:
  bit s of qh[l] is the high bit of weight l of sub-block s.
- q6_k: 256 weights in 210 bytes: 128 bytes of low nibbles (ql), 64 of high bit pairs (qh), 16 int8
  scales, then d. w = d * scale_(l // 16) * (q - 32).
- mxfp4 (OCP microscaling, gpt-oss's experts): 32 weights in 17 bytes: an E8M0 exponent e, then 16 bytes; byte j
  holds weight j's FP4 (E2M1) code in its low nibble and weight j + 16's in its high one. w = fp4(q) * 2^(e - 127).
  Hugging Face checkpoints keep the exponents apart and pair nibbles differently (`mxfp4_from_hf`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedFormat:
    name: str
    block: int  # weights per block
    block_bytes: int
    ggml_type: int  # gguf.GGMLQuantizationType value

    def row_bytes(self, k: int) -> int:
        if k % self.block:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block} weights, not {k}")
        return k // self.block * self.block_bytes

    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block


FORMATS = {f.name: f for f in (
    PackedFormat("q4_0", 32, 18, 2),
    PackedFormat("q8_0", 32, 34, 8),
    PackedFormat("q4_k", 256, 144, 12),
    PackedFormat("q5_k", 256, 176, 13),
    PackedFormat("q6_k", 256, 210, 14),
    PackedFormat("mxfp4", 32, 17, 39),
)}
BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}
# What --expert-dtype int8 / int4 quantise a 16-bit checkpoint's experts to: the simple block formats,
# one float16 scale per 32 weights, which `quantize` below writes exactly as gguf's quantiser does.
QUANTIZE_TO = {"int8": "q8_0", "int4": "q4_0"}


# llama.cpp's quantiser, asked for a k-quant whose 256-weight blocks do not tile a tensor's rows (GLM-4.5-Air's
# 1408-wide down projection), falls back for that tensor alone to a format of 32-weight blocks (llama-quant.cpp:
# q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0), and to 16 bits where even those do not fit. The same rule over the
# formats these kernels compute: q4_0 for q4_k (as many bits; q5_0 is not one of them), q8_0 for q5_k and q6_k.
FALLBACK = {"q4_k": "q4_0", "q5_k": "q8_0", "q6_k": "q8_0"}


def format_for_rows(name: str, k: int) -> str | None:
    """The format a tensor of k-weight rows is stored in when `name` is asked for: `name` where its blocks tile the
    rows, else its fallback where that fits, else None (keep the tensor in floats)."""
    for candidate in (name, FALLBACK.get(name)):
        if candidate is not None and k % packed_format(candidate).block == 0:
            return candidate
    return None


def packed_format(name: str) -> PackedFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown packed format {name!r} (known: {', '.join(FORMATS)})") from None


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from [n, 2] bytes, as float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def dequantize(packed: torch.Tensor, fmt: str, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., R, k] weights in `dtype` from packed rows [..., R, row_bytes(k)] (uint8), on packed's device."""
    f = packed_format(fmt)
    if packed.dtype != torch.uint8 or packed.shape[-1] != f.row_bytes(k):
        raise ValueError(f"expected uint8 rows of {f.row_bytes(k)} bytes for {k} {fmt} weights, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    blocks = packed.reshape(-1, f.block_bytes)
    w = _DEQUANT[fmt](blocks)
    return w.reshape(*lead, k).to(dtype)


def _q8_0(b):
    return _f16(b[:, 0:2]) * b[:, 2:].view(torch.int8).float()


def _q4_0(b):
    q = b[:, 2:]
    nibbles = torch.cat([q & 0xF, q >> 4], dim=1).float() - 8
    return _f16(b[:, 0:2]) * nibbles


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of q4_k / q5_k blocks from their 12 bytes [n, 12] -> [n, 8] each."""
    s = s.to(torch.int32)
    lo, hi = s[:, 0:4], s[:, 4:8]
    tail = s[:, 8:12]
    scale = torch.cat([lo & 63, (tail & 0xF) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], dim=1)
    return scale.float(), mins.float()


def _nibble_subblocks(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of q4_k/q5_k nibbles [n, 128] -> [n, 8, 32]: sub-block 2j is the low nibbles of bytes
    32j..32j+31, sub-block 2j + 1 their high nibbles."""
    q = qs.to(torch.int32).view(-1, 4, 32)
    return torch.stack([q & 0xF, q >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scale, mins = _k_scales(b[:, 4:16])
    q = _nibble_subblocks(b[:, 16:144]).float()
    w = (d * scale).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return w.reshape(-1, 256)


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scale, mins = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].to(torch.int32)  # [n, 32]
    bit = torch.arange(8, device=b.device, dtype=torch.int32)
    high = ((qh.unsqueeze(1) >> bit.view(1, 8, 1)) & 1) << 4  # [n, 8, 32]
    q = (_nibble_subblocks(b[:, 48:176]) | high).float()
    w = (d * scale).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return w.reshape(-1, 256)


def _q6_k(b):
    ql = b[:, 0:128].to(torch.int32).view(-1, 2, 64)  # two halves of 128 weights
    qh = b[:, 128:192].to(torch.int32).view(-1, 2, 32)
    scales = b[:, 192:208].view(torch.int8).float().view(-1, 2, 8)
    d = _f16(b[:, 208:210]).view(-1, 1, 1)
    lo = torch.cat([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-1)
    hi = torch.cat([(qh >> 0) & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], dim=-1)
    q = (lo | (hi << 4)).float() - 32  # [n, 2, 128]
    scale = scales.repeat_interleave(16, dim=-1)  # weight l of a half uses scale l // 16
    return (d * scale * q).reshape(-1, 256)


# Twice the E2M1 values, so that the scale 2^(e - 128) is a float32 for every exponent (2^-128 a subnormal one).
_FP4_TWICE = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)


def _mxfp4(b):
    codes = torch.cat([b[:, 1:17] & 0xF, b[:, 1:17] >> 4], dim=1).long()
    values = torch.tensor(_FP4_TWICE, device=b.device)[codes]
    return torch.ldexp(values, b[:, 0:1].to(torch.int32) - 128)


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed mxfp4 rows [..., G * 17] from a Hugging Face checkpoint's `*_blocks` [..., G, 16] and `*_scales`
    [..., G] (uint8): the same codes and exponents, rearranged without loss. There byte i of a block holds weights
    2i (low nibble) and 2i + 1; here byte j holds weights j and j + 16, as GGUF and llama.cpp keep them."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"mxfp4 blocks [..., G, 16] and scales [..., G] of uint8 expected, got {blocks.dtype} "
                         f"{tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32], weights in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2)


_DEQUANT = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "mxfp4": _mxfp4}


def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Packed rows [..., R, row_bytes(K)] of weights [..., R, K]: q8_0 or q4_0 (see QUANTIZE_TO), rounding as
    gguf's quantiser (and llama.cpp's reference one) does, so the bytes equal what it writes."""
    f = packed_format(fmt)
    k = w.shape[-1]
    row_bytes = f.row_bytes(k)
    lead = w.shape[:-1]
    blocks = w.reshape(-1, f.block).float()
    if fmt == "q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        scaled = blocks * inv
        q = (scaled.sign() * torch.floor(scaled.abs() + 0.5)).to(torch.int8).view(torch.uint8)  # C's roundf
        scale = d.to(torch.float16).view(torch.uint8).view(-1, 2)
        packed = torch.cat([scale, q], dim=1)
    elif fmt == "q4_0":
        # The value of largest magnitude, sign kept, maps to -8.
        at = blocks.abs().argmax(dim=1, keepdim=True)
        d = blocks.gather(1, at) / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.clamp(torch.trunc(blocks * inv + 8.5), max=15).to(torch.uint8)
        scale = d.to(torch.float16).view(torch.uint8).view(-1, 2)
        packed = torch.cat([scale, q[:, :16] | (q[:, 16:] << 4)], dim=1)
    else:
        raise ValueError(f"quantising to {fmt} is not supported (only {', '.join(QUANTIZE_TO.values())})")
    return packed.reshape(*lead, row_bytes)
