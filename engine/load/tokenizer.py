"""Text to token ids and back (the `tokenizers` library), and chat templates (jinja2, sandboxed)."""
from __future__ import annotations

import functools
import json
import re
import sys
import time
from datetime import datetime
from functools import cached_property

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from tokenizers.decoders import DecodeStream

from moedesk.engine.errors import MoedeskError

try:
    import resource
except ImportError:  # Windows: no memory watch, the other bounds still hold
    resource = None

# A chat template comes with the model, so it is untrusted input: the sandbox stops it from running
# code, and these stop it from running forever or filling memory. Real templates render a long
# conversation in milliseconds, to a prompt no longer than the conversation plus some markup.
TEMPLATE_SECONDS = 5.0
TEMPLATE_MAX_CHARS = 16 * 2**20  # longer than any prompt that fits a 1M-token context
TEMPLATE_MAX_GROWTH = 256 << 20  # bytes the process's peak memory may grow by while a template renders
TEMPLATE_MAX_ITEMS = 1 << 20  # a list built by a template: real ones hold messages and tools, not millions
_HUGE_NUMBER = 10**7  # no template needs a width, count or repeat this large
_WIDE_FORMAT = re.compile(r"[%{][^%{}a-zA-Z]*\d{7}")  # "%9999999d", "{:9999999}"


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as plain strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class _TemplateLimit(SecurityError):
    """A template went past one of the bounds above."""


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _check_numbers(values) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _HUGE_NUMBER:
            raise _TemplateLimit(f"the number {value if abs(value) < 10**30 else 'given'} is too large for a template")


def _check_format(text) -> None:
    if isinstance(text, str) and _WIDE_FORMAT.search(text):
        raise _TemplateLimit("a format width or precision too large for a template")


# One filter or method call runs in C between two template lines, so the per-line watch of _render_bounded never
# sees it: the calls that can make a value much larger than their inputs are sized before they run.

def _check_length(length: int, what: str) -> None:
    if length > TEMPLATE_MAX_CHARS:
        raise _TemplateLimit(f"{what} of {length} characters is too large for a template")


def _joined(items, separator) -> list:
    """`items` as a list (a generator is read once, here), refused when joining them would be too long."""
    items = list(items)
    if len(items) > TEMPLATE_MAX_ITEMS:
        raise _TemplateLimit(f"a join of {len(items)} items is too large for a template")
    total = sum(len(x) if isinstance(x, str) else len(str(x)) for x in items)
    _check_length(total + len(str(separator)) * max(len(items) - 1, 0), "a join")
    return items


def _check_replace(text, old, new, count=-1) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        found = text.count(old) if old else len(text) + 1
        if isinstance(count, int) and count >= 0:
            found = min(found, count)
        _check_length(len(text) + found * (len(new) - len(old)), "a replace")


def _check_method(method, args) -> list:
    """The arguments of a str method call, checked (and a join's items read into a list)."""
    name, owner = getattr(method, "__name__", None), getattr(method, "__self__", None)
    if not isinstance(owner, str):
        return list(args)
    if name == "join" and args:
        return [_joined(args[0], owner), *args[1:]]
    if name == "replace" and len(args) >= 2:
        _check_replace(owner, *args[:3])
    elif name == "expandtabs" and args and isinstance(args[0], int):
        _check_length(len(owner) + owner.count("\t") * max(args[0], 0), "expandtabs")
    return list(args)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with the operators and calls that can build huge values checked before they run."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def call_binop(self, context, op, left, right):
        if op == "*":
            count, sized = (right, _size(left)) if _size(left) is not None else (left, _size(right))
            items = isinstance(left, (list, tuple)) or isinstance(right, (list, tuple))
            if sized is not None and isinstance(count, int) and \
                    sized * count > (TEMPLATE_MAX_ITEMS if items else TEMPLATE_MAX_CHARS):
                raise _TemplateLimit(f"a repeat to {sized * count} items is too large for a template")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 10**5:
                raise _TemplateLimit("a product too large for a template")
        elif op == "**":
            if isinstance(right, (int, float)) and abs(right) > 1024 and not (isinstance(left, (int, float))
                                                                              and abs(left) <= 1):
                raise _TemplateLimit("a power too large for a template")
        elif op == "+":
            if _size(left) is not None and _size(right) is not None and _size(left) + _size(right) > TEMPLATE_MAX_CHARS:
                raise _TemplateLimit("a concatenation too large for a template")
        elif op == "%":
            _check_format(left)
        return super().call_binop(context, op, left, right)

    def getattr(self, obj, attribute):
        if attribute in ("format", "format_map"):  # the sandbox hands out a wrapper that hides the string
            _check_format(obj)
        return super().getattr(obj, attribute)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja's own signature
        _check_numbers([*args, *kwargs.values()])
        if getattr(__obj, "__name__", None) in ("format", "format_map"):
            _check_format(getattr(__obj, "__self__", None))
        args = _check_method(__obj, args)
        return super().call(__context, __obj, *args, **kwargs)


def _checked_filter(name: str, function):
    """A filter that refuses huge numbers (`center(10**10)`): jinja calls filters without `call`."""
    @functools.wraps(function)
    def checked(*args, **kwargs):
        _check_numbers([*args, *kwargs.values()])
        if name == "format":
            _check_format(next((a for a in args if isinstance(a, str)), None))
        # join(value, d="", attribute=None) and replace(s, old, new, count=None), after any context argument
        first = next((i for i, a in enumerate(args) if not isinstance(a, _CONTEXTS)), len(args))
        values = list(args[first:])
        if name == "join" and values and kwargs.get("attribute") is None and (len(values) < 3 or values[2] is None):
            values[0] = _joined(values[0], values[1] if len(values) > 1 else kwargs.get("d", ""))
        elif name == "replace" and len(values) >= 3:
            _check_replace(str(values[0]), values[1], values[2], values[3] if len(values) > 3 else
                           kwargs.get("count") if kwargs.get("count") is not None else -1)
        return function(*args[:first], *values, **kwargs)
    return checked


_CONTEXTS = (jinja2.nodes.EvalContext, jinja2.runtime.Context, jinja2.Environment)


def _render_bounded(template: jinja2.Template, **variables) -> str:
    """template.render(**variables), stopped with _TemplateLimit past TEMPLATE_SECONDS, TEMPLATE_MAX_CHARS of
    output, or TEMPLATE_MAX_GROWTH of new peak memory.

    Time and memory are checked on every line the compiled template runs (a trace function on this
    thread, for the template's own frames only), which is where loops and repeated concatenation run.
    """
    deadline = time.monotonic() + TEMPLATE_SECONDS
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale if resource else 0

    def watch(frame, event, arg):
        if resource and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale - peak > TEMPLATE_MAX_GROWTH:
            raise _TemplateLimit(f"rendering took more than {TEMPLATE_MAX_GROWTH >> 20} MiB of memory")
        if time.monotonic() > deadline:
            raise _TemplateLimit(f"rendering took longer than {TEMPLATE_SECONDS:g} s")
        return watch

    def enter(frame, event, arg):
        return watch if frame.f_code.co_filename == "<template>" else None

    parts, length = [], 0
    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        for part in template.generate(**variables):
            length += len(part)
            if length > TEMPLATE_MAX_CHARS:
                raise _TemplateLimit(f"the rendered prompt is longer than {TEMPLATE_MAX_CHARS} characters")
            parts.append(part)
    finally:
        sys.settrace(previous)
    return "".join(parts)


def fallback_template(architecture: str | None) -> str | None:
    from moedesk.engine.load.harmony import fallback_template as known

    return known(architecture)


class ChatTemplating:
    """A model's chat template rendered in the bounded sandbox: what both engines' tokenizers share. Subclasses
    set `chat_template`, `source`, `bos_token`, `eos_token` and give `encode`."""

    @cached_property
    def _template(self):
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        del env.globals["lipsum"]  # placeholder text: no chat template needs it, and it writes megabytes per call
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items()}
        return env.from_string(self.chat_template)

    @cached_property
    def reply_format(self):
        """How this model marks reasoning and tool calls in a reply (engine.load.reply_format), from its template."""
        from moedesk.engine.load.reply_format import detect_format

        return detect_format(self.chat_template)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    **options) -> str:
        """The conversation as the model's template writes it. tools: OpenAI-style function definitions, for
        templates that describe them to the model; options: the template's own switches (enable_thinking,
        reasoning_effort, ...), which a template that does not read them ignores."""
        if not self.chat_template:
            raise MoedeskError(f"{self.source}: the model has no chat template; use a raw prompt")
        fixed = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        if tools:
            fixed["tools"] = tools
        try:
            return _render_bounded(self._template, **{**options, **fixed})
        except jinja2.exceptions.TemplateError as e:
            raise MoedeskError(f"{self.source}: chat template failed: {_first_line(e)}") from None
        except Exception as e:  # noqa: BLE001 -- a template's own bug (1/0, a recursive macro)
            raise MoedeskError(f"{self.source}: chat template failed: {type(e).__name__}: {_first_line(e)}") from None

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    **options) -> list[int]:
        """Token ids of a conversation, formatted by the model's own chat template (arguments: render_chat's)."""
        # The template writes any BOS itself; adding special tokens again would double it.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, **options),
                           add_special_tokens=False)


class Tokenizer(ChatTemplating):
    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict, eos_token_ids=(), source: str = "model",
                 architecture: str | None = None):
        self._tok = tokenizer
        self.source = source
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one is for chat
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # A family whose format moedesk knows gets it when the checkpoint carries no template (gpt-oss: harmony)
        self.chat_template: str | None = template or fallback_template(architecture)
        ids = set(eos_token_ids)
        if self.eos_token is not None and self.token_id(self.eos_token) is not None:
            ids.add(self.token_id(self.eos_token))
        self.eos_token_ids = frozenset(ids)

    @cached_property
    def max_token_id(self) -> int:
        """The largest id this tokenizer can give (added tokens included); -1 when it has none."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise MoedeskError (one line) when the tokenizer can give ids the model has no embedding for:
        the first text that contains one would otherwise fail in the middle of a run."""
        if self.max_token_id >= vocab_size:
            raise MoedeskError(f"{self.source}: the tokenizer has token ids up to {self.max_token_id}, outside the "
                               f"model's vocabulary of {vocab_size} (vocab_size in its config)")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_id(self.bos_token)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        # tokenizer.json usually adds BOS itself (post-processor); GGUF files only say that it should.
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        """Text of ids that arrive one at a time, without decoding all of them again for each."""
        return StreamDecoder(self._tok, skip_special_tokens)


class StreamDecoder:
    """Text of ids that arrive one at a time: `step(id)` gives the text that id completes ('' while a character
    split over byte tokens is still partial). Concatenated, it is decode(ids) wherever that has no U+FFFD.

    tokenizers' DecodeStream does the work, re-decoding only a window of the last ids. It raises where a decoder
    rewrites text it has already given (ByteFallback turns a whole byte run with an undecodable byte in it into
    one U+FFFD per byte, the valid bytes before it included); then, as for any step whose text has U+FFFD in it,
    the full decode of the ids so far says what is new, and a fresh DecodeStream goes on from there.
    step() never raises: a reply must not die of its text."""

    def __init__(self, tok: tokenizers.Tokenizer, skip_special_tokens: bool = True):
        self._tok, self._skip = tok, skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._shown = 0  # characters given so far

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._tok, token_id) or ""
                # A U+FFFD may stand for bytes the window rewrote unseen (a Strip decoder hides the space that
                # was given before it turned into U+FFFD): only the full decode says how much of it is new.
                if "\ufffd" not in piece:
                    self._shown += len(piece)
                    return piece
            except Exception:  # the window's text no longer extends what was given
                pass
            self._stream = None  # until the full decode is whole text again
        return self._catch_up()

    def _catch_up(self) -> str:
        try:
            text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        except Exception:
            return ""  # the next id decodes them all again
        if text.endswith("\ufffd"):
            return ""  # a character still split over byte tokens
        # Where decode rewrote text already given, what lies past as many characters as were given is new:
        # ByteFallback swaps each ASCII byte for one U+FFFD, so "N", "O", then <0xAC> t12 gives "\ufffdt12", the
        # bytes' own reading (a 2-4 byte character in such a run turns into as many U+FFFD, one to three more than
        # llama.cpp would show). Given text is never taken back: text that shrank gives nothing until it outgrows it.
        piece = text[self._shown:]
        self._shown += len(piece)
        # Back to the fast path, its window starting at the last id (whole text now, so a fair prefix): stepped in,
        # as tokenizers 0.21 (pyproject's floor) takes no DecodeStream(ids=...). Failing that, full decodes go on.
        try:
            stream = DecodeStream(skip_special_tokens=self._skip)
            stream.step(self._tok, self._ids[-1])
            self._stream = stream
        except Exception:  # noqa: BLE001 - the stream must not die of its text
            pass
        return piece


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""
