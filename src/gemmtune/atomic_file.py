"""A file written whole or not at all: beside it first, then renamed over it, so that a reader
(another process, or after a crash) sees the old file or the new one, never half of either."""

from __future__ import annotations

import os
import random
from pathlib import Path


def write(path: Path, text: str) -> None:
    """``text`` as ``path``'s whole content; its folder made where missing. What fails raises, the
    file beside it removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 mode would make a file meant for sharing unreadable to others. The
    # random part keeps two threads of one process apart.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{random.getrandbits(32):08x}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
