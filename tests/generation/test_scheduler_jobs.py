"""Beam search and speculative decoding as jobs of the scheduler's one decode thread.

They run between the plain batch's steps, beside plain requests that keep streaming; at temperature 0 each
gives what it gives alone (a beam search what Engine.beam_search gives on an idle engine, speculative
decoding plain greedy's tokens); speculative requests that arrive while a job runs join it; a cancel ends
a job's request at its next step and the next job runs.
"""
import dataclasses
import threading
import time

import pytest

from moedesk.engine.generation.beam import BeamJob, BeamOptions
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from moedesk.engine.speculative.options import SpeculativeOptions
from moedesk.engine.speculative.oracle_drafter import oracle_factory
from tests.speculative.test_speculative_decode import random_head

PROMPTS = ["The quick brown fox", "Hello, world!", "def add(a, b):", "Experts live in RAM"]


def greedy(n=16):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32")
    yield engine
    engine.scheduler.close()  # whatever a failed test left in flight: no decode thread outlives the module


@pytest.fixture
def fresh_engine(tiny_checkpoint):
    """fresh_engine(arch, device="cuda"): an engine of its own (on the GPU with its experts in RAM), whose decode
    thread is stopped when the test ends, failed or not (one left stepping beside the next test's engine broke that
    test's attention)."""
    made = []

    def load(arch, device="cuda"):
        offload = dict(offload=True, gpu_budget=0) if device == "cuda" else {}
        made.append(Engine.load(str(tiny_checkpoint(arch)), device=device, dtype="float32", **offload))
        return made[-1]

    yield load
    for engine in made:
        engine.scheduler.close()


@pytest.fixture(scope="module")
def head(engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("head")
    random_head(engine, 1, folder)
    return folder


def ids(engine, k):
    return engine.tokenizer.encode(PROMPTS[k])


def alone(engine, prompt, params=None):
    return next(engine.generate([Request(prompt, params or greedy())], batch_size=1)).token_ids


def wait_idle(engine, timeout=30.0):
    """Until every request has ended and the decode thread has stopped. (Polling the counters is not enough: read in
    two calls, "running" then "waiting", they missed requests moving from waiting into a job in between, and the
    test went on with its searches unfinished and its decode thread stepping them into the next test.)"""
    engine.scheduler.drain(timeout)
    stats = engine.scheduler.stats()
    assert stats["running"] == stats["waiting"] == stats["running_jobs"] == stats["in_jobs"] == 0, stats


class Recorder:
    """Every update of several requests, in the order the decode thread sent them."""

    def __init__(self):
        self.events, self.lock = [], threading.Lock()

    def sink(self, name):
        def put(update):
            with self.lock:
                self.events.append((name, update))
        return put

    def final(self, name):
        return next(u for n, u in self.events if n == name and u.final)

    def names(self):
        with self.lock:
            return [n for n, _ in self.events]


def test_beam_and_speculative_jobs_beside_streaming_plain_requests_equal_running_alone(engine, head):
    beam_alone = engine.beam_search(ids(engine, 2), beams=3, max_new_tokens=10)
    spec_want = [alone(engine, ids(engine, k)) for k in (0, 1)]
    plain_want = [alone(engine, ids(engine, k), greedy(60)) for k in (2, 3)]
    jobs_before = engine.scheduler.stats()["jobs"]
    rec = Recorder()
    plain = [engine.submit(Request(ids(engine, k), greedy(60)), sink=rec.sink(f"plain{k}")) for k in (2, 3)]
    while rec.names().count("plain2") < 3:  # the plain batch is streaming
        time.sleep(0.001)
    beam = engine.submit(Request(ids(engine, 2), greedy(10)), decoding=BeamOptions(beams=3), sink=rec.sink("beam"))
    options = SpeculativeOptions("greedy", head, draft_length=3)
    with engine.scheduler.submitting():  # submitted together: one job, verified as one batch
        spec = [engine.submit(Request(ids(engine, k), greedy()), decoding=options, sink=rec.sink(f"spec{k}"))
                for k in (0, 1)]
    wait_idle(engine)
    assert all(h.done for h in plain + spec + [beam])

    assert rec.final("beam").completion.token_ids == beam_alone.token_ids
    assert rec.final("beam").completion.stats["beams"] == 3
    for k in (0, 1):
        done = rec.final(f"spec{k}").completion
        assert done.token_ids == spec_want[k] and done.finish_reason == "length"
        spec_stats = done.stats["speculative"]
        assert spec_stats["mode"] == "greedy" and spec_stats["verify_steps"] >= 1
        # tokens streamed one by one, as plain decoding's are
        streamed = [u.token_id for n, u in rec.events if n == f"spec{k}" and u.token_id is not None]
        assert streamed == done.token_ids
    for i, k in enumerate((2, 3)):
        assert rec.final(f"plain{k}").completion.token_ids == plain_want[i]
    assert engine.scheduler.stats()["jobs"] - jobs_before == 2  # one beam job, one speculative job for both

    # Nobody waited for anybody: plain tokens kept coming while the jobs ran, and the jobs ended first.
    names = rec.names()
    first_job = min(names.index("beam"), names.index("spec0"))
    last_job = max(len(names) - 1 - names[::-1].index(n) for n in ("beam", "spec0", "spec1"))
    assert any(n.startswith("plain") for n in names[first_job:last_job])
    assert names[-1].startswith("plain")


def test_speculative_requests_arriving_while_a_job_runs_join_it(engine, head):
    """A newcomer takes a row of the running job (its drafter and cache grow, a freed row is reused) and the
    output stays plain greedy's."""
    options = SpeculativeOptions("beam", head, draft_length=3, draft_width=2)
    lengths = {0: 40, 1: 12, 2: 12, 3: 8}
    want = {k: alone(engine, ids(engine, k), greedy(n)) for k, n in lengths.items()}
    jobs_before = engine.scheduler.stats()["jobs"]
    rec = Recorder()
    first = engine.submit(Request(ids(engine, 0), greedy(lengths[0])), decoding=options, sink=rec.sink(0))
    while rec.names().count(0) < 4:
        time.sleep(0.001)
    engine.submit(Request(ids(engine, 1), greedy(lengths[1])), decoding=options, sink=rec.sink(1))
    while not any(n == 1 and u.final for n, u in rec.events):
        time.sleep(0.001)
    assert not first.done  # the first is still running: the next newcomer reuses the freed row beside it
    engine.submit(Request(ids(engine, 2), greedy(lengths[2])), decoding=options, sink=rec.sink(2))
    engine.submit(Request(ids(engine, 3), greedy(lengths[3])), decoding=options, sink=rec.sink(3))
    wait_idle(engine)
    for k in lengths:
        assert rec.final(k).completion.token_ids == want[k], k
    assert engine.scheduler.stats()["jobs"] - jobs_before == 1
    stats = {k: rec.final(k).completion.stats["speculative"] for k in lengths}
    assert stats[1]["rounds"] < stats[0]["rounds"]  # it came later and left earlier


def test_beam_searches_submitted_together_share_forwards_and_equal_running_alone(engine):
    """Widths 1 to 4, prompts of different lengths, some ending on EOS: one job, one forward per step over every
    search's rows, and each search gives what it gives alone."""
    beams_together_equal_alone(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_beam_searches_together_on_cuda(arch, fresh_engine):
    """The same on the GPU, experts in RAM: the searches' rows (not in one piece once one ends) go through the
    beam search's CUDA graphs with a row index, and the graphs stay on."""
    engine = fresh_engine(arch)
    beams_together_equal_alone(engine, timeout=120)
    assert engine._beam.runner.graphs is not None and engine._beam.runner.graphs.broken is None


def beams_together_equal_alone(engine, timeout=30.0):
    cases = [(0, 2, 12, 1.0, True), (1, 4, 10, 2.0, True), (2, 3, 16, 0.5, False), (3, 1, 8, 1.0, True)]
    requests = [Request(ids(engine, k), SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=ignore))
                for k, _, n, _, ignore in cases]
    want = [engine.beam_search(r.prompt_ids, beams=w, max_new_tokens=r.params.max_new_tokens, length_penalty=lp,
                               ignore_eos=r.params.ignore_eos) for r, (_, w, _, lp, _) in zip(requests, cases)]
    before = engine.scheduler.stats()
    rec = Recorder()
    with engine.scheduler.submitting():
        handles = [engine.submit(r, decoding=BeamOptions(beams=w, length_penalty=lp), sink=rec.sink(i))
                   for i, (r, (_, w, _, lp, _)) in enumerate(zip(requests, cases))]
    wait_idle(engine, timeout)
    assert all(h.done for h in handles)
    got = [rec.final(i).completion for i in range(len(cases))]
    for done, alone_ in zip(got, want):
        assert done.token_ids == alone_.token_ids and done.finish_reason == alone_.finish_reason
        assert done.stats["beam_steps"] == alone_.stats["beam_steps"]
        assert done.stats["score"] == pytest.approx(alone_.stats["score"], abs=1e-5)
    after = engine.scheduler.stats()
    assert after["jobs"] - before["jobs"] == 1
    # every job step runs at most one forward of the searches' hypotheses: fewer than their steps added up
    job_steps = after["job_steps"] - before["job_steps"]
    assert job_steps < sum(d.stats["beam_steps"] for d in got)
    assert job_steps <= max(d.stats["beam_steps"] for d in got) + 1  # + 1: the step that ends the last
    assert all(d.stats["mean_rows"] > w for d, (_, w, _, _, _) in zip(got, cases))  # rows beside its own


def test_a_cancelled_beam_search_frees_its_rows_while_the_others_go_on(engine, monkeypatch):
    """Rows for 6 hypotheses: a long 4-wide search and a 2-wide one fill them, a 3-wide one waits; cancelling the
    long one lets the waiting one in while the 2-wide one keeps going, and both give what they give alone."""
    fox, hello, code = ids(engine, 0), ids(engine, 1), ids(engine, 2)
    middle_want = engine.beam_search(hello, beams=2, max_new_tokens=40, ignore_eos=True)
    last_want = engine.beam_search(code, beams=3, max_new_tokens=6, ignore_eos=True)
    search = engine._beam
    monkeypatch.setattr(search, "max_rows", 6)
    rec = Recorder()
    long = engine.submit(Request(fox, greedy(300)), decoding=BeamOptions(beams=4), sink=rec.sink("long"))
    middle = engine.submit(Request(hello, greedy(40)), decoding=BeamOptions(beams=2), sink=rec.sink("middle"))
    last = engine.submit(Request(code, greedy(6)), decoding=BeamOptions(beams=3), sink=rec.sink("last"))
    deadline = time.monotonic() + 30
    while len(search.active) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert len(search.waiting) == 1 and search.waiting[0].W == 3  # no rows for it yet
    long.cancel()
    wait_idle(engine)
    assert rec.final("long").completion.finish_reason == "cancelled"
    assert rec.final("middle").completion.token_ids == middle_want.token_ids
    assert rec.final("last").completion.token_ids == last_want.token_ids
    # the waiting one came in while the 2-wide one still ran: it shared its forwards (2 + 3 rows)
    assert rec.final("last").completion.stats["mean_rows"] == 5
    assert search.active == [] and search.waiting == [] and all(h.done for h in (long, middle, last))


def test_cancel_ends_a_jobs_request_at_its_next_step(engine, head):
    prompt = ids(engine, 0)
    long = greedy(300)
    for decoding in (BeamOptions(beams=2), SpeculativeOptions("greedy", head, draft_length=2)):
        handle = engine.submit(Request(prompt, long), decoding=decoding)
        updates = handle.updates(timeout=60)
        if isinstance(decoding, SpeculativeOptions):
            next(updates)  # it is streaming
        else:
            while engine.scheduler.stats()["in_jobs"] == 0:
                time.sleep(0.001)
            time.sleep(0.05)  # a few of its steps
        handle.cancel()
        final = list(updates)[-1]
        assert final.completion.finish_reason == "cancelled"
        assert len(final.completion.token_ids) < 300
        wait_idle(engine)
        assert engine.scheduler.stats()["running_jobs"] == 0
    # the searches and the speculator were given back: the next ones run
    assert engine.beam_search(prompt, beams=2, max_new_tokens=4).finish_reason == "length"
    assert engine.speculate([Request(prompt, greedy(6))], head, draft_length=2)[0].token_ids == alone(engine, prompt,
                                                                                                       greedy(6))


def test_stream_with_speculation_and_beams(engine, head):
    prompt = ids(engine, 1)
    want = alone(engine, prompt, greedy(20))
    chunks = list(engine.stream(prompt, greedy(20), decoding=SpeculativeOptions("greedy", head, draft_length=3)))
    done = chunks[-1].completion
    assert done.token_ids == want and sum((c.token_ids for c in chunks), []) == want
    assert "".join(c.text for c in chunks) == done.text
    assert len([c for c in chunks if c.text]) > 1  # streamed, not all at the end

    beam = list(engine.stream(prompt, greedy(8), decoding=BeamOptions(beams=2)))
    assert len(beam) == 1  # beam search: only the best hypothesis, whole, at the end
    assert beam[0].completion.token_ids == engine.beam_search(prompt, beams=2, max_new_tokens=8).token_ids
    assert beam[0].text == beam[0].completion.text


def test_a_request_a_job_cannot_take_fails_alone(engine, head):
    options = SpeculativeOptions("greedy", head, draft_length=2)
    good = engine.submit(Request(ids(engine, 0), greedy(8)), decoding=options)
    bad = engine.submit(Request(ids(engine, 0), greedy(8), grammar=object()), decoding=options)
    assert "response_format" in str(list(bad.updates(timeout=60))[-1].error)
    assert list(good.updates(timeout=60))[-1].completion.token_ids == alone(engine, ids(engine, 0), greedy(8))
    with pytest.raises(ValueError):
        SpeculativeOptions("sideways", head)
    with pytest.raises(ValueError):
        SpeculativeOptions("greedy", None)


def test_oracle_drafts_through_the_scheduler_accept(engine):
    """Accepted chains through a job (the random head accepts almost nothing): the oracle's references are
    the requests' own greedy outputs, rows in submission order."""
    requests = [Request(ids(engine, k), greedy(24)) for k in range(3)]
    want = [alone(engine, r.prompt_ids, r.params) for r in requests]
    done = engine.speculate(requests, oracle_factory(want, 0.0, engine.vocab_size), draft_length=3)
    assert [c.token_ids for c in done] == want
    assert all(c.stats["speculative"]["tokens_per_step"] == 4.0 for c in done)  # every draft accepted


def test_a_speculative_batch_compacts_and_grows_its_draft_slots(engine, head):
    """Rows that come and go leave holes in the draft head's shared slots: a batch made with room for very
    few compacts them and grows, and every output stays plain greedy's."""
    from moedesk.engine.speculative.eagle_drafter import draft_head, eagle_factory
    from moedesk.engine.speculative.verification import SpeculativeBatch, Speculator

    spec = Speculator(engine.model, engine.device, engine.dtype, engine.context_length, engine.config.eos_token_ids,
                      engine.tokenizer)
    made = []

    def factory(batch, capacity):
        drafter = eagle_factory(draft_head(engine, head), engine.config.num_layers)(batch, capacity)
        drafter.draft_room = 3 * 2 + 8
        made.append(drafter)
        return drafter

    batch = SpeculativeBatch(spec, factory, "beam", 3, 2, None, None, capacity=24)
    lengths = [30, 6, 20, 10]
    requests = [Request(ids(engine, k), greedy(n)) for k, n in enumerate(lengths)]
    want = [alone(engine, r.prompt_ids, r.params) for r in requests]
    rows = batch.admit(requests[:1], engine.executor)
    for _ in range(3):
        batch.round(engine.executor)
    rows += batch.admit(requests[1:2], engine.executor)
    compactions = 0
    real = type(made[0])._compact

    def counting(self):
        nonlocal compactions
        compactions += 1
        real(self)

    made[0]._compact = counting.__get__(made[0])
    while rows[1].finish_reason is None:
        batch.round(engine.executor)
    batch.release(rows[1])
    rows += batch.admit(requests[2:], engine.executor)  # one in the freed row, one in a new one
    assert [r.index for r in rows] == [0, 1, 1, 2]
    while batch.active():
        batch.round(engine.executor)
    assert [r.tokens for r in rows] == want
    assert compactions >= 1 and made[0].cache.capacity > 24 and made[0].batch == 3


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_jobs_beside_plain_requests_on_cuda(arch, fresh_engine):
    """On the GPU the decode thread replays the plain batch's CUDA graphs, captures the beam search's over its own
    cache and verifies speculative rounds, in turn, with experts in RAM: each still gives what it gives alone."""
    engine = fresh_engine(arch)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    beam_alone = engine.beam_search(prompts[2], beams=4, max_new_tokens=12)
    want = [alone(engine, p, greedy(24)) for p in prompts]
    rec = Recorder()
    plain = [engine.submit(Request(prompts[k], greedy(24)), sink=rec.sink(f"plain{k}")) for k in (2, 3)]
    while rec.names().count("plain2") < 2:
        time.sleep(0.001)
    beam = engine.submit(Request(prompts[2], greedy(12)), decoding=BeamOptions(beams=4), sink=rec.sink("beam"))
    options = SpeculativeOptions("greedy", oracle_factory(want[:2], 0.3, engine.vocab_size), draft_length=3)
    with engine.scheduler.submitting():
        spec = [engine.submit(Request(prompts[k], greedy(24)), decoding=options, sink=rec.sink(f"spec{k}"))
                for k in (0, 1)]
    wait_idle(engine, timeout=120)
    assert all(h.done for h in plain + spec + [beam])
    assert rec.final("beam").completion.token_ids == beam_alone.token_ids
    for k in range(4):
        name = f"spec{k}" if k < 2 else f"plain{k}"
        assert rec.final(name).completion.token_ids == want[k], name
    assert engine._beam.runner.graphs is not None and engine._beam.runner.graphs.broken is None


# --- several searches coming and going --------------------------------------------------------------------------

# (prompt, beams, max_new_tokens, length_penalty, ignore_eos, early_stopping, submitted at the job's step, cancelled
# at the job's step or None): widths 1 to 5, searches that end together (a and b: same length, no EOS, submitted
# together), ones that end on an EOS the model picks often, ones that come while others end or start, one cancelled
# while it steps and one while it still waits for rows (more hypotheses than the 9 rows allow).
SEARCHES = {
    "a": (0, 2, 6, 1.0, True, False, 0, None),
    "b": (1, 3, 6, 1.0, True, False, 0, None),
    "c": (2, 4, 14, 1.0, False, False, 0, None),
    "d": (3, 1, 5, 1.0, False, False, 2, None),
    "e": (0, 3, 30, 1.0, True, False, 3, 7),
    "f": (1, 2, 9, 2.0, False, True, 6, None),
    "g": (4, 5, 7, 0.5, False, "never", 6, None),
    "h": (2, 3, 40, 1.0, True, False, 7, 8),
    "i": (5, 2, 3, 1.0, False, False, 9, None),
    "j": (3, 4, 4, 1.0, True, False, 9, None),
}
MORE_PROMPTS = ["Hi", "Mixture of experts models route every token"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_searches_coming_going_ending_and_cancelled_each_end_as_alone_and_the_thread_exits(arch, device, fresh_engine,
                                                                                           monkeypatch):
    """Beam searches submitted at different steps of a running job, some ending in the same step, some on EOS, some
    cancelled (stepping, or still waiting for rows): every request ends with what its search gives alone, the
    scheduler ends idle with nothing held and the decode thread exits. (On the GPU, experts in RAM, through the
    beam search's CUDA graphs.)"""
    engine = fresh_engine(arch, device)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS + MORE_PROMPTS]
    # Two EOS ids the searches pick (3W continuations a step): the first token d's search gives unconstrained (it
    # ends at once) and the third of c's (so hypotheses end at several steps).
    first = engine.beam_search(prompts[3], beams=1, max_new_tokens=2, ignore_eos=True).token_ids[0]
    later = engine.beam_search(prompts[2], beams=4, max_new_tokens=4, ignore_eos=True).token_ids[2]
    eos = (first, later) if later != first else (first,)
    engine.config = dataclasses.replace(engine.config, eos_token_ids=eos)
    engine.tokenizer.eos_token_ids = frozenset(eos)
    engine.runner.stop_ids = frozenset(eos)

    def request(name):
        p, _, n, _, ignore, *_ = SEARCHES[name]
        return Request(prompts[p], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=ignore), tag=name)

    def options(name):
        _, w, _, lp, _, early, *_ = SEARCHES[name]
        return BeamOptions(beams=w, length_penalty=lp, early_stopping=early)

    want = {name: engine.complete([request(name)], decoding=options(name))[0]
            for name, case in SEARCHES.items() if case[7] is None}
    assert "stop" in {c.finish_reason for c in want.values()}  # some end on the EOS
    search = engine._beam
    search.max_rows = 9
    rec, handles, cancelled_in = Recorder(), {}, {}

    def act(step):
        """Before the job's step `step` (on the decode thread, so the order does not depend on timing)."""
        for name, (*_, at, cancel_at) in SEARCHES.items():
            if at == step:
                handles[name] = engine.submit(request(name), decoding=options(name), sink=rec.sink(name))
            if cancel_at == step:
                handles[name].cancel()  # it leaves at the job's next step

    drop = BeamJob.drop

    def dropping(job, handle):
        held = job.held[handle][0]
        cancelled_in[handle.request.tag] = "active" if held in search.active else \
            "waiting" if held in search.waiting else None
        return drop(job, handle)

    monkeypatch.setattr(BeamJob, "drop", dropping)

    steps = 0
    real_step = search.step

    def step(executor):
        nonlocal steps
        steps += 1
        act(steps)
        return real_step(executor)

    search.step = step
    with engine.scheduler.submitting():
        act(0)
    thread = engine.scheduler._thread
    wait_idle(engine, 120)
    assert thread is not None and not thread.is_alive() and engine.scheduler._thread is None
    assert set(handles) == set(SEARCHES) and all(h.done for h in handles.values())
    assert search.active == [] and search.waiting == []
    assert cancelled_in == {"e": "active", "h": "waiting"}
    for name, (*_, cancel_at) in SEARCHES.items():
        done = rec.final(name).completion
        assert done is not None, (name, rec.final(name).error)
        if cancel_at is not None:
            assert done.finish_reason == "cancelled" and done.token_ids == [], name
            continue
        assert done.token_ids == want[name].token_ids and done.finish_reason == want[name].finish_reason, name
        assert done.stats["beam_steps"] == want[name].stats["beam_steps"], name
        assert done.stats["score"] == pytest.approx(want[name].stats["score"], abs=1e-5), name
    assert sum(1 for n, _ in rec.events if n in SEARCHES) == len(SEARCHES)  # one update each: the last


def test_a_job_requests_caller_returns_once_the_decode_thread_has_stopped(engine, head, monkeypatch):
    """Engine.beam_search / complete / stream return only once the decode thread has ended the step that sent the
    final update and stopped (on the GPU a thread still working beside the caller's next forward, or the next
    engine's, broke graph captures and sdpa's process-wide flags). The thread lingers a while after each final
    update here, so a caller that does not wait for it sees it still running."""
    scheduler = engine.scheduler
    send = scheduler._send

    def slow_send(handle, update):
        send(handle, update)
        if update.final:
            time.sleep(0.2)  # the decode thread has more to do in this step after the caller has its reply

    monkeypatch.setattr(scheduler, "_send", slow_send)
    prompt = ids(engine, 1)
    engine.beam_search(prompt, beams=2, max_new_tokens=3)
    assert scheduler._thread is None or not scheduler._thread.is_alive()
    engine.complete([Request(prompt, greedy(3)), Request(ids(engine, 0), greedy(4))], decoding=BeamOptions(beams=2))
    assert scheduler._thread is None or not scheduler._thread.is_alive()
    list(engine.stream(prompt, greedy(3), decoding=BeamOptions(beams=3)))
    assert scheduler._thread is None or not scheduler._thread.is_alive()
    engine.speculate([Request(prompt, greedy(4))], head, draft_length=2)
    assert scheduler._thread is None or not scheduler._thread.is_alive()


def test_requests_stranded_by_a_failed_decode_thread_are_done_before_the_scheduler_looks_idle(engine, monkeypatch):
    """A bug that escapes a step ends the decode thread and fails every request it held: no one polling the
    scheduler may see it idle (nothing running, no jobs) while one of those requests is not done yet."""
    scheduler = engine.scheduler
    seen = []

    def broken_step(running):
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(scheduler, "_step_job", broken_step)
    handles = []

    def sink(update):
        if update.final:  # the first error delivered: what would a poller see now?
            stats = scheduler.stats()
            idle = not (stats["running"] or stats["waiting"] or stats["running_jobs"] or stats["in_jobs"])
            seen.append((idle, [h.done for h in handles]))

    with scheduler.submitting():
        handles += [engine.submit(Request(ids(engine, k), greedy(4)), decoding=BeamOptions(beams=2), sink=sink)
                    for k in range(3)]
    scheduler.drain(30)
    assert len(seen) == 3 and all(h.done for h in handles)
    assert all(all(done) for idle, done in seen if idle), seen
