"""Every ``GEMMTUNE_*`` environment variable, declared once, typed, read lazily.

Each knob has one name in Python (the attribute here), one environment variable, and one CLI
flag where the CLI exposes it. Values are read when asked for, never at import, so a test or a
user can change the environment after ``import gemmtune``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MODES = ("tune", "lookup")


@dataclass(frozen=True)
class Knob:
    env: str
    default: str
    help: str

    def raw(self) -> str:
        return os.environ.get(self.env, self.default)


CACHE_DIR = Knob("GEMMTUNE_CACHE_DIR", "", "directory of the tuning store (default: the user's cache dir)")
MODE = Knob("GEMMTUNE_MODE", "tune", "on a store miss: 'tune' tunes on first sight, 'lookup' falls back to torch")
LOG_LEVEL = Knob("GEMMTUNE_LOG_LEVEL", "INFO", "level of the 'gemmtune' logger when the CLI configures it")
BUCKET = Knob("GEMMTUNE_BUCKET", "exact",
              "on a miss, reuse the result tuned for the shape's bucket: exact (none), pow2 or log2m")

COMPILE_WORKERS = Knob("GEMMTUNE_COMPILE_WORKERS", "",
                       "threads compiling candidates ahead of timing: a count, 0 for none "
                       "(default: one per CPU core but one, at most 16)")
COMPILE_FORK = Knob("GEMMTUNE_COMPILE_FORK", "1",
                    "1: run Triton's front end of each candidate compiled ahead in a forked child, "
                    "side by side; 0: in the compile threads only (they share the GIL)")

MISSES = Knob("GEMMTUNE_MISSES", "",
               "in lookup mode, append each shape (and gemmtune.autotune kernel call) missing from the store "
               "to this file (JSON Lines), for `gemmtune tune --from FILE`")

STORE = Knob("GEMMTUNE_STORE", "",
              "the tuning store: a postgresql:// URL (a server a fleet shares), or a SQLite file or directory "
              "(default: the SQLite file in GEMMTUNE_CACHE_DIR)")

KNOBS = (CACHE_DIR, STORE, MODE, LOG_LEVEL, BUCKET, COMPILE_WORKERS, COMPILE_FORK, MISSES)


def cache_dir() -> Path:
    """Where the store lives: ``GEMMTUNE_CACHE_DIR``, else the per-user cache directory."""
    explicit = CACHE_DIR.raw()
    if explicit:
        return Path(explicit).expanduser()
    try:
        import platformdirs
    except ImportError:  # the GPU machines carry no platformdirs; XDG is what it would say
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "gemmtune"
    return Path(platformdirs.user_cache_dir("gemmtune", appauthor=False))


STORE_FILENAME = "gemmtune.sqlite"


def store_file(path: str | Path | None = None) -> Path:
    """The store's file, the one answer for every command and the library: ``path`` itself where
    it is a file, or names one not made yet (``team.db``: a suffix); else the store file inside
    that directory (existing, or to be made); without a path, inside ``cache_dir()``."""
    if path is None:
        return cache_dir() / STORE_FILENAME
    path = Path(path).expanduser()
    # one question of the file system first: two processes opening one new store.sqlite at once
    # would otherwise see it absent, then present, and take it for a directory
    if path.is_dir():
        return path / STORE_FILENAME
    return path if path.suffix or path.exists() else path / STORE_FILENAME


def store_location() -> str | None:
    """``GEMMTUNE_STORE`` where set (a server's URL, or a SQLite file or directory), else None:
    the SQLite file of ``store_file()``."""
    return STORE.raw().strip() or None


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels for gemmtune's workers: TRITON_CACHE_DIR if the user
    set it, else beside the store, so clearing gemmtune's cache clears both."""
    explicit = os.environ.get("TRITON_CACHE_DIR")
    return Path(explicit).expanduser() if explicit else cache_dir() / "triton"


def bucket_policy() -> str:
    from gemmtune.problem import BUCKETS

    value = BUCKET.raw().strip().lower()
    if value not in BUCKETS:
        raise ValueError(f"{BUCKET.env}={value!r} is not a bucket policy; accepted: {', '.join(BUCKETS)}")
    return value


def mode() -> str:
    value = MODE.raw().strip().lower()
    if value not in MODES:
        raise ValueError(f"{MODE.env}={value!r} is not a mode; accepted: {', '.join(MODES)}")
    return value


def compile_workers() -> int | None:
    """The number of compile threads asked for; None when unset (gemmtune picks)."""
    value = COMPILE_WORKERS.raw().strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{COMPILE_WORKERS.env}={value!r} is not a count; accepted: 0 (none) or a whole number")
    return int(value)


def compile_fork() -> bool:
    value = COMPILE_FORK.raw().strip()
    if value not in ("0", "1"):
        raise ValueError(f"{COMPILE_FORK.env}={value!r} is not accepted; accepted: 1 (fork) or 0 (threads only)")
    return value == "1"


def misses_file() -> Path | None:
    value = MISSES.raw().strip()
    return Path(value).expanduser() if value else None
