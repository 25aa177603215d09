"""Sigmoid routers in bf16 (MiniMax-M2, GLM-4.x, DeepSeek-V3): our bf16 run leaves float32's choices only at ties, and
apart from those rounds no worse than transformers' bf16.

Where a bf16 run is further from float32 than transformers' bf16 is (tests/model/test_gpu_equivalence.py's check),
either its arithmetic rounds worse or it fell on the other side of a router near-tie than transformers' did
(tests/router_ties.py). These tell the two apart on the CPU: an expert picked against a clear float32 margin,
or logits further off once the ties are pinned, would be the arithmetic.
"""
import pytest
import torch

from moedesk.engine.runtime import Engine
from tests.model.test_gpu_equivalence import PROMPTS
from tests.reference import hf_greedy, hf_model
from tests.router_ties import TIE, flipped, pinned_logits, routed_logits


@pytest.mark.parametrize("arch", ["minimax_m2", "glm4_moe", "deepseek_v3"])
def test_bf16_leaves_float32_routing_only_at_ties(arch, tiny_checkpoint):
    folder = tiny_checkpoint(arch)
    ours16 = Engine.load(str(folder), device="cpu", dtype="bfloat16")
    ours32 = Engine.load(str(folder), device="cpu", dtype="float32")
    ref16, ref32 = hf_model(folder, torch.bfloat16), hf_model(folder)
    eos = ours16.tokenizer.eos_token_ids | set(ours16.config.eos_token_ids)
    for i, text in enumerate(PROMPTS):
        prompt = ours16.tokenizer.encode(text)
        ids = prompt + hf_greedy(ref16, prompt, 24, eos)
        with torch.no_grad():
            exact = ref32(torch.tensor([ids])).logits[0].float()
            theirs = ref16(torch.tensor([ids])).logits[0].float()
        err = lambda a: ((a - exact).norm(dim=-1) / exact.norm(dim=-1)).median().item()
        ours, routes = routed_logits(ours16, ids)
        flips = flipped(routes, routed_logits(ours32, ids)[1])
        margins = [margin for tokens in flips.values() for _, margin in tokens.values()]
        assert all(m < TIE for m in margins), f"prompt {i}: an expert changed against a float32 margin of {max(margins)}"
        pinned = pinned_logits(ours16, ids, flips) if flips else ours
        assert err(pinned) <= 1.5 * err(theirs), f"prompt {i}: ours {err(pinned):.3g} with ties pinned, " \
                                                 f"transformers bf16 {err(theirs):.3g}"
