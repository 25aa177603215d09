"""Reasoning, answer and tool calls told apart, per family, whole and streamed (engine/load/reply_format.py)."""
import json

import pytest

from moedesk.engine.load.reply_format import (CALL_LIST, DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP, PLAIN,
                                              Parsed, ReplyFormat, ToolCall, detect_format, parse_reply,
                                              starts_in_reasoning)
from moedesk.engine.load.reply_stream import ReplyStream

QWEN3 = ReplyFormat(("<think>", "</think>"), "tagged")
WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "days": 2}))

# (format, prompt ends inside <think>, reply text, what it holds)
CASES = {
    "qwen3 thinking then a call": (
        QWEN3, False,
        '<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
        Parsed("The user wants weather.", "Let me check.", (WEATHER,))),
    "qwen3 two parallel calls": (
        QWEN3, False,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        Parsed("", "", (WEATHER, ToolCall("get_time", "{}")))),
    "qwen3 answer only": (QWEN3, False, "<think>\n\n</think>\n\nHello <b>there</b>", Parsed("", "Hello <b>there</b>")),
    "deepseek-r1 prompt opened the think tag": (
        ReplyFormat(("<think>", "</think>"), "deepseek"), True, "Two plus two.\n</think>\n\nIt is 4.",
        Parsed("Two plus two.", "It is 4.")),
    "qwen3-coder xml parameters": (
        QWEN3, False,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>",
        Parsed("", "", (WEATHER,))),
    "glm-4.5 arg keys": (
        QWEN3, False,
        "<think>hm</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        Parsed("hm", "", (WEATHER,))),
    "llama 3.1 json": (
        ReplyFormat(None, "llama3"), False,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        Parsed("", "", (WEATHER,))),
    "llama 3 plain answer": (ReplyFormat(None, "llama3"), False, "Paris is sunny.", Parsed("", "Paris is sunny.")),
    "mistral v3 list": (
        ReplyFormat(None, "mistral"), False,
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
        Parsed("", "Sure.", (WEATHER,))),
    "mistral v11 name[ARGS]": (
        ReplyFormat(("[THINK]", "[/THINK]"), "mistral"), False,
        '[THINK]weather[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
        '[TOOL_CALLS]get_time[ARGS]{}',
        Parsed("weather", "", (WEATHER, ToolCall("get_time", "{}")))),
    "deepseek v3 fenced": (
        ReplyFormat(None, "deepseek"), False,
        f'Checking.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```'
        f'{DS_CALL_END}{DS_CALLS_END}',
        Parsed("", "Checking.", (WEATHER,))),
    "deepseek v3.1": (
        ReplyFormat(None, "deepseek"), False,
        f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris", "days": 2}}{DS_CALL_END}{DS_CALLS_END}',
        Parsed("", "", (WEATHER,))),
    "gpt-oss analysis and final": (
        ReplyFormat(None, "harmony"), False,
        "<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
        Parsed("Simple sum.", "It is 4.")),
    "gpt-oss call": (
        ReplyFormat(None, "harmony"), False,
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>',
        Parsed("Need weather.", "", (WEATHER,))),
    "a forced list of calls": (
        CALL_LIST, False, '[{"name":"get_weather","arguments":{"city": "Paris", "days": 2}},{"name":"get_time",'
        '"arguments":{}}]', Parsed("", "", (WEATHER, ToolCall("get_time", "{}")))),
    "a broken call stays text": (
        QWEN3, False, "<tool_call>\n{not json}\n</tool_call>", Parsed("", "<tool_call>\n{not json}\n</tool_call>")),
}


@pytest.mark.parametrize("name", CASES)
def test_a_whole_reply(name):
    fmt, opened, text, expected = CASES[name]
    assert parse_reply(text, fmt, in_reasoning=opened) == expected


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("name", CASES)
def test_a_stream_adds_up_to_the_whole_reply_and_never_shows_markup(name, step):
    fmt, opened, text, expected = CASES[name]
    stream = ReplyStream(fmt, in_reasoning=opened)
    reasoning, content, calls = "", "", []
    for end in range(step, len(text) + step, step):
        new = stream.update(text[:end], final=False)
        reasoning, content, calls = reasoning + new.reasoning, content + new.content, calls + list(new.tool_calls)
        # what was shown stays true of the whole reply: no tag piece leaks, nothing is taken back
        if name != "a broken call stays text":
            assert expected.content.startswith(content.strip()), (text[:end], content)
        assert expected.reasoning.startswith(reasoning.strip()), (text[:end], reasoning)
    new = stream.update(text, final=True)
    reasoning, content, calls = reasoning + new.reasoning, content + new.content, calls + list(new.tool_calls)
    assert reasoning.strip() == expected.reasoning
    assert content.strip() == expected.content
    assert tuple(calls) == expected.tool_calls


# The families whose arguments are the model's own JSON object: they stream in fragments as it is written.
FRAGMENTED = [name for name, (fmt, _, _, expected) in CASES.items() if expected.tool_calls and "xml" not in name
              and "glm" not in name]


@pytest.mark.parametrize("name", [name for name in CASES if CASES[name][3].tool_calls])
def test_streamed_calls_come_name_first_then_argument_fragments_adding_up_to_the_call(name):
    fmt, opened, text, expected = CASES[name]
    stream = ReplyStream(fmt, in_reasoning=opened)
    deltas = []
    for end in range(1, len(text) + 1):
        deltas += stream.update(text[:end]).call_deltas
    deltas += stream.update(text, final=True).call_deltas
    names = {d.index: d.name for d in deltas if d.name is not None}
    arguments = {i: "".join(d.arguments for d in deltas if d.index == i) for i in names}
    assert [ToolCall(names[i], arguments[i]) for i in sorted(names)] == list(expected.tool_calls)
    for i in names:  # the name comes once, in the call's first piece
        pieces = [d for d in deltas if d.index == i]
        assert pieces[0].name is not None and all(d.name is None for d in pieces[1:])
    weather = [d for d in deltas if d.index == 0]
    if name in FRAGMENTED:  # {"city": "Paris", "days": 2} arrives a character or so at a time
        assert len(weather) > 10, weather
    else:  # arguments built from the model's markup come whole, after the name
        assert len(weather) == 2 and weather[0].arguments == ""


def test_a_call_written_as_a_json_string_of_arguments_comes_whole():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    stream = ReplyStream(QWEN3)
    deltas = [d for end in range(1, len(text) + 1) for d in stream.update(text[:end]).call_deltas]
    deltas += stream.update(text, final=True).call_deltas
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", '{"a": 1}')]


def test_a_forced_list_cut_short_is_text_with_no_call():
    text = '[{"name":"get_weather","arguments":{"city": "Pa'
    assert parse_reply(text, CALL_LIST) == Parsed("", text)
    stream = ReplyStream(CALL_LIST)
    stream.update(text)
    assert stream.pending == ToolCall("get_weather", '{"city": "Pa')


def test_without_tools_offered_nothing_is_a_call():
    text = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    assert parse_reply(text, QWEN3, tools=False) == Parsed("", text)


def test_a_reply_cut_short_while_thinking_is_reasoning():
    assert parse_reply("<think>still going", QWEN3) == Parsed("still going", "")
    assert parse_reply("thinking on", QWEN3, in_reasoning=True) == Parsed("thinking on", "")


def test_plain_text_is_untouched_even_with_angle_brackets():
    for text in ("a < b and <think", "x\n</think> y"):
        assert parse_reply(text, PLAIN) == Parsed("", text)
        stream = ReplyStream(PLAIN)
        assert stream.update(text).content + stream.update(text, final=True).content == text


def test_the_format_is_read_from_the_template():
    assert detect_format(None) == PLAIN
    assert detect_format("{{ '<|im_start|>' }}") == PLAIN
    assert detect_format("{%- if tools %}<tool_call>{% endif %}{{ '<think>\\n\\n</think>' }}") == QWEN3
    assert detect_format("<|start_header_id|>ipython<|python_tag|>{{ tools }}").tools == "llama3"
    assert detect_format("[AVAILABLE_TOOLS][TOOL_CALLS]").tools == "mistral"
    assert detect_format("<｜tool▁calls▁begin｜></think>") == ReplyFormat(("<think>", "</think>"), "deepseek")
    assert detect_format("<|start|>assistant<|channel|>final<|message|>") == ReplyFormat(None, "harmony")
    assert detect_format("<|channel|>").keeps_special_tokens and not QWEN3.keeps_special_tokens


def test_a_prompt_ending_inside_a_think_tag_starts_in_reasoning():
    assert starts_in_reasoning(QWEN3, "<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning(PLAIN, "<think>\n")
