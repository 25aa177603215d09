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


def test_the_last_chunk_brings_what_lies_past_text_the_whole_decode_rewrote():
    """Streamed "NO", then bytes that make decode() rewrite "NO" as U+FFFD: the end still brings the new tail."""
    from moedesk.engine.generation.scheduler import TextDeltas, Update
    from moedesk.engine.requests import Completion

    deltas = TextDeltas()
    assert [deltas.chunk(Update(i, t)).text for i, t in [(1, "N"), (2, "NO"), (3, "NO\ufffd")]] == ["N", "O", ""]
    done = Completion(tag=None, token_ids=[1, 2, 3, 4], text="\ufffd\ufffd\ufffdt12\ufffd", finish_reason="length",
                      prompt_tokens=1)
    assert deltas.last(done).text == "\ufffdt12\ufffd"
