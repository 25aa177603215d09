"""What a chat model's reply holds: its reasoning, its answer and its tool calls, told apart by the markup its
family writes (read from its chat template), as a whole reply.

Families (`ReplyFormat.tools`):
- "tagged": `<tool_call>...</tool_call>` blocks holding JSON {"name", "arguments"} (Hermes, Qwen2.5/3), a
  `<function=NAME><parameter=K>V</parameter></function>` body (Qwen3-Coder) or `NAME<arg_key>K</arg_key>
  <arg_value>V</arg_value>` (GLM-4.5);
- "llama3": the reply is a JSON object {"name", "parameters"} (after `<|python_tag|>` or alone);
- "mistral": `[TOOL_CALLS]` then a JSON list, or `NAME[ARGS]{...}` per call (newer tokenizers);
- "deepseek": `<｜tool▁calls▁begin｜>` blocks of `function<｜tool▁sep｜>NAME` + a fenced JSON (V3, R1) or
  `NAME<｜tool▁sep｜>{...}` (V3.1);
- "harmony": gpt-oss's channels: analysis is reasoning, final the answer, `to=functions.NAME` a call;
- "calls": the whole reply is a JSON list [{"name", "arguments"}, ...] (a reply the grammar forced to call).
Reasoning sits between `<think>` and `</think>` (Qwen3, DeepSeek-R1, GLM), `[THINK]`...`[/THINK]` (Magistral)
or in harmony's analysis channel; a prompt that ends inside an open think tag (DeepSeek-R1's template writes
it) starts the reply in reasoning.

Harmony's and Mistral's markers are special tokens: those replies are parsed from text decoded with special
tokens kept (`ReplyFormat.keeps_special_tokens`).

A stream is read as it arrives by engine/load/reply_stream.py, which knows the same markup and ends with this
parse of the whole reply. A call's arguments are the model's own text where it wrote a JSON object, so a stream's
fragments of them add up to exactly the whole reply's arguments.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from moedesk.engine.load.json_scan import loads, member_span, split_top_level

THINK_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's API carries it


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its name in the call's first piece only, then the next text of its arguments."""

    index: int
    name: str | None
    arguments: str


@dataclass(frozen=True)
class Parsed:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # whole calls
    call_deltas: tuple[CallDelta, ...] = ()  # a stream's new call pieces (ReplyStream only)


@dataclass(frozen=True)
class ReplyFormat:
    """How one model family marks reasoning and tool calls (None: it does not)."""

    think: tuple[str, str] | None = None
    tools: str | None = None  # "tagged", "llama3", "mistral", "deepseek", "harmony", "calls"

    @property
    def keeps_special_tokens(self) -> bool:
        return self.tools in ("harmony", "mistral")

    @property
    def plain(self) -> bool:
        return self.think is None and self.tools is None


PLAIN = ReplyFormat()
CALL_LIST = ReplyFormat(None, "calls")


def detect_format(chat_template: str | None) -> ReplyFormat:
    """The reply format a chat template's model writes, from the markup the template itself knows."""
    t = chat_template or ""
    if "<|channel|>" in t:
        return ReplyFormat(None, "harmony")  # its reasoning is a channel, not a tag
    think = next((pair for pair in THINK_TAGS if pair[1] in t), None)
    if "tool▁calls▁begin" in t:
        tools = "deepseek"
    elif "[TOOL_CALLS]" in t:
        tools = "mistral"
    elif "<tool_call>" in t:
        tools = "tagged"
    elif "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        tools = "llama3"
    else:
        tools = None
    return ReplyFormat(think, tools)


def starts_in_reasoning(fmt: ReplyFormat, prompt: str) -> bool:
    """Whether the rendered prompt leaves the reply inside an open think tag (the template wrote `<think>`)."""
    if fmt.think is None:
        return False
    return prompt.rstrip().endswith(fmt.think[0])


def parse_reply(text: str, fmt: ReplyFormat, *, in_reasoning: bool = False, tools: bool = True) -> Parsed:
    """The reasoning, answer and tool calls of a whole reply (tools=False: the request offered none, so nothing is a
    call). A stream is read as it arrives by engine/load/reply_stream.py, which ends with this parse."""
    if fmt.tools == "harmony":
        return _harmony(text, tools)
    reasoning, rest = "", text
    if fmt.think is not None:
        reasoning, rest, open_ = _split_think(text, fmt.think, in_reasoning)
        if open_:
            return Parsed(reasoning, "", ())
    if not tools or fmt.tools is None:
        return Parsed(reasoning, rest, ())
    content, calls = _TOOL_PARSERS[fmt.tools](rest)
    return Parsed(reasoning, content, tuple(calls))


# --- reasoning ---------------------------------------------------------------------------------------------

def _split_think(text: str, tags: tuple[str, str], in_reasoning: bool):
    """(reasoning, rest, still_open)."""
    opening, closing = tags
    body = text
    if not in_reasoning:
        stripped = text.lstrip()
        if not stripped.startswith(opening):
            return "", text, False
        body = stripped[len(opening):]
    end = body.find(closing)
    if end < 0:  # cut short while thinking
        return body.strip(), "", True
    return body[:end].strip(), body[end + len(closing):].lstrip(), False


# --- tool-call families --------------------------------------------------------------------------------------

def arguments_text(value) -> str | None:
    """A call's arguments as the text of a JSON object (None when they are not one): the model's own text when it
    wrote one, so that a stream's fragments add up to it."""
    if isinstance(value, str):
        text = value.strip()
        value = loads(text)
        if isinstance(value, dict):
            return text
    if value is None:
        value = {}
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def json_call(text: str) -> ToolCall | None:
    """A call written as the JSON object {"name", "arguments" (or "parameters")}."""
    obj = loads(text)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    span = member_span(text, key)
    if isinstance(obj.get(key), dict) and span is not None:
        return ToolCall(obj["name"], text[span[0]:span[1]])
    args = arguments_text(obj.get(key))
    return None if args is None else ToolCall(obj["name"], args)


def _json_list(text: str) -> list | None:
    """Calls written as a JSON list of {"name", "arguments"} (Mistral's, and a reply forced to call); None when the
    text is not a JSON list."""
    body = text.strip()
    if not body.startswith("[") or not isinstance(loads(body), list):
        return None
    items = split_top_level(body[1:], ",")
    if items and items[-1].endswith("]"):
        items[-1] = items[-1][:-1].strip()  # the list's own closing bracket
        items = [item for item in items if item]
    return [json_call(item) for item in items]


def _calls(text: str):
    calls = _json_list(text)
    return ("", calls) if calls and all(calls) else (text, [])


def _scalar(text: str):
    """A parameter value written as text: JSON where it reads as JSON, else the string itself."""
    value = loads(text)
    return text if value is None and text.strip() != "null" else value


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def tagged_body(body: str) -> ToolCall | None:
    """The call a `<tool_call>` block holds: JSON, Qwen3-Coder's `<function=...>` or GLM-4.5's `NAME<arg_key>`."""
    body = body.strip()
    if body.startswith("{"):
        return json_call(body)
    match = _FUNCTION.match(body)
    if match:  # Qwen3-Coder
        args = {k: _scalar(v) for k, v in _PARAMETER.findall(match.group(2))}
        return ToolCall(match.group(1), json.dumps(args, ensure_ascii=False))
    name, _, rest = body.partition("<arg_key>")  # GLM-4.5
    name = name.strip()
    if name and not any(c in name for c in "<>{}\n"):
        args = {k.strip(): _scalar(v) for k, v in _ARG.findall("<arg_key>" + rest)} if rest else {}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    return None


def _tagged(text: str):
    content, calls, pos = [], [], 0
    while True:
        start = text.find("<tool_call>", pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        end = text.find("</tool_call>", start)
        if end < 0:  # cut short: keep what the model wrote rather than lose it
            call = tagged_body(text[start + len("<tool_call>"):])
            calls.append(call) if call else content.append(text[start:])
            break
        call = tagged_body(text[start + len("<tool_call>"):end])
        calls.append(call) if call else content.append(text[start:end + len("</tool_call>")])
        pos = end + len("</tool_call>")
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def _llama3(text: str):
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>"):].strip()
    if body.startswith("{") or tagged:
        calls = [json_call(part) for part in split_top_level(body, ";")]
        if calls and all(calls):
            return "", calls
    return text, []


def _mistral(text: str):
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    body = text[start + len("[TOOL_CALLS]"):].strip()
    if body.startswith("["):
        calls = _json_list(body) or [None]
    else:  # NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}
        calls = []
        for piece in body.split("[TOOL_CALLS]"):
            name, sep, args = piece.partition("[ARGS]")
            name = name.split("[CALL_ID]")[0].strip()
            args = arguments_text(args.strip()) if sep else None
            calls.append(ToolCall(name, args) if name and args is not None else None)
    if calls and all(calls):
        return text[:start].strip(), calls
    return text, []


_DS_FENCED = re.compile(r"^\s*(?:function)?\s*" + re.escape(DS_SEP) + r"\s*([^\n]+)\n```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def deepseek_block(block: str) -> ToolCall | None:
    """The call between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`."""
    fenced = _DS_FENCED.match(block)
    if fenced:
        name, args = fenced.group(1).strip(), arguments_text(fenced.group(2))
    else:
        name, _, args = block.partition(DS_SEP)
        name, args = name.strip(), arguments_text(args.strip())
    return ToolCall(name, args) if name and args is not None else None


def _deepseek(text: str):
    start = text.find(DS_CALLS)
    if start < 0:
        return text, []
    end = text.find(DS_CALLS_END, start)
    blocks = text[start + len(DS_CALLS):end if end >= 0 else len(text)].split(DS_CALL)[1:]
    calls = [deepseek_block(block.split(DS_CALL_END)[0]) for block in blocks]
    if calls and all(calls):
        return text[:start].strip(), calls
    return text, []


_TOOL_PARSERS = {"tagged": _tagged, "llama3": _llama3, "mistral": _mistral, "deepseek": _deepseek, "calls": _calls}

# --- gpt-oss harmony -------------------------------------------------------------------------------------------

HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def _harmony(text: str, tools: bool) -> Parsed:
    reasoning, content, calls = [], [], []
    for i, message in enumerate(text.split("<|start|>")):
        header, sep, body = message.partition("<|message|>")
        if not sep:
            if i == 0 and "<|channel|>" not in header:
                content.append(header)  # no channels at all: the whole reply is the answer
            continue
        for end in HARMONY_ENDS:
            body = body.split(end)[0]
        recipient = RECIPIENT.search(header)
        if recipient and tools:
            args = arguments_text(body.strip())
            calls.append(ToolCall(recipient.group(1), args)) if args is not None else content.append(body)
            continue
        (reasoning if "<|channel|>analysis" in header else content).append(body)
    return Parsed("".join(reasoning).strip(), "".join(content), tuple(calls))
