"""Host time per call of ``F.linear`` and of a cache-hit ``gemmtune.linear`` on tiny GEMMs,
one synchronous loop each, same process: the ``dispatch`` file of RESULTS.md. Each shape is
timed twice through gemmtune: served by its tuned choice, then by a tiled Triton kernel pinned in
the hot-path dict (the lean path's direct launch).

    PYTHONPATH=src python3 benchmarks/dispatch.py --out dispatch.json

The file's ``launch`` rows time the ways a compiled Triton kernel can be launched, on 16x16x16
(the measurement behind the lean hot path's design): the tiled kernel's wrapper (argument setup,
then Triton's JIT launch), the JIT launch with arguments prepared once (binder, cache key,
launch), the saved CompiledKernel's runner (no binder, no cache lookup), and its raw launcher
with every argument prepared once. Each is checked against F.linear before it is timed.
``torch.empty`` times the output allocation a call makes, which every path but the raw
launcher's pays; the other parts of a call's host path (the stream query, the guard, the API's
front path up to its dict hit) are timed alone too. The raw launcher also takes pointers as
integers, which skips its own ``data_ptr`` calls and the driver's check of each pointer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import gemmtune
from gemmtune.backends.triton_tiled import BACKEND, TiledConfig
from gemmtune.device import current
from gemmtune.serving import calls
from gemmtune.serving.dispatch import DISPATCHER
from gemmtune.backends.kernels.tiled import tiled_matmul
from gemmtune.backends.launch import gemm_hints
from gemmtune.problem import Problem

SHAPES = ((16, 16, 16), (1, 256, 256), (256, 1024, 1024))
PARTS = ("torch.empty", "stream query", "gemm_guard", "gemmtune.linear front path, no launch")


def loop_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def paired_us(ours, theirs, calls: int, pairs: int = 9) -> tuple[float, float, float]:
    """Loops of the two calls alternated ``pairs`` times: each one's median host us per call,
    and the median of the per-pair ratios (the host's speed drifts by tens of percent between
    seconds on the GPU machine; a ratio within a pair sees the same drift)."""
    samples = [(loop_us(ours, calls), loop_us(theirs, calls)) for _ in range(pairs)]
    return (statistics.median(o for o, _ in samples), statistics.median(t for _, t in samples),
            statistics.median(o / t for o, t in samples))


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
            ours_us, torch_us, ratio = paired_us(lambda: gemmtune.linear(x, w), lambda: F.linear(x, w), args.calls)
            rows.append({"shape": f"{m}x{n}x{k}", "dtype": "bfloat16", "choice": choice, "torch_us": torch_us,
                         "gemmtune_us": ours_us, "ratio": ratio})
            print(f"{m}x{n}x{k}: F.linear {torch_us:.2f} us, gemmtune.linear {ours_us:.2f} us "
                  f"(x{ratio:.2f}) [{choice}]", flush=True)
            # The same hit served by a Triton kernel: the hot-path dict pinned to a tiled config
            key = calls.dispatch_key("linear", x, None, m, n, k, "none")
            DISPATCHER.kernels[key] = BACKEND.build(Problem(m, n, k), TiledConfig(16, 64, 64, 8, 4, 3), current())
            DISPATCHER.front.clear()  # else the front path keeps serving the tuned choice
            expected = F.linear(x, w).float()
            ok = torch.allclose(gemmtune.linear(x, w).float(), expected, rtol=2e-2, atol=2e-2)
            triton_us, torch_us, ratio = paired_us(lambda: gemmtune.linear(x, w), lambda: F.linear(x, w), args.calls)
            rows.append({"shape": f"{m}x{n}x{k}", "dtype": "bfloat16", "choice": "triton_tiled (pinned)",
                         "torch_us": torch_us, "gemmtune_us": triton_us, "ratio": ratio, "correct": bool(ok)})
            print(f"{m}x{n}x{k}: F.linear {torch_us:.2f} us, gemmtune.linear {triton_us:.2f} us "
                  f"(x{ratio:.2f}) [triton_tiled pinned]{'' if ok else ' WRONG RESULT'}", flush=True)
    doc = {"kind": "dispatch", "device": current().name, "torch": torch.__version__, "triton": triton.__version__,
           "gemmtune": gemmtune.__version__, "date": datetime.date.today().isoformat(), "rows": rows,
           "launch": launch_rows(args.calls)}
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


def launch_rows(calls: int) -> list[dict]:
    m = n = k = 16
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    wrapper = BACKEND.build(Problem(m, n, k), TiledConfig(16, 16, 16, 8, 1, 1), current())
    params = (x, w, out, out, m, n, x.stride(0), x.stride(1), w.stride(1), w.stride(0), out.stride(0), out.stride(1),
              0, 0, 0)  # no batch; K is among the wrapper's constexprs
    consts = wrapper._constexprs[False] | gemm_hints(params[4:])
    compiled = tiled_matmul[(1,)](*params, **consts)
    runner = compiled[(1, 1, 1)]
    values = dict(zip(tiled_matmul.arg_names, params)) | consts  # the raw launcher: every parameter, in order
    ordered = [values[name] for name in tiled_matmul.arg_names]
    stream = torch.cuda.current_stream().cuda_stream
    compiled._init_handles()
    raw = compiled.run
    pointers = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in ordered]  # the launcher takes ints too
    from triton.runtime import driver

    from gemmtune.serving.calls import front_key
    from gemmtune.backends.launch import gemm_guard

    front = front_key(x, w, None, None, x.data_ptr(), w.data_ptr(), 0)
    DISPATCHER.front[front] = lambda x, w, bias, px, pw, pb: out  # the API's front path alone, no launch
    c_launch = raw.launch  # Triton's C launcher without CudaLauncher.__call__ (launch._raw_launch)
    assert raw.global_scratch_size == 0 and raw.profile_scratch_size == 0
    ways = {
        "F.linear": lambda: F.linear(x, w),
        "TiledKernel": lambda: wrapper(x, w, None, out=out),
        "jit[grid]": lambda: tiled_matmul[(1,)](*params, **consts),
        "compiled[grid]": lambda: runner(*ordered),
        "compiled.run": lambda: raw(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                                    *ordered),
        "compiled.run, int pointers": lambda: raw(1, 1, 1, stream, compiled.function, compiled.packed_metadata,
                                                  None, None, None, *pointers),
        "C launcher, int pointers": lambda: c_launch(
            1, 1, 1, stream, compiled.function, raw.launch_cooperative_grid, raw.launch_pdl, None, None,
            compiled.packed_metadata, None, None, None, *pointers),
        "compiled.run, data_ptr() per call": lambda: raw(
            1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
            x.data_ptr(), w.data_ptr(), out.data_ptr(), out.data_ptr(), *ordered[4:]),
        "torch.empty": lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
        "stream query": lambda: driver.active.get_current_stream(0),
        "gemm_guard": lambda: gemm_guard(x, w, None, None, x.stride(), w.stride(), x.data_ptr(), w.data_ptr(), 0),
        "gemmtune.linear front path, no launch": lambda: gemmtune.linear(x, w),
    }
    expected = F.linear(x, w).float()
    rows = []
    for name, fn in ways.items():
        out.fill_(float("nan"))
        result = fn()
        torch.cuda.synchronize()
        # the rows from torch.empty on launch nothing: each times one part of a call's host path
        ok = name in PARTS or torch.allclose((result if name == "F.linear" else out).float(), expected,
                                                     rtol=2e-2, atol=2e-2)
        us = statistics.median(loop_us(fn, calls) for _ in range(9))
        rows.append({"way": name, "host_us_per_call": us, "correct": bool(ok) if name not in PARTS else None})
        print(f"launch {name:16s} {us:7.2f} us/call{'' if ok else '  WRONG RESULT'}", flush=True)
    DISPATCHER.forget()
    return rows


if __name__ == "__main__":
    sys.exit(main())
