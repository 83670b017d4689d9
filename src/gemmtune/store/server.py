"""A server database as the store, for a fleet that shares its choices: PostgreSQL through
psycopg (``pip install "psycopg[binary]"``), the same entries and validation as the SQLite store
(``gemmtune.store.entries``), the same interface and the same promise: a store that cannot be
used warns once and keeps nothing, and never breaks a call (``strict`` raises instead).

Its tables carry gemmtune's prefix (``gemmtune_choices``, ``gemmtune_trials``, ``gemmtune_meta``)
so that a database shared with other programs keeps theirs untouched; gemmtune creates them on
first use (under an advisory lock: many workers may start together), refuses a schema version it
never wrote or a newer one, and reads or writes no other table. Entries are keyed by the device
fingerprint, so GPUs of every kind share one database. A choice is upserted with its trials in
one transaction: a writer killed midway leaves nothing half-written.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from gemmtune import settings
from gemmtune.errors import StoreError
from gemmtune.store.queries import CHOICE_COLUMNS, REFUSE, Queries, schema_number, warn_once

SCHEMES = ("postgresql", "postgres")
SCHEMA_VERSION = 1
LOCK_ID = 0x676D7475  # the advisory lock taken while the tables are made ("gmtu")
CONNECT_TIMEOUT_S = 10

log = logging.getLogger("gemmtune.store")
T = TypeVar("T")

_TABLES = (
    "CREATE TABLE IF NOT EXISTS gemmtune_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS gemmtune_choices (device TEXT NOT NULL, problem_key TEXT NOT NULL,"
    " backend TEXT NOT NULL, config_json TEXT NOT NULL, time_ms DOUBLE PRECISION NOT NULL,"
    " cublas_ms DOUBLE PRECISION, rel_err DOUBLE PRECISION, tune_s DOUBLE PRECISION NOT NULL,"
    " gpu_timings INTEGER NOT NULL, gemmtune_version TEXT, created_at TEXT NOT NULL,"
    " PRIMARY KEY (device, problem_key))",
    "CREATE TABLE IF NOT EXISTS gemmtune_trials (id BIGSERIAL PRIMARY KEY, device TEXT NOT NULL,"
    " problem_key TEXT NOT NULL, backend TEXT NOT NULL, config_json TEXT NOT NULL, status TEXT NOT NULL,"
    " reason TEXT NOT NULL, samples_json TEXT, rel_err DOUBLE PRECISION, created_at TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS gemmtune_trials_by_problem ON gemmtune_trials (device, problem_key)",
)


def is_url(location: Any) -> bool:
    """Whether ``location`` names a server (``postgresql://...``) rather than a file."""
    return isinstance(location, str) and urlsplit(location).scheme in SCHEMES


def redacted(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class ServerStore(Queries):
    """The store in a PostgreSQL database (see the module's docstring); what it reads and writes
    is ``Queries``'. The connection opens on first use and is the process's own: a process forked
    from one that used it opens another."""

    _choices_table, _trials_table, _placeholder = "gemmtune_choices", "gemmtune_trials", "%s"
    _upsert_choice = (f"INSERT INTO gemmtune_choices ({CHOICE_COLUMNS}, gemmtune_version, created_at) "
                      f"VALUES ({', '.join(['%s'] * 11)}) ON CONFLICT (device, problem_key) DO UPDATE SET "
                      + ", ".join(f"{c} = EXCLUDED.{c}" for c in ("backend", "config_json", "time_ms", "cublas_ms",
                                                                    "rel_err", "tune_s", "gpu_timings",
                                                                    "gemmtune_version", "created_at")))

    def __init__(self, url: str, strict: bool = False) -> None:
        if not is_url(url):
            raise ValueError(f"ServerStore(url=...): expected a postgresql:// URL, got {url!r}")
        self._url, self._strict = url, strict
        self._lock = threading.Lock()
        self._conn = None
        self._pid = os.getpid()
        self._failure: str | None = None

    @property
    def path(self) -> str:
        """Where the store is, as messages print it (the URL without its password)."""
        return redacted(self._url)

    def __repr__(self) -> str:
        return f"ServerStore({self.path!r})"

    def check(self) -> None:
        """Raise StoreError, naming the server and what to do, if the store cannot be written."""
        self._run(lambda conn: None, write=True)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    def size_bytes(self) -> int:
        row = self._run(lambda c: c.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c"
            " WHERE c.relname IN ('gemmtune_meta', 'gemmtune_choices', 'gemmtune_trials')").fetchone(), empty=(0,))
        return int(row[0])

    def _many(self, conn, sql: str, rows: list[tuple]) -> None:
        if rows:
            conn.cursor().executemany(sql, rows)

    def _lock_problem(self, conn, device: str, problem_key: str) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{device}\n{problem_key}",))

    def _run(self, work: Callable[[Any], T], write: bool = False, empty: Any = REFUSE) -> T:
        """``work`` on the connection, in a transaction. On a failure, what an empty store
        answers (``empty``) once the failure is logged, or StoreError where ``strict`` or the
        caller (no ``empty``) says so. A connection the server dropped is opened again once."""
        import psycopg

        with self._lock:
            if self._failure is None:
                for attempt in range(2):
                    try:
                        conn = self._connection()
                        with conn.transaction():
                            return work(conn)
                    except psycopg.OperationalError as exc:
                        self._drop()
                        if attempt:
                            self._fail(exc, empty)
                    except (psycopg.Error, OSError, StoreError) as exc:
                        self._drop()
                        self._fail(exc, empty)
                        break
            if empty is REFUSE:
                raise StoreError(self._failure)
            return empty

    def _fail(self, exc: BaseException, empty: Any) -> None:
        failure = str(exc) if isinstance(exc, StoreError) else (
            f"the store at {self.path} cannot be used ({str(exc).strip()}): check that the server runs and the "
            f"URL, user and password are right, or set {settings.STORE.env} (--store in the CLI) to another store")
        if self._strict or empty is REFUSE:
            raise StoreError(failure) from None
        self._failure = failure
        warn_once(self.path, failure)

    def _drop(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close: it is gone either way
                pass
        self._conn = None

    def _connection(self):
        if self._conn is not None and self._pid != os.getpid():
            self._conn = None  # the parent's: never used or closed here
        if self._conn is None:
            self._conn, self._pid = _open(self._url), os.getpid()
        return self._conn


def _open(url: str):
    import psycopg

    conn = psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                           application_name="gemmtune")
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_ID,))
            for statement in _TABLES:
                conn.execute(statement)
            conn.execute("INSERT INTO gemmtune_meta VALUES ('schema_version', %s) ON CONFLICT (key) DO NOTHING",
                         (str(SCHEMA_VERSION),))
            row = conn.execute("SELECT value FROM gemmtune_meta WHERE key = 'schema_version'").fetchone()
        _check_version(url, row[0] if row else None)
    except BaseException:
        conn.close()
        raise
    return conn


def _check_version(url: str, version: Any) -> None:
    number = schema_number(version)
    if number is None:
        raise StoreError(f"the store at {redacted(url)} has schema version {version!r}, which gemmtune never "
                         "wrote, so it leaves the database untouched")
    if number > SCHEMA_VERSION:
        raise StoreError(f"the store at {redacted(url)} was made by a newer gemmtune (schema version {number}; this one "
                         f"reads {SCHEMA_VERSION} at most): upgrade gemmtune")
