"""Requests to a remote server, each on a thread of its own: the face of engine.generation.scheduler.Scheduler.

The server batches what arrives together, so this side only has to send requests at once: every request whose
`Group` has room runs now (a batch run's --batch-size, serve's batch), the others wait in arrival order and
start as earlier ones end. `run(handle)` (the engine's) streams one request and returns its Completion; it is
called on the request's thread and reports progress through `handle.sink`.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from moedesk.engine.generation.scheduler import Group, Handle, QueueFull, Update
from moedesk.engine.requests import Completion, Request

MAX_IN_FLIGHT = 64  # requests sent at once when no group caps them: the server queues the rest anyway


class RemoteScheduler:
    def __init__(self, run: Callable[[Handle], Completion], max_rows: int = MAX_IN_FLIGHT):
        self.run = run
        self.max_rows = max_rows
        self.prefill_chunk = None  # the server's business: kept so front ends that set it do no harm
        self._lock = threading.Condition(threading.RLock())
        self._pending: list[Handle] = []
        self._running: set[Handle] = set()
        self._closed = False
        self.counters = dict(requests=0, finished=0, cancelled=0, failed=0, generated_tokens=0)
        self._recent_seconds = 0.0

    def submit(self, request: Request, *, group: Group | None = None, sink=None, cancel=None,
               queue_limit: int | None = None, kind=None) -> Handle:
        if kind is not None:
            raise ValueError("a remote engine decodes plainly: no beam search nor speculation job")
        handle = Handle(request, group, sink, cancel)
        with self._lock:
            if queue_limit is not None and len(self._pending) >= queue_limit:
                raise QueueFull(f"{len(self._pending)} requests are waiting (the limit is {queue_limit})")
            self.counters["requests"] += 1
            self._pending.append(handle)
            self._start_what_fits()
        return handle

    def submitting(self):
        """As Scheduler.submitting: requests submitted inside start together."""
        return self._lock

    def _start_what_fits(self) -> None:
        with self._lock:
            for handle in list(self._pending):
                if handle.cancelled:
                    self._pending.remove(handle)
                    self._end(handle, Update(None, "", completion=Completion(
                        handle.request.tag, [], "", "cancelled", len(handle.request.prompt_ids))), "cancelled")
                    continue
                group = handle.group
                if len(self._running) >= self.max_rows or (group is not None and group.active >= group.limit):
                    continue
                self._pending.remove(handle)
                self._running.add(handle)
                if group is not None:
                    group.active += 1
                    handle.admitted = True
                threading.Thread(target=self._work, args=(handle,), name="moedesk-remote", daemon=True).start()

    def _work(self, handle: Handle) -> None:
        try:
            completion = self.run(handle)
        except BaseException as error:  # noqa: BLE001 -- it ends this request, reported to its caller
            update, count = Update(None, "", error=error), "failed"
        else:
            update = Update(None, completion.text, completion=completion)
            count = "cancelled" if completion.finish_reason == "cancelled" else "finished"
            self.counters["generated_tokens"] += len(completion.token_ids)
            self._recent_seconds = 0.8 * self._recent_seconds + 0.2 * (time.perf_counter() - handle.submitted)
        with self._lock:
            self._running.discard(handle)
            if handle.admitted:
                handle.group.active -= 1
            self._end(handle, update, count)
            self._start_what_fits()
            self._lock.notify_all()

    def _end(self, handle: Handle, update: Update, count: str) -> None:
        handle.done = True
        self.counters[count] += 1
        handle.sink(update)

    def wait_idle(self, timeout: float | None = 30.0) -> None:
        """Nothing to wait for: a request's thread has no work left once its last update is sent."""

    def drain(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"remote requests still running after {timeout} s: {self.stats()}")
                self._lock.wait(min(left, 0.1))
                self._start_what_fits()

    def when_idle(self, action: Callable[[], None], timeout: float = 30.0) -> bool:
        try:
            self.drain(timeout)
        except TimeoutError:
            return False
        with self._lock:
            action()
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every request: each thread stops at the server's next event and closes its connection."""
        with self._lock:
            for handle in self._pending + list(self._running):
                handle.cancel()
            self._start_what_fits()
        try:
            self.drain(timeout)
        except TimeoutError:
            pass  # a server that sends nothing: its threads are daemons, and end with their read timeout

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "running": len(self._running), "waiting": len(self._pending),
                    "max_rows": self.max_rows, "prefill_chunk": None}

    def retry_after(self) -> int:
        with self._lock:
            rows = max(1, len(self._running))
            waiting = len(self._pending)
        return max(1, min(60, round(self._recent_seconds * (waiting + 1) / rows)))
