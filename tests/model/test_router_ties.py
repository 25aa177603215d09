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
from tests.router_ties import TIE, flipped, patched_route, pinned_logits, ranked_scores, routed_logits


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
        assert all(m < TIE for m in margins), f"prompt {i}: a choice lost by {max(margins):.3g} bf16 steps"
        pinned = pinned_logits(ours16, ids, flips) if flips else ours
        assert err(pinned) <= 1.5 * err(theirs), f"prompt {i}: ours {err(pinned):.3g} with ties pinned, " \
                                                 f"transformers bf16 {err(theirs):.3g}"


def test_a_lost_choice_is_found_with_its_margin_and_pinned_back(tiny_checkpoint):
    """Our bf16 MiniMax-M2 made to lose two choices of prompt 1: its closest one (a tie) and its clearest one. `flipped`
    finds both, only the first under TIE, and pinning what changed gives the run's own logits back bit for bit."""
    folder = tiny_checkpoint("minimax_m2")
    ours16 = Engine.load(str(folder), device="cpu", dtype="bfloat16")
    ids = ours16.tokenizer.encode(PROMPTS[1])
    ids = ids + hf_greedy(hf_model(folder, torch.bfloat16), ids, 24, {2})
    logits, routes = routed_logits(ours16, ids)
    exact = routed_logits(Engine.load(str(folder), device="cpu", dtype="float32"), ids)[1]
    margin = lambda layer, t: exact[layer][1][t].item()
    spots = [(layer, t) for layer in exact for t in range(len(ids))]
    closest, clearest = min(spots, key=lambda s: margin(*s)), max(spots, key=lambda s: margin(*s))
    assert margin(*closest) < TIE <= margin(*clearest)

    def runner_up(moe, x, original):  # the k-th expert swapped for the (k+1)-th; the weights left as they were
        weights, chosen = original(moe, x)
        for layer, t in (closest, clearest):
            if moe.layer == layer:
                ranked = ranked_scores(moe, x)[0][t].topk(chosen.shape[1] + 1).indices
                chosen = chosen.clone()
                chosen[t] = torch.cat([ranked[:-2], ranked[-1:]]).sort().values
        return weights, chosen

    with patched_route(runner_up):
        lost, lost_routes = routed_logits(ours16, ids)
        back = pinned_logits(ours16, ids, flipped(lost_routes, routes))
    found = flipped(lost_routes, exact)
    assert found[closest[0]][closest[1]][1] < TIE <= found[clearest[0]][clearest[1]][1]
    assert not torch.equal(lost, logits) and torch.equal(back, logits)


def test_routes_of_a_decode_are_a_prefills_where_not_tied(tiny_checkpoint):
    """routed_logits along a decode's calls (the prompt, then a token a call): a row per token, the logits and choices
    a prefill of the same ids gives, up to float32's order of sums (a choice closer than a bf16 step may fall
    either way)."""
    folder = tiny_checkpoint("gpt_oss")
    engine = Engine.load(str(folder), device="cpu", dtype="float32")
    ids = engine.tokenizer.encode(" ".join(PROMPTS))
    whole, routes = routed_logits(engine, ids)
    stepped, stepped_routes = routed_logits(engine, ids, prompt=5)
    assert stepped.shape == whole.shape and torch.allclose(stepped, whole, atol=1e-4, rtol=1e-4)
    assert stepped_routes.keys() == routes.keys()
    for layer, (chosen, steps) in routes.items():
        clear = steps >= TIE
        assert stepped_routes[layer][0].shape == chosen.shape and clear.sum() > len(ids) // 2
        assert torch.equal(stepped_routes[layer][0][clear], chosen[clear])


def test_routers_tied_judges_the_first_choice_that_differs(tiny_checkpoint):
    """check_matches_all_on_gpu's router check (gpt-oss's top-k router): two copies of one engine part nowhere; a copy
    made to lose its closest choice (a tie) is accepted, though the flip moves later choices too; one made to lose its
    clearest choice is not. In float32, whose scores come closer than a bf16 step."""
    from tests.model.test_gpu_equivalence import routers_tied

    folder = tiny_checkpoint("gpt_oss")
    ours, resident = (Engine.load(str(folder), device="cpu", dtype="float32") for _ in range(2))
    ids = ours.tokenizer.encode(" ".join(PROMPTS))  # enough tokens for a choice closer than a step
    assert routers_tied(ours, resident, ids) == (False, "the routers chose the same experts")
    routes = routed_logits(resident, ids)[1]
    margin = lambda layer, t: routes[layer][1][t].item()
    spots = [(layer, t) for layer in routes for t in range(len(ids))]
    closest, clearest = min(spots, key=lambda s: margin(*s)), max(spots, key=lambda s: margin(*s))
    assert margin(*closest) < TIE <= margin(*clearest)
    own = {id(m) for m in ours.model.modules()}
    for (layer, t), accepted in ((closest, True), (clearest, False)):
        def runner_up(moe, x, original):  # in `ours` alone: the k-th expert swapped for the (k+1)-th
            weights, chosen = original(moe, x)
            if id(moe) in own and moe.layer == layer:
                ranked = ranked_scores(moe, x)[0][t].topk(chosen.shape[1] + 1).indices
                chosen = chosen.clone()
                chosen[t] = torch.cat([ranked[:-2], ranked[-1:]]).sort().values
            return weights, chosen

        with patched_route(runner_up):
            tied, why = routers_tied(ours, resident, ids)
        assert tied == accepted and f"(token {t}, layer {layer})" in why, why


def test_as_close_to_exact_accepts_another_rounding_and_refuses_a_worse_one(tiny_checkpoint):
    """check_matches_all_on_gpu's last resort where two bf16 runs part: two copies of one bf16 engine are as close to
    float32 as each other; a copy whose head is off by 3% (a wrong kernel's error, far above bf16's) is not."""
    from tests.model.test_gpu_equivalence import as_close_to_exact

    folder = tiny_checkpoint("gpt_oss")
    exact = Engine.load(str(folder), device="cpu", dtype="float32")
    ours, resident = (Engine.load(str(folder), device="cpu", dtype="bfloat16") for _ in range(2))
    ids = ours.tokenizer.encode(" ".join(PROMPTS[:2]))
    assert as_close_to_exact(ours, resident, exact, ids, len(ids) // 2)[0]
    with torch.no_grad():
        ours.model.lm_head.weight.mul_(1.03)
    close, why = as_close_to_exact(ours, resident, exact, ids, len(ids) // 2)
    assert not close and "offloaded" in why, why
