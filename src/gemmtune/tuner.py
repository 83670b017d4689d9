"""The tuning flow for one problem: candidates -> build -> verify -> measure -> select -> store.

Selection never makes a user slower: cuBLAS stays unless a candidate beats it by more than the
noise measured in the same rounds (and by at least MIN_GAIN), judged on the time a user's call
really costs; for kernels of a few microseconds that includes the host's launch path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gemmtune import backends, bench, search, verify
from gemmtune.device import Device
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, Trial, TuneResult

log = logging.getLogger("gemmtune.tuner")

MIN_GAIN = 0.02  # a win smaller than this is not worth leaving cuBLAS for
HOST_BOUND_MS = 0.1  # below this a call's cost is checked with a back-to-back loop too
MIN_ROUNDS_FINAL = 20


@dataclass(frozen=True)
class TuneOptions:
    strategy: str = "topk"  # how each backend's space is searched (gemmtune.search.STRATEGIES)
    budget: search.Budget = search.Budget()  # per backend whose configs the cost model ranks
    finalists: int = 4  # candidates re-measured beside cuBLAS after screening
    screen_budget_ms: float = 40.0  # each candidate's own screening measurement
    final_budget_ms: float = 500.0
    backends: tuple[str, ...] | None = None  # None: every registered backend
    seed: int | None = None  # inputs' seed; None draws fresh random inputs

    def __post_init__(self) -> None:
        if self.strategy not in search.STRATEGIES:
            raise ValueError(f"TuneOptions.strategy {self.strategy!r} is not a strategy; accepted: "
                             f"{', '.join(search.STRATEGIES)}")


@dataclass
class _Candidate:
    backend: str
    config: dict
    kernel: Callable
    rel_err: float
    screen: Timing | None = None

    @property
    def label(self) -> str:
        return Trial(self.backend, self.config, Status.OK).label()


def tune_problem(problem: Problem, device: Device, *, options: TuneOptions = TuneOptions(),
                 on_trial: Callable[[Trial], None] | None = None) -> TuneResult:
    """Tune one problem on ``device`` and return the choice with every trial behind it."""
    started = time.perf_counter()
    inputs = verify.make_inputs(problem, "cpu" if device.interpreter else "cuda", seed=options.seed)
    failed: list[Trial] = []
    ready: list[_Candidate] = []

    def evaluate(backend_name: str, config) -> float | None:
        outcome = _build_and_verify(backend_name, config, problem, device, inputs)
        if isinstance(outcome, Trial):
            failed.append(outcome)
            _report(outcome, on_trial)
            return None
        timing = bench.measure({outcome.label: _bound(outcome.kernel, inputs)}, device,
                               budget_ms=options.screen_budget_ms, min_rounds=3)
        outcome.screen = timing[outcome.label]
        ready.append(outcome)
        _report(_ok_trial(outcome, outcome.screen), on_trial)
        return outcome.screen.median

    for name in options.backends or backends.names():
        _search_backend(name, problem, device, options, evaluate)
    reference = next((c for c in ready if c.backend == backends.REFERENCE), None)
    if reference is None:
        raise RuntimeError(f"the reference backend failed on {problem.describe()}: {failed[:1]}")

    run = {c.label: _bound(c.kernel, inputs) for c in ready}
    others = sorted((c for c in ready if c is not reference), key=lambda c: c.screen.median)
    finalists = [reference] + others[: options.finalists]
    final = bench.measure({c.label: run[c.label] for c in finalists}, device,
                          budget_ms=options.final_budget_ms, min_rounds=MIN_ROUNDS_FINAL)
    costs = {c.label: _cost(final[c.label], run[c.label], device) for c in finalists}
    chosen = select(reference, finalists, final, costs)
    trials = [_ok_trial(c, final.get(c.label) or c.screen) for c in ready] + failed
    return TuneResult(
        problem_key=problem.key(), device=device.fingerprint(), backend=chosen.backend,
        config=chosen.config, time_ms=costs[chosen.label], cublas_ms=costs[reference.label],
        tune_s=time.perf_counter() - started, rel_err=chosen.rel_err, trials=tuple(trials),
        gpu_timings=not device.interpreter,
    )


def _search_backend(name: str, problem: Problem, device: Device, options: TuneOptions, evaluate) -> None:
    """Measure the configs of one backend that its cost model and the strategy pick. Backends
    without a cost model (cuBLAS, the padded path: a config or two) are measured whole."""
    backend = backends.get(name)
    if not backend.is_available(device):
        return
    configs = backend.candidates(problem, device)
    if not configs:
        return
    if backend.predict_ms(problem, device, configs[0]) is None:
        for config in configs:
            evaluate(name, config)
        return
    search.run(options.strategy, configs, lambda config: evaluate(name, config), options.budget,
               predict=lambda config: backend.predict_ms(problem, device, config),
               neighbours=search.neighbours_by_fields(configs, lambda config: config.as_dict()),
               seed=options.seed or 0)


def select(reference: _Candidate, finalists: list[_Candidate], timings: dict[str, Timing],
           costs: dict[str, float]) -> _Candidate:
    """The fastest finalist if it beats the reference beyond the measured noise, else the reference."""
    best = min(finalists, key=lambda c: costs[c.label])
    if best is reference:
        return reference
    noise = timings[reference.label].spread + timings[best.label].spread
    if costs[best.label] < costs[reference.label] * (1.0 - max(MIN_GAIN, noise)):
        return best
    return reference


def _build_and_verify(backend_name: str, config, problem: Problem, device: Device, inputs):
    config_dict = config.as_dict()
    try:
        kernel = backends.get(backend_name).build(problem, config, device)
        err = verify.check(kernel, problem, inputs)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a typed Trial, never a crash
        status, reason = _classify(exc)
        return Trial(backend_name, config_dict, status, reason=reason)
    if not err <= verify.tolerance(problem):
        return Trial(backend_name, config_dict, Status.WRONG_RESULT, rel_err=err,
                     reason=f"rel_err {err:.3g} > tolerance {verify.tolerance(problem):.3g}")
    return _Candidate(backend_name, config_dict, kernel, err)


def _classify(exc: Exception) -> tuple[Status, str]:
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources, PTXASError
    except ImportError:
        return Status.LAUNCH_ERROR, reason
    if isinstance(exc, OutOfResources):
        return Status.OUT_OF_RESOURCES, reason
    if isinstance(exc, (CompilationError, PTXASError)):
        return Status.COMPILE_ERROR, reason
    return Status.LAUNCH_ERROR, reason


def _bound(kernel: Callable, inputs: verify.Inputs) -> Callable[[], object]:
    a, b, bias = inputs.a, inputs.b, inputs.bias
    return lambda: kernel(a, b, bias)


def _cost(timing: Timing, fn: Callable[[], object], device: Device) -> float:
    """What a call costs: the kernel's median, or the back-to-back wall time if that is larger."""
    if device.interpreter or timing.median >= HOST_BOUND_MS:
        return timing.median
    return max(timing.median, bench.host_loop_ms(fn, device))


def _ok_trial(candidate: _Candidate, timing: Timing) -> Trial:
    return Trial(candidate.backend, candidate.config, Status.OK, timing=timing, rel_err=candidate.rel_err)


def _report(trial: Trial, on_trial: Callable[[Trial], None] | None) -> None:
    if trial.ok:
        log.debug("%s ok %.4f ms (rel_err %.2e)", trial.label(), trial.median_ms, trial.rel_err)
    else:
        log.debug("%s %s: %s", trial.label(), trial.status.value, trial.reason)
    if on_trial is not None:
        on_trial(trial)
