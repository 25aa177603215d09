"""A Gated DeltaNet layer's prefill alone on the GPU, eager as a prefill runs it: the chunks walked by
kernels.gpu_delta_chunks against the torch loop it replaces (issue 41: a 512-token Qwen3.5 prefill spent ~4.2 ms a
DeltaNet layer, about seventy of its ~150 launches in that loop).

Usage (GPU box): python tests/perf/probe_gdn_prefill.py [--shape qwen3.5-35b-a3b] [--tokens 512] [--batch 1]
Prints, for each: the layer's wall ms a call (host and GPU, synchronised: what the prefill pays), the GPU ms of
chunked_delta_rule alone (CUDA events), and how far the kernel's outputs and final state are from the loop's.
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.model import delta_net
from moedesk.engine.model.cache.recurrent import RecurrentState
from moedesk.engine.model.delta_net import GatedDeltaNet
from moedesk.kernels import gpu_delta_chunks
from tests.cuda_timing import median_ms


def wall_ms(fn, repeat: int = 20) -> float:
    """The median wall time of a synchronised call, in ms, after a warm-up (Triton's compile)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3.5-35b-a3b")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    cfg = shape_config(args.shape)
    dtype, B, T = torch.bfloat16, args.batch, args.tokens
    torch.manual_seed(0)
    net = GatedDeltaNet(cfg, 0).to("cuda", dtype).eval()
    with torch.no_grad():  # the checkpoint's kind of decays (the constructor's zeros forget nothing)
        net.A_log.uniform_(-2, 1)
        net.conv.normal_(0, 0.3)
        for p in (net.in_qkv, net.in_z, net.in_b, net.in_a, net.out):
            p.weight.normal_(0, cfg.hidden_size ** -0.5)
    net.fuse_projections()
    cache = RecurrentState([0], B, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim, net.conv_dim,
                           cfg.linear_conv_kernel, 1, "cuda", conv_dtype=dtype)
    x = torch.randn(B, T, cfg.hidden_size, device="cuda", dtype=dtype)
    batch = SimpleNamespace(rows=None, positions=torch.arange(T, device="cuda").expand(B, T), parents=None,
                            keep_states=False, lengths=None, real_mask=lambda length: None)
    H, dk, dv = cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    q, k = (delta_net.l2_normalise(torch.randn(B, T, H, dk, device="cuda")) for _ in range(2))
    rule = dict(q=q * dk ** -0.5, k=k, v=torch.randn(B, T, H, dv, device="cuda"),
                g=-torch.rand(B, T, H, device="cuda") * 0.1, beta=torch.rand(B, T, H, device="cuda"),
                state=torch.randn(B, H, dk, dv, device="cuda") * 0.1)
    fits = gpu_delta_chunks.fits
    layer = lambda: net(x, None, {0: cache}, 0, batch)  # noqa: E731
    results = {}
    with torch.no_grad():
        for name, use in (("kernel", True), ("torch loop", False)):
            gpu_delta_chunks.fits = (lambda *a: fits(*a)) if use else (lambda *a: False)
            results[name] = (wall_ms(layer), median_ms(lambda: delta_net.chunked_delta_rule(**rule)),
                             delta_net.chunked_delta_rule(**rule))
        gpu_delta_chunks.fits = fits
    (out, last), (want_out, want_last) = results["kernel"][2], results["torch loop"][2]
    for name, (wall, rule_ms, _) in results.items():
        print(f"{args.shape} {T} tokens x {B}: {name}: layer {wall:.2f} ms wall, chunked_delta_rule {rule_ms:.3f} "
              f"GPU ms")
    print(f"kernel against the loop: outputs {(out - want_out).abs().max().item():.2e}, final state "
          f"{(last - want_last).abs().max().item():.2e} max abs (state max {want_last.abs().max().item():.2f})")


if __name__ == "__main__":
    main()
