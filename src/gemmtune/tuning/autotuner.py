"""Tuning one call of a user's own Triton kernel over its config list (``gemmtune.autotune``):
every config runs on the call's own arguments, restored before each run, its outputs poisoned
first; each is checked, against ``reference`` where the user gave one, else against the outputs
most configs agree on; the configs that pass are timed side by side (interleaved rounds, L2
flushed between calls, plain calls: a config's hooks may do host work a CUDA graph would not
replay); the fastest median wins. A config that raises is a failed trial with its reason.

Outputs are the tensors named in ``outputs``, else those the first config that runs writes into
(each tensor argument poisoned in turn: one found changed after the run was written, even where
it already held the right values), with those named in ``reset_to_zero`` and ``restore_value``.
Every output but the ``restore_value`` ones (read and written in place) is filled with NaN
(floating types) or its type's largest value before each run, the reference's too, so an element
a config leaves unwritten differs from every written one. Afterwards every tensor argument holds what it held before tuning, so that the
call that follows runs once, as without tuning.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gemmtune import search
from gemmtune.device import Device
from gemmtune.kernel_config import BACKEND, KernelConfig
from gemmtune.results import Status, Timing, Trial, TuneResult
from gemmtune.tuning import measure

log = logging.getLogger("gemmtune")

# |got - expected| <= RTOL * |expected| + ATOL * max|expected|, per element (ints and bools exact):
# configs of one kernel may order a reduction differently, so the float bounds allow rounding
TOLERANCES = {torch.float64: (1e-9, 1e-12), torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-3),
              torch.bfloat16: (2e-2, 8e-3)}
FP8_TOLERANCE = (1.5e-1, 6e-2)
BUDGET_MS = 300.0
SCREEN_MS = 20.0  # one config's screening, where a search strategy picks the configs tried
STRATEGIES = ("exhaustive", "random", "descent")  # gemmtune.search's that need no cost model


@dataclass
class Call:
    """One call of a kernel: how to run it with a config, and its tensor arguments by name."""

    launch: Callable[[Any], object]  # runs the kernel with a triton.Config: hooks, kernel, post-hook
    tensors: dict[str, torch.Tensor]
    outputs: tuple[str, ...] = ()  # named by the user; else found by the first run
    restored: tuple[str, ...] = ()  # read and written in place (restore_value): never poisoned
    zeroed: tuple[str, ...] = ()  # reset_to_zero: outputs the hook zeroes
    reference: Callable[[dict[str, torch.Tensor]], object] | None = None  # writes the outputs into the tensors


@dataclass
class Outcome:
    """What one config did: its outputs, or why it has none."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    status: Status = Status.OK
    reason: str = ""


Timer = Callable[[dict[str, Callable[[], object]]], dict[str, Timing]]


def tune(call: Call, configs: list[tuple[KernelConfig, Any]], device: Device, key: str, *,
         budget_ms: float = BUDGET_MS, graphs: bool = False, timer: Timer | None = None,
         strategy: str = "exhaustive", trials: int | None = None) -> tuple[TuneResult | None, Any]:
    """Check and time each (data, triton.Config) on ``call``; the TuneResult to store (None where
    nothing can be trusted: the first config is then served and nothing stored) and the
    triton.Config chosen. ``graphs`` times CUDA-graph replays; ``timer`` (the user's benchmark)
    replaces gemmtune's measurement. ``strategy`` and ``trials`` (gemmtune.search's) pick which
    configs are tried where not every one is (``_searched``)."""
    started = time.perf_counter()
    originals = {name: t.clone() for name, t in call.tensors.items()}
    try:
        if strategy != "exhaustive" or trials is not None:
            screen = timer or (lambda runs: measure.measure(runs, device, budget_ms=SCREEN_MS, graphs=False))
            configs = _searched(call, configs, screen, strategy, trials, originals)
        expected, outputs = _expected(call, configs, originals)
        outcomes = [_run(call, config, originals, outputs) for _, config in configs]
        against = "the reference" if expected is not None else "the outputs most configs agree on"
        if expected is None:
            expected = _agreed(outcomes)
        trials = [_judged(data, outcome, expected, against) for (data, _), outcome in zip(configs, outcomes)]
        timer = timer or (lambda runs: measure.measure(runs, device, budget_ms=budget_ms, graphs=graphs))
        trials = _timed(call, configs, trials, originals, timer)
    finally:
        _restore(call.tensors, originals)
    passed = [(t, config) for t, (_, config) in zip(trials, configs) if t.ok and t.timing is not None]
    if not passed:
        log.warning("gemmtune.autotune: %s: no config passed its check (%s); the first config is served and "
                    "nothing is stored", key, "; ".join(f"{t.label()}: {t.reason}" for t in trials if not t.ok)[:400])
        return None, configs[0][1]
    best, config = min(passed, key=lambda pair: pair[0].timing.median)
    result = TuneResult(key, device.fingerprint(), BACKEND, best.config, best.timing.median, None,
                        time.perf_counter() - started, best.rel_err, tuple(trials), gpu_timings=not device.interpreter)
    return result, config


def _searched(call: Call, configs: list, screen: Timer, strategy: str, trials: int | None,
              originals: dict) -> list:
    """The configs ``strategy`` (exhaustive, random or descent: from a config to the neighbour,
    one field apart, that screens fastest) visits within ``trials``, each screened alone (one
    run, then ``screen``'s timing; a config that raises screens as failed), in the order visited.
    Those then go through the checks and the side-by-side timing as a whole list would."""

    def evaluate(i: int) -> float | None:
        config = configs[i][1]
        _restore(call.tensors, originals)
        try:
            call.launch(config)  # compiles it; a config that cannot run fails here
            return screen({str(i): lambda: call.launch(config)})[str(i)].median
        except Exception:  # noqa: BLE001 - a config that fails screening is not visited further
            return None

    indices = list(range(len(configs)))
    neighbours = search.neighbours_by_fields(indices, lambda i: _fields(configs[i][0])) \
        if strategy == "descent" else None
    visited = search.run(strategy, indices, evaluate, search.Budget(trials=trials), neighbours=neighbours)
    log.info("gemmtune.autotune: %s visited %d of %d configs", strategy, len(visited), len(configs))
    return [configs[i] for i in visited]


def _fields(data: KernelConfig) -> dict:
    return {**dict(data.kwargs), "num_warps": data.num_warps, "num_stages": data.num_stages,
            "num_ctas": data.num_ctas, "maxnreg": data.maxnreg}


def _expected(call: Call, configs, originals) -> tuple[dict | None, tuple[str, ...]]:
    """The names of the outputs (the user's, else those a run writes into), and the reference's
    outputs, computed from poisoned outputs as the configs' are (None without a reference)."""
    named = set(call.zeroed) | set(call.restored)
    outputs = tuple(sorted(set(call.outputs) | named if call.outputs else _written(call, configs, originals) | named))
    if call.reference is None:
        return None, outputs
    _restore(call.tensors, originals)
    for name in outputs:
        if name not in call.restored:
            _poison(call.tensors[name])
    call.reference(call.tensors)
    return {name: call.tensors[name].clone() for name in outputs}, outputs


def _written(call: Call, configs, originals) -> set[str]:
    """The tensors a run of the first config that runs writes into: each poisoned in turn, the
    others as they were, and found changed after the run (a tensor that already held the right
    values is found too; one the kernel only reads stays poisoned)."""
    for _, config in configs:
        written = set()
        try:
            for name, tensor in call.tensors.items():
                _restore(call.tensors, originals)
                _poison(tensor)
                poisoned = tensor.clone()
                call.launch(config)
                if not _same(tensor, poisoned):
                    written.add(name)
        except Exception:  # noqa: BLE001 - this config fails: the next one shows the outputs
            continue
        return written
    return set()


def _run(call: Call, config: Any, originals: dict, outputs: tuple[str, ...]) -> Outcome:
    """One run of ``config`` from the original arguments, its outputs poisoned first."""
    _restore(call.tensors, originals)
    for name in outputs:
        if name not in call.restored:
            _poison(call.tensors[name])
    try:
        call.launch(config)
    except Exception as error:  # noqa: BLE001 - any failure of a config is its trial's reason
        return Outcome(status=_status(error), reason=f"{type(error).__name__}: {error}"[:300])
    return Outcome({name: call.tensors[name].clone() for name in outputs})


def _status(error: Exception) -> Status:
    name = type(error).__name__
    if name == "OutOfResources":
        return Status.OUT_OF_RESOURCES
    if "Compil" in name or name in ("PTXASError", "CompileTimeAssertionFailure"):
        return Status.COMPILE_ERROR
    return Status.LAUNCH_ERROR


def _agreed(outcomes: list[Outcome]) -> dict | None:
    """Without a reference: the outputs that a strict majority of the configs that ran agree on,
    or None where no majority agrees."""
    ran = [o for o in outcomes if o.status is Status.OK]
    best, votes = None, 0
    for candidate in ran:
        count = sum(_agree(other.outputs, candidate.outputs) for other in ran)
        if count > votes:
            best, votes = candidate, count
    return best.outputs if best is not None and votes * 2 > len(ran) else None


def _judged(data: KernelConfig, outcome: Outcome, expected: dict | None, against: str) -> Trial:
    if outcome.status is not Status.OK:
        return Trial(BACKEND, data.as_dict(), outcome.status, reason=outcome.reason)
    if expected is None:
        return Trial(BACKEND, data.as_dict(), Status.WRONG_RESULT,
                     reason="the configs disagree and no reference= was given: none can be trusted")
    worst = max((_error(outcome.outputs[name], expected[name]) for name in expected), default=0.0)
    if worst > 1.0:
        return Trial(BACKEND, data.as_dict(), Status.WRONG_RESULT, rel_err=worst,
                     reason=f"outputs differ from {against} beyond the dtype's bound ({worst:.3g}x it)")
    return Trial(BACKEND, data.as_dict(), Status.OK, rel_err=worst)


def _timed(call: Call, configs, trials: list[Trial], originals: dict, timer: Timer) -> list[Trial]:
    """The trials, those that passed with the timing of their config from one measurement."""
    ways = {i: config for i, ((_, config), t) in enumerate(zip(configs, trials)) if t.ok}
    if not ways:
        return trials
    _restore(call.tensors, originals)
    try:
        timings = timer({str(i): (lambda c=config: call.launch(c)) for i, config in ways.items()})
    except Exception as error:  # noqa: BLE001 - a config failing only when repeated: no timing
        log.warning("gemmtune.autotune: timing the configs failed (%s: %s); the first config is served",
                    type(error).__name__, error)
        return [_failed(t, f"timing failed: {error}") if t.ok else t for t in trials]
    return [_with_timing(t, timings.get(str(i))) if i in ways else t for i, t in enumerate(trials)]


def _with_timing(trial: Trial, timing: Timing | None) -> Trial:
    return Trial(trial.backend, trial.config, trial.status, timing, trial.rel_err, trial.reason, final=True)


def _failed(trial: Trial, reason: str) -> Trial:
    return Trial(trial.backend, trial.config, Status.LAUNCH_ERROR, rel_err=trial.rel_err, reason=reason[:300])


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |got - expected| over its element's bound (above 1: wrong); NaN where one
    side has a number is inf; NaN on both sides (an element neither wrote) agrees."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return math.inf
    if not (got.is_floating_point() or got.is_complex()):
        return 0.0 if torch.equal(got, expected) else math.inf
    a, b = got.double(), expected.double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    rtol, atol = TOLERANCES.get(got.dtype, FP8_TOLERANCE)
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    bound = rtol * b.abs() + atol * max(scale, 1e-30)
    ratio = (a - b).abs() / bound
    ratio = torch.where(both_nan | (a == b), torch.zeros_like(ratio), ratio)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    return float(ratio.max()) if ratio.numel() else 0.0


def _agree(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return all(_error(a[name], b[name]) <= 1.0 for name in b)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.is_floating_point() and bool(torch.equal(torch.isnan(a), torch.isnan(b)))
                                 and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(math.nan)
    elif t.dtype is torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _restore(tensors: dict[str, torch.Tensor], originals: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        t.copy_(originals[name])
