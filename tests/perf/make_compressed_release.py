"""Turn a 16-bit Hugging Face checkpoint folder into a compressed-tensors release of it, laid out as the releases made
with llm-compressor are (engine/load/compressed_tensors.py reads them), for timing and sizing their loads on the GPU
box; the values are the source's, rounded.

--scheme int4 (Kimi-K2-Thinking's): the routed experts' weights as 4-bit integers packed 8 to an int32
(`weight_packed`), a bf16 `weight_scale` per 32 weights of a row and `weight_shape`; everything else as it was,
named in `ignore`. --scheme fp8 (GLM-4.5-FP8's): every linear weight but the routers' and lm_head's as float8_e4m3fn
with a float32 scale per output channel, activations rounded per token at run time (dynamic).

Usage (repo root): python3 tests/perf/make_compressed_release.py SRC_DIR OUT_DIR [--scheme int4|fp8]
One source shard is in memory at a time; each becomes one shard of the release.

On the GPU box (a Mixtral-8x7B shape, 8 layers), the load's speed and peak against the block-FP8 and 16-bit ones of
tests/perf/make_fp8_release.py's usage (auto keeps INT4 experts as Q4_0, takes FP8 ones as Q8_0), and the tiny
releases against transformers on CUDA:
    python3 tests/perf/make_mixtral_checkpoint.py /tmp/ct/mix16 --layers 8
    python3 tests/perf/make_compressed_release.py /tmp/ct/mix16 /tmp/ct/int4 --scheme int4
    python3 tests/perf/make_compressed_release.py /tmp/ct/mix16 /tmp/ct/fp8 --scheme fp8
    python3 tests/perf/load_bench.py /tmp/ct/int4 --device cuda --json $OUT/ct_int4_load_cuda.json
    python3 tests/perf/load_bench.py /tmp/ct/int4 --device cpu --json $OUT/ct_int4_load_cpu.json
    python3 tests/perf/load_bench.py /tmp/ct/fp8 --device cuda --json $OUT/ct_fp8_load_cuda.json
    python3 -m pytest -q -m gpu tests/load/test_compressed_tensors.py
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from make_fp8_release import quantised as linear_weight, rewrite_release  # noqa: E402

E4M3_MAX = 448.0
GROUP = 32
# the routed experts of every family's Hub names (Mixtral's w1/w2/w3, the others' *_proj)
ROUTED = re.compile(r".*\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def int4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight_packed, weight_scale and weight_shape of w [rows, cols] (cols a multiple of 32): each group's largest
    magnitude at 7, value i of a row plus 8 in bits 4 (i % 8) of word i // 8."""
    rows, cols = w.shape
    groups = w.float().view(rows, cols // GROUP, GROUP)
    scale = (groups.abs().amax(-1, keepdim=True) / 7).clamp_min(1e-12).bfloat16()
    q = torch.round(groups / scale.float()).clamp(-8, 7).view(rows, cols) + 8
    u = q.to(torch.uint8).numpy().astype(np.uint32).reshape(rows, cols // 8, 8)
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for i in range(8):
        words |= u[..., i] << np.uint32(4 * i)
    return {"weight_packed": torch.from_numpy(words.view(np.int32)), "weight_scale": scale.view(rows, -1),
            "weight_shape": torch.tensor([rows, cols], dtype=torch.int32)}


def fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight (float8_e4m3fn) and weight_scale [rows, 1]: each row's largest magnitude at 448."""
    scale = (w.float().abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
    return {"weight": (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), "weight_scale": scale}


def quantised(scheme: str, name: str, t: torch.Tensor) -> bool:
    if scheme == "int4":
        return ROUTED.fullmatch(name) is not None and t.shape[1] % GROUP == 0
    return linear_weight(name, t)


def quantization_config(scheme: str, routers: list[str]) -> dict:
    if scheme == "int4":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
        fmt, ignore, inputs = "pack-quantized", KIMI_IGNORE, None
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
        fmt, ignore = "float-quantized", ["lm_head", *routers]
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--scheme", choices=("int4", "fp8"), default="int4")
    args = parser.parse_args()
    routers = []

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.endswith((".gate.weight", ".router.weight")):
            routers.append(name.removesuffix(".weight"))
        if not quantised(args.scheme, name, t):
            return {name: t}
        module = name.removesuffix(".weight")
        return {f"{module}.{k}": v for k, v in (int4 if args.scheme == "int4" else fp8)(t).items()}

    rewrite_release(args.src, args.out, convert, lambda: quantization_config(args.scheme, sorted(routers)))


if __name__ == "__main__":
    main()
