"""What a cuBLASLt candidate's call costs the host, beside F.linear's and a Triton kernel's bound
launch: each decode shape's cuBLASLt candidates through ``api.linear``'s front path (their bound
call), the host's time per call up to the last launch (``measure.host_times``), best of five
alternating rounds. Selection drops a candidate whose call takes the host more than HOST_SLACK
longer than cuBLAS's.

    PYTHONPATH=src:benchmarks python3 benchmarks/lt_host.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from gemmtune import backends
from gemmtune.tuning import measure
from gemmtune.device import current
from gemmtune.backends.launch import front_entry
from gemmtune.problem import Problem

SHAPES = ((1, 6144, 4096), (16, 6144, 4096), (16, 28672, 4096), (16, 4096, 14336), (128, 4096, 4096))
ROUNDS = 5


def bound(kernel, x, w):
    kernel(x, w, None)  # a Triton kernel binds its launch only once a call has made the binary
    call = front_entry(kernel, x, w, None)
    px, pw = x.data_ptr(), w.data_ptr()
    return lambda: call(x, w, None, px, pw, 0)


def main(path: str) -> None:
    device = current()
    rows = []
    for m, n, k in SHAPES:
        problem = Problem(m, n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        calls = {"F.linear": lambda: F.linear(x, w)}
        lt = backends.get("cublaslt")
        for i, config in enumerate(lt.candidates(problem, device)[:3]):
            calls[f"cublaslt{i}"] = bound(lt.build(problem, config, device), x, w)
        stream = backends.get("triton_stream")
        configs = stream.candidates(problem, device) if stream.is_available(device) else []
        if configs:
            calls["triton_stream"] = bound(stream.build(problem, configs[0], device), x, w)
        best = {name: float("inf") for name in calls}
        for _ in range(ROUNDS):
            for name, call in calls.items():
                best[name] = min(best[name], measure.host_times(call, device, calls=200)[1] * 1e3)
        row = {"m": m, "n": n, "k": k, "host_us": best}
        rows.append(row)
        print(f"{m}x{n}x{k}: " + ", ".join(f"{name} {us:.1f} us" for name, us in best.items()), flush=True)
    with open(path, "w") as f:
        json.dump({"kind": "lt-host", "device": device.name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
