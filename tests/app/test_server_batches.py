"""OpenAI's Files and Batches APIs on `moedesk serve`, driven by the official openai client: a batch's replies equal
the server's own answers to the same requests, failed lines go to the error file, a bad file is refused with its
lines named, a cancel stops the batch, and unknown ids are 404s."""
import json
import time

import httpx
import openai
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion

from moedesk.app import server_batches
from moedesk.app.server_batches import check_lines
from tests.app.test_server import KEY, engine, running_server  # noqa: F401 -- engine: the module's fixture

# Every route of app/server_batches.py, with and without /v1 (tests/app/test_server_apis.py holds the rest)
BATCH_ROUTES = [(method, prefix + path) for prefix in ("/v1", "") for method, path in (
    ("POST", "/files"), ("GET", "/files"), ("GET", "/files/{file_id}"), ("DELETE", "/files/{file_id}"),
    ("GET", "/files/{file_id}/content"), ("POST", "/batches"), ("GET", "/batches"), ("GET", "/batches/{batch_id}"),
    ("POST", "/batches/{batch_id}/cancel"))]
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
PROMPTS = ["Hi", "The quick brown fox jumps over the lazy", "def add(a, b):"]


@pytest.fixture(scope="module")
def client(engine):  # noqa: F811
    with running_server(engine, api_key=KEY, batch_size=2, model_name="tiny") as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=60, max_retries=0)


def jsonl(lines) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def line(custom_id, body, url=CHAT):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait(client, batch_id, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"the batch is still {batch.status}"
        time.sleep(0.1)


def records(client, file_id):
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


def test_a_chat_batch_answers_as_the_server_does_and_puts_failures_apart(client):
    bodies = {f"q{i}": {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 8,
                        "temperature": 0} for i, p in enumerate(PROMPTS)}
    bad = {"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    upload = client.files.create(file=("requests.jsonl", jsonl(
        [line(k, b) for k, b in bodies.items()] + [line("bad", bad)])), purpose="batch")
    assert upload.purpose == "batch" and upload.filename == "requests.jsonl" and upload.bytes > 0
    created = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h",
                                    metadata={"job": "nightly"})
    assert created.status in ("validating", "in_progress") and created.metadata == {"job": "nightly"}
    batch = wait(client, created.id)
    assert batch.status == "completed" and batch.completed_at and batch.in_progress_at
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    done = {r["custom_id"]: r for r in records(client, batch.output_file_id)}
    assert sorted(done) == sorted(bodies)
    for custom_id, body in bodies.items():
        record = done[custom_id]
        assert record["error"] is None and record["response"]["status_code"] == 200
        reply = ChatCompletion.model_validate(record["response"]["body"])
        direct = client.chat.completions.create(**body)
        assert reply.choices[0].message.content == direct.choices[0].message.content
        assert reply.usage.completion_tokens == direct.usage.completion_tokens
    [failed] = records(client, batch.error_file_id)
    assert failed["custom_id"] == "bad" and failed["response"]["status_code"] == 404
    assert failed["response"]["body"]["error"]["code"] == "model_not_found"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list().data]


def test_a_text_batch_runs_the_completions_endpoint(client):
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
    upload = client.files.create(file=("t.jsonl", jsonl([line("t", body, TEXT)])), purpose="batch")
    batch = wait(client, client.batches.create(input_file_id=upload.id, endpoint=TEXT, completion_window="24h").id)
    [record] = records(client, batch.output_file_id)
    reply = OpenAICompletion.model_validate(record["response"]["body"])
    assert reply.choices[0].text == client.completions.create(**body).choices[0].text
    assert batch.error_file_id is None


def test_a_line_with_several_choices_answers_as_the_server_does(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 6,
            "temperature": 1.0, "seed": 9, "n": 3}
    upload = client.files.create(file=("n.jsonl", jsonl([line("n", body)])), purpose="batch")
    batch = wait(client, client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h").id)
    [record] = records(client, batch.output_file_id)
    reply = ChatCompletion.model_validate(record["response"]["body"])
    direct = client.chat.completions.create(**body)
    assert [c.message.content for c in reply.choices] == [c.message.content for c in direct.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and reply.usage == direct.usage


def test_a_file_with_bad_lines_fails_the_batch_naming_them(client):
    good = line("a", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    upload = client.files.create(file=("bad.jsonl", jsonl(
        [good, "not json", line("a", good["body"]), line("c", good["body"], TEXT), {"url": CHAT, "body": {}}])),
        purpose="batch")
    batch = wait(client, client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_endpoint"),
        (5, "missing_required_parameter")]


def test_a_cancel_stops_a_batch_and_keeps_what_finished(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "ignore_eos": True}
    upload = client.files.create(file=("many.jsonl", jsonl([line(f"r{i}", body) for i in range(40)])),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled", "completed")
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    counts = batch.request_counts
    assert counts.total == 40 and counts.completed + counts.failed < 40 and counts.failed == 0
    written = records(client, batch.output_file_id) if batch.output_file_id else []
    assert len(written) == counts.completed


def test_files_list_retrieve_delete_and_the_errors_of_unknown_ids(client):
    upload = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    assert upload.id in [f.id for f in client.files.list().data]
    assert client.files.content(upload.id).content == b"{}\n"
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    stranger = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.files.list()


def test_check_lines_refuses_an_empty_file_and_takes_blank_lines():
    assert check_lines(b"\n\n", CHAT) == ([], [{"code": "empty_file", "message": "The input file holds no requests.",
                                                "param": None, "line": 0}])
    lines, errors = check_lines(jsonl([line("a", {"x": 1}), ""]), CHAT)
    assert lines == [("a", {"x": 1})] and errors == []


@pytest.mark.parametrize("method, path", BATCH_ROUTES)
def test_every_batch_route_asks_for_the_key(client, method, path):
    url = str(client.base_url).removesuffix("/v1/") + path.format(file_id="file-x", batch_id="batch_x")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.request(method, url, headers=headers, timeout=30).status_code == 401
    assert httpx.request(method, url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code in (
        200, 400, 404)


def test_an_upload_over_the_limit_is_a_413_and_leaves_nothing(client, monkeypatch):
    monkeypatch.setattr(server_batches, "MAX_FILE_BYTES", 1000)  # the server runs in this process
    before = [f.id for f in client.files.list().data]
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    assert e.value.status_code == 413 and [f.id for f in client.files.list().data] == before
    with pytest.raises(openai.APIStatusError) as e:  # a JSON body over the server's cap, as every route
        client.batches.create(input_file_id="x" * (9 << 20), endpoint=CHAT, completion_window="24h")
    assert e.value.status_code == 413


def test_a_full_disk_fails_the_batch_with_the_reason_and_the_server_goes_on(client, monkeypatch):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    upload = client.files.create(file=("d.jsonl", jsonl([line("a", body)])), purpose="batch")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(server_batches, "output_line", full)  # where a line's answer is written
    batch = wait(client, client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h").id)
    assert batch.status == "failed" and "No space left on device" in batch.errors.data[0].message
    monkeypatch.undo()
    assert client.chat.completions.create(**body).choices[0].message.content is not None


def test_lines_in_flight_follow_the_loaded_models_batch_and_an_unloaded_one_counts_not():
    from types import SimpleNamespace

    from moedesk.app.model_registry import Entry

    def workers(*entries):
        return server_batches.BatchesApi(SimpleNamespace(pool=SimpleNamespace(entries=list(entries))))._workers()

    assert workers(Entry("a", "x")) == server_batches.WORKERS  # discovered in the caches, not loaded: no group
    assert workers(Entry("a", "x"), Entry("b", "y", group=SimpleNamespace(limit=3))) == 3
