"""A stream read as it arrives (engine/load/reply_stream.py): every family's long tool call, fed a character at a
time, gives what the whole reply's parse gives, and the characters the reader looks at grow linearly with the call."""
import json

import pytest

from moedesk.engine.load.reply_format import (CALL_LIST, DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP, PLAIN,
                                              ReplyFormat, ToolCall, parse_reply)
from moedesk.engine.load.reply_stream import ReplyStream

QWEN3 = ReplyFormat(("<think>", "</think>"), "tagged")
HARMONY = ReplyFormat(None, "harmony")


def code(lines: int) -> str:
    """Arguments' text with what a JSON scanner must not be fooled by: quotes, backslashes, brackets, markup-like
    characters and backticks inside strings."""
    line = 'print("a {b} [c]", \'\\\\n\', x<y and `z`) # é\n'
    return json.dumps({"path": "src/app.py", "code": line * lines, "flags": [1, {"deep": [True, None]}]},
                      ensure_ascii=False)


def replies(lines: int) -> dict:
    """(format, reply) of each family with one long call between reasoning or an answer and a short call."""
    args = code(lines)
    text = json.loads(args)["code"]
    return {
        "qwen3 json": (QWEN3, f'<think>\nLet me write it.\n</think>\n\nWriting.\n<tool_call>\n{{"name": "write", '
                              f'"arguments": {args}}}\n</tool_call>\n<tool_call>\n{{"name": "run", "arguments": {{}}}}'
                              f'\n</tool_call>'),
        "qwen3-coder xml": (QWEN3, f"<tool_call>\n<function=write>\n<parameter=path>\nsrc/app.py\n</parameter>\n"
                                   f"<parameter=code>\n{text}\n</parameter>\n</function>\n</tool_call>"),
        "glm-4.5": (QWEN3, f"<think>hm</think>\n<tool_call>write\n<arg_key>code</arg_key>\n<arg_value>{text}"
                           f"</arg_value>\n</tool_call>"),
        "llama 3": (ReplyFormat(None, "llama3"), f'<|python_tag|>{{"name": "write", "parameters": {args}}}; '
                                                 f'{{"name": "run", "parameters": {{}}}}'),
        "mistral list": (ReplyFormat(None, "mistral"), f'Sure. [TOOL_CALLS][{{"name": "write", "arguments": {args}}}, '
                                                       f'{{"name": "run", "arguments": {{}}}}]'),
        "mistral name[ARGS]": (ReplyFormat(("[THINK]", "[/THINK]"), "mistral"),
                               f"[THINK]code[/THINK][TOOL_CALLS]write[ARGS]{args}[TOOL_CALLS]run[ARGS]{{}}"),
        "deepseek v3 fenced": (ReplyFormat(None, "deepseek"),
                               f"Checking.{DS_CALLS}{DS_CALL}function{DS_SEP}write\n```json\n{args}\n```{DS_CALL_END}"
                               f"{DS_CALL}function{DS_SEP}run\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}"),
        "deepseek v3.1": (ReplyFormat(("<think>", "</think>"), "deepseek"),
                          f"<think>plan</think>{DS_CALLS}{DS_CALL}write{DS_SEP}{args}{DS_CALL_END}{DS_CALLS_END}"),
        "gpt-oss harmony": (HARMONY, f"<|channel|>analysis<|message|>Need to write.<|end|><|start|>assistant"
                                     f"<|channel|>commentary to=functions.write <|constrain|>json<|message|>{args}"
                                     f"<|call|>"),
        "a forced list": (CALL_LIST, f'[{{"name":"write","arguments":{args}}},{{"name":"run","arguments":{{}}}}]'),
    }


def streamed(fmt, text: str, step: int = 1):
    """What a stream fed `text` `step` characters at a time gives, added up: (reasoning, content, calls, the calls
    rebuilt from their deltas, the deltas of each call, characters read)."""
    stream = ReplyStream(fmt)
    news = [stream.update(text[:end]) for end in range(step, len(text), step)]
    news.append(stream.update(text, final=True))
    deltas = [d for new in news for d in new.call_deltas]
    names = {d.index: d.name for d in deltas if d.name is not None}
    rebuilt = [(names[i], "".join(d.arguments for d in deltas if d.index == i)) for i in sorted(names)]
    pieces = {i: [d for d in deltas if d.index == i] for i in names}
    return ("".join(n.reasoning for n in news), "".join(n.content for n in news),
            [c for n in news for c in n.tool_calls], rebuilt, pieces, stream.read)


@pytest.mark.parametrize("name", list(replies(1)))
def test_a_long_call_fed_a_character_at_a_time_gives_the_whole_replys_parse(name):
    fmt, text = replies(60)[name]  # arguments of about 3 KB
    whole = parse_reply(text, fmt)
    assert whole.tool_calls and len(whole.tool_calls[0].arguments) > 2500, whole
    reasoning, content, calls, rebuilt, pieces, _ = streamed(fmt, text)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    assert tuple(calls) == whole.tool_calls
    assert rebuilt == [(c.name, c.arguments) for c in whole.tool_calls]
    first = pieces[0]
    assert first[0].name == "write" and all(d.name is None for d in first[1:])
    if name in ("qwen3-coder xml", "glm-4.5"):  # arguments built from markup: the name, then the arguments whole
        assert [d.arguments for d in first] == ["", whole.tool_calls[0].arguments]
    else:  # the model's own JSON: fragments as it is written, never more than a few characters each
        assert len(first) > 2000 and max(len(d.arguments) for d in first[:-1]) <= 16, [d.arguments for d in first]


@pytest.mark.parametrize("name", list(replies(1)))
def test_the_characters_read_grow_linearly_with_the_call(name):
    fmt, short = replies(40)[name]
    _, long = replies(160)[name]
    per_char = [streamed(fmt, text)[-1] / len(text) for text in (short, long)]
    # re-reading the call per character would read ~len/2 characters per character: 4x as many for 4x the length;
    # here a character is read a bounded number of times (new, then as a possible start of the markers awaited)
    assert per_char[1] < 1.1 * per_char[0], per_char
    assert per_char[1] < 100, per_char


def test_the_count_sees_a_quadratic_reading():
    """The counter counts what the reader looks at: a stream given text it must wait on, whose whole re-read
    would be quadratic, is linear only because the reader resumes where it stood."""
    fmt, text = replies(80)["qwen3 json"]
    one = streamed(fmt, text)[-1]
    restarted = 0
    for end in range(1, len(text), 7):  # a fresh stream per prefix: everything read again each time
        stream = ReplyStream(fmt)
        stream.update(text[:end])
        restarted += stream.read
    assert restarted > 20 * one, (restarted, one)


@pytest.mark.parametrize("step", [1, 5, 64])
def test_plain_and_thinking_replies_stream_their_text(step):
    text = "<think>\n  a < b, [c]\n\n</think>\n\n  The answer <b>is</b> here.\n" * 3
    for fmt, tools in ((PLAIN, True), (QWEN3, True), (QWEN3, False)):
        whole = parse_reply(text, fmt, tools=tools)
        stream = ReplyStream(fmt, tools=tools)
        news = [stream.update(text[:end]) for end in range(step, len(text), step)] + [stream.update(text, True)]
        assert "".join(n.reasoning for n in news) == whole.reasoning
        assert "".join(n.content for n in news) == whole.content


def test_whitespace_the_whole_reply_strips_is_held_not_shown():
    text = '<think>\n\nplan\n\n</think>\n\nLet me check.\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    stream = ReplyStream(QWEN3)
    news = [stream.update(text[:end]) for end in range(1, len(text))] + [stream.update(text, final=True)]
    assert "".join(n.reasoning for n in news) == "plan"
    assert "".join(n.content for n in news) == "Let me check."
    assert all(not n.reasoning.isspace() and not n.content.isspace() for n in news)


def random_reply(rng) -> tuple[ReplyFormat, str]:
    """A well-formed reply of a random family: reasoning, text with markup-like pieces, one to three calls."""
    def words():
        return "".join(rng.choice(["a", "<b>", "x < y", " ", "\n", "[1]", "{", "}", "`c`", "é", "\n\n", "<tool",
                                   "[TOOL", "<|st"]) for _ in range(rng.randint(0, 8)))

    def args():
        return json.dumps({"k": words(), "n": [rng.randint(0, 9), {"z": words()}]}, ensure_ascii=rng.random() < 0.5)

    def think(tags=("<think>", "</think>")):
        return tags[0] + words() + tags[1] if rng.random() < 0.6 else ""

    n = range(rng.randint(1, 3))
    family = rng.randrange(9)
    if family == 0:
        return QWEN3, think() + words() + "".join(
            f'<tool_call>\n{{"name": "f{i}", "arguments": {args()}}}\n</tool_call>' + rng.choice(["", "\n"]) for i in n)
    if family == 1:
        return QWEN3, think() + "".join(f"<tool_call>f{i}\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>"
                                        for i in n)
    if family == 2:
        return ReplyFormat(None, "llama3"), rng.choice(["", "<|python_tag|>"]) + "; ".join(
            f'{{"name": "f{i}", "parameters": {args()}}}' for i in n)
    if family == 3:
        return ReplyFormat(None, "mistral"), words() + "[TOOL_CALLS][" + ", ".join(
            f'{{"name": "f{i}", "arguments": {args()}}}' for i in n) + "]"
    if family == 4:
        return ReplyFormat(("[THINK]", "[/THINK]"), "mistral"), think(("[THINK]", "[/THINK]")) + "".join(
            f"[TOOL_CALLS]f{i}[ARGS]{args()}" for i in n)
    if family == 5:
        return ReplyFormat(None, "deepseek"), words() + DS_CALLS + "".join(
            f"{DS_CALL}function{DS_SEP}f{i}\n```json\n{args()}\n```{DS_CALL_END}" for i in n) + DS_CALLS_END
    if family == 6:
        return ReplyFormat(("<think>", "</think>"), "deepseek"), think() + DS_CALLS + "".join(
            f"{DS_CALL}f{i}{DS_SEP}{args()}{DS_CALL_END}" for i in n) + DS_CALLS_END
    if family == 7:
        last = (f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args()}<|call|>"
                if rng.random() < 0.5 else f"<|channel|>final<|message|>{words()}<|return|>")
        return HARMONY, f"<|channel|>analysis<|message|>{words()}<|end|><|start|>assistant{last}"
    return CALL_LIST, "[" + ",".join(f'{{"name":"f{i}","arguments":{args()}}}' for i in n) + "]"


def test_random_replies_in_random_pieces_give_the_whole_replys_parse():
    import random

    rng = random.Random(43)
    for _ in range(400):
        fmt, text = random_reply(rng)
        whole = parse_reply(text, fmt)
        stream, news, end = ReplyStream(fmt), [], 0
        while end < len(text):
            end = min(len(text), end + rng.randint(1, 5))
            news.append(stream.update(text[:end]))
        news.append(stream.update(text, final=True))
        deltas = [d for new in news for d in new.call_deltas]
        names = {d.index: d.name for d in deltas if d.name is not None}
        rebuilt = tuple(ToolCall(names[i], "".join(d.arguments for d in deltas if d.index == i)) for i in sorted(names))
        assert "".join(n.reasoning for n in news) == whole.reasoning, text
        assert "".join(n.content for n in news).strip() == whole.content.strip(), text
        assert tuple(c for n in news for c in n.tool_calls) == whole.tool_calls == rebuilt, text
