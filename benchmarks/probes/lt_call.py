"""Probe: where the host time of a bound cuBLASLt call goes (docs/host-cost.md, cuBLASLt's ctypes
call). For a product with a bias (and an activation, fused in cuBLAS's epilogue or not), the
cuBLASLt kernel of the heuristic's first algorithms, each timed as host us per call over queued
loops (the GPU drained between loops), in alternated rounds, median per item:

- ``F.linear`` and torch's call with its activation, the reference;
- the front path's bound call (``launch.front_entry``), as a served call makes it;
- its parts: the output's and the workspace's ``new_empty``; the ctypes launch with the bias
  pointer; the activation's own launch where cuBLAS's epilogue does not compute it; a ctypes
  call of the library that does nothing (``cublasLtGetVersion``).

    PYTHONPATH=src python3 benchmarks/probes/lt_call.py OUT.json [--shape 12608 3072 768] [--activation gelu]
"""
import argparse
import datetime
import json
import logging
import statistics
import time

import torch
import torch.nn.functional as F

import gemmtune
from gemmtune import activation as activations
from gemmtune import backends
from gemmtune.backends import cublaslt_binding
from gemmtune.backends.launch import front_entry
from gemmtune.device import current
from gemmtune.problem import Problem

CALLS, ROUNDS = 100, 11
log = logging.getLogger("lt_call")


def host_us(fn, calls: int = CALLS) -> float:
    """Host us per call to queue ``calls`` calls of ``fn``, the GPU drained before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def rounds(items: dict) -> dict:
    """Median host us per call of each item over alternated rounds (the order rotating)."""
    samples = {name: [] for name in items}
    names = list(items)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(host_us(items[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


def items_of(kernel, x, w, bias, act: str) -> dict:
    """The calls timed for one cuBLASLt kernel bound to (x, w, bias)."""
    px, pw, pb = x.data_ptr(), w.data_ptr(), bias.data_ptr()
    entry = front_entry(kernel, x, w, bias)
    plan = kernel._plan(x.device.index, x.numel() // x.shape[-1])
    launch, workspace_bytes, _ = plan
    m, n = x.numel() // x.shape[-1], w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    workspace = torch.empty(max(workspace_bytes, 1), device=x.device, dtype=torch.uint8)
    po, pwork = out.data_ptr(), workspace.data_ptr()
    stream = torch.cuda.current_stream().cuda_stream
    version = cublaslt_binding.library().cublasLtGetVersion
    return {
        "bound call": lambda: entry(x, w, bias, px, pw, pb),
        "launch, bias set": lambda: launch(pw, px, po, pwork, workspace_bytes, stream, pb),
        "new_empty out": lambda: x.new_empty((*x.shape[:-1], n)),
        "new_empty workspace": lambda: x.new_empty(workspace_bytes, dtype=torch.uint8),
        "ctypes no-op": version,
        "activation apply": (lambda: activations.apply(out, act)) if act != "none" else version,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--shape", type=int, nargs=3, default=(12608, 3072, 768), metavar=("M", "N", "K"))
    parser.add_argument("--activation", default="gelu", help="none, relu, gelu, gelu_tanh, silu")
    parser.add_argument("--algorithms", type=int, default=3, help="the heuristic's first N (default 3)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    m, n, k = args.shape
    problem = Problem(m, n, k, "bfloat16", "linear", bias=True, activation=args.activation)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    act = args.activation

    def torch_call():
        out = F.linear(x, w, bias)
        return out if act == "none" else activations.apply(out, act, inplace=False)

    backend = backends.get("cublaslt")
    rows = []
    for config in backend.candidates(problem, current())[:args.algorithms]:
        kernel = backend.build(problem, config, current())
        kernel(x, w, bias)
        items = {"F.linear": lambda: F.linear(x, w, bias), "torch with activation": torch_call,
                 **items_of(kernel, x, w, bias, act)}
        rows.append({"config": config.as_dict(), "workspace_bytes": kernel._plan(x.device.index, m)[1],
                     "fused_activation": cublaslt_binding.fused_activation(problem), "host_us": rounds(items)})
        log.info("%s", rows[-1])
    result = {"kind": "lt-call", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "gemmtune": gemmtune.__version__, "date": datetime.date.today().isoformat(),
              "problem": problem.describe(), "calls": CALLS, "rounds": ROUNDS, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
