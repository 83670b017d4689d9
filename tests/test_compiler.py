"""Compiling ahead: pool processes build and launch candidates (on the GPU where there is one,
under the interpreter otherwise, where a launch runs the kernel instead of compiling it), failures
come back typed, and the tuner plans what to compile and records compile failures without
building those candidates again."""

import time

import pytest
import torch

from gemmtune import compiler, search, tuner
from gemmtune.backends import get
from gemmtune.device import Device
from gemmtune.problem import Problem
from gemmtune.results import Status

H100 = Device("H100", (9, 0), 132, 232448, 50 << 20)
PROBLEM = Problem(7, 33, 65, "float32", "linear", bias=True)
TILED = [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 1, "num_stages": 1},
         {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2, "num_warps": 1, "num_stages": 1}]
INTERPRETER = not torch.cuda.is_available()  # conftest turns Triton's interpreter on only then


def test_compile_one_builds_and_launches(tmp_path):
    done = compiler.compile_one(PROBLEM, "triton_tiled", TILED[0], str(tmp_path), interpreter=INTERPRETER)
    assert done.status is Status.OK and done.reason == "" and done.seconds > 0


def test_compile_one_reports_a_failure_instead_of_raising(tmp_path):
    bad = dict(TILED[0], BLOCK_M=24)  # not a power of two: the config is refused
    done = compiler.compile_one(PROBLEM, "triton_tiled", bad, str(tmp_path), interpreter=INTERPRETER)
    assert done.status is not Status.OK and "BLOCK_M" in done.reason


def test_the_pool_compiles_every_candidate_in_its_processes(tmp_path):
    pool = compiler.CompilePool(workers=2)
    try:
        done = pool.compile(PROBLEM, [("triton_tiled", TILED[0]), ("triton_tiled", TILED[1]), ("cublas", {})],
                            str(tmp_path), interpreter=INTERPRETER)
        again = pool.compile(PROBLEM, [("triton_tiled", TILED[1]), ("triton_tiled", dict(TILED[1], GROUP_M=4))],
                             str(tmp_path), interpreter=INTERPRETER)
    finally:
        pool.close()
    assert sorted((d.backend, d.status) for d in done) == [
        ("cublas", Status.OK), ("triton_tiled", Status.OK), ("triton_tiled", Status.OK)]
    assert [d.config["GROUP_M"] for d in again] == [4]  # compiled once per process


def test_a_pool_of_no_processes_compiles_nothing(tmp_path):
    assert compiler.CompilePool(workers=0).compile(PROBLEM, [("triton_tiled", TILED[0])], str(tmp_path)) == []


def test_workers_follow_the_setting(monkeypatch):
    monkeypatch.setenv("GEMMTUNE_COMPILE_WORKERS", "3")
    assert compiler.CompilePool().workers == 3
    monkeypatch.setenv("GEMMTUNE_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="GEMMTUNE_COMPILE_WORKERS"):
        compiler.default_workers()


def test_plan_lists_what_a_fixed_order_strategy_measures():
    space = list(range(20))
    assert search.plan("topk", space, predict=lambda c: -c) == list(range(19, 19 - search.DEFAULT_TOPK, -1))
    assert search.plan("exhaustive", space, search.Budget(trials=5)) == [0, 1, 2, 3, 4]
    assert search.plan("random", space, seed=3) == list(search.run("random", space, float, seed=3))
    assert search.plan("descent", space, predict=float) == []
    ran = search.run("topk", space, lambda c: float(c), predict=lambda c: -c)
    assert list(ran) == search.plan("topk", space, predict=lambda c: -c)


class FakePool:
    workers = 4

    def __init__(self):
        self.asked = []

    def compile(self, problem, candidates, triton_cache_dir, interpreter=False):
        self.asked = list(candidates)
        name, config = candidates[-1]
        return [compiler.Compiled(name, config, Status.COMPILE_ERROR, "PTXASError: too many registers"),
                compiler.Compiled(*candidates[0], Status.LAUNCH_ERROR, "CUDA out of memory")]


class FakeRunner:
    triton_cache_dir = "/nonexistent"


def test_the_tuner_plans_every_backend_and_keeps_only_compile_failures(monkeypatch):
    pool = FakePool()
    monkeypatch.setattr(compiler, "shared_pool", lambda: pool)
    problem = Problem(64, 4096, 4096, "bfloat16")
    names = ["cublas", "triton_tiled", "triton_splitk"]
    spaces = {name: get(name).candidates(problem, H100) for name in names}
    failed = tuner._compile_ahead(problem, H100, tuner.TuneOptions(), spaces, FakeRunner())
    per_backend = {name: sum(n == name for n, _ in pool.asked) for name in names}
    assert per_backend["cublas"] == 1 and 1 <= per_backend["triton_tiled"] <= search.DEFAULT_TOPK
    assert 1 <= per_backend["triton_splitk"] <= search.DEFAULT_TOPK
    (key, trial), = failed.items()  # the launch error is left for the runner to meet
    assert trial.status is Status.COMPILE_ERROR and key == (trial.backend, trial.label())
    tiled = get(pool.asked[-1][0])
    assert tiled.parse_config(pool.asked[-1][1]).as_dict() == trial.config


def test_nothing_is_compiled_ahead_when_turned_off(monkeypatch):
    monkeypatch.setattr(compiler, "shared_pool", lambda: pytest.fail("the pool was started"))
    options = tuner.TuneOptions(compile_ahead=False)
    spaces = {"triton_tiled": get("triton_tiled").candidates(Problem(64, 4096, 4096), H100)}
    assert tuner._compile_ahead(Problem(64, 4096, 4096), H100, options, spaces, FakeRunner()) == {}


def test_idle_processes_are_shut_down(tmp_path, monkeypatch):
    monkeypatch.setattr(compiler, "IDLE_CLOSE_S", 0.2)
    pool = compiler.CompilePool(workers=1)
    try:
        assert [d.status for d in pool.compile(PROBLEM, [("cublas", {})], str(tmp_path), interpreter=INTERPRETER)] == [Status.OK]
        assert pool._executor is not None
        deadline = time.monotonic() + 10
        while pool._executor is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool._executor is None  # the CUDA contexts they held are given back
        again = pool.compile(PROBLEM, [("triton_tiled", TILED[0])], str(tmp_path), interpreter=INTERPRETER)
        assert [d.status for d in again] == [Status.OK]  # restarted on demand
    finally:
        pool.close()


RUNNER_AFTER_POOL = """
import json, os, sys
from gemmtune import compiler
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.runner import LocalRunner

configs = json.loads(sys.argv[1])
cache = os.environ["TRITON_CACHE_DIR"]
problem = Problem(300, 520, 264, "bfloat16", "linear", bias=True, activation="relu")
pool = compiler.CompilePool(workers=2)
done = pool.compile(problem, [("triton_tiled", c) for c in configs], cache)
pool.close()
before = sorted(os.listdir(cache))
runner = LocalRunner(current())
runner.start(problem, 0)
trials = [runner.evaluate("triton_tiled", c, 5.0) for c in configs]
print(json.dumps({"pool": [d.status.value for d in done], "runner": [t.status.value for t in trials],
                  "before": before, "after": sorted(os.listdir(cache))}))
"""


@pytest.mark.gpu
def test_the_runner_loads_what_the_pool_compiled(tmp_path):
    """A fresh process whose runner finds every kernel in the cache the pool filled: nothing new
    is written there, so nothing was compiled twice."""
    import json
    import os
    import subprocess
    import sys

    configs = [dict(TILED[1], num_warps=4, num_stages=3), dict(TILED[1], BLOCK_M=64, BLOCK_N=64, num_warps=4)]
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(compiler.__file__).rsplit("/gemmtune/", 1)[0],
                                                        os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", RUNNER_AFTER_POOL, json.dumps(configs)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["pool"] == ["ok", "ok"] and report["runner"] == ["ok", "ok"]
    assert len(report["before"]) >= 2 and report["after"] == report["before"]


def test_processes_started_in_the_background_serve_the_next_compile(tmp_path):
    pool = compiler.CompilePool(workers=2)
    try:
        pool.start_in_background()
        done = pool.compile(PROBLEM, [("triton_tiled", TILED[0])], str(tmp_path), interpreter=INTERPRETER)
        assert [d.status for d in done] == [Status.OK] and pool._executor is not None
        pool.start_in_background()  # already running: nothing happens
    finally:
        pool.close()
    assert pool._executor is None


def test_a_compile_past_the_time_limit_is_left_to_the_runner(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(compiler, "COMPILE_TIMEOUT_S", 0.01)
    pool = compiler.CompilePool(workers=1)
    try:
        done = pool.compile(PROBLEM, [("triton_tiled", TILED[0]), ("triton_tiled", TILED[1])], str(tmp_path),
                            interpreter=INTERPRETER)  # the pool's start alone takes longer than the limit
        assert len(done) < 2 and pool._executor is None and "the runner will build" in caplog.text
    finally:
        pool.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CUDA failure: asks for CUDA on a CPU-only build")
def test_processes_that_met_a_cuda_error_are_replaced(tmp_path):
    pool = compiler.CompilePool(workers=1)
    try:
        (done,) = pool.compile(PROBLEM, [("cublas", {})], str(tmp_path), interpreter=False)
        assert done.status is Status.LAUNCH_ERROR and "CUDA" in done.reason
        assert pool._executor is None  # the next compile starts fresh processes
    finally:
        pool.close()
