"""The server store (gemmtune.store.server) against a real PostgreSQL server: the same entries,
validation and promises as the SQLite store; chosen by a URL; a server that cannot be reached
never breaks a call; other programs' tables left alone; a killed writer leaves nothing."""

import logging
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

import gemmtune
from gemmtune.errors import StoreError
from gemmtune.kernel_config import BACKEND, KernelConfig, kernel_key
from gemmtune.problem import Problem
from gemmtune.results import TuneResult
from gemmtune.store import ServerStore, Store, open_store
from gemmtune.store.server import redacted

from .test_sqlite import DEVICE, OTHER_DEVICE, key_for, make_result


def test_choices_and_trials_round_trip(postgres_url):
    with ServerStore(postgres_url) as store:
        result = make_result()
        store.put(result)
        store.put(make_result(key=key_for(7), device=OTHER_DEVICE))
        got = store.get(DEVICE, result.problem_key)
        assert (got.backend, got.config, got.time_ms, got.cublas_ms, got.rel_err) == (
            result.backend, result.config, result.time_ms, result.cublas_ms, result.rel_err)
        assert got.from_store and [t.status for t in store.trials(DEVICE, result.problem_key)] == [
            t.status for t in result.trials]
        assert store.devices() == sorted([DEVICE, OTHER_DEVICE]) and len(store.choices()) == 2
        assert [c.device for c in store.choices(OTHER_DEVICE)] == [OTHER_DEVICE]
        store.put(make_result(time_ms=0.01))  # an upsert: one choice, trials appended
        assert store.get(DEVICE, result.problem_key).time_ms == 0.01 and len(store.choices()) == 2
        assert len(store.trials(DEVICE, result.problem_key)) == 4
        assert store.size_bytes() > 0
        assert store.clear(OTHER_DEVICE) == 1 and store.devices() == [DEVICE]


def test_a_kernel_choice_and_a_gemm_choice_share_the_server(postgres_url):
    key = kernel_key("add", "0123456789abcdef", "fedcba9876543210", "100;torch.float32")
    kernel = TuneResult(key, DEVICE, BACKEND, KernelConfig(1, (("BLOCK", 32),)).as_dict(), 0.01, None, 0.5)
    with ServerStore(postgres_url) as store:
        store.put(kernel)
        store.put(make_result())
        assert store.get(DEVICE, key).config == kernel.config and len(store.choices()) == 2
        with pytest.raises(ValueError, match="goes with a kernel key"):
            store.put(TuneResult(key, DEVICE, "cublas", {}, 0.01, None, 0.5))


def test_export_from_the_server_and_import_into_sqlite_and_back(postgres_url, tmp_path):
    with ServerStore(postgres_url) as server:
        for m in (1, 2, 3):
            server.put(make_result(key=key_for(m)))
        assert server.export_json(tmp_path / "fleet.json") == 3
    local = Store(tmp_path / "local.sqlite")
    assert local.import_json(tmp_path / "fleet.json") == 3
    local.put(make_result(key=key_for(4)))
    local.export_json(tmp_path / "local.json")
    with ServerStore(postgres_url) as server:
        assert server.import_json(tmp_path / "local.json") == 4
        assert sorted(c.problem_key for c in server.choices()) == sorted(key_for(m) for m in (1, 2, 3, 4))


def test_a_url_chooses_the_server_everywhere(postgres_url, monkeypatch, tmp_path):
    assert isinstance(open_store(postgres_url), ServerStore)
    assert isinstance(open_store(tmp_path / "s.sqlite"), Store)
    monkeypatch.setenv("GEMMTUNE_STORE", postgres_url)
    assert isinstance(open_store(), ServerStore)


@pytest.mark.interpreter
def test_tuning_with_gemmtune_store_set_keeps_the_choice_on_the_server(postgres_url, monkeypatch, capsys):
    from gemmtune.cli import main

    monkeypatch.setenv("GEMMTUNE_STORE", postgres_url)
    problem = Problem(7, 40, 33, "float32", "nn")
    (result,) = gemmtune.tune([problem])
    with ServerStore(postgres_url) as server:
        assert server.get(result.device, problem.key()).backend == result.backend
    monkeypatch.delenv("GEMMTUNE_STORE")
    assert main(["cache", "--store", postgres_url, "list"]) == 0
    assert "1 choices" in capsys.readouterr().out


def test_a_server_that_cannot_be_reached_warns_once_and_keeps_nothing(postgres_server, caplog):
    folder, port, user = postgres_server
    url = f"postgresql://{user}:secret@/nowhere?host={folder}&port={port + 1}"
    with caplog.at_level(logging.WARNING, logger="gemmtune.store"):
        store = ServerStore(url)
        assert store.get(DEVICE, key_for(1)) is None
        store.put(make_result())
        assert store.choices() == []
    assert caplog.text.count("goes on without its tuning store") == 1
    assert "secret" not in caplog.text and ":***@" in store.path and store.failure
    with pytest.raises(StoreError, match="cannot be used") as raised:
        ServerStore(url, strict=True).choices()
    assert "secret" not in str(raised.value)


def test_other_programs_tables_are_left_alone_and_a_newer_schema_refused(postgres_url):
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE choices (id INTEGER, note TEXT)")
        conn.execute("INSERT INTO choices VALUES (1, 'theirs')")
    with ServerStore(postgres_url) as store:
        store.put(make_result())
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        assert conn.execute("SELECT * FROM choices").fetchall() == [(1, "theirs")]
        conn.execute("UPDATE gemmtune_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="newer gemmtune"):
        ServerStore(postgres_url, strict=True).choices()


def _put_and_hang(url: str) -> None:
    """Runs in a spawned process: the choice is written, then the trials' insert waits on the
    server, inside the transaction, until the process is killed."""
    sleep = "SELECT pg_sleep(60) FROM (VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)) AS v"
    ServerStore._insert_trial = lambda self: sleep
    ServerStore(url, strict=True).put(make_result())


def test_a_writer_killed_midway_leaves_nothing_half_written(postgres_url):
    import psycopg

    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_put_and_hang, args=(postgres_url,))
    child.start()
    deadline = time.monotonic() + 60
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        while time.monotonic() < deadline:  # until the child waits inside its transaction
            waiting = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%%'"
                                   " AND state = 'active'").fetchone()[0]
            if waiting:
                break
            time.sleep(0.1)
    assert waiting, "the writer never reached its transaction"
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=30)
    time.sleep(0.5)
    with ServerStore(postgres_url) as store:
        assert store.choices() == [] and store.trials(DEVICE, make_result().problem_key) == []


def test_redacted_hides_the_password_alone():
    assert redacted("postgresql://u:pw@db.example/tune") == "postgresql://u:***@db.example/tune"
    assert redacted("postgresql://u@db/tune?host=/tmp") == "postgresql://u@db/tune?host=/tmp"
    with pytest.raises(ValueError, match="postgresql://"):
        ServerStore(str(Path("/tmp/x.sqlite")))


def test_merging_stores_into_the_server_and_back_is_idempotent_and_newest_first(postgres_url, tmp_path, capsys):
    from gemmtune.cli import main
    from gemmtune.store import merge

    first, second = Store(tmp_path / "a.sqlite"), Store(tmp_path / "b.sqlite")
    first.put(make_result(key=key_for(1), time_ms=0.03))
    first.put(make_result(key=key_for(2)))
    time.sleep(1.1)  # the stamps are to the second
    second.put(make_result(key=key_for(1), time_ms=0.01))  # newer than first's
    with ServerStore(postgres_url) as server:
        assert merge([second, first], server) == (2, 1)  # first's key 1 is older than second's
        assert server.get(DEVICE, key_for(1)).time_ms == 0.01
        assert len(server.trials(DEVICE, key_for(1))) == 2  # the newest choice's trials, not both
        assert merge([first, second], server) == (0, 3)  # again: nothing copied
    assert main(["cache", "--store", str(tmp_path / "c.sqlite"), "merge", postgres_url]) == 0  # and back
    assert "2 choices copied" in capsys.readouterr().out
    back = Store(tmp_path / "c.sqlite")
    assert {c.problem_key: c.time_ms for c in back.choices()} == {key_for(1): 0.01, key_for(2): 0.015}
