"""The suite: every shape of a shapes file tuned from an empty store, then cuBLAS, gemmtune's
choice (through the public API) and optionally inductor max-autotune measured side by side in
one process, in interleaved rounds with L2 flushed. Writes the ``suite`` file of RESULTS.md.

    PYTHONPATH=src python3 benchmarks/suite.py --out results.json [--inductor] [--only NAME ...]

GPU only: on a machine without one, use ``gemmtune tune`` (the interpreter pipeline) instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Cold caches, set before torch and triton are imported (both read these at import): tune_s is
# then gemmtune's time from an empty compile cache, and inductor tunes from scratch.
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-suite-triton-"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-suite-inductor-"))
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402
import triton  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune import backends, shapes  # noqa: E402
from gemmtune.tuning import measure, verify
from gemmtune.cli import bench
from gemmtune.device import current  # noqa: E402
from gemmtune.serving.dispatch import DISPATCHER  # noqa: E402
from gemmtune.search import STRATEGIES  # noqa: E402
from gemmtune.store import Store  # noqa: E402
from gemmtune.tuning.tuner import TuneOptions, tune_problem  # noqa: E402
from gemmtune.tuning.worker import IsolatedRunner  # noqa: E402

ROOT = Path(__file__).resolve().parent


def copy_tbps() -> float:
    """Device-to-device copy bandwidth, bytes read plus written, median of 20 copies of 1 GiB
    made by a kernel (torch.neg into a second buffer). Not ``copy_``: captured in a CUDA graph
    it becomes a memcpy node that the copy engines run, at 2.70 TB/s on the H200 against
    4.22 TB/s for the kernel and 4.20 for an eager ``copy_`` (NOTES, step 14)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    until = time.perf_counter() + 0.5
    while time.perf_counter() < until:  # out of idle clocks first (a cold card read 35% low)
        torch.neg(src, out=dst)
        torch.cuda.synchronize()
    timing = measure.measure({"copy": lambda: torch.neg(src, out=dst)}, current(), min_rounds=20)["copy"]
    return 2 * src.numel() * 4 / (timing.median * 1e-3) / 1e12


def read_tbps() -> float:
    """Read-only bandwidth: a sum over 1 GiB of bf16, the bytes a weight stream moves."""
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    timing = measure.measure({"sum": lambda: x.sum()}, current(), min_rounds=20)["sum"]
    return x.numel() * 2 / (timing.median * 1e-3) / 1e12


def operands(named, inputs):
    """torch's call (cuBLAS) and gemmtune's through its public API, on ``inputs``."""
    p = named.problem
    a, b, bias = inputs.a, inputs.b, inputs.bias
    if p.scaled:  # torch._scaled_mm's operands: b (K, N) and its scales in that orientation
        sa, sb = inputs.scales
        sb = sb.t() if sb.dim() == 2 else sb
        act = None if p.activation == "none" else p.activation
        out_dtype = verify.TORCH_DTYPES[p.out_dtype]
        return bench.torch_call(named, inputs), (lambda: gemmtune.scaled_mm(a, b.t(), sa, sb, bias, out_dtype, act))
    if p.layout == "linear":
        act = None if p.activation == "none" else p.activation
        return bench.torch_call(named, inputs), (lambda: gemmtune.linear(a, b, bias, act))
    if bias is None and p.activation == "none":
        return bench.torch_call(named, inputs), (lambda: gemmtune.matmul(a, b))
    raise ValueError(f"{named.name}: the suite times an epilogue only for layout linear")


def bound(result, problem, inputs):
    """The kernel a TuneResult chose (or a Trial measured), built directly, as a zero-argument call
    on ``inputs``."""
    kernel = backends.build(problem, result.backend, result.config, current())
    return lambda: kernel(*inputs.operands)


def run_shape(named, args, runner) -> dict:
    p = named.problem
    t0 = time.perf_counter()
    result = tune_problem(p, current(), options=args.options, runner=runner)
    tune_wall = time.perf_counter() - t0
    Store().put(result)  # what gemmtune.linear / matmul below will find
    warm = tune_problem(p, current(), options=args.options, runner=runner).tune_s if args.warm else None
    DISPATCHER.forget()
    inputs = verify.make_inputs(p, "cuda")
    cublas_fn, gemmtune_fn = operands(named, inputs)
    out = gemmtune_fn()
    fns = {"gemmtune": gemmtune_fn}
    refused = bench.refusal(cublas_fn)
    if refused is None:
        fns["cublas"] = cublas_fn
    if p.scaled:  # the bf16 GEMM the fp8 one replaces (issue 32's decode goals are against it)
        fns["unscaled"] = bench.unscaled_call(p, inputs)
    exhaustive = None
    if args.exhaustive:  # the best of the whole space, timed in the same rounds as the choice
        exhaustive = tune_problem(p, current(), options=dataclasses.replace(args.options, strategy="exhaustive"),
                                  runner=runner)
        fns["exhaustive"] = bound(exhaustive, p, inputs)
    timings = measure.measure(fns, current(), budget_ms=args.budget_ms, min_rounds=args.rounds)
    inductor_ms = inductor_s = inductor_cublas_ms = None
    if args.inductor:
        # Its own rounds beside cuBLAS, after gemmtune's: with the compiled wrapper in the same
        # rounds, the other two read tens of microseconds slow on small shapes (seen on an H200).
        compiled, inductor_s = bench.compiled(cublas_fn)
        paired = measure.measure({"cublas": cublas_fn, "inductor": compiled}, current(),
                               budget_ms=args.budget_ms / 2, min_rounds=args.rounds // 2)
        inductor_ms, inductor_cublas_ms = paired["inductor"].median, paired["cublas"].median
    verdict = verify.judge(out, p, inputs)
    rel = verdict.rel_err
    row = {
        "name": named.name, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype, "tf32": p.tf32,
        "layout": p.layout, "group": named.group, "scaling": p.scaling, "out_dtype": p.out_dtype,
        "unscaled_ms": timings["unscaled"].median if p.scaled else None,
        "cublas_ms": timings["cublas"].median if refused is None else None, "cublas_refused": refused,
        "gemmtune_ms": timings["gemmtune"].median,
        "speedup": timings["cublas"].median / timings["gemmtune"].median if refused is None else None,
        "cublas_spread": timings["cublas"].spread if refused is None else None,
        "gemmtune_spread": timings["gemmtune"].spread,
        "choice": result.label(), "rel_err": rel, "verified": verdict.ok,
        "tune_s": result.tune_s, "tune_wall_s": tune_wall, "tune_s_warm": warm,
        "exhaustive_ms": timings["exhaustive"].median if exhaustive else None,
        "exhaustive_choice": exhaustive.label() if exhaustive else None,
        "exhaustive_tune_s": exhaustive.tune_s if exhaustive else None,
        # did the default strategy measure the exhaustive winner at all (the cost model's recall)?
        "exhaustive_in_topk": exhaustive.label() in {t.label() for t in result.trials} if exhaustive else None,
        "candidates": len(result.trials), "failed": sum(not t.ok for t in result.trials),
        "tflops": p.flops / (timings["gemmtune"].median * 1e-3) / 1e12,
        "tbps": p.min_bytes / (timings["gemmtune"].median * 1e-3) / 1e12,
        "inductor_ms": inductor_ms, "inductor_tune_s": inductor_s, "inductor_cublas_ms": inductor_cublas_ms,
        "best_by_backend": best_by_backend(result.trials),
        # why the default chose what it did: each verified trial's time, its round, its ratio to
        # cuBLAS in its own screening rounds where it was paired with cuBLAS
        "trials": [[t.label(), t.median_ms, "final" if t.final else "screening", t.vs_reference]
                   for t in sorted((t for t in result.trials if t.ok), key=lambda t: t.median_ms)],
        "final_vs_cublas": final_ratios(result.trials),
    }
    return row


def final_ratios(trials) -> dict:
    """Each finalist's time over cuBLAS's in the final rounds: [median of the per-round ratios,
    their half inter-quartile range (what selection reads as noise), rounds]."""
    reference = next((t for t in trials if t.ok and t.final and t.backend == backends.REFERENCE), None)
    if reference is None:
        return {}
    paired = {t.label(): t.timing.per_round(reference.timing) for t in trials if t.ok and t.final}
    return {label: [ratios.median, ratios.spread, len(ratios.samples)]
            for label, ratios in paired.items() if ratios is not None}


def best_by_backend(trials) -> dict:
    """Each backend's fastest measured trial (what the kernels of a family reach on this shape)
    with its spread, how many of its trials failed (with their first reason), and the round its
    time comes from: "final" (beside cuBLAS in the same rounds, so ``vs_cublas`` and
    ``noise_vs_cublas`` are what selection compared) or "screening" (its own short measurement:
    no ratio is given, since cuBLAS's time here is a final one). A backend's finalist is
    preferred to a faster screening time, so like is compared with like."""
    reference = next((t for t in trials if t.ok and t.final and t.backend == backends.REFERENCE), None)
    best = {}
    for t in trials:
        entry = best.setdefault(t.backend, {"ms": None, "config": None, "failed": 0, "reason": "", "round": None})
        if not t.ok:
            entry["failed"] += 1
            entry["reason"] = entry["reason"] or f"{t.status.value}: {t.reason}"[:200]
            continue
        better = entry["ms"] is None or (t.final, -t.median_ms) > (entry["round"] == "final", -entry["ms"])
        if better:
            paired = t.final and reference is not None
            entry.update(ms=t.median_ms, config=t.label(), spread=t.timing.spread,
                         round="final" if t.final else "screening",
                         vs_cublas=reference.median_ms / t.median_ms if paired else None,
                         noise_vs_cublas=t.timing.spread_against(reference.timing) if paired else None)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=Path, default=ROOT / "shapes" / "public.json")
    parser.add_argument("--out", type=Path, required=True, help="suite JSON to write (rewritten after each shape)")
    parser.add_argument("--only", nargs="*", default=None, help="names of shapes to run")
    parser.add_argument("--inductor", action="store_true", help="also torch.compile(mode='max-autotune-no-cudagraphs')")
    parser.add_argument("--warm", action="store_true", help="tune each shape a second time for tune_s_warm")
    parser.add_argument("--exhaustive", action="store_true",
                        help="also tune with strategy exhaustive and time its choice beside gemmtune's (exhaustive_ms)")
    parser.add_argument("--rounds", type=int, default=50, help="minimum interleaved rounds per shape")
    parser.add_argument("--budget-ms", type=float, default=1500.0, help="time budget of the side-by-side rounds")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="stop starting new shapes after this long")
    parser.add_argument("--strategy", default="topk", choices=STRATEGIES, help="gemmtune's search strategy")
    parser.add_argument("--resume", type=Path, default=None,
                        help="a partial suite file from this device: its rows are kept and their shapes skipped "
                             "(a run split over several processes, each under a time limit)")
    args = parser.parse_args()
    args.options = TuneOptions(strategy=args.strategy)
    if not torch.cuda.is_available():
        print("suite.py needs a CUDA GPU; without one run `gemmtune tune` (interpreter pipeline)", file=sys.stderr)
        return 2
    os.environ.setdefault("GEMMTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="gemmtune-suite-"))  # an empty store
    torch.set_float32_matmul_precision("high")  # fp32 shapes as the seeds advise: TF32 for both sides
    started = time.perf_counter()
    device = current()
    named = [n for n in shapes.load(args.shapes, tf32=True) if args.only is None or n.name in args.only]
    doc = {
        "kind": "suite", "device": device.name, "sm_count": device.sm_count, "torch": torch.__version__,
        "triton": triton.__version__, "gemmtune": gemmtune.__version__, "date": datetime.date.today().isoformat(),
        "shapes_file": str(args.shapes.relative_to(ROOT.parent)) if args.shapes.is_relative_to(ROOT.parent) else str(args.shapes),
        "copy_tbps": copy_tbps(), "read_tbps": read_tbps(), "float32_matmul_precision": "high", "strategy": args.strategy, "rows": [],
    }
    if args.resume is not None:
        earlier = json.loads(args.resume.read_text())
        if (earlier.get("device"), earlier.get("sm_count")) != (device.name, device.sm_count):
            print(f"--resume {args.resume}: measured on {earlier.get('device')} with {earlier.get('sm_count')} SMs, "
                  f"not this {device.name} with {device.sm_count}", file=sys.stderr)
            return 2
        doc["rows"] = earlier["rows"]
        doc["processes"] = earlier.get("processes", 1) + 1
        done = {row["name"] for row in doc["rows"]}
        named = [item for item in named if item.name not in done]
    runner = IsolatedRunner(device)  # one worker for the run: a faulty candidate costs a trial, not the suite
    for item in named:
        if time.perf_counter() - started > args.deadline_s:
            print(f"deadline reached; skipping {item.name}", flush=True)
            continue
        with torch.no_grad():  # compile and time under the same grad mode: no recompiles mid-run
            row = run_shape(item, args, runner)
        if row["group"] == "decode":  # the weights' read rate against the device's, measured above
            p = item.problem
            row["weight_tbps"] = p.n * p.k * p.element_size / (row["gemmtune_ms"] * 1e-3) / 1e12
            row["weight_of_copy"] = row["weight_tbps"] / doc["copy_tbps"]
            row["weight_of_read"] = row["weight_tbps"] / doc["read_tbps"]
        doc["rows"].append(row)
        args.out.write_text(json.dumps(doc, indent=1))
        ind = f" inductor {row['inductor_ms']:.4f} ms ({row['inductor_tune_s']:.1f} s)" if row["inductor_ms"] else ""
        warm = f" warm {row['tune_s_warm']:.2f}s" if row["tune_s_warm"] is not None else ""
        ex = f" exhaustive {row['exhaustive_ms']:.4f} ({row['exhaustive_tune_s']:.1f} s)" if row["exhaustive_ms"] else ""
        if row["unscaled_ms"]:
            ex += f" vs {row['out_dtype']} x{row['unscaled_ms'] / row['gemmtune_ms']:.3f}"
        theirs = f"cublas {row['cublas_ms']:.4f}" if row["cublas_ms"] else "cublas refused"
        ratio = f"x{row['speedup']:.3f}" if row["speedup"] else "x-"
        print(f"{item.name:24s} {theirs} gemmtune {row['gemmtune_ms']:.4f} {ratio} tune {row['tune_s']:.1f}s{warm} {row['choice']} err {row['rel_err']:.1e}"
              f"{ex}{ind}", flush=True)
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
