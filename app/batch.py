"""`moedesk batch`: complete every line of a JSONL file, resumable, one output line per input line.

The contract (DESIGN.md): output in input order, appended and flushed line by line; ids
already in the output are skipped on a rerun; a bad line becomes an `error` line and the run
goes on; exit 0 when every line succeeded, 1 when some failed, 2 for usage errors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

from engine.errors import MoedeskError
from engine.requests import Request, SamplingParams


class BatchUsageError(MoedeskError):
    """The run cannot start: input unreadable, output folder missing."""


@dataclass
class BatchSettings:
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    batch_size: int = 8

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


LINE_OVERRIDES = {"max_new_tokens": int, "temperature": (int, float), "top_p": (int, float), "seed": int}


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BatchSettings()
    parser.add_argument("input", metavar="IN.jsonl", help="one JSON object per line: id plus prompt, messages or prompt_ids")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.jsonl",
                        help="results, appended; ids already there are skipped (resume)")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, metavar="N")
    parser.add_argument("--temperature", type=float, default=defaults.temperature, metavar="T", help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=defaults.top_p, metavar="P")
    parser.add_argument("--top-k", type=int, default=defaults.top_k, metavar="K", help="0 = off")
    parser.add_argument("--seed", type=int, default=defaults.seed, metavar="S")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, metavar="N",
                        help="sequences decoded together (continuous batching)")


def settings_from_args(args) -> BatchSettings:
    settings = BatchSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos, batch_size=args.batch_size)
    try:
        _params(settings, {})
    except ValueError as e:
        raise BatchUsageError(f"bad option: {e}") from None
    if settings.batch_size < 1:
        raise BatchUsageError("--batch-size must be at least 1")
    return settings


def check_batch_paths(in_path, out_path) -> None:
    if not Path(in_path).is_file():
        raise BatchUsageError(f"{in_path}: no such input file")
    if not os.access(in_path, os.R_OK):
        raise BatchUsageError(f"{in_path}: cannot read the input file")
    parent = Path(out_path).resolve().parent
    if not parent.is_dir():
        raise BatchUsageError(f"{out_path}: the output folder {parent} does not exist")


def _params(settings: BatchSettings, line: dict) -> SamplingParams:
    values = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
              "top_p": settings.top_p, "seed": settings.seed}
    for key, kinds in LINE_OVERRIDES.items():
        if key in line:
            value = line[key]
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ValueError(f"{key} must be a number, got {value!r}")
            values[key] = value
    return SamplingParams(top_k=settings.top_k, ignore_eos=settings.ignore_eos, **values)


def read_done(out_path: Path) -> tuple[dict, int]:
    """What is already written (id -> succeeded; ("line", N) -> False for lines without a usable id)
    and the byte length of the file's complete lines.

    A crash can leave a last line without its newline: it is dropped (truncated away) and its
    id is done again.
    """
    done: dict[str, bool] = {}
    if not out_path.exists():
        return done, 0
    data = out_path.read_bytes()
    keep = data.rfind(b"\n") + 1
    for raw in data[:keep].splitlines():
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("id"), str):
            done[record["id"]] = "error" not in record
        elif isinstance(record, dict) and isinstance(record.get("line"), int):
            done[("line", record["line"])] = False
    return done, keep


@dataclass
class Item:
    """One input line, ready to run or already judged bad."""

    number: int
    id: str | None
    request: Request | None = None
    error: str | None = None


def parse_line(number: int, raw: str, engine, settings: BatchSettings, seen: set) -> Item:
    try:
        line = json.loads(raw)
    except json.JSONDecodeError as e:
        return Item(number, None, error=f"line {number}: malformed JSON ({e.msg})")
    if not isinstance(line, dict):
        return Item(number, None, error=f"line {number}: expected a JSON object")
    line_id = line.get("id")
    if not isinstance(line_id, str) or not line_id:
        return Item(number, None, error=f"line {number}: missing or non-string id")
    if line_id in seen:
        return Item(number, line_id, error=f"line {number}: duplicate id {line_id!r}")
    seen.add(line_id)
    try:
        ids = _prompt_ids(line, engine)
        params = _params(settings, line)
    except (ValueError, MoedeskError) as e:
        return Item(number, line_id, error=f"line {number}: {e}")
    if len(ids) >= engine.context_length:
        return Item(number, line_id, error=f"line {number}: prompt has {len(ids)} tokens; "
                                           f"the model's context is {engine.context_length}")
    return Item(number, line_id, Request(ids, params, tag=line_id))


def _prompt_ids(line: dict, engine) -> list[int]:
    kinds = [k for k in ("prompt", "messages", "prompt_ids") if k in line]
    if len(kinds) != 1:
        raise ValueError("give exactly one of prompt, messages, prompt_ids")
    kind = kinds[0]
    value = line[kind]
    if kind == "prompt_ids":
        if not isinstance(value, list) or not value or not all(type(t) is int for t in value):
            raise ValueError("prompt_ids must be a non-empty list of integers")
        bad = [t for t in value if not 0 <= t < engine.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids has token {bad[0]} outside the vocabulary [0, {engine.vocab_size})")
        return list(value)
    if engine.tokenizer is None:
        raise ValueError(f"the model has no tokenizer; use prompt_ids instead of {kind}")
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError("empty prompt")
        return engine.tokenizer.encode(value)
    if (not isinstance(value, list) or not value
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in value)):
        raise ValueError("messages must be a non-empty list of {role, content} strings")
    return engine.tokenizer.chat_prompt(value)


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


class _Progress:
    """done/total, tokens/s and ETA on stderr (rich's progress bar on a terminal, a summary otherwise)."""

    def __init__(self, total: int, skipped: int, stderr, live: bool):
        self.total, self.skipped, self.stderr = total, skipped, stderr
        self.tokens = self.ok = self.failed = 0
        self.started = time.perf_counter()
        self.bar = None
        if live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]} tok/s"), TimeRemainingColumn(),
                                console=Console(file=stderr), transient=False)
            self.task = self.bar.add_task("batch", total=total, completed=skipped, rate="-")
            self.bar.start()

    def advance(self, ok: bool, tokens: int) -> None:
        self.ok += ok
        self.failed += not ok
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(self.task, advance=1, rate=f"{self.rate():.1f}")

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        print(f"{self.ok} ok, {self.failed} failed, {self.skipped} skipped, {self.rate():.1f} tok/s",
              file=self.stderr)


def run_batch(in_path, out_path, engine, settings: BatchSettings, *, stderr=sys.stderr, progress: bool = True) -> int:
    in_path, out_path = Path(in_path), Path(out_path)
    check_batch_paths(in_path, out_path)
    done, keep = read_done(out_path)
    total = _count_lines(in_path)
    print(f"moedesk batch: {engine.description}; {settings.describe()}; "
          f"{total} lines, {len(done)} already in {out_path}", file=stderr)
    bar = _Progress(total, len(done), stderr, progress)
    failed_before = sum(1 for ok in done.values() if not ok)
    with open(out_path, "r+b" if out_path.exists() else "wb") as out:
        out.truncate(keep)
        out.seek(keep)
        writer = _OrderedWriter(out, bar)
        try:
            items = _items(in_path, engine, settings, done)
            for completion in engine.generate(writer.requests(items), batch_size=settings.batch_size):
                writer.finish(completion.tag, _result(completion))
            writer.flush_ready()
        finally:
            bar.close()
    return 1 if writer.failed or failed_before else 0


def _items(in_path: Path, engine, settings, done: dict) -> Iterator[Item]:
    seen: set = set()
    with open(in_path, encoding="utf-8", errors="replace") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            item = parse_line(number, raw, engine, settings, seen)
            if (item.id if item.id is not None else ("line", number)) in done:
                continue
            yield item


def _result(c) -> dict:
    return {"id": c.tag, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids)}, "stats": c.stats}


class _OrderedWriter:
    """Writes results in input order: a completion that finishes early waits for the lines before it."""

    def __init__(self, out, bar: _Progress):
        self.out, self.bar = out, bar
        self.order: list[Item] = []  # input order of lines not yet written
        self.results: dict[int, dict] = {}
        self.failed = 0

    def requests(self, items: Iterator[Item]) -> Iterator[Request]:
        for item in items:
            self.order.append(item)
            if item.error is not None:
                # Lines without a usable id also carry their number, so a rerun can skip them.
                self.results[item.number] = {"id": item.id, "error": item.error}
                if item.id is None:
                    self.results[item.number]["line"] = item.number
                self.flush_ready()
            else:
                item.request.tag = item.number
                yield item.request

    def finish(self, number: int, result: dict) -> None:
        item = next(i for i in self.order if i.number == number)
        result["id"] = item.id
        self.results[number] = result
        self.flush_ready()

    def flush_ready(self) -> None:
        while self.order and self.order[0].number in self.results:
            item = self.order.pop(0)
            result = self.results.pop(item.number)
            self.out.write((json.dumps(result, ensure_ascii=False) + "\n").encode())
            self.out.flush()
            ok = "error" not in result
            self.failed += not ok
            self.bar.advance(ok, len(result.get("token_ids", ())))
