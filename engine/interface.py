"""What front ends may call on an engine, and the half both engines share: requests through one scheduler.

engine.runtime.Engine (the native engine, and `Engine.load`, which picks the engine) and
engine.llamacpp.engine.LlamaCppEngine both derive from `EngineFace`. Each gives `scheduler` (an
engine.generation.scheduler.Scheduler over its own decoder), `tokenizer`, `config`, `context_length`, `name`,
`device`, `warnings`, `cache` (its `bytes_per_position()` and `ensure(rows, length)`), `_kind(decoding, limit)`
(the scheduler's JobKind for a decoding option, or a one-line refusal), `description`, `expert_map()`,
`expert_stats()`, `grammar(response_format)`, `generation_defaults` (the model's own sampling defaults), `beam_search`,
`speculate`, `load_draft` and `release_cache`.
`kind` says which engine it is and `why` why it was chosen, in one line; front ends show them and never test them.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator

from moedesk.engine.requests import NOT_YET, Completion, Request, SamplingParams, StreamChunk
# What front ends use with `submit`, beside the request types: a Group of requests decoding at most N at once, the
# Handle and the Updates a sink receives, QueueFull when the queue is, and TextDeltas (stop strings held back).
from moedesk.engine.generation.scheduler import Group, Handle, QueueFull, TextDeltas, Update, cancelled_after

__all__ = ["EngineFace", "Group", "Handle", "QueueFull", "TextDeltas", "Update", "DEFAULT_CONTEXT"]

DEFAULT_CONTEXT = 4096  # per sequence; the model may allow more, but the KV cache grows with it
IDLE_POLL_S = 0.05  # while a request source has nothing to read: how long generate waits on running requests


class EngineFace:
    kind = "native"  # "native" | "llama.cpp"
    why = ""  # one line: why this engine runs the model

    def submit(self, request: Request, *, decoding=None, **options) -> Handle:
        """Queue one request on the scheduler (options: see engine.generation.scheduler.Scheduler.submit).

        decoding: None (plain: sampling or greedy as its params say), a BeamOptions (beam search: nothing
        streams before the best hypothesis is whole) or an engine.speculative.options.SpeculativeOptions
        (speculative decoding: accepted drafts stream as tokens). Beam and speculative requests run as jobs of
        the same decode thread, between the plain batch's steps, and cancel as plain ones do."""
        group = options.get("group")
        return self.scheduler.submit(request, kind=self._kind(decoding, group.limit if group else None), **options)

    def queue_stats(self) -> dict:
        """The scheduler's counters since start, and what runs and waits now."""
        return self.scheduler.stats()

    def retry_after(self) -> int:
        """Seconds a client refused with QueueFull might wait before trying again."""
        return self.scheduler.retry_after()

    def generate(self, requests: Iterable[Request], batch_size: int = 8, decoding=None,
                 refill: int = 1) -> Iterator[Completion]:
        """Complete every request, at most `batch_size` at once; yield each as soon as it finishes (not in input
        order). Requests are pulled from `requests` on the caller's thread as earlier ones finish.
        refill: freed rows are taken by waiting requests only once that many are free (scheduler.Group), so
        newcomers prefill together; 1 (the default) takes a freed row at once.

        decoding: as `submit` takes it, for every request; or a callable giving each request's (None: plain).
        Speculative requests fill their job's rows as plain ones fill the batch's, so `batch_size` of them
        verify together."""
        group = Group(batch_size, refill=max(1, min(refill, batch_size)))
        choose = decoding if callable(decoding) else (lambda request: decoding)
        finished: queue.SimpleQueue = queue.SimpleQueue()
        source = iter(requests)
        in_flight: dict[int, Handle] = {}
        exhausted, number = False, 0
        try:
            while True:
                # A batch's worth waits beyond the running ones, so a freed row takes the next request in the
                # same step instead of after a round trip through this thread.
                fresh, idle = [], False
                while not exhausted and len(in_flight) + len(fresh) < 2 * batch_size:
                    request = next(source, None)
                    if request is None:
                        exhausted = True
                        break
                    if request is NOT_YET:  # nothing to read now: answer what runs, then ask again
                        idle = True
                        break
                    fresh.append(request)
                # Submitted together, so the decode thread admits them in one step: which requests share a step
                # (and so the stats) does not depend on how fast this thread pulls them from `requests`.
                with self.scheduler.submitting():
                    for request in fresh:
                        number += 1
                        in_flight[number] = self.submit(
                            request, decoding=choose(request), group=group,
                            sink=lambda u, n=number: finished.put((n, u)) if u.final else None)
                if not in_flight:
                    if not exhausted:
                        continue  # the source waits a moment itself before it says NOT_YET again
                    self.scheduler.wait_idle()
                    return
                try:
                    n, update = finished.get(timeout=IDLE_POLL_S if idle else None)
                except queue.Empty:
                    continue
                del in_flight[n]
                if update.error is not None:
                    raise update.error
                yield update.completion
        finally:
            for handle in in_flight.values():  # the caller stopped early (or failed): free their rows
                handle.cancel()

    def complete(self, requests: list[Request], decoding=None) -> list[Completion]:
        """Complete `requests`, all submitted at once (so a speculative job takes them together and verifies them
        as one batch), in input order. The first request's error is raised once all have ended."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        handles = []
        try:
            with self.scheduler.submitting():
                group = Group(max(1, len(requests)))
                for i, request in enumerate(requests):
                    handles.append(self.submit(request, decoding=decoding, group=group,
                                               sink=lambda u, i=i: done.put((i, u)) if u.final else None))
            results: dict[int, Update] = {}
            while len(results) < len(handles):
                i, update = done.get()
                results[i] = update
        finally:
            for handle in handles:
                handle.cancel()  # no-op once finished; the caller interrupted: free their rows
        self.scheduler.wait_idle()
        for i in range(len(handles)):
            if results[i].error is not None:
                raise results[i].error
        return [results[i].completion for i in range(len(handles))]

    def stream(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
               cancel: threading.Event | None = None, grammar=None, decoding=None) -> Iterator[StreamChunk]:
        """Yield text as it is generated; the last chunk carries the Completion. `cancel` stops early: set
        between two chunks, the reply ends with the tokens already yielded. decoding: as `submit` takes it
        (beam search yields its whole text in the last chunk)."""
        updates: queue.SimpleQueue = queue.SimpleQueue()
        handle = self.submit(Request(list(prompt_ids), params, grammar=grammar), decoding=decoding, sink=updates.put,
                             cancel=cancel)
        deltas = TextDeltas(params.stop)
        seen: list[int] = []
        try:
            while True:
                update = updates.get()
                if update.error is not None:
                    raise update.error
                if update.completion is not None:
                    self.scheduler.wait_idle()
                    yield deltas.last(update.completion, update.token_id)
                    return
                chunk = deltas.chunk(update)
                seen += chunk.token_ids
                yield chunk
                if cancel is not None and cancel.is_set():
                    # The decode thread may have gone on meanwhile: the reply is what the caller saw.
                    handle.cancel()
                    while not update.final:
                        update = updates.get()
                    if update.error is not None:
                        raise update.error
                    text = self.tokenizer.decode(seen) if self.tokenizer is not None else ""
                    yield deltas.last(cancelled_after(update.completion, seen, text))
                    return
        finally:
            handle.cancel()  # a caller that stops iterating frees the row at the next step
