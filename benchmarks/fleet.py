"""Tuning a zoo over every GPU of a host against one GPU: the ``fleet`` file of RESULTS.md.

A zoo of ``--count`` problems (210 at most; default 200: the goal's) (the shapes of
benchmarks/shapes/public.json and zoo.json, each (n, k) at ten row counts from 1 to 4096, bf16;
deterministic) is tuned once per run of ``--runs`` (default ``gpus_all,plain,gpus_1``; ``plain``
always) from empty stores and empty Triton compile caches, each a ``gemmtune tune`` process:

    gpus_all      --gpus all: one worker process per GPU, every result into one store
    plain         no scheduler: the command's own tuning on one GPU
    gpus_1        --gpus 1: the same scheduler with one worker
    ray           --ray: a local Ray instance over every GPU, an actor each (needs ray)

and the file says:

- ``scaling = plain_s / gpus_all_s`` against the ideal ``gpus`` (the goal: >= 0.9 x gpus); with
  ``--times N``, the runs again N - 1 times, alternated, for their seconds alone (``rounds``), and
  ``scaling_median``, the median of the rounds' ratios, which a host's drift between runs moves less;
- ``scheduler_overhead = gpus_1_s / plain_s - 1`` (the goal: <= 5%);
- ``work_s``: per run, the seconds its problems' tuning took (their ``tune_s``, summed), so that
  what a run spends outside tuning (process starts, the scheduler, a GPU left idle at the end)
  reads as ``*_s - work_s / gpus``;
- ``agreement``: the share of problems whose choice under ``--gpus all`` is the plain run's, and
  ``repeat``: the same between the two one-GPU runs (``plain`` and ``gpus_1``, on the same GPU:
  how far two tunings agree at all), with its ``drift`` (how far the two runs read each
  candidate both timed in their final rounds, against each run's own noise); ``ray``: the ray
  run's ``scaling`` and its agreement with plain, as gpus_all's; ``graph_same``: the same for the
  kernel each stored choice runs in a CUDA graph (``tuner.graph_choice``). Each difference is
  then crosschecked: its two choices timed side by side with cuBLAS on GPU 0, in rounds like the
  tuner's final ones; ``kernel`` and ``cost`` are the other choice's over plain's (medians of
  per-round ratios, with their noise), and ``within_noise`` counts the differences where both are
  level, ``cost_level`` those where the cost is (see ``crosscheck``); each difference says where
  it ``started`` (the final rounds, a screening cut, or screening). The ``--gpus all`` and ray
  runs' differences are crosschecked on each other GPU too (``on_gpu1``, ...): half their problems
  were tuned there, and two chips of one model need not read alike.

    PYTHONPATH=src python3 benchmarks/fleet.py --out fleet.json [--count 200] [--runs plain,ray] [--times 3]
        [--keep DIR]

``--keep DIR`` keeps the runs' stores there (every trial's samples: to study the choices).

Without a GPU the workers run Triton's interpreter on a small zoo: NOT GPU timings.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("gemmtune.fleet")
ROWS = (1, 8, 16, 33, 64, 128, 256, 1024, 2048, 4096)


def zoo(count: int, tiny: bool) -> list[dict]:
    """``count`` distinct bf16 problems: every (n, k) of the shapes files at each row count."""
    if tiny:
        return [{"name": f"tiny.{m}x{n}x{k}", "m": m, "n": n, "k": k, "dtype": "float32", "layout": "linear"}
                for m, n, k in [(3, 24, 40), (5, 24, 40), (7, 32, 48), (9, 16, 16)][:count]]
    pairs = []
    for name in ("public.json", "zoo.json"):
        for shape in json.loads((ROOT / "benchmarks" / "shapes" / name).read_text())["shapes"]:
            if shape.get("layout", "linear") == "linear" and (shape["n"], shape["k"]) not in pairs:
                pairs.append((shape["n"], shape["k"]))
    problems = [{"name": f"zoo.{m}x{n}x{k}", "m": m, "n": n, "k": k, "dtype": "bfloat16", "layout": "linear"}
                for m in ROWS for n, k in pairs]
    if len(problems) < count:
        raise SystemExit(f"--count {count}: the shapes files give {len(problems)} problems")
    return problems[:count]


def tune(shapes: Path, store: Path, cache: Path, extra: list[str], timeout: float) -> float:
    """Seconds one ``gemmtune tune`` process takes, from empty caches."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": path}
    argv = [sys.executable, "-c", "import sys; from gemmtune.cli import main; sys.exit(main(sys.argv[1:]))",
            "tune", "--from", str(shapes), "--store", str(store), *extra]
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"{' '.join(extra) or 'plain'}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return seconds


def agreement(plain: Path, spread: Path) -> dict:
    """The choices of the ``spread`` store against the ``plain`` store's, problem by problem; and
    ``graph_same``, the problems whose CUDA-graph kernel (``tuner.graph_choice`` over the stored
    trials, else the choice's own) is the same in both, with ``graph_differences``."""
    from gemmtune.store import Store

    base, other = Store(plain), Store(spread)
    theirs = {(r.device, r.problem_key): r for r in other.choices()}
    same, differences, graph_same, graph_differences = 0, [], 0, []
    for ours in base.choices():
        their = theirs.get((ours.device, ours.problem_key))
        if their is None:
            differences.append({"problem": ours.problem_key, "missing": True})
            continue
        if their.label() == ours.label():
            same += 1
        else:
            differences.append({"problem": ours.problem_key, "plain": [ours.backend, ours.config],
                                "other": [their.backend, their.config],
                                "started": started(base, other, ours, their)})
        graphs = graph_kernel(base, ours), graph_kernel(other, their)
        if graphs[0] == graphs[1]:
            graph_same += 1
        else:
            graph_differences.append({"problem": ours.problem_key, "plain": graphs[0], "other": graphs[1]})
    total = len(base.choices())
    return {"problems": total, "same": same, "agreement": same / total if total else None, "differences": differences,
            "graph_same": graph_same, "graph_differences": graph_differences}


def started(base, other, ours, theirs) -> str:
    """Where a difference started: ``final`` where both choices were finalists in both runs (the
    final rounds judged the same candidates differently), ``cut`` where one run stopped screening
    either choice after two rounds, else ``screening`` (one run's screening ranked the other's
    choice out of its final)."""
    from gemmtune.tuning.tuner import final_rounds

    stored = [store.trials(record.device, record.problem_key) for store, record in ((base, ours), (other, theirs))]
    labels = (ours.label(), theirs.label())
    if all(label in (final_rounds(trials) or (None, {}))[1] for trials in stored for label in labels):
        return "final"
    screened = [{t.label(): len(t.timing.samples) for t in trials if t.ok and t.timing is not None} for trials in stored]
    return "cut" if any(run.get(label) == 2 for run in screened for label in labels) else "screening"


def drift(plain: Path, spread: Path) -> dict:
    """How far two runs read the same candidate: for each candidate that was a finalist in both
    (timed in as many rounds as that problem's cuBLAS), its kernel's ratio to cuBLAS in each run,
    and the difference's quantiles (``abs_diff``) and share beyond 2 and 3 standard errors of the
    two medians (``beyond_2se``, ``beyond_3se``; chance alone: about 5% and 0.3%). A share well
    above chance is drift fixed within a run, which more rounds do not shrink."""
    from gemmtune.store import Store

    base, other = Store(plain), Store(spread)
    diffs, errors = [], []
    for record in base.choices():
        ours = finalists(base.trials(record.device, record.problem_key))
        theirs = finalists(other.trials(record.device, record.problem_key))
        for label in ours.keys() & theirs.keys():
            (m1, e1), (m2, e2) = ours[label], theirs[label]
            diffs.append(abs(m1 - m2))
            errors.append(abs(m1 - m2) / max(math.hypot(e1, e2), 1e-12))
    if not diffs:
        return {"pairs": 0}
    diffs.sort()
    return {"pairs": len(diffs),
            "abs_diff": {q: diffs[min(len(diffs) - 1, int(p * len(diffs)))] for q, p in
                         (("p50", 0.5), ("p75", 0.75), ("p90", 0.9))},
            "beyond_2se": sum(e > 2 for e in errors) / len(errors), "beyond_3se": sum(e > 3 for e in errors) / len(errors)}


def finalists(trials) -> dict[str, tuple[float, float]]:
    """label -> (kernel ratio to cuBLAS, its standard error) of each finalist but cuBLAS in a
    problem's stored ``trials``: the median of per-round ratios, and 1.2533 x sigma / sqrt(rounds)
    with sigma from their half inter-quartile range (1.4826 x it, for normal noise)."""
    from gemmtune.tuning.tuner import final_rounds

    found = final_rounds(trials)
    if found is None:
        return {}
    reference, final = found
    rounds = len(reference.timing.samples)
    out = {}
    for label, trial in final.items():
        if trial is not reference:
            ratio = trial.timing.ratio_to(reference.timing)
            sigma = 1.4826 * trial.timing.spread_against(reference.timing) * ratio
            out[label] = (ratio, 1.2533 * sigma / math.sqrt(rounds))
    return out


def graph_kernel(store, record) -> str:
    """The label of the kernel a CUDA graph replays for ``record``, a stored choice."""
    from gemmtune.tuning.tuner import graph_choice

    pick = graph_choice(store.trials(record.device, record.problem_key), record.label())
    return (pick or record).label()


def crosscheck(comparison: dict, budget_ms: float, gpu: int = 0) -> None:
    """Each difference's two choices timed side by side on ``gpu`` with cuBLAS, as the tuner's
    final rounds time its finalists: ``kernel`` and ``cost`` (a user's call, the time selection
    judges) of the other choice over plain's, each the median of per-round ratios with its
    ``*_noise`` (the half inter-quartile range of those ratios), and ``host``, the host's time per
    call, where the kernels are short enough for it to be measured. A difference is within noise
    where both its kernel and its cost are level (within max(MIN_GAIN, noise)) with plain's, and
    ``cost_level`` where its cost is (what selection judges an eager call by; the kernel a CUDA
    graph replays is chosen apart, ``graph_same``). On GPU 0 the readings are the difference's own
    fields and ``within_noise`` and ``cost_level`` the comparison's counts; on another GPU they go
    under ``on_gpu<N>`` (each difference's and the comparison's): whether two GPUs of one model
    read the same two choices alike."""
    from gemmtune.device import current
    from gemmtune.problem import Problem
    from gemmtune.results import Status, Trial
    from gemmtune.tuning.runner import LocalRunner
    from gemmtune.tuning.tuner import MIN_GAIN, MIN_ROUNDS_FINAL

    if torch.cuda.is_available():
        torch.cuda.set_device(gpu)
    runner = LocalRunner(current(gpu if torch.cuda.is_available() else None))
    within = cost_level = 0
    for difference in comparison["differences"]:
        if difference.get("missing"):
            continue
        readings = difference if gpu == 0 else difference.setdefault(f"on_gpu{gpu}", {})
        runner.start(Problem.from_key(difference["problem"]), seed=0)
        pair = [tuple(difference["plain"]), tuple(difference["other"])]
        final = runner.final([("cublas", {}), *pair], budget_ms, MIN_ROUNDS_FINAL)
        mine, theirs = (final.get(Trial(backend, config, Status.OK).label()) for backend, config in pair)
        if mine is None or theirs is None:
            readings["failed"] = "a choice failed its build or check in the crosscheck"
            continue
        levels = []
        for i, what in enumerate(("kernel", "cost")):
            ratio, noise = theirs[i].ratio_to(mine[i]), theirs[i].spread_against(mine[i])
            readings[what], readings[f"{what}_noise"] = ratio, noise
            levels.append(abs(ratio - 1.0) <= max(MIN_GAIN, noise))
        if mine[2] is not None and theirs[2] is not None:
            readings["host"] = theirs[2].ratio_to(mine[2])
        readings["within_noise"], readings["cost_level"] = all(levels), levels[1]
        within += all(levels)
        cost_level += levels[1]
    counts = {"within_noise": within, "cost_level": cost_level}
    if gpu == 0:
        comparison |= counts
    else:
        comparison[f"on_gpu{gpu}"] = counts


def median_scalings(result: dict) -> None:
    """Each spread run's ``scaling_median`` (and gpus_1's ``overhead_median``): the median over
    ``result["rounds"]`` (each round's seconds per run, the first round's included) of plain's
    seconds over the run's in that round."""
    rounds = result["rounds"]
    for name, place in (("gpus_all", result), ("ray", result.get("ray"))):
        if place is not None and name in rounds[0]:
            place["scaling_median"] = statistics.median(r["plain"] / r[name] for r in rounds)
    if "gpus_1" in rounds[0]:
        result["overhead_median"] = statistics.median(r["gpus_1"] / r["plain"] - 1 for r in rounds)


def scale_file(result: dict) -> dict:
    """The ``scale`` file of RESULTS.md from a fleet result: a row for each run over every GPU
    (``scheduler``: gpus for --gpus all, ray for --ray), with its speedup over the plain one-GPU
    run, its agreement with it, and the problems the plain run stored that it did not (entries lost)."""
    rows = []
    for scheduler, name, comparison in (("gpus", "gpus_all", result), ("ray", "ray", result.get("ray"))):
        if comparison is None or "scaling" not in comparison:
            continue
        problems = comparison["problems"]
        rounds = result.get("rounds", [{"plain": result["plain_s"], name: result[f"{name}_s"]}])
        rows.append({"gpus": result["gpus"], "hosts": 1, "scheduler": scheduler, "problems": problems,
                     "wall_s": statistics.median(r[name] for r in rounds),
                     "one_gpu_wall_s": statistics.median(r["plain"] for r in rounds), "rounds": len(rounds),
                     "speedup_vs_one": comparison.get("scaling_median", comparison["scaling"]),
                     "choice_agreement": comparison["agreement"],
                     "same_or_within_noise": (comparison["same"] + comparison["within_noise"]) / problems,
                     "same_or_cost_level": (comparison["same"] + comparison["cost_level"]) / problems,
                     "entries_lost": sum(1 for d in comparison["differences"] if d.get("missing"))})
    return {"kind": "scale", "device": result["device"], "torch": result["torch"], "date": result["date"],
            "timings": result["timings"], "source": "benchmarks/fleet.py", "rows": rows}


def runs_of(text: str) -> list[str]:
    runs = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(runs) - {"gpus_all", "plain", "gpus_1", "ray"})
    if unknown:
        raise argparse.ArgumentTypeError(f"--runs: {', '.join(unknown)} unknown; expected gpus_all, plain, gpus_1, ray")
    return runs if "plain" in runs else ["plain", *runs]


def work_of(store: Path) -> float:
    from gemmtune.store import Store

    return sum(r.tune_s for r in Store(store).choices() if r.tune_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--count", type=int, default=200, help="problems in the zoo (default 200, at most 210)")
    parser.add_argument("--runs", type=runs_of, default=["gpus_all", "plain", "gpus_1"],
                        help="the runs, in order, comma-separated, of gpus_all, plain, gpus_1 and ray (default "
                             "gpus_all,plain,gpus_1; plain is added where missing)")
    parser.add_argument("--keep", type=Path, help="a folder to keep the runs' stores in")
    parser.add_argument("--scale-out", type=Path, help="also write RESULTS.md's scale file there")
    parser.add_argument("--timeout-s", type=float, default=400.0, help="the longest one tuning run may take")
    parser.add_argument("--times", type=int, default=1,
                        help="rounds of --runs, alternated, each run from empty stores and caches (default 1); the "
                             "scalings are then the medians of the rounds' (a host's pace drifts between runs)")
    parser.add_argument("--crosscheck-ms", type=float, default=90.0,
                        help="the side-by-side rounds' budget for each difference (default 90: twice the tuner's final)")
    args = parser.parse_args(argv)
    if args.times < 1:
        parser.error(f"--times {args.times}: expected a count of at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if gpu else 2
    problems = zoo(args.count, tiny=not gpu)
    result = {"kind": "fleet", "device": torch.cuda.get_device_name(0) if gpu else "cpu", "gpus": gpus,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "problems": len(problems),
              "timings": "GPU" if gpu else "CPU: Triton's interpreter, NOT GPU timings"}
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shapes = work / "zoo.json"
        shapes.write_text(json.dumps({"shapes": problems}))
        # the scaling and the agreement first: each is written as soon as it is known
        extra = {"gpus_all": ["--gpus", "all" if gpu else str(gpus)], "plain": [], "gpus_1": ["--gpus", "1"],
                 "ray": ["--ray"]}
        for name in args.runs:
            store = work / f"{name}.sqlite"
            result[f"{name}_s"] = tune(shapes, store, work / f"{name}-triton", extra[name], args.timeout_s)
            result.setdefault("work_s", {})[name] = work_of(store)
            log.warning("%s: %.1f s", name, result[f"{name}_s"])
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(store, args.keep / store.name)
            for other in (args.runs if name == "plain" else [name]):
                if other != "plain" and f"{other}_s" in result and "plain_s" in result:
                    compare(result, other, work)
            out.write_text(json.dumps(result, indent=1))
        for again in range(1, args.times):  # the timings alone: agreement is the first round's
            seconds = {name: tune(shapes, work / f"{name}-{again}.sqlite", work / f"{name}-{again}-triton", extra[name],
                                  args.timeout_s) for name in args.runs}
            result.setdefault("rounds", [{name: result[f"{name}_s"] for name in args.runs}]).append(seconds)
            log.warning("round %d: %s", again + 1, ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()))
            median_scalings(result)
            out.write_text(json.dumps(result, indent=1))
        # the differences' kernels compile from the runs' own caches, merged
        for cache in (work / f"{name}-triton" for name in args.runs):
            if cache.is_dir():  # none under the interpreter
                shutil.copytree(cache, work / "crosscheck-triton", dirs_exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(work / "crosscheck-triton")
        spread_runs = [result[name] if name == "ray" else result for name in ("gpus_all", "ray") if name in args.runs]
        for comparison in (*spread_runs, *([result["repeat"]] if "gpus_1" in args.runs else [])):
            crosscheck(comparison, args.crosscheck_ms)
            out.write_text(json.dumps(result, indent=1))
        for other in range(1, gpus if gpu else 1):  # the spread runs' differences, on each other GPU
            for comparison in spread_runs:
                crosscheck(comparison, args.crosscheck_ms, other)
                out.write_text(json.dumps(result, indent=1))
    if args.scale_out:
        args.scale_out.write_text(json.dumps(scale_file(result), indent=1))
    for name, comparison in (("gpus_all", result), ("ray", result.get("ray")), ("gpus_1", result.get("repeat"))):
        if name in args.runs:
            log.warning("%s against plain on %d GPUs: %s", name, gpus, summary(comparison))
    return 0


def compare(result: dict, name: str, work: Path) -> None:
    """Run ``name``'s scaling (or overhead) and agreement with plain into ``result``: at its top
    level for gpus_all, under ``repeat`` for gpus_1, under ``ray`` for ray."""
    fields = agreement(work / "plain.sqlite", work / f"{name}.sqlite")
    fields["drift"] = drift(work / "plain.sqlite", work / f"{name}.sqlite")
    if name == "gpus_1":
        result["scheduler_overhead"] = result["gpus_1_s"] / result["plain_s"] - 1
        result["repeat"] = fields
    elif name == "ray":
        result["ray"] = {"scaling": result["plain_s"] / result["ray_s"], **fields}
    else:
        result["scaling"] = result["plain_s"] / result["gpus_all_s"]
        result |= fields


def summary(comparison: dict) -> str:
    what = [f"scaling {comparison['scaling']:.2f}x"] if "scaling" in comparison else []
    if "scaling_median" in comparison:
        what = [f"scaling {comparison['scaling_median']:.2f}x (the median of the rounds')"]
    what.append(f"agreement {comparison['same']}/{comparison['problems']} ({comparison.get('within_noise')} "
                f"of the differences within noise, {comparison.get('cost_level')} level in cost)")
    what.append(f"CUDA-graph kernels the same: {comparison['graph_same']}")
    return ", ".join(what)


if __name__ == "__main__":
    sys.exit(main())
