"""Batch from a pipe answers the lines already received while the writer is idle (issue 46, item 10): a blocking
read ahead held them, and their answers, until the next line came or the pipe closed."""
import io
import json
import os
import threading
import time

from moedesk.app.batch import BatchSettings, run_batch
from moedesk.engine.runtime import Engine


def records(path):
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def test_lines_received_are_answered_while_the_pipe_is_idle(tiny_checkpoint, tmp_path):
    engine = Engine.load(str(tiny_checkpoint("llama")), device="cpu", dtype="float32")
    read_end, write_end = os.pipe()
    out = tmp_path / "out.jsonl"
    lines = [{"id": f"l{i}", "prompt_ids": [3, 4, 5 + i]} for i in range(10)]
    os.write(write_end, "".join(json.dumps(line) + "\n" for line in lines).encode())
    result = {}

    def run():
        with os.fdopen(read_end, "rb") as stdin:
            result["code"] = run_batch("-", out, engine, BatchSettings(temperature=0, max_new_tokens=4, batch_size=4),
                                       stderr=io.StringIO(), stdin=stdin, progress=False)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(records(out)) < 10:
        assert time.monotonic() < deadline, f"{len(records(out))} of 10 lines answered while the pipe stayed open"
        assert thread.is_alive()
        time.sleep(0.05)
    os.write(write_end, (json.dumps({"id": "late", "prompt_ids": [3, 4]}) + "\n").encode())
    os.close(write_end)
    thread.join(60)
    assert result["code"] == 0
    assert sorted(r["id"] for r in records(out)) == sorted([f"l{i}" for i in range(10)] + ["late"])
