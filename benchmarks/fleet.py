"""Tuning a zoo over every GPU of a host against one GPU: the ``fleet`` file of RESULTS.md.

A zoo of ``--count`` problems (126 at most) (the shapes of benchmarks/shapes/public.json and zoo.json, each
(n, k) at several row counts, bf16; deterministic) is tuned three times from empty stores and
empty Triton compile caches, each a ``gemmtune tune`` process:

    gpus_all      --gpus all: one worker process per GPU, every result into one store
    plain         no scheduler: the command's own tuning on one GPU
    gpus_1        --gpus 1: the same scheduler with one worker

and the file says:

- ``scaling = plain_s / gpus_all_s`` against the ideal ``gpus`` (the goal: >= 0.9 x gpus);
- ``scheduler_overhead = gpus_1_s / plain_s - 1`` (the goal: <= 5%);
- ``agreement``: the share of problems whose choice under ``--gpus all`` is the plain run's;
  for each that differs, ``loss`` = the plain run's trial median of the other choice over that of
  its own choice (both from the same run's trials; null where it did not time the other), so a
  difference within noise reads ~1.0.

    PYTHONPATH=src python3 benchmarks/fleet.py --out fleet.json [--count 126]

Without a GPU the workers run Triton's interpreter on a small zoo: NOT GPU timings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ROWS = (1, 16, 64, 256, 1024, 4096)


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
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "-c", "import sys; from gemmtune.cli import main; sys.exit(main(sys.argv[1:]))",
            "tune", "--from", str(shapes), "--store", str(store), *extra]
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"{' '.join(extra) or 'plain'}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return seconds


def agreement(plain: Path, spread: Path) -> dict:
    """The choices of the spread run against the plain run's, problem by problem."""
    from gemmtune.store import Store

    base, other = Store(plain), Store(spread)
    theirs = {(r.device, r.problem_key): r for r in other.choices()}
    same, differences = 0, []
    for ours in base.choices():
        their = theirs.get((ours.device, ours.problem_key))
        if their is None:
            differences.append({"problem": ours.problem_key, "missing": True})
        elif their.label() == ours.label():
            same += 1
        else:
            timed = {t.label(): t.median_ms for t in base.trials(ours.device, ours.problem_key) if t.ok}
            mine, other_ms = timed.get(ours.label()), timed.get(their.label())
            differences.append({"problem": ours.problem_key, "plain": ours.label(), "spread": their.label(),
                                "loss": other_ms / mine if other_ms and mine else None})
    total = len(base.choices())
    return {"problems": total, "same": same, "agreement": same / total if total else None,
            "differences": differences}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--count", type=int, default=126, help="problems in the zoo (default and most: 126)")
    parser.add_argument("--timeout-s", type=float, default=400.0, help="the longest one tuning run may take")
    args = parser.parse_args(argv)
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
        runs = {"gpus_all": ["--gpus", "all" if gpu else str(gpus)], "plain": [], "gpus_1": ["--gpus", "1"]}
        for name, extra in runs.items():
            result[f"{name}_s"] = tune(shapes, work / f"{name}.sqlite", work / f"{name}-triton", extra, args.timeout_s)
            print(f"{name}: {result[f'{name}_s']:.1f} s", file=sys.stderr, flush=True)
            if name == "plain":
                result["scaling"] = result["plain_s"] / result["gpus_all_s"]
                result |= agreement(work / "plain.sqlite", work / "gpus_all.sqlite")
            out.write_text(json.dumps(result, indent=1))
        result["scheduler_overhead"] = result["gpus_1_s"] / result["plain_s"] - 1
    out.write_text(json.dumps(result, indent=1))
    print(f"{gpus} GPUs: scaling {result['scaling']:.2f}x (ideal {gpus}), scheduler overhead "
          f"{result['scheduler_overhead']:+.1%}, agreement {result['same']}/{result['problems']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
