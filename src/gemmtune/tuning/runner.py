"""Where candidates run: build, verify and time the candidates of one problem in this process.

The tuner talks to a runner only through the ``Runner`` Protocol (``start``, ``compile``,
``evaluate``, ``evaluate_many``, ``final``) with plain data (backend names, config dicts,
Trials), so the same flow runs here (``LocalRunner``) or, through ``gemmtune.tuning.worker``'s
``IsolatedRunner``, in a child process that a crashing candidate cannot take down with it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

from gemmtune import backends
from gemmtune.backends.launch import front_entry
from gemmtune.device import Device
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, Trial
from gemmtune.tuning import compiler, measure, verify
from gemmtune.tuning.compiler import Compiled, classify

log = logging.getLogger("gemmtune.tuning.runner")

HOST_BOUND_MS = 0.1  # below this a call's cost is checked with a back-to-back loop too
HOST_LOOP_MS = 0.5  # the GPU time one such loop aims at (between 10 and 50 calls)
# A candidate whose first two rounds are both this much slower than the best so far is not
# screened further: it cannot become a finalist, and full screening would cost most of the time.
ABORT_FACTOR = 1.5
GROUP_BUDGET = 2  # screening budgets that a library backend's candidates share (evaluate_many)
FINAL_SESSIONS = 4  # blocks of the final rounds, each on graphs captured anew (measure.measure)
SECOND_SEED = 0x9E3779B9  # the second input set's seed, from the first's


def float32_precision(problem: Problem) -> str:
    """The torch float32 matmul precision under which cuBLAS computes ``problem`` as keyed."""
    return "high" if problem.tf32 else "highest"


@contextlib.contextmanager
def matmul_precision(problem: Problem) -> Iterator[None]:
    """cuBLAS's float32 precision set to the problem's for a while: the reference candidate must
    run as the problem is keyed (TF32 or not), whatever the caller's global setting."""
    import torch

    if problem.dtype != "float32":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(float32_precision(problem))
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@runtime_checkable
class Runner(Protocol):
    """What the tuner asks of wherever the candidates of one problem run, one problem at a time."""

    def start(self, problem: Problem, seed: int) -> None:
        """Begin ``problem``: its inputs drawn from ``seed``, nothing of the last problem kept."""
        ...

    def compile(self, candidates: list[tuple[str, dict]]) -> list[Compiled]:
        """Each (backend name, config dict) compiled ahead, in parallel where the runner runs."""
        ...

    def evaluate(self, backend_name: str, config: dict, screen_budget_ms: float) -> Trial:
        """One candidate built, verified and screened; a failure is a Trial with its reason."""
        ...

    def evaluate_many(self, backend_name: str, configs: list[dict], screen_budget_ms: float) -> list[Trial]:
        """A library backend's configs, screened side by side; one Trial each, in order."""
        ...

    def final(self, candidates: list[tuple[str, dict]], budget_ms: float,
              min_rounds: int) -> dict[str, tuple[Timing, Timing, Timing | None, str]]:
        """The finalists timed side by side: label -> (timing, a user's call's cost, the host's
        time per call or None, why its check after the timing failed or "")."""
        ...


class LocalRunner:
    """The ``Runner`` in this process."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._problem: Problem | None = None
        self._inputs: verify.Inputs | None = None  # what candidates are timed on, and checked first
        self._second: verify.Inputs | None = None  # independent: checked too, and after the timing
        self._ready: dict[str, tuple[Callable, float]] = {}  # label -> (kernel, rel_err)
        self._reference: str | None = None  # cuBLAS's label once it passed verification
        self._reference_tried = False
        self._best_ratio = float("inf")

    def start(self, problem: Problem, seed: int) -> None:
        """Two sets of fresh random inputs and their float64 references for ``problem``."""
        self._problem = problem
        where = "cpu" if self.device.interpreter else "cuda"
        self._inputs = verify.make_inputs(problem, where, seed=seed)
        self._second = verify.make_inputs(problem, where, seed=(seed + SECOND_SEED) % 2 ** 32)
        self._ready = {}
        self._reference, self._reference_tried = None, False
        self._best_ratio = float("inf")

    def compile(self, candidates: list[tuple[str, dict]]) -> list[Compiled]:
        """Each candidate compiled ahead on this problem's operands, in parallel threads."""
        operands = self._inputs.operands
        return compiler.compile_ahead([(self._problem, name, config, operands) for name, config in candidates],
                                      self.device)

    def evaluate(self, backend_name: str, config: dict, screen_budget_ms: float) -> Trial:
        """Build, verify and screen one candidate, beside cuBLAS in the same rounds; a failure is
        a Trial with its typed reason."""
        trial = self._build_and_verify(backend_name, config)
        if not trial.ok:
            return trial
        label, best = trial.label(), self._best_ratio
        # after two rounds, a candidate far slower than the best so far in both is not screened
        # further (its faster round decides: a round's host stall inflates one sample, docs/tuning-time.md)
        return self._screen([trial], screen_budget_ms,
                            stop=lambda rounds: rounds[label] >= ABORT_FACTOR * best)[0]

    def evaluate_many(self, backend_name: str, configs: list[dict], screen_budget_ms: float) -> list[Trial]:
        """Build and verify each config of one library backend, then screen the verified ones
        side by side in one measurement of GROUP_BUDGET screening budgets: they compile nothing,
        so a separate measurement each would be mostly its fixed cost (a graph capture, warm-up
        and synchronizations: about 4 ms a cuBLASLt candidate on the H200, docs/tuning-time.md)."""
        trials = [self._build_and_verify(backend_name, config) for config in configs]
        screened = iter(self._screen([t for t in trials if t.ok], GROUP_BUDGET * screen_budget_ms))
        return [next(screened) if t.ok else t for t in trials]

    def _screen(self, trials: list[Trial], budget_ms: float, stop=None) -> list[Trial]:
        """The verified ``trials`` timed in one measurement, with cuBLAS in the same rounds where it
        passed verification: each Trial gets its ratio to cuBLAS (``vs_reference``), which
        drift between measurements does not move (on an H100, cuBLAS alone timed 0.113 ms in one
        measurement and 0.092 ms in the next). ``stop(ratios)`` ends it after two rounds: it is
        given each candidate's ratio in its faster round (``_best_round``)."""
        labels = [t.label() for t in trials]
        reference = self._reference_label()
        fns = {label: self._bound(label) for label in labels}
        if reference is not None:
            fns.setdefault(reference, self._bound(reference))

        def ratios(timings: dict[str, Timing]) -> dict[str, float]:
            return {label: _ratio(timings[label], timings.get(reference)) for label in labels}

        def best_rounds(timings: dict[str, Timing]) -> dict[str, float]:
            return {label: _best_round(timings[label], timings.get(reference)) for label in labels}

        timings = measure.measure(fns, self.device, budget_ms=budget_ms, min_rounds=3,
                                stop=None if stop is None else lambda timings: stop(best_rounds(timings)))
        found = ratios(timings)
        self._best_ratio = min([self._best_ratio, *found.values()])
        return [Trial(t.backend, t.config, Status.OK, timing=timings[t.label()], rel_err=t.rel_err,
                      vs_reference=found[t.label()] if reference is not None else None) for t in trials]

    def _reference_label(self) -> str | None:
        """cuBLAS's label once it is verified (built and checked here on first need: a restarted
        worker has not seen it), or None where it failed."""
        if not self._reference_tried:
            self._reference_tried = True
            label = Trial(backends.REFERENCE, {}, Status.OK).label()
            self._reference = label if label in self._ready or self._build_and_verify(backends.REFERENCE, {}).ok \
                else None
        return self._reference

    def final(self, candidates: list[tuple[str, dict]], budget_ms: float,
              min_rounds: int) -> dict[str, tuple[Timing, Timing, Timing | None, str]]:
        """The finalists timed side by side, then each checked again on the second inputs:
        label -> (timing, cost of a user's call, the host's own time per call where it was
        measured, else None, and why it failed that check, else "")."""
        labels = []
        for backend_name, config in candidates:
            label = Trial(backend_name, config, Status.OK).label()
            if label in self._ready or self._build_and_verify(backend_name, config).ok:
                labels.append(label)
        timings = measure.measure({label: self._bound(label) for label in labels}, self.device,
                                  budget_ms=budget_ms, min_rounds=min_rounds, sessions=FINAL_SESSIONS)
        costs, hosts = self._costs(timings)
        return {label: (timing, costs[label], hosts[label], self._recheck(label)) for label, timing in timings.items()}

    def _recheck(self, label: str) -> str:
        """Why the kernel of ``label``, after its timing rounds, gets the second inputs wrong; ""
        where it gets them right."""
        try:
            verdict = verify.check(self._ready[label][0], self._problem, self._second)
        except Exception as exc:  # noqa: BLE001 - a kernel that now raises has failed the check
            return f"after timing: {classify(exc)[1]}"
        return "" if verdict.ok else f"after timing: {verdict.reason()}"

    def _build_and_verify(self, backend_name: str, config: dict) -> Trial:
        """Build the candidate and check it on both input sets."""
        problem = self._problem
        try:
            backend = backends.get(backend_name)
            parsed = backend.parse_config(config)
            kernel = backend.build(problem, parsed, self.device)
            verdict = verify.check(kernel, problem, self._inputs)
            if verdict.ok:
                verdict = verdict.worse(verify.check(kernel, problem, self._second))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a typed Trial, never a crash
            status, reason = classify(exc)
            return Trial(backend_name, config, status, reason=reason)
        if not verdict.ok:
            return Trial(backend_name, config, Status.WRONG_RESULT, rel_err=verdict.rel_err, reason=verdict.reason())
        trial = Trial(backend_name, parsed.as_dict(), Status.OK, rel_err=verdict.rel_err)
        self._ready[trial.label()] = (kernel, verdict.rel_err)
        return trial

    def _bound(self, label: str) -> Callable[[], object]:
        kernel, operands = self._ready[label][0], self._inputs.operands
        return lambda: kernel(*operands)

    def _costs(self, timings: dict[str, Timing]) -> tuple[dict[str, Timing], dict[str, Timing | None]]:
        """What a call of each finalist costs, and the host's own time per call where it counts.

        Where every kernel takes HOST_BOUND_MS or more, the kernels' timings are the costs. Else
        each call is also timed back to back, all in the same interleaved rounds
        (``measure.host_rounds``), and a round's cost is the larger of the kernel's median and
        the loop's time per call (for layout linear, the loop of the call linear's front path
        makes: a bound launch where the kernel has one, which costs the host several
        microseconds less than its wrapper). The host's own time is kept for the kernels under
        HOST_BOUND_MS: above it, a kernel hides its launch."""
        if self.device.interpreter or all(t.median >= HOST_BOUND_MS for t in timings.values()):
            return dict(timings), dict.fromkeys(timings)
        # loops of about HOST_LOOP_MS of GPU time: a loop of 50 calls of a 0.09 ms kernel cost
        # 5 ms a round, and the 200-shape zoo's tuning 11% more time (docs/tuning-time.md)
        longest = max(t.median for t in timings.values())
        calls = max(10, min(50, round(HOST_LOOP_MS / longest)))
        measured = measure.host_rounds({label: self._call(label) for label in timings}, self.device, calls=calls)
        costs = {label: Timing(tuple(max(timings[label].median, s) for s in loop.samples))
                 for label, (loop, _) in measured.items()}
        hosts = {label: issue if timings[label].median < HOST_BOUND_MS else None
                 for label, (_, issue) in measured.items()}
        return costs, hosts

    def _call(self, label: str) -> Callable[[], object]:
        """A user's call of ``label``'s kernel on the first inputs."""
        p = self._problem
        if p.layout != "linear" or p.scaled or p.batch > 1:  # no front path: the kernel's own call
            return self._bound(label)
        a, b, bias = self._inputs.a, self._inputs.b, self._inputs.bias
        front = front_entry(self._ready[label][0], a, b, bias)
        pa, pb, pbias = a.data_ptr(), b.data_ptr(), 0 if bias is None else bias.data_ptr()
        return lambda: front(a, b, bias, pa, pb, pbias)


def _best_round(timing: Timing, reference: Timing | None) -> float:
    """``timing``'s fastest reading: its smallest ratio to ``reference`` in one round (paired),
    else its smallest sample. A host stall between a round's start event and its launch (another
    thread holding the GIL, the scheduler) inflates that round alone: tuning a 200-shape zoo on
    2 H100s, 5-8 of the 29-35 candidates per run cut after two rounds had read 1.5-13x what they
    read screened in full in another run, their first round 2-25x their second, and the best
    configs of a decode shape never reached its final."""
    if reference is None:
        return min(timing.samples)
    paired = timing.per_round(reference)
    return min(paired.samples) if paired is not None else min(timing.samples) / min(reference.samples)


def _ratio(timing: Timing, reference: Timing | None) -> float:
    """``timing`` over ``reference`` (timed in the same rounds), or its own median without one."""
    return timing.median if reference is None else timing.ratio_to(reference)
