"""One thread owns decoding: requests submitted from any thread join the running batch between steps.

The engine's only way to generate. `Engine.generate` (batch runs, calibration), `Engine.stream`
(the chat app) and the HTTP server (app/server.py) all submit `Request`s here; one decode thread
runs engine.generation.decoder.Decoder's steps over whatever is in flight:

- a request takes a free cache row between two steps (continuous batching) and gives it back when
  it finishes or is cancelled (a cancelled one, e.g. a client that disconnected, at the next step);
- each loop runs at most one prefill piece of `prefill_chunk` prompt tokens (spread over the
  newcomers, several prompts in one forward) and then one decode step of every sequence whose
  prompt is in: a long prompt arrives in pieces and the running sequences keep getting tokens
  between them, at the cost of one decode step per piece for the newcomer;
- each request's progress goes to its own sink (a callable; by default a queue to iterate), as
  `Update`s carrying the token and the text so far, the last one its `Completion`;
- a `Group` caps how many of a set of requests run at once (a batch run's --batch-size); requests
  beyond it wait in the queue in arrival order, so one caller can keep the queue stocked and a freed
  row is refilled in the same step, as `Decoder.run` does;
- a request submitted with a `JobKind` (beam search, speculative decoding) does not take a row of the
  plain batch: it runs in a `Job`, which decodes in a cache of its own. Requests of equal `JobKind.key`
  share one job while it has room (speculative requests that arrive together verify in one forward, which
  is where speculation pays), and join it between its steps as they join the plain batch. Each loop
  runs the plain batch's step and then one step of every job, interleaved; see `_loop` for why
  neither waits for the other.

The decode thread lives while there is work and exits when idle: an engine nobody uses holds no
thread, and a thread never keeps a model alive after its engine is dropped. Nor does it outlive the interpreter:
at exit every request still in flight is cancelled and the thread joined after its current step (`_stop_at_exit`).
"""
from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Iterable, Iterator, Protocol

import torch

from moedesk.engine.errors import MoedeskError
from moedesk.engine.hardware import use_device
from moedesk.engine.requests import Completion, Request, StreamChunk
from moedesk.engine.openmp_pool import release_pool

log = logging.getLogger("moedesk")

# Prompt tokens per prefill piece while others decode. With the experts in RAM a piece's time is mostly each
# layer's experts read or copied once, whatever its length, so on a GPU few long pieces stall the running
# sequences less in all than many short ones (docs/measurements.md, "Decoding: graphs, sampling, the scheduler").
# On the CPU a piece's time grows with its tokens: short pieces bound the others' wait.
PREFILL_CHUNK_GPU = 2048
PREFILL_CHUNK_CPU = 512

# How long the interpreter's exit waits for the decode threads to end their steps (_stop_at_exit).
EXIT_JOIN_SECONDS = 10.0
_schedulers: weakref.WeakSet = weakref.WeakSet()  # every scheduler alive, for _stop_at_exit


def default_prefill_chunk(device) -> int:
    """Prompt tokens per prefill piece for an engine on `device` (see PREFILL_CHUNK_GPU)."""
    return PREFILL_CHUNK_GPU if torch.device(device).type == "cuda" else PREFILL_CHUNK_CPU


class QueueFull(MoedeskError):
    """More requests wait than the caller's queue limit allows (the server answers 503)."""


@dataclass(frozen=True)
class Update:
    """One step's news for one request: the token it gained (None when none) and its whole text so far.
    The last update of a request carries its `completion`, or the `error` that ended it."""

    token_id: int | None
    text: str
    completion: Completion | None = None
    error: BaseException | None = None

    @property
    def final(self) -> bool:
        return self.completion is not None or self.error is not None


class Group:
    """Requests that share a concurrency limit: at most `limit` of them hold a cache row at once.

    refill: a waiting request of the group takes a row only once `refill` of the group's rows are free (or as
    many as it has waiting, if fewer), so a batch run's newcomers prefill together in one forward every few
    steps instead of one forward beside nearly every decode step (1, the default: a freed row is taken at once).
    The price: about refill / 2 rows idle, and decode steps over rows that are not 0..n-1 (a gather of their
    cache). It can pay only where a forward's fixed cost (launches, expert reads) dwarfs its tokens'; on the
    demo on a 2-core CPU it did not (tests/generation/bench_generate_host.py measures it)."""

    def __init__(self, limit: int, refill: int = 1):
        if limit < 1:
            raise ValueError(f"a group's limit must be at least 1, got {limit}")
        if refill < 1:
            raise ValueError(f"a group's refill must be at least 1, got {refill}")
        self.limit = limit
        self.refill = refill
        self.active = 0


class Handle:
    """A submitted request: `cancel()` it from any thread; iterate `updates()` when no sink was given."""

    def __init__(self, request: Request, group: Group | None, sink: Callable[[Update], None] | None,
                 cancel: threading.Event | None):
        self.request, self.group = request, group
        self._queue: queue.SimpleQueue | None = None
        if sink is None:
            self._queue = queue.SimpleQueue()
            sink = self._queue.put
        self.sink = sink
        # The caller's event is only read: setting our own never touches it (the chat keeps its event).
        self._caller_cancel = cancel
        self._cancel = threading.Event()
        self.seq = None  # the decoder's Sequence once admitted
        self.kind: JobKind | None = None  # runs in a job of this kind, not in the plain batch
        self.job: _RunningJob | None = None  # the job it was admitted to
        self.admitted = False  # counted in its group's active requests
        self.extra_stats: dict = {}  # merged into its completion's stats (e.g. auto speculation that went plain)
        self.submitted = time.perf_counter()
        self.decode_steps = 0
        self.batch_sum = 0  # sequences in the decode steps this one took part in, summed
        self.done = False

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set() or (self._caller_cancel is not None and self._caller_cancel.is_set())

    def updates(self, timeout: float | None = None) -> Iterator[Update]:
        """Every update until the last (which is yielded too); only for handles submitted without a sink."""
        if self._queue is None:
            raise RuntimeError("this request reports to its own sink")
        while True:
            update = self._queue.get(timeout=timeout)
            yield update
            if update.final:
                return


# (handle, new token or None, its text so far, its completion when this event ends it)
JobEvent = tuple["Handle", "int | None", str, "Completion | None"]


class Job(Protocol):
    """Requests that decode in a cache of their own (a beam search, a batch of speculative requests), stepped
    on the decode thread between the plain batch's steps. Every method runs on the decode thread."""

    plain: list  # handles it gives back to the plain batch (auto speculation predicted not to pay), emptied by the scheduler

    def admit(self, handle: Handle) -> None:
        """Take this request from the next step on; raise (one line) to fail it alone."""

    def step(self) -> Iterable[JobEvent]:
        """One step (about one forward) over the requests it holds, newcomers first brought in; an event whose
        completion is set ends that request. An exception ends every request of the job."""

    def drop(self, handle: Handle) -> Completion:
        """The request was cancelled: forget it and free what it held; its completion so far."""

    def close(self) -> None:
        """It holds no requests any more and will not be stepped again."""


class JobKind(Protocol):
    """How a request submitted with it is decoded: its job's key, capacity and maker."""

    key: Hashable  # requests of equal keys share one job while it has room
    limit: int  # requests one job holds at once; more wait for a place

    def make(self) -> Job:
        """A new job (under the scheduler's lock: quick; heavy setup belongs to the job's first step)."""


class _RunningJob:
    def __init__(self, kind: JobKind):
        self.key, self.limit = kind.key, kind.limit
        self.job = kind.make()
        self.handles: list[Handle] = []  # admitted and not finished
        self.fresh: list[Handle] = []  # admitted since its last step


class Scheduler:
    """Continuous batching over one decoder: see the module docstring.

    make_decoder() gives the engine.generation.decoder.Decoder to run (called for every step, so it sees the engine's
    current executor). max_rows caps the sequences decoding together (None: only the
    groups cap them). cpu_share: an engine.cpu_share.CpuShare that sets the CPU threads before each step (None: they
    stay as they are).
    """

    def __init__(self, make_decoder: Callable[[], object], max_rows: int | None = None,
                 prefill_chunk: int | None = PREFILL_CHUNK_CPU, cpu_share=None):
        self.make_decoder = make_decoder
        self.cpu_share = cpu_share
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self._lock = threading.Condition()
        self._pending: list[Handle] = []
        self._rows: list[Handle | None] = []  # the cache row each running request holds
        self._jobs: list[_RunningJob] = []
        self._thread: threading.Thread | None = None  # the decode thread while it loops; None once it stops
        self._last_thread: threading.Thread | None = None  # the latest one started (maybe still on its way out)
        self.counters = dict(requests=0, finished=0, cancelled=0, failed=0, decode_steps=0, prefill_pieces=0,
                             prefill_tokens=0, generated_tokens=0, batch_sum=0, max_batch=0, jobs=0, job_steps=0,
                             decode_seconds=0.0)  # wall time of the plain batch's decode steps, sinks included
        self._recent_seconds = 0.0  # a running mean of how long finished requests took, for retry hints
        self._exiting = False  # the interpreter is exiting: requests are cancelled, new ones end at once
        _schedulers.add(self)

    # --- any thread -------------------------------------------------------------------------

    def submit(self, request: Request, *, group: Group | None = None, sink: Callable[[Update], None] | None = None,
               cancel: threading.Event | None = None, queue_limit: int | None = None,
               kind: JobKind | None = None) -> Handle:
        """Queue `request`; it joins the running batch at the next step with a free row.

        sink(update) is called on the decode thread: it must be quick and must not raise (hand the update to
        your own thread). cancel: an event that cancels the request when set (its row is freed at the next
        step). queue_limit: raise QueueFull when that many requests already wait for a row. kind: decode it in
        a job of this kind (beam search, speculative decoding) instead of the plain batch.
        """
        handle = Handle(request, group, sink, cancel)
        handle.kind = kind
        if threading.current_thread() is not self._thread:
            release_pool()  # this thread's OpenMP workers would throttle the decode thread's (engine.openmp_pool)
        with self._lock:
            if self._exiting:  # no thread may start now (_stop_at_exit has joined them): it ends here, cancelled
                handle.done = True
                self._send(handle, Update(None, "", completion=Completion(request.tag, [], "", "cancelled",
                                                                          len(request.prompt_ids))))
                return handle
            if queue_limit is not None and self._waiting(group) >= queue_limit:
                raise QueueFull(f"{self._waiting(group)} requests are waiting for a free row (the limit is "
                                f"{queue_limit})")
            self._pending.append(handle)
            self.counters["requests"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="moedesk-decode", daemon=True)
                self._last_thread = self._thread
                self._thread.start()
            self._lock.notify_all()
        return handle

    def submitting(self):
        """`with scheduler.submitting(): submit(...) ...`: the decode thread sees all of those requests or none
        (the lock is re-entrant, so submit takes it again inside)."""
        return self._lock

    def wait_idle(self, timeout: float | None = 30.0) -> None:
        """When no request runs or waits, wait for the decode thread to end its last step and stop. Its final update
        is sent mid-step, so without this the caller could use the GPU while that thread still works (a graph
        capture then sees another thread's random-number use, and fails). With other requests in flight, returns at
        once.

        A job whose requests have all ended still counts as nothing: it is closed later in the very step that sent
        their final updates (counting it as work, a beam search's caller returned while the decode thread still ran
        that step, and it went on beside whatever the caller did next)."""
        with self._lock:
            thread = self._thread or self._last_thread
            busy = (bool(self._pending) or any(h is not None for h in self._rows)
                    or any(j.handles for j in self._jobs))
        if thread is not None and not busy and thread is not threading.current_thread():
            thread.join(timeout)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every request submitted so far (and any submitted meanwhile) has ended and the decode thread
        has stopped; TimeoutError (with the stats) if that takes longer than `timeout` seconds. Idle means no
        decode thread: it loops while anything runs or waits, so one look under the lock sees the whole state
        (reading the counters of `stats` in two calls can miss a request moving from waiting to running)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                thread = self._thread or self._last_thread
            if thread is threading.current_thread():
                raise RuntimeError("the decode thread cannot wait for itself")
            if thread is not None:
                thread.join(max(0.0, min(0.05, deadline - time.monotonic())))
            with self._lock:
                stopped = self._thread is None and (self._last_thread is None or not self._last_thread.is_alive())
                if stopped and not self._pending:  # (a request left waiting with no thread to run it: time out)
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the scheduler did not become idle in {timeout} s: {self.stats()}")

    def when_idle(self, action: Callable[[], None], timeout: float = 30.0) -> bool:
        """Run action() on this thread once every request has ended and the decode thread has stopped (drain),
        holding the lock so that none starts meanwhile: for changing what that thread owns, such as the KV cache.
        The rows are forgotten too, so the next requests reserve cache rows for themselves only, not for the most
        ever held. False (action not run) when other requests keep it busy for `timeout` seconds."""
        try:
            self.drain(timeout)
        except TimeoutError:
            return False
        with self._lock:
            if self._thread is not None or self._pending:  # one came in since drain looked
                return False
            self._rows = []
            action()
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every request in flight and wait until the decode thread has stopped (drain): what a test or a
        front end does before dropping an engine, so that no decode thread outlives it."""
        self._cancel_all()
        self.drain(timeout)

    def _cancel_all(self) -> None:
        """Cancel every request waiting or running: the decode thread ends them at its next step, before any
        forward, and stops."""
        with self._lock:
            for handle in self._pending + [h for h in self._rows if h is not None] + \
                    [h for j in self._jobs for h in j.handles]:
                handle.cancel()

    def stats(self) -> dict:
        """Counters since start, and what runs and waits now."""
        with self._lock:
            in_jobs = sum(len(j.handles) for j in self._jobs)
            running = sum(h is not None for h in self._rows) + in_jobs
            steps = self.counters["decode_steps"]
            return {**self.counters, "running": running, "waiting": self._waiting(), "rows": len(self._rows),
                    "running_jobs": len(self._jobs), "in_jobs": in_jobs,
                    "mean_batch": round(self.counters["batch_sum"] / steps, 3) if steps else None,
                    "decode_seconds": round(self.counters["decode_seconds"], 4),
                    "prefill_chunk": self.prefill_chunk, "max_rows": self.max_rows}

    def retry_after(self) -> int:
        """Seconds a refused client might wait before trying again: about one request's time per row ahead."""
        with self._lock:
            rows = max(1, sum(h is not None for h in self._rows) + sum(len(j.handles) for j in self._jobs))
            waiting = self._waiting()
        return max(1, min(60, round(self._recent_seconds * (waiting + 1) / rows)))

    def _waiting(self, group: Group | None = None) -> int:
        """Requests queued for a row. Those of `group` that its free rows will take at the next step are not
        waiting: counted, `--max-queue 4` with a batch of 2 turned away the fifth request, not the seventh."""
        pending = [h for h in self._pending if not h.cancelled]
        if group is None:
            return len(pending)
        taken = min(max(0, group.limit - group.active), sum(h.group is group for h in pending))
        return len(pending) - taken

    # --- the decode thread ------------------------------------------------------------------

    def _loop(self) -> None:
        # Nothing here is ever differentiated: without this, a draft head's forwards (outside the target's own
        # inference_mode) recorded autograd graphs that the drafter's caches, written in place, kept alive round
        # after round; speculative decoding of 8 HumanEval prompts grew by ~80 MB a second on the CPU and 16
        # MT-bench replies of 256 tokens in beam mode ran out of 24 GB. no_grad, not inference_mode: caches made
        # here are reused by later jobs and tests outside it.
        with torch.no_grad():
            self._steps()

    def _steps(self) -> None:
        # Jobs and the plain batch take turns, a step each, rather than one pausing until the other drains:
        # a chat reply streaming beside a beam search (or a server's other clients) keeps getting tokens, and
        # a beam or speculative request does not wait for a plain batch that, under steady load, never drains.
        # The price: a job's forward does not share expert reads with the plain batch's (they are different
        # caches and shapes), and each side's step time includes the other's.
        device_set = False
        try:
            while True:
                with self._lock:
                    newcomers = self._admit()
                    self._admit_to_jobs()
                    if not newcomers and not any(self._rows) and not self._jobs:
                        self._thread = None  # under the lock: a submit from now on starts a new thread
                        return
                # A decoder per step (a few attribute copies): it always runs the engine's current executor,
                # which placement and tests replace between generations.
                decoder = self.make_decoder()
                if not device_set:
                    use_device(decoder.device)  # a new thread starts on GPU 0 (engine.hardware.thread_gpu)
                device_set = True
                if self.cpu_share is not None:
                    self.cpu_share.follow()
                self._step(decoder, newcomers)
                for running in list(self._jobs):
                    self._step_job(running)
        except BaseException as error:  # noqa: BLE001 -- a bug here must not leave callers waiting forever
            log.exception("moedesk decode thread failed")
            with self._lock:
                stranded = [h for h in self._rows if h is not None] + self._pending
                stranded += [h for j in self._jobs for h in j.handles if not h.done]
                # Every stranded request is done before the lock is let go: whoever looks next sees nothing running
                # only once nothing is (released one by one after clearing, a poller saw an idle scheduler while
                # requests it had submitted were not done).
                for handle in stranded:
                    self._release(handle, "failed")
                self._rows, self._pending, self._jobs, self._thread = [], [], [], None
            for handle in stranded:
                self._send(handle, Update(None, "", error=error))

    def _admit(self) -> list[Handle]:
        """(Under the lock.) Give free rows to waiting requests in arrival order, within their groups' limits."""
        newcomers = []
        ready: dict[int, bool] = {}  # per group with a refill threshold: whether its newcomers come in this step
        for handle in list(self._pending):
            if handle.cancelled:
                self._pending.remove(handle)
                self._finish(handle, Completion(handle.request.tag, [], "", "cancelled",
                                                len(handle.request.prompt_ids)), count="cancelled")
                continue
            if handle.kind is not None:
                continue  # _admit_to_jobs' (the loop's) business
            if handle.group is not None and handle.group.active >= handle.group.limit:
                continue
            if handle.group is not None and handle.group.refill > 1:
                group = handle.group
                if id(group) not in ready:  # decided once a step, before this step's newcomers take rows
                    waiting = sum(h.group is group and h.kind is None and not h.cancelled for h in self._pending)
                    ready[id(group)] = group.limit - group.active >= min(group.refill, waiting, group.limit)
                if not ready[id(group)]:
                    continue
            running = sum(h is not None for h in self._rows)
            if self.max_rows is not None and running >= self.max_rows:
                break
            row = next((r for r, h in enumerate(self._rows) if h is None), len(self._rows))
            if row == len(self._rows):
                self._rows.append(None)
            self._rows[row] = handle
            handle.row = row
            self._count_in_group(handle)
            self._pending.remove(handle)
            newcomers.append(handle)
        return newcomers

    def _admit_to_jobs(self) -> None:
        """(Under the lock.) Waiting job requests in arrival order go to a running job of their key with room, or
        start one; a key's requests beyond its job's room wait (one job per key, so one cache per key)."""
        for handle in list(self._pending):
            if handle.kind is None or handle.cancelled:  # a cancelled one is finished by _admit
                continue
            if handle.group is not None and handle.group.active >= handle.group.limit:
                continue
            running = next((j for j in self._jobs if j.key == handle.kind.key), None)
            if running is None:
                running = _RunningJob(handle.kind)
                self._jobs.append(running)
                self.counters["jobs"] += 1
            elif len(running.handles) >= running.limit:
                continue
            running.handles.append(handle)
            running.fresh.append(handle)
            handle.job = running
            self._count_in_group(handle)
            self._pending.remove(handle)

    @staticmethod
    def _count_in_group(handle: Handle) -> None:
        handle.admitted = True
        if handle.group is not None:
            handle.group.active += 1

    def _step_job(self, running: _RunningJob) -> None:
        """One step of a job: its cancelled requests leave, its newcomers come in, its events go to the sinks.
        An error in the step ends every request of that job with it; the loop and the other jobs go on."""
        job = running.job
        fresh, running.fresh = running.fresh, []
        try:
            for handle in list(running.handles):
                if handle.cancelled and not handle.done:
                    if handle in fresh:
                        fresh.remove(handle)
                        done = Completion(handle.request.tag, [], "", "cancelled", len(handle.request.prompt_ids))
                    else:
                        done = job.drop(handle)
                    self._finish(handle, done, count="cancelled")
            for handle in fresh:
                try:
                    job.admit(handle)
                except Exception as error:  # noqa: BLE001 -- e.g. a prompt longer than its cache: that one only
                    self._fail(handle, error)
            if running.handles:
                events = job.step()
                self.counters["job_steps"] += 1
                for handle, token, text, completion in events:
                    if token is not None:
                        self.counters["generated_tokens"] += 1
                    if completion is not None:
                        self._finish(handle, completion, token)
                    else:
                        self._send(handle, Update(token, text))
            if job.plain:
                self._to_plain(running, job.plain)
        except Exception as error:  # noqa: BLE001 -- the error goes to the job's requests; the loop goes on
            log.warning("a job's step failed for %d requests: %s", len(running.handles), error)
            for handle in list(running.handles):
                if not handle.done:
                    self._fail(handle, error)
        if not running.handles:
            with self._lock:
                self._jobs.remove(running)
            try:
                job.close()
            except Exception:  # noqa: BLE001 -- giving back a cache must not stop the decode thread
                log.exception("closing a job failed")

    def _to_plain(self, running: _RunningJob, handles: list) -> None:
        """Requests a job gives back: they wait again, in arrival order, for rows of the plain batch."""
        moved = list(handles)
        handles.clear()
        with self._lock:
            for handle in moved:
                if handle in running.handles:
                    running.handles.remove(handle)
                handle.kind, handle.job, handle.admitted = None, None, False
                if handle.group is not None:
                    handle.group.active -= 1
                self._pending.append(handle)
            self._pending.sort(key=lambda h: h.submitted)

    def _step(self, decoder, newcomers: list[Handle]) -> None:
        for handle in list(newcomers):
            try:
                handle.seq = decoder.start(handle.request, handle.row)
            except Exception as error:  # noqa: BLE001 -- e.g. a grammar its library refuses: that request only
                newcomers.remove(handle)
                self._fail(handle, error)
        if newcomers:
            try:
                decoder.reserve(len(self._rows), [h.seq for h in newcomers])
            except Exception as error:  # noqa: BLE001 -- no room for their cache: these requests fail, others go on
                for handle in newcomers:
                    self._fail(handle, error)
        running = [h for h in self._rows if h is not None]
        for handle in running:
            if handle.cancelled and not handle.done:
                handle.seq.finish_reason = "cancelled"
                self._finish(handle, self._completion(decoder, handle), count="cancelled")
        # Prompts go in in arrival order (a newcomer in a freed low row does not jump the queue).
        filling = sorted((h for h in self._rows if h is not None and h.seq.prefilled < len(h.request.prompt_ids)),
                         key=lambda h: h.submitted)
        if filling:
            pieces_before = {id(h): h.seq.prefilled for h in filling}
            if self._run(lambda: decoder.prefill([h.seq for h in filling], self.prefill_chunk), filling, decoder):
                taken = sum(h.seq.prefilled - pieces_before[id(h)] for h in filling)
                self.counters["prefill_pieces"] += 1
                self.counters["prefill_tokens"] += taken
        decoding = [h for h in self._rows if h is not None and h.seq.tokens and not h.seq.finish_reason]
        if decoding:
            batch = len(decoding)
            for handle in decoding:
                handle.decode_steps += 1
                handle.batch_sum += batch
            started = time.perf_counter()
            if self._run(lambda: decoder.decode([h.seq for h in decoding]), decoding, decoder):
                self.counters["decode_seconds"] += time.perf_counter() - started
                self.counters["decode_steps"] += 1
                self.counters["batch_sum"] += batch
                self.counters["max_batch"] = max(self.counters["max_batch"], batch)

    def _run(self, events: Callable[[], Iterator], handles: list[Handle], decoder=None) -> bool:
        """Run one step's events to the requests' sinks; on an error, end every request of the step with it."""
        by_seq = {id(h.seq): h for h in handles}
        try:
            for seq, token in events():
                handle = by_seq[id(seq)]
                if token is not None:
                    self.counters["generated_tokens"] += 1
                if seq.finish_reason:
                    self._finish(handle, self._completion(decoder, handle), token)
                else:
                    self._send(handle, Update(token, seq.text))
            return True
        except Exception as error:  # noqa: BLE001 -- the error goes to the requests it hit; the loop goes on
            log.warning("a step failed for %d requests: %s", len(handles), error)
            for handle in handles:
                if not handle.done:
                    self._fail(handle, error)
            return False

    def _completion(self, decoder, handle: Handle) -> Completion:
        done = decoder.completion(handle.seq)
        steps = handle.decode_steps
        # Steps are shared: how many sequences decoded together, on average, in the steps this one took.
        done.stats.update(decode_steps=steps, mean_batch=round(handle.batch_sum / steps, 3) if steps else None)
        done.stats.update(handle.extra_stats)
        return done

    def _finish(self, handle: Handle, completion: Completion, token: int | None = None, count: str = "finished") -> None:
        self._release(handle, count)
        elapsed = time.perf_counter() - handle.submitted
        self._recent_seconds = elapsed if not self._recent_seconds else 0.8 * self._recent_seconds + 0.2 * elapsed
        self._send(handle, Update(token, completion.text, completion=completion))

    def _fail(self, handle: Handle, error: BaseException) -> None:
        self._release(handle, "failed")
        self._send(handle, Update(None, "", error=error))

    def _release(self, handle: Handle, count: str) -> None:
        handle.done = True
        with self._lock:
            self.counters[count] += 1
            row = getattr(handle, "row", None)
            if row is not None and row < len(self._rows) and self._rows[row] is handle:
                self._rows[row] = None
            if handle.job is not None and handle in handle.job.handles:
                handle.job.handles.remove(handle)
            if handle.admitted:
                handle.admitted = False
                if handle.group is not None:
                    handle.group.active -= 1

    @staticmethod
    def _send(handle: Handle, update: Update) -> None:
        try:
            handle.sink(update)
        except Exception:  # noqa: BLE001 -- a consumer's bug must not stop everyone else's decoding
            log.exception("a request's sink failed; cancelling it")
            handle.cancel()


def _stop_at_exit() -> None:
    """Cancel what every live scheduler holds and join its decode thread, EXIT_JOIN_SECONDS for all of them.

    The thread is a daemon, so nobody waits for it; left inside a step (a long prefill, a CUDA step) as the
    interpreter finalises, it is stopped when it takes the GIL back inside torch's C++ and the process aborts
    ("terminate called without an active exception", exit 134 instead of its own status). Cancelled, it ends the
    requests before any further forward and stops. One line on stderr if a step outlasts the wait."""
    deadline = time.monotonic() + EXIT_JOIN_SECONDS
    schedulers = list(_schedulers)
    for scheduler in schedulers:
        with scheduler._lock:
            scheduler._exiting = True
        scheduler._cancel_all()
    threads = [s._last_thread for s in schedulers if s._last_thread not in (None, threading.current_thread())]
    try:
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
        pass
    if any(thread.is_alive() for thread in threads):
        print(f"moedesk: a decode step was still running {EXIT_JOIN_SECONDS:g} s after exit began; exiting "
              f"without waiting for it", file=sys.stderr, flush=True)


def _at_thread_shutdown() -> None:
    # Called before the interpreter joins its non-daemon threads, which may still be waiting for replies: too early
    # to cancel. An atexit function registered now runs right after they are joined and before every other atexit
    # function (they run last registered first), while whatever a step uses (compile workers, CUDA) is still up; one
    # registered when this module is imported would run after those that torch and Triton register later.
    atexit.register(_stop_at_exit)


try:
    threading._register_atexit(_at_thread_shutdown)  # CPython's own hook, the one concurrent.futures uses
except AttributeError:  # an interpreter without it: atexit alone
    atexit.register(_stop_at_exit)


class TextDeltas:
    """Turns a request's updates into the pieces of text a stream shows: never a partial character, never
    what might turn out to be the start of a stop string (held back until the next token settles it)."""

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = stops
        self.shown = ""

    def chunk(self, update: Update) -> StreamChunk:
        new_ids = [] if update.token_id is None else [update.token_id]
        safe = _safe_prefix(update.text, self.stops)
        if not safe.startswith(self.shown):
            return StreamChunk("", new_ids)
        delta, self.shown = safe[len(self.shown):], safe
        return StreamChunk(delta, new_ids)

    def last(self, completion: Completion, token_id: int | None = None) -> StreamChunk:
        text = completion.text
        # The whole decode may have rewritten bytes already shown (ByteFallback: one U+FFFD for each, as
        # engine.load.tokenizer.StreamDecoder says): they stay as shown, and what lies past them is still new.
        rest = text[len(self.shown):]
        self.shown = text
        return StreamChunk(rest, [] if token_id is None else [token_id], completion)


def _safe_prefix(text: str, stops: tuple[str, ...]) -> str:
    """text without a half-decoded character at its end (U+FFFD) nor, stop by stop, the longest tail that may
    still grow into that stop."""
    end = len(text.rstrip("\ufffd"))
    for stop in stops:
        end -= _held_back(text, end, stop)
    return text[:end]


def _held_back(text: str, end: int, stop: str) -> int:
    """The longest k < len(stop) with text[end - k:end] == stop[:k]. Only where stop's first character occurs
    can such a tail start: a stream checks every stop for every token, so the text is never copied and a long
    stop costs no more than the places its first character appears in the last len(stop) - 1 characters."""
    if not stop:
        return 0
    pos = text.find(stop[0], max(0, end - len(stop) + 1), end)
    while pos != -1:  # earliest first: the longest tail
        if stop.startswith(text[pos:end]):
            return end - pos
        pos = text.find(stop[0], pos + 1, end)
    return 0


def cancelled_after(completion: Completion, token_ids: list[int], text: str) -> Completion:
    """The completion of a request its caller cancelled after seeing `token_ids`: what it saw, no more."""
    return replace(completion, token_ids=list(token_ids), text=text, finish_reason="cancelled")
