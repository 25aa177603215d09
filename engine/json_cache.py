"""Measurements kept between runs as small JSON files: read if present and sound, else measure and store."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

_unwritable: set[Path] = set()  # cache folders already reported unwritable in this process


def cached_json(path: Path, measure, refresh: bool = False):
    """The value stored at path, or measure() now and store it (atomically; a damaged file is measured again).

    The cache only saves time: when its folder cannot be written (read-only, a file, under a file),
    the value is measured, used and not stored, and stderr says so once per folder.
    """
    path = Path(path)
    if not refresh:
        try:
            return json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            pass  # absent, unreadable or damaged: measure again
    value = measure()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new file under a random name: a fixed one (profile-<key>.tmp) could be a link planted in the cache
        # folder, and writing through it overwrote whatever it pointed at.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(value, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if path.parent not in _unwritable:
            _unwritable.add(path.parent)
            print(f"moedesk: {path.parent}: cannot write the cache folder ({folder_problem(path.parent, e)}); "
                  f"going on without it, so this is measured again next time (MOEDESK_CACHE_DIR moves the folder)",
                  file=sys.stderr, flush=True)
    return value


def unwritable(folder: Path) -> str | None:
    """Why files cannot be created in `folder` (made if missing), in words (folder_problem); None if they can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        return folder_problem(folder, e)
    return None


def folder_problem(folder: Path, error: OSError) -> str:
    """Why files cannot be made in `folder`, in words (the errno's own are cryptic for the file cases)."""
    try:
        if folder.exists() and not folder.is_dir():
            return "it is a file, not a folder"
    except OSError:
        pass
    if isinstance(error, NotADirectoryError):
        return "a part of its path is a file, not a folder"
    return error.strerror or str(error)
