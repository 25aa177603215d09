"""A group's refill threshold (scheduler.Group(refill=k), Engine.generate(refill=k)): freed rows are taken only
once k are free, so newcomers prefill together; the answers are those of refill 1, nothing waits forever (k above
the group's limit or its waiting requests), and a waiting request still cancels."""
import pytest

from moedesk.engine.generation.scheduler import Group
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32")


def requests(engine, n=10):
    prompts = ["The quick brown fox", "Hello, world!", "def add(a, b):", "Experts live in RAM", "One two three"]
    return [Request(engine.tokenizer.encode(prompts[i % len(prompts)]),
                    SamplingParams(max_new_tokens=3 + 2 * i, temperature=0 if i % 2 else 0.9, seed=i,
                                   ignore_eos=True), tag=i) for i in range(n)]


def test_refill_gives_the_same_answers_in_fewer_prefill_forwards(engine):
    reqs = requests(engine)
    counts, answers = {}, {}
    for refill in (1, 3, 50):  # 50: more than the batch and than the requests, clamped, never stuck
        before = engine.scheduler.stats()
        answers[refill] = {c.tag: (c.token_ids, c.finish_reason) for c in engine.generate(reqs, batch_size=4,
                                                                                           refill=refill)}
        counts[refill] = engine.scheduler.stats()["prefill_pieces"] - before["prefill_pieces"]
        engine.scheduler.drain()
    assert answers[3] == answers[1] and answers[50] == answers[1]
    assert len(answers[1]) == len(reqs) and all(len(ids) == 3 + 2 * i for i, (ids, _) in answers[1].items())
    assert counts[3] < counts[1] and counts[50] <= counts[3]


def test_newcomers_wait_for_the_threshold_and_still_cancel(engine):
    group = Group(3, refill=2)
    ids = engine.tokenizer.encode("Hello")
    short = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    long = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    with engine.scheduler.submitting():
        running = [engine.submit(Request(ids, p), group=group) for p in (long, long, short)]
        waiting = [engine.submit(Request(ids, short), group=group) for _ in range(2)]
    try:
        assert list(running[2].updates(timeout=30))[-1].completion.finish_reason == "length"
        # one row is free, the group wants two before its two waiting requests come in
        for _ in range(20):
            next(running[0].updates(timeout=30))
        assert engine.scheduler.stats()["waiting"] == 2
        waiting[0].cancel()
        assert list(waiting[0].updates(timeout=30))[-1].completion.finish_reason == "cancelled"
        # one waits now: one free row is enough for it
        assert list(waiting[1].updates(timeout=30))[-1].completion.finish_reason == "length"
    finally:
        for h in running + waiting:
            h.cancel()
    engine.scheduler.drain()
    with pytest.raises(ValueError):
        Group(2, refill=0)
