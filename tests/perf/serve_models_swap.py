"""Two models behind one `moedesk serve` on the GPU: what switching costs, and that an unloaded model gives its
memory back (issue 43, item 3).

Usage (GPU box, repo root):
    python3 tests/perf/serve_models_swap.py --model A --model B [--rounds 3] [--device cuda] [--port 8124]
        [--json OUT.json]
    python3 tests/perf/serve_models_swap.py --smoke   (CPU, two tiny random checkpoints, a few seconds)

Starts `moedesk serve --model A --model B` as its own process, then asks A, B, A, B... (--rounds of each) for a
short greedy reply and reports per request: the model, whether it had to load (the other unloaded first), the
wall time, and the GPU memory in use (nvidia-smi, the whole device) and the server's resident RAM (/proc) once it
answered. Each round's memory should come back to the first round's for that model: more means an unloaded
model left something behind. It also checks each model's reply is the same in every round.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from tests.app.serve_process import serve_process  # noqa: E402

KEY = "sk-swap"
ASK = [{"role": "user", "content": "Name three colours."}]


def gpu_used_mib() -> int | None:
    with contextlib.suppress(Exception):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    return None


def rss_mib(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return None


def server_pid(port: int) -> int | None:
    out = subprocess.run(["pgrep", "-f", f"moedesk serve .*--port {port}"], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out.split() else None


def run(models: list[str], rounds: int, device: str, dtype: str | None) -> dict:
    args = [a for m in models for a in ("--model", m)] + ["--device", device, "--keep-alive", "-1"]
    args += ["--dtype", dtype] if dtype else []
    rows, replies = [], {}
    with serve_process(args, KEY, startup_s=1800) as base:
        port = int(base.rsplit(":", 1)[1])
        pid = server_pid(port)
        headers = {"Authorization": f"Bearer {KEY}"}
        for round_ in range(rounds):
            for model in models:
                before = {m["id"]: m["loaded"] for m in httpx.get(base + "/v1/models", headers=headers).json()["data"]}
                started = time.perf_counter()
                reply = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=1800, json={
                    "model": model, "messages": ASK, "max_tokens": 16, "temperature": 0}).json()
                seconds = time.perf_counter() - started
                text = reply["choices"][0]["message"]["content"]
                same = replies.setdefault(model, text) == text
                rows.append({"round": round_, "model": model, "loaded_first": not before.get(model, False),
                             "seconds": round(seconds, 2), "gpu_used_mib": gpu_used_mib(),
                             "server_rss_mib": rss_mib(pid) if pid else None, "same_reply": same})
                print(json.dumps(rows[-1]), flush=True)
    return {"models": models, "device": device, "requests": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        from tests import tiny_models

        root = Path(tempfile.mkdtemp(prefix="swap-"))
        args.model = [str(tiny_models.build("qwen3_moe", root / "a", seed=1)),
                      str(tiny_models.build("olmoe", root / "b", seed=2))]
        args.device, args.dtype, args.rounds = "cpu", "float32", 2
    if len(args.model) != 2:
        parser.error("give two --model")
    report = run(args.model, args.rounds, args.device, args.dtype)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = all(r["same_reply"] for r in report["requests"])
    print("every model answered the same in every round" if ok else "a reply changed between rounds")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
