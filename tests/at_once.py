"""Calls made at the same moment from threads, as concurrent clients make them."""
from __future__ import annotations

import threading


def at_once(call, items: list, timeout: float) -> list:
    """[call(item) for item in items], each in a thread of its own, all released together; the first error any
    call raised is raised here once every thread ended (or `timeout` seconds passed for each)."""
    start = threading.Barrier(len(items))
    results, errors = [None] * len(items), []

    def one(k):
        try:
            start.wait()
            results[k] = call(items[k])
        except BaseException as e:  # noqa: BLE001 -- raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"calls still running after {timeout} s"
    return results
