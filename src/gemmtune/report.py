"""Rendering results for people (rich tables) and programs (JSON-ready dicts)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from gemmtune.problem import Problem
from gemmtune.results import Trial, TuneResult


def result_dict(result: TuneResult, name: str | None = None) -> dict:
    problem = Problem.from_key(result.problem_key)
    return {
        "name": name or problem.describe(), "m": problem.m, "n": problem.n, "k": problem.k,
        "dtype": problem.dtype, "tf32": problem.tf32, "layout": problem.layout, "bias": problem.bias,
        "activation": problem.activation,
        "backend": result.backend, "config": result.config, "choice": result.label(),
        "time_ms": result.time_ms, "cublas_ms": result.cublas_ms, "speedup": result.speedup,
        "rel_err": result.rel_err, "tune_s": result.tune_s, "from_store": result.from_store,
        "gpu_timings": result.gpu_timings, "device": result.device,
    }


def results_table(results: Sequence[TuneResult], names: Sequence[str] | None = None) -> Table:
    gpu = all(r.gpu_timings for r in results)
    table = Table(title="gemmtune tune" + ("" if gpu else " (CPU interpreter: NOT GPU timings)"))
    numeric = ("ms", "cuBLAS ms", "speedup", "tune s", "verified")
    for column in ("shape", "dtype", "layout", "choice") + numeric:
        table.add_column(column, justify="right" if column in numeric else "left")
    for i, result in enumerate(results):
        problem = Problem.from_key(result.problem_key)
        name = names[i] if names else f"{problem.m}x{problem.n}x{problem.k}"
        speedup = f"{result.speedup:.2f}x" if result.speedup else "-"
        tune_s = "stored" if result.from_store else f"{result.tune_s:.1f}"
        dtype = problem.dtype + ("+tf32" if problem.tf32 else "")
        layout = problem.layout + ("+bias" if problem.bias else "")
        layout += "" if problem.activation == "none" else f"+{problem.activation}"
        cublas = f"{result.cublas_ms:.4f}" if result.cublas_ms else "-"
        verified = f"{sum(t.ok for t in result.trials)}/{len(result.trials)}" if result.trials else "-"
        table.add_row(name, dtype, layout, result.label(), f"{result.time_ms:.4f}", cublas, speedup, tune_s, verified)
    return table


def trials_table(trials: Sequence[Trial]) -> Table:
    table = Table(title="trials")
    for column in ("candidate", "status", "median ms", "spread", "rel_err", "reason"):
        table.add_column(column)
    for t in sorted(trials, key=lambda t: (not t.ok, t.median_ms or 0.0)):
        table.add_row(t.label(), t.status.value, f"{t.median_ms:.4f}" if t.timing else "-",
                      f"{t.timing.spread:.1%}" if t.timing else "-",
                      f"{t.rel_err:.2e}" if t.rel_err is not None else "-", t.reason)
    return table
