"""Where a cold process's compile phase goes: each stage of each candidate's compile, per thread,
for the seeds' MLP (its two GEMMs, one shape with two epilogues), as ``tuner.compile_batch`` runs
them. Wraps Triton 3.6's compile stages and its C builds (the driver's utilities, each kernel's
launcher) with timers; run it with an empty TRITON_CACHE_DIR.

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python3 benchmarks/compile_phases.py [float32]

GPU only. (NOTES, step 18.)
"""

from __future__ import annotations

import collections
import sys
import threading
import time

import torch
import triton.compiler
import triton.compiler.compiler
from triton.backends.nvidia import compiler as nvidia_compiler
from triton.backends.nvidia import driver as nvidia_driver

START = time.perf_counter()
EVENTS: list[tuple[str, str, float, float]] = []  # thread, what, start, end (seconds from START)


def timed(owner, name: str, label: str, static: bool = False) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        began = time.perf_counter() - START
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((threading.current_thread().name, label, began, time.perf_counter() - START))

    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def main() -> int:
    for stage in ("make_ttir", "make_ttgir"):
        timed(nvidia_compiler.CUDABackend, stage, stage, static=True)
    for stage in ("make_llir", "make_ptx", "make_cubin"):
        timed(nvidia_compiler.CUDABackend, stage, stage)
    timed(nvidia_driver, "compile_module_from_src", "C build")
    timed(triton.compiler.compiler, "compile", "compile")
    triton.compiler.compile = triton.compiler.compiler.compile  # the name the JIT imports

    from gemmtune.tuning import tuner
    from gemmtune.device import current
    from gemmtune.problem import Problem

    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    problems = [Problem(256, 1024, 1024, dtype, "linear", bias=True, activation="relu"),
                Problem(256, 1024, 1024, dtype, "linear", bias=True)]
    began = time.perf_counter()
    tuner.compile_batch(problems, current())
    print(f"{dtype}: compile_batch {time.perf_counter() - began:.2f} s, from {began - START:.2f} s")
    spans = collections.defaultdict(list)
    for _, label, start, end in EVENTS:
        spans[label].append(end - start)
    for label, seconds in spans.items():
        print(f"  {label:10s} n={len(seconds):2d} mean {sum(seconds) / len(seconds):.3f} max {max(seconds):.3f} "
              f"sum {sum(seconds):.2f}")
    for thread, label, start, end in sorted(EVENTS, key=lambda e: e[2]):
        if label in ("compile", "C build"):
            print(f"  {thread:22s} {label:8s} {start:6.2f} -> {end:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
