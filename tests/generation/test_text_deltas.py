"""A stream's text holds back what may still become a stop string (engine.generation.scheduler.TextDeltas)."""
import random

from moedesk.engine.generation.scheduler import _safe_prefix


def _reference(text: str, stops) -> str:
    """The definition, slowly: stop by stop, drop the longest tail of what is left that a stop starts with."""
    end = len(text.rstrip("\ufffd"))
    for stop in stops:
        end -= max((k for k in range(1, min(len(stop) - 1, end) + 1) if text[end - k:end] == stop[:k]), default=0)
    return text[:end]


def test_safe_prefix_holds_back_the_longest_start_of_each_stop():
    assert _safe_prefix("Hello wor", ("world",)) == "Hello "
    assert _safe_prefix("abab", ("abac",)) == "ab"  # "ab" could become "abac"; "abab" could not
    assert _safe_prefix("x\ufffd", ("y",)) == "x"  # half a character waits too
    assert _safe_prefix("end.", ("</s>", ".\n")) == "end"  # each stop in turn
    assert _safe_prefix("done", ()) == "done"


def test_safe_prefix_is_the_definition_on_random_text():
    rng = random.Random(0)
    for _ in range(3000):  # a two-letter alphabet: stops start over and over in the text
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3)))
        assert _safe_prefix(text, stops) == _reference(text, stops), (text, stops)
