"""Where a process's first Triton compile goes, and what compiling ahead in threads costs: the
setup time of ``gemmtune.optimize`` from empty caches, taken apart.

Each case runs in a fresh process with its own Triton cache (empty, or left warm by the case
before it). Inside, Triton's compile stages, its C builds (the driver's utility module and each
kernel signature's launcher, compiled with the host's C compiler on a cache miss) and the
ptxas call are timed by wrapping them, so a first launch's seconds are split into imports,
CUDA start, C builds, MLIR passes, ptxas and loading.

    PYTHONPATH=src python3 benchmarks/cold_start.py --out cold.json

GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning.tuner import TuneOptions, _plan

CHILD = r"""
import collections, json, sys, time
t = {}
t0 = time.perf_counter(); import torch; t["import_torch"] = time.perf_counter() - t0
t0 = time.perf_counter(); import triton; t["import_triton"] = time.perf_counter() - t0
t0 = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize(); t["cuda_start"] = time.perf_counter() - t0
t0 = time.perf_counter(); import gemmtune.backends, gemmtune.tuning.verify; t["import_gemmtune"] = time.perf_counter() - t0
#PROBLEM

from triton.runtime import build
from triton.backends.nvidia import compiler as nv

spent = collections.defaultdict(float)
def timed(owner, name, label):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0
    static = isinstance(owner.__dict__.get(name), staticmethod)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)
timed(build, "_build", "c_build")
for stage in ("make_ttir", "make_ttgir", "make_llir", "make_ptx", "make_cubin"):
    timed(nv.CUDABackend, stage, stage)

from gemmtune import backends
from gemmtune.tuning import verify
from gemmtune.device import current
rows = []
for backend, config in json.loads(sys.argv[1]):
    spent.clear()
    t0 = time.perf_counter()
    kernel = backends.build(PROBLEM, backend, config, current())
    ops = verify.make_operands(PROBLEM, "cuda", seed=0)
    kernel(*ops); torch.cuda.synchronize()
    rows.append({"backend": backend, "config": config, "first_call_s": time.perf_counter() - t0, **spent})
print("RESULT", json.dumps({"process": t, "kernels": rows}), flush=True)
"""

THREADS = r"""
import json, os, sys, time
os.environ["GEMMTUNE_COMPILE_WORKERS"] = sys.argv[2]
t = {}
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda")
from gemmtune.device import current
from gemmtune.tuning.runner import LocalRunner
#PROBLEM
t["main_start"] = time.perf_counter() - t0
runner = LocalRunner(current())
runner.start(PROBLEM, 0)
t0 = time.perf_counter(); done = runner.compile([tuple(c) for c in json.loads(sys.argv[1])])
t["compile"] = time.perf_counter() - t0
t["per_candidate_s"] = sorted(round(d.seconds, 3) for d in done)
t["failed"] = [d.reason[:200] for d in done if d.status.value != "ok"]
print("RESULT", json.dumps(t), flush=True)
"""

# the seeds' MLP's first GEMM, which optimize compiles first
PROBLEM = Problem(256, 1024, 1024, "bfloat16", "linear", bias=True, activation="relu")


def child(src: str, args: list[str], cache: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    code = src.replace("#PROBLEM", f"from gemmtune.problem import Problem\nPROBLEM = Problem.from_key({PROBLEM.key()!r})")
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=400)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None:
        return {"error": (done.stdout + done.stderr)[-3000:]}
    return json.loads(line[len("RESULT "):])



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, nargs="*", default=[8, 4, 1], help="compile threads to try")
    args = parser.parse_args()
    planned = _plan(PROBLEM, current(), TuneOptions())  # the Triton candidates the tuner compiles ahead
    three = [planned[0], planned[1]] + [c for c in planned if c[0] != planned[0][0]][:1]
    doc = {"kind": "cold_start", "candidates": planned, "cases": []}
    # one process, three kernels (two of one signature, one of another): from an empty cache,
    # then again in a new process over the cache the first left
    cache = tempfile.mkdtemp()
    for case in ("one process, cache empty", "one process, cache warm"):
        doc["cases"].append({"case": case, **child(CHILD, [json.dumps(three)], cache)})
    # the tuner's compile ahead: the first GEMM's planned candidates in threads of a fresh
    # process, from an empty cache, then again in another over the cache the first left
    for workers in args.workers:
        cache = tempfile.mkdtemp()
        for case in ("empty", "warm"):
            done = child(THREADS, [json.dumps(planned), str(workers)], cache)
            doc["cases"].append({"case": f"{workers} threads, cache {case}", **done})
    args.out.write_text(json.dumps(doc, indent=1))
    for case in doc["cases"]:
        print(json.dumps(case)[:1500], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
