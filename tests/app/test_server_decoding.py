"""`moedesk serve` with speculative decoding (the server's flags) and the per-request `moedesk` extension
(speculative, beams, length_penalty), through the official openai client against a real uvicorn server.

At temperature 0 every reply equals plain greedy decoding's (speculation is lossless) or Engine.beam_search's;
usage and the `moedesk` stats count the drafts the model accepted; bad extension values are 400 error objects.
"""
import json

import httpx
import openai
import pytest

from moedesk.app.server import Speculation
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.app.serve_process import serve_process
from tests.app.test_server import ARCH, KEY, running_server
from tests.at_once import at_once
from tests.speculative.test_speculative_decode import random_head

MESSAGES = [{"role": "user", "content": "Hello, fox!"}]
COMMON = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.load(str(tiny_checkpoint(ARCH)), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def head(engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("head")
    random_head(engine, 1, folder)
    return folder


@pytest.fixture(scope="module")
def spec_url(engine, head):
    """A server started as `--speculative greedy --draft HEAD --draft-length 3 --draft-width 2` would be."""
    with running_server(engine, api_key=KEY, batch_size=8, model_name="tiny",
                        speculation=Speculation("greedy", str(head), 3, 2)) as base:
        yield base


@pytest.fixture(scope="module")
def plain_url(engine):
    with running_server(engine, api_key=KEY, batch_size=8, model_name="tiny") as base:
        yield base


def client_of(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def greedy_reference(engine, messages=MESSAGES, n=16):
    ids = engine.tokenizer.chat_prompt(messages)
    return next(engine.generate([Request(ids, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))]))


def test_the_server_flag_speculates_losslessly_and_counts_accepted_drafts(engine, spec_url):
    client = client_of(spec_url)
    want = greedy_reference(engine)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, **COMMON)
    assert reply.choices[0].message.content == want.text
    stats = reply.model_extra["moedesk"]
    assert stats["token_ids"] == want.token_ids
    spec = stats["speculative"]
    assert spec["mode"] == "greedy" and spec["verify_steps"] >= 1 and spec["drafted"] >= spec["accepted"]
    details = reply.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == spec["accepted"]
    assert details.rejected_prediction_tokens == spec["drafted"] - spec["accepted"]

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **COMMON))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed, not at the end
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 0
    assert httpx.get(spec_url + "/moedesk/stats", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).json()["speculative"] == "greedy"


def test_concurrent_speculative_requests_verify_together(engine, spec_url):
    prompts = ["def add(a, b):", "Hello, world!", "The quick brown fox", "Experts live in RAM"]
    want = [engine.tokenizer.decode(greedy_reference(engine, [{"role": "user", "content": p}], 24).token_ids)
            for p in prompts]
    client = client_of(spec_url)
    results = at_once(lambda p: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": p}], max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True}), prompts, 120)
    assert [r.choices[0].message.content for r in results] == want
    # They verified in one job's forwards: more than one row per round on average, for some of them at least.
    assert max(r.model_extra["moedesk"]["speculative"]["mean_rows"] for r in results) > 1


def test_the_extension_chooses_per_request(engine, spec_url, head, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_CACHE_DIR", str(tmp_path))  # auto measures step times once and keeps them there
    want = greedy_reference(engine)
    client = client_of(spec_url)
    off = client.chat.completions.create(model="tiny", messages=MESSAGES, **{**COMMON, "extra_body": {
        "ignore_eos": True, "moedesk": {"speculative": "off"}}})
    assert off.choices[0].message.content == want.text and "speculative" not in off.model_extra["moedesk"]
    assert off.usage.completion_tokens_details is None
    # A server started with --draft but without --speculative speculates for a request that asks.
    with running_server(engine, api_key=KEY, model_name="tiny", speculation=Speculation("off", str(head))) as url:
        asked = client_of(url).chat.completions.create(model="tiny", messages=MESSAGES, **{**COMMON, "extra_body": {
            "ignore_eos": True, "moedesk": {"speculative": "auto"}}})
        assert asked.choices[0].message.content == want.text
        assert asked.model_extra["moedesk"]["speculative"]["mode"] == "auto"
        unasked = client_of(url).chat.completions.create(model="tiny", messages=MESSAGES, **COMMON)
        assert "speculative" not in unasked.model_extra["moedesk"]

    tree = client.chat.completions.create(model="tiny", messages=MESSAGES, **{**COMMON, "extra_body": {
        "ignore_eos": True, "moedesk": {"speculative": "beam"}}})
    assert tree.choices[0].message.content == want.text
    assert tree.model_extra["moedesk"]["speculative"]["mode"] == "beam"
    sampled = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5,
                                             top_p=0.5, extra_body={"moedesk": {"speculative": "beam"}})
    # trees of sampled drafts need widths the sampling allows: a sampled request drafts chains
    assert sampled.model_extra["moedesk"]["speculative"]["mode"] == "greedy"
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5,
                                           top_p=0.5, extra_body={"moedesk": {"speculative": "off"}})
    assert sampled.usage.completion_tokens == len(sampled.model_extra["moedesk"]["token_ids"])
    assert again.choices[0].finish_reason in ("stop", "length")
    # A response_format decodes plainly on a speculative server: the flag applies where the request allows it.
    constrained = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                                 response_format={"type": "json_object"})
    json.loads(constrained.choices[0].message.content)
    assert "speculative" not in constrained.model_extra["moedesk"]


def test_beams_through_the_extension(engine, plain_url):
    ids = engine.tokenizer.chat_prompt(MESSAGES)
    best = engine.beam_search(ids, beams=3, max_new_tokens=10, length_penalty=0.5, ignore_eos=True)
    client = client_of(plain_url)
    body = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True, "moedesk": {"beams": 3, "length_penalty": 0.5}})
    reply = client.chat.completions.create(**body)
    assert reply.choices[0].message.content == best.text
    assert reply.model_extra["moedesk"]["token_ids"] == best.token_ids and reply.model_extra["moedesk"]["beams"] == 3
    chunks = list(client.chat.completions.create(stream=True, **body))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert pieces == [best.text]  # only the best hypothesis, whole, when the search ends


@pytest.mark.parametrize("extension, param", [
    ({"temperature": 0}, "moedesk.temperature"),
    ({"speculative": "sideways"}, "moedesk.speculative"),
    ({"speculative": 1}, "moedesk.speculative"),
    ({"beams": 0}, "moedesk.beams"),
    ({"beams": 1000}, "moedesk.beams"),
    ({"beams": "2"}, "moedesk.beams"),
    ({"beams": 2.5}, "moedesk.beams"),
    ({"length_penalty": "long"}, "moedesk.length_penalty"),
    ({"beams": 2, "speculative": "greedy"}, "moedesk.beams"),
    ([1, 2], "moedesk"),
])
def test_bad_extension_values_are_400_error_objects(spec_url, extension, param):
    r = httpx.post(spec_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "moedesk": extension})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_what_a_request_cannot_combine_or_a_server_cannot_do(spec_url, plain_url):
    client = client_of(spec_url)
    for extension, words in (({"beams": 2}, "response_format"), ({"speculative": "greedy"}, "response_format")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                           response_format={"type": "json_object"}, extra_body={"moedesk": extension})
        assert words in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # no --draft, and the tiny model has no head of its own
        client_of(plain_url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                     extra_body={"moedesk": {"speculative": "greedy"}})
    assert "draft" in caught.value.body["message"] and caught.value.body["param"] == "moedesk.speculative"


def test_the_serve_flags(engine, head, tiny_checkpoint, capsys):
    from moedesk.app.cli import build_parser, main, server_speculation

    args = build_parser().parse_args(["serve", "--speculative", "beam", "--draft", str(head), "--draft-length", "3",
                                      "--draft-width", "2"])
    assert server_speculation(engine, args) == Speculation("beam", str(head), 3, 2)
    assert server_speculation(engine, build_parser().parse_args(["serve"])) == Speculation("off")
    for bad in (["--draft-length", "0"], ["--speculative", "sideways"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
    # --speculative without a head for a model that has none of its own: one line, before listening
    assert main(["serve", "--model", str(tiny_checkpoint(ARCH)), "--device", "cpu", "--dtype", "float32",
                 "--speculative", "greedy", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "draft" in err[-1] and err[-1].startswith("moedesk: ")
    assert main(["serve", "--model", str(tiny_checkpoint(ARCH)), "--device", "cpu", "--dtype", "float32",
                 "--draft", str(head / "missing"), "--port", "1"]) == 2


def test_moedesk_serve_with_speculative_flags_end_to_end(engine, head, tiny_checkpoint):
    args = ["--model", str(tiny_checkpoint(ARCH)), "--device", "cpu", "--dtype", "float32", "--batch-size", "4",
            "--speculative", "greedy", "--draft", str(head), "--draft-length", "3"]
    with serve_process(args, KEY) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        model = str(tiny_checkpoint(ARCH))
        reply = client.chat.completions.create(model=model, messages=MESSAGES, **COMMON)
        assert reply.choices[0].message.content == greedy_reference(engine).text
        assert reply.model_extra["moedesk"]["speculative"]["mode"] == "greedy"
        assert reply.usage.completion_tokens_details.accepted_prediction_tokens is not None
