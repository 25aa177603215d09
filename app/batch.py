"""`moedesk batch`: complete every line of a JSONL file, resumable, one output line per input line.

The contract (docs/architecture.md, "Contracts other tools rely on"): output in input order, appended and flushed line
by line; ids already in the output are skipped on a rerun; a bad line becomes an `error` line and the run goes on;
exit 0 when every line succeeded, 1 when some failed (or the output could not be written, as on a full disk: the run
stops, what was written stays, and a rerun resumes), 2 for usage errors.

Memory stays bounded: the input is read line by line and handed to the engine as a generator
it pulls from, so at any moment only the lines in flight and the finished results waiting for
an earlier, slower line are held (while one line decodes, at most about batch_size results per
decode step can finish behind it). What is kept for the whole run is one id per input line (to
spot duplicates) and per output line (to skip what is already done).
"""
from __future__ import annotations

import argparse
import codecs
import contextlib
import difflib
import errno
import json
import math
import os
import re
import stat
import sys
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: a lock file beside the output instead (see _lock_output)
    fcntl = None

from moedesk.app import batch_openai, chat_request
from moedesk.app.tui.conversation_lock import ConversationLock
from moedesk.engine.decoding import DRAFT_LENGTH, DRAFT_WIDTH, SPECULATIVE_MODES, Decoding, decoding_options
from moedesk.engine.errors import EngineUnavailable, MoedeskError
from moedesk.engine.load.reply_format import Parsed, parse_reply, starts_in_reasoning
from moedesk.engine.requests import NOT_YET, TEMPERATURE_MAX, Completion, Request, SamplingParams

PROMPT_KINDS = ("prompt", "messages", "prompt_ids")
LINE_OVERRIDES = ("max_new_tokens", "temperature", "top_p", "seed")  # what one line may set for itself
# Every field a line sets: any other is reported once and ignored (_Run._request).
# The chat fields (messages lines only) are the server's, checked by app/chat_request.py.
CHAT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort")
LINE_FIELDS = ("id", *PROMPT_KINDS, *LINE_OVERRIDES, "stop", "beams", "length_penalty", "response_format",
               *CHAT_FIELDS)
# Widest beam search one line may ask for, as the server's (app/server.py, MAX_BEAMS): a search holds beams x
# context of KV cache, and one wider than the engine's beam rows runs alone with all of them.
MAX_LINE_BEAMS = 16
SEED_LIMIT = 2**64  # torch.Generator.manual_seed overflows beyond this; catch it here, not mid-run
# Longest input line read, newline excluded: a prompt filling a 1M-token context is a few MiB even
# JSON-escaped, and nothing (a file without newlines, /dev/zero) may make the reader hold more.
MAX_LINE_BYTES = 16 * 2**20
STDIO = "-"  # as input: standard input; as output: standard output


class _Stopped(MoedeskError):
    """The run cannot go on (the output takes no more lines, the input cannot be read, the model fails
    on everything): it stops with this one line and exits 1; what is written stays and a rerun resumes."""


class BatchUsageError(MoedeskError):
    """The run cannot start (input unreadable, output folder missing, bad option): the CLI exits 2."""


class BatchOutputError(_Stopped):
    """The output file stopped taking lines mid-run (a full disk): the run stops and exits 1."""


@dataclass
class BatchSettings:
    """Sampling defaults for lines that do not override them, and how many sequences run together."""

    # The engine's sampling defaults, so the two never drift apart.
    max_new_tokens: int = SamplingParams.max_new_tokens
    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k
    seed: int = SamplingParams.seed
    ignore_eos: bool = SamplingParams.ignore_eos
    beams: int = 1  # above 1: beam search (engine.generation.beam), the beam lines in flight stepping together
    length_penalty: float = 1.0  # beam search's, as transformers applies it
    speculative: str = "off"  # one of engine.decoding.SPECULATIVE_MODES, with an EAGLE head
    draft: str | None = None  # the EAGLE head's folder
    draft_length: int = DRAFT_LENGTH
    draft_width: int = DRAFT_WIDTH
    batch_size: int | None = None  # None: as many as free memory holds, chosen when the run starts
    gpu_budget_gib: float | tuple[float, ...] | None = None  # None: the engine decides; a tuple: one per GPU
    dtype: str | None = None  # None: the engine's default for the device
    expert_dtype: str = "auto"  # how routed experts are kept (engine.load.loader.expert_formats)
    from_app: tuple[str, ...] = ()  # which of these came from the app's saved settings
    batch_size_from_memory: bool = False  # batch_size was chosen from free memory
    # Sampling values nobody set (no flag, blank in the app): the model's own defaults take them once it is loaded.
    sampling_unset: tuple[str, ...] = field(default=(), compare=False)
    from_model: tuple[str, ...] = ()  # which of these are the model's own defaults

    def with_model_defaults(self, defaults: dict) -> "BatchSettings":
        """These settings with the model's own sampling defaults (Engine.generation_defaults) where none was set."""
        taken = {name: defaults[name] for name in self.sampling_unset if name in defaults}
        return replace(self, **taken, sampling_unset=(), from_model=tuple(taken))

    def describe(self) -> str:
        shown = [f for f in fields(self) if f.name not in ("from_app", "batch_size_from_memory", "sampling_unset",
                                                           "from_model")
                 and (self.beams > 1 or f.name not in ("beams", "length_penalty"))
                 and (self.speculative != "off" or f.name not in ("draft", "draft_length", "draft_width"))]

        def mark(name: str) -> str:
            if name == "batch_size" and self.batch_size_from_memory:
                return " (what free memory holds)"
            return "*" if name in self.from_app else "+" if name in self.from_model else ""

        def value(name: str):
            got = getattr(self, name)
            return "auto" if got is None else got  # None: the engine decides (dtype, GPU budget), not "None"

        text = ", ".join(f"{f.name}={value(f.name)}{mark(f.name)}" for f in shown)
        return text + (" (* from the app's settings)" if self.from_app else "") + \
            (" (+ the model's own default)" if self.from_model else "")

    def sampling_params(self, line: dict | None = None) -> SamplingParams:
        """These settings with the line's own `max_new_tokens`, `temperature`, `top_p`, `seed`.

        Raises ValueError with a one-line message for a value of the wrong type or range.
        """
        values = {key: getattr(self, key) for key in LINE_OVERRIDES}
        for key in LINE_OVERRIDES:
            if line is not None and key in line:
                values[key] = line[key]
            _check_param(key, values[key])
        return SamplingParams(top_k=self.top_k, ignore_eos=self.ignore_eos, **values)


# What each setting may be; shared by the per-line overrides and the command-line flags.
_INTEGERS = {"max_new_tokens", "seed", "top_k", "batch_size", "beams"}
_RANGES = {
    "max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "batch_size": (lambda v: v >= 1, ">= 1"),
    "temperature": (lambda v: 0 <= v <= TEMPERATURE_MAX, f"in [0, {TEMPERATURE_MAX:g}]"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= 0, ">= 0"),
    "seed": (lambda v: 0 <= v < SEED_LIMIT, "in [0, 2**64)"),
    "beams": (lambda v: v >= 1, ">= 1"),
    # as the server's: beyond, length ** length_penalty overflows a float on long replies and fails the beam step
    "length_penalty": (lambda v: -10 <= v <= 10, "in [-10, 10]"),
}


def _check_param(key: str, value) -> None:
    """Raise ValueError (one line) unless `value` is a valid `key`."""
    # bool is an int in Python, but `"seed": true` in a file is a mistake, not 1.
    if key in _INTEGERS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {_show(value)}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        # json.loads accepts NaN and Infinity; either would make sampling silently wrong.
        raise ValueError(f"{key} must be a finite number, got {_show(value)}")
    in_range, need = _RANGES[key]
    if not in_range(value):
        raise ValueError(f"{key} must be {need}, got {_show(value)}")


# --- command line -----------------------------------------------------------------------------

# Flags whose default is the app's setting of the same meaning (the settings screen), when one is given.
APP_SETTINGS = {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "seed": "seed", "gpu_budget_gib": "gpu_budget_gib",
                "dtype": "engine_dtype",  # auto is None: the engine's default, as if unset
                "expert_dtype": "engine_expert_dtype"}


AUTO_BATCH_CAP = 16  # the batched decode measured on the GPU box (docs/measurements.md, "Speed")
PROMPT_ALLOWANCE = 512  # prompt tokens assumed per line when sizing the batch, before any line is read


def batch_size_for_memory(free_bytes: int, bytes_per_sequence: int, share: float = 0.5,
                          cap: int = AUTO_BATCH_CAP) -> int:
    """How many sequences' KV caches fit in `share` of the free memory, from 1 to `cap`.

    Half, not all: the cache grows to the longest line in flight, and the rest of the step
    (activations, the experts copied to the GPU) needs room too.
    """
    if bytes_per_sequence <= 0:
        return cap
    return max(1, min(cap, int(free_bytes * share) // bytes_per_sequence))


def batch_size_for_devices(room: list[tuple[int, int]], share: float = 0.5, cap: int = AUTO_BATCH_CAP) -> int:
    """The batch every device holds: `room` is each device's (free bytes, bytes of its own layers' KV cache a
    sequence), and a sequence needs its cache on each of them at once, so the least device's batch is the batch."""
    return min((batch_size_for_memory(free, need, share, cap) for free, need in room), default=cap)


def kv_bytes_by_device(cache) -> dict:
    """The cache's bytes a position on each device it lives on: a model spread over GPUs keeps each run of layers'
    cache on its own GPU (one kind of the cache per run); any other cache is all on its one device."""
    kinds = getattr(cache, "kinds", None) or [cache]
    found: dict = {}
    for kind in kinds:
        device = getattr(kind, "device", None)
        found[device] = found.get(device, 0) + kind.bytes_per_position()
    return found


def free_memory_bytes(device) -> int:
    """Free memory where the KV cache lives: the GPU's, or the RAM available (within a container's limit)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    from moedesk.engine.host_memory import available_memory

    return available_memory()


def auto_batch_size(engine, positions: int) -> int:
    """`positions`: the cache length one sequence may need (what the longest line asks for). Each device the cache
    lives on is asked for its own room against its own layers' share (one device: the engine's)."""
    by_device = kv_bytes_by_device(engine.cache)
    if len(by_device) == 1:  # one device, whatever the cache calls it: the engine's, as it always was
        return batch_size_for_memory(free_memory_bytes(engine.device), engine.cache.bytes_per_position() * positions)
    return batch_size_for_devices([(free_memory_bytes(device), per_position * positions)
                                   for device, per_position in by_device.items()])


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch job's own flags; the model/device/dtype/GPU-budget flags are added by the CLI.

    Sampling flags default to None here: the CLI fills them from the app's saved settings.
    """
    # What a line may hold, where someone writing one looks first (the list is the one lines are checked against).
    parser.epilog = (f"Each line of IN.jsonl is a JSON object with an id and one of {', '.join(PROMPT_KINDS)}. "
                     f"It may also set: {', '.join(f for f in LINE_FIELDS if f != 'id' and f not in PROMPT_KINDS)}; "
                     f"the flags above are the defaults for lines that do not. A line of OpenAI's Batch API "
                     f"(custom_id, url, body) runs as it is and gets OpenAI's output line.")
    parser.add_argument("input", metavar="IN.jsonl",
                        help="one JSON object per line: id plus one of prompt, messages, prompt_ids")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.jsonl",
                        help="results in input order, appended; ids already there are skipped (resume)")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                        help="per line, unless the line sets max_new_tokens (default: the app's setting)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="0 = greedy (default: the app's setting, else the model's own, else 0.7)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="nucleus sampling (default: the app's setting, else the model's own, else 0.95)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="0 = off (default: the app's setting, else the model's own, else 0)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed of each line's own generator, unless the line sets seed "
                             "(default: the app's setting, or 0 when that is blank)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help=f"sequences decoded together (default: as many as half the free GPU memory, or RAM "
                             f"without a GPU, holds KV caches for, at most {AUTO_BATCH_CAP})")
    parser.add_argument("--beams", type=int, default=1, metavar="W",
                        help="beam search over W hypotheses, unless the line sets beams (default 1: off)")
    parser.add_argument("--length-penalty", type=float, default=1.0, metavar="L",
                        help="beam search scores sum(logprobs) / length**L, as transformers (default 1.0)")
    parser.add_argument("--speculative", choices=SPECULATIVE_MODES, default="off",
                        help="speculative decoding with the EAGLE head --draft: chains (greedy), trees (beam), or auto: "
                             "draft lengths chosen from measured step times, plain decoding where drafting would "
                             "not pay (default off)")
    parser.add_argument("--draft", default=None, metavar="PATH", help="EAGLE draft head folder (config.json + weights)")
    parser.add_argument("--draft-length", type=int, default=4, metavar="N",
                        help="draft tokens per step (tree depth; auto's longest) (default 4)")
    parser.add_argument("--draft-width", type=int, default=4, metavar="K",
                        help="beam mode: children per tree node; the tree keeps N x K nodes (default 4)")


def settings_from_args(args: argparse.Namespace, app_settings=None) -> BatchSettings:
    """Flags first, then the app's settings (an app.tui.settings.Settings), then BatchSettings' own defaults."""
    values, from_app = {}, []
    for name in APP_SETTINGS:
        flag = getattr(args, name.removesuffix("_gib"), None)
        app_value = getattr(app_settings, APP_SETTINGS[name], None) if app_settings is not None else None
        if flag is not None:
            values[name] = flag
        elif app_value is not None:
            values[name] = app_value
            from_app.append(name)
    settings = BatchSettings(**values, ignore_eos=args.ignore_eos, batch_size=args.batch_size,
                             beams=getattr(args, "beams", 1), length_penalty=getattr(args, "length_penalty", 1.0),
                             speculative=getattr(args, "speculative", "off"), draft=getattr(args, "draft", None),
                             draft_length=getattr(args, "draft_length", DRAFT_LENGTH),
                             draft_width=getattr(args, "draft_width", DRAFT_WIDTH), from_app=tuple(from_app),
                             sampling_unset=tuple(n for n in ("temperature", "top_p", "top_k") if n not in values))
    if settings.speculative != "off" and not settings.draft and getattr(args, "model", "demo") != "demo":
        # the demo has a head of its own (engine.speculative.demo_draft)
        raise BatchUsageError(f"--speculative {settings.speculative}: needs --draft PATH (an EAGLE head folder)")
    if settings.draft_length < 1 or settings.draft_width < 1:
        raise BatchUsageError("--draft-length and --draft-width: must be >= 1")
    for name in _RANGES:
        if name == "batch_size" and settings.batch_size is None:
            continue  # chosen from memory once the model is loaded
        try:
            _check_param(name, getattr(settings, name))
        except ValueError as e:
            raise BatchUsageError(f"--{name.replace('_', '-')}: {e}") from None
    if isinstance(settings.gpu_budget_gib, (int, float)) and settings.gpu_budget_gib < 0:  # a tuple: one per GPU
        raise BatchUsageError(f"--gpu-budget: must be >= 0 GiB, got {settings.gpu_budget_gib}")
    return settings


def speculative_options(engine, settings: BatchSettings):
    """The SpeculativeOptions of a run with --speculative, its draft head loaded now: a head that does not load
    (a folder without config.json, weights of the wrong shape) raises MoedeskError, one line, before any line runs.
    Loaded at the first step instead, it failed every step, and every line then ran again alone, plainly."""
    choice = Decoding(settings.speculative, settings.draft, settings.draft_length, settings.draft_width)
    return decoding_options(engine, choice, load_draft=True)


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def check_batch_paths(in_path, out_path) -> None:
    """Raise BatchUsageError unless the input can be read and the output written (and is not locked).

    Cheap, so the CLI calls it before the slow model load; it creates nothing.
    """
    in_stdio, out_stdio = str(in_path) == STDIO, str(out_path) == STDIO
    in_path, out_path = Path(in_path), Path(out_path)
    if not in_stdio:
        if not in_path.exists():
            raise BatchUsageError(f"{in_path}: no such input file")
        if in_path.is_dir():
            raise BatchUsageError(f"{in_path}: is a folder, not an input file")
        if not _is_regular_file(in_path):
            # Opening a pipe to test it could take what a writer sends, or wait for one to appear.
            if not os.access(in_path, os.R_OK):
                raise BatchUsageError(f"{in_path}: cannot read the input")
        else:
            try:
                with open(in_path, "rb") as f:
                    head = f.read(8)
            except OSError as e:
                raise BatchUsageError(f"{in_path}: cannot read the input file ({e.strerror})") from None
            wide = _wide_encoding(head)
            if wide:  # every line would be an error line, after the model's load
                raise BatchUsageError(f"{in_path}: is {wide} text; moedesk batch reads UTF-8 JSONL (save it as "
                                      f"UTF-8, e.g. PowerShell's Out-File -Encoding utf8)")
    if out_stdio:
        return
    parent = out_path.resolve().parent
    if not parent.is_dir():
        if parent.exists():
            raise BatchUsageError(f"{out_path}: {parent} is a file, not a folder")
        raise BatchUsageError(f"{out_path}: the output folder {parent} does not exist")
    if out_path.is_dir():
        raise BatchUsageError(f"{out_path}: is a folder, not an output file")
    if out_path.exists():
        if not in_stdio and _is_regular_file(out_path) and os.path.samefile(in_path, out_path):
            raise BatchUsageError(f"{out_path}: the output file must not be the input file")
        if not os.access(out_path, os.W_OK):
            raise BatchUsageError(f"{out_path}: cannot write the output file")
        if _is_regular_file(out_path):
            try:
                with open(out_path, "ab") as f:
                    lock = _lock_output(f, out_path)
                    if lock is not None:
                        lock.release()
            except OSError as e:
                raise BatchUsageError(f"{out_path}: cannot write the output file ({e.strerror})") from None
    elif not os.access(parent, os.W_OK):
        raise BatchUsageError(f"{out_path}: cannot create files in {parent}")


def _wide_encoding(head: bytes) -> str | None:
    """"UTF-16" or "UTF-32" when a file's first 8 bytes are that (Windows PowerShell 5's `>` writes UTF-16), else
    None: a byte order mark, or ASCII text with every second (fourth) byte NUL. A first line of other stray NULs
    is only that line's error."""
    if head.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "UTF-32"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    if len(head) == 8 and all(b < 0x80 for b in head):
        for step, name in ((4, "UTF-32"), (2, "UTF-16")):
            for first in range(step):  # the one non-NUL byte of each unit: first (little-endian) or last
                units = [head[i:i + step] for i in range(0, 8, step)]
                if all(u[first] and u.count(0) == step - 1 for u in units) and first in (0, step - 1):
                    return name
    return None


def _lock_output(out, out_path) -> ConversationLock | None:
    """Hold an exclusive lock on the output while the run writes it; refuse if another run holds it.

    Two runs appending to one file would each skip only what the other had written when it
    started, and write every other line twice. A flock goes with the file's closing (or the process); without
    flock (Windows) the lock is `<output>.lock` beside it, returned for the caller to release (a killed run's
    is stale and broken by the next, see app.tui.conversation_lock).
    """
    busy = BatchUsageError(f"{out_path}: another moedesk batch is writing this file; let it finish "
                           f"(rerunning afterwards completes what it did not) or choose another -o")
    if fcntl is None:
        lock = ConversationLock.try_acquire(Path(f"{out_path}.lock"))
        if isinstance(lock, str):
            raise busy
        return lock
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise busy from None
    except OSError:
        pass  # a file system without locks (some network mounts): run unlocked rather than not at all
    return None


# --- what an earlier run already wrote --------------------------------------------------------

_LINE_PREFIX = re.compile(r"line (\d+):")


@dataclass
class _Written:
    """The complete lines of an existing output file, as far as resuming needs them."""

    ids: set = field(default_factory=set)  # every id that has a record
    ok_ids: set = field(default_factory=set)  # ids with a successful record
    error_lines: set = field(default_factory=set)  # input line numbers of error records
    records: int = 0
    unreadable: int = 0  # complete lines that are not JSON objects: left alone
    keep: int = 0  # bytes of complete lines; anything after is a crash's partial line
    partial: bool = False


def _read_written(f, out_path: Path) -> _Written:
    """Scan the output file (open for reading: `f`) line by line; only ids and line numbers are kept.

    Lines longer than MAX_LINE_BYTES are none of ours: skipped unread, so that a stray huge file
    cannot exhaust memory.
    """
    written = _Written()
    try:
        while raw := f.readline(MAX_LINE_BYTES + 1):
            if not raw.endswith(b"\n"):
                if len(raw) <= MAX_LINE_BYTES:
                    # We write each record with its newline in one call, so a line without one is
                    # an interrupted write; it is cut off and its line done again.
                    written.partial = True
                    break
                while (raw := f.readline(2**20)) and not raw.endswith(b"\n"):
                    pass
                if not raw:
                    written.partial = True
                    break
                written.unreadable += 1
                written.keep = f.tell()
                continue
            written.keep += len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):
                record = None
            if not isinstance(record, dict):
                written.unreadable += 1
                continue
            written.records += 1
            if batch_openai.is_openai(record):
                record_id, ok, error = batch_openai.written(record)
            else:
                record_id, ok, error = record.get("id"), "error" not in record, str(record.get("error", ""))
            if isinstance(record_id, str):
                written.ids.add(record_id)
                if ok:
                    written.ok_ids.add(record_id)
            # Errors name their input line ("line 4: ..."): that is how lines without a usable
            # id, and repeated ids, are recognised on a rerun.
            match = _LINE_PREFIX.match(error)
            if match:
                written.error_lines.add(int(match.group(1)))
    except OSError as e:
        raise BatchUsageError(f"{out_path}: cannot read the output file ({e.strerror})") from None
    return written


# --- the input --------------------------------------------------------------------------------

def _capped_lines(f) -> Iterator[bytes | None]:
    """The lines of binary file `f`; None for one longer than MAX_LINE_BYTES.

    An over-long line is reported as soon as its first MAX_LINE_BYTES are read (so its error line
    can be written at once), then the rest of it is skipped without being kept.
    """
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        yield None
        while (raw := f.readline(2**20)) and not raw.endswith(b"\n"):
            pass


def _arrives_over_time(f) -> bool:
    """Whether reading `f` may wait on a writer (a pipe, a terminal, a socket), rather than a file on disk."""
    try:
        mode = os.fstat(f.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # an in-memory stream (tests), or closed
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)


def _read_ahead(lines: Iterator, wait_s: float = 0.05) -> Iterator:
    """`lines`, read on a thread of their own: NOT_YET when none came within `wait_s`. From a pipe, a blocking read
    held every line already received (and their answers) until the writer sent more or closed it."""
    import queue
    import threading

    got: queue.SimpleQueue = queue.SimpleQueue()
    end = object()

    def read() -> None:
        try:
            for item in lines:
                got.put(item)
        except BaseException as e:  # noqa: BLE001 -- handed to the reading side, which raises it
            got.put(e)
        got.put(end)

    threading.Thread(target=read, name="moedesk-batch-input", daemon=True).start()
    while True:
        try:
            item = got.get(timeout=wait_s)
        except queue.Empty:
            yield NOT_YET
            continue
        if item is end:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


def _input_lines(f) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes or None when too long) of each non-blank line; numbers count every line from 1."""
    for number, raw in enumerate(_capped_lines(f), 1):
        if number == 1 and raw is not None:
            raw = raw.removeprefix(codecs.BOM_UTF8)  # some editors on Windows write one
        if raw is None or raw.strip():
            yield number, raw


@dataclass
class _Scan:
    """What a first pass over a (regular) input file finds: the lines for the progress bar, and the
    most KV cache any line can ask for, to size the batch by."""

    lines: int = 0
    max_new_tokens: int = 0  # the most new tokens a line asks for (its own, or the default)
    prompt_ids: int = 0  # the longest prompt_ids list


def _scan_input(in_path: Path, settings: BatchSettings) -> _Scan:
    scan = _Scan()
    with open(in_path, "rb") as f:
        for _, raw in _input_lines(f):
            scan.lines += 1
            try:
                obj = json.loads(raw)
            except Exception:  # noqa: BLE001 -- too long (None), or not JSON: an error line, no cache needed
                continue
            if not isinstance(obj, dict):
                continue
            asked = obj.get("max_new_tokens", settings.max_new_tokens)
            if type(asked) is int and asked >= 1:
                scan.max_new_tokens = max(scan.max_new_tokens, asked)
            if isinstance(obj.get("prompt_ids"), list):
                scan.prompt_ids = max(scan.prompt_ids, len(obj["prompt_ids"]))
    return scan


def _cache_positions(scan: _Scan | None, settings: BatchSettings, context: int) -> int:
    """The cache length one sequence may grow to: what the lines ask for, within the context.

    The cache grows to the longest line in flight and shrinks only after running out of memory, so a batch
    sized for a typical line would hold batch_size rows of the longest. A stream cannot be read ahead: full context.
    """
    if scan is None:
        return context
    new_tokens = scan.max_new_tokens or settings.max_new_tokens
    return max(1, min(context, max(PROMPT_ALLOWANCE, scan.prompt_ids) + new_tokens))


@dataclass
class _Line:
    """One input line after its id has been read; error is set when the line is bad."""

    number: int
    obj: dict | None = None
    id: str | None = None
    error: str | None = None
    by_number: bool = False  # no usable id, or a repeated one: a rerun recognises it by its line number
    unknown_body: tuple[str, ...] = ()  # an OpenAI line's body fields that moedesk batch does not use


class _BadLine(Exception):
    """The reason one input line cannot be run (one line of text, without the "line N:" prefix)."""


# --- one run ----------------------------------------------------------------------------------

class _Run:
    """Feeds the engine and writes results in input order.

    A completion that finishes before the lines above it waits in `ready` until they are written.
    """

    def __init__(self, engine, settings: BatchSettings, written: _Written, out, report: "_Report"):
        self.engine, self.settings, self.written, self.out, self.report = engine, settings, written, out, report
        self.pending: deque[int] = deque()  # line numbers not yet written, in input order
        # line number -> (record, succeeded, tokens) waiting for the lines before it
        self.ready: dict[int, tuple[dict, bool, int]] = {}
        self.in_flight: dict[int, tuple[str, Request]] = {}  # line number -> (id, request) the engine holds
        self.beam_lines: dict[int, tuple[int, float]] = {}  # line number -> (beams, length penalty) of beam lines
        # line number -> how its reply is read (reply format, starts in reasoning, tools) for messages lines
        self.chat_lines: dict[int, tuple] = {}
        self.openai_lines: dict[int, bool] = {}  # line number -> chat? of OpenAI Batch API lines (app/batch_openai.py)
        self.model = getattr(engine, "name", "moedesk")  # what an OpenAI line's response names as its model
        self._line_decoding = None  # the decoding of lines that are not beam lines: None (plain) or speculative
        self.first_seen: dict[str, int] = {}  # id -> line it first appeared on
        self.ok = self.failed = self.skipped = self.failed_before = 0
        self._warnings_shown = 0  # of engine.warnings
        self.resumable = True  # a rerun skips what is written (not so for standard output, a pipe, a device)
        self.unknown_fields: set[str] = set()  # fields no line may set, each reported once

    def requests(self, lines: Iterator[tuple[int, bytes | None]], in_name) -> Iterator[Request]:
        """The engine's input: one Request per good line; bad lines are written on the way.

        Whatever one line holds, the worst it gets is its own error line: only a failure to read
        the input or to write the output stops the run.
        """
        while True:
            try:
                item = next(lines)
            except StopIteration:
                return
            except OSError as e:
                raise _Stopped(f"{in_name}: cannot read the input ({e.strerror or e}); what is written stays: "
                               f"run the same command to go on") from None
            if item is NOT_YET:  # a pipe with nothing new: the engine answers what it holds meanwhile
                yield NOT_YET
                continue
            number, raw = item
            line, request = _Line(number, by_number=True), None
            try:
                line = self._identify(number, raw)
                if self._done_before(line):
                    self.skipped += 1
                    self.report.skipped()
                    continue
                if line.error is None:
                    request = self._request(line)
            except _BadLine as e:
                line.error = str(e)
            except Exception as e:  # noqa: BLE001 -- a case no check foresaw still stays with its line
                line.error = _describe(e)
            self.pending.append(number)
            if request is None:
                self._finished(number, {"id": line.id, "error": _one_line(f"line {number}: {line.error}")})
            else:
                self.in_flight[number] = (line.id, request)
                yield request

    def _identify(self, number: int, raw: bytes | None) -> _Line:
        """Parse the JSON and find the id; later checks need the id to report and to skip."""
        line = _Line(number, by_number=True)
        if raw is None:
            line.error = f"longer than {MAX_LINE_BYTES} bytes, the limit for one line"
            return line
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            line.error = f"not valid UTF-8 (byte {e.start + 1})"
            return line
        except json.JSONDecodeError as e:
            # some of json's messages end in "at" already ("Invalid control character at")
            line.error = f"malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
            return line
        except RecursionError:
            line.error = "malformed JSON (nested too deeply)"
            return line
        except ValueError as e:  # e.g. an integer of more digits than Python converts (4300)
            line.error = f"malformed JSON ({_first_line(e)})"
            return line
        if not isinstance(obj, dict):
            line.error = f"expected a JSON object, got {_json_type(obj)}"
            return line
        line.obj = obj
        if batch_openai.is_openai(obj):
            self.openai_lines[number] = obj.get("url") != "/v1/completions"
            try:
                line.obj, self.openai_lines[number], unknown = batch_openai.to_line(obj)
            except ValueError as e:
                line.id, line.error = batch_openai.custom_id(obj), str(e)
                return line
            line.unknown_body = tuple(f"body.{name}" for name in unknown)
        line_id = line.obj.get("id")
        if not isinstance(line_id, str) or not line_id:
            line.error = "missing or non-string id" + (f" (got {_show(line_id)})" if "id" in obj else "")
            return line
        line.id = line_id
        first = self.first_seen.setdefault(line_id, number)
        if first != number:
            line.error = f"duplicate id {_show(line_id)} (first on line {first})"
            return line
        line.by_number = False
        return line

    def _note_unknown(self, number: int, names: list[str], what: str, known: tuple[str, ...] = ()) -> None:
        """Said once per name, and the line runs: datasets carry fields of their own (a category, a question id),
        while a misspelt option ("temprature") would otherwise be dropped unseen. known: the names to suggest."""
        for name in names:
            if name in self.unknown_fields:
                continue
            self.unknown_fields.add(name)
            guess = difflib.get_close_matches(name, known, 1, 0.6)
            hint = f" (did you mean {_show(guess[0])}?)" if guess else ""
            takes = f"; a line takes {', '.join(known)}" if known else ""
            self.report.note(f"line {number}: field {_show(name)} is not one {what}, ignored{hint}{takes}")

    def _done_before(self, line: _Line) -> bool:
        """Whether an earlier run wrote this line's result; counts those that had failed."""
        if line.by_number:
            if line.number in self.written.error_lines:
                self.failed_before += 1
                return True
            return False
        if line.id in self.written.ids:
            self.failed_before += line.id not in self.written.ok_ids
            return True
        return False

    def _request(self, line: _Line) -> Request:
        obj = line.obj
        self._note_unknown(line.number, [key for key in obj if key not in LINE_FIELDS], "a line sets", LINE_FIELDS)
        self._note_unknown(line.number, line.unknown_body, "moedesk batch uses")
        kinds = [k for k in PROMPT_KINDS if k in obj]
        if len(kinds) != 1:
            found = f" (found {' and '.join(kinds)})" if kinds else ""
            raise _BadLine(f"give exactly one of prompt, messages, prompt_ids{found}")
        try:
            params = replace(self.settings.sampling_params(obj), stop=chat_request.stop_strings(obj.get("stop")))
        except ValueError as e:  # BadField among them
            raise _BadLine(str(e)) from None
        if kinds[0] != "messages" and any(obj.get(k) is not None for k in CHAT_FIELDS):
            raise _BadLine(f"{next(k for k in CHAT_FIELDS if obj.get(k) is not None)} needs a messages line")
        tools = chat_request.NO_TOOLS
        if kinds[0] == "messages":
            try:
                tools = chat_request.tools(obj)
            except chat_request.BadField as e:
                raise _BadLine(str(e)) from None
        ids = self._prompt_ids(kinds[0], obj[kinds[0]], obj, line.number, tools)
        context = self.engine.context_length
        if len(ids) >= context:  # not even one new token would fit
            raise _BadLine(f"prompt has {len(ids)} tokens; the model's context is {context}")
        # Prompt plus reply stays within the context (finish_reason "length" where it cuts).
        params = replace(params, max_new_tokens=min(params.max_new_tokens, context - len(ids)))
        grammar = None
        response_format = obj.get("response_format")
        if tools.forced is not None:  # tool_choice required or a named function: a constrained list of calls
            if response_format is not None:
                raise _BadLine("response_format and a tool_choice that forces a call exclude each other")
            response_format = chat_request.forced_response_format(tools.forced)
        if response_format is not None:  # structured output, as the server's response_format
            try:
                grammar = self.engine.grammar(response_format)
            except (ValueError, MoedeskError) as e:
                raise _BadLine(str(e)) from None
        beams = obj.get("beams", self.settings.beams)
        length_penalty = obj.get("length_penalty", self.settings.length_penalty)
        try:
            _check_param("beams", beams)
            _check_param("length_penalty", length_penalty)
        except ValueError as e:
            raise _BadLine(str(e)) from None
        if beams > max(MAX_LINE_BEAMS, self.settings.beams):
            raise _BadLine(f"beams must be at most {max(MAX_LINE_BEAMS, self.settings.beams)}, got {_show(beams)}")
        if beams > 1:
            if grammar is not None:
                raise _BadLine("response_format cannot be combined with beam search")
            if params.stop:
                raise _BadLine("stop cannot be combined with beam search")
            self.beam_lines[line.number] = (beams, float(length_penalty))
        # The tag is the line number, not the id: unique even when ids repeat, and it finds the
        # line's place in the output order.
        return Request(ids, params, tag=line.number, grammar=grammar)

    def _prompt_ids(self, kind: str, value, obj: dict | None = None, number: int = 0,
                    tools=chat_request.NO_TOOLS) -> list[int]:
        if kind == "prompt_ids":
            if not isinstance(value, list) or not all(type(t) is int for t in value):
                raise _BadLine(f"prompt_ids must be a list of integers, got {_show(value)}")
            if not value:
                raise _BadLine("empty prompt_ids")
            vocab = self.engine.vocab_size
            for position, token in enumerate(value):
                if not 0 <= token < vocab:
                    raise _BadLine(f"prompt_ids[{position}] = {token} is outside the vocabulary [0, {vocab})")
            return list(value)

        if kind == "prompt":
            if not isinstance(value, str):
                raise _BadLine(f"prompt must be a string, got {_show(value)}")
            if not value:
                raise _BadLine("empty prompt")
        else:
            if not isinstance(value, list):
                raise _BadLine('messages must be a list of {"role": str, "content": str} objects')
            if not value:
                raise _BadLine("empty messages")
            try:
                value = [chat_request.message(m, i) for i, m in enumerate(value)]
                options = chat_request.template_options(obj or {})
            except chat_request.BadField as e:
                raise _BadLine(str(e)) from None
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise _BadLine(f"the model has no tokenizer; give prompt_ids instead of {kind}")
        try:
            if kind == "prompt":
                ids = tokenizer.encode(value)
            else:
                text = tokenizer.render_chat(value, tools=tools.offered, **options)
                ids = tokenizer.encode(text, add_special_tokens=False)
                fmt = tokenizer.reply_format
                self.chat_lines[number] = (fmt, starts_in_reasoning(fmt, text), tools)
        except MoedeskError as e:  # e.g. a model without a chat template
            raise _BadLine(str(e)) from None
        except Exception as e:  # noqa: BLE001 -- odd text (lone surrogates, ...) must not stop the run
            raise _BadLine(f"cannot tokenise the {kind}: {type(e).__name__}: {e}") from None
        if not ids:
            raise _BadLine(f"the {kind} has no tokens")
        vocab = self.engine.vocab_size
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:  # the embedding lookup would fail mid-batch
            raise _BadLine(f"the tokenizer gave token id {outside} for this {kind}, outside the model's "
                           f"vocabulary [0, {vocab})")
        return list(ids)

    def generate(self, requests: Iterator[Request], batch_size: int) -> None:
        """Run the engine over `requests` to the end. Beam-search lines go to the engine with the others, as jobs
        of its scheduler: up to `batch_size` lines at once, plain or beam, and the beam lines in flight step
        together, their hypotheses in one forward (engine.generation.beam)."""
        self._generate_plain(requests, batch_size)

    def _decoding(self, request: Request):
        """A request's decoding for Engine.generate: BeamOptions for a beam line, else the run's (None: plain)."""
        return self._beam_decoding(request) or self._line_decoding

    def _beam_decoding(self, request: Request):
        """BeamOptions for a beam line, None for any other."""
        beam = self.beam_lines.get(request.tag)
        if beam is None:
            return None
        return decoding_options(self.engine, Decoding(beams=beam[0], length_penalty=beam[1]))

    def _generate_plain(self, requests: Iterator[Request], batch_size: int) -> None:
        """Run the engine over `requests` to the end, whatever fails on the way.

        When the engine raises, the lines it held are run again one at a time: a line that fails
        alone gets its error line, the others their results (a line's output does not depend on its
        batch), and the engine goes on with the rest of the input. Only when the model fails even
        a one-token request does the run stop, with no error written for the lines it held.
        """
        while True:
            completions = self._completions(requests, batch_size)
            try:
                while True:
                    try:
                        completion = next(completions)
                    except StopIteration:
                        return
                    except _Stopped:
                        raise
                    except EngineUnavailable as error:
                        raise _Stopped(f"{_describe(error)}; what is written stays: run the same command to go "
                                       f"on") from None
                    except Exception as error:  # noqa: BLE001 -- see the docstring
                        if _out_of_memory(error):
                            # The KV caches only grow: without this the rows the batch no longer uses stay allocated
                            # and halving it gives no memory back. The next requests allocate what they need.
                            release = getattr(self.engine, "release_cache", None)
                            if release is not None:
                                release()
                        self._run_alone(error)
                        if _out_of_memory(error) and batch_size > 1:  # the batch did not fit: try fewer at once
                            self.report.note(f"out of memory with up to {batch_size} lines at once "
                                             f"({_describe(error)[:120]}); going on with {batch_size // 2}")
                            batch_size //= 2
                        self.show_warnings()
                        break
                    self.completed(completion)
                    self.show_warnings()
            finally:
                close = getattr(completions, "close", None)
                if close is not None:
                    close()  # releases the engine even when the output stopped the run

    def show_warnings(self) -> None:
        """The engine's new warnings (what went less well than asked: a GPU out-of-memory back-off moving experts
        to RAM, RAM it could not pin), one line each on stderr."""
        warnings = getattr(self.engine, "warnings", None) or []
        for warning in warnings[self._warnings_shown:]:
            self.report.note(_one_line(str(warning)))
        self._warnings_shown = len(warnings)

    def _completions(self, requests: Iterator[Request], batch_size: int):
        s = self.settings
        if s.speculative != "off" and self._line_decoding is None:
            self._line_decoding = speculative_options(self.engine, s)
        # batch_size lines at once, a finished line's place taken by the next (the lines held again alone on an
        # error run plainly, a beam line by beam search)
        return self.engine.generate(requests, batch_size=batch_size, decoding=self._decoding)

    def _run_alone(self, error: Exception) -> None:
        if not self.in_flight:  # it failed before taking a line: nothing to blame a line for
            raise _Stopped(f"the model failed ({_describe(error)}); what is written stays: run the same "
                           f"command to go on")
        for number, (line_id, request) in sorted(self.in_flight.items()):
            try:
                done = list(self.engine.generate([request], batch_size=1, decoding=self._beam_decoding))
            except _Stopped:
                raise
            except Exception as alone:  # noqa: BLE001
                self._check_engine_works(alone)
                del self.in_flight[number]
                self._finished(number, {"id": line_id, "error": _one_line(f"line {number}: {_describe(alone)}")})
                continue
            for completion in done:
                self.completed(completion)

    def _check_engine_works(self, error: Exception) -> None:
        """Raise _Stopped unless the engine completes a one-token request: then `error` is the line's own."""
        probe = Request([0], SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True), tag=None)
        try:
            list(self.engine.generate([probe], batch_size=1))
        except _Stopped:
            raise
        except Exception as e:  # noqa: BLE001
            raise _Stopped(f"the model fails even on a one-token request ({_describe(e)}; first: "
                           f"{_describe(error)}); what is written stays: run the same command to go on") from None

    def completed(self, completion: Completion) -> None:
        number = completion.tag
        if number not in self.in_flight:
            raise RuntimeError(f"the engine returned a completion with an unknown tag {number!r}")
        line_id, _ = self.in_flight.pop(number)
        record = {"id": line_id, "text": completion.text}
        chat = self.chat_lines.pop(number, None)
        if chat is not None:  # a chat reply: the answer as text, reasoning and tool calls beside it
            record.update(_reply_fields(completion, *chat, self.engine.tokenizer))
        self._finished(number, {
            **record, "token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason,
            "usage": {"prompt_tokens": completion.prompt_tokens, "completion_tokens": len(completion.token_ids)},
            "stats": completion.stats,
        })

    def _finished(self, number: int, record: dict) -> None:
        self.beam_lines.pop(number, None)
        self.chat_lines.pop(number, None)
        ok, tokens = "error" not in record, len(record.get("token_ids", ()))
        chat = self.openai_lines.pop(number, None)
        if chat is not None:  # an OpenAI Batch API line gets OpenAI's output line
            record = batch_openai.output(record["id"], record, chat, self.model)
        self.ready[number] = (record, ok, tokens)
        while self.pending and self.pending[0] in self.ready:
            record, ok, tokens = self.ready.pop(self.pending.popleft())
            # One write per whole line, flushed at once: a crash or a full disk leaves at most a
            # partial last line, which the next run cuts off.
            try:
                self.out.write(_dumps(record) + b"\n")
                self.out.flush()
            except OSError as e:
                with contextlib.suppress(OSError):
                    self.out.close()  # its buffer holds the line that did not fit: drop it, do not fail again
                raise BatchOutputError(_cannot_write(getattr(self.out, "name", "the output"), e,
                                                     self.resumable)) from None
            self.ok += ok
            self.failed += not ok
            self.report.line_done(tokens)

    def check_finished(self, requests: Iterator[Request]) -> None:
        """After the engine returns: every request pulled must have come back."""
        leftover = next(requests, None)  # also writes bad lines after the last request, should any remain
        if leftover is not None or self.pending:
            raise RuntimeError("the engine returned before completing every request")

    def summary(self) -> str:
        text = f"{self.ok} ok, {self.failed} failed, {self.skipped} skipped, {self.report.rate():.1f} tok/s"
        if self.failed_before:
            text += f"; {self.failed_before} of the skipped lines had failed before"
        return text


# --- progress on stderr -----------------------------------------------------------------------

class _Report:
    """A rich progress bar on a terminal (done/total lines, tok/s, ETA); else only the summary.

    total None: the input is a stream whose length is unknown; the bar counts lines done, no ETA.
    """

    def __init__(self, stderr, total: int | None, live: bool):
        self.stderr, self.total = stderr, total
        self.tokens = 0
        self.started = time.perf_counter()
        self.bar = self.console = None
        if live:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.console = Console(file=stderr, highlight=False)
            self.bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("lines"),
                                TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(), console=self.console)
            self.task = self.bar.add_task("batch", total=total, rate="0.0")

    def header(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, markup=False, soft_wrap=True)  # one line; the terminal wraps it

    def start(self) -> None:
        self.started = time.perf_counter()
        if self.bar is not None:
            self.bar.start()

    def note(self, text: str) -> None:
        """One line on stderr, above the bar when there is one."""
        if self.console is not None:
            self.console.print(f"moedesk: {text}", markup=False, soft_wrap=True)
        else:
            print(f"moedesk: {text}", file=self.stderr, flush=True)

    def skipped(self) -> None:
        # The bar counts the lines of this run only, so its rate and ETA are not flattered by
        # skipped ones. (Skipped lines come first in practice: output is in input order.)
        if self.total is None:
            return
        self.total -= 1
        if self.bar is not None:
            self.bar.update(self.task, total=self.total)

    def line_done(self, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(self.task, advance=1, rate=f"{self.rate():.1f}")

    def rate(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def close(self, summary: str) -> None:
        if self.bar is not None:
            self.bar.stop()
        print(summary, file=self.stderr, flush=True)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


# --- entry point ------------------------------------------------------------------------------

def run_batch(in_path, out_path, engine, settings: BatchSettings, *, stderr=sys.stderr, progress: bool = True,
              stdin=None, stdout=None) -> int:
    """Complete every line of `in_path` into `out_path` (see the module docstring).

    Either may be "-" (standard input / output, or `stdin` / `stdout` when given, binary) or a pipe
    or device: a stream is read once as it comes (no line count, no look-ahead), and an output that
    is not a regular file is only appended to (nothing to resume from, no lock).

    Returns 0 when every line of the input succeeded (in this run or an earlier one whose results
    are in `out_path`), 1 otherwise, or when the run had to stop (output full, input unreadable,
    model failing everything). Raises BatchUsageError when the run cannot start.
    KeyboardInterrupt propagates; what was written stays valid JSONL.
    """
    check_batch_paths(in_path, out_path)
    in_stdio, out_stdio = str(in_path) == STDIO, str(out_path) == STDIO
    in_path, out_path = Path(in_path), Path(out_path)
    check_vocab = getattr(engine.tokenizer, "check_vocab", None)
    if check_vocab is not None:
        check_vocab(engine.vocab_size)  # MoedeskError: the CLI's one line and exit 2
    # The draft head, before the output is touched: one that does not load is the CLI's one line and exit 2 too.
    line_decoding = speculative_options(engine, settings) if settings.speculative != "off" else None

    with contextlib.ExitStack() as stack:
        if out_stdio:
            out, resumable = stdout or sys.stdout.buffer, False
        else:
            try:
                out = stack.enter_context(open(out_path, "ab"))
            except OSError as e:
                raise BatchUsageError(f"{out_path}: cannot write the output file ({e.strerror})") from None
            resumable = _is_regular_file(out_path)
        written = _Written()
        if resumable:
            lock = _lock_output(out, out_path)  # before reading what is done: no other run may add to it now
            if lock is not None:
                stack.callback(lock.release)
            try:
                with open(out_path, "rb") as f:
                    written = _read_written(f, out_path)
                if written.partial:
                    out.truncate(written.keep)
            except OSError as e:
                raise BatchUsageError(f"{out_path}: cannot write the output file ({e.strerror})") from None

        streamed = in_stdio or not _is_regular_file(in_path)
        scan = None if streamed else _scan_input(in_path, settings)
        if settings.batch_size is None:
            positions = _cache_positions(scan, settings, engine.context_length)
            settings = replace(settings, batch_size=auto_batch_size(engine, positions), batch_size_from_memory=True)
        report = _Report(stderr, None if scan is None else scan.lines, live=progress and _is_terminal(stderr))
        notes = [f"reading {'standard input' if in_stdio else in_path} as it comes" if scan is None
                 else f"{scan.lines} lines in {in_path}"]
        if resumable:
            notes.append(f"already in {out_path}: {written.records} (skipped)")
        if written.partial:
            notes.append("its unfinished last line is removed and redone")
        if written.unreadable:
            notes.append(f"{written.unreadable} unreadable lines in it are left as they are")
        report.header(f"moedesk batch: {engine.description}; {settings.describe()}; {'; '.join(notes)}")

        try:
            source = (stdin or sys.stdin.buffer) if in_stdio else stack.enter_context(open(in_path, "rb"))
        except OSError as e:
            raise BatchUsageError(f"{in_path}: cannot read the input ({e.strerror})") from None
        run = _Run(engine, settings, written, out, report)
        run.resumable, run._line_decoding = resumable, line_decoding
        run.show_warnings()  # from the load
        report.start()
        stopped = None
        try:
            lines = _input_lines(source)
            if _arrives_over_time(source):  # a pipe or a terminal: lines come when they come
                lines = _read_ahead(lines)
            requests = run.requests(lines, STDIO if in_stdio else in_path)
            try:
                run.generate(requests, settings.batch_size)
                run.check_finished(requests)
            finally:
                requests.close()
        except _Stopped as e:
            stopped = e
        finally:
            report.close(run.summary())
    if stopped is not None:
        print(f"moedesk: {stopped}", file=stderr, flush=True)
        return 1
    return 1 if run.failed or run.failed_before else 0


# --- small helpers ----------------------------------------------------------------------------

def _reply_fields(completion: Completion, fmt, in_reasoning: bool, tools, tokenizer) -> dict:
    """A chat line's reply as the server's message holds it: text (the answer), reasoning, tool_calls."""
    if tools.forced is not None:
        calls = chat_request.forced_calls(completion.text)
        parsed = Parsed("", "" if calls else completion.text, calls)
    else:
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=False) if fmt.keeps_special_tokens \
            else completion.text
        parsed = parse_reply(text, fmt, in_reasoning=in_reasoning, tools=tools.offered is not None)
        if not tools.parallel:
            parsed = Parsed(parsed.reasoning, parsed.content, parsed.tool_calls[:1])
    fields = {"text": parsed.content}
    if parsed.reasoning:
        fields["reasoning"] = parsed.reasoning
    if parsed.tool_calls:
        fields["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                for c in parsed.tool_calls]
    return fields


def _dumps(record: dict) -> bytes:
    try:
        return json.dumps(record, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (legal in JSON's \ud800 escapes) cannot be written as UTF-8; escaping
        # everything keeps the line valid.
        return json.dumps(record, ensure_ascii=True, default=str).encode("ascii")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _describe(e: BaseException) -> str:
    """An exception as the one-line reason of an error line."""
    if isinstance(e, MoedeskError):
        return _first_line(e) or type(e).__name__
    text = _first_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _cannot_write(name, e: OSError, resumable: bool) -> str:
    """The one line of a run the output stopped: what failed, and what to do that fits the failure."""
    text = f"{name}: cannot write the output ({e.strerror or e})"
    if e.errno == errno.EPIPE:
        return text + ": whatever read it stopped reading"
    if not resumable:  # standard output, a pipe: a rerun cannot tell what was written, so it starts again
        return text + "; what is written stays"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return text + "; what is written stays: free some space and run the same command to go on"
    return text + "; what is written stays: run the same command to go on once that is fixed"


def _out_of_memory(e: BaseException) -> bool:
    """Whether `e` says memory ran out: the GPU's (torch.OutOfMemoryError, or the engine's MoedeskError once it
    has no experts left to move to RAM), torch's CPU allocator ("can't allocate memory") or Python's."""
    if isinstance(e, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(e).__mro__):
        return True
    text = str(e).lower()
    return any(words in text for words in ("out of memory", "can't allocate memory", "cannot allocate memory",
                                            "not enough memory"))


def _one_line(text: str) -> str:
    return " ".join(text.split()) if "\n" in text or "\r" in text else text


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}[type(value)]


def _show(value, limit: int = 40) -> str:
    """A value as JSON, cut short: error messages stay one short line."""
    try:
        text = json.dumps(value, ensure_ascii=True, default=str)
    except (ValueError, RecursionError):  # too many digits, nested too deeply
        text = f"<{_json_type(value)}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
