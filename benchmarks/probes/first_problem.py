"""Probe: what a process's first tuned problem pays that the next does not.

A fresh process tunes ``--shapes`` (bf16 linear problems, M x N x K) one after another on the GPU
with the candidates in this process (``runner.LocalRunner``), each under cProfile, twice: first
with empty caches (Triton's compiles), then in a second fresh process with the caches the first
filled and an empty store. Per process and problem: its tuning seconds and the functions that
took most of it (cumulative), so the first problem's excess over the second's reads as the
process's own set-up. Also the process's imports and its CUDA context's start.

    PYTHONPATH=src python3 benchmarks/probes/first_problem.py OUT.json [--shapes 64x4096x4096,33x4096x4096]
"""
import argparse
import cProfile
import json
import logging
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("gemmtune.probe")
TOP = 30


def child(shapes: list[str]) -> dict:
    """In this process: the imports, the context, then each problem tuned under cProfile."""
    row = {}
    started = time.perf_counter()
    import torch

    row["import_torch_s"] = time.perf_counter() - started
    started = time.perf_counter()
    torch.zeros(1, device="cuda")
    row["cuda_context_s"] = time.perf_counter() - started
    started = time.perf_counter()
    from gemmtune.device import current
    from gemmtune.problem import Problem
    from gemmtune.tuning.runner import LocalRunner
    from gemmtune.tuning.tuner import tune_problem

    row["import_gemmtune_s"] = time.perf_counter() - started
    device = current(0)
    runner = LocalRunner(device)
    row["problems"] = []
    for shape in shapes:
        m, n, k = (int(v) for v in shape.split("x"))
        problem = Problem(m=m, n=n, k=k, dtype="bfloat16")
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        result = tune_problem(problem, device, runner=runner)
        profile.disable()
        seconds = time.perf_counter() - started
        stats = pstats.Stats(profile)
        top = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:TOP]
        row["problems"].append({"shape": shape, "seconds": seconds, "choice": result.label(),
                                "trials": len(result.trials),
                                "cumulative": [[f"{path.rsplit('/', 2)[-1]}:{line}:{name}", round(entry[3], 4)]
                                               for (path, line, name), entry in top]})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--shapes", default="64x4096x4096,33x4096x4096,64x11008x4096")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.child).write_text(json.dumps(child(args.shapes.split(","))))
        return
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    result = {"kind": "probe", "date": time.strftime("%Y-%m-%d"), "shapes": args.shapes, "runs": {},
              "note": "a fresh process tuning the shapes in turn (candidates in-process), cold caches, then "
                      "warm caches and an empty store; per problem its seconds and costliest functions (cumulative)"}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TRITON_CACHE_DIR": f"{tmp}/triton"}
        env["GEMMTUNE_CACHE_DIR"] = f"{tmp}/gemmtune"  # Triton's key kept there, as for a user's second process
        for name in ("cold", "warm"):
            out = Path(tmp) / f"{name}.json"
            started = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--child", str(out), "--shapes", args.shapes], env=env,
                           check=True)
            row = json.loads(out.read_text())
            row["process_s"] = time.perf_counter() - started
            result["runs"][name] = row
            log.warning("%s: process %.1f s, torch %.2f s, context %.2f s, gemmtune %.2f s, problems %s", name,
                        row["process_s"], row["import_torch_s"], row["cuda_context_s"], row["import_gemmtune_s"],
                        [round(p["seconds"], 2) for p in row["problems"]])
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
