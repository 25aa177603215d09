"""gpt-oss's harmony format end to end through `moedesk serve`: a tiny random gpt_oss checkpoint (transformers) whose
tokenizer has harmony's special tokens and no chat template gets moedesk's harmony template; reasoning_effort reaches
it; the analysis channel comes back as reasoning apart from the answer, and a commentary call as a tool call.

A random model never writes harmony's markup by itself, so these replies are forced: a grammar whose only sentence
is the reply's tokens (llguidance, as structured output uses it) stands in for the engine's response_format grammar,
and the real model decodes under it token by token through the server's whole path (template, scheduler, raw decode
with special tokens kept, the reply parser, the streams)."""
import json

import httpx
import openai
import pytest

from moedesk.engine.generation.sampling import Grammar
from moedesk.engine.load.harmony import HARMONY_TEMPLATE
from moedesk.engine.runtime import Engine
from tests import tiny_models
from tests.app.test_server import running_server

KEY = "sk-harmony"
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
RETURN, CALL = 3 + HARMONY_TOKENS.index("<|return|>"), 3 + HARMONY_TOKENS.index("<|call|>")  # after SPECIAL's 3
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "<|channel|>analysis<|message|>The user wants weather.<|end|>"
ANSWERED = THOUGHT + "<|start|>assistant<|channel|>final<|message|>Sunny, 21 C."
CALLED = THOUGHT + ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                    '{"city": "Paris", "days": 2}')
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_models.build("gpt_oss", tmp_path_factory.mktemp("harmony"), chat_template=None,
                             special_tokens=HARMONY_TOKENS, eos_token="<|return|>", eos_token_id=[RETURN, CALL],
                             max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engine(folder):
    return Engine.load(str(folder), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def url(engine):
    with running_server(engine, api_key=KEY, model_name="oss") as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture
def forced(engine, monkeypatch):
    """forced(text): the next requests with a response_format decode exactly `text`'s tokens, then stop."""
    import llguidance

    def force(text):
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " ".join(f"<[{i}]>" for i in ids))
        engine.grammar({"type": "text"})  # builds the engine's own llguidance tokenizer
        fixed = Grammar(engine._grammar_tokenizer, grammar, engine.vocab_size, {RETURN, CALL})
        monkeypatch.setattr(engine, "grammar", lambda response_format: fixed)
    return force


FORCE = {"response_format": {"type": "json_object"}}  # what makes the server ask the engine for its grammar


def test_a_gpt_oss_model_without_a_template_gets_harmonys(engine):
    tokenizer = engine.tokenizer
    assert tokenizer.chat_template == HARMONY_TEMPLATE and tokenizer.reply_format.tools == "harmony"
    prompt = tokenizer.render_chat(ASK, tools=[WEATHER], reasoning_effort="high")
    assert prompt.startswith("<|start|>system<|message|>") and "\nReasoning: high\n" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n" \
           "namespace functions {\n\n// The weather in a city\ntype get_weather = (_: {\ncity: string,\ndays?: " \
           "number,\n}) => any;\n\n} // namespace functions<|end|>" in prompt
    assert prompt.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    # Its special tokens are single tokens, as the model was trained with them.
    assert tokenizer.encode("<|channel|>", add_special_tokens=False) == [3 + HARMONY_TOKENS.index("<|channel|>")]


def test_a_streamed_reply_is_decoded_a_token_at_a_time_with_its_special_tokens_kept(engine):
    """The server and the app read a harmony reply from text decoded a token at a time (not all its ids again for
    each): it is the whole decode, special tokens kept, or without them when asked so."""
    ids = engine.tokenizer.encode(CALLED + "<|call|>", add_special_tokens=False)
    for skip in (False, True):
        decoder = engine.tokenizer.stream_decoder(skip_special_tokens=skip)
        assert "".join(decoder.step(i) for i in ids) == engine.tokenizer.decode(ids, skip_special_tokens=skip)
    assert engine.tokenizer.decode(ids, skip_special_tokens=False) == CALLED + "<|call|>"


def test_a_tool_turn_goes_back_as_harmony_writes_it(engine):
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    turns = ASK + [{"role": "assistant", "content": "", "reasoning_content": "Need weather.", "tool_calls": calls},
                   {"role": "tool", "content": "sunny"}]
    prompt = engine.tokenizer.render_chat(turns, tools=[WEATHER])
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant")
    # an earlier answer's reasoning is dropped once the user has spoken again
    later = turns + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    assert "Need weather." not in engine.tokenizer.render_chat(later, tools=[WEATHER])


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_reasoning_effort_reaches_the_template(client, engine, effort):
    reply = client.chat.completions.create(model="oss", messages=ASK, reasoning_effort=effort, max_tokens=1)
    prompt = engine.tokenizer.render_chat(ASK, reasoning_effort=effort)
    assert f"\nReasoning: {effort}\n" in prompt
    assert reply.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    responses = client.responses.create(model="oss", input=ASK[1:], instructions=ASK[0]["content"],
                                        reasoning={"effort": effort}, max_output_tokens=1)
    assert responses.usage.input_tokens == reply.usage.prompt_tokens


def test_each_effort_is_its_own_prompt(client):
    counts = {e: client.chat.completions.create(model="oss", messages=ASK, reasoning_effort=e, max_tokens=1
                                                ).usage.prompt_tokens for e in ("low", "medium")}
    assert counts["low"] != counts["medium"]


def test_the_effort_reaches_the_template_through_every_api_and_batch_lines(client, url, engine, folder, tmp_path):
    """reasoning_effort on chat, reasoning.effort on /v1/responses, Ollama's `think` level and a batch line's field:
    each gives the prompt the template writes for that effort."""
    from moedesk.app.cli import main

    ollama = pytest.importorskip("ollama")
    local = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    efforts = ("low", "high")
    expected = {e: len(engine.tokenizer.encode(engine.tokenizer.render_chat(ASK, reasoning_effort=e),
                                               add_special_tokens=False)) for e in efforts}
    assert expected["low"] != expected["high"]
    for effort in efforts:
        chat = client.chat.completions.create(model="oss", messages=ASK, reasoning_effort=effort, max_tokens=1)
        responses = client.responses.create(model="oss", input=ASK, reasoning={"effort": effort}, max_output_tokens=1)
        thought = local.chat(model="oss", messages=ASK, think=effort, options={"num_predict": 1})
        assert chat.usage.prompt_tokens == responses.usage.input_tokens == thought.prompt_eval_count == \
            expected[effort], effort
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": e, "messages": ASK, "reasoning_effort": e}) + "\n" for e in efforts))
    assert main(["batch", str(src), "-o", str(out), "--model", str(folder), "--device", "cpu", "--dtype", "float32",
                 "--max-new-tokens", "1"]) == 0
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert {e: records[e]["usage"]["prompt_tokens"] for e in efforts} == expected


def test_the_analysis_channel_comes_back_as_reasoning(client, forced):
    forced(ANSWERED)
    reply = client.chat.completions.create(model="oss", messages=ASK, max_tokens=200, temperature=0, **FORCE)
    [choice] = reply.choices
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    assert choice.message.content == "Sunny, 21 C." and choice.finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="oss", messages=ASK, max_tokens=200, temperature=0,
                                                 stream=True, **FORCE))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "The user wants weather."
    assert "".join(d.content or "" for d in deltas) == "Sunny, 21 C."
    assert not any("<|" in (d.content or "") + ((d.model_extra or {}).get("reasoning_content") or "")
                   for d in deltas)
    response = client.responses.create(model="oss", input=ASK, max_output_tokens=200, temperature=0,
                                       text={"format": {"type": "json_object"}})
    [reasoning, message] = response.output
    assert reasoning.content[0].text == "The user wants weather." and message.content[0].text == "Sunny, 21 C."


def test_a_commentary_call_is_a_tool_call_streamed_in_fragments(client, url, forced):
    forced(CALLED)
    reply = client.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0,
                                           **FORCE)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"]
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris", "days": 2}')
    body = {"model": "oss", "messages": ASK, "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
            "stream": True, **FORCE}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [p for c in chunks if c["choices"] for p in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert len(pieces) > 5 and "".join(p["function"]["arguments"] for p in pieces) == call.function.arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_calls_come_back_through_ollamas_api_and_the_responses_api(url, client, forced):
    """The same forced call through the official ollama client (arguments as an object, a streamed call whole in one
    line, as Ollama streams it) and through /v1/responses (a function_call item)."""
    ollama = pytest.importorskip("ollama")
    forced(CALLED)
    local = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    common = dict(model="oss", messages=ASK, tools=[WEATHER], format="json", options={"temperature": 0,
                                                                                       "num_predict": 200})
    reply = local.chat(**common)
    assert reply.message.thinking == "The user wants weather." and not reply.message.content
    [call] = reply.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris", "days": 2})
    parts = list(local.chat(**common, stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert parts[-1].done and "".join(p.message.thinking or "" for p in parts) == "The user wants weather."
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    response = client.responses.create(model="oss", input=ASK, tools=[tool], max_output_tokens=200, temperature=0,
                                       text={"format": {"type": "json_object"}})
    [reasoning, function_call] = response.output
    assert reasoning.type == "reasoning" and function_call.type == "function_call"
    assert (function_call.name, function_call.arguments) == ("get_weather", '{"city": "Paris", "days": 2}')
