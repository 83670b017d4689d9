"""A small JSON file in gemmtune's cache directory that keeps an answer across processes (Triton's
cache key, the GPU's cluster occupancy): read as data, never executed, and replaced whole, so that
a process reading meanwhile sees the old file or the new one. A file that cannot be read counts
as absent; one that cannot be written is left as it was.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gemmtune import atomic_file

log = logging.getLogger("gemmtune")


def read(memo: Path) -> dict | None:
    """The file's object; None where it is missing, unreadable or not a JSON object."""
    try:
        found = json.loads(memo.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def write(memo: Path, doc: dict) -> None:
    """``doc`` as the file's whole content (``atomic_file``)."""
    try:
        atomic_file.write(memo, json.dumps(doc))
    except OSError as exc:
        log.debug("gemmtune: could not keep %s (%s)", memo, exc)
