"""Probe (GPU box): what the out-of-memory retry's copy of the recurrent states costs a step (engine.generation.runner).

Usage: python3 tests/perf/probe_state_save.py [SHAPE] (default qwen3.5-35b-a3b). The shape's Gated DeltaNet
states on the GPU for 1, 4 and 16 rows (rows 0..B-1 as plain decoding passes them, and explicit rows as beam search
and reused rows do): per step the GPU time and the host time of `RecurrentState.save`, and of one decode step of
the recurrence alone (`delta_step` in every recurrent layer) beside it, so the copy reads as a share of that.
One line per case; the figures go to docs/measurements.md."""
import sys
import time

import torch

from moedesk.engine.load.synthetic import SHAPES
from moedesk.engine.model.cache.recurrent import RecurrentState
from moedesk.engine.model.delta_net import delta_step

SHAPE = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-35b-a3b"
REPEATS = 50
cfg = SHAPES[SHAPE]
device = torch.device("cuda")
linear = [i for i in range(cfg.num_layers) if cfg.is_linear_layer(i)]
conv_dim = 2 * cfg.linear_key_heads * cfg.linear_key_dim + cfg.linear_value_heads * cfg.linear_value_dim


def timed(fn) -> tuple[float, float]:
    """(GPU ms, host ms) per call, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(REPEATS):
        fn()
    end.record()
    host = (time.perf_counter() - host) * 1e3 / REPEATS
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPEATS, host


for rows in (1, 4, 16):
    cache = RecurrentState(linear, rows + 2, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim,
                           conv_dim, cfg.linear_conv_kernel, 1, device, conv_dtype=torch.bfloat16)
    explicit = torch.arange(rows, device=device).flip(0) + 1
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(rows, cfg.linear_key_heads, cfg.linear_key_dim, device=device,
                                                      generator=g), dim=-1) for _ in range(2))
    v = torch.randn(rows, cfg.linear_value_heads, cfg.linear_value_dim, device=device, generator=g)
    decay, beta = torch.full((rows, cfg.linear_value_heads), -0.1, device=device), torch.rand(
        rows, cfg.linear_value_heads, device=device, generator=g)

    def recurrence():
        for i in range(len(linear)):
            delta_step(cache.state[i][:rows], q, k, v, decay, beta)

    mb = rows * cache.bytes_per_row() / (rows + 2) / 2**20
    step_gpu, step_host = timed(recurrence)
    for name, index in (("rows 0..B-1", None), ("explicit rows", explicit)):
        gpu, host = timed(lambda: cache.save(index, rows))
        print(f"{SHAPE} B={rows:2d} {name:13s}: save {gpu:.3f} ms GPU, {host:.3f} ms host for {mb:.0f} MiB; "
              f"the recurrence alone {step_gpu:.3f} ms GPU, {step_host:.3f} ms host")
