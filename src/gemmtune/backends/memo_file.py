"""A small JSON file in gemmtune's cache directory that keeps an answer across processes (Triton's
cache key, QuACK's source fingerprint, the GPU's cluster occupancy): read as data, never executed,
and replaced whole, so that a process reading meanwhile sees the old file or the new one. A file
that cannot be read counts as absent; one that cannot be written is left as it was. An answer
computed from files is kept with their ``stamp`` (``kept_answer``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
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


def stamp(files: Iterable[Path], *extra: str) -> str:
    """A digest of the path, size and modification time of each of ``files`` (what build tools'
    direct mode trusts) and of the ``extra`` strings: it changes where any of them does."""
    digest = hashlib.sha256()
    for value in extra:
        digest.update(f"{value}\n".encode())
    for path in files:
        info = path.stat()
        digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def kept_answer(memo: Path, stamp: Callable[[], str], compute: Callable[[], str]) -> str:
    """``compute()``'s string, as ``memo`` keeps it under ``stamp()``: the stored one where the
    stamp matches, else computed and stored with it. Where the stamp cannot be taken (a file
    gone while the folders are read), computed and not kept."""
    try:
        current = stamp()
    except OSError:
        return compute()
    stored = read(memo)
    if stored is not None and stored.get("stamp") == current and isinstance(stored.get("key"), str):
        return stored["key"]
    key = compute()
    write(memo, {"stamp": current, "key": key})
    return key


def remembered(memo: Path, stamp: Callable[[], str], compute: Callable[[], str]) -> Callable[[], str]:
    """A stand-in for ``compute``, a library's own zero-argument function: ``kept_answer`` once a
    process, then that answer. Marked ``gemmtune_memo``, so that installing it twice is seen."""

    @functools.lru_cache(maxsize=1)
    def answer() -> str:
        return kept_answer(memo, stamp, compute)

    answer.gemmtune_memo = True
    return answer
