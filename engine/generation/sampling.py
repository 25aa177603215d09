"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""
from __future__ import annotations

import torch

from engine.requests import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a row of float32 logits [V] on the CPU.

    Sampling happens on the CPU with the sequence's own generator, so a seed gives the same
    text whatever the device and whatever else shares the batch.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits))
    # Shifted so the largest logit is 0 before dividing: a temperature as small as 1e-45 then sends
    # the others to -inf (greedy, as its limit is) instead of everything to inf and the softmax to NaN.
    # NaN logits (a model gone wrong) count as -inf, +inf as the largest finite value.
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), neginf=float("-inf"))
    logits = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the ones before it already cover top_p; the first always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not torch.isfinite(probs).all():  # every logit NaN or -inf: nothing to weigh, take the argmax
        return int(torch.argmax(logits))
    return int(torch.multinomial(probs, 1, generator=generator))


# --- structured output ------------------------------------------------------------------------
#
# llguidance, not xgrammar or outlines-core: it builds its token trie straight from the
# `tokenizers` JSON that engine.load.tokenizer.Tokenizer already wraps (no transformers tokenizer, no
# Hub download), computes a mask lazily per step from a context-free grammar (tens of microseconds,
# no per-schema precompilation that would stall the decode thread for a new schema, where
# outlines-core builds a whole regex automaton up front and cannot express free-form JSON at all),
# supports arbitrary JSON for json_object as well as JSON schemas, and is one small wheel with no
# dependencies (xgrammar pulls in transformers and more at run time).

class Grammar:
    """A compiled response format for one tokenizer; `matcher()` gives each sequence its own parse state."""

    def __init__(self, lltokenizer, grammar: str, vocab_size: int, eos_token_ids):
        self._tokenizer, self._grammar, self.vocab_size = lltokenizer, grammar, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)

    def matcher(self) -> "TokenConstraint":
        import llguidance

        return TokenConstraint(llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0), self)


class TokenConstraint:
    """The tokens one sequence may choose next under its grammar, advanced token by token."""

    def __init__(self, matcher, grammar: Grammar):
        self.matcher, self.grammar = matcher, grammar
        self._bits = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (float32, CPU) with every token the grammar forbids at -inf; only the end once it is done."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
            allowed[self.grammar.eos_token_ids] = True
        else:
            packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
            allowed = (packed[:, None] & self._bits).ne(0).view(-1)[: logits.shape[-1]]
            if allowed.shape[0] < logits.shape[-1]:
                allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[-1] - allowed.shape[0])])
            if allowed[self.grammar.eos_token_ids].any():  # llguidance marks one end token; every one of ours ends
                allowed[self.grammar.eos_token_ids] = True
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> bool:
        """Advance past `token`; True when the grammar is complete and nothing but the end may follow."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() or self.matcher.is_error()


def compile_response_format(response_format, lltokenizer, vocab_size: int, eos_token_ids) -> Grammar | None:
    """An OpenAI `response_format` ({"type": "text" | "json_object" | "json_schema", ...}) as a Grammar; None
    for plain text. Raises ValueError with a one-line reason for a malformed format or an unusable schema."""
    import json

    import llguidance

    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError('response_format must be an object with a "type": "text", "json_object" or "json_schema"')
    kind = response_format["type"]
    # No whitespace between tokens of JSON: a model that would wander into endless spaces cannot.
    options = {"whitespace_flexible": False}
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ValueError('response_format json_schema must be an object {"name": ..., "schema": {...}}')
        schema = spec.get("schema", {})
        if schema is True or schema == {}:
            schema = {"type": "object"}  # as OpenAI does: an empty schema still asks for a JSON object
        elif schema is False:
            raise ValueError("response_format json_schema: the schema false allows nothing")
    else:
        raise ValueError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
    except (ValueError, TypeError) as e:
        raise ValueError(f"response_format: {e}") from None
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer)
    if error:
        raise ValueError(f"response_format: the schema cannot be used: {' '.join(messages[0].split())}")
    return Grammar(lltokenizer, grammar, vocab_size, eos_token_ids)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids):
    """llguidance's view of an engine.load.tokenizer.Tokenizer (builds a token trie: cache the result)."""
    import llguidance

    # The `tokenizers` object itself, serialised: engine.load.tokenizer.Tokenizer keeps it private and has no other use for it.
    return llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
