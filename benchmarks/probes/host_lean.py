"""Probe: whether a host-bound model's eager forward gains from the kernels whose calls cost the
host least, where the chosen ones won on the GPU.

A zoo model (``benchmarks/models.py``) with every layer gemmtune's (``optimize(check=False)``) and
its GEMMs tuned. Then, per GEMM the forward performs, the fastest Triton kernel its tuning timed in
the final rounds (a bound Triton launch costs the host less than ``F.linear``'s call or
cuBLASLt's: docs/host-cost.md), where there is one. Four sides in alternated rounds of queued
eager forwards, each side's kernels put in the dispatcher before its loop: the model without
gemmtune, an A/A copy of it, the optimized model with its tuned kernels, and with the Triton
ones ("lean"); where ``optimize`` would pick lean kernels (``gemmtune.nn.lean.lean_picks``: bound launches
within the ceiling), two sides more: those picks put in the dispatcher as they are ("picks"), and
served as optimize serves them (``Dispatcher.serve_lean``: each a ``ByMode`` of the pick and the
choice, "served"); then the first three sides' CUDA graphs replayed (the GPU's time alone: where the lean
kernels would make the GPU pace the forward). Ratios are the model without gemmtune over each
side (above 1: faster), medians of per-round ratios with their spreads; per GEMM its choice, its
fastest Triton finalist and that kernel's time over cuBLAS's. Written to OUT.json.

    PYTHONPATH=src:benchmarks python3 benchmarks/probes/host_lean.py OUT.json [--models bert-base]
"""
import copy

import torch

import gemmtune
import models
from gemmtune import backends
from gemmtune.device import current
from gemmtune.nn import tune_calls
from gemmtune.nn.lean import lean_picks
from gemmtune.serving.dispatch import DISPATCHER, DispatchKey
from gemmtune.tuning import measure
from gemmtune.tuning.tuner import final_rounds


def optimized(case, base, shared):
    """A copy of ``base`` with every layer gemmtune's and the step's GEMMs tuned; its inputs."""
    tuned = copy.deepcopy(base)
    kwargs = case.kwargs(tuned, shared)
    if case.positional:
        gemmtune.optimize(tuned, tuple(kwargs.values()), check=False)
    else:
        gemmtune.optimize(tuned, check=False)
        tune_calls(models.step_of(case, tuned, tuned, kwargs), check=False)
    return tuned, kwargs


def lean_kernels(problems, device) -> tuple[dict, list]:
    """Per dispatch key the fastest Triton kernel of its problem's final rounds, built; and per
    problem what was found (its label, its kernel time over cuBLAS's)."""
    index, lean, found = torch.cuda.current_device(), {}, []
    for problem, calls in problems:
        rounds = final_rounds(DISPATCHER.trials(problem, device))
        triton = [] if rounds is None else [t for t in rounds[1].values() if t.backend.startswith("triton")]
        row = {"problem": problem.describe(), "calls": calls, "lean": None}
        if triton:
            best = min(triton, key=lambda t: t.timing.median)
            lean[DispatchKey.of(problem, index)] = backends.build(problem, best.backend, best.config, device)
            row.update(lean=best.label(), lean_over_cublas=best.timing.ratio_to(rounds[0].timing))
        found.append(row)
    return lean, found


def optimize_picks(problems) -> tuple[dict, dict]:
    """Per problem the kernel ``optimize`` would serve its eager calls with where the host paces the
    run (``gemmtune.nn.lean.lean_picks``), where there is one; and the choices, read from the store,
    by ``Problem.key()``."""
    results = {r.problem_key: r for r in gemmtune.tune([problem for problem, _ in problems])}
    return lean_picks({"run": set(results)}, results), results


def installer(kernels: dict, step, picks: dict, served: bool = False):
    """Put ``kernels`` in the dispatcher, and where ``served`` serve ``picks`` as optimize does
    (else no pick is served), then run ``step`` once, untimed (its calls bind anew)."""
    index = torch.cuda.current_device()

    def install():
        DISPATCHER.drop_lean(list(picks), index)
        DISPATCHER.kernels.update(kernels)
        if served:
            DISPATCHER.serve_lean(picks, index)
        DISPATCHER.front.clear()
        step()
    return install


def ratios(timings: dict) -> dict:
    base = timings["torch"]
    return {name: {"speedup": 1.0 / t.ratio_to(base), "spread": t.spread_against(base), "median_ms": t.median}
            for name, t in timings.items()}


def probe_case(case, base, shared) -> dict:
    device = current()
    tuned, kwargs = optimized(case, base, shared)
    control = copy.deepcopy(base)
    with torch.no_grad():
        problems = models.recorded(case, tuned, kwargs, deferring=False)
        index = torch.cuda.current_device()
        as_tuned = {key: DISPATCHER.kernels[key] for key in (DispatchKey.of(p, index) for p, _ in problems)
                    if key in DISPATCHER.kernels}
        # its store lookups drop the dispatcher's kernels: as_tuned keeps them
        picks, results = optimize_picks(problems)
        lean, found = lean_kernels(problems, device)
        for (problem, _), row in zip(problems, found):
            row["choice"] = results[problem.key()].label() if problem.key() in results else None
        steps = {"torch": models.step_of(case, base, base, case.kwargs(base, shared)),
                 "control": models.step_of(case, control, control, case.kwargs(control, shared))}
        step = models.step_of(case, tuned, tuned, kwargs)
        steps.update(tuned=step, lean=step)
        enter = {"tuned": installer(as_tuned, step, picks), "lean": installer({**as_tuned, **lean}, step, picks)}
        if picks:
            built = {DispatchKey.of(p, index): backends.build(p, t.backend, t.config, device) for p, t in picks.items()}
            steps.update(picks=step, served=step)
            enter.update(picks=installer({**as_tuned, **built}, step, picks),
                         served=installer(as_tuned, step, picks, served=True))
        reference = models.first_tensor(steps["torch"]()).float()
        errors = {}
        for name in enter:
            enter[name]()
            errors[name] = models.rel_err(models.first_tensor(step()).float(), reference)
        eager = measure.loops(steps, device, budget_ms=40000.0, rounds=21, loop_ms=100.0, enter=enter)
        graphs = {}
        for name in ("torch", "tuned", "lean"):
            enter.get(name, lambda: None)()
            graphs[name], _ = models.captured(steps[name])
        replayed = measure.loops(graphs, device, budget_ms=20000.0, rounds=15, loop_ms=50.0)
        enter["tuned"]()
    return {"case": case.label(), "gemms": found, "picks": {p.describe(): t.label() for p, t in picks.items()},
            "rel_err": errors, "eager": ratios(eager),
            "graph": ratios(replayed)}


def main() -> None:
    args = models.probe_parser(__doc__, "bert-base").parse_args()
    models.probe_rows(args.out, args.models, probe_case)

if __name__ == "__main__":
    main()
