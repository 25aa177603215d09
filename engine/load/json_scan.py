"""Where JSON values and an object's members are written in a text, found without parsing it, whole or as the text
arrives: brackets and separators are counted outside strings, whose bodies the regex engine skips whole (a tool
call's arguments are mostly one long string of code or text). The scanners keep their place, so text read as it
arrives is looked at once; a `Tape` holds the text and counts the characters looked at."""
from __future__ import annotations

import json
import re

WS = re.compile(r"\s*")
_STRING_BODY = re.compile(r'(?:[^"\\]++|\\.)*+', re.S)  # up to a string's closing quote (or a lone trailing \)
_STRUCTURE = re.compile(r'["{}\[\],;]')
_SCALAR = re.compile(r"[^,}\]\s]*")


class Tape:
    """A text (whole, or as far as it has arrived) and the characters looked at in it."""

    def __init__(self, text: str = ""):
        self.text, self.read = text, 0

    def search(self, pattern: re.Pattern, pos: int):
        found = pattern.search(self.text, pos)
        self.read += (found.end() if found else len(self.text)) - pos
        return found

    def match(self, pattern: re.Pattern, pos: int):
        found = pattern.match(self.text, pos)
        self.read += found.end() - pos + 1
        return found

    def find(self, sub: str, pos: int) -> int:
        at = self.text.find(sub, pos)
        self.read += (at + len(sub) if at >= 0 else len(self.text)) - pos
        return at

    def slice(self, start: int, end: int) -> str:
        self.read += max(0, end - start)
        return self.text[start:end]


class Scan:
    """JSON text's brackets and separators outside strings, from `pos` on, as far as the text goes."""

    def __init__(self, pos: int):
        self.pos, self.depth, self.in_string = pos, 0, False

    def tokens(self, tape: Tape):
        """Each structural character now readable ('"' for a string's end) and the position just after it; `depth`
        counts the brackets open after it."""
        while True:
            if self.in_string:
                self.pos = tape.match(_STRING_BODY, self.pos).end()
                if self.pos >= len(tape.text) or tape.text[self.pos] != '"':
                    return
                self.pos, self.in_string = self.pos + 1, False
                yield '"', self.pos
                continue
            found = tape.search(_STRUCTURE, self.pos)
            if found is None:
                self.pos = len(tape.text)
                return
            self.pos, token = found.end(), found.group()
            if token == '"':
                self.in_string = True
                continue
            self.depth += (token in "{[") - (token in "}]")
            yield token, self.pos


class Value:
    """Where the JSON value that begins at `start` ends (`end`; None until it is written)."""

    def __init__(self, tape: Tape, start: int):
        self.scalar = tape.text[start] not in '{["'
        self.scan, self.end = Scan(start), None

    def read(self, tape: Tape) -> int | None:
        if self.end is None and self.scalar:
            self.scan.pos = tape.match(_SCALAR, self.scan.pos).end()
            self.end = self.scan.pos if self.scan.pos < len(tape.text) else None
        elif self.end is None:
            for _, after in self.scan.tokens(tape):
                if self.scan.depth == 0:
                    self.end = after
                    break
        return self.end


class Members:
    """The members of the JSON object that begins at `start` (after whitespace), as far as it is written:
    `members` {key: (where its value begins, its Value)}, the last of a repeated key, as json.loads keeps it.
    Reading stops at the first thing that is not the object's next part."""

    def __init__(self, start: int):
        self.pos, self.state = start, "open"
        self.key: str | None = None
        self.key_value: Value | None = None
        self.members: dict = {}

    def read(self, tape: Tape) -> dict:
        while self.state != "done":
            if self.state == "value":  # a member's value being written
                value = self.members[self.key][1]
                if value.read(tape) is None:
                    break
                self.pos, self.state = value.end, ","
                continue
            if self.state == "key":
                if self.key_value.read(tape) is None:
                    break
                self.key = loads(tape.slice(self.pos, self.key_value.end))
                self.pos, self.state = self.key_value.end, ":"
                continue
            pos = tape.match(WS, self.pos).end()
            if pos >= len(tape.text):
                break
            self.pos, char = pos, tape.text[pos]
            if self.state == "before value":
                self.members[self.key] = (pos, Value(tape, pos))
                self.state = "value"
            elif self.state == "before key":
                self.key_value, self.state = (Value(tape, pos), "key") if char == '"' else (None, "done")
            else:  # "open", ":" or ",": the character that must come next
                expected = "{" if self.state == "open" else self.state
                self.pos += 1
                self.state = "done" if char != expected else "before value" if char == ":" else "before key"
        return self.members


def loads(text: str):
    """The JSON value `text` holds (None when it holds none)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def member_span(text: str, key: str) -> tuple[int, int] | None:
    """Where the value of the member `key` of the JSON object `text` is written (None: no such whole member)."""
    tape = Tape(text)
    found = Members(0).read(tape).get(key)
    return None if found is None or found[1].end is None else (found[0], found[1].end)


def split_top_level(text: str, separator: str) -> list[str]:
    """JSON values written one after another, split where `separator` (',' or ';') stands outside any bracket or
    string; a string not closed makes the rest one part."""
    tape, scan, parts, start = Tape(text), Scan(0), [], 0
    for token, after in scan.tokens(tape):
        if token == separator and scan.depth == 0:
            parts.append(text[start:after - 1])
            start = after
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]
