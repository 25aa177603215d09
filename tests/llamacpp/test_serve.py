"""`moedesk serve --engine llama.cpp`: concurrent clients decode together, through llama.cpp's multi-sequence
batches, and get the replies they get one at a time (the official openai client); response_format holds."""
from __future__ import annotations

import json

import pytest

from tests.app.serve_process import serve_process
from tests.at_once import at_once

openai = pytest.importorskip("openai")
KEY = "k"
QUESTIONS = ["What is the capital of France?", "Name a fruit.", "Count to five.", "What colour is the sky?"]


def ask(client, question):
    return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": question}],
                                          max_tokens=24, temperature=0)


def test_four_concurrent_requests_equal_their_one_at_a_time_replies(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torch's threads, which the llama.cpp engine takes: two shared cores
    with serve_process(["--engine", "llama.cpp", "--model", "demo", "--context", "256", "--batch-size", "4"],
                       KEY, startup_s=180) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=300, max_retries=0)
        alone = [ask(client, q) for q in QUESTIONS]
        together = dict(zip(QUESTIONS, at_once(lambda q: ask(client, q), QUESTIONS, 300)))
        for q, reply in zip(QUESTIONS, alone):
            assert together[q].choices[0].message.content == reply.choices[0].message.content, q
            assert reply.choices[0].message.content  # something was said
        batches = [together[q].model_extra["moedesk"]["mean_batch"] for q in QUESTIONS]
        assert max(batches) > 1  # they shared llama_decode calls
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
                  "additionalProperties": False}
        shaped = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Give me a JSON object with a name."}], max_tokens=40,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
        assert list(json.loads(shaped.choices[0].message.content)) == ["name"]  # llguidance's masks on llama.cpp
