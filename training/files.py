"""Files written so that a crash leaves the old one whole: the trainer's checkpoints and head, its answers and
the prompts the target wrote."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) into a temporary file beside `path`, then rename it over `path`: a crash leaves the old file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would leave a shared head readable by its trainer only
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
