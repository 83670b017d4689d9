"""The stream kernel on few SMs: at 38 SMs the m=16 rows' 64 or 96 tiles of 64 weight rows fill
two or three rounds of persistent programs, the last one part-empty (64 tiles on 38 programs keep
84% of the slots busy). Shallower pipelines fit two or three programs on an SM, so that every tile
is resident at once. Times the stream kernel's tiles at several depths and residencies beside
cuBLAS, each result checked against float64.

    PYTHONPATH=src python3 benchmarks/stream_residency.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch

from gemmtune.tuning import measure, verify
from gemmtune.backends import triton_stream
from gemmtune.backends.cublas import BACKEND as CUBLAS
from gemmtune.backends.triton_stream import StreamConfig, StreamKernel
from gemmtune.device import current
from gemmtune.problem import Problem

ROWS = {"qkv.m16": (16, 6144, 4096), "o.m16": (16, 4096, 4096), "down.m16": (16, 4096, 14336),
        "gate_up.m16": (16, 28672, 4096)}
TILES = [(64, 256, 4), (64, 256, 3), (64, 256, 2), (64, 128, 6), (64, 128, 4), (64, 128, 3), (64, 128, 2),
         (128, 128, 3), (128, 128, 2), (64, 64, 4)]


def main() -> None:
    dev = current()
    out_rows = []
    for name, (m, n, k) in ROWS.items():
        p = Problem(m, n, k, "bfloat16", "linear")
        inp = verify.make_inputs(p, "cuda", seed=0)
        cublas = CUBLAS.build(p, CUBLAS.candidates(p, dev)[0], dev)
        fns = {"cublas": lambda: cublas(inp.a, inp.b, None)}
        errs = {}
        for bn, bk, stages in TILES:
            config = StreamConfig(16, bn, bk, 4, stages)
            if config.smem_bytes(2) > dev.smem_per_block:
                continue
            fit = max(1, dev.smem_per_block // config.smem_bytes(2))
            for resident in range(1, min(3, fit) + 1):
                triton_stream.MAX_RESIDENT = resident
                kernel = StreamKernel(p, config, dev)
                label = f"{bn}x{bk}s{stages}r{resident}"
                errs[label] = verify.check(kernel, p, inp).rel_err
                fns[label] = lambda kern=kernel: kern(inp.a, inp.b, None)
        triton_stream.MAX_RESIDENT = 2
        t = measure.measure(fns, dev, budget_ms=1500, min_rounds=30)
        us = {label: v.median * 1e3 for label, v in t.items()}
        best = min((v, lab) for lab, v in us.items() if lab != "cublas")
        row = {"row": name, "us": us, "rel_err": errs, "best": best[1], "best_vs_cublas": us["cublas"] / best[0]}
        out_rows.append(row)
        print(name, {lab: round(v, 1) for lab, v in sorted(us.items(), key=lambda kv: kv[1])},
              f"best {best[1]} {row['best_vs_cublas']:.3f}x cuBLAS", "max err", f"{max(errs.values()):.1e}", flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "sm_count": dev.sm_count, "rows": out_rows},
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
