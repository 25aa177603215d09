"""The Ollama API through the official `ollama` client, /v1/responses through the official `openai` client, CORS
and the API key on every route: a real uvicorn server on a tiny random Qwen3-MoE whose template lists tools and
opens a <think> block (tests/tiny_models.py, TOOLS_TEMPLATE)."""
import json

import httpx
import jsonschema
import openai
import pytest

from moedesk.app.server import MAX_BODY_BYTES
from tests.app.test_server import running_server
from tests.app.test_server_tools import ASK, TIME, WEATHER, engine, folder  # noqa: F401 -- module fixtures

ollama = pytest.importorskip("ollama")  # the test extras install it

KEY = "sk-apis"
AUTH = {"Authorization": f"Bearer {KEY}"}
NOT_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def url(engine):  # noqa: F811
    with running_server(engine, api_key=KEY, model_name="tiny", cors=("https://app.example",)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture
def local(url):
    return ollama.Client(host=url, headers=AUTH, timeout=120)


def token_text(engine, ids):  # noqa: F811
    return engine.tokenizer.decode(ids)


# --- Ollama ----------------------------------------------------------------------------------------------------

def test_ollama_lists_shows_and_reports_its_model(local):
    [model] = local.list().models
    assert model.model == "tiny:latest" and model.details.family == "qwen3_moe"
    shown = local.show("tiny")
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities) and "<tool_call>" in shown.template
    assert [m.model for m in local.ps().models] == ["tiny:latest"]
    assert httpx.get(local._client.base_url.join("/api/version"), headers=AUTH).json()["version"]


def test_ollama_chat_thinks_apart_and_streams_as_ollama_does(local, engine):  # noqa: F811
    options = {"temperature": 0, "num_predict": 10}
    thinking = local.chat(model="tiny", messages=ASK, options=options, think=True)
    assert thinking.done and thinking.done_reason in ("stop", "length") and thinking.eval_count >= 1
    assert thinking.message.thinking and thinking.message.content == ""
    answer = local.chat(model="tiny", messages=ASK, options=options, think=False)
    assert answer.message.content and not answer.message.thinking

    parts = list(local.chat(model="tiny", messages=ASK, options=options, think=False, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == answer.message.content
    assert parts[-1].eval_count == answer.eval_count and parts[-1].prompt_eval_count == answer.prompt_eval_count
    streamed = list(local.chat(model="tiny", messages=ASK, options=options, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in streamed) == thinking.message.thinking


def test_ollama_generate_and_tool_turns(local, engine):  # noqa: F811
    options = {"temperature": 0, "num_predict": 8, "seed": 1}
    raw = local.generate(model="tiny", prompt="The quick brown", raw=True, options=options)
    assert raw.response and raw.prompt_eval_count == len(engine.tokenizer.encode("The quick brown"))
    parts = list(local.generate(model="tiny", prompt="The quick brown", raw=True, options=options, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert "".join(p.response for p in parts) == raw.response and parts[-1].eval_count == raw.eval_count
    assert local.generate(model="tiny", prompt="").done_reason == "load"  # Ollama's way to load a model
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]
    turns = ASK + [{"role": "assistant", "content": "", "tool_calls": calls},
                   {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    reply = local.chat(model="tiny", messages=turns, tools=[WEATHER], options=options, think=False)
    first = local.chat(model="tiny", messages=ASK, tools=[WEATHER], options=options, think=False)

    def length(messages):  # the ollama client rewrites tool schemas, so compare what the turns add
        text = engine.tokenizer.render_chat(messages, tools=[WEATHER], enable_thinking=False)
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    added = length(ASK + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", **calls[0]}]},
                          {"role": "tool", "content": "sunny"}]) - length(ASK)
    assert reply.prompt_eval_count - first.prompt_eval_count == added > 0


def test_ollama_errors_are_its_error_objects(local, url):
    with pytest.raises(ollama.ResponseError) as caught:
        local.chat(model="nope", messages=ASK)
    assert caught.value.status_code == 404 and "nope" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        local.chat(model="tiny", messages=ASK, options={"temperature": "hot"})
    assert caught.value.status_code == 400 and "temperature" in caught.value.error
    r = httpx.post(url + "/api/chat", json={"model": "tiny", "messages": ASK}, timeout=10)
    assert r.status_code == 401 and "error" in r.json()


# --- /v1/responses -----------------------------------------------------------------------------------------------

def test_responses_plain_streamed_and_with_instructions(client, engine):  # noqa: F811
    common = dict(model="tiny", max_output_tokens=10, temperature=0, extra_body={"chat_template_kwargs": NOT_THINKING})
    reply = client.responses.create(input="Weather in Paris?", instructions="Be brief.", **common)
    assert reply.status in ("completed", "incomplete") and reply.output_text
    assert reply.usage.output_tokens == 10 and reply.incomplete_details.reason == "max_output_tokens"
    chat = client.chat.completions.create(model="tiny", max_tokens=10, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *ASK], extra_body={"chat_template_kwargs": NOT_THINKING})
    assert reply.output_text == chat.choices[0].message.content  # the same request path
    events = list(client.responses.create(input="Weather in Paris?", instructions="Be brief.", stream=True, **common))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == reply.output_text


def test_responses_reasoning_and_forced_function_calls(client):
    thinking = client.responses.create(model="tiny", input=ASK, max_output_tokens=8, temperature=0)
    [reasoning, message] = thinking.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text and message.content[0].text == ""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    called = client.responses.create(model="tiny", input=ASK, tools=[tool], tool_choice="required",
                                     max_output_tokens=700, temperature=0.8, extra_body={"seed": 3})
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), tool["parameters"])
    # The next turn carries the call and its output as input items.
    follow = client.responses.create(model="tiny", tools=[tool], max_output_tokens=4, temperature=0, input=[
        *ASK, {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > called.usage.input_tokens
    events = list(client.responses.create(model="tiny", input=ASK, tools=[tool], tool_choice="required", stream=True,
                                          max_output_tokens=700, temperature=0.8, extra_body={"seed": 3}))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [(c.name, c.arguments) for c in calls]
    # Each call's item is added empty, then its arguments arrive in fragments that add up to the whole.
    for call in done:
        added = [e for e in events if e.type == "response.output_item.added" and e.item.id == call.item_id]
        fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.item_id == call.item_id]
        assert added[0].item.arguments == "" and added[0].item.name == call.name
        assert len(fragments) > 5 and "".join(fragments) == call.arguments
    assert events[-1].type == "response.completed"
    assert [(c.name, c.arguments) for c in events[-1].response.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({}, "input"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": 5}, "input"),
])
def test_responses_bad_input_is_400(url, body, param):
    r = httpx.post(url + "/v1/responses", json={"model": "tiny", **body}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# --- every route -------------------------------------------------------------------------------------------------

ROUTES = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None), ("GET", "/moedesk/stats", None),
          ("POST", "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 1, "stream": True}),
          ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}),
          ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1, "stream": True}),
          ("POST", "/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": ASK}),
          ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": ASK}),
          ("POST", "/api/chat", {"model": "tiny", "messages": ASK}), ("POST", "/api/generate", {"model": "tiny"}),
          ("GET", "/api/tags", None), ("POST", "/api/show", {"model": "tiny"}), ("GET", "/api/ps", None),
          ("GET", "/api/version", None),
          # the OpenAI routes without /v1, as llama-server serves them
          ("GET", "/models", None), ("GET", "/models/tiny", None),
          ("POST", "/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 1, "stream": True}),
          ("POST", "/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": True}),
          ("POST", "/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1})]


def test_the_key_test_covers_every_route_the_server_serves(engine):  # noqa: F811
    from moedesk.app.server import Server

    from tests.app.test_server_batches import BATCH_ROUTES  # forms and ids: their key is tested there
    from tests.app.test_server_ollama_pull import PULL_ROUTES  # downloads: their key is tested there

    served = {(method, route.path.replace("{model_id:path}", "tiny")) for route in Server(engine).app.routes
              for method in route.methods - {"HEAD"}}
    assert served - {("GET", "/health")} == {(method, path) for method, path, _ in ROUTES} | set(BATCH_ROUTES) \
        | set(PULL_ROUTES)


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_every_route_asks_for_the_key_and_caps_the_body(url, method, path, body):
    r = httpx.request(method, url + path, json=body, timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.request(method, url + path, json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401
    r = httpx.request(method, url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    if method == "POST":
        r = httpx.post(url + path, content=b" " * (MAX_BODY_BYTES + 1), headers=AUTH, timeout=60)
        assert r.status_code == 413


def test_cors_only_for_the_named_origins(url, engine):  # noqa: F811
    ask = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(url + "/v1/chat/completions", headers=ask, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(url + "/v1/chat/completions", headers={**ask, "Origin": "https://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in r.headers
    with running_server(engine, api_key=KEY, model_name="tiny") as plain:  # no --cors: no CORS headers at all
        r = httpx.options(plain + "/v1/chat/completions", headers=ask, timeout=10)
        assert "access-control-allow-origin" not in r.headers
        r = httpx.get(plain + "/v1/models", headers={**AUTH, "Origin": "https://app.example"}, timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_structured_output_through_ollama_format_and_responses_text_format(local, client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = local.chat(model="tiny", messages=ASK, format=schema, think=False, options={"num_predict": 40, "seed": 2})
    jsonschema.validate(json.loads(reply.message.content), schema)
    # Greedy: sampled, the object was sometimes still open after 60 tokens (a `length` reply, not JSON).
    reply = local.generate(model="tiny", prompt="JSON:", format="json", raw=True,
                           options={"num_predict": 60, "temperature": 0})
    assert isinstance(json.loads(reply.response), dict)
    reply = client.responses.create(model="tiny", input="JSON:", max_output_tokens=40, extra_body={
        "chat_template_kwargs": NOT_THINKING},
        text={"format": {"type": "json_schema", "name": "ok", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), schema)
