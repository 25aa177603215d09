"""Text to token ids and back (the `tokenizers` library), and chat templates (jinja2, sandboxed)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

from engine.errors import MoedeskError


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as plain strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict, eos_token_ids=(), source: str = "model"):
        self._tok = tokenizer
        self.source = source
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one is for chat
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        ids = set(eos_token_ids)
        if self.eos_token is not None and self.token_id(self.eos_token) is not None:
            ids.add(self.token_id(self.eos_token))
        self.eos_token_ids = frozenset(ids)

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

    def stream_decoder(self) -> "StreamDecoder":
        """Text of ids that arrive one at a time, without decoding all of them again for each."""
        return StreamDecoder(self._tok)

    @cached_property
    def _template(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        return env.from_string(self.chat_template)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise MoedeskError(f"{self.source}: the model has no chat template; use a raw prompt")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except jinja2.exceptions.TemplateError as e:
            raise MoedeskError(f"{self.source}: chat template failed: {e}") from None

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation, formatted by the model's own chat template."""
        # The template writes any BOS itself; adding special tokens again would double it.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


class StreamDecoder:
    """tokenizers' DecodeStream: `step(id)` gives the text that id completes ('' while a character split
    over byte tokens is still partial). Concatenated, it is decode(ids) wherever the ids spell valid UTF-8."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self._tok, self._stream = tok, DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""
