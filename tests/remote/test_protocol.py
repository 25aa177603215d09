"""The remote engine's wire format, decision by decision, without a server."""
import json

import pytest

from moedesk.engine.errors import EngineUnavailable, MoedeskError
from moedesk.engine.remote import protocol
from moedesk.engine.remote.protocol import RemoteError, RemoteUnavailable
from moedesk.engine.requests import Request, SamplingParams


@pytest.mark.parametrize("typed, root", [("gpu-box:8000", "http://gpu-box:8000/v1"),
                                         ("http://gpu-box:8000/", "http://gpu-box:8000/v1"),
                                         ("https://api.example.com/v1/", "https://api.example.com/v1")])
def test_base_url(typed, root):
    assert protocol.base_url(typed) == root


@pytest.mark.parametrize("typed", ["", "  ", "ftp://host/"])
def test_base_url_refuses_in_one_line(typed):
    with pytest.raises(MoedeskError) as refused:
        protocol.base_url(typed)
    assert "\n" not in str(refused.value)


def test_body_maps_sampling_and_sends_token_ids():
    params = SamplingParams(max_new_tokens=12, temperature=0.5, top_p=0.9, top_k=40, seed=7, stop=("\n\n", "END"),
                            ignore_eos=True)
    body = protocol.completion_body("m", Request([1, 2, 3], params), {"type": "json_object"})
    assert body["prompt"] == [1, 2, 3] and body["model"] == "m" and body["stream"] is True
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (12, 0.5, 0.9, 40, 7)
    assert body["stop"] == ["\n\n", "END"] and body["ignore_eos"] is True
    assert body["response_format"] == {"type": "json_object"}
    plain = protocol.completion_body("m", Request([1], SamplingParams(temperature=0)))
    assert not {"top_k", "stop", "ignore_eos", "response_format"} & set(plain)  # sent only when they matter


def _line(payload) -> str:
    return "data: " + json.dumps(payload)


def test_events_of_each_server():
    # vLLM with return_token_ids: this event's ids beside its text
    event = protocol.parse_event(_line({"choices": [{"text": "Hi", "finish_reason": None, "token_ids": [5, 6]}]}))
    assert (event.text, event.token_ids, event.all_ids, event.finish_reason) == ("Hi", [5, 6], False, None)
    # moedesk serve: the whole reply's ids on the last event
    event = protocol.parse_event(_line({"choices": [{"text": "", "finish_reason": "length"}],
                                        "moedesk": {"token_ids": [5, 6, 7]}}))
    assert (event.token_ids, event.all_ids, event.finish_reason) == ([5, 6, 7], True, "length")
    # the usage event of stream_options.include_usage
    assert protocol.parse_event(_line({"choices": [], "usage": {"prompt_tokens": 9}})).prompt_tokens == 9
    assert protocol.parse_event("data: [DONE]").done
    assert protocol.parse_event(": keep-alive") is None and protocol.parse_event("") is None


def test_error_event_and_garbage_are_one_line_errors():
    with pytest.raises(RemoteError, match="engine failed"):
        protocol.parse_event(_line({"error": {"message": "The engine failed\nthis request"}}))
    with pytest.raises(RemoteError, match="not JSON"):
        protocol.parse_event("data: {oops")


def test_status_errors():
    key = protocol.status_error(401, json.dumps({"error": {"message": "Incorrect API key"}}), "http://h/v1")
    assert isinstance(key, EngineUnavailable) and "API key" in str(key) and "401" in str(key)
    gone = protocol.status_error(503, "<html>Bad gateway</html>", "http://h/v1")
    assert isinstance(gone, RemoteUnavailable)
    bad = protocol.status_error(400, json.dumps({"error": {"message": "prompt too long"}}), "http://h/v1")
    assert not isinstance(bad, EngineUnavailable) and str(bad) == "the server at http://h/v1 answered 400: prompt too long"


def test_pick_model_and_context():
    assert protocol.pick_model([{"id": "a"}, {"id": "demo"}], "demo") == ("demo", None)
    assert protocol.pick_model([{"id": "Qwen/Qwen3-30B-A3B"}], "/models/qwen3") == ("Qwen/Qwen3-30B-A3B", None)
    chosen, warning = protocol.pick_model([{"id": "a"}, {"id": "b"}], "c")
    assert chosen == "a" and "2 models" in warning
    with pytest.raises(MoedeskError):
        protocol.pick_model([], "c")
    assert protocol.served_context({"max_model_len": 32768}) == 32768
    assert protocol.served_context({"context_length": 4096}) == 4096
    assert protocol.served_context({"id": "x"}) is None
    assert protocol.finish_reason("length") == "length" and protocol.finish_reason("eos") == "stop"
