"""What a chat model's reply holds: its reasoning, its answer and its tool calls, told apart by the markup its
family writes (read from its chat template), as a whole reply or as a stream.

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

A stream is parsed by parsing its whole text so far again with `partial=True`, which holds back anything that
may still turn into markup (a tail that could begin a tag, a call not yet closed): one parser serves both ways,
at a cost per token that grows with the reply but stays small next to a decode step (docs/measurements.md).
A call still being written is the parse's `pending` call (its name, and its arguments' text so far), so a stream
gives a call's name first and then its arguments in fragments as the model writes them (`CallDelta`, as OpenAI
streams them). A call's arguments are the model's own text where it wrote a JSON object, so the fragments add up
to exactly the whole reply's arguments. A stream cannot take back a call it began: one the final parse does not
read as a call (its JSON never closed into an object) stays begun in the stream while the whole reply has it as text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

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
    pending: ToolCall | None = None  # a partial parse's call still being written (its arguments so far)
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


def parse_reply(text: str, fmt: ReplyFormat, *, in_reasoning: bool = False, tools: bool = True,
                partial: bool = False) -> Parsed:
    """The reasoning, answer and tool calls of `text` (tools=False: the request offered none, so nothing is a
    call). partial: `text` is a stream's prefix; what may still become markup is held back."""
    if fmt.tools == "harmony":
        return _harmony(text, tools, partial)
    reasoning, rest = "", text
    if fmt.think is not None:
        reasoning, rest, open_ = _split_think(text, fmt.think, in_reasoning, partial)
        if open_:
            return Parsed(reasoning, "", ())
    if not tools or fmt.tools is None:
        return Parsed(reasoning, _hold(rest, (), partial), ())
    content, calls, pending = _TOOL_PARSERS[fmt.tools](rest, partial)
    return Parsed(reasoning, content, tuple(calls), pending if partial else None)


class ReplyStream:
    """Feeds a streamed reply's text (its whole text so far, as the engine's updates carry it) and gives what is
    new each time: reasoning and answer pieces, tool calls once each is whole, and the calls' pieces as they are
    written (`call_deltas`)."""

    def __init__(self, fmt: ReplyFormat, *, in_reasoning: bool = False, tools: bool = True):
        self.fmt, self.in_reasoning, self.tools = fmt, in_reasoning, tools
        self.shown = Parsed()
        self.sent: dict[int, str] = {}  # each begun call's arguments text sent so far

    def update(self, text: str, final: bool = False) -> Parsed:
        now = parse_reply(text, self.fmt, in_reasoning=self.in_reasoning, tools=self.tools, partial=not final)
        first = len(self.shown.tool_calls)
        calls = now.tool_calls[first:]
        deltas = [d for i, call in enumerate(calls, first) for d in self._delta(i, call)]
        if now.pending is not None:
            deltas += self._delta(len(now.tool_calls), now.pending)
        new = Parsed(_grown(self.shown.reasoning, now.reasoning), _grown(self.shown.content, now.content), calls,
                     call_deltas=tuple(deltas))
        self.shown = Parsed(self.shown.reasoning + new.reasoning, self.shown.content + new.content,
                            self.shown.tool_calls + new.tool_calls)
        return new

    def _delta(self, index: int, call: ToolCall) -> list[CallDelta]:
        sent = self.sent.get(index)
        if sent is None:
            self.sent[index] = call.arguments
            return [CallDelta(index, call.name, call.arguments)]
        if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
            self.sent[index] = call.arguments
            return [CallDelta(index, None, call.arguments[len(sent):])]
        return []  # nothing new, or (a final parse that reads the call otherwise) nothing a stream can send


def _grown(before: str, now: str) -> str:
    # A final parse may place text differently from the held-back partial one (a lone "<tool" that never became
    # a tag); a stream cannot take back what it sent, so only an extension is new.
    return now[len(before):] if now.startswith(before) else ""


# --- reasoning ---------------------------------------------------------------------------------------------

def _split_think(text: str, tags: tuple[str, str], in_reasoning: bool, partial: bool):
    """(reasoning, rest, still_open)."""
    opening, closing = tags
    body = text
    if not in_reasoning:
        stripped = text.lstrip()
        if stripped.startswith(opening):
            body = stripped[len(opening):]
        elif partial and stripped and opening.startswith(stripped):
            return "", "", True  # may be the opening tag still arriving
        else:
            return "", text, False
    end = body.find(closing)
    if end < 0:  # still thinking (or, in a whole reply, cut short while thinking)
        return (_hold(body, (closing,), True).lstrip() if partial else body.strip()), "", True
    return body[:end].strip(), body[end + len(closing):].lstrip(), False


def _hold(text: str, markers, partial: bool) -> str:
    """text less, while partial, a tail that may be the start of one of `markers` (or of any tag-like markup)."""
    if not partial:
        return text
    cut = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


# --- tool-call families --------------------------------------------------------------------------------------

def _arguments(value) -> str | None:
    """A call's arguments as the text of a JSON object (None when they are not one): the model's own text when it
    wrote one, so that a stream's fragments add up to it."""
    if isinstance(value, str):
        text = value.strip()
        value = _loads(text)
        if isinstance(value, dict):
            return text
    if value is None:
        value = {}
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


# A JSON value's extent, scanned without parsing it, for calls still being written: the regex engine skips whole
# strings (a call's arguments are mostly one long string of code or text), Python only counts brackets.
_WS = re.compile(r"\s*")
_SCALAR = re.compile(r"[^,}\]\s]*")
_STRING = r'"(?:[^"\\]++|\\.)*+"'
_STRUCTURE = re.compile(_STRING + r'|"|[{}\[\]]')  # a lone '"' is a string not yet closed


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value that begins at text[i] ends (just past it); None when the text ends first."""
    if text[i] not in "{[\"":
        end = _SCALAR.match(text, i).end()
        return end if end < len(text) else None
    depth = 0
    for match in _STRUCTURE.finditer(text, i):
        token = match.group()
        if token == '"':
            return None
        if token[0] in "{[":
            depth += 1
        elif token[0] in "}]":
            depth -= 1
        if depth == 0:
            return match.end()
    return None


def _members(text: str) -> dict:
    """The members of the JSON object `text` begins with, as far as it is written: {key: (start, end)} of each
    value's text, end None for the one still being written."""
    members: dict = {}
    i = _WS.match(text).end()
    if not text.startswith("{", i):
        return members
    i += 1
    while True:
        i = _WS.match(text, i).end()
        if not text.startswith('"', i):
            return members
        end = _value_end(text, i)
        if end is None:
            return members
        key, i = _loads(text[i:end]), _WS.match(text, end).end()
        if not text.startswith(":", i):
            return members
        i = _WS.match(text, i + 1).end()
        if i >= len(text):
            return members
        end = _value_end(text, i)
        members[key] = (i, end)
        if end is None:
            return members
        i = _WS.match(text, end).end()
        if not text.startswith(",", i):
            return members
        i += 1


def _object_prefix(text: str) -> str | None:
    """The JSON object `text` begins with, or as much of it as is written (None: it does not begin with one)."""
    text = text.lstrip()
    if not text.startswith("{"):
        return None
    end = _value_end(text, 0)
    return text if end is None else text[:end]


def _json_call(text: str) -> ToolCall | None:
    """A call written as the JSON object {"name", "arguments" (or "parameters")}."""
    obj = _loads(text)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    span = _members(text).get(key)
    if isinstance(obj.get(key), dict) and span is not None and span[1] is not None:
        return ToolCall(obj["name"], text[span[0]:span[1]])
    args = _arguments(obj.get(key))
    return None if args is None else ToolCall(obj["name"], args)


def _pending_json_call(text: str) -> ToolCall | None:
    """A {"name", "arguments"} call still being written, once its name is whole and its arguments object begun."""
    members = _members(text)
    name, args = members.get("name"), members.get("arguments", members.get("parameters"))
    if name is None or name[1] is None or args is None or not text.startswith("{", args[0]):
        return None
    name = _loads(text[name[0]:name[1]])
    return ToolCall(name, text[args[0]:args[1]] if args[1] is not None else text[args[0]:]) \
        if isinstance(name, str) else None


def _json_list(text: str, partial: bool):
    """Calls written as a JSON list of {"name", "arguments"} (Mistral's, and a reply forced to call): (calls, the
    pending one); calls None when the list is not one of calls."""
    body = text.strip()
    if not body.startswith("["):
        return None, None
    if not partial and not isinstance(_loads(body), list):
        return None, None
    items = _split_top_level(body[1:], ",")
    if items and items[-1].endswith("]") and (not partial or _value_end(body, 0) is not None):
        items[-1] = items[-1][:-1].strip()  # the list's own closing bracket
        items = [item for item in items if item]
    elif partial and items:
        return [_json_call(item) for item in items[:-1]], _pending_json_call(items[-1])
    calls = [_json_call(item) for item in items]
    return calls, None


def _calls(text: str, partial: bool):
    calls, pending = _json_list(text, partial)
    if partial:
        return "", [c for c in calls or () if c], pending
    if calls and all(calls):
        return "", calls, None
    return text, [], None


def _scalar(text: str):
    """A parameter value written as text: JSON where it reads as JSON, else the string itself."""
    value = _loads(text)
    return text if value is None and text.strip() != "null" else value


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _tagged_body(body: str) -> ToolCall | None:
    body = body.strip()
    if body.startswith("{"):
        return _json_call(body)
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


def _pending_tagged(body: str) -> ToolCall | None:
    body = body.strip()
    if body.startswith("{"):
        return _pending_json_call(body)
    # Qwen3-Coder's and GLM's arguments are built from their markup: they come whole, the name first
    match = re.match(r"<function=([^>\s]+)>", body)
    if match:
        return ToolCall(match.group(1), "")
    name, sep, _ = body.partition("<arg_key>")
    name = name.strip()
    return ToolCall(name, "") if sep and name and not any(c in name for c in "<>{}\n") else None


def _tagged(text: str, partial: bool):
    content, calls, pos, pending = [], [], 0, None
    while True:
        start = text.find("<tool_call>", pos)
        if start < 0:
            content.append(_hold(text[pos:], ("<tool_call>",), partial))
            break
        content.append(text[pos:start])
        end = text.find("</tool_call>", start)
        if end < 0:
            if partial:
                pending = _pending_tagged(text[start + len("<tool_call>"):])
            else:  # cut short: keep what the model wrote rather than lose it
                call = _tagged_body(text[start + len("<tool_call>"):])
                calls.append(call) if call else content.append(text[start:])
            break
        call = _tagged_body(text[start + len("<tool_call>"):end])
        calls.append(call) if call else content.append(text[start:end + len("</tool_call>")])
        pos = end + len("</tool_call>")
    return _joined(content, calls), calls, pending


def _joined(content: list[str], calls: list) -> str:
    text = "".join(content)
    return text.strip() if calls else text


def _llama3(text: str, partial: bool):
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>"):].strip()
    if body.startswith("{") or tagged or (partial and body and "<|python_tag|>".startswith(body)):
        parts = _split_top_level(body, ";")
        if partial:  # a call is JSON: nothing to show but the calls, whole or being written
            whole = [_json_call(part) for part in parts[:-1]]
            if all(whole) and parts:
                return "", whole, _pending_json_call(parts[-1])
            return "", [], None
        calls = [_json_call(part) for part in parts]
        if calls and all(calls):
            return "", calls, None
    return text, [], None


def _split_top_level(text: str, separator: str) -> list[str]:
    """JSON values written one after another, split where `separator` stands outside any bracket or string."""
    parts, depth, start = [], 0, 0
    for match in re.finditer(_STRING + r'|"|[{}\[\]' + re.escape(separator) + "]", text):
        token = match.group()
        if token == '"':
            break  # a string not yet closed: the rest is one part
        if token[0] in "{[":
            depth += 1
        elif token[0] in "}]":
            depth -= 1
        elif token == separator and depth == 0:
            parts.append(text[start:match.start()])
            start = match.end()
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _mistral(text: str, partial: bool):
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return _hold(text, ("[TOOL_CALLS]",), partial), [], None
    content = text[:start]
    body, calls, pending = text[start + len("[TOOL_CALLS]"):].strip(), [], None
    if body.startswith("["):
        calls, pending = _json_list(body, partial)
        calls = calls or [None]
    else:  # NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}
        pieces = body.split("[TOOL_CALLS]")
        for i, piece in enumerate(pieces):
            name, sep, args = piece.partition("[ARGS]")
            name = name.split("[CALL_ID]")[0].strip()
            if partial and i == len(pieces) - 1:  # the last may still be written
                args = _object_prefix(args) if sep else None
                if name and args is not None:
                    pending = ToolCall(name, _hold(args, ("[TOOL_CALLS]",), True))
                break
            args = _arguments(args.strip()) if sep else None
            calls.append(ToolCall(name, args) if name and args is not None else None)
    if partial:
        return content, [c for c in calls if c], pending
    if calls and all(calls):
        return content.strip(), calls, None
    return text, [], None


_DS_FENCED = re.compile(r"^\s*(?:function)?\s*" + re.escape(DS_SEP) + r"\s*([^\n]+)\n```(?:json)?\s*(.*?)\s*```\s*$", re.S)
_DS_FENCE_OPEN = re.compile(r"^\s*(?:function)?\s*" + re.escape(DS_SEP) + r"\s*([^\n]+)\n```(?:json)?\s*", re.S)


def _deepseek(text: str, partial: bool):
    start = text.find(DS_CALLS)
    if start < 0:
        return _hold(text, (DS_CALLS,), partial), [], None
    content, calls, pending = text[:start], [], None
    end = text.find(DS_CALLS_END, start)
    blocks = text[start + len(DS_CALLS):end if end >= 0 else len(text)].split(DS_CALL)[1:]
    for i, block in enumerate(blocks):
        closed = DS_CALL_END in block
        block = block.split(DS_CALL_END)[0]
        if partial and not closed:
            if i == len(blocks) - 1:
                pending = _pending_deepseek(block)
            break
        fenced = _DS_FENCED.match(block)
        if fenced:
            name, args = fenced.group(1).strip(), _arguments(fenced.group(2))
        else:
            name, _, args = block.partition(DS_SEP)
            name, args = name.strip(), _arguments(args.strip())
        calls.append(ToolCall(name, args) if name and args is not None else None)
    if partial:
        return content, [c for c in calls if c], pending
    if calls and all(calls):
        return content.strip(), calls, None
    return text, [], None


def _pending_deepseek(block: str) -> ToolCall | None:
    fenced = _DS_FENCE_OPEN.match(block)
    if fenced:
        name, args = fenced.group(1).strip(), block[fenced.end():]
    else:
        name, sep, args = block.partition(DS_SEP)
        if not sep or "\n" in name.strip():
            return None
        name = name.strip()
    args = _object_prefix(args)
    return ToolCall(name, _hold(args, (DS_CALL_END, "`"), True)) if name and args is not None else None


_TOOL_PARSERS = {"tagged": _tagged, "llama3": _llama3, "mistral": _mistral, "deepseek": _deepseek, "calls": _calls}

# --- gpt-oss harmony -------------------------------------------------------------------------------------------

_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", *_HARMONY_ENDS)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def _harmony(text: str, tools: bool, partial: bool) -> Parsed:
    reasoning, content, calls, pending = [], [], [], None
    for i, message in enumerate(text.split("<|start|>")):
        header, sep, body = message.partition("<|message|>")
        if not sep:
            if i == 0 and "<|channel|>" not in header and not partial:
                content.append(header)  # no channels at all: the whole reply is the answer
            continue
        whole = any(end in body for end in _HARMONY_ENDS)
        for end in _HARMONY_ENDS:
            body = body.split(end)[0]
        recipient = _RECIPIENT.search(header)
        if recipient and tools:
            if whole or not partial:
                args = _arguments(body.strip())
                calls.append(ToolCall(recipient.group(1), args)) if args is not None else content.append(body)
            else:
                args = _object_prefix(body)
                pending = ToolCall(recipient.group(1), _hold(args, _HARMONY_MARKERS, True)) if args else None
            continue
        if not whole:
            body = _hold(body, _HARMONY_MARKERS, partial)
        (reasoning if "<|channel|>analysis" in header else content).append(body)
    return Parsed("".join(reasoning).strip(), "".join(content), tuple(calls), pending if partial else None)
