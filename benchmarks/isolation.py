"""The crash-isolation proof: tuning with a candidate that makes an illegal memory access, one
that kills its process and one that hangs, each in gemmtune's worker process. For each: the
failed trial and its reason, the worker restarts, the choice tuning still made, and a GEMM this
process runs afterwards, checked against float64 (its CUDA context must be untouched).

    PYTHONPATH=src python3 benchmarks/isolation.py --out isolation.json

GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

import gemmtune
from faulty import Dies, Hangs, Scribbles
from gemmtune.tuning import verify
from gemmtune.device import current
from gemmtune.problem import Problem
from gemmtune.tuning.tuner import TuneOptions, tune_problem
from gemmtune.tuning.worker import IsolatedRunner

PROBLEM = Problem(256, 512, 512, "bfloat16", "linear")
OPTIONS = TuneOptions(strategy="exhaustive", backends=("cublas", "triton_tiled"))
HANG_TIMEOUT_S = 20


def this_process_still_computes() -> float:
    """A GEMM in the parent after the faults: its error against float64."""
    inputs = verify.make_inputs(PROBLEM, "cuda", seed=1)
    out = torch.nn.functional.linear(inputs.a, inputs.b)
    return verify.rel_err(out, inputs.reference)


def scenario(name: str, factory, flag_dir: str) -> dict:
    os.environ["GEMMTUNE_ISOLATION_FLAG"] = os.path.join(flag_dir, name)
    started = time.perf_counter()
    with IsolatedRunner(current(), timeout_s=HANG_TIMEOUT_S, runner_factory=factory) as runner:
        result = tune_problem(PROBLEM, current(), options=OPTIONS, runner=runner)
        restarts = runner.restarts
    err = this_process_still_computes()
    failed = [{"backend": t.backend, "config": t.config, "status": t.status.value, "reason": t.reason}
              for t in result.trials if not t.ok]
    return {"scenario": name, "seconds": time.perf_counter() - started, "trials": len(result.trials),
            "ok_trials": sum(t.ok for t in result.trials), "failed": failed, "worker_restarts": restarts,
            "choice": result.label(), "choice_rel_err": result.rel_err,
            "parent_gemm_rel_err": err, "parent_ok": err <= verify.tolerance(PROBLEM)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("isolation.py needs a CUDA GPU", file=sys.stderr)
        return 2
    doc = {"kind": "isolation", "device": current().name, "torch": torch.__version__, "triton": triton.__version__,
           "gemmtune": gemmtune.__version__, "date": datetime.date.today().isoformat(),
           "problem": PROBLEM.describe(), "rows": []}
    with tempfile.TemporaryDirectory() as flags:
        for name, factory in (("illegal memory access", Scribbles), ("process killed", Dies), ("hang", Hangs)):
            row = scenario(name, factory, flags)
            doc["rows"].append(row)
            args.out.write_text(json.dumps(doc, indent=1))
            reasons = "; ".join(f"{f['status']}: {f['reason'][:80]}" for f in row["failed"]) or "none"
            print(f"{name:22s} {row['ok_trials']}/{row['trials']} trials ok, {row['worker_restarts']} restart(s), "
                  f"choice {row['choice']}, parent GEMM {'ok' if row['parent_ok'] else 'WRONG'} "
                  f"({row['seconds']:.1f} s); failed: {reasons}", flush=True)
    return 0 if all(r["parent_ok"] and r["failed"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
