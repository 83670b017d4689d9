"""Does cuBLAS read its output buffer? At 38 SMs (MPS) verification saw cuBLAS give non-finite
results on some shapes (odd-1k; 1x4104x4096 and 16x4104x4096 linear). Verification writes into a
NaN-filled output (``out=``); if cuBLAS's chosen kernel reads C although beta is 0, the NaN
comes from the poison, not from the product, and a plain call is right. Each shape: the product
into a NaN-filled, a zero-filled and a fresh output, each against float64, several times.

    PYTHONPATH=src python3 benchmarks/cublas_poison.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch

from gemmtune.tuning import verify
from gemmtune.device import current
from gemmtune.problem import Problem

SHAPES = ((1, 4104, 4096, "linear"), (16, 4104, 4096, "linear"), (1000, 1000, 1000, "nn"),
          (1, 4096, 4096, "linear"), (4096, 4096, 4096, "nn"))


def product(p: Problem, a, b, out=None):
    rhs = b.t() if p.layout == "linear" else b
    return torch.mm(a, rhs) if out is None else torch.mm(a, rhs, out=out)


def main() -> None:
    rows = []
    for m, n, k, layout in SHAPES:
        p = Problem(m, n, k, "bfloat16", layout)
        errs: dict[str, list] = {"nan_out": [], "zero_out": [], "fresh": []}
        for seed in range(3):
            inp = verify.make_inputs(p, "cuda", seed=seed)
            for label, fill in (("nan_out", float("nan")), ("zero_out", 0.0)):
                out = torch.full((m, n), fill, dtype=torch.bfloat16, device="cuda")
                product(p, inp.a, inp.b, out)
                errs[label].append(verify.rel_err(out, inp.reference))
            errs["fresh"].append(verify.rel_err(product(p, inp.a, inp.b), inp.reference))
        rows.append({"shape": p.describe(), "rel_err": errs})
        print(p.describe(), {key: [f"{e:.1e}" for e in v] for key, v in errs.items()}, flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "sm_count": current().sm_count, "rows": rows},
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
