"""What callers hand the engine and what they get back: plain data, no behaviour."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The highest temperature every front end takes (OpenAI's): the app, batch and serve agree on one range.
TEMPERATURE_MAX = 2.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one sequence. temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class Request:
    """One sequence to complete. `tag` is the caller's handle, returned untouched."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tag: Any = None
    grammar: Any = None  # engine.generation.sampling.Grammar: only tokens it allows are chosen (structured output)
    # The reply's first tokens, chosen in advance: token i is fed_tokens[i] whatever the model predicts, the model
    # chooses the rest. A benchmark's feed (llama-bench's random tokens); plain decoding only, without a grammar.
    fed_tokens: tuple[int, ...] = ()


@dataclass
class Completion:
    """A finished sequence. token_ids never include the end-of-sequence token; text stops before a stop string."""

    tag: Any
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    stats: dict = field(default_factory=dict)


@dataclass
class StreamChunk:
    """A piece of a streamed reply: new text (may be empty while a multi-byte character is incomplete)."""

    text: str
    token_ids: list[int]
    completion: Completion | None = None  # set on the last chunk only


class _NotYet:
    def __repr__(self) -> str:
        return "NOT_YET"


# What a request source given to Engine.generate yields when it has no request now but may later (a pipe whose
# writer is idle): generate answers the requests it runs meanwhile, then asks the source again.
NOT_YET = _NotYet()
