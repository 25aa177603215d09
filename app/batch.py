"""`moedesk batch`: complete every line of a JSONL file, resumable, one output line per input line.

The contract (DESIGN.md, "Contracts"): output in input order, appended and flushed line by
line; ids already in the output are skipped on a rerun; a bad line becomes an `error` line and
the run goes on; exit 0 when every line succeeded, 1 when some failed (or the output could not be
written, as on a full disk: the run stops, what was written stays, and a rerun resumes), 2 for usage
errors.

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
import json
import math
import os
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Iterator

from engine.errors import MoedeskError
from engine.requests import Completion, Request, SamplingParams

PROMPT_KINDS = ("prompt", "messages", "prompt_ids")
LINE_OVERRIDES = ("max_new_tokens", "temperature", "top_p", "seed")  # what one line may set for itself
SEED_LIMIT = 2**64  # torch.Generator.manual_seed overflows beyond this; catch it here, not mid-run


class BatchUsageError(MoedeskError):
    """The run cannot start (input unreadable, output folder missing, bad option): the CLI exits 2."""


class BatchOutputError(MoedeskError):
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
    batch_size: int | None = None  # None: as many as free memory holds, chosen when the run starts
    gpu_budget_gib: float | None = None  # None: the engine decides from free GPU memory
    dtype: str | None = None  # None: the engine's default for the device
    from_app: tuple[str, ...] = ()  # which of these came from the app's saved settings
    batch_size_from_memory: bool = False  # batch_size was chosen from free memory

    def describe(self) -> str:
        shown = [f for f in fields(self) if f.name not in ("from_app", "batch_size_from_memory")]

        def mark(name: str) -> str:
            if name == "batch_size" and self.batch_size_from_memory:
                return " (what free memory holds)"
            return "*" if name in self.from_app else ""

        text = ", ".join(f"{f.name}={getattr(self, f.name)}{mark(f.name)}" for f in shown)
        return text + (" (* from the app's settings)" if self.from_app else "")

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
_INTEGERS = {"max_new_tokens", "seed", "top_k", "batch_size"}
_RANGES = {
    "max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "batch_size": (lambda v: v >= 1, ">= 1"),
    "temperature": (lambda v: v >= 0, ">= 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= 0, ">= 0"),
    "seed": (lambda v: 0 <= v < SEED_LIMIT, "in [0, 2**64)"),
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
                "dtype": "engine_dtype"}  # auto is None: the engine's default, as if unset


AUTO_BATCH_CAP = 16  # the batched decode measured on the GPU box (README, "Speed, measured")
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


def free_memory_bytes(device) -> int:
    """Free memory where the KV cache lives: the GPU's, or the RAM available."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def auto_batch_size(engine, settings: BatchSettings) -> int:
    positions = min(engine.context_length, settings.max_new_tokens + PROMPT_ALLOWANCE)
    return batch_size_for_memory(free_memory_bytes(engine.device), engine.cache.bytes_per_position() * positions)


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch job's own flags; the model/device/dtype/GPU-budget flags are added by the CLI.

    Sampling flags default to None here: the CLI fills them from the app's saved settings.
    """
    parser.add_argument("input", metavar="IN.jsonl",
                        help="one JSON object per line: id plus one of prompt, messages, prompt_ids")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.jsonl",
                        help="results in input order, appended; ids already there are skipped (resume)")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                        help="per line, unless the line sets max_new_tokens (default: the app's setting)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="0 = greedy (default: the app's setting)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="nucleus sampling (default: the app's setting)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="0 = off (default: the app's setting)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed of each line's own generator, unless the line sets seed "
                             "(default: the app's setting, or 0 when that is blank)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help=f"sequences decoded together (default: as many as half the free GPU memory, or RAM "
                             f"without a GPU, holds KV caches for, at most {AUTO_BATCH_CAP})")


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
                             from_app=tuple(from_app))
    for name in _RANGES:
        if name == "batch_size" and settings.batch_size is None:
            continue  # chosen from memory once the model is loaded
        try:
            _check_param(name, getattr(settings, name))
        except ValueError as e:
            raise BatchUsageError(f"--{name.replace('_', '-')}: {e}") from None
    if settings.gpu_budget_gib is not None and settings.gpu_budget_gib < 0:
        raise BatchUsageError(f"--gpu-budget: must be >= 0 GiB, got {settings.gpu_budget_gib}")
    return settings


def check_batch_paths(in_path, out_path) -> None:
    """Raise BatchUsageError unless the input can be read and the output written.

    Cheap, so the CLI calls it before the slow model load; it creates nothing.
    """
    in_path, out_path = Path(in_path), Path(out_path)
    if not in_path.exists():
        raise BatchUsageError(f"{in_path}: no such input file")
    if in_path.is_dir():
        raise BatchUsageError(f"{in_path}: is a folder, not an input file")
    try:
        open(in_path, "rb").close()
    except OSError as e:
        raise BatchUsageError(f"{in_path}: cannot read the input file ({e.strerror})") from None
    parent = out_path.resolve().parent
    if not parent.is_dir():
        raise BatchUsageError(f"{out_path}: the output folder {parent} does not exist")
    if out_path.is_dir():
        raise BatchUsageError(f"{out_path}: is a folder, not an output file")
    if out_path.exists():
        if os.path.samefile(in_path, out_path):
            raise BatchUsageError(f"{out_path}: the output file must not be the input file")
        if not os.access(out_path, os.W_OK):
            raise BatchUsageError(f"{out_path}: cannot write the output file")
    elif not os.access(parent, os.W_OK):
        raise BatchUsageError(f"{out_path}: cannot create files in {parent}")


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


def _read_written(out_path: Path) -> _Written:
    """Scan the output file line by line (it can be large); only ids and line numbers are kept."""
    written = _Written()
    if not out_path.exists():
        return written
    try:
        with open(out_path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    # We write each record with its newline in one call, so a line without one is
                    # an interrupted write; it is cut off and its line done again.
                    written.partial = True
                    break
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
                record_id = record.get("id")
                if isinstance(record_id, str):
                    written.ids.add(record_id)
                    if "error" not in record:
                        written.ok_ids.add(record_id)
                # Errors name their input line ("line 4: ..."): that is how lines without a usable
                # id, and repeated ids, are recognised on a rerun.
                match = _LINE_PREFIX.match(str(record.get("error", "")))
                if match:
                    written.error_lines.add(int(match.group(1)))
    except OSError as e:
        raise BatchUsageError(f"{out_path}: cannot read the output file ({e.strerror})") from None
    return written


# --- the input --------------------------------------------------------------------------------

def _input_lines(in_path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line; numbers count every physical line from 1."""
    with open(in_path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # some editors on Windows write one
            if raw.strip():
                yield number, raw


def _count_lines(in_path: Path) -> int:
    """Non-blank lines, for the progress bar: a pass over bytes, no JSON parsing."""
    with open(in_path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


@dataclass
class _Line:
    """One input line after its id has been read; error is set when the line is bad."""

    number: int
    obj: dict | None = None
    id: str | None = None
    error: str | None = None
    by_number: bool = False  # no usable id, or a repeated one: a rerun recognises it by its line number


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
        self.ready: dict[int, dict] = {}  # line number -> record waiting for the lines before it
        self.in_flight: dict[int, str] = {}  # line number -> id of a request the engine holds
        self.first_seen: dict[str, int] = {}  # id -> line it first appeared on
        self.ok = self.failed = self.skipped = self.failed_before = 0

    def requests(self, in_path: Path) -> Iterator[Request]:
        """The engine's input: one Request per good line; bad lines are written on the way."""
        for number, raw in _input_lines(in_path):
            line = self._identify(number, raw)
            if self._done_before(line):
                self.skipped += 1
                self.report.skipped()
                continue
            self.pending.append(number)
            request = None
            if line.error is None:
                try:
                    request = self._request(line)
                except _BadLine as e:
                    line.error = str(e)
            if request is None:
                self._finished(number, {"id": line.id, "error": _one_line(f"line {number}: {line.error}")})
            else:
                self.in_flight[number] = line.id
                yield request

    def _identify(self, number: int, raw: bytes) -> _Line:
        """Parse the JSON and find the id; later checks need the id to report and to skip."""
        line = _Line(number, by_number=True)
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            line.error = f"not valid UTF-8 (byte {e.start + 1})"
            return line
        except json.JSONDecodeError as e:
            line.error = f"malformed JSON ({e.msg} at column {e.colno})"
            return line
        except RecursionError:
            line.error = "malformed JSON (nested too deeply)"
            return line
        if not isinstance(obj, dict):
            line.error = f"expected a JSON object, got {_json_type(obj)}"
            return line
        line.obj = obj
        line_id = obj.get("id")
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
        kinds = [k for k in PROMPT_KINDS if k in obj]
        if len(kinds) != 1:
            found = f" (found {' and '.join(kinds)})" if kinds else ""
            raise _BadLine(f"give exactly one of prompt, messages, prompt_ids{found}")
        try:
            params = self.settings.sampling_params(obj)
        except ValueError as e:
            raise _BadLine(str(e)) from None
        ids = self._prompt_ids(kinds[0], obj[kinds[0]])
        context = self.engine.context_length
        if len(ids) >= context:  # not even one new token would fit
            raise _BadLine(f"prompt has {len(ids)} tokens; the model's context is {context}")
        # The tag is the line number, not the id: unique even when ids repeat, and it finds the
        # line's place in the output order.
        return Request(ids, params, tag=line.number)

    def _prompt_ids(self, kind: str, value) -> list[int]:
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
            if not isinstance(value, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value):
                raise _BadLine('messages must be a list of {"role": str, "content": str} objects')
            if not value:
                raise _BadLine("empty messages")
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise _BadLine(f"the model has no tokenizer; give prompt_ids instead of {kind}")
        try:
            ids = tokenizer.encode(value) if kind == "prompt" else tokenizer.chat_prompt(value)
        except MoedeskError as e:  # e.g. a model without a chat template
            raise _BadLine(str(e)) from None
        except Exception as e:  # noqa: BLE001 -- odd text (lone surrogates, ...) must not stop the run
            raise _BadLine(f"cannot tokenise the {kind}: {type(e).__name__}: {e}") from None
        if not ids:
            raise _BadLine(f"the {kind} has no tokens")
        return list(ids)

    def completed(self, completion: Completion) -> None:
        number = completion.tag
        if number not in self.in_flight:
            raise RuntimeError(f"the engine returned a completion with an unknown tag {number!r}")
        line_id = self.in_flight.pop(number)
        self._finished(number, {
            "id": line_id, "text": completion.text, "token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "usage": {"prompt_tokens": completion.prompt_tokens, "completion_tokens": len(completion.token_ids)},
            "stats": completion.stats,
        })

    def _finished(self, number: int, record: dict) -> None:
        self.ready[number] = record
        while self.pending and self.pending[0] in self.ready:
            record = self.ready.pop(self.pending.popleft())
            # One write per whole line, flushed at once: a crash or a full disk leaves at most a
            # partial last line, which the next run cuts off.
            try:
                self.out.write(_dumps(record) + b"\n")
                self.out.flush()
            except OSError as e:
                with contextlib.suppress(OSError):
                    self.out.close()  # its buffer holds the line that did not fit: drop it, do not fail again
                raise BatchOutputError(f"{self.out.name}: cannot write the output ({e.strerror or e}); what is "
                                       f"written stays: free some space and run the same command to go on") from None
            ok = "error" not in record
            self.ok += ok
            self.failed += not ok
            self.report.line_done(len(record.get("token_ids", ())))

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
    """A rich progress bar on a terminal (done/total lines, tok/s, ETA); else only the summary."""

    def __init__(self, stderr, total: int, live: bool):
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

    def skipped(self) -> None:
        # The bar counts the lines of this run only, so its rate and ETA are not flattered by
        # skipped ones. (Skipped lines come first in practice: output is in input order.)
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

def run_batch(in_path, out_path, engine, settings: BatchSettings, *, stderr=sys.stderr, progress: bool = True) -> int:
    """Complete every line of `in_path` into `out_path` (see the module docstring).

    Returns 0 when every line of the input succeeded (in this run or an earlier one whose results
    are in `out_path`), 1 otherwise. Raises BatchUsageError when the run cannot start.
    KeyboardInterrupt and engine errors propagate; what was written stays valid JSONL.
    """
    in_path, out_path = Path(in_path), Path(out_path)
    check_batch_paths(in_path, out_path)
    if settings.batch_size is None:
        settings = replace(settings, batch_size=auto_batch_size(engine, settings), batch_size_from_memory=True)
    written = _read_written(out_path)
    total = _count_lines(in_path)
    report = _Report(stderr, total, live=progress and _is_terminal(stderr))

    notes = [f"{total} lines in {in_path}", f"already in {out_path}: {written.records} (skipped)"]
    if written.partial:
        notes.append("its unfinished last line is removed and redone")
    if written.unreadable:
        notes.append(f"{written.unreadable} unreadable lines in it are left as they are")
    report.header(f"moedesk batch: {engine.description}; {settings.describe()}; {'; '.join(notes)}")

    try:
        if written.partial:
            with open(out_path, "r+b") as f:
                f.truncate(written.keep)
        out = open(out_path, "ab")
    except OSError as e:
        raise BatchUsageError(f"{out_path}: cannot write the output file ({e.strerror})") from None

    run = _Run(engine, settings, written, out, report)
    report.start()
    stopped = None
    try:
        with out:
            requests = run.requests(in_path)
            try:
                for completion in engine.generate(requests, batch_size=settings.batch_size):
                    run.completed(completion)
                run.check_finished(requests)
            finally:
                requests.close()  # closes the input file even when the engine stops early
    except BatchOutputError as e:
        stopped = e
    finally:
        report.close(run.summary())
    if stopped is not None:
        print(f"moedesk: {stopped}", file=stderr, flush=True)
        return 1
    return 1 if run.failed or run.failed_before else 0


# --- small helpers ----------------------------------------------------------------------------

def _dumps(record: dict) -> bytes:
    try:
        return json.dumps(record, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (legal in JSON's \ud800 escapes) cannot be written as UTF-8; escaping
        # everything keeps the line valid.
        return json.dumps(record, ensure_ascii=True, default=str).encode("ascii")


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
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."
