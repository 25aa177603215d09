"""Probe (GPU box; python3 tests/perf/probe_mla_forms.py [--shape deepseek-v3] [--contexts 512,8192,32768]): one
MLA layer of a real shape, bf16, random weights, timed in its two forms (engine.model.mla): expanded (every cached
latent through kv_b_proj, then attention at head width) and absorbed (W_UK folded into the query, W_UV into the
output, attention against the latents), for forwards of 1, 4 and 512 tokens a row after each context; and which
form `absorb_pays` picks. Shows whether the multiply-add rule picks the faster form on the GPU, and how decode's
attention time grows with the context (issue 41's target: decode at 8k context >= 0.8x decode at 512).

Printed per (tokens, context): ms per layer forward in each form, the form the rule picks, and the latent cache's
bytes against every head's keys and values."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moedesk.engine.load.synthetic import shape_config  # noqa: E402
from moedesk.engine.model.cache.positional import LatentCache  # noqa: E402
from moedesk.engine.model.mla import LatentAttention, absorb_pays  # noqa: E402
from moedesk.engine.model.transformer import ForwardBatch, Rotary  # noqa: E402


def time_forward(attn, x, rope, cache, batch, repeat: int) -> float:
    for _ in range(2):
        attn(x, rope, cache, 0, batch)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        attn(x, rope, cache, 0, batch)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v3")
    ap.add_argument("--contexts", default="512,8192,32768")
    ap.add_argument("--tokens", default="1,4,512")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    cfg = shape_config(args.shape)
    dtype, device = torch.bfloat16, torch.device("cuda")
    contexts, token_counts = [int(c) for c in args.contexts.split(",")], [int(t) for t in args.tokens.split(",")]
    longest = max(contexts) + max(token_counts)
    attn = LatentAttention(cfg).to(device, dtype)
    for p in attn.parameters():
        p.data.normal_(0, 0.02)
    rotary = Rotary(cfg, longest).to(device)
    cache = LatentCache([0], 1, longest, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype, device)
    cache.tensors["latent"][0].normal_()
    cache.tensors["rope"][0].normal_()
    plain = 2 * cfg.num_heads * cfg.head_dim * dtype.itemsize
    print(f"{args.shape}: latent cache {cache.bytes_per_position()} bytes a token and layer, "
          f"every head's keys and values {plain}")
    print(f"{'tokens':>7}{'context':>9}{'expanded ms':>13}{'absorbed ms':>13}  rule")
    for tokens in token_counts:
        for context in contexts:
            positions = torch.arange(context, context + tokens, device=device)[None]
            batch = ForwardBatch(positions, None, None)
            x = torch.randn(1, tokens, cfg.hidden_size, device=device, dtype=dtype)
            rope = rotary(positions, dtype)
            times = {}
            for form in (False, True):
                attn.absorb = form
                times[form] = time_forward(attn, x, rope, cache, batch, args.repeat)
            rule = "absorbed" if absorb_pays(tokens, context + tokens, cfg) else "expanded"
            print(f"{tokens:>7}{context:>9}{times[False]:>13.3f}{times[True]:>13.3f}  {rule}")


if __name__ == "__main__":
    main()
