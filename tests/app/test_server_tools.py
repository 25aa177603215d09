"""Tool calls and reasoning through `moedesk serve`, with the official openai client, on a tiny random Qwen3-MoE
whose chat template lists tools and opens a <think> block (tests/tiny_models.py, TOOLS_TEMPLATE)."""
import json

import httpx
import jsonschema
import openai
import pytest

from moedesk.engine.runtime import Engine
from tests import tiny_models
from tests.app.openai_checks import assert_all_reasoning
from tests.app.test_server import running_server

KEY = "sk-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("tools"), chat_template=tiny_models.TOOLS_TEMPLATE,
                             max_position_embeddings=2048)  # tools in a byte-level vocabulary of 384 are long


@pytest.fixture(scope="module")
def engine(folder):
    return Engine.load(str(folder), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def url(engine):
    with running_server(engine, api_key=KEY, model_name="tiny") as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def test_reasoning_comes_apart_from_the_answer_and_the_switch_reaches_the_template(client, engine):
    # The template opens <think>: a random model never closes it, so its whole reply is reasoning.
    assert_all_reasoning(client, "tiny", ASK, engine.tokenizer.decode, **GREEDY)

    # enable_thinking false: the template writes an empty think block, and the same kind of reply is the answer.
    off = dict(GREEDY, extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    reply = client.chat.completions.create(model="tiny", messages=ASK, **off)
    text = engine.tokenizer.decode(reply.model_extra["moedesk"]["token_ids"])
    assert reply.choices[0].message.content == text and "reasoning_content" not in reply.choices[0].message.model_extra
    assert reply.usage.prompt_tokens > client.chat.completions.create(model="tiny", messages=ASK, **GREEDY
                                                                      ).usage.prompt_tokens


def check_calls(calls, functions):
    schemas = {f["function"]["name"]: f["function"]["parameters"] for f in functions}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_follows_the_functions_schema(client, choice):
    tools = [WEATHER, TIME]
    budget = dict(temperature=0.8, seed=3, max_tokens=700)
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice=choice, **budget)
    [out] = reply.choices
    assert out.finish_reason == "tool_calls" and out.message.content is None
    check_calls(out.message.tool_calls, tools)
    if isinstance(choice, dict):
        assert [c.function.name for c in out.message.tool_calls] == ["get_time"]
    # Streamed, the same seed gives the same calls, in pieces the official client's stream helper puts together.
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in tools]  # the helper asks it
    with client.chat.completions.stream(model="tiny", messages=ASK, tools=strict, tool_choice=choice,
                                        **budget) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert [c.function.parsed_arguments for c in streamed.message.tool_calls] == \
        [json.loads(c.function.arguments) for c in out.message.tool_calls]


def test_a_streamed_call_comes_name_first_then_its_arguments_in_fragments(url):
    body = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "stream": True,
            "parallel_tool_calls": False, "temperature": 0.8, "seed": 3, "max_tokens": 700}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [p for c in chunks if c["choices"] for p in c["choices"][0]["delta"].get("tool_calls") or ()]
    first, rest = pieces[0], pieces[1:]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest)
    fragments = [p["function"]["arguments"] for p in pieces if p["function"]["arguments"]]
    assert len(fragments) > 5, fragments  # {"city":...,"days":...} arrives as the model writes it
    jsonschema.validate(json.loads("".join(fragments)), WEATHER["function"]["parameters"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_gives_one_call(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0.8, seed=5, max_tokens=700)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_tool_results_reach_the_next_turn(client, engine):
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model="tiny", messages=turns, tools=[WEATHER], **GREEDY)
    rendered = engine.tokenizer.render_chat(turns[:1] + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
        {"role": "tool", "content": "sunny, 21 C"}], tools=[WEATHER])
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert reply.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))


def test_tool_choice_none_hides_the_tools(client):
    with_tools = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], **GREEDY)
    hidden = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", **GREEDY)
    plain = client.chat.completions.create(model="tiny", messages=ASK, **GREEDY)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "get_weather"}}], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": "get_weather"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": 3}]}]}, "messages[0].tool_calls[0]"),
])
def test_bad_tool_fields_are_400_with_the_field_named(url, extra, param):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_batch_lines_take_the_same_fields(folder, engine, tmp_path):
    from moedesk.app.cli import main

    lines = [{"id": "forced", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
              "temperature": 0.8, "seed": 3},
             {"id": "thinking", "messages": ASK, "temperature": 0},
             {"id": "not thinking", "messages": ASK, "temperature": 0,
              "chat_template_kwargs": {"enable_thinking": False}},
             {"id": "bad", "prompt": "hi", "tools": [WEATHER]}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["batch", str(src), "-o", str(out), "--model", str(folder), "--device", "cpu", "--dtype", "float32",
                 "--max-new-tokens", "700"])
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert code == 1 and "messages" in records["bad"]["error"]
    calls = records["forced"]["tool_calls"]
    assert calls and records["forced"]["text"] == ""
    schemas = {f["function"]["name"]: f["function"]["parameters"] for f in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    thinking = records["thinking"]
    assert thinking["text"] == "" and thinking["reasoning"] == engine.tokenizer.decode(thinking["token_ids"]).strip()
    assert "reasoning" not in records["not thinking"]
    assert records["not thinking"]["text"] == engine.tokenizer.decode(records["not thinking"]["token_ids"])


def test_the_routes_answer_without_v1_as_llama_server_s_do(url):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    replies = [httpx.post(url + path, json=body, headers=auth, timeout=120).json() for path in
               ("/v1/chat/completions", "/chat/completions")]
    assert replies[0]["moedesk"]["token_ids"] == replies[1]["moedesk"]["token_ids"]
    prompt = {"model": "tiny", "prompt": "Hello", "temperature": 0, "max_tokens": 3}
    assert httpx.post(url + "/completions", json=prompt, headers=auth, timeout=120).json()["choices"][0]["text"] == \
        httpx.post(url + "/v1/completions", json=prompt, headers=auth, timeout=120).json()["choices"][0]["text"]
    assert httpx.get(url + "/models", headers=auth).json() == httpx.get(url + "/v1/models", headers=auth).json()
    # Streamed, the first delta names the role with a null content, and no later content delta is empty.
    with httpx.stream("POST", url + "/chat/completions", json={**body, "stream": True}, headers=auth,
                      timeout=120) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert all(d.get("content") is None or d["content"] for d in deltas)
