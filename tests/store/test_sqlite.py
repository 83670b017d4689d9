"""The tuning store: round trips, validation of everything read back, corruption, concurrency."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import sqlite3
import threading
from contextlib import closing
from pathlib import Path

import pytest

import gemmtune.store.sqlite
from gemmtune.results import Status, Timing, Trial, TuneResult
from gemmtune.settings import STORE_FILENAME
from gemmtune.errors import StoreError
from gemmtune.store import SCHEMA_VERSION, Store

DEVICE = "nvidia-h100-80gb-hbm3-9.0-132-abc123def456"
OTHER_DEVICE = "nvidia-a100-sxm4-80gb-8.0-108-0123456789ab"
KEY = "v2/linear/bfloat16/1x6144x4096/bias=0/act=none"
CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
BAD_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 5}


def make_result(key: str = KEY, device: str = DEVICE, **changes) -> TuneResult:
    trials = (
        Trial("triton_tiled", dict(CONFIG), Status.OK, Timing((0.015, 0.0151, 0.0149)), 0.002),
        Trial("triton_tiled", dict(BAD_CONFIG), Status.WRONG_RESULT, Timing((0.012,)), 0.75,
              "max relative error 0.75 > tolerance 0.016"),
    )
    result = TuneResult(problem_key=key, device=device, backend="triton_tiled", config=dict(CONFIG),
                        time_ms=0.015, cublas_ms=0.022, tune_s=1.4, rel_err=0.002, trials=trials)
    return dataclasses.replace(result, **changes)


def key_for(m: int) -> str:
    return f"v2/nn/float16/{m}x256x512/bias=1/act=none"


def valid_entry(**changes) -> dict:
    entry = {"device": DEVICE, "problem": KEY, "backend": "triton_tiled", "config": dict(CONFIG),
             "time_ms": 0.015, "cublas_ms": 0.022, "rel_err": 0.002, "tune_s": 1.4, "gpu_timings": True}
    entry.update(changes)
    return entry


def write_export(path: Path, entries: list, **header) -> Path:
    document = {"format": "gemmtune-store", "version": 1, "gemmtune": "0.1.0", "choices": entries, **header}
    path.write_text(json.dumps(document))
    return path


@pytest.fixture
def store(tmp_path: Path):
    with Store(tmp_path / "store.sqlite") as opened:
        yield opened


# --- round trips ---------------------------------------------------------------------------------


def test_put_then_get_returns_every_field(store: Store) -> None:
    result = make_result()
    store.put(result)
    got = store.get(DEVICE, KEY)
    assert got == dataclasses.replace(result, trials=(), from_store=True)
    assert list(got.config) == list(CONFIG)  # key order kept, as the label shows it
    assert got.gpu_timings is True and got.from_store is True and got.trials == ()


def test_trials_keep_status_reason_samples_and_error(store: Store) -> None:
    result = make_result()
    store.put(result)
    trials = store.trials(DEVICE, KEY)
    assert trials == list(result.trials)
    assert [t.status for t in trials] == [Status.OK, Status.WRONG_RESULT]
    assert trials[1].reason.startswith("max relative error")
    assert trials[0].timing.samples == (0.015, 0.0151, 0.0149)


def test_trial_without_timing_round_trips(store: Store) -> None:
    failed = Trial("triton_tiled", dict(BAD_CONFIG), Status.OUT_OF_RESOURCES, reason="smem 262144 > 232448")
    store.put(make_result(trials=(failed,)))
    assert store.trials(DEVICE, KEY) == [failed]


def test_cublas_choice_without_optional_numbers_round_trips(store: Store) -> None:
    result = make_result(backend="cublas", config={}, cublas_ms=None, rel_err=None, gpu_timings=False, trials=())
    store.put(result)
    assert store.get(DEVICE, KEY) == dataclasses.replace(result, from_store=True)


def test_missing_key_is_none(store: Store) -> None:
    assert store.get(DEVICE, KEY) is None
    assert store.trials(DEVICE, KEY) == []


def test_put_twice_keeps_one_choice_and_every_trial(store: Store) -> None:
    store.put(make_result(time_ms=0.02))
    store.put(make_result(time_ms=0.015))
    assert [c.time_ms for c in store.choices()] == [0.015]
    assert len(store.trials(DEVICE, KEY)) == 4


def test_devices_are_separate(store: Store) -> None:
    store.put(make_result(device=DEVICE))
    assert store.get(OTHER_DEVICE, KEY) is None
    store.put(make_result(device=OTHER_DEVICE, time_ms=0.03))
    assert store.get(OTHER_DEVICE, KEY).time_ms == 0.03
    assert store.get(DEVICE, KEY).time_ms == 0.015
    assert store.devices() == sorted([DEVICE, OTHER_DEVICE])
    assert [c.device for c in store.choices(OTHER_DEVICE)] == [OTHER_DEVICE]


def test_choices_are_ordered_by_device_then_key(store: Store) -> None:
    for device, m in [(OTHER_DEVICE, 2), (DEVICE, 3), (OTHER_DEVICE, 1)]:
        store.put(make_result(key=key_for(m), device=device))
    assert [(c.device, c.problem_key) for c in store.choices()] == sorted(
        [(OTHER_DEVICE, key_for(2)), (DEVICE, key_for(3)), (OTHER_DEVICE, key_for(1))])


def test_put_refuses_an_invalid_config_and_stores_nothing(store: Store) -> None:
    with pytest.raises(ValueError, match="BLOCK_M"):
        store.put(make_result(config={**CONFIG, "BLOCK_M": 3}))
    assert store.choices() == [] and store.trials(DEVICE, KEY) == []


def test_clear_counts_choices_and_drops_their_trials(store: Store) -> None:
    store.put(make_result(key=key_for(1)))
    store.put(make_result(key=key_for(2)))
    store.put(make_result(device=OTHER_DEVICE))
    assert store.clear(DEVICE) == 2
    assert store.trials(DEVICE, key_for(1)) == []
    assert store.devices() == [OTHER_DEVICE]
    assert store.clear() == 1
    assert store.choices() == [] and store.clear() == 0


def test_threads_share_one_store(store: Store) -> None:
    def worker(t: int) -> None:
        for i in range(20):
            store.put(make_result(key=key_for(100 * t + i + 1)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store.choices()) == 80


def test_a_writer_waits_out_another_writers_lock(store: Store, monkeypatch, caplog) -> None:
    monkeypatch.setattr(gemmtune.store.sqlite, "BUSY_TIMEOUT_S", 0.05)  # shorter than the lock: our retries must wait
    store.put(make_result(key=key_for(1)))
    with closing(sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)) as other:
        other.execute("BEGIN IMMEDIATE")
        release = threading.Timer(0.5, other.execute, args=("COMMIT",))
        release.start()
        with caplog.at_level(logging.DEBUG, logger="gemmtune.store"):
            store.put(make_result(key=key_for(2)))
        release.join()
    assert len(store.choices()) == 2
    assert any("retrying" in r.getMessage() for r in caplog.records)


def _put_in_child(store: Store, queue) -> None:
    store.put(make_result(key=key_for(2)))
    queue.put(len(store.choices()))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_opens_its_own_connection(store: Store) -> None:
    store.put(make_result(key=key_for(1)))  # the parent's connection is open now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_put_in_child, args=(store, queue))
    child.start()
    assert queue.get(timeout=30) == 2
    child.join(timeout=30)
    assert child.exitcode == 0 and len(store.choices()) == 2


# --- paths, size, lifecycle ----------------------------------------------------------------------


def test_default_path_honours_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    with Store() as store:
        assert store.path == tmp_path / "cache" / STORE_FILENAME
        store.put(make_result())
    assert (tmp_path / "cache" / STORE_FILENAME).is_file()


def test_directory_path_gets_the_default_filename(tmp_path: Path) -> None:
    assert Store(tmp_path).path == tmp_path / STORE_FILENAME


def test_constructing_touches_no_file(tmp_path: Path) -> None:
    store = Store(tmp_path / "deep" / "store.sqlite")
    assert not (tmp_path / "deep").exists() and store.size_bytes() == 0
    store.put(make_result())
    assert store.size_bytes() > 0
    store.close()


def test_closed_store_reopens_on_use(store: Store) -> None:
    store.put(make_result())
    store.close()
    assert store.get(DEVICE, KEY) is not None


def test_newer_schema_is_refused_naming_both_versions(store: Store) -> None:
    store.put(make_result())
    store.close()
    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match=rf"'7'.*{SCHEMA_VERSION}"):
        Store(store.path, strict=True).get(DEVICE, KEY)


# --- export and import ---------------------------------------------------------------------------


def test_export_then_import_reproduces_the_choices(store: Store, tmp_path: Path) -> None:
    store.put(make_result(key=key_for(1)))
    store.put(make_result(key=key_for(2), cublas_ms=None, rel_err=None))
    store.put(make_result(device=OTHER_DEVICE))
    assert store.export_json(tmp_path / "all.json") == 3
    document = json.loads((tmp_path / "all.json").read_text())
    assert (document["format"], document["version"]) == ("gemmtune-store", 1)
    assert document["choices"][0]["config"] == CONFIG and "trials" not in document["choices"][0]
    with Store(tmp_path / "fresh.sqlite") as fresh:
        assert fresh.import_json(tmp_path / "all.json") == 3
        assert fresh.choices() == store.choices()
        assert fresh.trials(DEVICE, key_for(1)) == []
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_export_of_one_device(store: Store, tmp_path: Path) -> None:
    store.put(make_result())
    store.put(make_result(device=OTHER_DEVICE))
    assert store.export_json(tmp_path / "one.json", device=OTHER_DEVICE) == 1
    entries = json.loads((tmp_path / "one.json").read_text())["choices"]
    assert [e["device"] for e in entries] == [OTHER_DEVICE]


def test_import_upserts(store: Store, tmp_path: Path) -> None:
    store.put(make_result(time_ms=0.5))
    assert store.import_json(write_export(tmp_path / "in.json", [valid_entry(time_ms=0.25)])) == 1
    assert store.get(DEVICE, KEY).time_ms == 0.25
    assert len(store.trials(DEVICE, KEY)) == 2  # the evidence from tuning here stays


def test_import_accepts_integers_for_numbers(store: Store, tmp_path: Path) -> None:
    store.import_json(write_export(tmp_path / "in.json", [valid_entry(time_ms=1, tune_s=0, rel_err=0)]))
    got = store.get(DEVICE, KEY)
    assert (got.time_ms, got.tune_s, got.rel_err) == (1.0, 0.0, 0.0)


def _without(key: str) -> dict:
    entry = valid_entry()
    del entry[key]
    return entry


BAD_ENTRIES = {
    "unknown backend": (valid_entry(backend="evil"), "backend"),
    "backend not a str": (valid_entry(backend=["triton_tiled"]), "backend"),
    "config out of bounds": (valid_entry(config={**CONFIG, "BLOCK_M": 3}), "BLOCK_M"),
    "config missing key": (valid_entry(config={k: v for k, v in CONFIG.items() if k != "GROUP_M"}), "config"),
    "config extra key": (valid_entry(config={**CONFIG, "EVIL": 1}), "config"),
    "config not an object": (valid_entry(config="BLOCK_M=16"), "config"),
    "config with a float": (valid_entry(config={**CONFIG, "num_warps": 4.0}), "num_warps"),
    "cublas with a config": (valid_entry(backend="cublas", config={"BLOCK_M": 16}), "cublas"),
    "bool time": (valid_entry(time_ms=True), "time_ms"),
    "bool cublas time": (valid_entry(cublas_ms=False), "cublas_ms"),
    "number for gpu_timings": (valid_entry(gpu_timings=1), "gpu_timings"),
    "negative time": (valid_entry(time_ms=-0.5), "time_ms"),
    "zero time": (valid_entry(time_ms=0.0), "time_ms"),
    "NaN time": (valid_entry(time_ms=float("nan")), "time_ms"),
    "infinite tune time": (valid_entry(tune_s=float("inf")), "tune_s"),
    "negative rel_err": (valid_entry(rel_err=-1e-3), "rel_err"),
    "huge integer": (valid_entry(tune_s=10**400), "tune_s"),
    "time as a string": (valid_entry(time_ms="0.015"), "time_ms"),
    "null time": (valid_entry(time_ms=None), "time_ms"),
    "bad problem key": (valid_entry(problem="v2/linear/bfloat16/0x1x1/bias=0/act=none"), "problem"),
    "problem not a str": (valid_entry(problem=42), "problem"),
    "empty device": (valid_entry(device=""), "device"),
    "device with a newline": (valid_entry(device="gpu\nrm -rf /"), "device"),
    "device too long": (valid_entry(device="x" * 201), "device"),
    "missing field": (_without("rel_err"), "rel_err"),
    "extra field": (valid_entry(trials=[]), "trials"),
    "not an object": (["triton_tiled", CONFIG], "object"),
}


@pytest.mark.parametrize("entry, field", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_import_refuses_an_invalid_entry_and_imports_nothing(store: Store, tmp_path: Path, entry, field) -> None:
    path = write_export(tmp_path / "bad.json", [valid_entry(problem=key_for(1)), entry, valid_entry()])
    with pytest.raises(StoreError) as caught:
        store.import_json(path)
    message = str(caught.value)
    assert "entry 1:" in message and field in message
    assert "entry 0" not in message and "entry 2" not in message
    assert store.choices() == []


def test_import_lists_every_invalid_entry(store: Store, tmp_path: Path) -> None:
    entries = [valid_entry(time_ms=-1), valid_entry(problem=key_for(1)), valid_entry(backend="evil", tune_s=True)]
    with pytest.raises(StoreError) as caught:
        store.import_json(write_export(tmp_path / "bad.json", entries))
    message = str(caught.value)
    assert "entry 0: time_ms" in message and "entry 1" not in message
    assert "entry 2:" in message and "backend" in message and "tune_s" in message
    assert store.choices() == []


BAD_FILES = {
    "not JSON": (b"{'format': 'gemmtune-store'", "not a JSON file"),
    "pickle": (b"\x80\x04\x95\x1c\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x06format\x94\x8c\x0egemmtune-store\x94s.",
               "not a JSON file"),
    "empty": (b"", "not a JSON file"),
    "top level list": (b"[]", "format"),
    "wrong format tag": (b'{"format": "triton-cache", "version": 1, "choices": []}', "format"),
    "no format tag": (b'{"version": 1, "choices": []}', "format"),
    "newer version": (b'{"format": "gemmtune-store", "version": 2, "choices": []}', "version 2"),
    "bool version": (b'{"format": "gemmtune-store", "version": true, "choices": []}', "version"),
    "string version": (b'{"format": "gemmtune-store", "version": "1", "choices": []}', "version"),
    "choices not a list": (b'{"format": "gemmtune-store", "version": 1, "choices": {}}', "choices"),
}


@pytest.mark.parametrize("data, words", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_import_refuses_an_invalid_file(store: Store, tmp_path: Path, data: bytes, words: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(data)
    with pytest.raises(StoreError, match=words):
        store.import_json(path)
    assert store.choices() == []


# --- what was written by hand, or broken ---------------------------------------------------------


HAND_EDITS = {
    "config out of bounds": ("config_json", json.dumps({**CONFIG, "BLOCK_M": 3})),
    "config not JSON": ("config_json", "{BLOCK_M: 16"),
    "unknown backend": ("backend", "evil"),
    "negative time": ("time_ms", -1.0),
}


@pytest.mark.parametrize("column, value", HAND_EDITS.values(), ids=HAND_EDITS.keys())
def test_hand_edited_row_is_skipped_with_a_warning(store: Store, column: str, value, caplog) -> None:
    store.put(make_result())
    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute(f"UPDATE choices SET {column} = ?", (value,))
    with caplog.at_level(logging.WARNING, logger="gemmtune.store"):
        assert store.get(DEVICE, KEY) is None
        assert store.choices() == []
    assert any(KEY in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_garbage_file_is_moved_aside_and_replaced(tmp_path: Path, caplog) -> None:
    path = tmp_path / "store.sqlite"
    garbage = b"this is not a sqlite database\n" * 200
    path.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="gemmtune.store"), Store(path) as store:
        assert store.choices() == []
        store.put(make_result())
        assert store.get(DEVICE, KEY) is not None
    aside = list(tmp_path.glob("store.sqlite.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == garbage
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(path) in m and str(aside[0]) in m for m in messages)


def test_truncated_database_is_moved_aside(tmp_path: Path, caplog) -> None:
    path = tmp_path / "store.sqlite"
    with Store(path) as store:
        for m in range(1, 200):
            store.put(make_result(key=key_for(m)))
    data = path.read_bytes()
    path.write_bytes(data[:100] + b"\xff" * (len(data) - 100))  # a valid header over broken pages
    with caplog.at_level(logging.WARNING, logger="gemmtune.store"), Store(path) as store:
        assert store.choices() == []
    assert list(tmp_path.glob("store.sqlite.corrupt-*"))


# --- several processes at once --------------------------------------------------------------------

WORKERS = 4
PUTS_PER_WORKER = 50


def _write_many(path: str, worker: int, barrier) -> None:
    """Runs in a spawned process: wait for the others, then put as fast as possible."""
    store = Store(path)
    barrier.wait(timeout=60)
    for i in range(PUTS_PER_WORKER):
        store.put(make_result(key=key_for(worker * 1000 + i + 1), device=f"{DEVICE}-{worker % 2}"))
    store.close()


def test_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WORKERS)
    workers = [context.Process(target=_write_many, args=(str(path), w, barrier)) for w in range(WORKERS)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=120)
    assert [p.exitcode for p in workers] == [0] * WORKERS
    with Store(path) as store:
        choices = store.choices()
        assert len(choices) == WORKERS * PUTS_PER_WORKER
        trials = sum(len(store.trials(c.device, c.problem_key)) for c in choices)
    assert trials == WORKERS * PUTS_PER_WORKER * 2
