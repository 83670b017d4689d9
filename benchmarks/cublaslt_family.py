"""Is there a cheap way into cuBLASLt's neighbours? Step 23's exhaustive probe found the winners
beyond the ranked eight among tiles one dimension away from a ranked tile (128x144 and 128x168
beside the ranked 128x160). For each row: every tile of the algorithm's capabilities that keeps
one dimension of a ranked configuration's tile and moves the other by at most BAND elements
(everything else of that configuration kept), checked by cuBLAS, verified against float64,
screened side by side with torch's call, the best few then timed in the suite's way. Each
candidate's base rank and dimension change are recorded, so that narrower rules can be judged
from one run.

The tile sizes come from cuBLAS's own header (``cublasLt.h``) where the machine has it; the
table found is written beside the rows.

    PYTHONPATH=src:benchmarks python3 benchmarks/cublaslt_family.py OUT.json [GROUP ...]
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys
import time

import torch

from cublaslt_space import FINALISTS, caps
from gemmtune import backends, bench, cublaslt, shapes, verify
from gemmtune.device import current
from gemmtune.sidebyside import torch_call

BAND = 48
CHUNK = 24


def tile_table() -> tuple[dict[int, tuple[int, int]], str]:
    """{tile id: (rows, columns)} from the first cublasLt.h found, and its path."""
    roots = [os.path.dirname(torch.__file__) + "/../nvidia", "/usr/local/cuda*/include", "/usr/include"]
    for root in roots:
        for path in sorted(glob.glob(f"{root}/**/cublasLt.h", recursive=True)) + sorted(glob.glob(f"{root}/cublasLt.h")):
            text = open(path).read()
            table = {int(i): (int(a), int(b)) for a, b, i in re.findall(r"CUBLASLT_MATMUL_TILE_(\d+)x(\d+)\s*=\s*(\d+)", text)}
            if table:
                return table, path
    raise SystemExit("no cublasLt.h with the tile enum on this machine")


def family(ranked: list[dict], types: tuple, dims: dict) -> list[tuple[int, int, int, dict]]:
    """(base rank, change in rows, change in columns, config) of every family member."""
    seen = {tuple(c.values()) for c in ranked}
    found = []
    for rank, base in enumerate(ranked):
        if base["tile"] not in dims:
            continue
        a, b = dims[base["tile"]]
        for tile in caps(base["algo"], types)["tile"]:
            if tile not in dims:
                continue
            ta, tb = dims[tile]
            if not ((ta == a and 0 < abs(tb - b) <= BAND) or (tb == b and 0 < abs(ta - a) <= BAND)):
                continue
            config = {**base, "tile": tile}
            if tuple(config.values()) not in seen:
                seen.add(tuple(config.values()))
                found.append((rank, ta - a, tb - b, config))
    return found


def main(path: str, groups: list[str]) -> None:
    device = current()
    backend = backends.get("cublaslt")
    dims, header = tile_table()
    rows = []
    for named in shapes.load():
        if named.group not in (groups or ["prefill", "mid"]):
            continue
        p = named.problem
        if p.bias or not p.rows_aligned:
            continue
        t0 = time.perf_counter()
        torch.set_float32_matmul_precision("high" if p.tf32 else "highest")
        matmul = cublaslt.Matmul(p, torch.cuda.current_device())
        ranked = matmul.heuristics(8)
        members = family(ranked, matmul._types, dims)
        candidates = [(f"ranked{r}", r, 0, 0, c) for r, c in enumerate(ranked) if r] + \
                     [(f"family{i}", r, da, db, c) for i, (r, da, db, c) in enumerate(members)]
        inputs = verify.make_inputs(p, "cuda")
        kernels, rejected, wrong = {}, 0, 0
        for name, rank, da, db, config in candidates:
            try:
                kernel = backend.build(p, backend.parse_config(config), device)
            except (cublaslt.CublasLtError, ValueError):
                rejected += 1
                continue
            if verify.check(kernel, p, inputs) > verify.tolerance(p):
                wrong += 1
                continue
            kernels[name] = ({"rank": rank, "d_rows": da, "d_cols": db, "dims": dims.get(config["tile"]), **config}, kernel)
        screened = {}
        names = list(kernels)
        for start in range(0, len(names), CHUNK):
            chunk = names[start:start + CHUNK]
            fns = {n: (lambda k: lambda: k(inputs.a, inputs.b, None))(kernels[n][1]) for n in chunk}
            fns["torch"] = torch_call(named, inputs)
            timings = bench.measure(fns, device, budget_ms=100, min_rounds=3)
            for n in chunk:
                screened[n] = timings["torch"].median / timings[n].median
            torch.cuda.empty_cache()
        best = sorted(screened, key=screened.get, reverse=True)[:FINALISTS]
        best_ranked = max((n for n in screened if n.startswith("ranked")), key=screened.get, default=None)
        final_names = list(dict.fromkeys(best + ([best_ranked] if best_ranked else [])))
        fns = {n: (lambda k: lambda: k(inputs.a, inputs.b, None))(kernels[n][1]) for n in final_names}
        fns["torch"] = torch_call(named, inputs)
        timings = bench.measure(fns, device, budget_ms=1000, min_rounds=20)
        ref = timings["torch"]
        finals = {n: {"vs_torch": ref.median / timings[n].median, "noise": timings[n].spread_against(ref)}
                  for n in final_names}
        top = max(finals, key=lambda n: finals[n]["vs_torch"])
        row = {"name": named.name, "group": named.group, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
               "ranked_dims": [dims.get(c["tile"]) for c in ranked],
               "candidates": len(candidates), "rejected": rejected, "wrong": wrong,
               "screened": {n: {"vs_torch": screened[n], **kernels[n][0]} for n in names},
               "torch_ms": ref.median, "finals": finals, "best": top, "best_vs_torch": finals[top]["vs_torch"],
               "best_ranked_vs_torch": finals[best_ranked]["vs_torch"] if best_ranked else None,
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{named.name:26s} {len(candidates):4d} tried, {rejected:4d} rejected, {wrong} wrong; "
              f"best {top} {row['best_vs_torch']:.3f}x, best ranked {row['best_ranked_vs_torch'] or 0:.3f}x "
              f"({row['seconds']:.0f} s)", flush=True)
        del inputs, kernels, fns
        torch.cuda.empty_cache()
        with open(path, "w") as f:
            json.dump({"kind": "cublaslt-family", "device": device.name, "sm_count": device.sm_count,
                       "torch": torch.__version__, "band": BAND, "header": header,
                       "tiles": {str(i): d for i, d in sorted(dims.items())}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
