"""Anthropic's Messages API on `moedesk serve`, driven by the official anthropic client: replies equal the server's
own OpenAI chat answers to the same conversation, streamed events add up to the plain reply, tool use and tool
results map both ways, stop sequences are named, and errors come as Anthropic's types."""
import json

import jsonschema
import openai
import pytest

from moedesk.engine.runtime import Engine
from tests import tiny_models
from tests.app.test_server import KEY, running_server

anthropic = pytest.importorskip("anthropic")  # the test extras install it

ASK = [{"role": "user", "content": "The quick brown fox"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
LOOKUP = {"name": "lookup", "description": "Find a city", "input_schema": CITY}
GREEDY = {"temperature": 0}  # the anthropic client no longer has the field; servers that sample still take it


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny Qwen3-MoE whose template lists tools and opens a <think> block (tests/tiny_models.py)."""
    folder = tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("anthropic"),
                               chat_template=tiny_models.TOOLS_TEMPLATE, max_position_embeddings=2048)
    return Engine.load(str(folder), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def base(engine):
    with running_server(engine, api_key=KEY, batch_size=4, model_name="tiny") as url:
        yield url


@pytest.fixture
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture
def gpt(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=60, max_retries=0)


def test_a_reply_is_the_servers_chat_answer_plain_and_streamed(claude, gpt):
    reply = claude.messages.create(model="tiny", max_tokens=12, messages=ASK, system="Be brief.", extra_body=GREEDY)
    direct = gpt.chat.completions.create(model="tiny", max_tokens=12, temperature=0,
                                         messages=[{"role": "system", "content": "Be brief."}, *ASK])
    [block] = [b for b in reply.content if b.type == "text"]
    assert block.text == direct.choices[0].message.content and reply.role == "assistant" and reply.model == "tiny"
    thinking = [b.thinking for b in reply.content if b.type == "thinking"]
    assert thinking == ([direct.choices[0].message.reasoning_content]
                        if direct.choices[0].message.reasoning_content else [])
    assert reply.usage.input_tokens == direct.usage.prompt_tokens
    assert reply.usage.output_tokens == direct.usage.completion_tokens
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[direct.choices[0].finish_reason]
    with claude.messages.stream(model="tiny", max_tokens=12, messages=ASK, system="Be brief.", extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == block.text and final.stop_reason == reply.stop_reason
    assert [b.thinking for b in final.content if b.type == "thinking"] == thinking
    # thinking disabled reaches the template: the same kind of reply is then the answer
    off = claude.messages.create(model="tiny", max_tokens=12, messages=ASK, extra_body=GREEDY,
                                 thinking={"type": "disabled"})
    direct = gpt.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=ASK,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert direct.choices[0].message.content and [b.text for b in off.content] == [direct.choices[0].message.content]
    assert final.usage.output_tokens == reply.usage.output_tokens


def test_tool_use_and_tool_results_map_both_ways(claude, gpt):
    forced = dict(model="tiny", max_tokens=120, extra_body=GREEDY, messages=ASK, tools=[LOOKUP],
                  tool_choice={"type": "tool", "name": "lookup"})
    reply = claude.messages.create(**forced)
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "lookup" and reply.stop_reason == "tool_use" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY)
    with claude.messages.stream(**forced) as s:
        final = s.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == use.input and final.stop_reason == "tool_use"
    # the call and its result sent back: the same prompt as the OpenAI form of that conversation
    turns = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                                      {"type": "tool_use", "id": "toolu_1", "name": "lookup",
                                                       "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                          {"type": "text", "text": "And?"}]}]
    back = claude.messages.create(model="tiny", max_tokens=4, extra_body=GREEDY, messages=turns, tools=[LOOKUP])
    direct = gpt.chat.completions.create(model="tiny", max_tokens=4, temperature=0, tools=[
        {"type": "function", "function": {"name": "lookup", "description": "Find a city", "parameters": CITY}}],
        messages=[*ASK, {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}, {"role": "user", "content": "And?"}])
    assert back.usage.input_tokens == direct.usage.prompt_tokens
    assert claude.messages.count_tokens(model="tiny", messages=turns, tools=[LOOKUP]).input_tokens == \
        direct.usage.prompt_tokens
    assert [b.text for b in back.content if b.type == "text"] == [direct.choices[0].message.content]


def test_a_stop_sequence_is_named(claude):
    plain = dict(model="tiny", max_tokens=16, messages=ASK, extra_body=GREEDY, thinking={"type": "disabled"})
    [text] = [b.text for b in claude.messages.create(**plain).content]  # no thinking: the template's switch is off
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text.find(text[i:i + 2]) == i and text[i:i + 2].strip())
    reply = claude.messages.create(**plain, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert [b.text for b in reply.content] == [text[:text.find(stop)]]


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(model="tiny", max_tokens=0, messages=ASK), "BadRequestError", "max_tokens"),
    (dict(model="nope", max_tokens=4, messages=ASK), "NotFoundError", "does not exist"),
    (dict(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]),
     "BadRequestError", "blocks of type 'image' are not supported"),
    (dict(model="tiny", max_tokens=4, messages=ASK, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     "BadRequestError", "only custom tools"),
    (dict(model="tiny", max_tokens=4, messages=ASK, output_config={"format": {"type": "xml"}}), "BadRequestError",
     "output_config.format"),
])
def test_errors_come_as_anthropics_types(claude, kwargs, error, words):
    with pytest.raises(getattr(anthropic, error)) as e:
        claude.messages.create(**kwargs)
    assert words in e.value.body["error"]["message"] and e.value.body["type"] == "error"


def test_the_key_goes_as_x_api_key_and_a_wrong_one_is_refused(base):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=1, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert json.loads(json.dumps(e.value.body))["error"]["message"].startswith("Incorrect or missing API key")


def test_output_config_format_constrains_the_reply_to_its_schema(claude):
    reply = claude.messages.create(model="tiny", max_tokens=120, messages=ASK, extra_body=GREEDY,
                                   thinking={"type": "disabled"},
                                   output_config={"format": {"type": "json_schema", "schema": CITY}})
    [text] = [b.text for b in reply.content]
    jsonschema.validate(json.loads(text), CITY)
