"""The default store: every choice and every trial in one SQLite file (WAL) per user.

gemmtune writes only into files it made: it marks them with SQLite's application_id
(APPLICATION_ID) and leaves any other SQLite file exactly as it found it. A store that cannot be
used never breaks the caller of ``gemmtune.linear``, ``matmul`` or ``tune``: see ``Store``.
"""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import closing
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from gemmtune import settings
from gemmtune.errors import StoreError
from gemmtune.store.queries import CHOICE_COLUMNS, REFUSE, Queries, schema_number, warn_once

SCHEMA_VERSION = 1
# PRAGMA application_id of every store gemmtune creates: the ASCII bytes "gmtu". A file with
# another id is another program's, and gemmtune never writes into it.
APPLICATION_ID = 0x676D7475
BUSY_TIMEOUT_S = 30.0  # SQLite's own wait for a lock, inside one attempt
RETRY_FOR_S = 60.0  # our retries on top of it, when a writer holds the lock longer

log = logging.getLogger("gemmtune.store")
T = TypeVar("T")
_INHERITED: list[sqlite3.Connection] = []  # connections a forked child got from its parent
_FAILURES = (sqlite3.Error, OSError)  # what a store's file, folder, lock or disk can raise
_ELSEWHERE = f"move it away, or set {settings.CACHE_DIR.env} (--cache in the CLI) to another directory"

_TABLES = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS choices (device TEXT NOT NULL, problem_key TEXT NOT NULL, backend TEXT NOT NULL,"
    " config_json TEXT NOT NULL, time_ms REAL NOT NULL, cublas_ms REAL, rel_err REAL, tune_s REAL NOT NULL,"
    " gpu_timings INTEGER NOT NULL, gemmtune_version TEXT, created_at TEXT NOT NULL,"
    " PRIMARY KEY (device, problem_key))",
    "CREATE TABLE IF NOT EXISTS trials (id INTEGER PRIMARY KEY, device TEXT NOT NULL, problem_key TEXT NOT NULL,"
    " backend TEXT NOT NULL, config_json TEXT NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL,"
    " samples_json TEXT, rel_err REAL, created_at TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS trials_by_problem ON trials (device, problem_key)",
)


class Store(Queries):
    """A persistent tuning store; safe to share between threads and processes. What it reads and
    writes is ``Queries``'; this class holds the file, its connection and its failures.

    The connection opens on first use, so constructing a Store touches no file; a process forked
    from one that used the Store opens its own, as SQLite connections must not cross a fork.

    A store that cannot be used must not break the program that asked it for a kernel. So by
    default its first failure (a directory or an unwritable path, another program's file, a newer
    gemmtune's, a lock held past the retries, a full disk) is logged once per path, naming the
    file and what to do, and from then on the store keeps nothing: puts are dropped, and gets find
    nothing unless only writing failed, where what it holds is still served. ``strict=True`` (the
    CLI's cache commands) raises StoreError instead. ``export_json`` and ``import_json`` always
    raise: exporting or importing nothing in silence would be a wrong answer, not a fallback.
    """

    _upsert_choice = (f"INSERT OR REPLACE INTO choices ({CHOICE_COLUMNS}, gemmtune_version, created_at) "
                      f"VALUES ({', '.join('?' * 11)})")

    def __init__(self, path: str | Path | None = None, strict: bool = False) -> None:
        self._path = settings.store_file(path)
        self._strict = strict
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._failure: str | None = None
        self._readable = False  # after a failure: whether reading still works

    @property
    def path(self) -> Path:
        return self._path

    def check(self) -> None:
        """Raise StoreError, naming the file and what to do, if this store cannot be read and
        written, whatever ``strict`` says: the CLI asks before it starts work it could not keep.
        A store not created yet is not created here, only checked for a folder it can be created in."""
        if self._conn is not None or self._path.exists():
            self._run(lambda conn: None, write=True)  # opens it, and waits for the write lock
        _require_writable(self._path)

    def __repr__(self) -> str:
        return f"Store({str(self._path)!r})"

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in _family(self._path) if p.exists())

    def _run(self, work: Callable[[sqlite3.Connection], T], write: bool = False, empty: Any = REFUSE) -> T:
        """``work`` on the connection. On a failure, what an empty store answers (``empty``) once
        the failure is logged, or StoreError where ``strict`` or the caller (no ``empty``) says so."""
        def attempt() -> T:
            conn = self._connection()
            return _in_transaction(conn, work) if write else work(conn)

        with self._lock:
            if self._failure is None or (self._readable and not write):
                try:
                    return _retry(attempt)
                except (*_FAILURES, StoreError) as exc:
                    # a write that failed on an open connection leaves reading as it was
                    self._fail(_failure_message(self._path, exc), refuse=self._strict or empty is REFUSE,
                               readable=write and self._conn is not None)
            if empty is REFUSE:
                raise StoreError(self._failure)
            return empty

    def _fail(self, failure: str, refuse: bool, readable: bool) -> None:
        if refuse:
            raise StoreError(failure) from None
        self._failure, self._readable = failure, readable
        warn_once(self._path, failure, readable)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid != os.getpid():
            _INHERITED.append(self._conn)  # never closed here: closing could disturb the parent's state
            self._conn = None
        if self._conn is None:
            self._conn, self._pid = _open(self._path), os.getpid()
        return self._conn


# --- opening, corruption, retries -------------------------------------------------------------


def _family(path: Path) -> tuple[Path, Path, Path]:
    return path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _open(path: Path) -> sqlite3.Connection:
    """Connect and prepare; a file that is not a healthy SQLite database is moved aside."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        identity = _identity(path)
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            _prepare(conn, path)
            return conn
        except sqlite3.OperationalError:  # locked, I/O, permissions: not corruption, never moved aside
            conn.close()
            raise
        except sqlite3.DatabaseError as exc:
            conn.close()
            _quarantine(path, identity, exc)
        except BaseException:
            conn.close()
            raise
    raise StoreError(f"{path}: could not open a healthy store after moving corrupt files aside")


def _prepare(conn: sqlite3.Connection, path: Path) -> None:
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    marked = _check_owner(conn, path)  # first, before anything is written: a file not ours stays as it was
    verdict = conn.execute("PRAGMA quick_check").fetchall()
    if verdict != [("ok",)]:
        raise sqlite3.DatabaseError("quick_check: " + "; ".join(str(row[0]) for row in verdict[:5]))
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")  # WAL stays consistent; a power cut may lose the last commits
    if not marked:
        _in_transaction(conn, _adopt)


def _check_owner(conn: sqlite3.Connection, path: Path) -> bool:
    """Whether the file already carries gemmtune's mark. StoreError for a file gemmtune must not
    write into: another program's (another application_id, or tables not gemmtune's), a newer
    gemmtune's, or one whose schema version gemmtune never wrote. An empty file and a store made
    before the mark existed pass unmarked, to be adopted."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    if app_id not in (0, APPLICATION_ID):
        raise StoreError(f"{path} is another program's SQLite file (application_id {app_id:#010x}, gemmtune's is "
                         f"{APPLICATION_ID:#010x}), so gemmtune leaves it untouched: {_ELSEWHERE}")
    schema = _schema_of(conn)
    if not schema:
        return False
    if app_id == 0 and schema != _our_schema():
        raise StoreError(f"{path} is not a gemmtune store (it holds {_names(schema)}, not gemmtune's tables and "
                         f"columns), so gemmtune leaves it untouched: {_ELSEWHERE}")
    _check_version(path, _schema_version(conn, schema))
    if schema != _our_schema():
        raise StoreError(f"{path} is a gemmtune store whose tables were changed ({_names(schema)}), so gemmtune "
                         f"leaves it untouched: {_ELSEWHERE}")
    return app_id == APPLICATION_ID


def _schema_of(conn: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
    """Every table, index, view and trigger but SQLite's own, as "type name"; a table with its columns."""
    objects = conn.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite!_%' ESCAPE '!'")
    return {f"{kind} {name}": _columns(conn, name) if kind == "table" else () for kind, name in objects.fetchall()}


def _columns(conn: sqlite3.Connection, table: str) -> tuple[str, ...]:
    return tuple(row[0] for row in conn.execute("SELECT name FROM pragma_table_info(?)", (table,)))


@cache
def _our_schema() -> dict[str, tuple[str, ...]]:
    """What ``_schema_of`` finds in a store this gemmtune creates, read from one made in memory."""
    with closing(sqlite3.connect(":memory:")) as conn:
        for statement in _TABLES:
            conn.execute(statement)
        return _schema_of(conn)


def _names(schema: dict[str, tuple[str, ...]]) -> str:
    return ", ".join(sorted(key.split(" ", 1)[1] for key in schema if key.startswith("table ")))


def _schema_version(conn: sqlite3.Connection, schema: dict[str, tuple[str, ...]]) -> Any:
    """The stored schema version, or None where the file has none (meta, as every gemmtune writes it)."""
    if schema.get("table meta") != _our_schema()["table meta"]:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else row[0]


def _check_version(path: Path, version: Any) -> None:
    """Refuse a version gemmtune never wrote, and a newer one: never read with the wrong schema,
    never migrated down, never dropped."""
    number = schema_number(version)
    if number is None:
        found = "no store schema version" if version is None else f"store schema version {version!r}"
        raise StoreError(f"{path} has {found}, and gemmtune writes whole numbers from 1, so it leaves the file "
                         f"untouched: {_ELSEWHERE}")
    if number > SCHEMA_VERSION:
        raise StoreError(f"{path} was made by a newer gemmtune (store schema version {version!r}; this one reads "
                         f"version {SCHEMA_VERSION} at most), so this one neither reads nor writes it: upgrade "
                         f"gemmtune, or set {settings.CACHE_DIR.env} (--cache in the CLI) to another directory")


def _adopt(conn: sqlite3.Connection) -> None:
    """Make the file a marked store: a new one gets the tables, an old unmarked one (made before
    the mark) only the mark, and keeps every entry."""
    for statement in _TABLES:
        conn.execute(statement)
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")


def _require_writable(path: Path) -> None:
    """StoreError unless this process may write the store: the file, where it exists, and the
    nearest existing folder, where the file and its WAL files are created."""
    if path.exists() and not os.access(path, os.W_OK):
        raise StoreError(f"{path} cannot be written by this user: make it writable, or set "
                         f"{settings.CACHE_DIR.env} (--cache in the CLI) to another directory")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise StoreError(f"{path} cannot be written: {folder} is not a directory this user may write into; set "
                         f"{settings.CACHE_DIR.env} (--cache in the CLI) to another directory")


def _failure_message(path: Path, exc: BaseException) -> str:
    """One line: the file, what is wrong with it, and what to do."""
    if isinstance(exc, StoreError):
        return str(exc)
    if path.is_dir():
        return f"{path} is a directory, where the store's file belongs: {_ELSEWHERE}"
    return (f"{path} cannot be used as the tuning store ({exc}): check that the file and its directory are "
            f"writable and the disk has space, or set {settings.CACHE_DIR.env} (--cache in the CLI) to another "
            "directory")


def _quarantine(path: Path, identity: tuple[int, int] | None, exc: Exception) -> None:
    if identity is None or _identity(path) != identity:
        return  # another process already moved it aside and started a fresh store: just reopen
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    for source in _family(path):
        if source.exists():
            os.replace(source, aside.with_name(aside.name + source.name[len(path.name):]))
    log.warning("%s is not a usable gemmtune store (%s); moved it to %s and started an empty store",
                path, exc, aside)


def _in_transaction(conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], T]) -> T:
    # IMMEDIATE takes the write lock up front, so two writers never deadlock upgrading a read lock.
    conn.execute("BEGIN IMMEDIATE")
    try:
        out = work(conn)
        conn.execute("COMMIT")
    except BaseException:
        conn.rollback()
        raise
    return out


def _retry(attempt: Callable[[], T]) -> T:
    deadline = time.monotonic() + RETRY_FOR_S
    delay = 0.01
    while True:
        try:
            return attempt()
        except sqlite3.OperationalError as exc:
            message = str(exc).lower()
            if ("locked" not in message and "busy" not in message) or time.monotonic() + delay > deadline:
                raise
            log.debug("store busy (%s); retrying in %.2f s", exc, delay)
        time.sleep(delay * (0.5 + random.random()))  # jitter, so waiting writers do not collide again
        delay = min(1.0, 2 * delay)


