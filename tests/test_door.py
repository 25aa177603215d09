"""Front ends reach the engine through one door: Engine (and the interface both engines share) and plain types.

app/ may import these engine modules and no others; the reach-ins still there when this test was written are
listed as debts (issue 44, item 2), and a new one fails the test.
"""
from __future__ import annotations

from tests.test_docs import import_graph

DOOR = {
    "moedesk.engine.runtime",  # Engine.load
    "moedesk.engine.interface",  # EngineFace and the types used with submit: Group, QueueFull, Update, ...
    "moedesk.engine.requests",  # Request, SamplingParams, Completion, StreamChunk
    "moedesk.engine.errors",
    "moedesk.engine.decoding",  # decoding options, built once for every front end
    "moedesk.engine.load.reply_format",  # a reply's reasoning, answer and tool calls
    "moedesk.engine.load.size_estimate",  # what a model needs, before it is loaded
    "moedesk.engine.hardware",  # facts about this machine
    "moedesk.engine.host_memory",  # the memory this process may use (RAM, or a cgroup's limit)
    "moedesk.engine.memory_fit",  # whether a model fits that memory, before it is read
    "moedesk.engine.selection",  # which engine runs a model, and why
    "moedesk.engine.json_read",  # JSON a file hands us, read so that nesting too deep is one line, not a traceback
    "moedesk.engine.load.gguf_header",  # a GGUF file's header from its first bytes (estimates before downloading)
}

KNOWN_REACH_INS = {
    ("moedesk.app.tui.catalog", "moedesk.engine.load.demo"),
    ("moedesk.app.tui.catalog", "moedesk.engine.load.gguf_checkpoint"),
    ("moedesk.app.tui.catalog", "moedesk.engine.model.architectures"),
    ("moedesk.app.tui.screens.models", "moedesk.engine.load.checkpoint"),
    ("moedesk.app.tui.screens.models", "moedesk.engine.model.architectures"),
    ("moedesk.app.tui.widgets.load_panel", "moedesk.engine.load.demo"),
}


def reach_ins() -> set[tuple[str, str]]:
    return {(a, b) for a, deps in import_graph().items() if a.startswith("moedesk.app") for b in deps
            if b.startswith("moedesk.engine") and b not in DOOR and b != "moedesk.engine"}


def test_front_ends_import_only_the_engines_door():
    new = sorted(reach_ins() - KNOWN_REACH_INS)
    assert not new, f"app/ reaches past the engine's door: {new}"


def test_the_server_uses_no_scheduler_internals_nor_the_apps_settings():
    deps = import_graph()["moedesk.app.server"]
    assert not {d for d in deps if d.startswith(("moedesk.engine.generation", "moedesk.app.tui"))}, deps


def test_a_debt_paid_leaves_the_list():
    """A reach-in fixed must come off KNOWN_REACH_INS, so the list only ever shrinks."""
    assert KNOWN_REACH_INS <= reach_ins(), sorted(KNOWN_REACH_INS - reach_ins())
