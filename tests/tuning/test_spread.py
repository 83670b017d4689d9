"""Tuning over several GPUs (gemmtune.tuning.spread, `gemmtune tune --gpus`): groups that keep a
lead with its followers, handed out costliest first, every result in one store, a group whose
candidates' process dies costing only that group, which the next free lane tunes, and a group that
keeps failing given up. CPU lanes here (Triton's interpreter); one per GPU on a GPU machine."""

import pytest

from gemmtune.problem import Problem
from gemmtune.store import Store
from gemmtune.tuning import spread
from gemmtune.tuning.tuner import TuneOptions

from .spread_faults import AlwaysDies, DiesOnce

pytestmark = pytest.mark.interpreter
OPTIONS = TuneOptions(backends=("cublas", "triton_tiled"))


def problems(*rows):
    return [Problem(m, 24, 40, "float32", "linear", True, False, act) for m, act in rows]


def test_groups_keep_a_lead_with_its_followers_in_order():
    relu, plain, other = problems((5, "relu"), (5, "none"), (6, "none"))
    assert spread.groups([relu, other, plain]) == [[relu, plain], [other]]


def test_groups_are_handed_out_costliest_first_ties_in_order():
    small, big, also_small = problems((3, "none"), (9, "none"), (3, "relu"))
    same = Problem(3, 24, 40, "float32", "linear", True, True, "none")  # another shape of equal cost
    assert spread.costliest_first([[small], [big], [same]]) == [[big], [small], [same]]
    assert spread.costliest_first([[same], [small, also_small], [big]]) == [[big], [small, also_small], [same]]


def test_two_lanes_tune_every_problem_into_one_store(tmp_path):
    location = str(tmp_path / "store.sqlite")
    wanted = problems((3, "none"), (3, "relu"), (4, "none"), (5, "gelu"))
    seen = []
    done = spread.tune(wanted, [None, None], location=location, options=OPTIONS, on_result=seen.append)
    assert sorted(done.results) == sorted(p.key() for p in wanted) and not done.given_up
    assert len(seen) == 4 and done.restarts == 0
    stored = Store(location).choices()
    assert sorted(r.problem_key for r in stored) == sorted(p.key() for p in wanted)
    follower = next(r for r in stored if r.problem_key == wanted[1].key())
    tried = {t.label() for t in follower.trials if t.backend != "cublas"}
    lead = {t.label() for t in done.results[wanted[0].key()].trials if t.backend != "cublas"}
    assert tried < lead  # the follower tried part of its lead's candidates: its shortlist


def test_a_group_whose_candidates_process_dies_costs_only_that_group_which_another_lane_tunes(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_SPREAD_FLAG", str(tmp_path / "died"))
    wanted = problems((6, "none"), (7, "none"), (7, "relu"), (8, "none"))
    done = spread.tune(wanted, [None, None], location=str(tmp_path / "s.sqlite"), options=OPTIONS,
                       runner_factory=DiesOnce)
    assert (tmp_path / "died").exists() and done.restarts == 1
    assert sorted(done.results) == sorted(p.key() for p in wanted) and not done.given_up


def test_a_group_that_keeps_failing_is_given_up_and_the_rest_tuned(tmp_path, caplog):
    wanted = problems((9, "none"), (10, "none"))
    done = spread.tune(wanted, [None, None], location=str(tmp_path / "s.sqlite"), options=OPTIONS,
                       runner_factory=AlwaysDies)
    assert [p.m for p in done.given_up] == [9] and list(done.results) == [wanted[1].key()]
    assert done.restarts == spread.ATTEMPTS and "given up" in caplog.text


def test_no_device_is_an_error():
    with pytest.raises(ValueError, match="gpus"):
        spread.tune(problems((3, "none")), [])


def test_the_tune_command_spreads_over_workers(tmp_path, capsys):
    from gemmtune.cli import main

    import torch

    store = tmp_path / "cli.sqlite"
    workers = str(torch.cuda.device_count() or 2)  # a GPU host accepts as many as it has
    argv = ["tune", "--gpus", workers, "--store", str(store), "--dtype", "float32",
            "--shape", "3x24x40", "--shape", "5x24x40"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3x24x40" in out and "5x24x40" in out and len(Store(store).choices()) == 2


def test_the_tune_command_refuses_gpus_with_in_process_naming_both(tmp_path, capsys):
    from gemmtune.cli import main

    argv = ["tune", "--gpus", "1", "--in-process", "--store", str(tmp_path / "s.sqlite"), "--shape", "3x24x40"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--gpus and --in-process: choose one" in err


@pytest.mark.parametrize("value, message", [("0", "accepted: all"), ("zero", "accepted: all"), ("0,1", "no GPU")])
def test_gpus_that_cannot_be_had_are_refused_naming_what_is_accepted(value, message):
    import torch

    from gemmtune.cli import gpus_of

    if torch.cuda.is_available():
        pytest.skip("the CPU's answers: a GPU host accepts indices")
    with pytest.raises(ValueError, match=message):
        gpus_of(value)
    assert gpus_of("all") == [None] and gpus_of("3") == [None] * 3


@pytest.mark.parametrize("gpus, in_process, ray, count, expected", [
    (None, False, None, 4, [0]), ("all", False, None, 4, [0, 1, 2, 3]), ("2", False, None, 4, [0, 1]),
    ("1,3", False, None, 4, [1, 3]), ("0,7", False, None, 4, []), ("8", False, None, 4, []),
    ("3", False, None, 0, [0]), (None, True, None, 4, []), (None, False, "local", 4, [])])
def test_the_tune_command_starts_early_the_candidates_processes_it_will_use(gpus, in_process, ray, count, expected,
                                                                           monkeypatch):
    import argparse

    import torch

    from gemmtune.cli import _early_indices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    args = argparse.Namespace(gpus=gpus, in_process=in_process, ray=ray)
    assert _early_indices(args) == expected
