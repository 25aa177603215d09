"""A Gated DeltaNet layer's decode step and the router alone on the GPU, each captured in a CUDA graph (no launch
overhead, as the graphed decoder runs them): the fused path (kernels.gpu_delta_net, kernels.gpu_fused.route)
against the torch path it replaces. Issue 41: a graphed Qwen3.5 step paid ~40 small kernels a DeltaNet layer and
~23 us a routing call.

Usage (GPU box): python tests/perf/probe_gdn_decode.py [--shape qwen3.5-35b-a3b] [--batch 1]
Prints us per call of each, and what the difference comes to for the shape's first 12 layers.
"""
from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import torch

from moedesk.engine.load.synthetic import shape_config
from moedesk.engine.model.cache.recurrent import RecurrentState
from moedesk.engine.model.delta_net import GatedDeltaNet
from moedesk.engine.model.transformer import top_k_route
from moedesk.kernels import gpu_delta_net


def graphed_us(fn, replays: int = 200) -> float:
    """Microseconds a replay of fn's graph takes, best of three rounds."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compiles Triton's kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / replays)
    return 1e6 * best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3.5-35b-a3b")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    cfg = shape_config(args.shape)
    dtype, B = torch.bfloat16, args.batch
    net = GatedDeltaNet(cfg, 0).to("cuda", dtype).eval()
    net.fuse_projections()
    cache = RecurrentState([0], B, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim, net.conv_dim,
                           cfg.linear_conv_kernel, 1, "cuda", conv_dtype=dtype)
    x = torch.randn(B, 1, cfg.hidden_size, device="cuda", dtype=dtype)
    batch = SimpleNamespace(rows=None, positions=torch.full((B, 1), 5, device="cuda"), parents=None,
                            keep_states=False)
    fits = gpu_delta_net.fits
    step = lambda: net(x, None, {0: cache}, 0, batch)  # noqa: E731
    with torch.no_grad():
        fused = graphed_us(step)
        gpu_delta_net.fits = lambda *a: False
        plain = graphed_us(step)
        gpu_delta_net.fits = fits
        logits = torch.randn(B, cfg.num_experts, device="cuda", dtype=dtype)
        route = lambda: top_k_route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, dtype)  # noqa: E731
        routed = graphed_us(route)
        os.environ["MOEDESK_NO_FUSED_KERNELS"] = "1"
        torch_routed = graphed_us(route)
        del os.environ["MOEDESK_NO_FUSED_KERNELS"]
    layers = cfg.linear_layers[:12]
    linear, moe = sum(layers), sum(cfg.moe_layers[:12])
    print(f"{args.shape} batch {B}: DeltaNet decode layer fused {fused:.1f} us, torch {plain:.1f} us; "
          f"routing ({cfg.num_experts} experts, top-{cfg.num_experts_per_tok}) fused {routed:.1f} us, "
          f"torch {torch_routed:.1f} us")
    saved = linear * (plain - fused) / 1000
    print(f"first 12 layers ({linear} DeltaNet, {moe} routed): fused DeltaNet saves {saved:.2f} ms a step "
          f"over torch's; routing costs {moe * routed / 1000:.2f} ms a step")


if __name__ == "__main__":
    main()
