"""What both stores ask of their database, written once: the choices and trials read, written,
cleared, exported, imported and merged. A store class supplies its connection and failure
handling (``_run``), its table names, its placeholder and its upsert; queries are written with
``?`` and ``{choices}`` / ``{trials}``, made the store's own by ``_sql``."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gemmtune.results import Trial, TuneResult
from gemmtune.store.entries import (choice_row, entry_of_result, export_document, import_entries, is_label, now,
                                    result_of_row, trial_of_row, trial_row, validate_entry)
from gemmtune.version import __version__

log = logging.getLogger("gemmtune.store")
_WARNED: set = set()  # the stores (paths, URLs) whose failure this process has already logged
_WARNED_LOCK = threading.Lock()
REFUSE: Any = object()  # ``_run``'s ``empty`` when a failure must raise, whatever ``strict`` says
CHOICE_COLUMNS = "device, problem_key, backend, config_json, time_ms, cublas_ms, rel_err, tune_s, gpu_timings"
TRIAL_COLUMNS = "device, problem_key, backend, config_json, status, reason, samples_json, rel_err, created_at"


@dataclasses.dataclass(frozen=True)
class Record:
    """A stored choice with its trials, when it was made and by which gemmtune: what a merge
    copies from one store into another."""

    result: TuneResult
    created_at: str
    version: str | None


class Queries:
    """The stores' shared queries (see the module's docstring), and what both stores are besides:
    a context manager, and ``failure``, why a store stopped keeping results (None while it works)."""

    _failure: str | None = None
    _choices_table = "choices"
    _trials_table = "trials"
    _placeholder = "?"
    _upsert_choice = ""  # INSERT ... the choice's columns, gemmtune_version, created_at, replacing one there

    @property
    def failure(self) -> str | None:
        return self._failure

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def _run(self, work: Callable[[Any], Any], write: bool = False, empty: Any = REFUSE) -> Any:
        raise NotImplementedError

    def _many(self, conn, sql: str, rows: list[tuple]) -> None:
        if rows:
            conn.executemany(sql, rows)

    def _lock_problem(self, conn, device: str, problem_key: str) -> None:
        """Hold off other writers of this choice until the transaction ends (where the database's
        own write lock does not already)."""

    def _sql(self, text: str) -> str:
        return text.format(choices=self._choices_table, trials=self._trials_table).replace("?", self._placeholder)

    def get(self, device: str, problem_key: str) -> TuneResult | None:
        row = self._run(lambda c: c.execute(self._sql(
            f"SELECT {CHOICE_COLUMNS} FROM {{choices}} WHERE device = ? AND problem_key = ?"),
            (device, problem_key)).fetchone(), empty=None)
        return None if row is None else result_of_row(row)

    def put(self, result: TuneResult) -> None:
        """Upsert the choice and append every trial, in one transaction."""
        entry = _valid(result)
        stamp = now()
        choice = choice_row(entry, __version__, stamp)
        trials = [trial_row(result.device, result.problem_key, trial, stamp) for trial in result.trials]

        def write(conn) -> None:
            conn.execute(self._upsert_choice, choice)
            self._many(conn, self._insert_trial(), trials)

        self._run(write, write=True, empty=None)

    def choices(self, device: str | None = None) -> list[TuneResult]:
        return self._choices(device, empty=[])

    def trials(self, device: str, problem_key: str) -> list[Trial]:
        rows = self._run(lambda c: c.execute(self._sql(
            "SELECT backend, config_json, status, reason, samples_json, rel_err FROM {trials}"
            " WHERE device = ? AND problem_key = ? ORDER BY id"), (device, problem_key)).fetchall(), empty=[])
        return [t for t in map(trial_of_row, rows) if t is not None]

    def devices(self) -> list[str]:
        rows = self._run(lambda c: c.execute(self._sql(
            "SELECT DISTINCT device FROM {choices} ORDER BY device")).fetchall(), empty=[])
        return [row[0] for row in rows]

    def clear(self, device: str | None = None) -> int:
        """Remove the choices (and their trials) of one device, or of all; returns how many choices."""
        where, args = self._device_filter(device)

        def delete(conn) -> int:
            removed = conn.execute(self._sql(f"DELETE FROM {{choices}} {where}"), args).rowcount
            conn.execute(self._sql(f"DELETE FROM {{trials}} {where}"), args)
            return removed

        return self._run(delete, write=True, empty=0)

    def export_json(self, path: str | Path, device: str | None = None) -> int:
        return export_document(Path(path), self._choices(device, empty=REFUSE))

    def import_json(self, path: str | Path) -> int:
        """Upsert every choice of an export file, or none: any invalid entry refuses the file."""
        entries, version = import_entries(Path(path))
        stamp = now()
        rows = [choice_row(entry, version, stamp) for entry in entries]
        self._run(lambda c: self._many(c, self._upsert_choice, rows), write=True)
        return len(rows)

    def records(self, device: str | None = None) -> Iterator[Record]:
        """Every choice with its trials, made when and by which gemmtune (what ``merge`` copies).
        A failure raises StoreError: a merge that read nothing in silence would be a wrong answer."""
        where, args = self._device_filter(device)
        rows = self._run(lambda c: c.execute(self._sql(
            f"SELECT {CHOICE_COLUMNS}, created_at, gemmtune_version FROM {{choices}} {where}"
            " ORDER BY device, problem_key"), args).fetchall())
        for row in rows:
            result, created_at, version = result_of_row(row[:9]), row[9], row[10]
            if result is not None and is_label(created_at, 64):
                trials = tuple(self.trials(result.device, result.problem_key))
                yield Record(dataclasses.replace(result, trials=trials), created_at,
                             version if is_label(version, 64) else None)

    def put_record(self, record: Record) -> bool:
        """Write ``record`` as it was made, its trials in place of those stored, unless this store
        holds the choice as new or newer; whether it was written. One transaction."""
        result = record.result
        entry = _valid(result)
        choice = choice_row(entry, record.version, record.created_at)
        trials = [trial_row(result.device, result.problem_key, trial, record.created_at) for trial in result.trials]
        key = (result.device, result.problem_key)

        def write(conn) -> bool:
            self._lock_problem(conn, *key)
            held = conn.execute(self._sql(
                "SELECT created_at FROM {choices} WHERE device = ? AND problem_key = ?"), key).fetchone()
            if held is not None and held[0] >= record.created_at:
                return False
            conn.execute(self._upsert_choice, choice)
            conn.execute(self._sql("DELETE FROM {trials} WHERE device = ? AND problem_key = ?"), key)
            self._many(conn, self._insert_trial(), trials)
            return True

        return self._run(write, write=True)

    def _insert_trial(self) -> str:
        return self._sql(f"INSERT INTO {{trials}} ({TRIAL_COLUMNS}) VALUES ({', '.join('?' * 9)})")

    def _device_filter(self, device: str | None) -> tuple[str, tuple]:
        return ("", ()) if device is None else ("WHERE device = ?", (device,))

    def _choices(self, device: str | None, empty: Any) -> list[TuneResult]:
        where, args = self._device_filter(device)
        rows = self._run(lambda c: c.execute(self._sql(
            f"SELECT {CHOICE_COLUMNS} FROM {{choices}} {where} ORDER BY device, problem_key"), args).fetchall(),
            empty=empty)
        return [r for r in map(result_of_row, rows) if r is not None]


def warn_once(where: Any, failure: str, readable: bool = False) -> None:
    """One warning per store (its path or URL) in a process: a store that every miss reaches must
    not flood the log."""
    with _WARNED_LOCK:
        if where in _WARNED:
            return
        _WARNED.add(where)
    consequence = ("reads its tuning store but keeps nothing new in it" if readable
                   else "goes on without its tuning store, reading and keeping nothing")
    log.warning("gemmtune %s: %s", consequence, failure)


def schema_number(version: Any) -> int | None:
    """A stored schema version as gemmtune writes it (a whole number from 1), or None."""
    text = "" if version is None else str(version)
    return int(text) if text.isascii() and text.isdigit() and int(text) >= 1 else None


def _valid(result: TuneResult) -> dict:
    entry, problems = validate_entry(entry_of_result(result))
    if problems:
        raise ValueError(f"result for {result.problem_key!r} cannot be stored: {'; '.join(problems)}")
    return entry
