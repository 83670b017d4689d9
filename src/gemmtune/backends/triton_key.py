"""Triton's own cache key, kept across processes.

Before a process can find any compiled binary in Triton's cache, Triton computes ``triton_key()``
once: a SHA-256 of its own package, libtriton included (0.41 s of the 0.61 s first call of a
stored ``gemmtune.autotune`` kernel in a new process on an H100 host; docs/autotune.md). The key
only changes when one of those files does. ``install`` makes Triton's cache lookups take the key
from a small file in gemmtune's cache directory, stamped with the path, size and modification
time of every file Triton hashes (what build tools' direct mode trusts): a new process stats the
files, a few milliseconds, and takes the stored key where the stamp matches; anywhere else it
computes the key as Triton does and stores it. The file holds one string; nothing read from it
is executed, and a file that cannot be read or written is ignored.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from gemmtune.backends import memo_file
from gemmtune.settings import cache_dir

MEMO_FILENAME = "triton-key.json"
_HASHED = ("compiler", "backends", "language")  # the packages triton_key() hashes, with libtriton and its own file


def install() -> None:
    """Triton's cache lookups (``triton.runtime.cache.get_cache_key``) take the key kept across
    processes. Once per process; a Triton without ``triton_key`` there is left as it is."""
    try:
        import triton
        import triton.runtime.cache as cache
    except ImportError:
        return
    original = getattr(cache, "triton_key", None)
    if original is None or getattr(original, "gemmtune_memo", False):
        return
    root = Path(triton.__file__).parent
    cache.triton_key = memoized(original, root, Path(cache.__file__), cache_dir() / MEMO_FILENAME)


def memoized(compute: Callable[[], str], root: Path, own_file: Path, memo: Path) -> Callable[[], str]:
    """``compute`` (Triton's ``triton_key``) answered from ``memo`` where the files under ``root``
    it hashes are as they were when the key was stored."""
    return memo_file.remembered(memo, lambda: file_stamp(root, own_file), compute)


def file_stamp(root: Path, own_file: Path) -> str:
    """A digest of the path, size and modification time of every module of the packages Triton
    hashes (Python files and extensions), of libtriton and of Triton's cache module."""
    files = [own_file, *sorted((root / "_C").glob("libtriton*"))]
    for package in _HASHED:
        for folder, _, names in sorted(os.walk(root / package)):
            files += [Path(folder) / name for name in sorted(names) if name.endswith((".py", ".so"))]
    return memo_file.stamp(files)
