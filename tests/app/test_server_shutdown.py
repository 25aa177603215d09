"""SIGTERM while `moedesk serve` streams: replies being written may finish within --shutdown-grace; those still
open then end as a failed reply does (OpenAI: an error event and [DONE]; Ollama: a last line with done), and the
process exits. A real server process and real streaming clients."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from tests.app.serve_process import served

pytestmark = pytest.mark.timeout(180)
ARCH = "qwen3_moe"
KEY = "shutdown-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def args(tiny_checkpoint, grace: float) -> list[str]:
    return ["--model", str(tiny_checkpoint(ARCH)), "--device", "cpu", "--dtype", "float32", "--batch-size", "2",
            "--model-name", "tiny", "--shutdown-grace", str(grace)]


def openai_body(max_tokens: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Count."}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


def sse_events(lines) -> list:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_sigterm_ends_open_streams_properly_and_the_server_exits(tiny_checkpoint):
    with served(args(tiny_checkpoint, 0), KEY) as (url, proc), httpx.Client(timeout=60, headers=AUTH) as client:
        ollama_body = {"model": "tiny", "messages": [{"role": "user", "content": "Count."}], "stream": True,
                       "options": {"num_predict": 100000, "temperature": 0}}
        with client.stream("POST", f"{url}/v1/chat/completions", json=openai_body(100000)) as openai_reply, \
                client.stream("POST", f"{url}/api/chat", json=ollama_body) as ollama_reply:
            assert openai_reply.status_code == ollama_reply.status_code == 200
            openai_lines, ollama_lines = openai_reply.iter_lines(), ollama_reply.iter_lines()
            first = [next(openai_lines) for _ in range(3)] + [next(ollama_lines)]
            proc.send_signal(signal.SIGTERM)
            rest_openai, rest_ollama = list(openai_lines), list(ollama_lines)
        proc.wait(timeout=30)

    events = sse_events(first[:3] + rest_openai)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "shutting down" in last["error"]["message"]  # the reply was cut, and says so
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)

    lines = [json.loads(line) for line in [first[3], *rest_ollama] if line]
    assert not any(line.get("done") for line in lines[:-1])
    assert lines[-1]["done"] is True and "shutting down" in lines[-1]["error"]


def test_a_reply_that_finishes_within_the_grace_ends_as_usual(tiny_checkpoint):
    with served(args(tiny_checkpoint, 30), KEY) as (url, proc), httpx.Client(timeout=60, headers=AUTH) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=openai_body(64)) as reply:
            lines = reply.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        proc.wait(timeout=30)  # well before the grace: nothing is open any more
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks) > 1


def test_a_stopping_server_refuses_new_requests_and_cuts_a_plain_one(tiny_checkpoint):
    import asyncio

    from moedesk.app.api_errors import ApiError
    from moedesk.app.server import Server
    from moedesk.engine.runtime import Engine

    engine = Engine.load(str(tiny_checkpoint(ARCH)), device="cpu", dtype="float32")
    server = Server(engine, model_name="tiny")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 100000,
            "ignore_eos": True}

    class StillThere:  # a client that never goes away
        async def is_disconnected(self):
            return False

    async def scenario():
        job = await server.start(dict(body), chat=True)
        assert server.stop(grace_s=0.2) == 1
        try:
            await server.start(dict(body), chat=True)
            raise AssertionError("a new request was taken while stopping")
        except ApiError as e:
            refused = e
        try:
            await asyncio.wait_for(server.finish(StillThere(), job), 30)
            raise AssertionError("the open reply was not cut")
        except ApiError as e:
            cut = e
        while engine.queue_stats()["running"]:  # the cancelled row leaves at the next step, while the loop is open
            await asyncio.sleep(0.02)
        return refused, cut

    refused, cut = asyncio.run(scenario())
    assert refused.status == 503 and refused.code == "server_shutting_down"
    assert cut.status == 503 and "cut short" in cut.message
    assert not server.open_jobs
