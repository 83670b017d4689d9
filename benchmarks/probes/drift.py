"""Probe: what moves a candidate's reading against cuBLAS from one tuning to the next.

Two tunings of one shape on one GPU read the same finalist's ratio to cuBLAS about a percent
apart, more than either run's noise (docs/tuning-time.md, "What moves a reading"). Per shape,
this tunes once (fixed seed) and then times that tuning's finalists again and again in final
rounds like the tuner's, in sessions of these kinds, interleaved:

    repeat    the same operands again (same data, same buffers), the final as the tuner takes it
    moved     the same data drawn again into new buffers (the last ones kept alive, so the
              allocator cannot hand the same memory back)
    reseeded  new data in new buffers (the next seed)
    one       as repeat, the final's rounds in one session (the graphs captured once)

Run it in two processes with the same arguments and ``--analyze`` compares the readings within
a process (each kind of session against the next of its kind) and across the two processes
(sessions of one kind against the other's): the share of candidate pairs that differ by more
than two standard errors, where chance alone gives about 5%. Written as JSON, nothing printed.

    PYTHONPATH=src python3 benchmarks/probes/drift.py --out A.json [--sessions 5] [--kinds repeat,one]
    PYTHONPATH=src python3 benchmarks/probes/drift.py --analyze A.json B.json --out SUMMARY.json
"""
import argparse
import json
import math
import random
import statistics
import time

SHAPES = ((33, 1536, 384), (128, 1024, 1024), (1, 1024, 4096), (8, 3072, 768), (16, 768, 768),
          (64, 2304, 768), (2048, 1536, 384), (4096, 384, 1536), (1024, 768, 3072), (256, 4096, 4096),
          (2048, 4096, 4096), (4096, 3072, 768))
KINDS = ("repeat", "moved", "reseeded", "one")
SEED = 1


def reading(timing, reference) -> dict:
    """The median of per-round ratios to cuBLAS and its standard error (from the ratios'
    inter-quartile range, as a normal's)."""
    paired = timing.per_round(reference)
    rounds = len(paired.samples)
    iqr = paired.quantile(0.75) - paired.quantile(0.25)
    return {"ratio": paired.median, "se": 1.2533 * (iqr / 1.349) / math.sqrt(rounds), "rounds": rounds}


def probe_shape(shape, device, sessions: int, kinds: list[str]) -> dict:
    from gemmtune.problem import Problem
    from gemmtune.tuning import runner as runners
    from gemmtune.tuning.runner import LocalRunner
    from gemmtune.tuning.tuner import MIN_ROUNDS_FINAL, TuneOptions, final_rounds, tune_problem

    m, n, k = shape
    problem = Problem(m=m, n=n, k=k, dtype="bfloat16", layout="linear")
    options = TuneOptions(seed=SEED)
    runner = LocalRunner(device)
    result = tune_problem(problem, device, options=options, runner=runner)
    found = final_rounds(result.trials)
    if found is None:
        return {"shape": list(shape), "skipped": "no final rounds on record"}
    reference, finalists = found
    candidates = [(t.backend, t.config) for t in finalists.values()]
    cublas = reference.label()
    held, seed, out = [], SEED, []
    order = [kind for _ in range(sessions) for kind in kinds]
    random.Random(0).shuffle(order)
    blocks = runners.FINAL_SESSIONS
    for index, kind in enumerate(order):
        runners.FINAL_SESSIONS = 1 if kind == "one" else blocks
        if kind in ("moved", "reseeded"):
            held = (held + [runner._inputs, runner._second])[-6:]  # noqa: SLF001 - a probe of its buffers
            seed = seed + 1 if kind == "reseeded" else seed
            runner.start(problem, seed if kind == "reseeded" else SEED)
        final = runner.final(candidates, options.final_budget_ms, MIN_ROUNDS_FINAL)
        runners.FINAL_SESSIONS = blocks
        timings = {label: entry[0] for label, entry in final.items()}
        costs = {label: entry[1] for label, entry in final.items()}
        out.append({"index": index, "kind": kind, "at_s": time.perf_counter(), "cublas_ms": timings[cublas].median,
                    "readings": {label: reading(t, timings[cublas]) for label, t in timings.items() if label != cublas},
                    "costs": {label: reading(t, costs[cublas]) for label, t in costs.items() if label != cublas}})
    return {"shape": list(shape), "chosen": result.label(), "reference": cublas, "sessions": out}


def beyond(a: dict, b: dict) -> bool:
    return abs(a["ratio"] - b["ratio"]) > 2 * math.hypot(a["se"], b["se"])


def pairs_within(sessions: list[dict], kind: str, what: str) -> list[tuple[dict, dict]]:
    """Each session of ``kind`` against the next of its kind, candidate by candidate (``what``:
    kernel ``readings`` or call ``costs``)."""
    mine = [s for s in sessions if s["kind"] == kind]
    return [(x[what][label], y[what][label]) for x, y in zip(mine, mine[1:]) for label in x[what] if label in y[what]]


def pairs_across(one: list[dict], other: list[dict], kind: str, what: str) -> list[tuple[dict, dict]]:
    """Each session of ``kind`` of one process against the same-numbered one of the other."""
    a = [s for s in one if s["kind"] == kind]
    b = [s for s in other if s["kind"] == kind]
    return [(x[what][label], y[what][label]) for x, y in zip(a, b) for label in x[what] if label in y[what]]


def summary(pairs: list[tuple[dict, dict]]) -> dict:
    if not pairs:
        return {"pairs": 0}
    gaps = [abs(a["ratio"] - b["ratio"]) for a, b in pairs]
    return {"pairs": len(pairs), "beyond_2se": sum(beyond(a, b) for a, b in pairs) / len(pairs),
            "gap_median": statistics.median(gaps), "gap_p90": sorted(gaps)[int(0.9 * (len(gaps) - 1))],
            "se_median": statistics.median(a["se"] for a, _ in pairs)}


def analyze(first: dict, second: dict) -> dict:
    shapes = {tuple(s["shape"]): s for s in second["shapes"] if "sessions" in s}
    report = {}
    for what in ("readings", "costs"):
        within = {kind: [] for kind in KINDS}
        across = {kind: [] for kind in KINDS}
        for one in first["shapes"]:
            other = shapes.get(tuple(one["shape"]))
            if "sessions" not in one:
                continue
            for kind in KINDS:
                within[kind] += pairs_within(one["sessions"], kind, what)
                if other is not None:
                    across[kind] += pairs_across(one["sessions"], other["sessions"], kind, what)
        report[what] = {"within_process": {kind: summary(pairs) for kind, pairs in within.items() if pairs},
                        "across_processes": {kind: summary(pairs) for kind, pairs in across.items() if pairs}}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sessions", type=int, default=5, help="sessions of each kind per shape")
    parser.add_argument("--kinds", default="repeat,moved,reseeded", help=f"of {', '.join(KINDS)}")
    parser.add_argument("--analyze", nargs=2, metavar="RUN.json", help="compare two runs' files")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"--kinds {args.kinds}: {', '.join(sorted(unknown))} unknown; accepted: {', '.join(KINDS)}")
    if args.analyze:
        first, second = (json.load(open(path)) for path in args.analyze)
        report = analyze(first, second)
    else:
        import torch

        from gemmtune.device import current

        device = current()
        report = {"device": device.name, "torch": torch.__version__,
                  "shapes": [probe_shape(shape, device, args.sessions, kinds) for shape in SHAPES]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
