"""The measuring noise between identical kernels: one ``F.linear`` call captured in three CUDA
graphs and timed side by side (``measure.measure``, as the suite times cuBLAS against gemmtune's
choice), three times, on two decode rows. Where gemmtune keeps cuBLAS, the suite's two columns
are the same kernel, and their ratio reads within this spread of 1.0.

    PYTHONPATH=src python3 benchmarks/same_kernel.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch.nn.functional as F

from gemmtune.tuning import measure, verify
from gemmtune.device import current
from gemmtune.problem import Problem

ROWS = {"gate_up.m16": (16, 28672, 4096), "qkv.m16": (16, 6144, 4096)}


def main() -> None:
    out = {}
    for name, (m, n, k) in ROWS.items():
        p = Problem(m, n, k, "bfloat16", "linear")
        inputs = verify.make_inputs(p, "cuda")
        a, b = inputs.a, inputs.b
        rows = []
        for trial in range(3):
            fns = {f"copy{i}": (lambda: F.linear(a, b)) for i in range(3)}
            t = measure.measure(fns, current(), budget_ms=1500, min_rounds=50, seed=trial)
            rows.append({k2: round(v.median * 1e3, 2) for k2, v in t.items()})
        out[name] = rows
        print(name, rows, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
