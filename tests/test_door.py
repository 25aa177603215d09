"""Front ends reach the engine through one door: Engine (and the interface both engines share) and plain types.

app/ may import these engine modules and no others (issue 44, item 2): a front end that needs more asks for a plain
function or type here, not for the engine's internals.
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
    "moedesk.engine.load.reply_stream",  # the same, read as a stream arrives
    "moedesk.engine.load.size_estimate",  # what a model needs, before it is loaded
    "moedesk.engine.hardware",  # facts about this machine
    "moedesk.engine.host_memory",  # the memory this process may use (RAM, or a cgroup's limit)
    "moedesk.engine.memory_fit",  # whether a model fits that memory, before it is read
    "moedesk.engine.selection",  # which engine runs a model, and why; preflight: what loading would refuse
    "moedesk.engine.listing",  # a model on disk as listed: native architectures, a GGUF's header, the demo
    "moedesk.engine.json_read",  # JSON a file hands us, read so that nesting too deep is one line, not a traceback
    "moedesk.engine.load.gguf_header",  # a GGUF file's header from its first bytes (estimates before downloading)
    "moedesk.engine.speculative.eagle_export",  # a draft head folder rewritten for vLLM/SGLang (export-draft)
}


def reach_ins(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, deps in graph.items() if a.startswith("moedesk.app") for b in deps
            if b.startswith("moedesk.engine") and b not in DOOR and b != "moedesk.engine"}


def test_front_ends_import_only_the_engines_door():
    found = sorted(reach_ins(import_graph()))
    assert not found, f"app/ reaches past the engine's door: {found}"


def test_a_reach_in_is_seen():
    graph = {"moedesk.app.cli": {"moedesk.engine.runtime", "moedesk.engine.generation.scheduler"},
             "moedesk.bench.synthetic": {"moedesk.engine.offload.assignment"}}  # bench is no front end
    assert reach_ins(graph) == {("moedesk.app.cli", "moedesk.engine.generation.scheduler")}


def test_the_server_uses_no_scheduler_internals_nor_the_apps_settings():
    deps = import_graph()["moedesk.app.server"]
    assert not {d for d in deps if d.startswith(("moedesk.engine.generation", "moedesk.app.tui"))}, deps

