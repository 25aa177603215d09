"""How a reply decodes, one choice for every front end: plainly, by beam search, or speculatively with a draft
head. The CLI, the app's settings, batch and serve each collect the choice their own way (flags, a settings
file, a JSONL line, a request's `moedesk` object) and build the engine's `decoding` (Engine.submit's: None,
BeamOptions or SpeculativeOptions) here, so the rules below hold for all four alike.
"""
from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_MODES = ("off", "greedy", "beam", "auto")  # off: plain decoding; the others SpeculativeOptions' modes
DRAFT_LENGTH = 4  # tokens drafted per step (a tree's depth; auto's longest)
DRAFT_WIDTH = 4  # beam mode's children per tree node


@dataclass(frozen=True)
class Decoding:
    """A front end's choice. speculative: one of SPECULATIVE_MODES; draft: an EAGLE head folder, a drafter
    factory, or None for the model's own (the demo ships one); beams above 1: beam search, which takes
    precedence over speculation."""

    speculative: str = "off"
    draft: object = None
    draft_length: int = DRAFT_LENGTH
    draft_width: int = DRAFT_WIDTH
    beams: int = 1
    length_penalty: float = 1.0


def shipped_draft(model: str) -> str | None:
    """The draft head that ships with `model` (the demo's), or None: what front ends use when given no --draft."""
    if model != "demo":
        return None
    from moedesk.engine.speculative.demo_draft import demo_head_folder

    return str(demo_head_folder())


def speculative_draft(engine, draft, load: bool = True):
    """The draft head for `engine`'s model: `draft` when given, else the model's own; MoedeskError (one line) when
    there is none. load: load it now, so a head that does not load stops a front end before its first request
    rather than failing every request."""
    from moedesk.engine.speculative.demo_draft import resolve_draft

    draft = resolve_draft(engine, draft)
    if load and not callable(draft):
        engine.load_draft(draft)
    return draft


def decoding_options(engine, choice: Decoding, load_draft: bool = False):
    """Engine.submit's `decoding` for `choice`: BeamOptions when beams > 1, None when speculation is off, else
    SpeculativeOptions over speculative_draft(engine, choice.draft, load_draft). Options that cannot be met raise
    ValueError, a missing draft head MoedeskError: one line each."""
    if choice.beams > 1:
        from moedesk.engine.generation.beam import BeamOptions

        return BeamOptions(choice.beams, choice.length_penalty)
    if choice.speculative == "off":
        return None
    from moedesk.engine.speculative.options import SpeculativeOptions

    draft = speculative_draft(engine, choice.draft, load_draft)
    return SpeculativeOptions(choice.speculative, draft, choice.draft_length, choice.draft_width)
