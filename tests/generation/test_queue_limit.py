"""A queue limit counts the requests that wait for a row, not those the next step admits (issue 46, item 17)."""
import pytest

from moedesk.engine.generation.scheduler import Group, QueueFull
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine


def test_a_batch_of_two_and_a_queue_of_four_take_six(tiny_checkpoint):
    engine = Engine.load(str(tiny_checkpoint("llama")), device="cpu", dtype="float32")
    group, handles = Group(2), []
    request = Request([3, 4, 5], SamplingParams(max_new_tokens=2, temperature=0))
    try:
        with engine.scheduler.submitting():  # the decode thread admits none of them meanwhile
            for _ in range(6):
                handles.append(engine.scheduler.submit(request, group=group, queue_limit=4))
            with pytest.raises(QueueFull, match="4 requests are waiting"):
                engine.scheduler.submit(request, group=group, queue_limit=4)
    finally:
        for handle in handles:
            handle.cancel()
        engine.scheduler.wait_idle()
