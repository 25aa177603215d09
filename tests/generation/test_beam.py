"""Beam search returns what transformers' `generate(num_beams=W, do_sample=False)` returns.

The tiny random models rarely pick their real end-of-sequence token, so the cases where hypotheses
end early take tokens the search itself produces as EOS ids, on both sides: then length penalty
and early_stopping change the answer, and every combination must still agree.
"""
import dataclasses
import json

import pytest
import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.generation.beam import BeamSearch
from moedesk.engine.runtime import Engine
from tests.reference import hf_model

ARCHS = ["mixtral", "qwen3_moe", "llama"]
PROMPT = "The quick brown fox jumps over the lazy"
NEW = 8


def hf_beam(model, prompt_ids, beams, max_new_tokens, eos, length_penalty=1.0, early_stopping=False):
    """transformers' best hypothesis, cut before its EOS (moedesk's token_ids leave it out)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=model.device), max_new_tokens=max_new_tokens,
                             num_beams=beams, do_sample=False, length_penalty=length_penalty,
                             early_stopping=early_stopping, eos_token_id=sorted(eos), pad_token_id=0)
    new = out[0, len(prompt_ids):].tolist()
    end = next((i for i, t in enumerate(new) if t in eos), len(new))
    return new[:end]


def set_eos(engine, eos, monkeypatch):
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, eos_token_ids=tuple(eos)))
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset(eos))
    monkeypatch.setattr(engine.runner, "stop_ids", frozenset(eos))  # the stop set every decoding mode reads


@pytest.mark.parametrize("arch", ARCHS + ["minimax_m2"])
def test_the_models_own_eos_and_widths_2_and_4_match_transformers(arch, engines, tiny_checkpoint):
    engine = engines(arch)
    ref = hf_model(tiny_checkpoint(arch))
    eos = set(engine.config.eos_token_ids) | engine.tokenizer.eos_token_ids
    for text in (PROMPT, "Hi"):
        ids = engine.tokenizer.encode(text)
        for beams in (2, 4):
            done = engine.beam_search(ids, beams=beams, max_new_tokens=NEW)
            assert done.token_ids == hf_beam(ref, ids, beams, NEW, eos), (text, beams)
            assert done.text == engine.tokenizer.decode(done.token_ids)
            assert done.prompt_tokens == len(ids) and done.stats["beams"] == beams


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("eos_at", [(2,), (1, 4)], ids=["one-eos", "two-eos"])
def test_hypotheses_ending_on_eos_score_and_stop_as_transformers(arch, eos_at, engines, tiny_checkpoint,
                                                                 monkeypatch):
    """EOS ids taken from the unconstrained best hypothesis, so that hypotheses end at several lengths; with two
    ids, 3W continuations per step (transformers keeps (1 + EOS ids) * W)."""
    engine = engines(arch)
    ref = hf_model(tiny_checkpoint(arch))
    ids = engine.tokenizer.encode(PROMPT)
    free = engine.beam_search(ids, beams=4, max_new_tokens=NEW, ignore_eos=True)
    assert free.finish_reason == "length" and len(free.token_ids) == NEW
    eos = {free.token_ids[i] for i in eos_at}
    set_eos(engine, eos, monkeypatch)
    answers, reasons = set(), set()
    for beams in (2, 4):
        for length_penalty in (1.0, 0.0, 2.0, -1.0):
            for early_stopping in (False, True, "never"):
                done = engine.beam_search(ids, beams=beams, max_new_tokens=NEW, length_penalty=length_penalty,
                                          early_stopping=early_stopping)
                expected = hf_beam(ref, ids, beams, NEW, eos, length_penalty, early_stopping)
                assert done.token_ids == expected, (beams, length_penalty, early_stopping)
                assert not eos & set(done.token_ids)
                answers.add(tuple(done.token_ids))
                reasons.add(done.finish_reason)
    assert len(answers) > 1 and "stop" in reasons  # the settings mattered, and EOS ended some answers


def test_offloaded_experts_give_the_same_tokens_and_see_every_hypothesis_at_once(engines, tiny_checkpoint):
    folder = tiny_checkpoint("mixtral")
    offloaded = Engine.load(str(folder), device="cpu", dtype="float32", offload=True, gpu_budget=0)
    assert offloaded.orchestra is not None
    ids = offloaded.tokenizer.encode(PROMPT)
    seen = []
    executor = offloaded.executor
    outputs = executor.expert_outputs

    def spy(moe, x, *args, **kwargs):
        seen.append(x.shape[0])
        return outputs(moe, x, *args, **kwargs)

    executor.expert_outputs = spy
    for beams, length_penalty in ((2, 1.0), (4, 0.5), (4, 2.0)):
        seen.clear()
        done = offloaded.beam_search(ids, beams=beams, max_new_tokens=NEW, length_penalty=length_penalty)
        plain = engines("mixtral").beam_search(ids, beams=beams, max_new_tokens=NEW, length_penalty=length_penalty)
        assert done.token_ids == plain.token_ids
        moe_layers = len(offloaded.model.moe_blocks())
        # The prompt once, then every step all W hypotheses in one call per layer.
        assert seen[:moe_layers] == [len(ids)] * moe_layers
        assert set(seen[moe_layers:]) == {beams} and len(seen) == moe_layers * (1 + done.stats["beam_steps"])
        experts = done.stats["experts"]
        assert experts["experts_cpu"] + experts["experts_copied"] > 0 and experts["experts_gpu"] == 0


def test_cache_rows_are_reused_and_grown_between_searches(engines):
    engine = engines("llama")
    ids = engine.tokenizer.encode(PROMPT)
    first = engine.beam_search(ids, beams=2, max_new_tokens=4)
    cache = engine._beam.runner.cache
    wider = engine.beam_search(ids + ids, beams=4, max_new_tokens=NEW)
    assert engine._beam.runner.cache is cache and cache.rows >= 4 and cache.length >= 2 * len(ids) + NEW - 1
    assert engine.beam_search(ids, beams=2, max_new_tokens=4).token_ids == first.token_ids  # stale rows unseen
    assert wider.stats["beam_steps"] <= NEW - 1


def test_searches_step_together_in_blocks_of_rows_and_each_gives_what_it_gives_alone(engines):
    """Two searches share forwards; the short one ends and frees its rows; a newcomer takes them and a row past
    the other's block (a block not in one piece), and still gives what it gives alone."""
    engine = engines("mixtral")
    fox, hi = engine.tokenizer.encode(PROMPT), engine.tokenizer.encode("Hi")
    cases = [(hi, 2, 3, 1.0), (fox, 3, 12, 0.5), (fox[:5], 3, 8, 2.0)]  # prompt, beams, new tokens, length penalty

    def search():
        return BeamSearch(engine.model, "cpu", torch.float32, engine.context_length)

    alone = [search().run(p, engine.executor, w, n, length_penalty=lp) for p, w, n, lp in cases]
    together = search()
    a, b = (together.add(p, w, n, length_penalty=lp) for p, w, n, lp in cases[:2])
    ended = []
    while a.result is None:
        ended += together.step(engine.executor)
    assert ended == [a] and a.rows == [] and b.rows == [2, 3, 4]
    c = together.add(*cases[2][:3], length_penalty=cases[2][3])
    while b.result is None or c.result is None:
        together.step(engine.executor)
        if c.result is None:
            assert c.rows == [0, 1, 5]
    assert together.active == [] and together.waiting == []
    for result, single in zip((a.result, b.result, c.result), alone):
        assert result.tokens == single.tokens and result.steps == single.steps
        assert result.score == pytest.approx(single.score, abs=1e-5)
    counters = together.counters
    assert counters["forwards"] < sum(r.steps for r in alone) and counters["max_rows"] == 6
    assert a.result.mean_rows == 5 and b.result.mean_rows > 3


def test_a_search_waits_for_rows_beyond_the_limit_unless_it_is_alone(engines):
    engine = engines("llama")
    ids = engine.tokenizer.encode(PROMPT)
    together = BeamSearch(engine.model, "cpu", torch.float32, engine.context_length, max_rows=4)
    wide, narrow = together.add(ids, 5, 4), together.add(ids, 2, 4)
    together.step(engine.executor)
    assert together.active == [wide] and together.waiting == [narrow]  # wider than the limit: it runs alone
    while wide.result is None:
        together.step(engine.executor)
    together.step(engine.executor)
    assert together.active == [narrow]
    together.remove(narrow)  # a cancel: it leaves and holds no rows
    assert together.active == [] and narrow.rows == []


def test_width_1_is_greedy_and_the_context_caps_the_reply(engines, tiny_checkpoint):
    from moedesk.engine.requests import Request, SamplingParams

    engine = engines("qwen3_moe")
    ids = engine.tokenizer.encode(PROMPT)
    greedy = next(engine.generate([Request(ids, SamplingParams(max_new_tokens=NEW, temperature=0))]))
    assert engine.beam_search(ids, beams=1, max_new_tokens=NEW).token_ids == greedy.token_ids
    short = Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32", context_length=len(ids) + 5)
    capped = short.beam_search(ids, beams=2, max_new_tokens=100, ignore_eos=True)
    assert len(capped.token_ids) == 5 and capped.finish_reason == "length"


def test_bad_options_are_refused_and_a_busy_scheduler_is_not(engines):
    from moedesk.engine.requests import Request, SamplingParams

    engine = engines("llama")
    ids = engine.tokenizer.encode("Hi")
    for bad in (dict(beams=0), dict(beams=2.5), dict(length_penalty=float("nan")), dict(early_stopping="soon")):
        with pytest.raises(ValueError):
            engine.beam_search(ids, **{"beams": 2, **bad})
    with pytest.raises(MoedeskError, match="context"):
        engine.beam_search([5] * engine.context_length, beams=2)
    alone = engine.beam_search(ids, beams=2, max_new_tokens=NEW)
    # A plain request decoding meanwhile no longer refuses the search: it runs between that request's steps.
    plain = engine.submit(Request(ids, SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)))
    updates = plain.updates(timeout=30)
    next(updates)
    try:
        assert engine.beam_search(ids, beams=2, max_new_tokens=NEW).token_ids == alone.token_ids
        assert not next(updates).final  # it was still running
    finally:
        plain.cancel()
    assert list(updates)[-1].completion.finish_reason == "cancelled"


def test_batch_runs_beam_lines_together_in_input_order(engines, tiny_checkpoint, tmp_path, capsys):
    """Beam lines go to the engine with the plain ones, and those in flight together share their steps; the
    output is what each line gives alone, in input order."""
    from moedesk.app.cli import main

    folder = tiny_checkpoint("mixtral")
    engine = engines("mixtral")
    lines = [{"id": "a", "prompt": PROMPT},
             {"id": "b", "prompt": "Hi", "beams": 4, "length_penalty": 2.0},
             {"id": "c", "prompt": "Hi"},
             {"id": "d", "prompt": PROMPT, "beams": 1},
             {"id": "e", "prompt": "Hi", "beams": 0},
             {"id": "f", "prompt": "Hi", "beams": 2, "response_format": {"type": "json_object"}},
             {"id": "g", "prompt": "The quick", "beams": 3}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    code = main(["batch", str(src), "-o", str(out), "--model", str(folder), "--dtype", "float32", "--device", "cpu",
                 "--temperature", "0", "--max-new-tokens", str(NEW), "--beams", "2", "--length-penalty", "0.5",
                 "--batch-size", "3"])
    assert code == 1  # lines e and f are errors
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "c", "d", "e", "f", "g"]
    hi, fox = engine.tokenizer.encode("Hi"), engine.tokenizer.encode(PROMPT)
    assert records[0]["token_ids"] == engine.beam_search(fox, 2, NEW, 0.5).token_ids
    assert records[0]["stats"]["beams"] == 2
    assert records[1]["token_ids"] == engine.beam_search(hi, 4, NEW, 2.0).token_ids
    assert records[2]["token_ids"] == engine.beam_search(hi, 2, NEW, 0.5).token_ids
    greedy = engine.beam_search(fox, 1, NEW).token_ids
    assert records[3]["token_ids"] == greedy and "beams" not in records[3]["stats"]
    assert records[4]["error"] == "line 5: beams must be >= 1, got 0"
    assert records[5]["error"] == "line 6: response_format cannot be combined with beam search"
    assert records[6]["token_ids"] == engine.beam_search(engine.tokenizer.encode("The quick"), 3, NEW, 0.5).token_ids
    assert records[1]["usage"] == {"prompt_tokens": len(hi), "completion_tokens": len(records[1]["token_ids"])}
    # a, b and c went in together: a's and b's hypotheses (2 + 4) stepped in one forward
    assert records[0]["stats"]["mean_rows"] > 2 and records[1]["stats"]["mean_rows"] > 4


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_cuda_beam_search_matches_transformers_with_experts_offloaded(arch, tiny_checkpoint):
    folder = tiny_checkpoint(arch)
    engine = Engine.load(str(folder), device="cuda", dtype="float32", offload=True, gpu_budget=0)
    ref = hf_model(folder, device="cuda")
    eos = set(engine.config.eos_token_ids) | engine.tokenizer.eos_token_ids
    for text in (PROMPT, "Hi"):
        ids = engine.tokenizer.encode(text)
        for beams, length_penalty, early_stopping in ((2, 1.0, False), (4, 2.0, True), (8, 0.5, "never")):
            done = engine.beam_search(ids, beams=beams, max_new_tokens=16, length_penalty=length_penalty,
                                      early_stopping=early_stopping)
            assert done.token_ids == hf_beam(ref, ids, beams, 16, eos, length_penalty, early_stopping)
    assert engine._beam.runner.graphs is not None and engine._beam.runner.graphs.broken is None
