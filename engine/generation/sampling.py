"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""
from __future__ import annotations

import torch

from moedesk.engine.requests import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a row of logits [V]: sample_tokens of one row."""
    return sample_tokens(logits[None], [params], [generator])[0]


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token id per row of logits [N, V], on the logits' own device, row i drawn under params[i] with
    generators[i] (a CPU torch.Generator, or None for the global one).

    A whole batch is sampled in a few tensor operations: one sort for the rows with top-p, not one per row on
    the CPU (which at large batches took longer than the model's step on a GPU: docs/measurements.md, "Decoding:
    graphs, sampling, the scheduler"). Each row still takes exactly one uniform number from its own generator and
    is drawn by inverting its cumulative distribution, so a seed gives the same tokens whatever else shares the
    batch.
    """
    if not params:
        return []
    temperature = [p.temperature for p in params]
    out = torch.argmax(logits, dim=-1).tolist()
    sampled = [i for i, t in enumerate(temperature) if t > 0]
    if not sampled:
        return out
    # The uniforms first, one per sampled row in order: a row's draw never depends on the others'.
    u = torch.tensor([float(torch.rand((), generator=generators[i], dtype=torch.float64)) for i in sampled],
                     dtype=torch.float64)
    rows = logits[sampled] if len(sampled) < len(params) else logits
    probs = sampling_probs(rows, [params[i] for i in sampled])
    cdf = torch.cumsum(probs.double(), dim=-1)
    # right=True: the first token whose cumulative probability exceeds u * total has a probability above 0
    picks = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None], right=True)
    picks = picks.clamp_(max=probs.shape[-1] - 1).squeeze(1)
    # every logit NaN or -inf: nothing to weigh, keep the argmax
    picks = torch.where(torch.isfinite(probs).all(dim=-1), picks, rows.argmax(dim=-1))
    for i, pick in zip(sampled, picks.tolist()):
        out[i] = pick
    return out


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of logits [N, V] is sampled from under params[i] (temperature > 0, top-k,
    top-p), float32, on the logits' device. Rejection sampling needs it as well as the sampler."""
    dev = logits.device
    # Shifted so the largest logit is 0 before dividing: a temperature as small as 1e-45 then sends
    # the others to -inf (greedy, as its limit is) instead of everything to inf and the softmax to NaN.
    # NaN logits (a model gone wrong) count as -inf, +inf as the largest finite value.
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), neginf=float("-inf"))
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature[:, None]
    vocab = x.shape[-1]
    ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        k = torch.tensor(ks, device=dev)
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None])
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # Drop a token once the ones before it already cover top_p; the first always stays. Rows without
        # top-p get an infinite bar, so rounding in the cumulative sum can never drop their tail.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=dev)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p[:, None]
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


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
        """Advance past `token`; True when nothing but the end may follow (the grammar is complete, or failed)."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() or self.matcher.is_error()

    def complete(self) -> bool:
        """The text so far is a whole match of the grammar: ending here is a `stop`. A grammar that failed (no
        token could continue it, a lexer limit) or is still open ends as `length`: never invalid JSON as `stop`."""
        return not self.matcher.is_error() and (self.matcher.is_stopped() or self.matcher.is_accepting())


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
