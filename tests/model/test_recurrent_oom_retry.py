"""An out-of-memory retry over Gated DeltaNet layers (tiny random Qwen3.5-MoE, tests/gguf_from_hf.py).

The runner runs a forward again after an out-of-memory error. Layers before the failure have already fed their
tokens to their rows' recurrent states, so without care the retry feeds them twice, silently. Here one forward
runs out of memory in layer 1's experts (after the DeltaNets of layers 0 and 1 wrote their states) on its first
attempt only: in a decode step, in a prompt's second prefill chunk, in a step through the segments CUDA graphs
replay, in a beam search step and in a speculative verify forward. Tokens equal transformers' and a run without
the error; the states left behind equal that run's to the bit.
"""
from __future__ import annotations

import pytest
import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.reference import hf_greedy

TEXTS = ["The quick brown fox jumps over the lazy",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3)) Experts live in RAM; the most popular ones live on "
         "the GPU. Mixture of experts models route every token to a few experts out of many.", "Hi"]
NEW = 10
LAYER = 1  # a DeltaNet layer with experts, after another DeltaNet layer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from tests.gguf_from_hf import build

    return build("qwen35moe", tmp_path_factory.mktemp("qwen35moe"))


def load(built) -> Engine:
    engine = Engine.load(str(built.folder), device="cpu", dtype="float32")
    assert engine.config.linear_layers[:2] == (True, True) and hasattr(engine.model.layers[LAYER], "moe")
    return engine


def fail_once(engine, runner, method: str, call: int) -> list:
    """runner.<method>'s call-th call runs out of memory in layer LAYER's experts on its first attempt; the runner
    may retry (its on_oom frees nothing and says go on). Returns the list the failure is recorded in."""
    failed, calls, armed = [], [0], [False]
    original = getattr(runner, method)

    def counted(*args, **kwargs):
        calls[0] += 1
        armed[0] = calls[0] == call
        try:
            return original(*args, **kwargs)
        finally:
            armed[0] = False

    experts = engine.executor.expert_outputs

    def short_of_memory(moe, *args, **kwargs):
        if armed[0] and moe.layer == LAYER and not failed:
            failed.append(moe.layer)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return experts(moe, *args, **kwargs)

    setattr(runner, method, counted)
    engine.executor.expert_outputs = short_of_memory
    runner.on_oom, runner.can_free = (lambda: True), None
    return failed


def greedy(engine, ids, batch_size=2) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=NEW, temperature=0)
    done = {c.tag: c.token_ids for c in engine.generate([Request(p, params, tag=i) for i, p in enumerate(ids)],
                                                        batch_size=batch_size)}
    return [done[i] for i in range(len(ids))]


def states(cache) -> list[torch.Tensor]:
    recurrent = cache.kinds[1]
    return [t.clone() for t in recurrent.state + recurrent.conv]


def segments(engine):
    from moedesk.engine.generation.cuda_graphs import GraphedDecode

    engine.runner.graphs = GraphedDecode(engine.model, engine.cache, capture=False)


@pytest.mark.parametrize("where", ["decode-step", "prefill-chunk", "graph-segments"])
def test_a_retried_forward_feeds_the_recurrent_state_once(built, where):
    tokenizer, config = (engine := load(built)).tokenizer, engine.config
    ids = [tokenizer.encode(t) for t in TEXTS]
    eos = tokenizer.eos_token_ids | set(config.eos_token_ids)
    want = [hf_greedy(built.model, p, NEW, eos) for p in ids]

    def run(inject: bool):
        engine = load(built)
        engine.scheduler.prefill_chunk = 7  # the long prompt in pieces, each continuing the state
        if where == "graph-segments":
            segments(engine)
        failed = []
        if inject:
            method, call = ("prefill", 2) if where == "prefill-chunk" else ("step", 3)
            failed = fail_once(engine, engine.runner, method, call)
        tokens = greedy(engine, ids)
        assert failed == ([LAYER] if inject else [])
        return tokens, states(engine.cache)

    clean_tokens, clean_states = run(False)
    tokens, after = run(True)
    assert clean_tokens == want and tokens == want
    for ours, theirs in zip(after, clean_states):
        assert torch.equal(ours, theirs)


def test_beam_search_retries_a_step_from_the_states_it_started_from(built):
    from moedesk.engine.generation.beam import BeamSearch

    engine = load(built)
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    ids = engine.tokenizer.encode(TEXTS[0])
    with torch.no_grad():
        out = built.model.generate(torch.tensor([ids]), max_new_tokens=8, num_beams=3, do_sample=False,
                                   eos_token_id=sorted(eos), pad_token_id=0)
    new = out[0, len(ids):].tolist()
    want = new[:next((i for i, t in enumerate(new) if t in eos), len(new))]
    results = []
    for inject in (False, True):
        search = BeamSearch(engine.model, engine.device, engine.dtype, engine.context_length)
        failed = fail_once(engine, search.runner, "step", 3) if inject else []
        done = search.run(ids, engine.executor, 3, 8, eos)
        assert failed == ([LAYER] if inject else [])
        results.append((done.tokens[:len(done.tokens) - done.ended_by_eos], states(search.runner.cache)))
        engine = load(built)
    (clean, clean_states), (retried, after) = results
    assert clean == want and retried == want
    for ours, theirs in zip(after, clean_states):
        assert torch.equal(ours, theirs)


def test_a_retried_verify_forward_keeps_speculation_lossless(built):
    from moedesk.engine.speculative.oracle_drafter import oracle_factory
    from moedesk.engine.speculative.verification import Speculator

    engine = load(built)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_new_tokens=NEW, temperature=0)
    requests = [Request(p, params, tag=i) for i, p in enumerate(ids)]
    plain = [next(iter(engine.generate([r], batch_size=1))).token_ids for r in requests]
    for mode, width, budget in (("greedy", 1, None), ("beam", 3, 7)):
        engine = load(built)
        sp = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                        engine.tokenizer)
        failed = fail_once(engine, sp.runner, "step", 2)
        done, _ = sp.run(requests, engine.executor, oracle_factory(plain, 0.3, engine.vocab_size, seed=1), mode=mode,
                         draft_length=4, draft_width=width, budget=budget)
        assert failed == [LAYER] and [c.token_ids for c in done] == plain, mode


def test_an_offloaded_engine_moves_experts_to_ram_and_decodes_transformers_tokens(built):
    """The engine's own retry: out of memory in a decode step, half the GPU's experts go to RAM, the step runs
    again from the states it started from."""
    from tests.tiny_models import budget_for_experts

    engine = Engine.load(str(built.folder), device="cpu", dtype="float32", offload=True,
                         gpu_budget=budget_for_experts(built.folder, 2))
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    eos = engine.tokenizer.eos_token_ids | set(engine.config.eos_token_ids)
    resident = engine.expert_stats()["experts_on_gpu"]
    assert resident > 1 and engine._can_free()
    on_oom, can_free = engine.runner.on_oom, engine.runner.can_free
    failed = fail_once(engine, engine.runner, "step", 3)
    engine.runner.on_oom, engine.runner.can_free = on_oom, can_free  # the engine's: back off, while experts remain
    assert greedy(engine, ids) == [hf_greedy(built.model, p, NEW, eos) for p in ids]
    assert failed == [LAYER] and engine.expert_stats()["experts_on_gpu"] == resident // 2
    assert any("out of memory" in w for w in engine.warnings)


def test_nothing_left_to_free_puts_the_states_back_and_says_so_in_one_line(built):
    """The error ends the step, not the rows' states: they are what they were before it."""
    engine = load(built)
    ids = torch.tensor([engine.tokenizer.encode(TEXTS[0])])
    runner = engine.runner
    runner.reserve(1, 64)
    runner.prefill(ids, torch.arange(ids.shape[1])[None], engine.executor)
    before = states(runner.cache)
    fail_once(engine, runner, "step", 1)
    runner.on_oom = lambda: False
    with pytest.raises(MoedeskError, match="GPU out of memory with nothing left to move to RAM"):
        runner.step(torch.tensor([[5]]), torch.tensor([[ids.shape[1]]]), engine.executor)
    for ours, theirs in zip(states(runner.cache), before):
        assert torch.equal(ours, theirs)
