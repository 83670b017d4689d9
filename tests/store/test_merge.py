"""Merging stores (gemmtune.store.merge, `gemmtune cache merge`) between SQLite files: the newest
choice of each (device, problem) wins with its own trials, and merging again copies nothing."""

import time

from gemmtune.cli import main
from gemmtune.store import Store, merge

from .test_sqlite import DEVICE, OTHER_DEVICE, key_for, make_result


def test_the_newest_choice_wins_with_its_trials_and_a_second_merge_copies_nothing(tmp_path):
    old, new, into = (Store(tmp_path / f"{name}.sqlite") for name in ("old", "new", "into"))
    old.put(make_result(key=key_for(1), time_ms=0.05))
    old.put(make_result(key=key_for(2), device=OTHER_DEVICE))
    time.sleep(1.1)  # the stamps are to the second
    new.put(make_result(key=key_for(1), time_ms=0.01, trials=make_result().trials[:1]))
    assert merge([new, old], into) == (2, 1)
    assert merge([old, new], into) == (0, 3)
    assert into.get(DEVICE, key_for(1)).time_ms == 0.01 and len(into.trials(DEVICE, key_for(1))) == 1
    assert into.get(OTHER_DEVICE, key_for(2)) is not None
    assert [r.created_at for r in into.records(DEVICE)] == [r.created_at for r in new.records()]


def test_the_cache_merge_command_says_what_it_copied(tmp_path, capsys):
    source = Store(tmp_path / "source.sqlite")
    source.put(make_result(key=key_for(3)))
    argv = ["cache", "--store", str(tmp_path / "into.sqlite"), "merge", str(tmp_path / "source.sqlite")]
    assert main(argv) == 0 and "1 choices copied, 0 already there" in capsys.readouterr().out
    assert main(argv) == 0 and "0 choices copied, 1 already there" in capsys.readouterr().out
