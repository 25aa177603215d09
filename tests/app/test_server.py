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

from app.server import build_app
from engine.requests import Request, SamplingParams
from engine.runtime import Engine
from tests.app.serve_process import serve_process

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
    from app.cli import main

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
    from app.cli import main

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
    results, errors = {}, []
    start = threading.Barrier(len(prompts))

    def one(p):
        try:
            start.wait()
            results[p] = streamed(client, chat=False, prompt=p, max_tokens=32, temperature=0,
                                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
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
    import engine.generation.decoder as generate

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
    ({"model": "tiny"}, "messages", "invalid_type"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, "model", "model_not_found"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model", "missing_required_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature",
     "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens",
     "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, "max_tokens",
     "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream", "invalid_type"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "unsupported_parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop",
     "invalid_type"),
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
        reply = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens <= 4
