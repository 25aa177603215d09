"""Calibration counts expert popularity through the function it is handed (engine.offload.calibration), not
through an engine: the even-numbered prompts, then the odd-numbered ones, each half's counts as route gave them."""
from __future__ import annotations

import pytest
import torch

from moedesk.engine.offload import calibration


class Tokenizer:
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [len(text), text.count(" ")]


def test_popularity_is_two_halves_of_what_route_counted():
    prompts = [Tokenizer().encode(p) for p in calibration.calibration_prompts()]
    routed = []

    def route(requests):
        routed.append([r.prompt_ids for r in requests])
        n = len(routed)
        return {1: torch.tensor([n, 0, 2]), 0: torch.tensor([n, 1, 1])}  # by layer, in any order

    halves = calibration.measure_popularity(Tokenizer(), route, new_tokens=5)
    assert routed == [prompts[0::2], prompts[1::2]]
    assert halves == [[[1, 1, 1], [1, 0, 2]], [[2, 1, 1], [2, 0, 2]]]


def test_popularity_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        calibration.measure_popularity(None, lambda requests: {})


def test_a_cached_file_that_does_not_fit_the_model_is_measured_again(tmp_path):
    calls = []

    def route(requests):
        calls.append(len(requests))
        return {0: torch.tensor([1, 2])}

    first = calibration.cached_popularity(tmp_path, "k", Tokenizer(), route, [2])
    assert first == [[[1, 2]], [[1, 2]]] and len(calls) == 2
    assert calibration.cached_popularity(tmp_path, "k", Tokenizer(), route, [2]) == first and len(calls) == 2
    calibration.cached_popularity(tmp_path, "k", Tokenizer(), route, [3])  # another model's expert count
    assert len(calls) == 4
