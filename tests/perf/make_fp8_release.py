"""Turn a 16-bit Hugging Face checkpoint folder into a block-FP8 release of it, laid out as DeepSeek-V3, Kimi-K2 and
the Qwen3 "-FP8" releases are: every linear weight but the router's, the embeddings' and lm_head's as float8_e4m3fn,
with a float32 `weight_scale_inv` per 128x128 block ([ceil(rows/128), ceil(cols/128)]), and the config's
quantization_config. For timing and sizing FP8 loads on the GPU box (engine/load/fp8_blocks.py); the values are the
source's, rounded.

Usage (repo root): python3 tests/perf/make_fp8_release.py SRC_DIR OUT_DIR
One source shard is in memory at a time; each becomes one shard of the release.

On the GPU box (a Mixtral-8x7B shape, 8 layers: 23.7 GB of bfloat16, 11.9 GB of FP8), the load's speed and peak
against the 16-bit source's, experts in RAM (auto takes FP8 experts as Q8_0):
    python3 tests/perf/make_mixtral_checkpoint.py /tmp/fp8/mix16 --layers 8
    python3 tests/perf/make_fp8_release.py /tmp/fp8/mix16 /tmp/fp8/mix8
    python3 tests/perf/load_bench.py /tmp/fp8/mix8 --device cuda --json $OUT/fp8_load_cuda.json
    python3 tests/perf/load_bench.py /tmp/fp8/mix8 --device cpu --json $OUT/fp8_load_cpu.json
    python3 tests/perf/load_bench.py /tmp/fp8/mix16 --device cuda --json $OUT/bf16_load_cuda.json
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK = 128
E4M3_MAX = 448.0


def quantised(name: str, t: torch.Tensor) -> bool:
    """What the releases quantise: linear weights, not norms, embeddings, lm_head or the router."""
    return (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed" not in name
            and not name.startswith("lm_head") and not name.endswith((".gate.weight", ".router.weight")))


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weights, float32 scales): each 128x128 block's largest magnitude at 448."""
    rows, cols = w.shape
    padded = torch.zeros(math.ceil(rows / BLOCK) * BLOCK, math.ceil(cols / BLOCK) * BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, -1, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(padded.shape)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def rewrite_release(src: Path, out: Path, convert, quantization) -> None:
    """A release of the checkpoint folder `src` in `out`: each source shard read one at a time, every tensor turned
    by convert(name, tensor) into the release's {name: tensor}, written as one shard of the release; the other files
    copied, and the config given quantization() (called once every tensor was seen) as its quantization_config."""
    out.mkdir(parents=True, exist_ok=True)
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(extra, out / extra.name)
    weight_map, started = {}, time.perf_counter()
    for shard in sorted(src.glob("*.safetensors")):
        written = {}
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                written.update(convert(name, f.get_tensor(name)))
        save_file(written, str(out / shard.name), metadata={"format": "pt"})
        weight_map.update({name: shard.name for name in written})
        print(f"{shard.name}: {sum(t.numel() * t.element_size() for t in written.values()) / 1e9:.2f} GB, "
              f"{time.perf_counter() - started:.0f} s", flush=True)
        del written
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if not quantised(name, t):
        return {name: t}
    q, scale = to_fp8(t.float())
    return {name: q, name + "_scale_inv": scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    rewrite_release(args.src, args.out, convert, lambda: {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]})


if __name__ == "__main__":
    main()
