"""Acceptance length of a draft on a set of prompts: the figure that says how good a draft head is.

Acceptance length = (accepted drafts + the target's own token) per verify step, over every verify step of
every prompt (a prompt that runs longer counts for more, as it does in decoding time). Measured at
temperature 0, so the output is the target's greedy answer whatever the draft; the first token, which comes
from the prefill, is no verify step and is not counted. Used by tests/perf/draft_acceptance.py, the shipped
demo head's test and `moedesk bench --speculative`.
"""
from __future__ import annotations

import time

from moedesk.engine.requests import Request, SamplingParams


def _prompt_ids(engine, prompt) -> list[int]:
    """A str is one user message through the chat template; a list of dicts a conversation; a list of ints ids."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return engine.tokenizer.chat_prompt(prompt)


def acceptance_length(engine, prompts, draft=None, mode: str = "greedy", draft_length: int = 4, draft_width: int = 4,
                      budget: int | None = None, max_new_tokens: int = 256, batch_size: int = 8) -> dict:
    """Speculative greedy decoding of `prompts` with `draft` (an EAGLE head folder, a drafter factory, or None:
    the demo's shipped head); mode greedy (chains of draft_length) or beam (trees of depth draft_length,
    draft_width children per node, `budget` nodes: budget = draft_length verifies as many tokens per step as a
    chain). Returns {"mean": acceptance length, "accepted", "verify_steps", "drafted", "tokens",
    "per_prompt": [tokens per step of each prompt], "seconds"}."""
    from moedesk.engine.speculative.job import generate_speculative
    from moedesk.engine.speculative.demo_draft import resolve_draft

    if mode not in ("greedy", "beam"):
        raise ValueError(f"acceptance is measured in greedy or beam mode, not {mode!r}")
    draft = resolve_draft(engine, draft)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    requests = [Request(_prompt_ids(engine, p), params, tag=i) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    per_prompt: list[float | None] = [None] * len(requests)
    accepted = steps = drafted = tokens = 0
    for c in generate_speculative(engine, requests, batch_size, draft, mode, draft_length, draft_width, budget):
        s = c.stats["speculative"]
        accepted += s["accepted"]
        steps += s["verify_steps"]
        drafted += s["drafted"]
        tokens += len(c.token_ids)
        per_prompt[c.tag] = s["tokens_per_step"]
    return {"mean": (accepted + steps) / steps if steps else None, "accepted": accepted, "verify_steps": steps,
            "drafted": drafted, "tokens": tokens, "per_prompt": per_prompt,
            "seconds": round(time.perf_counter() - started, 1)}
