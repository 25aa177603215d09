"""The draft head shipped for the built-in demo model (assets/demo_draft, trained by `moedesk train-draft`).

`--speculative` on the demo without `--draft` uses it. Its config.json records the demo recipe version it
was trained for; the demo model changes only with that version, and a head trained for another demo would
draft for a model that no longer exists, so a mismatch is refused.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from moedesk.engine import json_read
from moedesk.engine.errors import MoedeskError

FOLDER = "demo_draft"


def demo_head_folder() -> Path:
    return Path(str(resources.files("moedesk.assets").joinpath(FOLDER)))


def check_demo_head(folder) -> None:
    """MoedeskError (one line) when the head at `folder` says it was trained for another demo recipe version."""
    from moedesk.engine.load.demo import recipe

    folder = Path(folder)
    try:
        meta = json_read.loads((folder / "config.json").read_text()).get("moedesk") or {}
    except (OSError, ValueError):
        return  # not ours to judge: load_eagle_head says what is wrong with it
    trained = meta.get("demo_recipe_version")
    version = recipe()["version"]
    if trained is not None and trained != version:
        raise MoedeskError(f"{folder}: this draft head was trained for demo model version {trained}, the demo is "
                           f"version {version}; train one with `moedesk train-draft --model demo --out DIR` and pass "
                           f"--draft DIR")


def default_draft(engine) -> Path:
    """The draft head to use when none is given: the shipped one for the demo; otherwise a one-line error."""
    if engine.name != "demo":
        raise MoedeskError(f"speculative decoding of {engine.name} needs --draft PATH (an EAGLE head folder; "
                           f"`moedesk train-draft` trains one)")
    folder = demo_head_folder()
    if not (folder / "config.json").is_file():
        raise MoedeskError(f"{folder}: the demo's draft head is missing; reinstall moedesk or pass --draft PATH")
    check_demo_head(folder)
    return folder


def resolve_draft(engine, draft):
    """The draft a front end should use: `draft` as given (a head folder or a drafter factory), else the demo's
    shipped head; a head folder given for the demo is checked against its recipe version."""
    if draft is None:
        return default_draft(engine)
    if engine.name == "demo" and not callable(draft):
        check_demo_head(draft)
    return draft
