"""The cost of reading a streamed chat reply (engine/load/reply_stream.py), per update.

    python tests/perf/bench_reply_parse.py [--step 4] [--repeat 150]

Prints microseconds per update for a reply of reasoning, an answer with HTML-like tags and a tool call, in
Qwen3's, gpt-oss harmony's and a plain model's format; then for a call whose arguments are long (code, streamed in
fragments as they are written), in Qwen3's format and as a reply forced to call. CPU only; docs/measurements.md
keeps the figures.
"""
from __future__ import annotations

import argparse
import json
import time

from moedesk.engine.load.reply_format import CALL_LIST, PLAIN, ReplyFormat
from moedesk.engine.load.reply_stream import ReplyStream


def reply(repeat: int) -> str:
    return ("<think>\n" + "reasoning words here, " * repeat + "</think>\n\n" + "The answer <b>is</b> here. " * repeat
            + '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')


def long_call(repeat: int) -> str:
    return json.dumps({"name": "python", "arguments": {"code": "x = x + 1\n" * repeat}})


def timed(name: str, fmt, text: str, step: int) -> None:
    stream, updates = ReplyStream(fmt), 0
    started = time.perf_counter()
    for end in range(step, len(text) + step, step):
        stream.update(text[:end])
        updates += 1
    elapsed = time.perf_counter() - started
    print(f"{name}: {len(text)} characters, {updates} updates, {elapsed / updates * 1e6:.1f} us an update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=4, help="characters a stream update adds (default 4)")
    parser.add_argument("--repeat", type=int, default=150, help="phrases of reasoning and of answer (default 150)")
    args = parser.parse_args()
    text = reply(args.repeat)
    for name, fmt in (("qwen3", ReplyFormat(("<think>", "</think>"), "tagged")),
                      ("harmony", ReplyFormat(None, "harmony")), ("plain", PLAIN)):
        timed(name, fmt, text, args.step)
    call = long_call(args.repeat * 2)
    timed("qwen3, long arguments", ReplyFormat(("<think>", "</think>"), "tagged"),
          "<tool_call>\n" + call + "\n</tool_call>", args.step)
    timed("forced call, long arguments", CALL_LIST, "[" + call + "]", args.step)

if __name__ == "__main__":
    main()
