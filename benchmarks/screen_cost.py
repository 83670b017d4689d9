"""Where a library candidate's screening time goes: per cuBLASLt candidate of a problem, the wall
time of building and verifying it, and of the runner's whole evaluate (build, verify, screening
measurement); beside it, one measurement of all of them side by side on the same budget.

    PYTHONPATH=src:benchmarks python3 benchmarks/screen_cost.py OUT.json
"""
from __future__ import annotations

import json
import sys
import time

import torch

from gemmtune import backends, shapes
from gemmtune.tuning import measure
from gemmtune.device import current
from gemmtune.tuning.runner import LocalRunner
from gemmtune.tuning.tuner import TuneOptions

NAMES = ("llama3-8b.o.m128", "llama3-8b.gate_up.m16", "llama3-8b.o.m2048", "llama3-8b.down.m2048",
         "llama3-8b.qkv.m8192", "blog-mlp")


def main(path: str) -> None:
    device, budget = current(), TuneOptions().screen_budget_ms
    backend = backends.get("cublaslt")
    rows = []
    for named in shapes.load():
        if named.name not in NAMES:
            continue
        p = named.problem
        runner = LocalRunner(device)
        runner.start(p, 0)
        configs = [c.as_dict() for c in backend.candidates(p, device)]
        runner.evaluate("cublas", {}, budget)  # loads what any first measurement loads
        verify_s, evaluate_s = [], []
        for config in configs:
            t0 = time.perf_counter()
            runner._build_and_verify("cublaslt", config)
            torch.cuda.synchronize()
            verify_s.append(time.perf_counter() - t0)
        for config in configs:
            t0 = time.perf_counter()
            runner.evaluate("cublaslt", config, budget)
            evaluate_s.append(time.perf_counter() - t0)
        labels = [label for label in runner._ready if label.startswith("cublaslt")]
        t0 = time.perf_counter()
        measure.measure({label: runner._bound(label) for label in labels}, device, budget_ms=budget, min_rounds=3)
        together_s = time.perf_counter() - t0
        row = {"name": named.name, "sm_count": device.sm_count, "candidates": len(configs),
               "build_verify_s": sum(verify_s), "evaluate_s": sum(evaluate_s), "together_s": together_s}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump({"kind": "screen-cost", "device": device.name, "sm_count": device.sm_count, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
