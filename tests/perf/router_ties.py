"""Probe (GPU box, or the CPU): is a bf16 run's distance from float32 a rounding error or a router near-tie?

Usage: python3 tests/perf/router_ties.py [ARCH] [DEVICE] (default minimax_m2 cuda). For each prompt of
tests/model/test_gpu_equivalence.py, along transformers' bf16 greedy tokens (as its bf16 check does): the median
relative error from transformers' float32 logits of our bf16 logits and of transformers' bf16 ones; every router
choice where our bf16 run picks other experts than our float32 run (which equals transformers' float32), with
the float32 margin of that choice in bf16 steps (tests/router_ties.py: the k-th expert's ranked score over the
(k+1)-th, and the kept groups' over the next where routing is group-limited); and our bf16 error once those choices
alone are pinned to the float32 run's. A margin far below a bf16 step that, pinned, brings our error back to
transformers' is a tie either bf16 run may fall on either side of, not arithmetic that rounds worse. A pinned error
still above 1.5x transformers' is the CUDA path's arithmetic: run again under MOEDESK_NO_FUSED_KERNELS=1 to take
the Triton kernels (kernels/gpu_fused.py) out of it.
"""
import sys
import tempfile
from pathlib import Path

import torch

from moedesk.engine.runtime import Engine
from tests import tiny_models
from tests.model.test_gpu_equivalence import PROMPTS
from tests.reference import hf_greedy, hf_model
from tests.router_ties import TIE, flipped, pinned_logits, routed_logits

ARCH = sys.argv[1] if len(sys.argv) > 1 else "minimax_m2"
DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cuda"


def main():
    folder = tiny_models.build(ARCH, Path(tempfile.mkdtemp()) / ARCH)
    ours16 = Engine.load(str(folder), device=DEVICE, dtype="bfloat16")
    ours32 = Engine.load(str(folder), device=DEVICE, dtype="float32")
    ref16, ref32 = hf_model(folder, torch.bfloat16, DEVICE), hf_model(folder, torch.float32, DEVICE)
    eos = ours16.tokenizer.eos_token_ids | set(ours16.config.eos_token_ids)
    print(f"{ARCH} on {DEVICE}; a tie: a float32 margin under {TIE:g} bf16 step")
    for i, text in enumerate(PROMPTS):
        prompt = ours16.tokenizer.encode(text)
        ids = prompt + hf_greedy(ref16, prompt, 24, eos)
        with torch.no_grad():
            exact = ref32(torch.tensor([ids], device=DEVICE)).logits[0].float().cpu()
            theirs = ref16(torch.tensor([ids], device=DEVICE)).logits[0].float().cpu()
        err = lambda a: ((a - exact).norm(dim=-1) / exact.norm(dim=-1)).median().item()
        ours, routes16 = routed_logits(ours16, ids)
        flips = flipped(routes16, routed_logits(ours32, ids)[1])
        print(f"prompt {i} ({len(ids)} tokens): ours {err(ours):.4f}, transformers bf16 {err(theirs):.4f}")
        for layer, tokens in sorted(flips.items()):
            for t, (pick, margin) in sorted(tokens.items()):
                print(f"  layer {layer} token {t}: ours bf16 picks {routes16[layer][0][t].tolist()}, float32 "
                      f"{pick.tolist()} by {margin:.3f} bf16 steps")
        if flips:
            print(f"  ours with those choices pinned to float32's: {err(pinned_logits(ours16, ids, flips)):.4f}")


if __name__ == "__main__":
    main()
