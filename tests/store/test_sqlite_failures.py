"""A store that cannot be used never breaks a library call; a file gemmtune did not make is never
written to. Real SQLite files on disk, no mocks: each case below is a store path as a user's
machine might have it."""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
import torch

import gemmtune
import gemmtune.store.sqlite
from gemmtune import backends
from gemmtune.cli import main
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, Trial, TuneResult
from gemmtune.serving.dispatch import Dispatcher, DispatchKey
from gemmtune.settings import STORE_FILENAME
from gemmtune.errors import StoreError
from gemmtune.store import APPLICATION_ID, Store
from gemmtune.tuning.tuner import TuneOptions

DEVICE = "nvidia-h100-80gb-hbm3-9.0-132-abc123def456"
PROBLEM = Problem(8, 16, 16, "float32", "nn")
KEY = PROBLEM.key()
# root writes through chmod: as root, "a path under a file" stands for a path that cannot be written
not_as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")


def make_result(key: str = KEY) -> TuneResult:
    trial = Trial("cublas", {}, Status.OK, Timing((0.01, 0.011)), 0.0)
    return TuneResult(problem_key=key, device=DEVICE, backend="cublas", config={}, time_ms=0.01, cublas_ms=0.01,
                      tune_s=0.1, rel_err=0.0, trials=(trial,))


def sqlite_file(path: Path, script: str) -> Path:
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(script)
    return path


def gemmtune_store(path: Path, schema_version: str | None = None) -> Path:
    """A store with one entry, its schema version then rewritten by hand where one is given."""
    with Store(path) as store:
        store.put(make_result())
    if schema_version is not None:
        sqlite_file(path, f"UPDATE meta SET value = '{schema_version}' WHERE key = 'schema_version'")
    return path


def read_only(path: Path, mode: int) -> Path:
    path.chmod(mode)
    return path


def directory_at_the_store_path(tmp: Path) -> Path:
    (tmp / STORE_FILENAME).mkdir()
    return tmp  # Store(tmp) is tmp / STORE_FILENAME: a directory


def path_under_a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("x")
    return tmp / "file" / "sub" / STORE_FILENAME


def read_only_directory(tmp: Path) -> Path:
    (tmp / "ro-dir").mkdir()
    return read_only(tmp / "ro-dir", 0o555)


# A store that cannot be read, each case tmp_path -> the path handed to Store (and to --cache).
# (A read-only store file can: see test_a_read_only_store_file_serves_what_it_holds.)
CASES: dict[str, Callable[[Path], Path]] = {
    "a directory at the store path": directory_at_the_store_path,
    "a path under a file": path_under_a_file,
    "other columns in choices": lambda tmp: sqlite_file(
        tmp / "menu.sqlite", "CREATE TABLE choices (dish TEXT, price REAL); INSERT INTO choices VALUES ('tea', 1.5);"),
    "another program's tables": lambda tmp: sqlite_file(
        tmp / "app.sqlite", "CREATE TABLE users (id INTEGER, name TEXT); INSERT INTO users VALUES (1, 'a');"),
    "another application_id": lambda tmp: sqlite_file(tmp / "other.sqlite", "PRAGMA application_id = 305419896;"),
    "schema_version 'abc'": lambda tmp: gemmtune_store(tmp / "abc.sqlite", "abc"),
    "schema_version 7 (newer)": lambda tmp: gemmtune_store(tmp / "newer.sqlite", "7"),
    "a read-only directory": read_only_directory,
}
CASE_IDS = list(CASES)
CASE_MAKERS = [pytest.param(make, marks=[not_as_root] if make is read_only_directory else [])
               for make in CASES.values()]


def contents(path: Path) -> bytes | None:
    """The bytes of the store's file, where it is one: what gemmtune must leave as it found it."""
    file = Store(path).path
    return file.read_bytes() if file.is_file() else None


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def assert_untouched(tmp_path: Path, path: Path, before: bytes | None) -> None:
    assert contents(path) == before
    assert not list(tmp_path.rglob("*.corrupt-*")), "a file that is not gemmtune's damaged store was moved aside"


# --- the library: one warning, then an empty store that keeps nothing -----------------------------


@pytest.mark.parametrize("make", CASE_MAKERS, ids=CASE_IDS)
def test_library_store_finds_nothing_keeps_nothing_and_warns_once(tmp_path, make, caplog) -> None:
    path = make(tmp_path)
    before = contents(path)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        store = Store(path)
        store.put(make_result())
        assert store.get(DEVICE, KEY) is None
        assert (store.choices(), store.trials(DEVICE, KEY), store.devices(), store.clear()) == ([], [], [], 0)
        assert Store(path).get(DEVICE, KEY) is None  # another Store of the same path: no second warning
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, warnings
    assert str(store.path) in warnings[0] and "GEMMTUNE_CACHE_DIR" in warnings[0] and "\n" not in warnings[0]
    assert store.failure is not None
    assert_untouched(tmp_path, path, before)


@pytest.mark.parametrize("make", CASE_MAKERS, ids=CASE_IDS)
def test_strict_store_raises_one_line_naming_the_file(tmp_path, make) -> None:
    path = make(tmp_path)
    before = contents(path)
    store = Store(path, strict=True)
    for call in (store.check, lambda: store.put(make_result()), lambda: Store(path).export_json(tmp_path / "out.json")):
        with pytest.raises(StoreError) as caught:
            call()
        assert str(store.path) in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out.json").exists()
    assert_untouched(tmp_path, path, before)


@pytest.mark.parametrize("make", CASE_MAKERS, ids=CASE_IDS)
def test_dispatcher_in_lookup_mode_serves_cublas(tmp_path, make, monkeypatch, caplog) -> None:
    monkeypatch.setenv("GEMMTUNE_MODE", "lookup")
    index = torch.cuda.current_device() if torch.cuda.is_available() else -1  # -1: a CPU tensor's get_device()
    key = DispatchKey.of(PROBLEM, index)
    assert key.problem() == PROBLEM
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        kernel = Dispatcher(Store(make(tmp_path))).kernel(key)
    assert kernel is backends.build(PROBLEM, backends.REFERENCE, {}, current(index))
    a, b = torch.randn(8, 16), torch.randn(16, 16)
    torch.testing.assert_close(kernel(a, b, None), a @ b)
    assert len(warnings_of(caplog)) == 1


@pytest.mark.parametrize("make", CASE_MAKERS, ids=CASE_IDS)
def test_tune_returns_its_result_unstored(tmp_path, make, caplog) -> None:
    path = make(tmp_path)
    before = contents(path)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        results = gemmtune.tune([PROBLEM], store=path, options=TuneOptions(backends=("cublas",)))
    assert len(results) == 1 and results[0].backend == "cublas" and not results[0].from_store
    assert len(warnings_of(caplog)) == 1
    assert_untouched(tmp_path, path, before)


# --- what is gemmtune's, and what is not ----------------------------------------------------------


def test_a_foreign_sqlite_file_gets_no_tables_and_stays_byte_for_byte(tmp_path) -> None:
    path = CASES["another program's tables"](tmp_path)
    before = path.read_bytes()
    Store(path).put(make_result())
    gemmtune.tune([PROBLEM], store=path, options=TuneOptions(backends=("cublas",)))
    assert path.read_bytes() == before
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("users",)]
        assert conn.execute("PRAGMA application_id").fetchone() == (0,)


def test_a_newer_gemmtunes_store_is_neither_read_nor_changed(tmp_path, caplog) -> None:
    path = CASES["schema_version 7 (newer)"](tmp_path)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        Store(path).put(make_result(key=Problem(9, 16, 16, "float32", "nn").key()))
        assert Store(path).get(DEVICE, KEY) is None
    assert "newer gemmtune" in warnings_of(caplog)[0]
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT value FROM meta").fetchall() == [("7",)]
        assert conn.execute("SELECT problem_key FROM choices").fetchall() == [(KEY,)]


def test_an_old_unmarked_store_keeps_its_entries_and_gets_marked(tmp_path, caplog) -> None:
    path = gemmtune_store(tmp_path / "old.sqlite")
    sqlite_file(path, "PRAGMA application_id = 0;")  # as every store was before the mark
    with caplog.at_level(logging.WARNING, logger="gemmtune"), Store(path) as store:
        assert store.get(DEVICE, KEY) is not None and len(store.trials(DEVICE, KEY)) == 1
        store.put(make_result(key=Problem(9, 16, 16, "float32", "nn").key()))
        assert len(store.choices()) == 2
    assert warnings_of(caplog) == []
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)


@pytest.mark.parametrize("empty_file", [False, True], ids=["no file", "an empty file"])
def test_a_new_store_is_marked(tmp_path, empty_file) -> None:
    path = tmp_path / "new.sqlite"
    if empty_file:
        path.touch()
    with Store(path) as store:
        store.put(make_result())
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)


# --- only writing fails: what the store holds is still served -------------------------------------


def test_a_lock_held_past_the_retries_drops_the_put_with_one_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(gemmtune.store.sqlite, "BUSY_TIMEOUT_S", 0.05)
    monkeypatch.setattr(gemmtune.store.sqlite, "RETRY_FOR_S", 0.3)
    path = gemmtune_store(tmp_path / "busy.sqlite")
    other_key = Problem(9, 16, 16, "float32", "nn").key()
    store = Store(path)
    with closing(sqlite3.connect(path, isolation_level=None)) as other, \
            caplog.at_level(logging.WARNING, logger="gemmtune"):
        other.execute("BEGIN IMMEDIATE")
        store.put(make_result(key=other_key))
        other.execute("ROLLBACK")
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "locked" in warnings[0] and str(path) in warnings[0]
    assert store.get(DEVICE, KEY) is not None and store.get(DEVICE, other_key) is None  # reading goes on


@not_as_root
def test_a_read_only_store_file_serves_what_it_holds(tmp_path, caplog, capsys) -> None:
    path = read_only(gemmtune_store(tmp_path / "ro.sqlite"), 0o444)
    before = path.read_bytes()
    other_key = Problem(9, 16, 16, "float32", "nn").key()
    store = Store(path)
    with caplog.at_level(logging.WARNING, logger="gemmtune"):
        store.put(make_result(key=other_key))
        assert store.get(DEVICE, KEY) is not None and store.get(DEVICE, other_key) is None
        assert Store(path).clear() == 0
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and str(path) in warnings[0] and "readonly" in warnings[0]
    for call in (Store(path).check, lambda: Store(path, strict=True).put(make_result())):
        with pytest.raises(StoreError, match=re.escape(str(path)) + ".*(readonly|cannot be written)"):
            call()
    assert path.read_bytes() == before
    code, out, _ = run(capsys, "cache", "--cache", str(path), "list")
    assert code == 0 and "1 choices" in out
    code, out, err = run(capsys, "cache", "--cache", str(path), "clear")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --- the CLI: one line naming the file, no traceback ----------------------------------------------


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("make", CASE_MAKERS, ids=CASE_IDS)
def test_cache_list_says_one_line_and_fails(tmp_path, make, capsys) -> None:
    path = make(tmp_path)
    code, out, err = run(capsys, "cache", "--cache", str(path), "list")
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and str(Store(path).path) in err and "Traceback" not in err


@pytest.mark.parametrize("action", [["list"], ["show", KEY, "--device", DEVICE], ["export", "EXPORT"],
                                    ["import", "IMPORT"], ["clear"]], ids=lambda a: a[0])
def test_every_cache_command_says_one_line_and_leaves_a_foreign_file(tmp_path, action, capsys) -> None:
    path = CASES["another program's tables"](tmp_path)
    before = path.read_bytes()
    (tmp_path / "in.json").write_text(json.dumps({"format": "gemmtune-store", "version": 1, "choices": []}))
    paths = {"EXPORT": str(tmp_path / "out.json"), "IMPORT": str(tmp_path / "in.json")}
    code, out, err = run(capsys, "cache", "--cache", str(path), *[paths.get(a, a) for a in action])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and str(path) in err and "Traceback" not in err
    assert path.read_bytes() == before and not (tmp_path / "out.json").exists()


def test_tune_says_one_line_before_tuning(tmp_path, capsys) -> None:
    path = CASES["another program's tables"](tmp_path)
    code, out, err = run(capsys, "tune", "--shape", "8x16x16", "--dtype", "float32", "--cache", str(path))
    assert code == 2 and out == "" and "Traceback" not in err
    assert len([line for line in err.splitlines() if str(path) in line]) == 1


def test_doctor_warns_about_the_store(tmp_path, capsys) -> None:
    path = CASES["another program's tables"](tmp_path)
    code, out, _ = run(capsys, "doctor", "--json", "--cache", str(path))
    store = next(check for check in json.loads(out) if check["name"] == "store")
    assert code == 0 and store["status"] == "warn" and str(path) in store["value"]
