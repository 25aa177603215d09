"""Attention alone at depth on the GPU: what our paths cost per layer (decode: the split-key kernel,
kernels.gpu_decode_attention, which the model takes for one token; both: engine.model.transformer.attention, the
memory-efficient kernel with an additive mask, which prefill takes) against SDPA's flash kernel with no mask (decode)
or a lower-right causal bias (a prefill piece), which cannot take our masks but shows what is left on the table.
Every layer of a step pays this once.

Usage (GPU box): python tests/perf/probe_long_attention.py [--shape mixtral-8x7b] [--depths 512,8192,16384,32768]
Prints ms per layer and, times the shape's layer count, per token (decode) or per piece.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.model.transformer import ForwardBatch, attention
from moedesk.kernels import gpu_decode_attention


def timed(fn, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--depths", default="512,8192,16384,32768")
    parser.add_argument("--piece", type=int, default=512)
    args = parser.parse_args()
    cfg = shape_config(args.shape)
    dev, dt = "cuda", torch.bfloat16
    print(f"{args.shape}: {cfg.num_heads} heads, {cfg.num_kv_heads} kv heads of {cfg.head_dim}, {cfg.num_layers} layers")
    print(f"{'depth':>6}{'tokens':>7}{'split ms':>9}{'sdpa ms':>9}{'flash ms':>10}{'ours/flash':>11}"
          f"{'ours x layers':>15}")
    for depth in (int(d) for d in args.depths.split(",")):
        for tokens in (1, args.piece):
            length = depth + tokens
            k = torch.randn(1, cfg.num_kv_heads, length, cfg.head_dim, device=dev, dtype=dt)
            v = torch.randn_like(k)
            q = torch.randn(1, cfg.num_heads, tokens, cfg.head_dim, device=dev, dtype=dt)
            positions = torch.arange(depth, length, device=dev)[None]
            mask = ForwardBatch(positions, None, None, kv_len=length).attention_mask(dt)
            sdpa = timed(lambda: attention(q, k, v, mask, gqa=True))
            split = float("nan")
            if tokens == 1:
                # [1, length, kv_heads, D] laid out as the cache is (a key's heads side by side), not a view
                cache_k, cache_v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
                lengths = torch.tensor([length], device=dev)
                split = timed(lambda: gpu_decode_attention.decode_attention(q[:, :, 0], cache_k, cache_v, None,
                                                                            lengths))
            ours = split if tokens == 1 else sdpa
            bias = None if tokens == 1 else causal_lower_right(tokens, length)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                try:
                    flash = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))
                except RuntimeError as error:  # no flash kernel for this case on this build
                    print(f"flash: {error}".splitlines()[0])
                    flash = float("nan")
            print(f"{depth:>6}{tokens:>7}{split:>9.3f}{sdpa:>9.3f}{flash:>10.3f}{ours / flash:>11.2f}"
                  f"{ours * cfg.num_layers:>15.2f}")


if __name__ == "__main__":
    main()
