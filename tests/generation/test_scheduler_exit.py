"""No decode thread outlives the interpreter: a process that exits (or is interrupted) while generating ends with
its own exit status, not an abort inside the decode thread's step (exit 134, "terminate called without an active
exception"), whoever uses the engine and whether or not it closed the scheduler."""
import signal
import subprocess
import sys
from pathlib import Path

from tests.ctrl_c import sigint_as_at_a_terminal

REPO = Path(__file__).resolve().parents[2]

# argv: repo, checkpoint, mode (exit, sigint, give-up), file of notes. Every forward first runs one native op of
# about a second (a stand-in for a long prefill or a CUDA step), so the decode thread is inside torch's C++ when
# the main thread ends; the script's own atexit function, registered after the engine's, notes the threads left.
SCRIPT = r"""
import atexit, sys, threading, time
repo, folder, mode, notes = sys.argv[1:5]
sys.path.insert(0, repo)
import torch
from moedesk.engine.generation import scheduler
from moedesk.engine.requests import Request, SamplingParams
from moedesk.engine.runtime import Engine

def note(text):
    with open(notes, "a") as f:
        f.write(text + "\n")

engine = Engine.load(folder, device="cpu", dtype="float32")
if mode == "give-up":
    scheduler.EXIT_JOIN_SECONDS = 0.05
n = 256
a = torch.randn(n, n)
torch.mm(a, a)  # timed warm: a first call's thread-pool start made the op too short, and give-up saw no step left
started = time.perf_counter()
torch.mm(a, a)
# At least 2048: timed on a busy machine the small op runs slow and the scaled one came out far under a second.
n = max(2048, min(4096, int(n * (1.0 / max(time.perf_counter() - started, 1e-6)) ** (1 / 3))))
big = torch.randn(n, n)
forward = engine.model.forward

def slow(*args, **kwargs):
    torch.mm(big, big)
    return forward(*args, **kwargs)

engine.model.forward = slow
atexit.register(lambda: note(f"alive {sum(t.name == 'moedesk-decode' for t in threading.enumerate())}"))
params = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
ids = engine.tokenizer.encode("The quick brown fox")
if mode == "sigint":
    try:
        for chunk in engine.stream(ids, params):
            print("generating", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
else:
    first = threading.Event()

    def sink(update):
        first.set()
        if update.final:
            note(f"final {update.completion.finish_reason if update.completion else update.error}")

    engine.submit(Request(ids, params), sink=sink)  # never closed: the script just ends mid-reply
    first.wait(60)
    print("generating", flush=True)
"""


def run(folder, tmp_path, mode):
    notes = tmp_path / "notes"
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(REPO), str(folder), mode, str(notes)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=sigint_as_at_a_terminal)
    try:
        assert process.stdout.readline() == "generating\n"
        if mode == "sigint":
            process.send_signal(signal.SIGINT)
        err = process.communicate(timeout=60)[1]
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err, notes.read_text().splitlines() if notes.exists() else []


def test_a_script_that_ends_while_generating_exits_0_once_the_step_in_flight_is_done(tiny_checkpoint, tmp_path):
    code, err, notes = run(tiny_checkpoint("qwen3_moe"), tmp_path, "exit")
    assert code == 0, err[-2000:]
    assert "Traceback" not in err and "terminate called" not in err and "moedesk:" not in err, err[-2000:]
    # the request ended cancelled on the decode thread, which had stopped before the script's atexit function ran
    assert notes == ["final cancelled", "alive 0"]


def test_ctrl_c_while_streaming_exits_with_the_scripts_own_status(tiny_checkpoint, tmp_path):
    code, err, notes = run(tiny_checkpoint("qwen3_moe"), tmp_path, "sigint")
    assert code == 130, err[-2000:]
    assert err.strip() == "interrupted"
    assert notes == ["alive 0"]


def test_a_step_that_outlasts_the_wait_is_said_in_one_line(tiny_checkpoint, tmp_path):
    code, err, notes = run(tiny_checkpoint("qwen3_moe"), tmp_path, "give-up")
    lines = [line for line in err.splitlines() if line.startswith("moedesk:")]
    assert lines == ["moedesk: a decode step was still running 0.05 s after exit began; exiting without waiting "
                     "for it"], err[-2000:]
