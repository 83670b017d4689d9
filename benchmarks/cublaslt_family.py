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
import os
import re
import sys

import torch

from cublaslt_space import caps, report, rows_of, screen_and_final, verified, write
from gemmtune.tuning import verify
from gemmtune.device import current

BAND = 48


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
    dims, header = tile_table()
    rows = []
    for named, t0, matmul, ranked in rows_of(groups):
        candidates = [(f"ranked{r}", c, {"rank": r, "d_rows": 0, "d_cols": 0, **c}) for r, c in enumerate(ranked) if r] + \
                     [(f"family{i}", c, {"rank": r, "d_rows": da, "d_cols": db, **c})
                      for i, (r, da, db, c) in enumerate(family(ranked, matmul._types, dims))]
        inputs = verify.make_inputs(named.problem, "cuda")
        kernels, rejected, wrong = verified(named, inputs, candidates, device)
        screened, finals, best_ranked, ref = screen_and_final(named, inputs, kernels, device)
        screened_records = {n: {"vs_torch": screened[n], "dims": dims.get(kernels[n][0]["tile"]), **kernels[n][0]}
                            for n in screened}
        rows.append(report(named, t0, len(candidates), rejected, wrong, finals, best_ranked, ref,
                           ranked_dims=[dims.get(c["tile"]) for c in ranked], screened=screened_records))
        del inputs, kernels
        torch.cuda.empty_cache()
        write(path, "cublaslt-family", device, rows, band=BAND, header=header,
              tiles={str(i): d for i, d in sorted(dims.items())})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
