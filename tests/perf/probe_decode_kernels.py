"""The split decode kernels against a copy of the cache they read (GPU box; python3 tests/perf/probe_decode_kernels.py).

One layer's cache of 32k positions on the real shapes: Mixtral-8x7B's keys and values through `decode_attention`
(the whole row, a row of 512 in the same reserved cache, a 128-position window), gpt-oss-120b's the same with its
sinks (three passes) and without, and DeepSeek-V3's latents and rotary keys through `latent_decode_attention` (the
whole row, a row of 512), each against cloning what it reads (a copy reads and writes each byte, so a kernel at
twice the copy's time reads at a quarter of its rate). Issue 42's
context targets rest on these reads; session 35 took the timed asserts that stood here as tests out of the suite
(the brief: speed is measured by benchmarks, not timed tests). GPU time per call, median of CUDA-event timings.
Then a sweep of the constants that set each kernel's grid at 32k, for the next choice: SPLIT (keys a program), the
latent kernel's target count of programs (latent_split) and COMBINE_COLUMNS (columns a combine program merges).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moedesk.engine.load.synthetic import shape_config  # noqa: E402
from moedesk.kernels import gpu_decode_attention as kernel  # noqa: E402
from tests.cuda_timing import median_ms  # noqa: E402

CONTEXT = 32768
bf16 = dict(device="cuda", dtype=torch.bfloat16)
whole, short = torch.tensor([CONTEXT], device="cuda"), torch.tensor([512], device="cuda")
rows = []

cfg = shape_config("mixtral-8x7b")
k = torch.randn(1, CONTEXT, cfg.num_kv_heads, cfg.head_dim, **bf16)
v = torch.randn_like(k)
q = torch.randn(1, cfg.num_heads, cfg.head_dim, **bf16)
copy = median_ms(lambda: (k.clone(), v.clone()))
rows += [("mixtral-8x7b keys+values", copy, median_ms(lambda: kernel.decode_attention(q, k, v, None, whole)),
          median_ms(lambda: kernel.decode_attention(q, k, v, None, short)),
          median_ms(lambda: kernel.decode_attention(q, k, v, None, whole, 128)))]
del k, v

# gpt-oss's sink layers take three passes over the keys (max, sum, p·v) to round as its eager reference does: their
# price against the one-pass kernel on the same cache, without sinks.
cfg = shape_config("gpt-oss-120b")
k = torch.randn(1, CONTEXT, cfg.num_kv_heads, cfg.head_dim, **bf16)
v = torch.randn_like(k)
q = torch.randn(1, cfg.num_heads, cfg.head_dim, **bf16)
sinks = torch.randn(cfg.num_heads, **bf16)
copy = median_ms(lambda: (k.clone(), v.clone()))
for name, s in (("gpt-oss-120b, sinks", sinks), ("gpt-oss-120b, no sinks", None)):
    rows += [(name, copy, median_ms(lambda: kernel.decode_attention(q, k, v, None, whole, 0, s)),
              median_ms(lambda: kernel.decode_attention(q, k, v, None, short, 0, s)),
              median_ms(lambda: kernel.decode_attention(q, k, v, None, whole, 128, s)))]
del k, v

cfg = shape_config("deepseek-v3")
latent = torch.randn(1, CONTEXT, cfg.kv_lora_rank, **bf16)
rope = torch.randn(1, CONTEXT, cfg.qk_rope_head_dim, **bf16)
q_latent = torch.randn(1, cfg.num_heads, cfg.kv_lora_rank, **bf16) / 8
q_rope = torch.randn(1, cfg.num_heads, cfg.qk_rope_head_dim, **bf16)
scale = cfg.attention_scale or cfg.head_dim ** -0.5
copy = median_ms(lambda: (latent.clone(), rope.clone()))
run = lambda n: kernel.latent_decode_attention(q_latent, q_rope, latent, rope, None, n, scale)  # noqa: E731
rows += [("deepseek-v3 latents", copy, median_ms(lambda: run(whole)), median_ms(lambda: run(short)), None)]


def sweep(name, setting, values, call):
    """GPU ms of call() at each value of the module constant (or function) `setting`, restored after."""
    saved = getattr(kernel, setting)
    try:
        out = []
        for value in values:
            setattr(kernel, setting, value)
            out.append(f"{value if not callable(value) else value.target}: {median_ms(call):.3f}")
        print(f"{name:40} " + "  ".join(out))
    finally:
        setattr(kernel, setting, saved)


def latent_split_at(target):
    real = kernel.latent_split
    fn = lambda length, programs: real(length, programs, target)  # noqa: E731
    fn.target = target
    return fn


print("\nsweeps at 32k, GPU ms a call")
cfg = shape_config("mixtral-8x7b")
k = torch.randn(1, CONTEXT, cfg.num_kv_heads, cfg.head_dim, **bf16)
v = torch.randn_like(k)
q = torch.randn(1, cfg.num_heads, cfg.head_dim, **bf16)
sweep("split kernel, SPLIT", "SPLIT", (128, 256, 512, 1024), lambda: kernel.decode_attention(q, k, v, None, whole))
sweep("split kernel, COMBINE_COLUMNS", "COMBINE_COLUMNS", (32, 64, 128),
      lambda: kernel.decode_attention(q, k, v, None, whole))
del k, v
sweep("latent kernel, programs (latent_split)", "latent_split", [latent_split_at(t) for t in (64, 128, 256, 512, 1024)],
      lambda: run(whole))
sweep("latent kernel, COMBINE_COLUMNS", "COMBINE_COLUMNS", (32, 64, 128, 512), lambda: run(whole))

print(f"\none layer's cache of {CONTEXT} positions, GPU ms a call")
print(f"{'cache':26}{'copy':>8}{'32k row':>9}{'x copy':>8}{'512 row':>9}{'window 128':>11}")
for name, copy, full, shallow, window in rows:
    print(f"{name:26}{copy:8.3f}{full:9.3f}{full / copy:8.2f}{shallow:9.3f}"
          f"{'' if window is None else f'{window:11.3f}'}")
