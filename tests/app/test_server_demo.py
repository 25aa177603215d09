"""`moedesk serve --model demo` as users start it, driven by the official `openai` and `ollama` clients: the
Responses API, a forced tool call and the Ollama API on the built-in demo (SmolLM2 upcycled into an MoE)."""
import json

import jsonschema
import openai
import pytest

from tests.app.serve_process import serve_process

ollama = pytest.importorskip("ollama")  # the test extras install it

KEY = "sk-demo"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def url():
    with serve_process(["--model", "demo", "--device", "cpu", "--model-name", "demo"], KEY, startup_s=600) as base:
        yield base


def test_openai_and_ollama_clients_on_the_demo(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=300, max_retries=0)
    chat = client.chat.completions.create(model="demo", messages=ASK, max_tokens=12, temperature=0)
    answer = chat.choices[0].message.content
    assert "Paris" in answer

    # /v1/responses takes the same path: the same greedy answer, plain and as streamed events
    reply = client.responses.create(model="demo", input=ASK, max_output_tokens=12, temperature=0)
    assert reply.output_text == answer
    events = list(client.responses.create(model="demo", input=ASK, max_output_tokens=12, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer

    # a named function: the arguments follow its schema whatever the model would have written
    tool = {"type": "function", "function": {"name": "lookup", "parameters": CITY}}
    called = client.chat.completions.create(model="demo", messages=ASK, tools=[tool], max_tokens=40, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "lookup"}})
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "lookup" and called.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), CITY)

    local = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert [m.model for m in local.list().models] == ["demo:latest"]
    options = {"temperature": 0, "num_predict": 12}
    plain = local.chat(model="demo", messages=ASK, options=options)
    assert plain.message.content == answer and plain.prompt_eval_count == chat.usage.prompt_tokens
    parts = list(local.chat(model="demo", messages=ASK, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == answer and parts[-1].done
