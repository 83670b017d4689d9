"""Host time per call of the ways a compiled Triton kernel can be launched, beside F.linear, on a
tiny GEMM where host time is everything: the measurement behind the lean hot path's design.

    PYTHONPATH=src python3 benchmarks/launch.py --out launch.json

- ``F.linear``: torch's dispatch to cuBLAS;
- ``gemmtune.linear``: the public call on a store hit (checks, dispatch dict, the kernel wrapper);
- ``TiledKernel``: the wrapper alone (argument setup, then Triton's JIT launch path);
- ``jit[grid]``: Triton's JIT launch with arguments prepared once (binder, cache key, launch);
- ``compiled[grid]``: the saved CompiledKernel's runner (no binder, no cache lookup);
- ``compiled.run``: its raw launcher with every argument prepared once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import gemmtune
from gemmtune.backends.triton_tiled import BACKEND, TiledConfig
from gemmtune.device import current
from gemmtune.dispatch import DISPATCHER
from gemmtune.kernels.tiled import tiled_matmul
from gemmtune.problem import Problem


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e6 / calls)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("launch.py needs a CUDA GPU", file=sys.stderr)
        return 2
    m = n = k = 16
    problem = Problem(m, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    wrapper = BACKEND.build(problem, TiledConfig(16, 16, 16, 8, 1, 1), current())
    wrapper(x, w, None)
    key = ("linear", m, n, k, x.dtype, False, False, "none", x.get_device())
    DISPATCHER.kernels[key] = wrapper  # a store hit served by the tiled kernel
    consts = dict(wrapper._constexprs, HAS_BIAS=False)
    params = (x, w, out, out, m, n, k, x.stride(0), x.stride(1), w.stride(1), w.stride(0), out.stride(0), out.stride(1))
    grid = (1,)
    compiled = tiled_matmul[grid](*params, **consts)
    runner = compiled[grid]
    # The raw launcher takes every parameter in declaration order, constexprs included.
    names = tiled_matmul.arg_names
    values = dict(zip(names, params)) | consts
    ordered = [values[name] for name in names]
    stream = torch.cuda.current_stream().cuda_stream
    compiled._init_handles()
    raw = compiled.run

    ways = {
        "F.linear": lambda: F.linear(x, w),
        "gemmtune.linear": lambda: gemmtune.linear(x, w),
        "TiledKernel": lambda: wrapper(x, w, None),
        "jit[grid]": lambda: tiled_matmul[grid](*params, **consts),
        "compiled[grid]": lambda: runner(*ordered),
        "compiled.run": lambda: raw(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                                    *ordered),
    }
    expected = F.linear(x, w)
    for name in ("TiledKernel", "jit[grid]", "compiled[grid]", "compiled.run"):
        out.fill_(float("nan"))
        result = ways[name]()
        torch.cuda.synchronize()
        got = result if name == "TiledKernel" else out
        if not torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2):
            print(f"{name}: WRONG RESULT", file=sys.stderr)
            return 1
    rows = []
    with torch.no_grad():
        for name, fn in ways.items():
            us = per_call_us(fn, args.calls)
            rows.append({"way": name, "host_us_per_call": us})
            print(f"{name:16s} {us:7.2f} us/call", flush=True)
    torch_us = rows[0]["host_us_per_call"]
    for row in rows:
        row["ratio_to_f_linear"] = row["host_us_per_call"] / torch_us
    doc = {"kind": "launch", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": datetime.date.today().isoformat(), "shape": f"{m}x{n}x{k}",
           "dtype": "bfloat16", "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
