"""Compiling ahead: threads of the runner's process build and launch candidates (on the GPU;
Triton's interpreter, which runs kernels instead of compiling them, gets nothing, and its tests
stand a recording kernel in), failures come back typed, a batch takes several problems at once,
and the tuner plans what to compile and records compile failures without building those
candidates again."""

import dataclasses
import sys
import threading

import pytest
import torch

from followers import measured_whole

from gemmtune import search
from gemmtune.backends import get
from gemmtune.device import Device, current
from gemmtune.problem import Problem
from gemmtune.results import Status
from gemmtune.tuning import compiler, tuner, verify
from gemmtune.tuning.runner import LocalRunner

H100 = Device("H100", (9, 0), 132, 232448, 50 << 20)
PROBLEM = Problem(7, 33, 65, "float32", "linear", bias=True)
TILED = [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "num_warps": 1, "num_stages": 1},
         {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2, "num_warps": 1, "num_stages": 1}]


def _operands(problem=PROBLEM):
    inputs = verify.make_inputs(problem, "cuda" if torch.cuda.is_available() else "cpu", seed=0)
    return inputs.a, inputs.b, inputs.bias


def test_every_candidate_is_built_and_launched_once_in_threads(monkeypatch):
    monkeypatch.setenv("GEMMTUNE_COMPILE_FORK", "0")  # on a GPU the stand-in would also run while capturing
    launched = []

    def build(problem, name, config, device):  # Triton's interpreter is not thread-safe: a stand-in kernel
        def kernel(a, b, bias):
            launched.append((threading.current_thread().name, config["GROUP_M"], a, bias, sys.getswitchinterval()))
        return kernel

    monkeypatch.setattr(compiler.backends, "build", build)
    configs = [TILED[0], TILED[1], dict(TILED[1], GROUP_M=4)]
    operands = _operands()
    before = sys.getswitchinterval()
    done = compiler.compile_ahead([(PROBLEM, "triton_tiled", c, operands) for c in configs], H100, workers=2,
                                  meanwhile=lambda: launched.append("meanwhile"))
    assert launched.pop(0) == "meanwhile"  # before any thread's launch
    # Triton's front ends hold the GIL: while compiling, a thread keeps it longer, then as before
    assert sys.getswitchinterval() == before
    assert all(interval == compiler.SWITCH_INTERVAL_S for *_, interval in launched)
    assert [d.config["GROUP_M"] for d in done] == [8, 2, 4]  # in the jobs' order
    assert all(d.status is Status.OK and d.reason == "" and d.seconds > 0 for d in done)
    assert sorted(g for _, g, *_ in launched) == [2, 4, 8]
    assert all(t.startswith("gemmtune-compile") and a is operands[0] and bias is operands[2]
               for t, _, a, bias, _ in launched)


def test_a_failure_comes_back_typed_instead_of_raising():
    bad = dict(TILED[0], BLOCK_M=24)  # not a power of two: the config is refused
    (done,) = compiler.compile_ahead([(PROBLEM, "triton_tiled", bad, _operands())], H100, workers=2)
    assert done.status is not Status.OK and "BLOCK_M" in done.reason


def test_nothing_is_compiled_without_threads_or_under_the_interpreter():
    cpu = Device("cpu", (0, 0), 1, 0, 0, interpreter=True)
    job = (PROBLEM, "triton_tiled", TILED[0], _operands())
    assert compiler.compile_ahead([job], H100, workers=0) == []
    assert compiler.compile_ahead([job], cpu, workers=2) == []


def test_a_result_survives_the_trip_from_a_worker_process():
    done = compiler.Compiled("triton_tiled", TILED[0], Status.COMPILE_ERROR, "PTXASError: registers", 0.5)
    assert compiler.Compiled.from_dict(done.to_dict()) == done


def test_workers_follow_the_setting(monkeypatch):
    monkeypatch.setenv("GEMMTUNE_COMPILE_WORKERS", "3")
    assert compiler.default_workers() == 3
    monkeypatch.setenv("GEMMTUNE_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="GEMMTUNE_COMPILE_WORKERS"):
        compiler.default_workers()


def test_the_runner_compiles_on_its_own_operands(monkeypatch):
    runner = LocalRunner(current())
    runner.start(PROBLEM, 3)
    asked = {}
    monkeypatch.setattr(compiler, "compile_ahead", lambda jobs, device: asked.update(jobs=jobs) or [])
    runner.compile([("triton_tiled", TILED[0])])
    ((problem, name, config, operands),) = asked["jobs"]
    assert problem == PROBLEM and (name, config) == ("triton_tiled", TILED[0])
    assert operands[0] is runner._inputs.a and operands[2] is runner._inputs.bias


def test_plan_lists_what_a_fixed_order_strategy_measures():
    space = list(range(20))
    assert search.plan("topk", space, predict=lambda c: -c) == list(range(19, 19 - search.DEFAULT_TOPK, -1))
    assert search.plan("exhaustive", space, search.Budget(trials=5)) == [0, 1, 2, 3, 4]
    assert search.plan("random", space, seed=3) == list(search.run("random", space, float, seed=3))
    assert search.plan("descent", space, predict=float) == []
    ran = search.run("topk", space, lambda c: float(c), predict=lambda c: -c)
    assert list(ran) == search.plan("topk", space, predict=lambda c: -c)


class FakeRunner:
    def __init__(self):
        self.asked = []

    def compile(self, candidates):
        self.asked = list(candidates)
        name, config = candidates[-1]
        return [compiler.Compiled(name, config, Status.COMPILE_ERROR, "PTXASError: too many registers"),
                compiler.Compiled(*candidates[0], Status.LAUNCH_ERROR, "CUDA out of memory")]


def test_the_tuner_plans_every_triton_backend_and_keeps_only_compile_failures():
    runner = FakeRunner()
    problem = Problem(64, 4096, 4096, "bfloat16")
    names = ["cublas", "triton_tiled", "triton_splitk"]
    spaces = {name: get(name).candidates(problem, H100) for name in names}
    failed = tuner._compile_ahead(problem, H100, tuner.TuneOptions(), spaces, runner)
    per_backend = {name: sum(n == name for n, _ in runner.asked) for name in names}
    assert per_backend["cublas"] == 0 and 1 <= per_backend["triton_tiled"] <= search.DEFAULT_TOPK
    assert 1 <= per_backend["triton_splitk"] <= search.DEFAULT_TOPK
    (key, trial), = failed.items()  # the launch error is left for the runner to meet
    assert trial.status is Status.COMPILE_ERROR and key == (trial.backend, trial.label())
    tiled = get(runner.asked[-1][0])
    assert tiled.parse_config(runner.asked[-1][1]).as_dict() == trial.config


def test_nothing_is_compiled_ahead_when_turned_off():
    options = tuner.TuneOptions(compile_ahead=False)
    spaces = {"triton_tiled": get("triton_tiled").candidates(Problem(64, 4096, 4096), H100)}
    runner = FakeRunner()
    assert tuner._compile_ahead(Problem(64, 4096, 4096), H100, options, spaces, runner) == {}
    assert runner.asked == []


@pytest.mark.gpu
def test_the_runner_finds_what_was_compiled_ahead(monkeypatch):
    """Evaluating a candidate compiled ahead compiles nothing: the threads' binaries are the
    runner's."""
    from triton.runtime.jit import JITFunction

    problem = Problem(300, 520, 264, "bfloat16", "linear", bias=True, activation="relu")
    configs = [dict(TILED[1], num_warps=4, num_stages=3), dict(TILED[1], BLOCK_M=64, BLOCK_N=64, num_warps=4)]
    runner = LocalRunner(current())
    runner.start(problem, 0)
    done = runner.compile([("triton_tiled", c) for c in configs])
    verify.warm_up(problem, *_operands(problem))  # verification's own kernels, compiled on their first use
    compiles = []
    real = JITFunction._do_compile
    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, *a, **k: compiles.append(a) or real(self, *a, **k))
    trials = [runner.evaluate("triton_tiled", c, 5.0) for c in configs]
    assert [d.status for d in done] == [Status.OK, Status.OK] and all(t.ok for t in trials)
    assert compiles == []


def test_a_batch_compiles_every_new_problem_together_and_sorts_failures_back(monkeypatch):
    first, second = Problem(64, 4096, 4096, "bfloat16"), Problem(256, 1024, 1024, "bfloat16", bias=True, activation="relu")
    monkeypatch.setattr(verify, "make_operands", lambda problem, device, seed: (problem,))
    batches, warmed = [], []

    def compile_ahead(jobs, device, meanwhile):
        batches.append(jobs)
        warmed.append(meanwhile)
        return [compiler.Compiled(name, config, Status.COMPILE_ERROR if i == len(jobs) - 1 else Status.OK)
                for i, (_, name, config, _) in enumerate(jobs)]

    monkeypatch.setattr(compiler, "compile_ahead", compile_ahead)
    monkeypatch.setattr(tuner, "_free_gpu_bytes", lambda: 1 << 40)
    failed = tuner.compile_batch([first, second], H100)
    (jobs,) = batches  # one batch for both
    checked = []  # while the children compile: verification's kernels loaded, once per kind of problem
    monkeypatch.setattr(verify, "warm_up", lambda problem, *operands: checked.append((problem, operands)))
    warmed[0]()
    assert checked == [(first, (first,)), (second, (second,))]
    assert {p for p, *_ in jobs} == {first, second} and all(ops == (p,) for p, _, _, ops in jobs)
    assert all(name != "cublas" for _, name, _, _ in jobs)
    assert failed[first.key()] == {}
    (key, trial), = failed[second.key()].items()
    assert jobs[-1][0] == second and trial.status is Status.COMPILE_ERROR and key == (trial.backend, trial.label())
    assert tuner.compile_batch([first], Device("cpu", (0, 0), 1, 0, 0, interpreter=True)) == {}
    assert tuner.compile_batch([first], H100, tuner.TuneOptions(compile_ahead=False)) == {}
    # a plan given for a problem (a follower's) is what it compiles; the others compile their own
    given = tuner.follower_plan(second, H100, tuner.TuneOptions())
    tuner.compile_batch([first, second], H100, plans={second.key(): given})
    jobs = batches[-1]
    assert [(name, config) for p, name, config, _ in jobs if p == second] == given
    assert [(name, config) for p, name, config, _ in jobs if p == first] == tuner._plan(first, H100, tuner.TuneOptions())


@pytest.mark.interpreter
def test_tune_hands_each_problem_its_part_of_the_batch(monkeypatch, tmp_path):
    from gemmtune import api

    problems = [Problem(7, 40, 100, "float32", "nn"), Problem(9, 40, 100, "float32", "nn")]
    gemmtune_tune = api.tune
    gemmtune_tune(problems[0], store=tmp_path)  # stored: not compiled again
    asked, handed = [], {}
    monkeypatch.setattr(tuner, "compile_batch", lambda new, device, options, plans: asked.append(new) or {
        p.key(): {"marker": p.key()} for p in new})
    real = tuner.tune_problem
    monkeypatch.setattr(tuner, "tune_problem", lambda problem, device, compiled=None, **kw: handed.update(
        {problem.key(): compiled}) or real(problem, device, **kw))
    gemmtune_tune(problems + [Problem(11, 40, 100, "float32", "nn")], store=tmp_path)
    assert [[p.m for p in new] for new in asked] == [[9, 11]]
    assert handed == {p.key(): {"marker": p.key()} for p in [problems[1], Problem(11, 40, 100, "float32", "nn")]}


def test_a_batch_takes_only_the_problems_whose_operands_fit(monkeypatch):
    small, large = Problem(16, 1024, 1024, "bfloat16"), Problem(8192, 8192, 8192, "bfloat16")
    monkeypatch.setattr(verify, "make_operands", lambda problem, device, seed: (problem,))
    monkeypatch.setattr(compiler, "compile_ahead", lambda jobs, device, meanwhile: [
        compiler.Compiled(name, config, Status.OK) for _, name, config, _ in jobs])
    monkeypatch.setattr(tuner, "_free_gpu_bytes", lambda: int(small.min_bytes / tuner.BATCH_MEMORY_SHARE) + 1)
    assert list(tuner.compile_batch([small, large, small], H100)) == [small.key()]  # large: compiled on its own


@pytest.mark.interpreter
def test_a_follower_compiles_its_leads_best_predicted_candidates_in_the_leads_batch(monkeypatch, tmp_path):
    """The seeds' MLP: one shape with bias + ReLU, then with bias alone. Which of the lead's
    candidates the second tries is known only after the lead is measured, so both compile in one
    batch: the second the lead's best-predicted few of each ranked backend, which it then tries
    in the order the lead measured them."""
    from gemmtune import api

    relu = Problem(256, 1024, 1024, "bfloat16", "linear", bias=True, activation="relu")
    plain = Problem(256, 1024, 1024, "bfloat16", "linear", bias=True)
    options = tuner.TuneOptions()
    for m in (1, 16, 256):
        lead, follower = (dataclasses.replace(p, m=m) for p in (relu, plain))
        planned = tuner._plan(lead, H100, options)
        trimmed = tuner.follower_plan(follower, H100, options)
        assert trimmed and set(tuner.labels(trimmed)) <= set(tuner.labels(planned)) and len(trimmed) < len(planned)
        for name in {name for name, _ in planned}:
            ours = [config for n, config in trimmed if n == name]
            assert ours == [config for n, config in planned if n == name][:len(ours)]  # each backend's first
            assert len(ours) == min(tuner.SHORTLIST, sum(n == name for n, _ in planned)) or name == "cublas_padded"
    asked, handed = [], {}
    small = [Problem(33, 40, 72, "float32", "linear", bias=True, activation="relu"),
             Problem(33, 40, 72, "float32", "linear", bias=True)]
    monkeypatch.setattr(tuner, "compile_batch", lambda new, device, options, plans: asked.append(
        (new, plans)) or {p.key(): {} for p in new})
    real = tuner.tune_problem
    monkeypatch.setattr(tuner, "tune_problem", lambda problem, device, options, **kw: handed.update(
        {problem.key(): options.shortlist}) or real(problem, device, options=options, **kw))
    first, second = api.tune(small, store=tmp_path)
    trimmed = tuner.follower_plan(small[1], current(), tuner.TuneOptions())
    assert asked == [(small, {small[1].key(): trimmed})]
    compiled = tuner.labels(trimmed)
    assert handed[small[0].key()] is None
    assert handed[small[1].key()] == tuner.shortlist(first, among=compiled)
    assert {t.label() for t in second.trials} <= compiled | measured_whole(small[1], current())


def test_concurrent_batches_restore_the_switch_interval_when_the_last_ends():
    """Two threads tuning at once: the first batch to end leaves the long interval to the other,
    the last one restores what was set before either began."""
    before = sys.getswitchinterval()
    inner_started, release = threading.Event(), threading.Event()
    seen = []

    def inner():
        with compiler._long_switch_interval():
            inner_started.set()
            release.wait(10)

    with compiler._long_switch_interval():
        worker = threading.Thread(target=inner)
        worker.start()
        inner_started.wait(10)
    seen.append(sys.getswitchinterval())  # the outer one ended first
    release.set()
    worker.join(10)
    assert seen == [compiler.SWITCH_INTERVAL_S] and sys.getswitchinterval() == before


def test_warming_up_runs_the_reference_and_error_measure_of_each_kind():
    for dtype in ("bfloat16", "float16", "float32"):
        problem = Problem(7, 33, 65, dtype, "linear", bias=True, activation="gelu")
        assert verify.warm_up(problem, *verify.make_operands(problem, "cpu", seed=1)) is None


def test_a_kernel_of_its_own_jit_is_not_run_to_capture_triton_compiles(monkeypatch):
    """CuTe DSL's kernels compile without Triton: capturing would compile each here, one after
    another, before the threads start; the backend compiles them together instead (its worker
    processes, ``compile_together``)."""
    from types import SimpleNamespace

    from gemmtune import backends

    monkeypatch.setattr(backends, "build", lambda *args: pytest.fail("built to capture a CuTe DSL kernel"))
    on_gpu = (SimpleNamespace(is_cuda=True), None, None)
    assert compiler._capture((Problem(512, 768, 768), "cute", {}, on_gpu), H100) == []


class _Together:
    """A backend of its own JIT (as CuTe DSL) whose ``compile_together`` makes every first call
    it is given, and records when."""

    def __init__(self, events, fail=False):
        self.events, self.fail = events, fail

    def compile_together(self, calls, workers):
        self.events.append(("together", len(calls), workers))
        if self.fail:
            raise ImportError("no compile pool in this QuACK")
        for call in calls:
            call()


@pytest.mark.parametrize("fail", [False, True])
def test_candidates_of_its_own_jit_are_compiled_together_before_each_first_call(monkeypatch, fail):
    monkeypatch.setenv("GEMMTUNE_COMPILE_FORK", "0")
    events = []

    def build(problem, name, config, device):
        return lambda a, b, bias: events.append((name, config["n"]))

    monkeypatch.setattr(compiler.backends, "build", build)
    monkeypatch.setattr(compiler.backends, "get", lambda name: _Together(events, fail))
    operands = _operands()
    jobs = [(PROBLEM, "cute", {"n": 1}, operands), (PROBLEM, "triton_tiled", {"n": 2}, operands),
            (PROBLEM, "cute", {"n": 3}, operands)]
    done = compiler.compile_ahead(jobs, H100, workers=3)
    assert [d.backend for d in done] == ["cute", "triton_tiled", "cute"]
    assert all(d.status is Status.OK for d in done)
    assert ("together", 2, 3) in events  # the cute jobs alone, with the compile workers
    together = events.index(("together", 2, 3))
    # each cute job's own first call comes after they were made together (where that worked)
    own_calls = [i for i, event in enumerate(events) if event[0] == "cute"]
    assert len(own_calls) == (2 if fail else 4) and all(i > together for i in own_calls)
    assert events.count(("triton_tiled", 2)) == 1
