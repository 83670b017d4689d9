"""Probe: where ``gemmtune tune --gpus all`` loses to one GPU on a host of several.

The fleet zoo (benchmarks/fleet.py) tuned from empty stores by each run of ``--runs`` (a name,
``=``, the tune arguments; ``+warm`` reuses the Triton cache the run before it filled; ``@N`` sets
GEMMTUNE_COMPILE_WORKERS=N), and per run: its seconds, its problems' tuning seconds summed, and
per tenth of the zoo in hand-out order (costliest first) the median ratio of a problem's tuning
seconds to the plain run's.

    PYTHONPATH=src python3 benchmarks/probes/spread_phases.py OUT.json [--runs plain=,all=--gpus all,...]
"""
import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fleet  # noqa: E402

from gemmtune.store import Store  # noqa: E402

log = logging.getLogger("gemmtune.probe")


def run(spec: str, index: int, shapes: Path, work: Path, previous_cache: Path | None) -> tuple[dict, Path]:
    name, _, rest = spec.partition("=")
    workers = None
    if "@" in name:
        name, workers = name.split("@")
    warm = name.endswith("+warm")
    cache = previous_cache if warm and previous_cache else work / f"run{index}-triton"
    if workers is not None:
        os.environ["GEMMTUNE_COMPILE_WORKERS"] = workers
    else:
        os.environ.pop("GEMMTUNE_COMPILE_WORKERS", None)
    store = work / f"run{index}.sqlite"  # each run from an empty store
    seconds = fleet.tune(shapes, store, cache, rest.split(), 500.0)
    tune_s = {r.problem_key: r.tune_s for r in Store(store).choices()}
    return {"run": spec, "seconds": seconds, "work_s": sum(tune_s.values()), "tune_s": tune_s}, cache


def tenths(rows: dict, plain: dict, order: list[str]) -> list[float]:
    ratios = [rows[key] / plain[key] for key in order if key in rows and plain.get(key)]
    size = max(1, len(ratios) // 10)
    return [round(statistics.median(ratios[i:i + size]), 3) for i in range(0, len(ratios), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", default="plain=,all=--gpus all,all+warm=--gpus all")
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    problems = fleet.zoo(args.count, tiny=False)
    result = {"kind": "probe", "date": time.strftime("%Y-%m-%d"), "runs": [],
              "note": "per run: wall seconds, tuning seconds summed, per tenth of the zoo in hand-out order the "
                      "median ratio of a problem's tuning seconds to the plain run's"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shapes = work / "zoo.json"
        shapes.write_text(json.dumps({"shapes": problems}))
        cache = None
        for index, spec in enumerate(args.runs.split(",")):
            row, cache = run(spec, index, shapes, work, cache)
            result["runs"].append(row)
            log.warning("%s: %.1f s, work %.1f s", spec, row["seconds"], row["work_s"])
    plain = result["runs"][0]["tune_s"]
    by_cost = sorted(plain, key=lambda key: -_macs(key))
    for row in result["runs"]:
        row["tenths"] = tenths(row["tune_s"], plain, by_cost)
        log.warning("%s tenths: %s", row["run"], row["tenths"])
    args.out.write_text(json.dumps(result, indent=1))


def _macs(key: str) -> int:
    m, n, k = (int(v) for v in key.split("/")[3].split("x"))
    return m * n * k


if __name__ == "__main__":
    main()
