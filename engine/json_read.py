"""Reading JSON that a file (a download, a hand edit, an attacker) hands us.

json.loads raises RecursionError, not ValueError, on arrays or objects nested past the interpreter's recursion
limit: every reader caught ValueError and let that through as a traceback. Here it is a ValueError like any
other bad JSON, so each reader's "unreadable file" path (one line, or the file set aside) covers it.
"""
from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """json.loads; ValueError (one line) for JSON nested too deeply to read, as for any malformed JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
