"""Tuning across a Ray cluster (gemmtune.tuning.cluster, `gemmtune tune --ray`), on a local Ray
instance with CPU-only workers (Triton's interpreter): an actor per CPU, each tuning group after
group with one runner, every result in one store, a group whose actor dies tuned again by another,
a group that keeps failing given up."""

import os
import sys

import pytest

from gemmtune.store import Store
from gemmtune.tuning import cluster

from .spread_faults import AlwaysDies, CountsRunners, DiesOnce
from .test_spread import OPTIONS, problems

ray = pytest.importorskip("ray", reason="tuning on a cluster needs ray (pip install ray)")
pytestmark = pytest.mark.interpreter


@pytest.fixture
def local_ray(tmp_path):
    """A local Ray instance whose workers import what this test imports and see its flag file."""
    flag = str(tmp_path / "died")
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "GEMMTUNE_SPREAD_FLAG": flag,
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")}
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        yield flag
    finally:
        ray.shutdown()


def test_every_group_tuned_by_a_task_into_one_store(local_ray, tmp_path):
    location = str(tmp_path / "store.sqlite")
    wanted = problems((3, "none"), (3, "relu"), (4, "none"))
    seen = []
    done = cluster.tune(wanted, location=location, options=OPTIONS, isolate=False, on_result=seen.append)
    assert sorted(done.results) == sorted(p.key() for p in wanted) and len(seen) == 3 and not done.given_up
    assert sorted(r.problem_key for r in Store(location).choices()) == sorted(p.key() for p in wanted)
    assert ray.is_initialized()  # the caller's instance is left running


def test_each_actor_keeps_its_runner_for_every_group_it_is_handed(local_ray, tmp_path):
    wanted = problems(*((m, "none") for m in (3, 4, 5, 6, 11)))
    done = cluster.tune(wanted, location=str(tmp_path / "store.sqlite"), options=OPTIONS, runner_factory=CountsRunners)
    assert sorted(done.results) == sorted(p.key() for p in wanted) and not done.given_up
    assert len(os.listdir(local_ray + ".runners")) == 2  # two CPUs: two actors, not a runner per group


def test_a_group_whose_actor_dies_is_tuned_again_and_one_that_keeps_dying_given_up(local_ray, tmp_path):
    location = str(tmp_path / "store.sqlite")
    done = cluster.tune(problems((7, "none"), (8, "none")), location=location, options=OPTIONS,
                        runner_factory=DiesOnce)
    assert os.path.exists(local_ray) and len(done.results) == 2 and not done.given_up
    done = cluster.tune(problems((9, "none"), (10, "none")), location=location, options=OPTIONS,
                        runner_factory=AlwaysDies)
    assert [p.m for p in done.given_up] == [9] and len(done.results) == 1
