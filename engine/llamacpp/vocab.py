"""The model's own tokenizer, through llama.cpp, with the same face as engine.load.tokenizer.Tokenizer.

llama.cpp knows the pre-tokenizer of every vocabulary it reads (gpt-oss's, GLM's, DeepSeek's...), which the
native GGUF tokenizer rebuilds only for the families the native engine runs: so the llama.cpp engine has one
tokenizer, llama.cpp's. Chat templates come from the GGUF and render in the same bounded sandbox as native's.
"""
from __future__ import annotations

import ctypes

from moedesk.engine.errors import MoedeskError
from moedesk.engine.load.tokenizer import ChatTemplating, fallback_template

PIECE_BYTES = 256  # a token's text is rarely longer; longer ones are read again with the size llama.cpp asks for


class LlamaVocab(ChatTemplating):
    def __init__(self, api, model, source: str):
        self.api, self.source = api, source
        self.vocab = api.llama_model_get_vocab(model)
        self.n_tokens = int(api.llama_vocab_n_tokens(self.vocab))
        template = api.llama_model_chat_template(model, None)
        self.chat_template: str | None = template.decode("utf-8", errors="replace") if template else None
        if self.chat_template is None:  # a family whose format moedesk knows (gpt-oss: harmony)
            self.chat_template = fallback_template(_architecture(api, model))
        bos, eos = api.llama_vocab_bos(self.vocab), api.llama_vocab_eos(self.vocab)
        self.bos_token_id = bos if 0 <= bos < self.n_tokens else None
        self.bos_token = self.piece(bos, special=True).decode(errors="replace") if self.bos_token_id is not None else None
        self.eos_token = self.piece(eos, special=True).decode(errors="replace") if 0 <= eos < self.n_tokens else None
        self.add_bos_token = bool(api.llama_vocab_get_add_bos(self.vocab))
        # Every end-of-generation token the vocabulary marks (EOS, EOT, <|im_end|>, <|return|>...).
        self.eos_token_ids = frozenset(t for t in range(self.n_tokens) if api.llama_vocab_is_eog(self.vocab, t))
        self.max_token_id = self.n_tokens - 1

    def check_vocab(self, vocab_size: int) -> None:
        """The vocabulary is the model's own: nothing to check (native's Tokenizer compares two files)."""

    def token_id(self, token: str) -> int | None:
        ids = self._tokenize(token.encode(), add_special=False, parse_special=True)
        return ids[0] if len(ids) == 1 else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Special tokens written in the text are matched whole, as the native Tokenizer matches added tokens.
        return self._tokenize(text.encode("utf-8"), add_special=add_special_tokens, parse_special=True)

    def _tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
        room = len(data) + 8
        for _ in range(2):
            out = (self.api.llama_token * room)()
            n = self.api.llama_tokenize(self.vocab, data, len(data), out, room, add_special, parse_special)
            if n >= 0:
                return list(out[:n])
            room = -n
        raise MoedeskError(f"{self.source}: llama.cpp could not tokenize a text of {len(data)} bytes")

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (control tokens give b"" unless `special`)."""
        buffer = ctypes.create_string_buffer(PIECE_BYTES)
        n = self.api.llama_token_to_piece(self.vocab, token, buffer, PIECE_BYTES, 0, special)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = self.api.llama_token_to_piece(self.vocab, token, buffer, -n, 0, special)
        return buffer.raw[:max(n, 0)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return b"".join(self.piece(int(t), special=not skip_special_tokens) for t in ids).decode("utf-8", "replace")

    def stream_decoder(self, skip_special_tokens: bool = True) -> "PieceStream":
        return PieceStream(self, special=not skip_special_tokens)


class PieceStream:
    """Text of ids that arrive one at a time: a character split over byte tokens comes out whole, once complete.
    Concatenated, it is `decode(ids)` wherever the ids spell valid UTF-8."""

    def __init__(self, vocab: LlamaVocab, special: bool = False):
        self.vocab, self.special, self.pending = vocab, special, b""

    def step(self, token_id: int) -> str:
        self.pending += self.vocab.piece(token_id, special=self.special)
        for end in range(len(self.pending), max(len(self.pending) - 4, -1), -1):
            try:
                text = self.pending[:end].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.pending = self.pending[end:]
            return text
        text, self.pending = self.pending.decode("utf-8", "replace"), b""  # not UTF-8 at all: as decode() shows it
        return text


def _architecture(api, model) -> str | None:
    buffer = ctypes.create_string_buffer(64)
    n = api.llama_model_meta_val_str(model, b"general.architecture", buffer, 64)
    return buffer.value.decode(errors="replace") if n >= 0 else None
