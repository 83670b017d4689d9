"""The CuTe DSL backend against its goals (issue 31), on the prefill shapes of the public shapes
(bf16 and fp16; ``--only`` names others). Per shape, in one process and from an empty compiled-
kernel cache:

1. **Exhaustive** over the backend's pruned space: each config compiled (``compile_s``: its
   first call, cold), checked against float64, then all of them timed side by side with cuBLAS;
   the best is the exhaustive choice.
2. **gemmtune**, the whole default space (cute's kernels now compiled, as the goal's "once
   compiled" asks): its choice and ``tune_s``, where those seconds went (``tune_profile``:
   cProfile, cumulative) and how many trials each backend had (``trials_by_backend``); the best
   verified trial of each backend as a ratio to cuBLAS (``by_backend``).
3. **QuACK's own autotuner** (``gemm_tuned`` called without a config: it times its configs on
   the first call, ``quack_tune_s``).
4. **Side by side**, in one measurement of interleaved rounds with L2 flushed: cuBLAS,
   gemmtune's choice, the exhaustive best CuTe DSL config, gemmtune's best CuTe DSL config, and
   QuACK's autotuned call. Ratios to cuBLAS (above 1: faster) and TFLOP/s.
5. **A second process** builds gemmtune's best CuTe DSL config from the compiled-kernel cache the
   first one filled: ``second_first_call_s`` is its first call (the goal: at most 50 ms), and
   ``second_first_call_profile`` where its time goes (cProfile, cumulative seconds). A third
   process makes QuACK's once-a-process query of how many clusters fit the GPU first
   (``occupancy_query_s``) and then times the same first call (``second_first_call_after_query_s``):
   what each further kernel of a process pays.

    PYTHONPATH=src:<cute site> python3 benchmarks/cute.py --out cute.json [--only NAME ...]

GPU only (sm_90 with gemmtune[cute] installed: benchmarks/cute_wheels.sh brings it to a machine
without a package index).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ("prefill",)
SIDE_BY_SIDE_MS = 1500.0
EXHAUSTIVE_MS = 4000.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the JSON file to write (rewritten after each shape)")
    parser.add_argument("--only", nargs="*", default=None, help="names of public shapes to run")
    parser.add_argument("--first-call", help=argparse.SUPPRESS)  # the second process: a problem key
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("QUACK_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-cute-bench-"))
    if args.first_call:
        return second_process(args.first_call, json.loads(args.config))
    if args.out is None:
        parser.error("--out is required")
    import torch

    from gemmtune.backends import cute

    if not torch.cuda.is_available() or not cute.installed():
        raise SystemExit("needs an sm_90 GPU and gemmtune[cute] (quack-kernels, nvidia-cutlass-dsl)")
    result = header()
    for shape in chosen_shapes(args.only):
        try:
            row = run_shape(shape)
        except Exception as exc:  # noqa: BLE001 - one shape's failure is its row, the others still run
            row = {"name": shape["name"], "error": f"{type(exc).__name__}: {exc}"[:1000]}
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=1))
        print(summary(row), file=sys.stderr, flush=True)
    return 0


def summary(row: dict) -> str:
    if "error" in row:
        return f"{row['name']:24s} {row['error'][:200]}"
    speedup = row["vs_cublas"]
    return (f"{row['name']:24s} exhaustive cute x{speedup['cute_exhaustive']:.3f}  gemmtune x{speedup['gemmtune']:.3f} "
            f"({row['choice']})  quack x{speedup['quack']:.3f}  tune {row['tune_s']:.1f} s  "
            f"second first call {row['second_first_call_s'] * 1e3:.0f} ms "
            f"({row['second_first_call_after_query_s'] * 1e3:.0f} ms after a {row['occupancy_query_s'] * 1e3:.0f} ms query)")


def header() -> dict:
    import torch

    from gemmtune.device import current
    from gemmtune.version import __version__

    device = current()
    return {"kind": "cute", "device": torch.cuda.get_device_name(0), "sm_count": device.sm_count,
            "torch": torch.__version__, "gemmtune": __version__, "quack": _version("quack-kernels"),
            "cutlass_dsl": _version("nvidia-cutlass-dsl"), "date": datetime.date.today().isoformat(),
            "timings": "GPU", "rows": []}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def chosen_shapes(only: list[str] | None) -> list[dict]:
    shapes = json.loads((ROOT / "benchmarks" / "shapes" / "public.json").read_text())["shapes"]
    if only:
        unknown = set(only) - {s["name"] for s in shapes}
        if unknown:
            raise SystemExit(f"--only: no public shape named {', '.join(sorted(unknown))}")
        return [s for s in shapes if s["name"] in only]
    return [s for s in shapes if s.get("group") in GROUPS and s["dtype"] in ("bfloat16", "float16")]


def run_shape(shape: dict) -> dict:
    from gemmtune.backends import cute
    from gemmtune.device import current
    from gemmtune.problem import Problem
    from gemmtune.tuning import verify

    device = current()
    problem = Problem(shape["m"], shape["n"], shape["k"], shape["dtype"], shape.get("layout", "linear"))
    inputs = verify.make_inputs(problem, "cuda", seed=0)
    a, b = inputs.a, inputs.b
    configs = cute.space(problem, device)
    compiled, failed = exhaustive_build(problem, configs, inputs)
    if not compiled:
        raise RuntimeError(f"every one of the {len(configs)} configs failed: {next(iter(failed.values()), '')}")
    tuned = tune(problem)
    quack_call, quack_tune_s = quack_autotuned(a, b, problem.layout)
    row = {"name": shape["name"], "m": problem.m, "n": problem.n, "k": problem.k, "dtype": problem.dtype,
           "cute_configs": len(configs), "cute_failed": failed, "quack_tune_s": quack_tune_s, **tuned["row"]}
    row |= side_by_side(problem, a, b, compiled, tuned, quack_call)
    best_cute = tuned["best_cute"] or compiled[row["cute_exhaustive_config"]]["config"]
    second = second_first_call(problem, best_cute)
    row["second_first_call_s"], row["second_first_call_profile"] = second["seconds"], second["profile"]
    # the same first call in a third process, after QuACK's once-a-process occupancy query
    row["second_first_call_after_query_s"] = second["after_query_s"]
    row["occupancy_query_s"] = second["occupancy_query_s"]
    return row


def exhaustive_build(problem, configs, inputs) -> tuple[dict, dict]:
    """Each config built and first called (its cold compile timed), then judged against float64
    as the tuner judges every candidate (``verify.check``)."""
    import torch

    from gemmtune import backends
    from gemmtune.device import current
    from gemmtune.tuning import verify

    compiled, failed = {}, {}
    for config in configs:
        label = config.key()
        try:
            kernel = backends.get("cute").build(problem, config, current())
            torch.cuda.synchronize()
            started = time.perf_counter()
            kernel(inputs.a, inputs.b, inputs.bias)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            verdict = verify.check(kernel, problem, inputs)
        except Exception as exc:  # noqa: BLE001 - a config that fails is reported, not fatal
            failed[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        if not verdict.ok:
            failed[label] = verdict.reason()
            continue
        compiled[label] = {"kernel": kernel, "config": config, "compile_s": seconds, "rel_err": verdict.rel_err}
    return compiled, failed


def tune(problem) -> dict:
    """gemmtune's tuning over the default space: its choice, its time, its best per backend."""
    from gemmtune import backends
    from gemmtune.device import current
    from gemmtune.tuning.tuner import tune_problem

    profile = cProfile.Profile()
    with profile:  # where the tuning's seconds go (the goal: 2 s once compiled)
        result = tune_problem(problem, current())
    best: dict[str, object] = {}
    for trial in result.trials:
        if trial.ok and trial.vs_reference is not None and \
                (trial.backend not in best or trial.vs_reference < best[trial.backend].vs_reference):
            best[trial.backend] = trial
    cute_trial = best.get("cute")
    return {"result": result,
            "kernel": backends.build(problem, result.backend, result.config, current()),
            "best_cute": backends.get("cute").parse_config(cute_trial.config) if cute_trial else None,
            "row": {"choice": result.label(), "tune_s": result.tune_s, "tune_profile": costliest(profile, 25),
                    "trials_by_backend": {name: sum(t.backend == name for t in result.trials)
                                          for name in dict.fromkeys(t.backend for t in result.trials)},
                    "by_backend": {name: {"config": t.label(), "vs_cublas": 1.0 / t.vs_reference}
                                   for name, t in best.items()}}}


def quack_autotuned(a, b, layout: str):
    """QuACK's own autotuned GEMM as its users call it, and how long its first call (which times
    its configs) took. ``b``: a weight (N, K) for layout linear, else (K, N)."""
    import torch
    from quack.gemm_interface import gemm_tuned

    b_kn = b.t() if layout == "linear" else b
    out = torch.empty(a.shape[0], b_kn.shape[1], dtype=a.dtype, device=a.device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    gemm_tuned(a, b_kn, out)
    torch.cuda.synchronize()
    return (lambda: gemm_tuned(a, b_kn, out)), time.perf_counter() - started


def side_by_side(problem, a, b, compiled, tuned, quack_call) -> dict:
    """The exhaustive rounds over every compiled config beside cuBLAS, then the contenders'."""
    import torch
    import torch.nn.functional as F

    from gemmtune.device import current
    from gemmtune.tuning import measure

    device = current()
    cublas = (lambda: F.linear(a, b)) if problem.layout == "linear" else (lambda: torch.mm(a, b))  # noqa: E731
    everything = {"cublas": cublas, **{label: (lambda k=entry["kernel"]: k(a, b, None))
                                       for label, entry in compiled.items()}}
    rounds = measure.measure(everything, device, budget_ms=EXHAUSTIVE_MS)
    exhaustive = min(compiled, key=lambda label: rounds[label].ratio_to(rounds["cublas"]))
    best_cute = tuned["best_cute"]
    contenders = {"cublas": cublas, "gemmtune": lambda: tuned["kernel"](a, b, None),
                  "cute_exhaustive": everything[exhaustive], "quack": quack_call}
    if best_cute is not None and best_cute.key() in compiled:
        contenders["cute_gemmtune"] = everything[best_cute.key()]
    final = measure.measure(contenders, device, budget_ms=SIDE_BY_SIDE_MS)
    flops = 2 * problem.m * problem.n * problem.k
    return {"cute_exhaustive_config": exhaustive,
            "exhaustive_vs_cublas": {label: 1.0 / rounds[label].ratio_to(rounds["cublas"]) for label in compiled},
            "compile_s": {label: entry["compile_s"] for label, entry in compiled.items()},
            "vs_cublas": {name: 1.0 / final[name].ratio_to(final["cublas"]) for name in final},
            "noise": {name: final[name].spread_against(final["cublas"]) for name in final},
            "tflops": {name: flops / (final[name].median * 1e-3) / 1e12 for name in final},
            "cute_gemmtune_within_exhaustive": (final["cute_gemmtune"].ratio_to(final["cute_exhaustive"])
                                                if "cute_gemmtune" in final else None)}


def second_first_call(problem, config) -> dict:
    """A fresh process's first call of ``config``, its kernel loaded from the cache this one filled:
    its ``seconds`` and its ``profile`` (the costliest functions, cumulative seconds)."""
    argv = [sys.executable, __file__, "--first-call", problem.key(), "--config", json.dumps(config.as_dict())]
    runs = {}
    for name, env in (("whole", {}), ("after_query", {"CUTE_BENCH_QUERY_FIRST": "1"})):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return runs["whole"] | {"after_query_s": runs["after_query"]["seconds"],
                            "occupancy_query_s": runs["after_query"]["occupancy_query_s"]}


def second_process(key: str, config: dict) -> int:
    import torch

    from gemmtune import backends
    from gemmtune.device import current
    from gemmtune.problem import Problem

    problem = Problem.from_key(key)
    dtype = getattr(torch, problem.dtype)
    a = torch.randn(problem.m, problem.k, device="cuda", dtype=dtype)
    b = torch.randn(*((problem.n, problem.k) if problem.layout == "linear" else (problem.k, problem.n)),
                    device="cuda", dtype=dtype)
    kernel = backends.build(problem, "cute", config, current())
    torch.cuda.synchronize()
    occupancy_s = occupancy_query(config) if os.environ.get("CUTE_BENCH_QUERY_FIRST") else None
    profile = cProfile.Profile()
    started = time.perf_counter()
    with profile:
        kernel(a, b, None)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "occupancy_query_s": occupancy_s, "profile": costliest(profile)}))
    return 0


def occupancy_query(config: dict) -> float:
    """Seconds of QuACK's query of how many clusters of the config's size fit the GPU at once,
    made as its GEMM makes it (CuTe DSL compiles a kernel to ask; QuACK keeps the answer for the
    process), so that the first call timed after it is the kernel's own."""
    import torch
    from quack.cute_dsl_utils import get_max_active_clusters

    started = time.perf_counter()
    get_max_active_clusters(config["cluster_m"] * config["cluster_n"],
                            device_capacity=torch.cuda.get_device_capability())
    return time.perf_counter() - started


def costliest(profile: cProfile.Profile, count: int = 15) -> list:
    """The functions the profiled call spent most time in (cumulative seconds), where they are."""
    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][3])[:count]
    return [[f"{path.rsplit('site-packages/', 1)[-1]}:{line}({name})", round(cumulative, 4)]
            for (path, line, name), (_, _, _, cumulative, _) in rows]


if __name__ == "__main__":
    sys.exit(main())
