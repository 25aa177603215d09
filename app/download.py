"""Downloading models from the Hugging Face Hub into the local HF cache: `moedesk download` and the TUI's wizard.

Everything here talks to the Hub through `huggingface_hub` (2.4.0 at the time of writing), and files land in its
cache layout (`blobs/<etag>`, `snapshots/<commit>/<path>` linking to the blobs, `refs/<branch>` holding the commit),
so `--model REPO_ID` finds them later with `snapshot_download(local_files_only=True)`.

Why this module does not just call `snapshot_download`: huggingface_hub 2.4.0 does not resume across calls. Each
`hf_hub_download` writes into a process-unique `<etag>.<uuid>.incomplete` file and deletes it on any failure (see
`file_download._download_to_tmp_and_move`, huggingface_hub PR #4228), so a cancel, Ctrl-C or crash throws the
partial file away (and one killed outright leaves it behind under a name nothing reuses). Within one call its
`http_get` does resume: when the connection drops it retries with `Range: bytes=N-` from the last whole chunk it
received (5 tries without progress). moedesk wants resuming across calls too, because a model is tens of GB. So
each file is fetched with huggingface_hub's own `http_get` (its Range requests, retries, size check and handling of
servers that ignore Range) into a partial file that this module keeps, `blobs/<etag>.incomplete` (the name older
huggingface_hub versions used, which `scan_cache_dir` still reports as an interrupted download); once complete it
is renamed to `blobs/<etag>` and `hf_hub_download` links it into the snapshot, finding the blob already there.

No Textual here: the TUI runs `download()` in a worker thread and passes a `progress` callback and a `cancel` event.
"""
from __future__ import annotations

import argparse
import errno
import functools
import glob
import hashlib
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TextIO

from moedesk.engine.errors import MoedeskError

ProgressCallback = Callable[[int, int], None]  # (done_bytes, total_bytes) across all files of one download

GB = 1000**3
MIN_DISK_MARGIN_BYTES = 1 * GB  # keep this much free beyond the download: logs, temp files, the rest of the system

# Files the safetensors choice takes along with the weights: config, tokenizer, shard index, chat template.
_SAFETENSORS_COMPANIONS = ("*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja")


class DownloadError(MoedeskError):
    """A download that could not be done; the message is one line saying why and what to do."""


class DownloadCancelled(DownloadError):
    """The caller's cancel event was set: partial files are kept and the next call resumes them."""

    def __init__(self, message: str = "download cancelled; partial files are kept and the next download resumes them"):
        super().__init__(message)


# ---------------------------------------------------------------------------------------------------------------
# Listing a repo and grouping its files into choices
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int


@dataclass(frozen=True)
class DownloadChoice:
    """One thing a person can pick to download: the safetensors checkpoint, or one GGUF quantisation."""

    name: str  # "safetensors", or the quantisation as written in the file name, upper-cased: "Q4_K_M", "UD-Q4_K_XL"
    kind: str  # "safetensors" or "gguf"
    files: tuple[str, ...]
    total_bytes: int
    include: tuple[str, ...]  # --include globs that select exactly these files (short globs when they are exact)

    @property
    def label(self) -> str:
        return "safetensors checkpoint" if self.kind == "safetensors" else f"GGUF {self.name}"

    @property
    def file_count(self) -> str:
        return f"{len(self.files)} file" + ("s" if len(self.files) != 1 else "")

    @property
    def description(self) -> str:
        """"safetensors checkpoint (6 files, 61.1 GB)" or "GGUF Q4_K_M (1 file, 18.6 GB)"."""
        return f"{self.label} ({self.file_count}, {format_bytes(self.total_bytes)})"


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    revision: str | None  # as asked for (None: the default branch)
    commit: str  # what it resolved to
    gated: bool
    files: tuple[RepoFile, ...]
    choices: tuple[DownloadChoice, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def choice(self, name: str) -> DownloadChoice | None:
        return next((c for c in self.choices if c.name.lower() == name.lower()), None)

    def default_choice(self) -> DownloadChoice | None:
        """The safetensors checkpoint if there is one, else the only GGUF quantisation; None if a person must pick."""
        safetensors = [c for c in self.choices if c.kind == "safetensors"]
        gguf = [c for c in self.choices if c.kind == "gguf"]
        if safetensors:
            return safetensors[0]
        return gguf[0] if len(gguf) == 1 else None

    def select(self, include: Iterable[str] | None) -> list[RepoFile]:
        """The files `--include` globs pick, with huggingface_hub's own matching (fnmatch, case-sensitive)."""
        return _select(self.files, include)


def list_repo_files_with_sizes(repo_id: str, revision: str | None = None) -> RepoListing:
    """The repo's files with sizes, grouped into download choices. Raises DownloadError (one line) on failure."""
    with _hub_errors(repo_id, revision):
        info = _model_info(repo_id, revision)
    files = tuple(RepoFile(s.rfilename, s.size or 0) for s in info.siblings or ())
    return RepoListing(repo_id, revision, info.sha, bool(info.gated), files, group_choices(files))


def group_choices(files: Iterable[RepoFile]) -> tuple[DownloadChoice, ...]:
    """Safetensors checkpoint first (if any), then one choice per GGUF quantisation, smallest first."""
    files = list(files)
    all_paths = [f.path for f in files]
    sizes = {f.path: f.size for f in files}
    choices = []

    top_level = [f.path for f in files if "/" not in f.path]
    weights = [p for p in top_level if p.endswith(".safetensors")]
    if any(not p.startswith("consolidated") for p in weights):
        # Mistral's repos carry a second copy of the weights in their own format (consolidated*.safetensors) next
        # to the Hugging Face one; only the latter loads as a model folder, and the copy would double the download.
        weights = [p for p in weights if not p.startswith("consolidated")]
    if weights:
        # Only top-level files: a folder's config.json + *.safetensors is what the engine loads, and sub-folders
        # hold other things (original/ consolidated weights, onnx/ exports...).
        picked = sorted(weights + [p for p in top_level if p not in weights and _matches(p, _SAFETENSORS_COMPANIONS)])
        choices.append(DownloadChoice("safetensors", "safetensors", tuple(picked), sum(sizes[p] for p in picked),
                                      _include_for(picked, all_paths, [("*.safetensors", *_SAFETENSORS_COMPANIONS)])))

    quants: dict[str, list[str]] = {}
    raw_names: dict[str, str] = {}
    for path in all_paths:
        name = PurePosixPath(path).name
        if not name.lower().endswith(".gguf") or name.lower().startswith("mmproj"):
            continue  # mmproj-*.gguf are vision projectors for multimodal models, not a quantisation of the LLM
        raw = gguf_quant(path)
        quants.setdefault(raw.upper(), []).append(path)
        raw_names.setdefault(raw.upper(), raw)
    gguf = []
    for name, paths in quants.items():
        paths.sort()
        raw = raw_names[name]
        candidates = [(f"*{raw}*.gguf",), (f"*[-.]{raw}[-.]*gguf",), (f"*[-.]{raw}.gguf", f"*[-.]{raw}-0*-of-*.gguf")]
        gguf.append(DownloadChoice(name, "gguf", tuple(paths), sum(sizes[p] for p in paths),
                                   _include_for(paths, all_paths, candidates)))
    choices += sorted(gguf, key=lambda c: (c.total_bytes, c.name))
    return tuple(choices)


# A GGUF's header (its metadata, the vocabulary included, then the tensor infos) is read from the Hub in growing
# Range requests: this much first (a 150k-token vocabulary with its merges takes a few MB), then as much again,
# up to the cap (the headers of the models moedesk runs are far smaller).
GGUF_HEADER_FIRST_BYTES = 4 << 20
GGUF_HEADER_MAX_BYTES = 64 << 20


def read_choice_weights(listing: RepoListing, choice: DownloadChoice, *, first_bytes: int | None = None,
                        max_bytes: int | None = None):
    """What the memory estimate needs of a choice (engine.load.size_estimate.ModelWeights), read from the Hub
    without downloading the weights. A safetensors choice: config.json and each shard's header (huggingface_hub
    reads one with a bounded Range request, two when it is long). A GGUF choice: each file's header, fetched from
    the file's start in Range requests of `first_bytes`, then twice as many, until it parses (at most `max_bytes`;
    by default GGUF_HEADER_FIRST_BYTES and GGUF_HEADER_MAX_BYTES); the config comes from its metadata as when the
    file is loaded. Raises DownloadError or MoedeskError, one line each."""
    if choice.kind == "gguf":
        return _read_gguf_weights(listing, choice, first_bytes or GGUF_HEADER_FIRST_BYTES,
                                  max_bytes or GGUF_HEADER_MAX_BYTES)

    import json
    from concurrent.futures import ThreadPoolExecutor

    from huggingface_hub import HfApi, hf_hub_url
    from huggingface_hub.errors import SafetensorsParsingError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from moedesk.engine.load.size_estimate import TensorInfo, summarize

    if choice.kind != "safetensors":
        raise ValueError(f"{choice.label}: only safetensors and GGUF choices are read before downloading")
    if "config.json" not in choice.files:
        raise DownloadError(f"{listing.repo_id} has no config.json")
    api = HfApi()
    shards = [p for p in choice.files if p.endswith(".safetensors")]

    def header(path: str) -> dict:
        try:
            return api.parse_safetensors_file_metadata(listing.repo_id, path, revision=listing.commit).tensors
        except SafetensorsParsingError as e:
            raise DownloadError(f"{path}: not a readable safetensors header ({_first_line(e)})") from e

    with _hub_errors(listing.repo_id, listing.revision):
        response = get_session().get(hf_hub_url(listing.repo_id, "config.json", revision=listing.commit),
                                     headers=build_hf_headers())
        hf_raise_for_status(response)
        with ThreadPoolExecutor(max_workers=min(8, len(shards) or 1)) as pool:
            headers = list(pool.map(header, shards))
    try:
        config = json.loads(response.content)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DownloadError(f"{listing.repo_id}: config.json is not JSON") from None
    if not isinstance(config, dict):
        raise DownloadError(f"{listing.repo_id}: config.json is not a JSON object")
    tensors = {name: TensorInfo(tuple(info.shape), info.dtype) for found in headers for name, info in found.items()}
    return summarize(config, tensors, f"{listing.repo_id}/config.json")


def _read_gguf_weights(listing: RepoListing, choice: DownloadChoice, first_bytes: int, max_bytes: int):
    """A GGUF choice's ModelWeights from its files' headers; a split GGUF's tensor infos are spread over its
    parts, so every part's header is read."""
    from concurrent.futures import ThreadPoolExecutor

    from moedesk.engine.load.size_estimate import summarize_gguf_header

    parts = sorted(p for p in choice.files if p.endswith(".gguf"))
    sizes = {f.path: f.size for f in listing.files}

    def header(path: str):
        return _read_gguf_header(listing, path, sizes.get(path) or None, first_bytes, max_bytes)

    with _hub_errors(listing.repo_id, listing.revision):
        with ThreadPoolExecutor(max_workers=min(8, len(parts))) as pool:
            headers = list(pool.map(header, parts))
    return summarize_gguf_header(headers, f"{listing.repo_id}/{parts[0]}", [f"{listing.repo_id}/{p}" for p in parts])


def _read_gguf_header(listing: RepoListing, path: str, size: int | None, first_bytes: int, max_bytes: int):
    """One GGUF file's header (engine.load.gguf_header.GGUFHeader) from its first bytes on the Hub."""
    from dataclasses import replace

    from huggingface_hub import hf_hub_url

    from moedesk.engine.errors import CheckpointError
    from moedesk.engine.load.gguf_header import HeaderIncomplete, parse_header

    url = hf_hub_url(listing.repo_id, path, revision=listing.commit)
    name = f"{listing.repo_id}/{path}"
    data, want = b"", first_bytes
    while True:
        end = min(want, size) if size else want
        if end > len(data):
            data += _fetch_range(url, len(data), end)
        try:
            header = parse_header(data, name)
            break
        except HeaderIncomplete as e:
            if len(data) < end or len(data) == size or (size and e.needed > size):  # the file ends first
                raise CheckpointError(name, "truncated GGUF file: its header runs past the file's end" if data
                                      else "empty file") from None
            if e.needed > max_bytes or want >= max_bytes:
                cap = f"{max_bytes >> 20} MiB" if max_bytes % (1 << 20) == 0 else f"{max_bytes} bytes"
                raise DownloadError(f"{name}: the GGUF header is longer than {cap}, more than is read for an "
                                    "estimate before downloading") from None
            want = min(2 * want, max_bytes)
    # Llama 3.1-style RoPE scaling is stored as a tensor of per-dimension factors that the config depends on
    # (loading refuses factors other than 1): its few hundred bytes are fetched, as a load would read them.
    tensors = [t.with_data(_fetch_range(url, t.data_offset, t.data_offset + t.n_bytes))
               if t.name == "rope_freqs.weight" else t for t in header.tensors]
    return replace(header, tensors=tensors)


def _fetch_range(url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of the file at `url` (fewer where the file ends first, none where it ends before
    `start`) with a bounded Range request.
    The answer is read as a stream and cut at `end`, so a server that ignores Range and sends the whole file
    (200 instead of 206) costs no more than the bytes asked for."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    with get_session().stream("GET", url, headers=headers) as response:
        if response.status_code == 416:  # nothing at `start`: the file ends there (an empty one: at once)
            return b""
        hf_raise_for_status(response)
        skip = 0 if response.status_code == 206 else start
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) >= skip + end - start:
                break
    return bytes(body[skip:skip + end - start])


_GGUF_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
# Quantisation names as llama.cpp and the big GGUF publishers write them: Q4_K_M, Q8_0, IQ4_XS, TQ1_0, BF16, MXFP4...
# They contain "_" but never "-" or ".", which is what separates them from the rest of a file name.
_QUANT = re.compile(r"I?Q\d+(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?", re.IGNORECASE)


def gguf_quant(path: str) -> str:
    """The quantisation in a GGUF file name, as written there ("Q4_K_M", "UD-Q4_K_XL", "bf16"); split parts
    (`-00001-of-00003`) share their quantisation. A name without a recognisable one is returned whole (minus the
    shard suffix and `.gguf`), so the file still becomes a choice of its own."""
    stem = _GGUF_SHARD.sub("", PurePosixPath(path).name[: -len(".gguf")])
    tokens = re.split(r"[-.]", stem)
    for i in reversed(range(len(tokens))):
        if _QUANT.fullmatch(tokens[i]):
            # Unsloth's "dynamic" quants (UD-Q4_K_XL) are a different file from plain Q4_K_XL: keep the prefix.
            return f"{tokens[i - 1]}-{tokens[i]}" if i > 0 and tokens[i - 1].upper() == "UD" else tokens[i]
    return stem


def _include_for(files: list[str], all_paths: list[str], candidates: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The first candidate glob set that selects exactly `files` out of the repo, else the escaped file names."""
    wanted = sorted(files)
    for patterns in candidates:
        if sorted(_select_paths(all_paths, patterns)) == wanted:
            return patterns
    return tuple(glob.escape(p) for p in wanted)


def _select(files: Iterable[RepoFile], include: Iterable[str] | None) -> list[RepoFile]:
    files = list(files)
    if include is None:
        return files
    picked = set(_select_paths([f.path for f in files], include))
    return [f for f in files if f.path in picked]


def _select_paths(paths: list[str], include: Iterable[str]) -> list[str]:
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(paths, allow_patterns=list(include)))


def _matches(path: str, patterns: Iterable[str]) -> bool:
    return bool(_select_paths([path], patterns))


# ---------------------------------------------------------------------------------------------------------------
# Will it fit?
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FitReport:
    needed_bytes: int
    target_dir: Path
    free_disk_bytes: int
    margin_bytes: int
    ram_total_bytes: int
    ram_available_bytes: int
    vram_total_bytes: int | None  # None: no CUDA GPU (or no torch)
    vram_free_bytes: int | None

    @property
    def fits_on_disk(self) -> bool:
        return self.needed_bytes + self.margin_bytes <= self.free_disk_bytes

    @property
    def fits_in_memory(self) -> bool:
        """Advisory: the weights as stored fit in RAM + VRAM together (moedesk keeps offloaded experts in RAM)."""
        return self.needed_bytes <= self.ram_total_bytes + (self.vram_total_bytes or 0)

    @property
    def summary(self) -> str:
        disk = f"disk: {format_bytes(self.free_disk_bytes)} free"
        disk += " (ok)" if self.fits_on_disk else \
            f" (NOT enough: needs {format_bytes(self.needed_bytes + self.margin_bytes)} with margin)"
        ram = f"RAM: {format_bytes(self.ram_available_bytes)} free of {format_bytes(self.ram_total_bytes)}"
        vram = "VRAM: no CUDA GPU" if self.vram_total_bytes is None else \
            f"VRAM: {format_bytes(self.vram_free_bytes or 0)} free of {format_bytes(self.vram_total_bytes)}"
        parts = [f"{format_bytes(self.needed_bytes)} to download", disk, ram, vram]
        if not self.fits_in_memory:
            parts.append("larger than RAM + VRAM together")
        return "; ".join(parts)


def disk_margin(needed_bytes: int) -> int:
    return max(MIN_DISK_MARGIN_BYTES, needed_bytes // 50)


def check_fits(choice_bytes: int, target_dir: str | Path | None = None) -> FitReport:
    """Free disk where the files go (default: the HF cache), RAM, VRAM, and whether the download fits on disk."""
    import psutil

    target = Path(target_dir) if target_dir is not None else hf_cache_dir()
    memory = psutil.virtual_memory()
    vram_free, vram_total = _vram()
    return FitReport(choice_bytes, target, _free_disk(target), disk_margin(choice_bytes),
                     memory.total, memory.available, vram_total, vram_free)


def _free_disk(path: Path) -> int:
    """Free bytes on the file system that holds `path`, or would hold it once created."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return shutil.disk_usage(Path.cwd()).free


def _vram() -> tuple[int | None, int | None]:
    """(free, total) bytes over all CUDA GPUs, or (None, None) without one."""
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    free = total = 0
    for device in range(torch.cuda.device_count()):
        f, t = torch.cuda.mem_get_info(device)
        free, total = free + f, total + t
    return free, total


def format_bytes(n: int | float) -> str:
    """Decimal units, as the Hub's web pages show file sizes."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def hf_cache_dir() -> Path:
    """The HF hub cache, read from huggingface_hub at call time (HF_HUB_CACHE / HF_HOME, as it resolved them)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser().resolve()


# ---------------------------------------------------------------------------------------------------------------
# Downloading
# ---------------------------------------------------------------------------------------------------------------

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass
class _Planned:
    path: str
    size: int
    blob: Path | None  # None: already linked in the snapshot, nothing to do
    partial_bytes: int = 0

    @property
    def partial(self) -> Path:
        assert self.blob is not None
        return self.blob.with_name(self.blob.name + ".incomplete")


def download(repo_id: str, revision: str | None = None, include: list[str] | None = None,
             progress: ProgressCallback | None = None, cancel: threading.Event | None = None) -> Path:
    """Download the repo's files matching `include` (all files if None) into the HF cache; return the snapshot
    folder. Files already there are skipped and partial ones continue where they stopped.

    `progress(done_bytes, total_bytes)` is called from this thread, at the start (with what is already on disk),
    after every chunk and at the end. Setting `cancel` stops the download at the next chunk (huggingface_hub reads
    10 MB at a time) and raises DownloadCancelled, keeping the partial file. Every failure is a DownloadError with
    a one-line message.
    """
    from huggingface_hub.file_download import repo_folder_name

    cancel = cancel or threading.Event()
    with _hub_errors(repo_id, revision):
        info = _model_info(repo_id, revision)
        files = _select((RepoFile(s.rfilename, s.size or 0) for s in info.siblings or ()), include)
        if not files:
            raise DownloadError(_nothing_matches(repo_id, include, [s.rfilename for s in info.siblings or ()]))
        cache = hf_cache_dir()
        storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
        snapshot = storage / "snapshots" / info.sha

        # Small files first: config and tokenizer land in seconds and a gated repo fails before any big transfer.
        plan = []
        for f in sorted(files, key=lambda f: (f.size, f.path)):
            if cancel.is_set():
                raise DownloadCancelled()
            plan.append(_plan_file(repo_id, info.sha, f, storage, snapshot))
        tracker = _Tracker({p.path: p.size for p in plan}, progress)
        for p in plan:
            tracker.set(p.path, p.size if p.blob is None or p.blob.exists() else p.partial_bytes)
        _check_room(tracker.total - tracker.done, cache)
        tracker.report()

        for p in plan:
            if cancel.is_set():
                raise DownloadCancelled()
            if p.blob is None:
                continue
            if not p.blob.exists():
                _fetch_blob(repo_id, info.sha, p, cache, storage, tracker, cancel)
            _link_into_snapshot(repo_id, info.sha, p.path, cache)
            tracker.set(p.path, p.size)
            tracker.report()

        # Only now point the branch at this commit, so `--model REPO_ID` never picks up a half-done snapshot.
        _write_ref(storage, revision or "main", info.sha)
    return snapshot


def _model_info(repo_id: str, revision: str | None):
    from huggingface_hub import HfApi

    return HfApi().model_info(repo_id, revision=revision, files_metadata=True)


def _plan_file(repo_id: str, commit: str, file: RepoFile, storage: Path, snapshot: Path) -> _Planned:
    """What is on disk for one file: linked already, a complete blob, or a partial blob of N bytes."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    if (snapshot / file.path).exists():
        return _Planned(file.path, file.size, None)
    # The blob is named by the ETag the Hub sends for the file (its sha256 for LFS files), as hf_hub_download does.
    meta = get_hf_file_metadata(hf_hub_url(repo_id, file.path, revision=commit))
    size = meta.size if meta.size is not None else file.size
    planned = _Planned(file.path, size, storage / "blobs" / meta.etag)
    if planned.partial.exists():
        planned.partial_bytes = min(planned.partial.stat().st_size, size)
    return planned


def _fetch_blob(repo_id: str, commit: str, planned: _Planned, cache: Path, storage: Path,
                tracker: _Tracker, cancel: threading.Event) -> None:
    """Download one file into `blobs/<etag>.incomplete`, continuing what is there, then rename it to the blob."""
    from filelock import FileLock, Timeout
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    blob, partial = planned.blob, planned.partial
    assert blob is not None
    blob.parent.mkdir(parents=True, exist_ok=True)
    # The lock huggingface_hub takes for the same blob: two processes never write one partial file at once.
    lock_path = cache / ".locks" / storage.name / f"{blob.name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path), timeout=0, mode=0o664)
    try:
        lock.acquire()
    except Timeout:
        raise DownloadError(f"{planned.path}: another process is downloading this file into the Hugging Face cache; "
                            "wait for it to finish, or stop it, and run again") from None
    try:
        if partial.exists() and partial.stat().st_size > planned.size:
            partial.unlink()  # longer than the file can be: not a prefix of it
        headers = build_hf_headers()
        # Uncompressed bytes, so that a byte offset in the partial file is a byte offset in the file on the Hub.
        headers["Accept-Encoding"] = "identity"
        with partial.open("ab") as out:
            resumed_from = out.tell()
            # The commit-pinned resolve URL: the Hub redirects it to its CDN on every request, so a retry hours
            # later gets a fresh signed URL, and httpx drops the Authorization header when the redirect leaves the
            # Hub. http_get sends `Range: bytes=<resumed_from>-` and retries dropped connections itself.
            http_get(hf_hub_url(repo_id, planned.path, revision=commit), out, resume_size=resumed_from,
                     headers=headers, expected_size=planned.size, displayed_filename=planned.path,
                     tqdm_class=functools.partial(_FileBar, tracker, planned.path, cancel))
        if resumed_from and _SHA256.fullmatch(blob.name):
            _verify_sha256(partial, blob.name, planned.path, cancel)
        os.replace(partial, blob)
    finally:
        lock.release()


def http_get(*args, **kwargs):
    """huggingface_hub's downloader, looked up at call time (tests replace it to simulate a full disk)."""
    from huggingface_hub.file_download import http_get as hf_http_get

    return hf_http_get(*args, **kwargs)


def _verify_sha256(path: Path, expected: str, name: str, cancel: threading.Event) -> None:
    """A file completed from a partial one written by an earlier process is checked against its LFS sha256 (its
    ETag): that partial may have been cut short by a crash or edited since. Fresh downloads are trusted like
    huggingface_hub trusts them."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            if cancel.is_set():
                raise DownloadCancelled()
            digest.update(block)
    if digest.hexdigest() != expected:
        path.unlink()
        raise DownloadError(f"{name}: the resumed download does not match the Hub's checksum; the partial file was "
                            "deleted, run the download again to fetch it afresh")


def _link_into_snapshot(repo_id: str, commit: str, path: str, cache: Path) -> None:
    """Let huggingface_hub write the snapshot entry: it finds `blobs/<etag>` present and only links it (a symlink,
    or a copy where symlinks are not allowed), so the cache stays exactly as its own tools expect."""
    from huggingface_hub import hf_hub_download

    hf_hub_download(repo_id, path, revision=commit, cache_dir=cache)


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    if _COMMIT.fullmatch(revision):
        return  # a commit names itself; huggingface_hub keeps no ref for it either
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    # a random name, created anew: a fixed one could be a planted link, written through
    fd, tmp = tempfile.mkstemp(dir=ref.parent, prefix=f".{ref.name}-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(commit)
    os.replace(tmp, ref)  # readers never see a half-written ref


def _check_room(remaining_bytes: int, cache: Path) -> None:
    free = _free_disk(cache)
    if remaining_bytes + disk_margin(remaining_bytes) > free:
        raise DownloadError(f"not enough disk space: {format_bytes(remaining_bytes)} still to download (plus "
                            f"{format_bytes(disk_margin(remaining_bytes))} margin) but {format_bytes(free)} free in "
                            f"{cache}; free some space or set HF_HUB_CACHE to a bigger disk")


class _Tracker:
    """Bytes on disk per file, summed into one (done, total) for the caller's progress callback."""

    def __init__(self, sizes: dict[str, int], callback: ProgressCallback | None):
        self.sizes = sizes
        self.total = sum(sizes.values())
        self.per_file = dict.fromkeys(sizes, 0)
        self.callback = callback

    @property
    def done(self) -> int:
        return sum(self.per_file.values())

    def set(self, path: str, done: int) -> None:
        self.per_file[path] = done

    def add(self, path: str, n: int) -> None:
        self.per_file[path] += n

    def report(self) -> None:
        if self.callback is not None:
            self.callback(min(self.done, self.total), self.total)


class _FileBar:
    """What huggingface_hub's `http_get` takes as `tqdm_class`: it is built once per file with `initial` = the
    bytes already in the partial file (0 when the server ignored the Range), and `update(n)` is called after every
    chunk received and before that chunk is written. Raising there is the only hook http_get offers to stop
    between chunks; the chunk in hand is dropped, so the partial file stays a clean prefix of the file."""

    def __init__(self, tracker: _Tracker, path: str, cancel: threading.Event, *, initial: int = 0, **_tqdm_kwargs):
        self.tracker, self.path, self.cancel = tracker, path, cancel
        tracker.set(path, initial)
        tracker.report()

    def update(self, n: int | float | None = 1) -> None:
        if self.cancel.is_set():
            raise DownloadCancelled()
        self.tracker.add(self.path, int(n or 0))
        self.tracker.report()

    def close(self) -> None:
        pass

    def __enter__(self) -> _FileBar:
        return self

    def __exit__(self, *exc) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------------
# Errors: one line each
# ---------------------------------------------------------------------------------------------------------------

@contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """Turn what huggingface_hub, httpx and the file system raise into a DownloadError with one line."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    endpoint = constants.ENDPOINT
    try:
        yield
    except DownloadError:
        raise
    except GatedRepoError as e:  # before RepositoryNotFoundError, its base class
        raise DownloadError(f"{repo_id} is a gated model: accept its licence on {endpoint}/{repo_id} and log in "
                            "with `hf auth login`, then run the download again") from e
    except RepositoryNotFoundError as e:
        raise DownloadError(f"{repo_id}: no such model on the Hugging Face Hub (if it is private, log in with "
                            "`hf auth login`)") from e
    except RevisionNotFoundError as e:
        raise DownloadError(f"{repo_id}: no revision {revision!r} (branch, tag or commit) on the Hub") from e
    except RemoteEntryNotFoundError as e:
        raise DownloadError(f"{repo_id}: a file listed by the Hub is missing from it ({_first_line(e)}); "
                            "try again later") from e
    except OfflineModeIsEnabled as e:
        raise DownloadError("HF_HUB_OFFLINE is set: unset it to download from the Hugging Face Hub") from e
    except (httpx2.TransportError, LocalEntryNotFoundError, ConnectionError) as e:
        # LocalEntryNotFoundError: hf_hub_download could not reach the Hub and has nothing cached to fall back on.
        raise DownloadError(f"cannot reach {endpoint} ({_first_line(e)}): check the network connection and try "
                            "again; the download resumes where it stopped") from e
    except HFValidationError as e:
        raise DownloadError(f"{repo_id!r} is not a Hub repo id ({_first_line(e)}); expected OWNER/NAME") from e
    except HfHubHTTPError as e:  # before OSError (and ValueError): huggingface_hub's HTTP errors are OSErrors too
        raise DownloadError(f"{repo_id}: the Hub answered {_first_line(e)}") from e
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DownloadError(f"disk full while downloading into {hf_cache_dir()}: free some space (or set "
                                "HF_HUB_CACHE to a bigger disk) and run again to resume") from e
        if e.errno is not None:
            raise DownloadError(f"cannot write to {e.filename or hf_cache_dir()}: {e.strerror}") from e
        # http_get's "Consistency check failed" (the Hub sent a different number of bytes than announced)
        raise DownloadError(f"{repo_id}: {_first_line(e)}; run again to retry") from e
    except ValueError as e:  # e.g. http_get refuses to fetch a file over 50 GB from offset 0 over plain HTTP
        raise DownloadError(f"{repo_id}: {_first_line(e)}") from e


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _nothing_matches(repo_id: str, include: list[str] | None, paths: list[str]) -> str:
    if not paths:
        return f"{repo_id}: the repo has no files"
    sample = ", ".join(sorted(paths)[:6]) + (", ..." if len(paths) > 6 else "")
    return f"{repo_id}: no file matches --include {' '.join(include or [])} (the repo has {sample})"


# ---------------------------------------------------------------------------------------------------------------
# `moedesk download REPO_ID [--revision R] [--include GLOB ...]`
# ---------------------------------------------------------------------------------------------------------------

def add_download_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", metavar="REPO_ID",
                        help="model repo on the Hugging Face Hub, e.g. Qwen/Qwen3-30B-A3B")
    parser.add_argument("--revision", default=None, metavar="R", help="branch, tag or commit (default: main)")
    parser.add_argument("--include", nargs="+", action="extend", default=None, metavar="GLOB",
                        help="download only files matching these globs (default: the safetensors checkpoint, or "
                             "the GGUF file if the repo has exactly one quantisation)")


def run_download_command(args: argparse.Namespace, stderr: TextIO | None = None,
                         stdout: TextIO | None = None) -> int:
    """0: downloaded (the path to pass to --model goes to stdout); 1: the download failed; 2: the repo has several
    GGUF quantisations (or nothing moedesk knows) and --include must pick; 130: interrupted, partial files kept."""
    stderr = stderr or sys.stderr
    stdout = stdout or sys.stdout

    def say(message: str) -> None:
        print(message, file=stderr, flush=True)

    repo_id, revision = args.repo_id, args.revision
    try:
        listing = list_repo_files_with_sizes(repo_id, revision)
        choice = None
        if args.include:
            include = list(args.include)
            selected = listing.select(include)
            if not selected:
                raise DownloadError(_nothing_matches(repo_id, include, [f.path for f in listing.files]))
            what = f"{len(selected)} file{'s' if len(selected) != 1 else ''} matching --include " \
                   f"({format_bytes(sum(f.size for f in selected))})"
        else:
            choice = listing.default_choice()
            if choice is None:
                say(_pick_one_message(listing))
                return 2
            include, selected, what = list(choice.include), listing.select(choice.include), choice.description
        say(f"{repo_id} @ {listing.commit[:12]}: {what}")
        if listing.gated:
            say("gated model: the download works once its licence is accepted on the Hub and `hf auth login` is done")
        say(check_fits(sum(f.size for f in selected)).summary)
        snapshot = download_with_bar(repo_id, revision, include, stderr)
    except (KeyboardInterrupt, DownloadCancelled):
        say("moedesk: interrupted; the partial files are kept: run the same command again to resume")
        return 130
    except DownloadError as e:
        say(f"moedesk: {e}")
        return 1

    ggufs = sorted(p for p in (choice.files if choice else []) if p.endswith(".gguf"))
    target = snapshot / ggufs[0] if choice and choice.kind == "gguf" else snapshot
    say(f"done: {target}")
    say(f"run it with: moedesk --model {repo_id if target == snapshot and revision is None else target}")
    print(target, file=stdout, flush=True)
    return 0


def download_with_bar(repo_id: str, revision: str | None, include: list[str], stderr: TextIO) -> Path:
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    columns = (TextColumn("downloading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=stderr)) as bar:
        task = bar.add_task("download", total=None)
        first = True

        def progress(done: int, total: int) -> None:
            nonlocal first
            if first:
                # Bytes found on disk are not transfer speed: start the rate estimate from them.
                bar.reset(task, total=total, completed=done)
                first = False
            else:
                bar.update(task, total=total, completed=done)

        return download(repo_id, revision, include, progress=progress)


def _pick_one_message(listing: RepoListing) -> str:
    gguf = [c for c in listing.choices if c.kind == "gguf"]
    if not gguf:
        return (f"moedesk: {listing.repo_id} has no .safetensors or .gguf weights; pass --include GLOB to download "
                "files anyway")
    lines = [f"moedesk: {listing.repo_id} has {len(gguf)} GGUF quantisations; pick one with --include:"]
    for c in gguf:
        lines.append(f"  {c.name:<14} {format_bytes(c.total_bytes):>9}  "
                     f"moedesk download {listing.repo_id} --include {' '.join(_quote(p) for p in c.include)}")
    return "\n".join(lines)


def _quote(pattern: str) -> str:
    return f"'{pattern}'" if any(ch in pattern for ch in "*?[] ") else pattern
