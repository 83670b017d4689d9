"""The host's own time per call (``measure.host_times``: a loop of 100 calls timed up to its last
launch) of the call the front path makes for each kind of kernel, on the m=16 decode rows: what
selection's host rule compares. ``F.linear`` itself, cuBLAS through the front path, a bound
split-K launch, and ``triton_stream``'s call (two TMA descriptors built and encoded per call).

    PYTHONPATH=src python3 benchmarks/host_cost.py --out host-cost.json

GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from gemmtune import backends
from gemmtune.tuning import measure, verify
from gemmtune.device import current
from gemmtune.backends.launch import front_entry
from gemmtune.problem import Problem

ROWS = {"qkv.m16": (16, 6144, 4096), "down.m16": (16, 4096, 14336)}
KERNELS = {
    "cublas": {},
    "triton_splitk": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1, "USE_DOT": True,
                      "num_warps": 2, "num_stages": 3},
    "triton_stream": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
}


def row(name: str, m: int, n: int, k: int, repeats: int) -> dict:
    problem = Problem(m, n, k)
    inputs = verify.make_inputs(problem, "cuda", seed=0)
    x, w = inputs.a, inputs.b
    px, pw = x.data_ptr(), w.data_ptr()
    calls = {"F.linear": lambda: F.linear(x, w)}
    for backend, config in KERNELS.items():
        kernel = backends.build(problem, backend, config, current())
        kernel(x, w, None)  # compiles, and makes the binary the bound launch needs
        front = front_entry(kernel, x, w, None)
        calls[backend] = lambda front=front: front(x, w, None, px, pw, 0)
    issue = {label: [] for label in calls}
    loop = {label: [] for label in calls}
    for _ in range(repeats):  # alternated, so the host's drift hits every call alike
        for label, call in calls.items():
            t_loop, t_issue = measure.host_times(call, current())
            loop[label].append(t_loop * 1e3)
            issue[label].append(t_issue * 1e3)
    result = {"name": name, "m": m, "n": n, "k": k,
              "host_us": {label: statistics.median(v) for label, v in issue.items()},
              "loop_us": {label: statistics.median(v) for label, v in loop.items()}}
    print(name, {label: round(v, 1) for label, v in result["host_us"].items()}, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("host_cost.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [row(name, *shape, args.repeats) for name, shape in ROWS.items()]
    args.out.write_text(json.dumps({"kind": "host-cost", "device": torch.cuda.get_device_name(),
                                    "date": datetime.date.today().isoformat(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
