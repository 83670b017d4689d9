"""Probe: which cuBLAS kernel ``torch.addmm`` runs for a bias given three ways, and what each
call costs the host.

A compiled graph's library call of a linear layer gets its bias one of three ways, by torch
release and compile mode: a 1-D row (a default compile), the row expanded to (M, N) with row
stride 0 (the GEMM templates on, torch 2.11's ``aten::addmm`` candidate), or that expansion
through the compiler's ``bias_addmm`` wrapper, which slices the row back out in Python. Per
shape: each way's CUDA kernels over a few calls (torch.profiler), and the wall and host time per
call queued, the three ways timed in interleaved rounds (``measure.host_rounds``). Written as JSON, nothing printed.

    PYTHONPATH=src python3 benchmarks/probes/addmm_bias.py OUT.json
"""
import argparse
import json

import torch
from torch._inductor.kernel.mm import bias_addmm

from gemmtune.device import current
from gemmtune.tuning.measure import host_rounds

SHAPES = ((4096, 768, 768), (4096, 3072, 768), (4096, 768, 3072), (16, 768, 768), (256, 2304, 768))
ROUNDS, CALLS = 15, 200


def ways(m: int, n: int, k: int) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    row = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    expanded = row.expand(m, n)
    return {"row": lambda: torch.addmm(row, a, b), "expanded": lambda: torch.addmm(expanded, a, b),
            "bias_addmm": lambda: bias_addmm(expanded, a, b)}


def kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def shape_row(m: int, n: int, k: int) -> dict:
    calls = ways(m, n, k)
    for fn in calls.values():
        fn()
    ref = calls["row"]().float()
    row = {"shape": [m, n, k], "kernels": {name: kernels(fn) for name, fn in calls.items()},
           "max_diff": {name: float((fn().float() - ref).abs().max()) for name, fn in calls.items()}}
    timed = host_rounds(calls, current(), rounds=ROUNDS, calls=CALLS)  # queued calls, interleaved rounds
    row["wall_us"] = {name: loop.median * 1e3 for name, (loop, _) in timed.items()}
    row["host_us"] = {name: host.median * 1e3 for name, (_, host) in timed.items()}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON file to write")
    args = parser.parse_args()
    doc = {"kind": "probe-addmm-bias", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rows": [shape_row(*shape) for shape in SHAPES]}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
