"""A streamed reply's reasoning, answer and tool calls, read as its text arrives (engine/load/reply_format.py reads
a whole reply; this reads the same markup a piece at a time).

Each family's reading is a generator over the growing text: it yields when it needs more and keeps its place, so an
update reads only what is new, plus the few characters a marker may straddle. A call still being written is read
by scanners that keep their state too (the JSON's depth, whether a string is open), so its arguments stream in
fragments, each character looked at a bounded number of times however long the call grows. The reader counts the
characters it looks at (`ReplyStream.read`), which tests hold to a constant times the reply's length.

What a stream shows stays true of the whole reply: a tail that may still become markup is held back, and so is a
run of whitespace that the whole reply's answer (or reasoning) may strip. The last update parses the whole reply
once (`parse_reply`) and sends what it adds to what was shown. A stream cannot take back a call it began: one the
whole parse does not read as a call stays begun in the stream while the whole reply has it as text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from moedesk.engine.load.json_scan import WS, Members, Scan, Tape, Value, loads
from moedesk.engine.load.reply_format import (DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP, HARMONY_ENDS,
                                              RECIPIENT, CallDelta, Parsed, ReplyFormat, ToolCall, arguments_text,
                                              deepseek_block, json_call, parse_reply, tagged_body)


class ReplyStream:
    """Feeds a streamed reply's text (its whole text so far, as the engine's updates carry it) and gives what is
    new each time: reasoning and answer pieces, tool calls once each is whole, and the calls' pieces as they are
    written (`call_deltas`)."""

    def __init__(self, fmt: ReplyFormat, *, in_reasoning: bool = False, tools: bool = True):
        self.fmt, self.in_reasoning, self.tools = fmt, in_reasoning, tools
        self._reader = _Reader(fmt, in_reasoning, tools)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []

    @property
    def shown(self) -> Parsed:
        """All that the stream has given so far."""
        return Parsed("".join(self._reasoning), "".join(self._content), tuple(self._calls))

    @property
    def pending(self) -> ToolCall | None:
        """The call being written: its name and its arguments as far as they were sent."""
        return self._reader.pending()

    @property
    def read(self) -> int:
        """Characters of the text looked at so far (what tests hold to linear)."""
        return self._reader.read

    def update(self, text: str, final: bool = False) -> Parsed:
        new = self._last(text) if final else self._reader.feed(text)
        self._reasoning.append(new.reasoning)
        self._content.append(new.content)
        self._calls += new.tool_calls
        return new

    def _last(self, text: str) -> Parsed:
        now = parse_reply(text, self.fmt, in_reasoning=self.in_reasoning, tools=self.tools)
        shown = self.shown
        calls = now.tool_calls[len(shown.tool_calls):]
        deltas = [d for i, call in enumerate(calls, len(shown.tool_calls))
                  for d in _deltas(i, call, self._reader.sent(i))]
        return Parsed(_grown(shown.reasoning, now.reasoning), _grown(shown.content, now.content), calls,
                      call_deltas=tuple(deltas))


def _grown(before: str, now: str) -> str:
    # The whole parse strips what the stream held back or had not yet seen stripped; a stream cannot take back
    # what it sent, so only an extension is new.
    for shown in (before, before.lstrip()):
        if now.startswith(shown):
            return now[len(shown):]
    return ""


def _deltas(index: int, call: ToolCall, sent: str | None) -> list[CallDelta]:
    """What a whole call adds to what its stream sent of it (None: nothing, not even its name)."""
    if sent is None:
        return [CallDelta(index, call.name, call.arguments)]
    if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
        return [CallDelta(index, None, call.arguments[len(sent):])]
    return []  # nothing new, or (a whole parse that reads the call otherwise) nothing a stream can send


# --- the reader ------------------------------------------------------------------------------------------------

class _Markers:
    """Markup strings searched for together, and the tail of a text that may be the start of one of them (or of
    one of `held`)."""

    def __init__(self, *markers: str, held: tuple[str, ...] = ()):
        self.pattern = re.compile("|".join(map(re.escape, markers)))
        self.longest = max(map(len, markers))
        self.held = markers + held

    def tail(self, r: _Reader, start: int) -> int:
        """The longest k with text[-k:] a marker's proper start, not reaching before `start`. Only where a
        marker's first character stands in its last len(marker) - 1 characters can one begin."""
        text, best = r.text, 0
        for marker in self.held:
            low = max(start, len(text) - len(marker) + 1)
            r.read += len(text) - low
            at = text.find(marker[0], low)
            while at >= 0 and len(text) - at > best:
                if marker.startswith(text[at:]):
                    best = len(text) - at
                    break
                at = text.find(marker[0], at + 1)
        return best


@dataclass
class _Open:
    """The call being written: its index among the reply's calls, its name, where its arguments begin and how far
    they were sent."""

    index: int
    name: str
    start: int
    sent: int


class _New:
    """What one update gives."""

    def __init__(self):
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.deltas: list[CallDelta] = []


class _Reader(Tape):
    """A stream's reading: the text so far (a Tape: the characters looked at are counted), the family's generator
    that keeps its place in it, and what the current update gives."""

    def __init__(self, fmt: ReplyFormat, in_reasoning: bool, tools: bool):
        super().__init__()
        self.pos = 0
        # a run of whitespace waits for what follows it where the whole parse strips the text it ends
        self.trim = {"reasoning": True, "content": tools and fmt.tools not in (None, "harmony")}
        self.space: dict[str, list[str]] = {"reasoning": [], "content": []}
        self.begun = False  # reasoning shown (its leading whitespace is not)
        self.calls = 0  # whole calls read
        self.open: _Open | None = None
        self.new = _New()
        self.steps = _reply(self, fmt, in_reasoning, tools)

    def feed(self, text: str) -> Parsed:
        if len(text) >= len(self.text):  # a stream's text only grows
            self.text = text
            next(self.steps)
        new, self.new = self.new, _New()
        return Parsed("".join(new.reasoning), "".join(new.content), tuple(new.calls), call_deltas=tuple(new.deltas))

    # -- waiting for text (generators: `yield from` them) --------------------------------------------------------

    def wait_for(self, markers: _Markers, show: str | None = None, reading=None):
        """The match of the first of `markers` at or after pos, once written. Meanwhile what comes before it is
        shown as `show` (less a tail that may begin a marker), or given to `reading(end)`: a call being written."""
        search = self.pos
        while True:
            found = self.search(markers.pattern, search)
            if found:
                if show:
                    self.show(show, found.start())
                return found
            if show:
                self.show(show, len(self.text) - markers.tail(self, self.pos))
            if reading:
                reading(len(self.text) - markers.tail(self, self.pos))
            search = max(search, len(self.text) - markers.longest + 1)
            yield

    def skip_space(self, pos: int):
        """The first character at or after pos that is not whitespace, once written."""
        while True:
            pos = self.match(WS, pos).end()
            if pos < len(self.text):
                return pos
            yield

    @staticmethod
    def forever():
        """Nothing more to read: the whole parse at the end decides the rest."""
        while True:
            yield

    # -- what the stream gives ---------------------------------------------------------------------------------

    def show(self, kind: str, end: int, raw: bool = False) -> None:
        """text[pos:end] as `kind` ("reasoning" or "content"), then pos = end. raw: even its trailing whitespace."""
        if end <= self.pos:
            return
        piece, self.pos = self.slice(self.pos, end), end
        out, space = (self.new.reasoning, self.space["reasoning"]) if kind == "reasoning" else \
            (self.new.content, self.space["content"])
        if not self.trim[kind] or raw:
            out += [*space, piece]
            space.clear()
            return
        if piece.isspace():
            space.append(piece)
            return
        if kind == "reasoning" and not self.begun:  # the whole parse strips reasoning at both ends
            space.clear()
            piece, self.begun = piece.lstrip(), True
        kept = piece.rstrip()
        out += [*space, kept]
        space[:] = [piece[len(kept):]]

    def stream_call(self, name: str, start: int, end: int) -> None:
        """A call being written: its name, and its arguments' text from `start`, written as far as `end`."""
        end = max(start, end)
        if self.open is None:
            self.open = _Open(self.calls, name, start, end)
            self.new.deltas.append(CallDelta(self.calls, name, self.slice(start, end)))
        elif end > self.open.sent:
            self.new.deltas.append(CallDelta(self.open.index, None, self.slice(self.open.sent, end)))
            self.open.sent = end

    def close_call(self, call: ToolCall | None) -> None:
        """A call's markup is closed: the call it reads as (None: not a call)."""
        if call is not None:
            self.new.deltas += _deltas(self.calls, call, self.sent(self.calls))
            self.new.calls.append(call)
            self.calls += 1
        self.open = None

    def sent(self, index: int) -> str | None:
        """The arguments text sent of the call being written, if `index` is it."""
        if self.open is None or self.open.index != index:
            return None
        return self.slice(self.open.start, self.open.sent)

    def pending(self) -> ToolCall | None:
        return None if self.open is None else ToolCall(self.open.name, self.sent(self.open.index))


def _reply(r: _Reader, fmt: ReplyFormat, in_reasoning: bool, tools: bool):
    if fmt.tools == "harmony":
        yield from _harmony(r, tools)
    if fmt.think is not None:
        yield from _think(r, fmt.think, in_reasoning)
    family = _FAMILIES.get(fmt.tools) if tools else None
    if family is None:
        while True:
            r.show("content", len(r.text))
            yield
    yield from family(r)


def _think(r: _Reader, tags: tuple[str, str], in_reasoning: bool):
    opening, closing = tags
    if not in_reasoning:  # the reply may open the tag, after whitespace
        start = yield from r.skip_space(r.pos)
        while True:
            written = r.slice(start, start + len(opening))
            if written == opening:
                r.pos = start + len(opening)
                break
            if not opening.startswith(written):
                return  # no reasoning: the reply is read from its start
            yield
    closed = yield from r.wait_for(_Markers(closing), show="reasoning")
    r.pos = yield from r.skip_space(closed.end())


# --- calls being written ---------------------------------------------------------------------------------------

class _JsonCall:
    """A call written as the JSON object {"name", "arguments" (or "parameters")}, read member by member as it is
    written: once its name is whole and its arguments object begun, the arguments stream."""

    def __init__(self, start: int):
        self.members, self.name = Members(start), None

    def __call__(self, r: _Reader, limit: int) -> None:
        members = self.members.read(r)
        if self.name is None:
            name = members.get("name")
            if name is None or name[1].end is None:
                return
            self.name = loads(r.slice(name[0], name[1].end))
        args = members.get("arguments", members.get("parameters"))
        if isinstance(self.name, str) and args is not None and r.text[args[0]] == "{":
            end = args[1].end
            r.stream_call(self.name, args[0], end if end is not None else limit)


class _Object:
    """A call's arguments written as a JSON object after `start` (and whitespace): they stream under `name` once
    they begin with '{'."""

    def __init__(self, r: _Reader, start: int, name: str):
        self.r, self.pos, self.name, self.value = r, start, name, None

    def __call__(self, limit: int) -> None:
        r = self.r
        if self.value is None:
            self.pos = r.match(WS, self.pos).end()
            if self.pos >= len(r.text) or r.text[self.pos] != "{":
                return
            self.value = Value(r, self.pos)
        end = self.value.read(r)
        r.stream_call(self.name, self.pos, end if end is not None else limit)


# --- families ---------------------------------------------------------------------------------------------------

_TOOL_CALL, _TOOL_CALL_END = _Markers("<tool_call>"), _Markers("</tool_call>")


def _tagged(r: _Reader):
    while True:
        opened = yield from r.wait_for(_TOOL_CALL, show="content")
        body = r.pos = opened.end()
        closed = yield from r.wait_for(_TOOL_CALL_END, reading=_TaggedHead(r, body))
        call = tagged_body(r.slice(body, closed.start()))
        r.close_call(call)
        if call is None:  # not a call: its markup is text
            r.pos = opened.start()
            r.show("content", closed.end(), raw=True)
        r.pos = closed.end()


_FUNCTION = re.compile(r"<function=([^>\s]+)>")
_ARG_KEY = _Markers("<arg_key>")


class _TaggedHead:
    """A `<tool_call>` body being written: a JSON call, Qwen3-Coder's `<function=NAME>` or GLM's `NAME<arg_key>`.
    Those two build their arguments from markup, so their name comes first and their arguments once the call closes."""

    def __init__(self, r: _Reader, body: int):
        self.r, self.at, self.kind, self.search, self.json = r, body, None, body, None

    def __call__(self, limit: int) -> None:
        r = self.r
        if self.kind is None:
            self.at = self.search = r.match(WS, self.at).end()
            if self.at >= len(r.text):
                return
            self.kind = {"{": "json", "<": "function"}.get(r.text[self.at], "glm")
            self.json = _JsonCall(self.at)
        if self.kind == "json":
            self.json(r, limit)
        elif self.kind == "function":
            end = r.find(">", self.search)
            if end < 0:
                self.search = len(r.text)
                return
            found, self.kind = _FUNCTION.match(r.slice(self.at, end + 1)), "read"
            if found:
                r.stream_call(found.group(1), end + 1, end + 1)
        elif self.kind == "glm":
            found = r.search(_ARG_KEY.pattern, self.search)
            if found is None:
                self.search = max(self.search, len(r.text) - _ARG_KEY.longest + 1)
                return
            name, self.kind = r.slice(self.at, found.start()).strip(), "read"
            if name and not any(c in name for c in "<>{}\n"):
                r.stream_call(name, found.start(), found.start())


def _json_items(r: _Reader, start: int, separator: str, closing: bool):
    """Calls written one after another as JSON values, split where `separator` stands outside any bracket or string
    (a list's items from after its '[', which a ']' closes; Llama 3's ';'-separated calls). Each whole item must be
    a call; the one being written streams."""
    scan = Scan(start)
    while True:
        item = yield from r.skip_space(scan.pos)
        head, end = _JsonCall(item), None
        while end is None:
            for token, after in scan.tokens(r):
                if (scan.depth == 0 and token == separator) or (closing and scan.depth < 0):
                    end = after
                    break
            else:
                head(r, len(r.text))
                yield
        call = json_call(r.slice(item, end - 1).strip())
        r.close_call(call)
        if call is None or scan.depth < 0:
            yield from r.forever()  # not a list of calls, or its end


def _calls(r: _Reader):
    start = yield from r.skip_space(r.pos)
    if r.text[start] == "[":
        yield from _json_items(r, start + 1, ",", True)
    yield from r.forever()


_PYTHON_TAG = "<|python_tag|>"


def _llama3(r: _Reader):
    start = yield from r.skip_space(r.pos)
    while True:  # a reply of calls begins with '{' or the python tag
        written = r.slice(start, start + len(_PYTHON_TAG))
        if written.startswith("{"):
            break
        if written == _PYTHON_TAG:
            start = yield from r.skip_space(start + len(_PYTHON_TAG))
            break
        if not _PYTHON_TAG.startswith(written):
            while True:
                r.show("content", len(r.text))
                yield
        yield
    yield from _json_items(r, start, ";", False)


_TOOL_CALLS = _Markers("[TOOL_CALLS]")
_MISTRAL_PIECE = _Markers("[ARGS]", "[TOOL_CALLS]")


def _mistral(r: _Reader):
    opened = yield from r.wait_for(_TOOL_CALLS, show="content")
    start = yield from r.skip_space(opened.end())
    if r.text[start] == "[":
        yield from _json_items(r, start + 1, ",", True)
    r.pos = start
    while True:  # NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}
        found = yield from r.wait_for(_MISTRAL_PIECE)
        name = r.slice(r.pos, found.start()).split("[CALL_ID]")[0].strip()
        if found.group() != "[ARGS]" or not name:  # a piece without a name and arguments is no call
            yield from r.forever()
        r.pos = found.end()
        after = yield from r.wait_for(_TOOL_CALLS, reading=_Object(r, found.end(), name))
        args = arguments_text(r.slice(found.end(), after.start()).strip())
        r.close_call(ToolCall(name, args) if args is not None else None)
        if args is None:
            yield from r.forever()
        r.pos = after.end()


_DS_CALLS = _Markers(DS_CALLS)
_DS_BLOCK = _Markers(DS_CALL, DS_CALLS_END)
_DS_BLOCK_END = _Markers(DS_CALL_END, DS_CALL, DS_CALLS_END, held=("`",))


def _deepseek(r: _Reader):
    opened = yield from r.wait_for(_DS_CALLS, show="content")
    r.pos = opened.end()
    while True:
        block = yield from r.wait_for(_DS_BLOCK)
        if block.group() == DS_CALLS_END:
            yield from r.forever()
        r.pos = block.end()
        end = yield from r.wait_for(_DS_BLOCK_END, reading=_DeepseekHead(r, block.end()))
        call = deepseek_block(r.slice(block.end(), end.start())) if end.group() == DS_CALL_END else None
        r.close_call(call)
        if call is None:  # not a call, or one not closed before the next: no more calls
            yield from r.forever()
        r.pos = end.end()


_DS_SEP = _Markers(DS_SEP)
_DS_FENCE_OPEN = re.compile(r"\s*(?:function)?\s*" + re.escape(DS_SEP) + r"\s*([^\n]+)\n```(?:json)?\s*", re.S)


class _DeepseekHead:
    """A DeepSeek call being written: `function<sep>NAME` and a fenced JSON (V3, R1) or `NAME<sep>{...}` (V3.1).
    Its arguments begin at the first '{' after the separator that what precedes it leads to (each '{' tried reads
    the head again; in practice the first is it)."""

    def __init__(self, r: _Reader, block: int):
        self.r, self.block, self.search, self.sep, self.args = r, block, block, False, None

    def __call__(self, limit: int) -> None:
        r = self.r
        while self.args is None:
            if not self.sep:
                found = r.search(_DS_SEP.pattern, self.search)
                if found is None:
                    self.search = max(self.search, len(r.text) - _DS_SEP.longest + 1)
                    return
                self.sep, self.search = True, found.end()
            brace = r.find("{", self.search)
            if brace < 0:
                self.search = len(r.text)
                return
            self.search, self.name = brace + 1, _deepseek_name(r.slice(self.block, brace))
            if self.name:
                self.start, self.args = brace, Value(r, brace)
        end = self.args.read(r)
        r.stream_call(self.name, self.start, end if end is not None else limit)


def _deepseek_name(head: str) -> str | None:
    """The call's name when `head` is all that comes before its arguments' '{'."""
    fenced = _DS_FENCE_OPEN.match(head)
    if fenced:
        return fenced.group(1).strip() if fenced.end() == len(head) else None
    name, _, rest = head.partition(DS_SEP)
    name = name.strip()
    return name if name and "\n" not in name and not rest.strip() else None


_FAMILIES = {"tagged": _tagged, "llama3": _llama3, "mistral": _mistral, "deepseek": _deepseek, "calls": _calls}

# --- gpt-oss harmony ------------------------------------------------------------------------------------------------

_HARMONY_HEADER = _Markers("<|message|>", "<|start|>")
_HARMONY_BODY = _Markers(*HARMONY_ENDS, "<|start|>", held=("<|channel|>", "<|message|>"))
_NEXT_MESSAGE = _Markers("<|start|>")


def _harmony(r: _Reader, tools: bool):
    while True:
        header = yield from r.wait_for(_HARMONY_HEADER)
        if header.group() == "<|start|>":  # a message begins before this one's header ended
            r.pos = header.end()
            continue
        head, r.pos = r.slice(r.pos, header.start()), header.end()
        recipient = RECIPIENT.search(head) if tools else None
        if recipient:
            name = recipient.group(1)
            end = yield from r.wait_for(_HARMONY_BODY, reading=_Object(r, header.end(), name))
            whole = end.group() != "<|start|>"
            args = arguments_text(r.slice(header.end(), end.start()).strip()) if whole else None
            r.close_call(ToolCall(name, args) if args is not None else None)
            if whole and args is None:  # not a call: its text is the answer
                r.show("content", end.start())
        else:
            end = yield from r.wait_for(_HARMONY_BODY, show="reasoning" if "<|channel|>analysis" in head else "content")
        if end.group() != "<|start|>":  # what follows a message's end, up to the next message, is no one's
            r.pos = end.end()
            end = yield from r.wait_for(_NEXT_MESSAGE)
        r.pos = end.end()
