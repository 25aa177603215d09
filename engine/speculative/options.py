"""How a request asks for speculative decoding: its mode, draft and draft shape (`SpeculativeOptions`)."""
from __future__ import annotations

from dataclasses import dataclass


def check_mode(mode: str, draft_length: int, draft_width: int) -> None:
    if mode not in ("greedy", "beam", "auto"):
        raise ValueError(f"speculative mode must be greedy, beam or auto here, got {mode!r}")
    for name, value in (("length", draft_length), ("width", draft_width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"draft {name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class SpeculativeOptions:
    """A request decoded speculatively (Engine.submit's `decoding`). draft: an EAGLE head folder (loaded once per
    engine) or a drafter factory (`oracle_factory`); mode, draft_length, draft_width, budget as Engine.speculate
    takes them."""

    mode: str = "greedy"
    draft: object = None
    draft_length: int = 4
    draft_width: int = 4
    budget: int | None = None

    def __post_init__(self):
        check_mode(self.mode, self.draft_length, self.draft_width)
        if self.draft is None:
            raise ValueError("speculative decoding needs a draft head (an EAGLE head folder)")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 1):
            raise ValueError(f"the draft budget must be an integer >= 1, got {self.budget!r}")

    @property
    def width(self) -> int:
        return self.draft_width if self.mode == "beam" else 1

    @property
    def key(self) -> tuple:
        """Requests of equal keys share a job, so they verify in one forward: the same head and draft shape."""
        draft = self.draft if callable(self.draft) else str(self.draft)
        return ("speculative", draft, self.mode, self.draft_length, self.width, self.budget)

