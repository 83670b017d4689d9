"""32 processes writing into one store at once lose nothing: the SQLite file and the server."""

import multiprocessing

import pytest

from gemmtune.store import open_store

from .test_sqlite import DEVICE, key_for, make_result

WRITERS = 32
PUTS = 8


def _write(location: str, writer: int, barrier) -> None:
    """Runs in a spawned process: wait for the others, then put as fast as it can."""
    store = open_store(location, strict=True)
    barrier.wait(timeout=120)
    for i in range(PUTS):
        store.put(make_result(key=key_for(writer * 1000 + i + 1), device=f"{DEVICE}-{writer % 4}"))
    store.close()


@pytest.mark.parametrize("kind", ["sqlite", "server"])
def test_32_writers_at_once_lose_no_entry(kind, tmp_path, request):
    location = str(tmp_path / "shared.sqlite") if kind == "sqlite" else request.getfixturevalue("postgres_url")
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WRITERS)
    writers = [context.Process(target=_write, args=(location, w, barrier)) for w in range(WRITERS)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=300)
    assert [p.exitcode for p in writers] == [0] * WRITERS
    with open_store(location, strict=True) as store:
        choices = store.choices()
        assert len(choices) == WRITERS * PUTS
        assert sum(len(store.trials(c.device, c.problem_key)) for c in choices) == WRITERS * PUTS * 2
