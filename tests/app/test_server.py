"""`moedesk serve` through the official openai client, against a real uvicorn server on 127.0.0.1."""
import contextlib
import json
import socket
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from moedesk.app.server import build_app
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine
from tests.app.serve_process import serve_process
from tests.at_once import at_once

KEY = "sk-test-key"
ARCH = "qwen3_moe"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.load(str(tiny_checkpoint(ARCH)), device="cpu", dtype="float32")


@contextlib.contextmanager
def running_server(engine, **options):
    """uvicorn serving `engine` on a free port of 127.0.0.1 in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, **options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def url(engine):
    with running_server(engine, api_key=KEY, batch_size=8, model_name="tiny") as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def stats(url):
    return httpx.get(url + "/moedesk/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()


def wait_idle(url, timeout=20):
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url)["scheduler"]
        if not s["running"] and not s["waiting"]:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def streamed(client, chat=True, **kwargs):
    """(text, chunks) of a streamed reply."""
    make = client.chat.completions.create if chat else client.completions.create
    chunks = list(make(model="tiny", stream=True, **kwargs))
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
    return "".join(pieces), chunks


def test_the_key_is_enforced(url):
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=url + "/v1", api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.models.list()
        assert caught.value.body["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # liveness needs no key


def test_models(client):
    [model] = client.models.list().data
    assert model.id == "tiny" and model.owned_by == "moedesk"
    assert client.models.retrieve("tiny").id == "tiny"


def test_plain_and_streamed_replies_equal_moedesk_batch_greedy(client, tiny_checkpoint, tmp_path):
    from moedesk.app.cli import main

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, fox!"}]
    prompt = "def add(a, b):"
    lines = [{"id": "chat", "messages": messages}, {"id": "text", "prompt": prompt}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["batch", str(src), "-o", str(out), "--model", str(tiny_checkpoint(ARCH)), "--device", "cpu",
                 "--dtype", "float32", "--temperature", "0", "--max-new-tokens", "16", "--ignore-eos"])
    assert code == 0
    batch = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    common = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})

    plain = client.chat.completions.create(model="tiny", messages=messages, **common)
    assert plain.choices[0].message.content == batch["chat"]["text"]
    assert plain.model_extra["moedesk"]["token_ids"] == batch["chat"]["token_ids"]
    assert plain.usage.completion_tokens == 16 and plain.usage.prompt_tokens == batch["chat"]["usage"]["prompt_tokens"]
    assert plain.choices[0].finish_reason == "length"
    text, chunks = streamed(client, messages=messages, **common)
    assert text == batch["chat"]["text"]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"

    plain = client.completions.create(model="tiny", prompt=prompt, **common)
    assert plain.choices[0].text == batch["text"]["text"]
    assert plain.model_extra["moedesk"]["token_ids"] == batch["text"]["token_ids"]
    text, _ = streamed(client, chat=False, prompt=prompt, **common)
    assert text == batch["text"]["text"]
    ids = client.completions.create(model="tiny", prompt=batch["text"]["token_ids"][:5], **common)  # token ids
    assert ids.usage.prompt_tokens == 5


def test_batch_lines_take_response_format(tiny_checkpoint, tmp_path):
    from moedesk.app.cli import main

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    lines = [{"id": "schema", "prompt": "JSON:", "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "s", "schema": schema}}},
             {"id": "object", "prompt": "JSON:", "response_format": {"type": "json_object"}},
             {"id": "bad", "prompt": "JSON:", "response_format": {"type": "yaml"}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["batch", str(src), "-o", str(out), "--model", str(tiny_checkpoint(ARCH)), "--device", "cpu",
                 "--dtype", "float32", "--temperature", "0", "--max-new-tokens", "60"])
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert code == 1 and "response_format" in records["bad"]["error"]
    jsonschema.validate(json.loads(records["schema"]["text"]), schema)
    assert isinstance(json.loads(records["object"]["text"]), dict)


def test_eight_concurrent_streams_complete_and_share_steps(client, engine, url):
    prompts = [f"{p} {i}" for i, p in enumerate(["The quick brown fox", "Hello, world!", "def add(a, b):",
                                                 "Experts live in RAM", "Mixture of experts", "1234567890",
                                                 "How are you today?", "print(add(2, 3))"])]
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    expected = {c.tag: c.text for c in engine.generate(
        [Request(engine.tokenizer.encode(p), params, tag=p) for p in prompts], batch_size=1)}
    before = stats(url)["scheduler"]
    results = dict(zip(prompts, at_once(lambda p: streamed(
        client, chat=False, prompt=p, max_tokens=32, temperature=0, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}), prompts, 120)))
    for p in prompts:
        text, chunks = results[p]
        assert text == expected[p]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32  # include_usage
        [last] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert last.model_extra["moedesk"]["decode_steps"] == 31
    after = wait_idle(url)
    mean_batches = [[c for c in results[p][1] if c.choices and c.choices[0].finish_reason][0].model_extra["moedesk"]
                    ["mean_batch"] for p in prompts]
    assert max(mean_batches) > 1 and after["max_batch"] >= 2
    assert after["decode_steps"] - before["decode_steps"] < 8 * 31  # steps were shared


def test_a_client_disconnecting_mid_stream_frees_its_row(url):
    before = wait_idle(url)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
        assert got
    after = wait_idle(url)  # the row is free again
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 400


def slow_steps(monkeypatch, seconds=0.01):
    """Decode steps take at least `seconds`: the tiny model is too quick for a client to act mid-reply."""
    import moedesk.engine.generation.decoder as generate

    real_decode = generate.Decoder.decode

    def slow_decode(self, seqs):
        time.sleep(seconds)
        return real_decode(self, seqs)

    monkeypatch.setattr(generate.Decoder, "decode", slow_decode)


def test_a_client_giving_up_on_a_plain_request_frees_its_row(url, monkeypatch):
    slow_steps(monkeypatch)
    before = wait_idle(url)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
    after = wait_idle(url)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 480


def test_json_mode_and_json_schema(client):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                           max_tokens=80, temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for temperature in (0, 1.0):
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A person"}],
                                               max_tokens=80, temperature=temperature, seed=5, response_format=fmt)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    text, _ = streamed(client, messages=[{"role": "user", "content": "A person"}], max_tokens=80, temperature=0,
                       response_format=fmt)
    jsonschema.validate(json.loads(text), schema)


def test_stop_and_seed(client):
    common = dict(model="tiny", prompt="The quick", max_tokens=24, extra_body={"ignore_eos": True})
    full = client.completions.create(temperature=0, **common).choices[0].text
    stop = full[len(full) // 2:][:3]
    cut = client.completions.create(temperature=0, stop=[stop], **common).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]
    a, b, c = (client.completions.create(temperature=1.0, seed=s, **common).choices[0].text for s in (7, 7, 8))
    assert a == b and a != c


def raw(url, body, key=KEY, path="/v1/chat/completions"):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=data, headers={"Authorization": f"Bearer {key}",
                                                          "Content-Type": "application/json"}, timeout=30)


@pytest.mark.parametrize("body, param, code", [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_json"),
    ({"model": "tiny"}, "messages", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model", "missing_required_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature",
     "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens",
     "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, "max_tokens",
     "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream", "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 129}, "n", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": "2"}, "n", "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": [f"s{i}" for i in range(33)]},
     "stop", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", 1]}, "stop", "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 257]}, "stop", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}},
     "response_format", "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x " * 600}]}, "messages", "context_length_exceeded"),
])
def test_bad_requests_get_400_with_an_error_object(url, body, param, code):
    r = raw(url, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert error["message"]


def test_completion_errors_and_unknown_paths(url, client):
    for prompt in ("", [], [10**6], {"a": 1}, ["a", "b"]):
        r = raw(url, {"model": "tiny", "prompt": prompt}, path="/v1/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x " * 600)
    assert raw(url, {}, path="/v1/nothing").status_code == 404
    assert httpx.get(url + "/v1/chat/completions", timeout=10).status_code == 405
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_a_full_queue_gets_503_with_retry_after(engine, monkeypatch):
    slow_steps(monkeypatch, 0.02)
    with running_server(engine, batch_size=1, max_queue=1, model_name="tiny") as base:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 300, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream, which cancels the request
            next(lines)  # decoding: the one row is taken
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as waiting:
                deadline = time.monotonic() + 10
                while httpx.get(base + "/moedesk/stats", timeout=10).json()["scheduler"]["waiting"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                refused = httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=30)
                assert refused.status_code == 503
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["code"] == "queue_full"
                assert waiting.status_code == 200
        monkeypatch.undo()
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens <= 2


def test_moedesk_serve_command(tiny_checkpoint, tmp_path):
    args = ["--model", str(tiny_checkpoint(ARCH)), "--device", "cpu", "--dtype", "float32", "--batch-size", "4"]
    with serve_process(args, KEY) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        [model] = client.models.list().data
        assert model.id == str(tiny_checkpoint(ARCH))
        assert client.models.retrieve(model.id).id == model.id  # an id that is a path, slashes and all
        reply = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens <= 4


# --- what OpenAI clients send, field by field (the audit of the server against the OpenAI API) ---------------------


def test_chat_roles_and_text_parts(client, url):
    as_strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More please"}]
    as_parts = [{**m, "content": [{"type": "text", "text": m["content"][:3]},
                                  {"type": "text", "text": m["content"][3:]}]} for m in as_strings]
    common = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(messages=as_strings, **common)
    parts = client.chat.completions.create(messages=as_parts, **common)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert plain.choices[0].message.role == "assistant"
    # OpenAI's newer clients send "developer" where older ones sent "system": the chat template knows "system" only
    developer = client.chat.completions.create(messages=[{**as_strings[0], "role": "developer"}, *as_strings[1:]],
                                               **common)
    assert developer.model_extra["moedesk"]["token_ids"] == plain.model_extra["moedesk"]["token_ids"]
    assert developer.usage.prompt_tokens == plain.usage.prompt_tokens
    r = raw(url, {"model": "tiny", "messages": [as_strings[1], {"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].role", r.text
    assert r.json()["error"]["code"] == "invalid_value"


def test_max_completion_tokens_and_the_room_left(client, engine):
    common = dict(model="tiny", messages=[{"role": "user", "content": "Count"}], temperature=0,
                  extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(max_completion_tokens=3, **common)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    reply = client.chat.completions.create(max_completion_tokens=2, max_tokens=5, **common)  # the newer name wins
    assert reply.usage.completion_tokens == 2
    # a max_tokens past the context is cut to the room the prompt leaves
    prompt = [1] * (engine.context_length - 3)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=100, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.usage.total_tokens == engine.context_length
    assert reply.choices[0].finish_reason == "length"


def stop_in(text: str, length: int) -> str:
    """A stop string from the second half of a reply, without the replacement character a split byte decodes to."""
    return next(text[i:i + length] for i in range(len(text) // 2, len(text) - length + 1)
                if "\ufffd" not in text[i:i + length])


def test_streamed_chat_with_usage_and_stop_equals_the_plain_reply(client):
    common = dict(messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(model="tiny", **common)
    text, chunks = streamed(client, stream_options={"include_usage": True}, **common)
    assert text == plain.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    full = plain.choices[0].message.content
    stop = stop_in(full, 2)
    cut = client.chat.completions.create(model="tiny", stop=stop, **common)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == full[: full.find(stop)]
    text, chunks = streamed(client, stop=[stop, "\u2603"], **common)  # the stop string never reaches the client
    assert text == full[: full.find(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert text == cut.choices[0].message.content


def test_more_stop_strings_than_openai_takes(client):
    """Tools written for local servers send more than OpenAI's 4 (Continue's autocomplete about 10, Qwen-Agent 5)."""
    common = dict(model="tiny", prompt="The quick", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**common).choices[0].text
    stop = stop_in(full, 3)
    stops = [f"\u2603{i}" for i in range(9)] + [stop]
    cut = client.completions.create(stop=stops, **common).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]
    text, chunks = streamed(client, chat=False, stop=stops, **{k: v for k, v in common.items() if k != "model"})
    assert text == cut.text and chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_with_top_p_follows_the_seed(client):
    common = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=1.5,
                  extra_body={"ignore_eos": True})
    a, b, c = (client.chat.completions.create(top_p=0.9, seed=s, **common).choices[0].message.content
               for s in (3, 3, 4))
    assert a == b and a != c
    greedy = client.chat.completions.create(top_p=1e-6, seed=3, **common).choices[0].message.content
    assert greedy == client.chat.completions.create(top_p=1e-6, seed=4, **common).choices[0].message.content


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param, code", [
    ({"model": "tiny", "messages": []}, "messages", "invalid_value"),
    ({"model": "tiny", "messages": "hi"}, "messages", "invalid_type"),
    ({"model": "tiny", "messages": HI, "top_p": 0}, "top_p", "invalid_value"),
    ({"model": "tiny", "messages": HI, "temperature": 2.5}, "temperature", "invalid_value"),
    ({"model": "tiny", "messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"model": "tiny", "messages": HI, "seed": 1.5}, "seed", "invalid_type"),
    ({"model": "tiny", "messages": HI, "stop": ""}, "stop", "invalid_value"),
    ({"model": "tiny", "messages": HI, "stream_options": {"include_usage": True}}, "stream_options",
     "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "invalid_type"),
])
def test_invalid_values_get_400_with_the_param_named(url, body, param, code):
    r = raw(url, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error


def test_an_unknown_model_is_a_404_as_openai_answers_it(url, client):
    for path, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"})):
        r = raw(url, {"model": "gpt-4o", **body}, path=path)
        assert r.status_code == 404, r.text  # OpenAI's status for a model it does not have
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                     "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HI)


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("/v1/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": {"name": "f"}}, "function_call"),
    ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -1}, "frequency_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "}"}, "suffix"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
])
def test_unsupported_parameters_fail_clearly(url, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **({"messages": HI} if "chat" in path else {"prompt": "hi"}), **extra}
    r = raw(url, body, path=path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param,
                                                              "unsupported_parameter"), error


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    """What clients send by default (the neutral value, or a tool_choice without tools) must not fail."""
    reply = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=2, n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False,
        tools=[], tool_choice="none", parallel_tool_calls=False, logit_bias={}, user="u", store=False,
        response_format={"type": "text"}, metadata={"a": "b"})
    assert reply.usage.completion_tokens <= 2
    reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, tool_choice="auto",
                                           function_call="none")
    assert reply.usage.completion_tokens <= 2
    reply = client.completions.create(model="tiny", prompt=["hi"], max_tokens=2, best_of=1, echo=False, n=1)
    assert reply.usage.prompt_tokens >= 1


def test_a_disconnected_stream_frees_the_only_row_for_the_next_request(engine, monkeypatch):
    slow_steps(monkeypatch, 0.01)
    with running_server(engine, batch_size=1, model_name="tiny") as base:
        before = wait_idle(base)  # the engine's counters, which earlier servers of this module added to
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30)
        body = dict(model="tiny", messages=HI, max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
        running = client.chat.completions.create(stream=True, **body)
        chunks = iter(running)
        next(chunks), next(chunks)  # the one row decodes this reply
        waiting = client.chat.completions.create(stream=True, **body)  # queued behind it: no row is free
        deadline = time.monotonic() + 10
        while stats(base)["scheduler"]["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waiting.close()  # gives up while it waits: it leaves the queue
        while stats(base)["scheduler"]["waiting"]:
            assert time.monotonic() < deadline, stats(base)
            time.sleep(0.01)
        running.close()  # gives up mid-reply: the row is free for the next request
        monkeypatch.undo()
        reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
        after = wait_idle(base)
        assert after["cancelled"] - before["cancelled"] == 2
        assert after["generated_tokens"] - before["generated_tokens"] < 400


def test_more_concurrent_clients_than_rows_all_complete(engine):
    with running_server(engine, batch_size=2, model_name="tiny") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        results, errors = {}, []

        def one(i):
            try:
                kind = dict(stream=True) if i % 2 else {}
                reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"N{i}"}],
                                                       max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                                                       **kind)
                if i % 2:
                    chunks = list(reply)
                    results[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    batch = [c for c in chunks if c.choices and c.choices[0].finish_reason][0].model_extra["moedesk"]
                else:
                    results[i], batch = reply.choices[0].message.content, reply.model_extra["moedesk"]
                assert batch["mean_batch"] <= 2  # the group's limit
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and len(results) == 6
        alone = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"N{i}"}],
                                                max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                 .choices[0].message.content for i in range(6)]
        assert [results[i] for i in range(6)] == alone


def test_an_engine_failure_is_a_500_for_that_request_and_the_server_goes_on(url, client, monkeypatch):
    import moedesk.engine.generation.decoder as decoder

    poison = [7, 7, 7, 7]  # a prompt the engine fails on (token ids: no tokenizer in the way)
    real_start = decoder.Decoder.start

    def start(self, request, row):
        if list(request.prompt_ids) == poison:
            raise RuntimeError("a step\nfailed")
        return real_start(self, request, row)

    monkeypatch.setattr(decoder.Decoder, "start", start)
    r = raw(url, {"model": "tiny", "prompt": poison, "max_tokens": 4}, path="/v1/completions")
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "The engine failed this request: a step failed", "type": "server_error",
                                 "param": None, "code": "engine_error"}
    with pytest.raises(openai.APIError) as caught:  # streamed: an error event where the chunks would be
        streamed(client, chat=False, prompt=poison, max_tokens=4)
    assert "a step failed" in caught.value.message
    reply = client.completions.create(model="tiny", prompt=[7, 7, 7], max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3


def test_the_openai_clients_structured_output_helpers(client):
    """client.chat.completions.parse and .stream send a strict json_schema made from a pydantic model."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        adult: bool

    messages = [{"role": "user", "content": "A person"}]
    reply = client.chat.completions.parse(model="tiny", messages=messages, response_format=Person, max_tokens=60,
                                          temperature=0)
    assert reply.choices[0].finish_reason == "stop" and isinstance(reply.choices[0].message.parsed, Person)
    with client.chat.completions.stream(model="tiny", messages=messages, response_format=Person, max_tokens=60,
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == reply.choices[0].message.parsed


def test_a_body_over_8_mib_is_a_413_declared_or_not(url, client):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (9 << 20) + b'"}'

    def pieces():  # chunked: no Content-Length to refuse it by
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    for content in (big, pieces()):
        r = httpx.post(url + "/v1/completions", content=content, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    with pytest.raises(openai.BadRequestError) as caught:  # and a prompt over the context, for contrast: 400
        client.completions.create(model="tiny", prompt="x " * 600)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "prompt"


def test_an_omitted_temperature_is_the_models_own_default(client, engine, monkeypatch):
    # The model recommends greedy: requests without a temperature, whatever their seed, get the greedy reply.
    greedy = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0).choices[0].text
    monkeypatch.setattr(engine, "generation_defaults", {"temperature": 0.0})
    replies = {client.completions.create(model="tiny", prompt="Hello", max_tokens=12, seed=s).choices[0].text
               for s in range(4)}
    assert replies == {greedy}
    monkeypatch.setattr(engine, "generation_defaults", {})
    sampled = {client.completions.create(model="tiny", prompt="Hello", max_tokens=12, seed=s).choices[0].text
               for s in range(4)}
    assert len(sampled) > 1  # OpenAI's default, 1.0, samples


UNFINISHABLE = {
    "self reference": {"$ref": "#"},
    "required recursion": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"],
                           "additionalProperties": False},
    "huge pattern": {"type": "string", "pattern": "^a{1000000000}$"},
}


@pytest.mark.parametrize("name", sorted(UNFINISHABLE))
def test_a_format_that_cannot_complete_is_refused_or_ends_as_length(url, name):
    # Issue 46, item 14: these ended in invalid JSON marked `stop`.
    schema = UNFINISHABLE[name]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 24,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    for temperature in (0, 1.0):
        r = raw(url, {**body, "temperature": temperature, "seed": 3})
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "response_format"
            continue
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        else:
            assert choice["finish_reason"] == "length"


def test_a_lone_surrogate_is_a_client_error_not_a_crash(url):
    # Issue 46, item 15: echoed back in the error message, it failed the response's UTF-8 encoding: a 500.
    base = '{"messages": [{"role": "user", "content": "hi"}], '
    r = raw(url, base + '"model": "\\ud800"}')
    assert r.status_code == 404 and "\\ud800" in r.json()["error"]["message"]
    r = raw(url, base + '"model": "tiny", "moedesk": {"\\udfff": 1}}')
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert r.json()["error"]["param"] == "moedesk.\\udfff"


def test_a_nan_temperature_is_named(url):
    # Issue 46, item 17: the message read "must be a number, got a number".
    r = raw(url, '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}')
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("got NaN")


def test_without_a_key_only_this_machines_host_names_are_answered(engine):
    # Issue 46, item 17: with no key the server answered any Host header (DNS rebinding).
    from moedesk.app.host_check import allowed_hosts, host_name

    assert [host_name(h) for h in ("[::1]:8000", "LocalHost:80", "::1", "evil.example")] == \
        ["::1", "localhost", "::1", "evil.example"]
    assert allowed_hosts("0.0.0.0") is None and "my.box" in allowed_hosts("127.0.0.1", ("My.Box",))
    with running_server(engine, hosts=allowed_hosts("127.0.0.1")) as base:
        port = base.rsplit(":", 1)[1]
        for host, status in ((f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200), ("evil.example", 403),
                             (f"evil.example:{port}", 403)):
            r = httpx.get(base + "/v1/models", headers={"Host": host}, timeout=10)
            assert r.status_code == status, host
        assert r.json()["error"]["code"] == "host_not_allowed"
    with running_server(engine, api_key=KEY, hosts=allowed_hosts("127.0.0.1")) as base:
        r = httpx.get(base + "/v1/models", headers={"Host": "evil.example", "Authorization": f"Bearer {KEY}"},
                      timeout=10)
        assert r.status_code == 200  # a key is the guard then


def test_errors_and_stats_do_not_show_local_paths(url, engine, monkeypatch):
    # Issue 46, item 17: a template error and /moedesk/stats told clients where the model lies on this machine.
    path = str(engine.tokenizer.source)
    assert "/" in path and path in engine.description
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ raise_exception('no system role') }}")
    monkeypatch.delitem(engine.tokenizer.__dict__, "_template", raising=False)
    r = raw(url, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "no system role" in message and path not in message
    monkeypatch.undo()
    engine.tokenizer.__dict__.pop("_template", None)  # the failing template, compiled and cached: not for later tests
    assert path not in json.dumps(stats(url)) and "tiny" in stats(url)["description"]
