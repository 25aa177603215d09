"""Measurements kept between runs as small JSON files: read if present and sound, else measure and store."""
from __future__ import annotations

import json
import os
from pathlib import Path


def cached_json(path: Path, measure, refresh: bool = False):
    """The value stored at path, or measure() now and store it (atomically; a damaged file is measured again)."""
    path = Path(path)
    if path.is_file() and not refresh:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            pass
    value = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)
    return value
