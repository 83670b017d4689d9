"""Crash isolation: candidates that kill, hang or poison their process become failed Trials;
the worker is replaced and tuning goes on. The faulty runners below run inside the worker."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.results import Status
from gemmtune.tuning.runner import LocalRunner
from gemmtune.tuning.tuner import TuneOptions, tune_problem
from gemmtune.tuning import worker
from gemmtune.tuning.worker import IsolatedRunner

PROBLEM = Problem(16, 32, 64, "float32", "nn")
OPTIONS = TuneOptions(strategy="exhaustive", seed=5, backends=("cublas", "triton_tiled"))


def first_tiled_candidate(backend_name):
    """True once per test, in whichever worker evaluates the first tiled candidate: the GPU's
    search space differs from the interpreter's, so no config can be named in advance."""
    if backend_name != "triton_tiled":
        return False
    flag = os.environ["GEMMTUNE_TEST_FAULT_FLAG"]
    if os.path.exists(flag):
        return False
    open(flag, "w").close()
    return True


@pytest.fixture(autouse=True)
def _fault_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_TEST_FAULT_FLAG", str(tmp_path / "faulted"))


class DiesOnce(LocalRunner):
    def evaluate(self, backend_name, config, screen_budget_ms):
        if first_tiled_candidate(backend_name):
            os._exit(11)  # what a segfault or an illegal memory access looks like from outside
        return super().evaluate(backend_name, config, screen_budget_ms)


class HangsOnce(LocalRunner):
    def evaluate(self, backend_name, config, screen_budget_ms):
        if first_tiled_candidate(backend_name):
            time.sleep(600)
        return super().evaluate(backend_name, config, screen_budget_ms)


@pytest.mark.interpreter
def test_isolated_tuning_matches_the_flow_in_process():
    with IsolatedRunner(current()) as runner:
        result = tune_problem(PROBLEM, current(), options=OPTIONS, runner=runner)
    assert result.backend in ("cublas", "triton_tiled") and result.rel_err < 1e-4
    assert all(t.ok for t in result.trials) and runner.restarts == 0


@pytest.mark.interpreter
def test_a_crashing_candidate_is_a_failed_trial_and_tuning_goes_on():
    with IsolatedRunner(current(), runner_factory=DiesOnce) as runner:
        result = tune_problem(PROBLEM, current(), options=OPTIONS, runner=runner)
    crashed = [t for t in result.trials if not t.ok]
    assert len(crashed) == 1 and crashed[0].status is Status.LAUNCH_ERROR
    assert "exit code 11" in crashed[0].reason and runner.restarts == 1
    assert sum(t.ok for t in result.trials) >= 2  # cuBLAS and the other tiles still measured


@pytest.mark.interpreter
def test_a_hanging_candidate_times_out():
    with IsolatedRunner(current(), timeout_s=15, runner_factory=HangsOnce) as runner:
        result = tune_problem(PROBLEM, current(), options=OPTIONS, runner=runner)
    hung = [t for t in result.trials if not t.ok]
    assert len(hung) == 1 and hung[0].status is Status.TIMEOUT and runner.restarts == 1


@pytest.mark.gpu
def test_an_illegal_memory_access_is_contained():
    with IsolatedRunner(current(), runner_factory=FaultsOnSmallTiles) as runner:
        result = tune_problem(Problem(256, 512, 512), current(), options=TuneOptions(strategy="exhaustive", seed=6),
                              runner=runner)
    faulted = [t for t in result.trials if not t.ok]
    assert faulted and all(t.status is Status.LAUNCH_ERROR for t in faulted)
    assert runner.restarts >= 1 and sum(t.ok for t in result.trials) > 1
    torch.ones(1, device="cuda").add_(1).item()  # this process's context is untouched


class FaultsOnSmallTiles(LocalRunner):
    """On the GPU: a kernel that writes far outside any allocation, poisoning the context."""

    def evaluate(self, backend_name, config, screen_budget_ms):
        if backend_name == "triton_tiled" and config["BLOCK_M"] == 16:
            import triton
            import triton.language as tl

            @triton.jit
            def scribble(ptr):
                tl.store(ptr + (1 << 40), 1.0)

            scribble[(1,)](torch.empty(1, device="cuda"))
        return super().evaluate(backend_name, config, screen_budget_ms)


class RaisesOnTiles(LocalRunner):
    def evaluate(self, backend_name, config, screen_budget_ms):
        if backend_name == "triton_tiled":
            raise ValueError("a bug in the runner, not a crash")
        return super().evaluate(backend_name, config, screen_budget_ms)


def test_an_error_that_leaves_the_context_healthy_is_raised_not_hidden():
    """Only a crash (a dead or broken worker) becomes a failed trial; a bug surfaces."""
    with IsolatedRunner(current(), runner_factory=RaisesOnTiles) as runner:
        with pytest.raises(RuntimeError, match="a bug in the runner"):
            tune_problem(PROBLEM, current(), options=OPTIONS, runner=runner)


class DiesScreeningTogether(LocalRunner):
    def evaluate_many(self, backend_name, configs, screen_budget_ms):
        os._exit(11)


@pytest.mark.interpreter
@pytest.mark.parametrize("factory", [None, DiesScreeningTogether])
def test_a_library_backends_candidates_screened_in_the_worker(factory):
    """Side by side in the child; where that kills it, one at a time in a new one."""
    problem = Problem(5, 13, 33, "float32", "linear")
    configs = [{"align": 8}, {"align": 64}]
    with IsolatedRunner(current(), runner_factory=factory) as runner:
        runner.start(problem, 3)
        trials = runner.evaluate_many("cublas_padded", configs, 5.0)
    assert [t.config for t in trials] == configs and all(t.ok and t.timing is not None for t in trials)
    assert runner.restarts == (factory is not None)


# A fresh interpreter, as `gemmtune tune` is: the candidates' processes started early are forked
# before CUDA or Triton is loaded, which a pytest process cannot promise.
_EARLY_SCRIPT = """
import json, os, signal, sys, time
from pathlib import Path
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning import worker
from gemmtune.tuning.tuner import TuneOptions, tune_problem

worker.start_early([0, 1])
early = {index: process.pid for index, (process, _) in worker._early.items()}
if sys.argv[2] == "dead":
    os.kill(early[0], signal.SIGKILL)
    time.sleep(0.5)
left_over = worker._early[1][0]
options = TuneOptions(strategy="exhaustive", seed=5, backends=("cublas", "triton_tiled"))
with worker.IsolatedRunner(current()) as runner:
    result = tune_problem(Problem(16, 32, 64, "float32", "nn"), current(), options=options, runner=runner)
    adopted = runner._process.pid
unadopted = sorted(worker._early)
worker.discard_early()
Path(sys.argv[1]).write_text(json.dumps({
    "early": early[0], "adopted": adopted, "rel_err": result.rel_err, "ok": all(t.ok for t in result.trials),
    "unadopted": unadopted, "left_over_alive": left_over.is_alive(), "after_discard": len(worker._early)}))
"""


def _early_run(tmp_path, how: str) -> dict:
    out = tmp_path / "early.json"
    done = subprocess.run([sys.executable, "-c", _EARLY_SCRIPT, str(out), how], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.interpreter
def test_a_candidates_process_started_early_is_adopted_and_the_rest_discarded(tmp_path):
    row = _early_run(tmp_path, "alive")
    assert row["adopted"] == row["early"]  # the runner took the forked process rather than spawning
    assert row["ok"] and row["rel_err"] < 1e-4
    assert row["unadopted"] == [1] and not row["left_over_alive"] and row["after_discard"] == 0


@pytest.mark.interpreter
def test_a_candidates_process_dead_before_adoption_is_replaced(tmp_path):
    row = _early_run(tmp_path, "dead")
    assert row["adopted"] != row["early"]  # a spawned one took its place
    assert row["ok"] and row["rel_err"] < 1e-4


def test_nothing_starts_early_while_other_threads_run():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        worker.start_early([0])
        assert worker._early == {}
    finally:
        stop.set()
        thread.join()


class _Driver:
    def __init__(self, answer):
        self.answer = answer

    def cuCtxGetCurrent(self, pointer):  # noqa: N802 - the driver's name
        return self.answer


@pytest.mark.parametrize("answer, started", [(3, False), (0, True), (201, True)])
def test_a_started_cuda_driver_is_told_by_its_answer_before_cuinit(answer, started, monkeypatch):
    monkeypatch.setattr(worker.ctypes, "CDLL", lambda name: _Driver(answer))
    assert worker._driver_started() is started


def test_without_a_cuda_driver_forking_is_safe(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(worker.ctypes, "CDLL", missing)
    assert worker._driver_started() is False


@pytest.mark.gpu
def test_nothing_starts_early_once_this_process_has_started_cuda():
    torch.zeros(1, device="cuda")
    assert worker._driver_started()
    worker.start_early([0])
    assert worker._early == {}
