"""engine.graph_capture: where a capture runs when its caller names no stream."""
from __future__ import annotations

import contextlib

import torch

from moedesk.engine import graph_capture


def test_a_capture_without_a_stream_runs_on_a_side_stream_of_the_current_gpu(monkeypatch):
    """torch.cuda.graph's own default stream lives on whichever GPU captured first; a capture for another GPU there
    records nothing of its kernels (seen on the two-GPU box). Each GPU gets its own side stream, made once."""
    current, made, captured = [0], [], []

    class Stream:
        def __init__(self, index):
            made.append(index)
            self.index = index

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode=None):
        captured.append(stream.index)
        yield

    monkeypatch.setattr(graph_capture, "_side_streams", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    for index in (0, 1, 1, 0):
        current[0] = index
        with graph_capture.capturing(object()):
            pass
    assert captured == [0, 1, 1, 0] and made == [0, 1]
    named = Stream(7)
    with graph_capture.capturing(object(), stream=named):
        pass
    assert captured[-1] == 7  # a stream the caller names is the one captured on
