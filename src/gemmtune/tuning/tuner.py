"""The tuning flow: for one problem, candidates -> build -> verify -> measure -> select; for
several (``tune_many``), which are already stored, which lead and which follow, and what
compiles together.

Selection never makes a user slower: cuBLAS stays unless a candidate beats it by more than the
noise measured in the same rounds (and by at least MIN_GAIN), judged on the time a user's call
really costs; for kernels of a few microseconds that includes the host's launch path. A
candidate whose kernel alone is slower than cuBLAS's never wins, whatever its launch saves:
replayed from a CUDA graph, the kernel is all a call costs, and there the fastest kernel of the
final rounds runs (``graph_choice``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gemmtune import backends, search
from gemmtune.device import Device
from gemmtune.problem import Problem
from gemmtune.results import Status, Timing, Trial, TuneResult
from gemmtune.tuning import compiler
from gemmtune.tuning.runner import LocalRunner, Runner, matmul_precision
from gemmtune.tuning.worker import IsolatedRunner

if TYPE_CHECKING:
    from gemmtune.store import Store

log = logging.getLogger("gemmtune.tuning.tuner")

MIN_GAIN = 0.02  # a win smaller than this is not worth leaving cuBLAS for
SHORTLIST = 3  # candidates a problem inherits from one that differs from it in its epilogue alone
HOST_SLACK = 0.1  # how much more host time per call than cuBLAS's a choice may take (see select)
# how much slower than cuBLAS's a kernel a host-bound model's eager calls may run instead of the
# choice (lean_choice): BERT-base's fastest Triton finalists ran 1.00-1.20x, and its eager forward
# 1.15-1.19x as fast with them (host-lean-h200-20261129.json); T5-small's fc2 1.38-1.40x, its
# forward 1.07-1.08x as fast with every GEMM on its fastest finalist (host-lean-h200-t5-20261129.json,
# host-lean-h200-served-20261129.json). Where the GPU's room is known, what a run's kernels may
# add in all is bounded by it too (gemmtune.nn.lean.affordable)
LEAN_CEILING = 1.5
MIN_ROUNDS_FINAL = 20
# compile_batch keeps its problems' operands (and, in each thread, an output) on the GPU at once:
# at most this share of the free memory, so a model that nearly fills a small GPU still tunes
BATCH_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class TuneOptions:
    strategy: str = "topk"  # how each backend's space is searched (gemmtune.search.STRATEGIES)
    budget: search.Budget = search.Budget()  # per backend whose configs the cost model ranks
    finalists: int = 4  # candidates re-measured beside cuBLAS after screening
    # Wall time on the host's clock (flushes included: bench._measure_cuda); on 132 SMs these
    # spend what the GPU-time budgets of 6 and 60 ms spent before
    screen_budget_ms: float = 4.5  # each candidate's own screening measurement
    final_budget_ms: float = 45.0  # the finalists side by side, at least MIN_ROUNDS_FINAL rounds
    backends: tuple[str, ...] | None = None  # None: every registered backend
    seed: int | None = None  # inputs' seed; None draws fresh random inputs
    compile_ahead: bool = True  # compile the planned candidates in parallel first (GPU only)
    # Labels of the only configs tried from the backends that a cost model ranks (see
    # ``shortlist``); None tries what the strategy picks. cuBLAS and the padded path stay.
    shortlist: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.strategy not in search.STRATEGIES:
            raise ValueError(f"TuneOptions.strategy {self.strategy!r} is not a strategy; accepted: "
                             f"{', '.join(search.STRATEGIES)}")


def tune_problem(problem: Problem, device: Device, *, options: TuneOptions = TuneOptions(),
                 on_trial: Callable[[Trial], None] | None = None, runner: Runner | None = None,
                 compiled: dict[tuple[str, str], Trial] | None = None) -> TuneResult:
    """Tune one problem on ``device`` and return the choice with every trial behind it.

    ``runner`` runs the candidates: a ``runner.LocalRunner`` in this process by default, or a
    ``worker.IsolatedRunner``.
    ``compiled``: this problem's entry of ``compile_batch`` (its candidates are compiled
    already, these failed); None compiles them here first.
    """
    if isinstance(runner, IsolatedRunner):
        # its process sets the precision; here it would be process-wide, which tuning several
        # GPUs from threads of one process (``spread``) must not touch
        return _tune(problem, device, options, on_trial, runner, compiled)
    with matmul_precision(problem):
        return _tune(problem, device, options, on_trial, runner, compiled)


def tune_many(problems: Sequence[Problem], device: Device, store: Store, options: TuneOptions = TuneOptions(), *,
              retune: bool = False, runner: Runner | None = None,
              on_result: Callable[[TuneResult], None] | None = None,
              on_trial: Callable[[Trial], None] | None = None) -> list[TuneResult]:
    """Each of ``problems`` tuned on ``device`` and put in ``store``, in order, one result each
    (``on_result`` told of each as it comes): a problem already stored is answered from
    ``store`` unless ``retune``, and one listed twice is tuned once. ``runner`` as for
    ``tune_problem``; the caller closes it."""
    known = {} if retune else {p.key(): store.get(device.fingerprint(), p.key()) for p in problems}
    new = list({p.key(): p for p in problems if known.get(p.key()) is None}.values())
    # A problem that differs from an earlier new one in its epilogue alone (a follower) tries
    # cuBLAS and that lead's best candidates after it, not a whole plan of its own.
    leads = {}
    for problem in new:
        leads.setdefault(problem.without_epilogue(), problem)
    # A model's shapes compile side by side (an isolated runner compiles each in its own process),
    # and so do the followers, each its lead's best-predicted candidates (follower_plan): which of
    # the lead's a follower tries is known only once the lead is measured, and compiling them
    # then would cost a second round.
    followers = {p.key(): follower_plan(p, device, options) for p in new if leads[p.without_epilogue()] is not p}
    compiled = compile_batch(new, device, options, followers) if runner is None and len(new) > 1 else {}
    results = []
    for problem in problems:
        result = known.get(problem.key())
        if result is None:
            lead = leads[problem.without_epilogue()]
            own = options
            if lead is not problem:  # a follower compiled in the batch tries what it compiled there
                among = labels(followers[problem.key()]) if problem.key() in compiled else None
                own = dataclasses.replace(options, shortlist=shortlist(known[lead.key()], among=among))
            result = tune_problem(problem, device, options=own, on_trial=on_trial, runner=runner,
                                  compiled=compiled.get(problem.key()))
            store.put(result)
            known[problem.key()] = result  # a problem listed twice is tuned once
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def compile_batch(problems: list[Problem], device: Device, options: TuneOptions = TuneOptions(),
                  plans: Mapping[str, list] | None = None) -> dict[str, dict]:
    """The planned candidates of every problem compiled in one batch of threads of this process
    (each on operands shaped as its runner's), so a model's shapes compile side by side rather
    than one shape after another; per problem key, the compile failures as ``tune_problem``'s
    ``compiled``. A problem keyed in ``plans`` compiles that plan instead (a follower's). Every
    problem's operands are alive at once, so the batch takes problems in order while they fit in
    BATCH_MEMORY_SHARE of the GPU's free memory; the rest are left out (``tune_problem`` compiles
    each of them on its own). Empty where compiling ahead is off or nothing would run on a GPU."""
    if not options.compile_ahead or device.interpreter or not problems:
        return {}
    from gemmtune.tuning import verify

    jobs, room, fitting, kinds = [], BATCH_MEMORY_SHARE * _free_gpu_bytes(), [], {}
    for problem in problems:
        room -= problem.min_bytes  # its a, b and output
        if room < 0:
            break
        fitting.append(problem)
        operands = verify.make_operands(problem, "cuda", seed=0)
        kind = (problem.dtype, problem.out_dtype, problem.scaling, problem.layout, problem.bias, problem.activation)
        kinds.setdefault(kind, (problem, operands))
        plan = plans[problem.key()] if plans and problem.key() in plans else _plan(problem, device, options)
        jobs += [(problem, name, config, operands) for name, config in plan]
    # While the compile children work, verification's kernels are loaded (CUDA loads each on its
    # first use): about 0.1 s of the seeds' MLP's first tuning in a process (docs/tuning-time.md, compiling ahead).
    results = compiler.compile_ahead(jobs, device, meanwhile=lambda: [
        verify.warm_up(problem, *operands) for problem, operands in kinds.values()])
    failed = {problem.key(): {} for problem in fitting}
    for (problem, *_), result in zip(jobs, results):
        failed[problem.key()].update(_compile_failures([result]))
    return failed


def _free_gpu_bytes() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


def _tune(problem: Problem, device: Device, options: TuneOptions, on_trial, runner: Runner | None,
          compiled) -> TuneResult:
    started = time.perf_counter()
    runner = runner or LocalRunner(device)
    seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(4), "little")
    runner.start(problem, seed)
    spaces = _spaces(problem, device, options)
    for name, configs in spaces.items():
        log.debug("%s: %d of its %d configs survive pruning for %s at %d SMs", name, len(configs),
                  backends.get(name).space_size, problem.describe(), device.sm_count)
    failed_ahead = _compile_ahead(problem, device, options, spaces, runner) if compiled is None else compiled
    trials: list[Trial] = []

    def evaluate(backend_name: str, config) -> float | None:
        trial = failed_ahead.get((backend_name, _label(backend_name, config.as_dict())))
        if trial is None:
            trial = runner.evaluate(backend_name, config.as_dict(), options.screen_budget_ms)
        trials.append(trial)
        _report(trial, on_trial)
        return trial.median_ms if trial.ok else None

    def evaluate_all(backend_name: str, configs: list) -> dict:
        measured = {}
        for config, trial in zip(configs, runner.evaluate_many(backend_name, [config.as_dict() for config in configs],
                                                               options.screen_budget_ms)):
            trials.append(trial)
            _report(trial, on_trial)
            measured[config] = trial.median_ms if trial.ok else None
        return measured

    for name, configs in spaces.items():
        _search_backend(name, configs, problem, device, options, evaluate, evaluate_all)
    ok = [t for t in trials if t.ok]
    reference = next((t for t in ok if t.backend == backends.REFERENCE), None)
    if not ok:
        raise RuntimeError(f"every candidate failed on {problem.describe()}: {trials[:1]}")
    if reference is None:  # cuBLAS itself failed verification (seen under MPS at 38 SMs): never chosen
        failed = next((t for t in trials if t.backend == backends.REFERENCE), None)
        log.warning("gemmtune: cuBLAS failed on %s (%s); choosing among the verified candidates",
                    problem.describe(), failed.reason if failed else "not run")

    # ranked by their ratio to cuBLAS in their own screening rounds, which drift between
    # measurements does not move; by their medians where cuBLAS was not there to pair with
    others = sorted((t for t in ok if t is not reference), key=_screening_rank)
    finalists = ([reference] if reference else []) + _finalists(others, options.finalists)
    final = runner.final([(t.backend, t.config) for t in finalists], options.final_budget_ms, MIN_ROUNDS_FINAL)
    failed = {label: reason for label, (*_, reason) in final.items() if reason}
    for label, reason in failed.items():
        log.warning("gemmtune: %s was right before its timing rounds and wrong after them on %s (%s): never chosen",
                    label, problem.describe(), reason)
    passed = {label: entry for label, entry in final.items() if label not in failed}
    if not passed:
        raise RuntimeError(f"every finalist failed its check after timing on {problem.describe()}: {failed}")
    timings = {label: timing for label, (timing, *_) in passed.items()}
    costs = {label: cost for label, (_, cost, *_) in passed.items()}
    hosts = {label: host for label, (_, _, host, _) in passed.items()}
    kept = reference if reference is not None and reference.label() in passed else None
    order = list(dict.fromkeys(t.label() for t in trials))  # as tried: the backends' and cost models' order
    label = select(kept.label() if kept else None, timings, costs, hosts, order)
    if kept is not None and label == kept.label():  # a narrow loser is settled like a narrow winner
        label = select(kept.label(), timings, costs, hosts, order, margin=0.5)
    chosen = next(t for t in finalists if t.label() == label)
    if kept is not None and chosen is not kept and not _faster(costs[label], costs[kept.label()], by=2):
        chosen = _settled(chosen, kept, passed, runner, options, problem)
    trials = [_after_final(t, timings, failed) for t in trials]
    return TuneResult(
        problem_key=problem.key(), device=device.fingerprint(), backend=chosen.backend,
        config=chosen.config, time_ms=costs[chosen.label()].median,
        cublas_ms=costs[kept.label()].median if kept else None,
        tune_s=time.perf_counter() - started, rel_err=chosen.rel_err, trials=tuple(trials),
        gpu_timings=not device.interpreter,
    )


def _finalists(ranked: list[Trial], count: int) -> list[Trial]:
    """The ``count`` best screened, and the best of each backend not among them. Screening times
    kernels; a user's call adds its backend's own launch path, which only the final rounds
    measure (a Triton kernel's call costs the host about a third less than cuBLASLt's), so a
    backend left out by a hair of kernel time made two tunings of one shape disagree by 35% of
    the call's cost (docs/selection.md)."""
    chosen = ranked[:count]
    for trial in ranked[count:]:
        if all(trial.backend != t.backend for t in chosen):
            chosen.append(trial)
    return chosen


def _settled(contender: Trial, reference: Trial, final: Mapping[str, tuple], runner: Runner,
             options: TuneOptions, problem: Problem) -> Trial:
    """``contender`` if it beats cuBLAS over its final rounds and fresh rounds of the two alone,
    pooled; else cuBLAS. A contender near the margin (a narrow winner, or a loser within half the
    margin of it) is where two tunings of a shape disagreed: a winner read among several finalists
    is read high (the largest of several noisy gains), and one set of rounds puts a 2-4% gain
    either side of MIN_GAIN. Twice the rounds halve the variance of the per-round ratios' median
    and of their spread, which sets the margin (docs/selection.md)."""
    again = runner.final([(reference.backend, reference.config), (contender.backend, contender.config)],
                         options.final_budget_ms, MIN_ROUNDS_FINAL)
    label, kept = contender.label(), reference.label()
    if label not in again or again[label][3]:
        log.warning("gemmtune: %s failed in its settling rounds on %s (%s): cuBLAS kept", label,
                    problem.describe(), again[label][3] if label in again else "not run")
        return reference
    if kept not in again:
        return contender
    timings, costs, hosts = ({name: _pooled(final[name][i], again[name][i]) for name in (kept, label)}
                             for i in range(3))
    if select(kept, timings, costs, hosts) == label:
        return contender
    log.debug("gemmtune: %s and cuBLAS were near the margin on %s, and over more rounds cuBLAS stays",
              label, problem.describe())
    return reference


def _pooled(first: Timing | None, second: Timing | None) -> Timing | None:
    """The samples of two sets of rounds as one (each set pairs round by round, so the pooled
    ones pair too); the one there is where the other was not measured."""
    if first is None or second is None:
        return first or second
    return Timing(first.samples + second.samples)


def _screening_rank(trial: Trial) -> float:
    return trial.vs_reference if trial.vs_reference is not None else trial.median_ms


def _after_final(trial: Trial, timings: dict[str, Timing], failed: dict[str, str]) -> Trial:
    """``trial`` as the final round left it: its final timing, or failed by its check after it."""
    label = trial.label()
    if label in failed:
        return dataclasses.replace(trial, status=Status.WRONG_RESULT, reason=failed[label])
    return dataclasses.replace(trial, timing=timings[label], final=True) if label in timings else trial


def select(reference: str | None, timings: dict[str, Timing], costs: dict[str, Timing],
           hosts: dict[str, Timing | None] | None = None, order: Sequence[str] = (), margin: float = 1.0) -> str:
    """The label of the cheapest candidate that costs less than the reference by more than
    ``margin`` times max(MIN_GAIN, the measured noise), else the reference's. The finalists are
    timed in the same rounds, and so are their costs, so every comparison reads the median and
    spread of per-round ratios (adding the two spreads would count the drift both saw twice).
    ``reference`` None: cuBLAS failed verification, and the cheapest verified candidate is chosen.

    ``costs`` include the host's time where a call is host-bound, which a cheaper launch can
    win; but a candidate whose kernel is slower than cuBLAS's beyond the noise does not win:
    inside a CUDA graph only the kernel's time remains (seen on the H200: a tiled kernel that won
    blog-mlp's host-bound cost ran 18% slower replayed from a graph), and a model whose GPU is
    busy pays the kernel in eager calls too. Without this test, on 2 H200s, tiled kernels 20-40%
    slower than cuBLAS's won calls of 1024-4096 rows that the host paced, in one tuning and not
    in the next (docs/selection.md).

    Likewise the other way: ``hosts``, the host's own time per call where it was measured, and
    a candidate whose call takes the host more than HOST_SLACK longer than the reference's is
    not chosen. A kernel longer than its launch hides the launch in a loop of its own calls,
    but in eager decoding the other operators keep the host busy, and each call's host time is
    what the step pays (on the H200, with TMA kernels chosen for the GPU time they saved, the
    Llama's eager decode at batch 16 read 0.95x eager's speed; with this rule, 1.13x).

    Among the winners whose cost is level with the cheapest's (within MIN_GAIN or the noise),
    the fastest kernel is chosen: as cheap for a user's loop, and faster inside a CUDA graph.
    Where launches set the cost, several kernels cost the same launch, and picking by the noise
    between them made two tunings of one shape on one GPU disagree. Kernels level with the
    fastest are told apart by ``order`` (the labels as the search tried them, which the cost
    models and cuBLASLt's heuristic set, not the timings), so that two tunings pick the same
    one of near-equals (docs/selection.md).
    """
    if reference is not None and hosts and hosts.get(reference) is not None:
        ceiling = 1.0 + HOST_SLACK
        costs = {label: cost for label, cost in costs.items() if label == reference
                 or hosts.get(label) is None or hosts[label].ratio_to(hosts[reference]) <= ceiling}
    if reference is None:
        return min(costs, key=lambda label: costs[label].median)
    winners = [label for label in costs if label != reference and _beats(label, reference, timings, costs, margin)]
    if not winners:
        return reference
    cheapest = min(winners, key=lambda label: costs[label].ratio_to(costs[reference]))
    tied = [label for label in winners if _level(costs[label], costs[cheapest])]
    return _first_fastest(tied, timings, timings[reference], order)


def _first_fastest(labels: list[str], timings: Mapping[str, Timing], reference: Timing,
                   order: Sequence[str]) -> str:
    """The fastest kernel of ``labels``, or among those level with it the first in ``order`` (the
    order the search tried them in; a label not in it after those that are, by name)."""
    fastest = min(labels, key=lambda label: timings[label].ratio_to(reference))
    level = [label for label in labels if _level(timings[label], timings[fastest])]
    rank = {label: i for i, label in enumerate(order)}
    return min(level, key=lambda label: (rank.get(label, len(rank)), label))


def graph_choice(trials: Sequence[Trial], chosen: str) -> Trial | None:
    """What a CUDA graph should replay for a problem whose choice is ``chosen``, from its tuning's
    stored ``trials``: the choice is made on a user's call's cost, host time included, but a graph
    replays the kernel alone. So: the finalist whose kernel beats the choice's by more than
    max(MIN_GAIN, the noise of their per-round ratio), and cuBLAS's too unless it is cuBLAS, the
    fastest of them (kernels level with it told apart by the order they were tried in, as in
    ``select``); None where none does (the choice serves graphs too) or the final rounds are not
    on record. Seen on 2 H100s: on short kernels whose call cost is the host's, cuBLASLt kernels
    3-10% faster than the chosen cuBLAS cost the same per call, and Triton kernels chosen for a
    call 35% cheaper ran 2-7% slower than cuBLAS's (docs/tuning-time.md)."""
    found = final_rounds(trials)
    if found is None:
        return None
    reference, final = found
    mine = final.get(chosen)
    if mine is None:
        return None
    faster = [label for label, t in final.items() if _faster(t.timing, mine.timing)
              and (label == reference.label() or _faster(t.timing, reference.timing))]
    if not faster:
        return None
    timings = {label: t.timing for label, t in final.items()}
    return final[_first_fastest(faster, timings, reference.timing, list(final))]


def lean_choice(trials: Sequence[Trial], chosen: str) -> Trial | None:
    """What eager calls of a problem whose choice is ``chosen`` could run in a model paced by its
    host, from its tuning's stored ``trials``: the finalist of a ``backends.LEAN`` backend with
    the fastest kernel (a bound Triton launch), where its kernel takes at most LEAN_CEILING times
    cuBLAS's; None where the choice is such a kernel already, no such finalist ran (an fp8
    product's), or the final rounds are not on record. ``select`` does not choose such a kernel,
    whose extra GPU time a caller the GPU paces pays: only a model's check, which times the model
    with it, does (``gemmtune.nn.keep``)."""
    found = final_rounds(trials)
    if found is None or chosen in found[1] and found[1][chosen].backend in backends.LEAN:
        return None
    reference, final = found
    lean = [(t.timing.ratio_to(reference.timing), t) for t in final.values() if t.backend in backends.LEAN]
    if not lean:
        return None
    ratio, best = min(lean, key=lambda pair: pair[0])
    return best if ratio <= LEAN_CEILING else None


def final_rounds(trials: Sequence[Trial]) -> tuple[Trial, dict[str, Trial]] | None:
    """cuBLAS's trial and every trial timed in the final rounds beside it (cuBLAS's among them), by
    label, from a tuning's stored ``trials``; None where the final rounds are not on record. The
    store keeps each trial's timing, not the round that made it: the final rounds' timings are
    those as long as cuBLAS's (cuBLAS is always a finalist), at least MIN_ROUNDS_FINAL."""
    reference = next((t for t in trials if t.ok and t.backend == backends.REFERENCE and t.timing), None)
    if reference is None or len(reference.timing.samples) < MIN_ROUNDS_FINAL:
        return None
    rounds = len(reference.timing.samples)
    return reference, {t.label(): t for t in trials if t.ok and t.timing is not None and len(t.timing.samples) == rounds}


def _faster(timing: Timing, other: Timing, by: float = 1.0) -> bool:
    """Whether ``timing`` is under ``other``'s by more than ``by`` times MIN_GAIN or the noise of
    their ratio (``by`` 2: a clear win, which needs no settling rounds)."""
    return timing.ratio_to(other) < 1.0 - by * max(MIN_GAIN, timing.spread_against(other))


def _level(timing: Timing, best: Timing) -> bool:
    """Whether ``timing`` is no more than MIN_GAIN or the noise of their ratio over ``best``'s."""
    return timing.ratio_to(best) <= 1.0 + max(MIN_GAIN, timing.spread_against(best))


def _beats(label: str, reference: str, timings: dict[str, Timing], costs: dict[str, Timing], margin: float) -> bool:
    """Whether ``label`` costs less than the reference by more than ``margin`` times max(MIN_GAIN,
    the noise of their ratio), with a kernel that is not slower than the reference's beyond its
    noise."""
    kernel = timings[label]
    if kernel.ratio_to(timings[reference]) > 1.0 + kernel.spread_against(timings[reference]):
        return False
    return _faster(costs[label], costs[reference], by=margin)


# Failures that come from compiling the candidate, the same wherever it is compiled: the tuner
# records them from what compiling ahead answered. Anything else the runner meets and classifies.
_COMPILE_FAILURES = (Status.OUT_OF_RESOURCES, Status.COMPILE_ERROR)


def _spaces(problem: Problem, device: Device, options: TuneOptions) -> dict[str, list]:
    """Each available backend's pruned configs for ``problem`` (those of ``options.shortlist``
    alone, where it is given, from the backends a cost model ranks)."""
    spaces = {name: backends.get(name).candidates(problem, device) for name in options.backends or backends.names()
              if backends.takes(name, problem) and backends.get(name).is_available(device)}
    if options.shortlist is None:
        return spaces
    keep = set(options.shortlist)
    return {name: [c for c in configs if _label(name, c.as_dict()) in keep]
            if _ranked(name, configs, problem, device) else configs for name, configs in spaces.items()}


def _ranked(name: str, configs: list, problem: Problem, device: Device) -> bool:
    """Whether a cost model ranks backend ``name``'s configs; those of the others (cuBLAS, the
    padded path: a config or two) are all measured."""
    return bool(configs) and backends.get(name).predict_ms(problem, device, configs[0]) is not None


def shortlist(result: TuneResult, count: int = SHORTLIST, among: set[str] | None = None) -> tuple[str, ...]:
    """The labels of the ``count`` fastest verified candidates of ``result`` besides cuBLAS (of
    those labelled in ``among``, where given): what to try on a problem that differs from
    ``result``'s in its epilogue alone (bias, activation). The epilogue touches each output
    once, after the K loop, so it does not reorder the tiles; cuBLAS and the padded path are
    measured on it whatever the list."""
    ranked = sorted((t for t in result.trials if t.ok and t.backend != backends.REFERENCE
                     and (among is None or t.label() in among)), key=lambda t: t.median_ms)
    return tuple(t.label() for t in ranked[:count])


def follower_plan(problem: Problem, device: Device, options: TuneOptions) -> list:
    """What a follower (a problem differing from another, its lead, in the epilogue alone)
    compiles in its lead's batch, before the lead is measured: of each backend a cost model
    ranks, the SHORTLIST configs predicted fastest; of the others, every config. It then tries
    the lead's fastest among them (``shortlist(..., among=...)``). Triton's front end holds the
    GIL for about 85 ms a compile, so the lead's whole plan again would cost the batch that much
    per config (docs/tuning-time.md, compiling ahead)."""
    return _plan(problem, device, options, ranked_first=SHORTLIST)


def labels(plan: list) -> set[str]:
    """The labels of a plan's (backend name, config dict) pairs."""
    return {_label(name, config) for name, config in plan}


def _compile_ahead(problem: Problem, device: Device, options: TuneOptions, spaces: dict[str, list],
                   runner: Runner) -> dict[tuple[str, str], Trial]:
    """Compile every Triton candidate the strategy plans to measure, in parallel, where the
    runner runs them; the failed ones as Trials keyed by (backend, label)."""
    if not options.compile_ahead or device.interpreter:
        return {}
    planned = _plan(problem, device, options, spaces)
    if len(planned) < 2:
        return {}
    return _compile_failures(runner.compile(planned))


def _plan(problem: Problem, device: Device, options: TuneOptions, spaces: dict[str, list] | None = None,
          ranked_first: int | None = None) -> list:
    """(backend name, config dict) of every candidate with Triton kernels (not cuBLAS's) that
    the strategy plans to measure; of each backend a cost model ranks, only the ``ranked_first``
    first where that is given."""
    spaces = _spaces(problem, device, options) if spaces is None else spaces
    plan = []
    for name, configs in spaces.items():
        if name in backends.PRECOMPILED:
            continue
        planned = _planned(name, configs, problem, device, options)
        if ranked_first is not None and _ranked(name, configs, problem, device):
            planned = planned[:ranked_first]
        plan += [(name, config.as_dict()) for config in _compiled_apart(name, planned, problem)[1]]
    return plan


def _compile_failures(results: list) -> dict[tuple[str, str], Trial]:
    """What compiling ahead answered, as Trials keyed by (backend, label): its compile failures."""
    return {(r.backend, _label(r.backend, r.config)): Trial(r.backend, r.config, r.status, reason=r.reason)
            for r in results if r.status in _COMPILE_FAILURES}


def _planned(name: str, configs: list, problem: Problem, device: Device, options: TuneOptions) -> list:
    """The configs of one backend that _search_backend will measure first."""
    if not _ranked(name, configs, problem, device):
        return configs
    backend = backends.get(name)
    return search.plan(options.strategy, configs, _budget(name, options),
                       predict=lambda config: backend.predict_ms(problem, device, config), seed=options.seed or 0)


def _budget(name: str, options: TuneOptions) -> search.Budget:
    """The search budget of backend ``name``: the options', with topk's count the backend's own
    (``topk``) where it has one and the options give none."""
    own = getattr(backends.get(name), "topk", None)
    if own is None or options.strategy != "topk" or options.budget.trials is not None:
        return options.budget
    return search.Budget(trials=own, seconds=options.budget.seconds)


def _compiled_apart(name: str, configs: list, problem: Problem) -> tuple[list, list]:
    """Backend ``name``'s configs whose kernels its cache holds compiled for ``problem``'s kind
    (for the CACHED_COMPILES backends; none for the others), and the rest."""
    if name not in backends.CACHED_COMPILES:
        return [], configs
    ready = backends.get(name).compiled(problem, configs)
    return ready, [c for c in configs if c not in ready]


def _label(backend_name: str, config: dict) -> str:
    return Trial(backend_name, config, Status.OK).label()


def _search_backend(name: str, configs: list, problem: Problem, device: Device, options: TuneOptions,
                    evaluate, evaluate_all) -> None:
    """Measure the configs of one backend that its cost model and the strategy pick. Backends
    without a cost model (cuBLAS, the padded path, cuBLASLt's ranked algorithms) are measured
    whole: a library's several algorithms side by side in one measurement (``evaluate_all``), as
    they compile nothing. A backend whose compiled kernels are cached (``CACHED_COMPILES``) has its
    compiled configs measured so too, and the strategy then walks the whole space, those counted
    as measured: it compiles only what it picks that is not compiled yet (before, it picked
    among the others alone, so each tuning compiled as many new configs as its budget allowed,
    one at a time: ViT-B/16's first tuning on an H100 compiled 6 more per shape after the ones
    compiled ahead, 1.3 s each)."""
    ready, rest = _compiled_apart(name, configs, problem)
    measured = evaluate_all(name, ready) if ready else {}
    if not rest:
        return
    if not _ranked(name, rest, problem, device):
        if name in backends.PRECOMPILED and len(rest) > 1:
            evaluate_all(name, rest)
            return
        for config in rest:
            evaluate(name, config)
        return
    backend = backends.get(name)
    search.run(options.strategy, configs,
               lambda config: measured[config] if config in measured else evaluate(name, config), _budget(name, options),
               predict=lambda config: backend.predict_ms(problem, device, config),
               neighbours=search.neighbours_by_fields(configs, lambda config: config.as_dict()),
               seed=options.seed or 0)


def _report(trial: Trial, on_trial: Callable[[Trial], None] | None) -> None:
    if trial.ok:
        log.debug("%s ok %.4f ms (rel_err %.2e)", trial.label(), trial.median_ms, trial.rel_err)
    else:
        log.debug("%s %s: %s", trial.label(), trial.status.value, trial.reason)
    if on_trial is not None:
        on_trial(trial)
