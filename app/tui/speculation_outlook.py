"""Whether speculative decoding can pay on this machine, in words, from the step times auto measured here.

On a CPU a Mixture-of-Experts verify step reads the experts of every drafted token, so checking four drafts can
cost several plain steps: speculation then loses whatever the draft head. The settings screen says so next to the
Speculative setting instead of leaving the user to find out from slower replies.
"""
from __future__ import annotations

UNMEASURED = ("auto measures on its first reply whether drafting pays on this machine (about half a minute, "
              "once), and says so here afterwards")


def outlook_note(outlook) -> str:
    """One line for the settings screen from Engine.speculation_outlook's answer (None: not measured yet)."""
    if outlook is None:
        return UNMEASURED
    if outlook.loses:
        return (f"On this machine speculation loses: checking {outlook.gamma} guesses costs "
                f"{outlook.verify_cost:.1f} plain steps, so even with {outlook.alpha:.0%} of guesses right a "
                f"reply would come at {outlook.speedup:.2f}x plain speed. auto decodes plainly here; greedy and beam "
                f"are slower than off.")
    return (f"On this machine speculation pays only with a draft head that guesses at least {outlook.break_even:.0%} "
            f"of tokens right (checking {outlook.gamma} guesses costs {outlook.verify_cost:.1f} plain steps); "
            f"up to {outlook.speedup:.2f}x at {outlook.alpha:.0%}. auto tries and keeps it only where it pays.")


def speculation_note(engine, draft_length: int) -> str:
    """The note for `engine` (empty for engines that do not measure step times: llama.cpp's, a remote one's)."""
    outlook_of = getattr(engine, "speculation_outlook", None)
    if outlook_of is None:
        return ""
    try:
        return outlook_note(outlook_of(draft_length))
    except Exception:  # noqa: BLE001 - a note is not worth a crash
        return ""
