"""Host time per call of ``F.linear`` and of a cache-hit ``gemmtune.linear`` on tiny GEMMs,
one synchronous loop each, same process: the ``dispatch`` file of RESULTS.md.

    PYTHONPATH=src python3 benchmarks/dispatch.py --out dispatch.json
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
import torch.nn.functional as F
import triton

import gemmtune
from gemmtune.device import current

SHAPES = ((16, 16, 16), (1, 256, 256), (256, 1024, 1024))


def loop_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("dispatch.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("GEMMTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-dispatch-"))
    rows = []
    with torch.no_grad():
        for m, n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            gemmtune.linear(x, w)  # tunes: later calls are store hits served from the dispatch dict
            choice = gemmtune.tune(gemmtune.Problem(m, n, k))[0].label()
            torch_us = min(loop_us(lambda: F.linear(x, w), args.calls) for _ in range(3))
            ours_us = min(loop_us(lambda: gemmtune.linear(x, w), args.calls) for _ in range(3))
            rows.append({"shape": f"{m}x{n}x{k}", "dtype": "bfloat16", "choice": choice, "torch_us": torch_us,
                         "gemmtune_us": ours_us, "ratio": ours_us / torch_us})
            print(f"{m}x{n}x{k}: F.linear {torch_us:.2f} us, gemmtune.linear {ours_us:.2f} us "
                  f"(x{ours_us / torch_us:.2f}) [{choice}]", flush=True)
    doc = {"kind": "dispatch", "device": current().name, "torch": torch.__version__, "triton": triton.__version__,
           "gemmtune": gemmtune.__version__, "date": datetime.date.today().isoformat(), "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
