"""The scheduler that owns decoding: requests from many threads share one continuous batch."""
import threading
import time

import pytest

from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from moedesk.engine.generation.scheduler import Group, QueueFull
from tests.at_once import at_once

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32")


@pytest.fixture
def chunk(engine):
    """Set the prefill piece size for one test."""
    before = engine.scheduler.prefill_chunk

    def set_chunk(tokens):
        engine.scheduler.prefill_chunk = tokens

    yield set_chunk
    engine.scheduler.prefill_chunk = before


def alone(engine, ids, params=GREEDY):
    return next(engine.generate([Request(ids, params)], batch_size=1))


def wait_idle(engine, timeout=10.0):
    # One look under the scheduler's lock (two stats() calls can miss a request moving from waiting to running).
    engine.scheduler.drain(timeout)


def test_requests_from_several_threads_share_steps_and_match_running_alone(engine):
    prompts = ["The quick brown fox", "Hello, world!", "def add(a, b):", "Experts live in RAM"]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    expected = [alone(engine, i).token_ids for i in ids]
    before = engine.scheduler.stats()

    def client(prompt_ids):
        handle = engine.submit(Request(prompt_ids, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)))
        return [u for u in handle.updates(timeout=30)][-1].completion

    results = at_once(client, ids, 60)
    for k, done in enumerate(results):
        assert done.token_ids[:12] == expected[k] and len(done.token_ids) == 24
        assert done.stats["decode_steps"] == 23
    after = engine.scheduler.stats()
    assert after["max_batch"] >= 2
    # Steps were shared: fewer decode steps than the sequences' steps added up.
    assert after["decode_steps"] - before["decode_steps"] < sum(r.stats["decode_steps"] for r in results)
    assert max(r.stats["mean_batch"] for r in results) > 1
    # the decode steps' wall time is counted (what a server's /moedesk/stats reports as its decode rate)
    assert after["decode_seconds"] > before["decode_seconds"]


def test_a_newcomer_joins_a_running_batch_between_steps(engine):
    long = engine.submit(Request(engine.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=200, temperature=0,
                                                                                  ignore_eos=True)))
    updates = long.updates(timeout=30)
    for _ in range(5):
        next(updates)
    ids = engine.tokenizer.encode("The quick brown fox")
    newcomer = engine.submit(Request(ids, GREEDY))
    done = [u for u in newcomer.updates(timeout=30)][-1].completion
    assert done.token_ids == alone(engine, ids).token_ids
    assert done.stats["mean_batch"] > 1  # it decoded beside the long one
    long.cancel()
    rest = list(updates)
    assert rest[-1].completion.finish_reason == "cancelled" and len(rest[-1].completion.token_ids) < 200


def test_long_prompts_prefill_in_pieces_between_decode_steps(engine, chunk):
    running = Request(engine.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True))
    long_ids = engine.tokenizer.encode("Mixture of experts models route every token to a few experts out of many. " * 2)
    expected = alone(engine, long_ids).token_ids
    chunk(4)
    before = engine.scheduler.stats()
    order = []
    lock = threading.Lock()

    def sink(name):
        def put(update):
            with lock:
                order.append((name, update))
        return put

    engine.submit(running, sink=sink("running"))
    while not any(name == "running" for name, _ in order):
        time.sleep(0.001)
    newcomer = engine.submit(Request(long_ids, GREEDY), sink=sink("long"))
    wait_idle(engine)
    pieces = engine.scheduler.stats()["prefill_pieces"] - before["prefill_pieces"]
    assert pieces >= len(long_ids) // 4
    [final] = [u for name, u in order if name == "long" and u.final]
    assert final.completion.token_ids == expected  # prefilled in pieces, the same greedy tokens
    # The running sequence kept getting tokens while the long prompt went in: between the newcomer's
    # submission and its first token, there were about as many steps as pieces.
    names = [name for name, _ in order]
    first_long = names.index("long")
    running_before = [k for k, (name, u) in enumerate(order) if name == "running"]
    during = [k for k in running_before if k < first_long]
    assert len(during) >= len(long_ids) // 4
    assert newcomer.done


def test_cancel_frees_the_row_at_the_next_step(engine):
    handle = engine.submit(Request(engine.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=400, temperature=0,
                                                                                    ignore_eos=True)))
    updates = handle.updates(timeout=30)
    next(updates)
    handle.cancel()
    final = list(updates)[-1]
    assert final.completion.finish_reason == "cancelled"
    wait_idle(engine)
    assert engine.scheduler.stats()["running"] == 0


def test_a_group_caps_its_requests_and_the_caller_stopping_early_cancels_the_rest(engine):
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    seen = []
    real_admit = engine.scheduler._admit

    def admit():
        newcomers = real_admit()
        seen.append(sum(h is not None for h in engine.scheduler._rows))
        return newcomers

    engine.scheduler._admit = admit
    try:
        requests = (Request(engine.tokenizer.encode(f"Hello {i}"), params, tag=i) for i in range(7))
        results = engine.generate(requests, batch_size=2)
        first = next(results)
        assert max(seen) == 2
        results.close()  # stops early: what it submitted is cancelled
        wait_idle(engine)
    finally:
        engine.scheduler._admit = real_admit
    assert first.finish_reason == "length"
    assert engine.scheduler.stats()["running"] == 0


def test_a_failing_step_ends_its_requests_with_the_error_and_the_engine_goes_on(engine, monkeypatch):
    import moedesk.engine.generation.decoder as generate

    real_decode = generate.Decoder.decode
    failed = []

    def decode(self, seqs):
        if not failed:
            failed.append(True)
            raise RuntimeError("simulated failure")
        return real_decode(self, seqs)

    monkeypatch.setattr(generate.Decoder, "decode", decode)
    with pytest.raises(RuntimeError, match="simulated failure"):
        list(engine.generate([Request(engine.tokenizer.encode("Hello"), GREEDY)]))
    ids = engine.tokenizer.encode("The quick brown fox")
    monkeypatch.setattr(generate.Decoder, "decode", real_decode)
    assert alone(engine, ids).finish_reason == "length"
    assert engine.scheduler.stats()["failed"] >= 1


def test_queue_limit(engine):
    group = Group(1)
    params = SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)
    ids = engine.tokenizer.encode("Hello")
    first = engine.submit(Request(ids, params), group=group)
    next(first.updates(timeout=30))  # running: the next one of the group waits
    try:
        waiting = engine.submit(Request(ids, params), group=group, queue_limit=1)
        with pytest.raises(QueueFull):
            engine.submit(Request(ids, params), group=group, queue_limit=1)
        assert engine.scheduler.stats()["waiting"] == 1 and engine.scheduler.retry_after() >= 1
        waiting.cancel()
    finally:
        first.cancel()
    assert list(waiting.updates(timeout=30))[-1].completion.finish_reason == "cancelled"
    wait_idle(engine)


def test_json_schema_constrains_decoding(engine):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    grammar = engine.grammar({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    for temperature in (0, 1.0):
        params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=3)
        done = next(engine.generate([Request(engine.tokenizer.encode("Answer in JSON:"), params, grammar=grammar)]))
        assert done.finish_reason == "stop", done.text
        jsonschema.validate(json.loads(done.text), schema)
    with pytest.raises(ValueError, match="response_format"):
        engine.grammar({"type": "xml"})
    assert engine.grammar({"type": "text"}) is None


def test_a_request_that_cannot_start_fails_alone(engine):
    class Broken:
        def matcher(self):
            raise RuntimeError("no matcher")

    ids = engine.tokenizer.encode("Hello")
    other = engine.submit(Request(ids, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)))
    bad = engine.submit(Request(ids, GREEDY, grammar=Broken()))
    assert "no matcher" in str(list(bad.updates(timeout=30))[-1].error)
    assert list(other.updates(timeout=30))[-1].completion.finish_reason == "length"


def test_generate_and_stream_return_only_once_the_decode_thread_has_stopped(engine, monkeypatch):
    """The last update is sent mid-step: a caller that goes on to use the GPU (load another model, capture a
    graph) must not overlap that step's end. With no other work, generate and stream wait for the thread."""
    ids = engine.tokenizer.encode("hello world")
    original_step = engine.scheduler._step

    def slow_step(decoder, newcomers):
        original_step(decoder, newcomers)
        time.sleep(0.05)  # the step's end, after its updates went out

    monkeypatch.setattr(engine.scheduler, "_step", slow_step)
    list(engine.generate([Request(ids, GREEDY)], batch_size=1))
    assert engine.scheduler._thread is None
    list(engine.stream(ids, GREEDY))
    assert engine.scheduler._thread is None


def test_prefill_pieces_are_long_on_a_gpu_and_short_on_the_cpu(engine):
    # On a GPU with the experts in RAM a piece costs about one read of every expert whatever its length.
    from moedesk.engine.generation.scheduler import PREFILL_CHUNK_CPU, PREFILL_CHUNK_GPU, default_prefill_chunk

    assert default_prefill_chunk("cuda") == default_prefill_chunk("cuda:1") == PREFILL_CHUNK_GPU
    assert default_prefill_chunk("cpu") == PREFILL_CHUNK_CPU < PREFILL_CHUNK_GPU
    assert engine.scheduler.prefill_chunk == PREFILL_CHUNK_CPU  # this engine runs on the CPU


def test_release_cache_gives_the_caches_back_once_idle_and_the_next_requests_give_the_same_tokens(engine):
    # What a batch's out-of-memory back-off asks for: the caches only ever grew, so fewer rows at once freed nothing.
    ids = engine.tokenizer.encode("The quick brown fox")
    plain = sorted((c.tag, c.token_ids) for c in engine.generate([Request(ids, GREEDY, tag=i) for i in range(4)],
                                                                  batch_size=4))
    beam = engine.beam_search(ids, beams=4, max_new_tokens=8)
    assert engine.cache.rows >= 4 and engine._beam is not None

    busy = engine.submit(Request(ids, SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)))
    next(busy.updates(timeout=30))
    full = engine.cache.nbytes()
    assert not engine.release_cache(timeout=0.2)  # a request runs: nothing is touched under it
    assert engine.cache.nbytes() == full
    busy.cancel()

    assert engine.release_cache()
    assert engine.cache.nbytes() < full and engine.cache.rows == 1 and engine._beam is None
    assert next(engine.generate([Request(ids, GREEDY, tag=0)], batch_size=1)).token_ids == plain[0][1]
    assert engine.cache.rows == 1  # the scheduler forgot the 4 rows the batch held: one request reserves one
    assert sorted((c.tag, c.token_ids) for c in engine.generate([Request(ids, GREEDY, tag=i) for i in range(4)],
                                                                batch_size=4)) == plain
    assert engine.beam_search(ids, beams=4, max_new_tokens=8).token_ids == beam.token_ids
