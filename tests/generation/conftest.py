"""Fixtures of the generation tests."""
import threading

import pytest


@pytest.fixture(autouse=True)
def no_decode_thread_outlives_its_test():
    """Every test leaves no decode thread running (one that went on stepping into the next test broke it on the
    GPU): whatever a test started has stopped, or stops within the join's time, when it ends."""
    yield
    for thread in threading.enumerate():
        if thread.name == "moedesk-decode":
            thread.join(30)
            assert not thread.is_alive(), "a decode thread outlived its test"
