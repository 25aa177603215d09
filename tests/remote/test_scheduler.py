"""Requests to a server start together up to their group's limit, the rest as earlier ones end (no server)."""
import threading
import time

from moedesk.engine.generation.scheduler import Group
from moedesk.engine.remote.scheduler import RemoteScheduler
from moedesk.engine.requests import Completion, Request


def test_group_limit_and_order():
    running, most, lock, started = [0], [0], threading.Lock(), []

    def run(handle):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            started.append(handle.request.tag)
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return Completion(handle.request.tag, [1, 2], "ab", "stop", 1)

    scheduler = RemoteScheduler(run)
    group, done = Group(3), []
    with scheduler.submitting():
        for i in range(8):
            scheduler.submit(Request([1], tag=i), group=group, sink=lambda u: done.append(u) if u.final else None)
    scheduler.drain(10)
    assert most[0] == 3  # three at once: the group's limit, and not fewer
    assert started == list(range(8)) and len(done) == 8 and all(u.completion.text == "ab" for u in done)
    assert scheduler.stats()["finished"] == 8 and scheduler.stats()["generated_tokens"] == 16


def test_a_failure_ends_its_request_alone_and_cancel_before_start():
    def run(handle):
        if handle.request.tag == "bad":
            raise RuntimeError("boom")
        return Completion(handle.request.tag, [], "", "stop", 1)

    scheduler = RemoteScheduler(run, max_rows=1)
    updates = {}
    with scheduler.submitting():  # the first runs; the others wait for its row
        for tag in ("bad", "ok", "cancelled"):
            handle = scheduler.submit(Request([1], tag=tag), sink=lambda u, t=tag: updates.__setitem__(t, u))
        handle.cancel()
    scheduler.drain(10)
    assert str(updates["bad"].error) == "boom" and updates["ok"].completion.finish_reason == "stop"
    assert updates["cancelled"].completion.finish_reason == "cancelled"
